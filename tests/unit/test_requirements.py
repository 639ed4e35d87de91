"""The run-time requirements pin what the tests ran on where behaviour differs between releases."""
from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("package", ["streamlit", "torch"])
def test_requirements_pin_the_tested_release(package):
    lines = [ln.split("#")[0].strip() for ln in (ROOT / "requirements.txt").read_text().splitlines()]
    (pin,) = [ln for ln in lines if re.match(rf"{package}\b", ln)]
    assert re.fullmatch(rf"{package}==[\w.]+", pin), f"{package} must be pinned exactly, got {pin!r}"
    assert pin.split("==")[1] == version(package).split("+")[0]      # the release these tests run on
