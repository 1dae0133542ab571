"""`report DIR`: summary tables of a recording."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rp = sub.add_parser("report", help="summary tables of a recording")
    rp.add_argument("recording", type=Path)
    rp.add_argument(
        "--anomalies",
        action="store_true",
        help="also list what the anomaly detectors find (repetition loops, log-prob collapse, routing "
        "collapse and jumps, sparsity spikes, attention-coverage collapse, slow steps, load imbalance)",
    )
    rp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sparseety_prof.views.report import print_report

    print_report(args.recording, anomalies=args.anomalies)
    return 0
