"""``python -m differential --seed S --trials N`` (with ``tests/`` on ``PYTHONPATH``; ``make fuzz SEED=S TRIALS=N``):
draw N cases from seed S, run each, shrink each difference and print its reproducer. Exit status 1 if any differed."""

from __future__ import annotations

import argparse
import sys

from .fuzz import campaign


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m differential", description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--families", default="", help="comma-separated families (default: every one)")
    parser.add_argument("--max-requests", type=int, default=8, help="most requests per phase")
    parser.add_argument("--findings", default="", help="append each shrunk finding (markdown) to this file")
    parser.add_argument("--no-shrink", action="store_true")
    args = parser.parse_args(argv)
    report = campaign(args.seed, args.trials, families=[f for f in args.families.split(",") if f] or None,
                      max_requests=args.max_requests, findings_path=args.findings or None,
                      shrink_cases=not args.no_shrink, log=print)
    print(report.summary())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
