"""python -m sparseety_prof.synthetic: write generated GGUF models from the command line.

python -m sparseety_prof.synthetic OUT.gguf --preset moe [--seed N] [--dtype f32|f16|q8_0|q4_0]
                                   [--prune N:M|FRACTION]
python -m sparseety_prof.synthetic --all DIR          # DIR/<preset>.gguf for every preset
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from sparseety_prof.synthetic.models import make_all, make_model
from sparseety_prof.synthetic.presets import DTYPES, PRESETS
from sparseety_prof.synthetic.prune import Prune, parse_prune


def _prune_arg(text: str) -> Prune:
    try:
        pr = parse_prune(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    assert pr is not None
    return pr


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Write deterministic random-weight GGUF test models (llama.cpp).",
        epilog="presets: " + "; ".join(f"{k}: {v.description}" for k, v in PRESETS.items()),
    )
    ap.add_argument("out", nargs="?", help="output .gguf path (single-model mode)")
    ap.add_argument("--preset", choices=list(PRESETS), help="model preset (single-model mode)")
    ap.add_argument("--all", metavar="DIR", dest="all_dir", help="write every preset as DIR/<preset>.gguf")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="weight type (default: the preset's); q8_0/q4_0 quantize the weight matrices, while "
        "norms and the MoE router stay f32",
    )
    ap.add_argument(
        "--prune",
        type=_prune_arg,
        default=None,
        metavar="N:M|FRACTION",
        help="zero part of the FFN weights (ffn_gate/up/down and their *_exps), per row (ne0), before "
        "any quantization: N:M keeps the N largest magnitudes of every M consecutive values (e.g. "
        "2:4; 1 <= N < M, M divides the row); a fraction 0 < f < 1 zeroes the round(f * row) "
        "smallest magnitudes of each row (e.g. 0.5). The zeros are exact, also after q8_0/q4_0",
    )
    ap.add_argument("--n-vocab-min", type=int, default=None, help="pad the vocab to at least this size")
    a = ap.parse_args(argv)

    if a.all_dir is not None:
        if a.out is not None or a.preset is not None or a.n_vocab_min is not None:
            ap.error("--all takes no OUT, --preset or --n-vocab-min")
        try:
            make_all(a.all_dir, seed=a.seed, dtype=a.dtype, log=sys.stdout, prune=a.prune)
        except ValueError as e:  # e.g. a prune group size that does not divide a preset's rows
            ap.error(str(e))
        return 0
    if a.out is None or a.preset is None:
        ap.error("give OUT.gguf --preset NAME, or --all DIR")
    t0 = time.perf_counter()
    try:
        path = make_model(
            a.out, a.preset, seed=a.seed, dtype=a.dtype, n_vocab_min=a.n_vocab_min, prune=a.prune
        )
    except ValueError as e:
        ap.error(str(e))
    size_mb = path.stat().st_size / 1e6
    print(f"{a.preset}: wrote {path} ({size_mb:.1f} MB, {time.perf_counter() - t0:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
