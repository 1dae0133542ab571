"""`report DIR`: summary tables of a recording."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rp = sub.add_parser("report", help="summary tables of a recording")
    rp.add_argument("recording", type=Path)
    rp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sparseety_prof.views.report import print_report

    print_report(args.recording)
    return 0
