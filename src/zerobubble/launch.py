"""``python -m zerobubble.launch -n P script.py [args...]``: run a script as P local ranks.

Like ``torchrun --standalone --nproc-per-node P`` with a stricter failure policy:
the first failing rank's exit code is the job's, the other ranks are stopped
after a grace period, and nothing outlives the launcher.
"""

from __future__ import annotations

import argparse
import sys

from zerobubble.runtime.launcher import run_script


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zerobubble.launch",
        description="Run a script as P local pipeline ranks (torchrun-style environment).",
    )
    parser.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks (P)")
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="overall limit in seconds (exit 124)"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds the other ranks get to fail on their own after the first failure",
    )
    parser.add_argument("script", help="the Python script every rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    if ns.nprocs < 1:
        parser.error(f"-n must be >= 1, got {ns.nprocs}")
    return run_script(ns.script, ns.args, ns.nprocs, timeout=ns.timeout, grace=ns.grace)


if __name__ == "__main__":
    sys.exit(main())
