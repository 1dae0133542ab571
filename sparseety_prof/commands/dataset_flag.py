"""`record/attach --dataset DEST`: the recording, once closed, is collected into the dataset DEST
(as `collect DIR DEST` would), so a fleet of recorders fills one dataset without a separate
step. The recording directory stays where -o put it: the dataset is a copy in its own layout.
DEST is checked with -o before anything is attached (session/output_checks.py), and the recording
collected by `collect`'s own code (the command's Frontend)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_dataset_flag(p: argparse._ActionsContainer) -> None:
    p.add_argument(
        "--dataset",
        type=Path,
        default=None,
        metavar="DEST",
        help="when the recording closes, collect it into the Parquet dataset DEST (see `collect`)",
    )
