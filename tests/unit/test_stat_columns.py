"""The statistics columns' one definition (engine.inspection.stat_columns): pooling rows of per-position
statistics equals the statistics of the raw values put together (hand computation with torch over the raw
tensors), NaN rows are counted and left out of the moments, and nothing else defines the columns."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from engine.inspection.reference_stats import dense_stats
from engine.inspection.stat_columns import STAT_NAMES, Col, nonfinite, pool

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_columns_are_named_once_in_forward_order():
    assert STAT_NAMES == ("min", "max", "mean", "std", "absmax", "nan", "inf")
    assert [STAT_NAMES[c] for c in (Col.MIN, Col.ABSMAX, Col.INF)] == ["min", "absmax", "inf"]


def test_pooling_equals_the_statistics_of_the_raw_values():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 64, generator=g) * 3 + 1, torch.randn(2, 64, generator=g) - 2      # 7 positions, 2 calls
    rows_a, rows_b = dense_stats(a), dense_stats(b)                                          # (T, 7) each
    p = pool([(["s"], rows_a[None]), (["s", "t"], torch.stack([rows_b, rows_b]))])
    raw = torch.cat([a, b]).double()
    assert p.names == ["s", "t"] and p.positions.tolist() == [7, 2]
    assert p.cols["mean"][0] == pytest.approx(float(raw.mean()), rel=1e-5)
    assert p.cols["std"][0] == pytest.approx(float(raw.std(unbiased=False)), rel=1e-5)
    assert p.cols["rms"][0] == pytest.approx(float(raw.square().mean().sqrt()), rel=1e-5)
    assert p.cols["min"][0] == pytest.approx(float(raw.min())) and p.cols["max"][0] == pytest.approx(float(raw.max()))
    assert p.cols["absmax"][0] == pytest.approx(float(raw.abs().max()))


def test_a_nan_row_is_counted_and_left_out_of_the_moments():
    x = torch.randn(3, 16)
    x[1] = math.nan                     # a position holding only NaN: no mean or std to pool
    rows = dense_stats(x)
    assert nonfinite(rows).tolist() == [False, True, False]
    p = pool([(["s"], rows[None])])
    kept = torch.cat([x[0], x[2]]).double()
    assert int(p.cols["nan"][0]) == 16 and int(p.cols["inf"][0]) == 0
    assert p.cols["mean"][0] == pytest.approx(float(kept.mean()), rel=1e-5)
    assert p.cols["std"][0] == pytest.approx(float(kept.std(unbiased=False)), rel=1e-5)


def test_nothing_else_defines_the_columns():
    pattern = re.compile(r"^\s*(STAT_NAMES\s*=|COL\s*=\s*\{|[A-Z, ]*NAN[A-Z, ]*=\s*\d)", re.M)
    hits = [str(p.relative_to(ROOT)) for d in ("engine", "inspector", "pages") for p in (ROOT / d).rglob("*.py")
            if pattern.search(p.read_text()) and p.name != "stat_columns.py"]
    assert hits == []
