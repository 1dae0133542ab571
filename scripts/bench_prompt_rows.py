"""What a prompt's per-row sparse values cost the consumer: row by row (StepSparse.row_values) and
all rows at once (StepSparse.fill_rows), on synthetic probe records shaped like the `bench` model
of sparseety_prof/synthetic (8 MoE layers, top-2, activation counts for 2 expert slots per token).
The crossing point is step_sparse.FILL_ROWS_MIN.

    .venv/bin/python scripts/bench_prompt_rows.py [--rows 4 8 12 16 32 64] [--layers 8] [--repeat 30]

Prints, per prompt length, the best of --repeat runs of each way, in microseconds per step.
No root, no engine: pure consumer code.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from test_sparse import _tensor as tensor_record  # noqa: E402  (a routing tensor's probe record)

from sparseety_prof.capture import events as ev  # noqa: E402
from sparseety_prof.capture.plans import LayerSet  # noqa: E402
from sparseety_prof.correlate.step_sparse import FILL_ROWS_MIN, Problems, StepSparse  # noqa: E402


def prompt_step(n: int, n_layers: int, rng: np.random.Generator) -> StepSparse:
    """A prompt pass of n rows: every MoE layer's ids and weights, every FFN layer's counts."""
    sp = StepSparse()
    for layer in range(n_layers):
        ids = rng.integers(0, 8, (n, 2)).astype(np.int32)
        sp.add_tensor(tensor_record(b"ffn_moe_weights-%d" % layer, ev.TAG_EXPERT_IDS, ids, stride_vals=8))
        wts = rng.random((n, 2)).astype(np.float32)
        sp.add_tensor(tensor_record(b"ffn_moe_weighted-%d" % layer, ev.TAG_EXPERT_WEIGHTS, wts))
        nr = n * 2  # 2 expert slots per token
        for ir0 in range(0, nr, ev.ACT_MAX_ROWS):
            k = min(ev.ACT_MAX_ROWS, nr - ir0)
            counts = [*rng.integers(0, 50, k).tolist(), *[0] * (ev.ACT_MAX_ROWS - k)]
            rec = {"name": b"ffn_moe_reglu-%d" % layer, "ne0": 64, "ne1": 2, "nr_total": nr}
            sp.add_act({**rec, "ir0": ir0, "n_rows": k, "zeros": counts, "below": counts}, with_bits=False)
    return sp


def best_us(fn: Callable[[], None], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def fresh(sp: StepSparse) -> StepSparse:
    """The step as the correlator has it when its rows are first asked for."""
    s = copy.copy(sp)
    s._row_cache = {}
    return s


def row_by_row(sp: StepSparse, n: int, layers: LayerSet) -> None:
    s = fresh(sp)
    for b in range(n):
        s.row_values(b, {n - 1: 0}, n, layers, Problems())  # the last row produces logits


def at_once(sp: StepSparse, n: int, layers: LayerSet) -> None:
    s = fresh(sp)
    # the method itself, whatever the threshold: what it costs at this length
    s.fill_rows(list(range(n)), {n - 1: 0}, n, layers, Problems(), min_rows=2)
    for b in range(n):
        s.row_values(b, {n - 1: 0}, n, layers, Problems())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 8, 12, 16, 32, 64])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=30)
    a = ap.parse_args()
    layers = LayerSet(moe=tuple(range(a.layers)), ffn=tuple(range(a.layers)), attn=())
    rng = np.random.default_rng(0)
    print(f"per step, {a.layers} MoE layers (best of {a.repeat}; fill_rows from {FILL_ROWS_MIN} rows)")
    print("| prompt rows | row by row | all at once |")
    print("| --- | --- | --- |")
    for n in a.rows:
        sp = prompt_step(n, a.layers, rng)
        ways = [lambda s=sp, n=n: row_by_row(s, n, layers), lambda s=sp, n=n: at_once(s, n, layers)]
        took = [best_us(way, a.repeat) for way in ways]
        print(f"| {n} | {took[0]:.0f} µs | {took[1]:.0f} µs |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
