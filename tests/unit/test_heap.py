"""A server gives freed tensors back to the system (engine.heap): measured in a fresh process, the
resident memory after 40 freed 2 MiB tensors (with small live blocks between them), without and with a trim."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys, psutil, torch
from engine.heap import trim
P = psutil.Process()
torch.empty(2 << 20, dtype=torch.uint8).fill_(1)   # one freed 2 MiB block: glibc raises its mmap threshold
base = P.memory_info().rss
big, small = [], []
for _ in range(40):
    big.append(torch.ones(2 << 20, dtype=torch.uint8))
    small.append(torch.ones(1000))                  # live blocks between them
del big
if sys.argv[1] == "trim":
    trim()
print((P.memory_info().rss - base) / 2**20)
"""


def _kept_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_tensors_go_back_to_the_system():
    assert _kept_mib("default") > 40          # the control: glibc keeps most of the 80 MiB in its heap
    assert _kept_mib("trim") < 8              # after a trim (the app's, after a run or a drop): nearly none


def test_a_session_s_counted_data_fills_a_fixed_share_of_its_budget():
    from inspector.session.budget import DATA_SHARE, data_allowance
    assert 0 < DATA_SHARE < 1
    assert data_allowance(64) == int(64 * 2**20 * DATA_SHARE) < 64 * 2**20
