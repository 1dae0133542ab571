"""`record/attach --dataset DEST`: the recording, once closed, is collected into the dataset DEST
(as `collect DIR DEST` would), so a fleet of recorders fills one dataset without a separate
step. The recording directory stays where -o put it: the dataset is a copy in its own layout."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from sparseety_prof.errors import UsageError

if TYPE_CHECKING:
    from sparseety_prof.session.options import Options


def add_dataset_flag(p: argparse._ActionsContainer) -> None:
    p.add_argument(
        "--dataset",
        type=Path,
        default=None,
        metavar="DEST",
        help="when the recording closes, collect it into the Parquet dataset DEST (see `collect`)",
    )


def check_dataset_flag(opts: Options) -> None:
    """Refuse --dataset without a recording to collect, or with a DEST `collect` would refuse,
    before anything is attached."""
    dataset = opts.outputs.dataset
    if dataset is None:
        return
    if opts.out is None:
        raise UsageError("--dataset collects the recording: give the recording's directory with -o as well")
    from sparseety_prof.store.dataset import MANIFEST
    from sparseety_prof.store.dataset_dir import check_dest
    from sparseety_prof.store.output_dir import sudo_owner

    check_dest(dataset, MANIFEST, sudo_owner())


def collect_recording(opts: Options) -> int:
    """Collect the closed recording into --dataset DEST (0 when none was asked for)."""
    if opts.outputs.dataset is None or opts.out is None:
        return 0
    from sparseety_prof.commands.collect import collect_into

    return collect_into([opts.out], opts.outputs.dataset)
