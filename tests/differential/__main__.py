"""``python -m differential --seed S --trials N`` (with ``tests/`` on ``PYTHONPATH``; ``make fuzz SEED=S TRIALS=N``):
draw N cases from seed S, run each, shrink each difference and print its reproducer. Exit status 1 if any differed."""

from __future__ import annotations

import argparse
import sys

from .fuzz import campaign
from .run import Runner


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m differential", description=__doc__)
    parser.add_argument("--seed", default="0", help="a seed, or several comma-separated (one campaign each)")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--families", default="", help="comma-separated families (default: every one)")
    parser.add_argument("--max-requests", type=int, default=8, help="most requests per phase")
    parser.add_argument("--findings", default="", help="append each shrunk finding (markdown) to this file")
    parser.add_argument("--no-shrink", action="store_true")
    parser.add_argument("--minutes", type=float, default=None, help="draw no new case after this long")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seed.split(",") if s]
    runner, failures, requests = Runner(), 0, 0
    for seed in seeds:
        report = campaign(seed, args.trials, families=[f for f in args.families.split(",") if f] or None,
                          max_requests=args.max_requests, findings_path=args.findings or None,
                          shrink_cases=not args.no_shrink, log=print, runner=runner,
                          minutes=args.minutes / len(seeds) if args.minutes else None)
        print(report.summary(), flush=True)
        failures += len(report.failures)
        requests += report.requests
    if len(seeds) > 1:
        print(f"all seeds: {requests} requests, {failures} cases differing")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
