"""Fuzz kvcli's command line (kvcli/testing/fuzz.py): N random cases from a seed, a report of how each ended.

    python benchmarks/fuzz.py --cases 1000 --seed 1 --jobs 2 --report fuzz-report.json --log fuzz.jsonl

Exit code 1 when a case ended in an internal error, a crash or a hang; the report lists each with its command.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcli.testing import fuzz  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a case counts as a hang")
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once")
    ap.add_argument("--report", default=None, help="write the JSON report here")
    ap.add_argument("--log", default=None, help="append one JSON line per finished case here")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvcli-fuzz-") as d:
        report = fuzz.run(a.seed, a.cases, Path(d), timeout=a.timeout, jobs=a.jobs, jsonl=a.log,
                          log=None if a.quiet else lambda m: print(m, file=sys.stderr, flush=True))
    if a.report:
        fuzz.dump(report, a.report)
    print(fuzz.format_report(report))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
