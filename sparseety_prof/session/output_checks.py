"""The places a `record`/`attach` run writes to, checked once before anything is attached: -o
(a new or empty directory, or, with --follow, one this follower made) and --dataset's DEST (one
`collect` would accept). Each check is the one of the layer that later opens the place."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparseety_prof.errors import UsageError
from sparseety_prof.store.output_dir import sudo_owner

if TYPE_CHECKING:
    from sparseety_prof.session.options import Options


def check_outputs(opts: Options) -> None:
    """UsageError for an -o or a --dataset DEST the run could not write to; creates nothing."""
    if opts.out is not None and opts.follow is not None:
        from sparseety_prof.session.follow_dir import check_follow_output

        # a new or empty directory, or one this follower made (a service manager restarted it)
        check_follow_output(opts.out, opts.follow.to_meta(), sudo_owner())
    elif opts.out is not None:
        from sparseety_prof.store.output_dir import check_output_path
        from sparseety_prof.store.recording import META_FILE

        check_output_path(opts.out, META_FILE, sudo_owner())
    dataset = opts.outputs.dataset
    if dataset is None:
        return
    if opts.out is None:
        raise UsageError("--dataset collects the recording: give the recording's directory with -o as well")
    from sparseety_prof.store.dataset import MANIFEST
    from sparseety_prof.store.dataset_dir import check_dest

    check_dest(dataset, MANIFEST, sudo_owner())
