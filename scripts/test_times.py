"""The README's test-time table from one run of the suite:

    LLM_INSPECTOR_TEST_TIMES=/tmp/times.tsv python3 -m pytest -q --durations=0
    python3 scripts/test_times.py /tmp/times.tsv [--top 25]

Each tier's tests and seconds (setup + call + teardown of its tests, without their waits for their turns: tests/
alone.py; a shared server or model is counted in the first test that asks for it), then the slowest tests. The tier
is the test's marker (tests/conftest.py). Last, each worker's seconds in tests and in waits for a turn, and the span
from the first phase's start to the last one's end."""
from __future__ import annotations

import argparse
import collections


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("times", help="the file $LLM_INSPECTOR_TEST_TIMES named during the run")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    seconds: dict[str, float] = collections.defaultdict(float)
    tier_of: dict[str, str] = {}
    busy: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    first, last = float("inf"), 0.0
    for line in open(a.times, encoding="utf-8"):
        tier, _when, took, _outcome, start, waited, worker, nodeid = line.rstrip("\n").split("\t", 7)
        seconds[nodeid] += float(took)
        tier_of[nodeid] = tier
        busy[worker][0] += float(took)
        busy[worker][1] += float(waited)
        first, last = min(first, float(start)), max(last, float(start) + float(waited) + float(took))
    per_tier: dict[str, list[float]] = collections.defaultdict(list)
    for nodeid, s in seconds.items():
        per_tier[tier_of[nodeid]].append(s)
    print("| tier | tests | seconds | minutes |\n|---|---:|---:|---:|")
    for tier, xs in sorted(per_tier.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {tier} | {len(xs)} | {sum(xs):.0f} | {sum(xs) / 60:.1f} |")
    total = sum(seconds.values())
    print(f"| all | {len(seconds)} | {total:.0f} | {total / 60:.1f} |\n")
    print("| # | seconds | tier | test |\n|---:|---:|---|---|")
    for k, (nodeid, s) in enumerate(sorted(seconds.items(), key=lambda kv: -kv[1])[:a.top], 1):
        print(f"| {k} | {s:.1f} | {tier_of[nodeid]} | `{nodeid}` |")
    workers = [f"{w}: {b:.0f} s in tests, {wt:.0f} s waiting for a turn" for w, (b, wt) in sorted(busy.items())]
    print("\n" + "; ".join(workers) + f"; span {last - first:.0f} s")


if __name__ == "__main__":
    main()
