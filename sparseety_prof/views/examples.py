"""Analysis examples with Polars, run as doctests (tests/test_examples.py): expert load per layer,
the first divergence of two runs, and the tokens whose experts changed between runs. Each works on
any recording; here on two tiny ones written by `write_example` (two runs of one request: 8 tokens,
two MoE layers, 4 experts, top-2), so every number below can be checked by hand.

Open a recording (`sparseety_prof.open(path)` as well):

>>> import tempfile
>>> import polars as pl
>>> from sparseety_prof.store.recording import open as open_recording
>>> from sparseety_prof.views.examples import write_example
>>> tmp = tempfile.mkdtemp()
>>> a = open_recording(write_example(f"{tmp}/dense"))
>>> b = open_recording(write_example(f"{tmp}/sparse", variant=True))
>>> a.meta["layers"]["moe"]  # expert_ids[i] is model layer moe[i]
[0, 1]

**Expert load per layer**: how often each expert was chosen, per MoE layer, over the sampled tokens.
`expert_ids` is a list per layer of the experts chosen; explode it twice, numbering the layers:

>>> load = (
...     a.tokens()
...     .select(pl.col("expert_ids"), pl.int_ranges(pl.col("expert_ids").list.len()).alias("layer"))
...     .explode("expert_ids", "layer")
...     .explode("expert_ids")
...     .group_by("layer", "expert_ids")
...     .len()
...     .sort("layer", "expert_ids")
... )
>>> load.rows()
[(0, 0, 8), (0, 1, 4), (0, 2, 4), (1, 1, 4), (1, 2, 8), (1, 3, 4)]

The `routes` table holds the same per layer, prompt rows included, with the model layer:
`a.routes().explode("expert_ids").group_by("layer", "expert_ids").len()`.

**The first divergence of two runs** of the same prompts: join the tokens by request and decode
order, then find the first token whose id, and the first whose experts, differ (`sparseety-prof diff`
does this and more, layer by layer):

>>> cols = ["request_id", "decode_order", "token_id", "expert_ids"]
>>> key = ["request_id", "decode_order"]
>>> pair = a.tokens().select(cols).join(b.tokens().select(cols), on=key, suffix="_b")
>>> pair.filter(pl.col("token_id") != pl.col("token_id_b"))["decode_order"].min()
6
>>> pair.filter(pl.col("expert_ids") != pl.col("expert_ids_b"))["decode_order"].min()
4

The routing diverged two tokens before the text did.

**Tokens whose experts changed between runs**, per layer, comparing the expert sets (the order
within a layer is the engine's ranking, not a difference of choice):

>>> changed = (
...     pair.with_columns(pl.int_ranges(pl.col("expert_ids").list.len()).alias("layer"))
...     .explode("expert_ids", "expert_ids_b", "layer")
...     .filter(pl.col("expert_ids").list.sort() != pl.col("expert_ids_b").list.sort())
...     .select("decode_order", "layer", "expert_ids", "expert_ids_b")
... )
>>> changed.rows()
[(4, 1, [2, 3], [0, 3]), (5, 1, [1, 2], [0, 1]), (7, 0, [0, 2], [2, 3]), (7, 1, [2, 3], [0, 3])]

Token 6's experts are the same in both runs, in another order: no change of choice.

>>> import shutil
>>> shutil.rmtree(tmp)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sparseety_prof.store import schema
from sparseety_prof.store.recording_writer import RecordingWriter

#: run A: per token, the experts of MoE layers 0 and 1, and the token ids
EXPERTS_A = [
    [[0, 1], [1, 2]],
    [[0, 2], [2, 3]],
    [[0, 1], [1, 2]],
    [[0, 2], [2, 3]],
    [[0, 1], [2, 3]],
    [[0, 2], [1, 2]],
    [[1, 0], [2, 1]],
    [[0, 2], [2, 3]],
]
TOKENS_A = [10, 11, 12, 13, 14, 15, 16, 17]
#: run B: other experts in layer 1 at tokens 4 and 5, in both layers at 7; token 6 the same experts
#: in another order; other token ids from token 6 on
EXPERTS_B = [*EXPERTS_A[:4], [[0, 1], [0, 3]], [[0, 2], [0, 1]], [[0, 1], [1, 2]], [[2, 3], [0, 3]]]
TOKENS_B = [*TOKENS_A[:6], 26, 27]


def write_example(path: str | Path, *, variant: bool = False) -> Path:
    """A complete recording of one request (`r0-0-1`, 8 decode-ordered tokens) with run A's (or,
    with `variant`, run B's) token ids and routing; the other columns null."""
    experts, ids = (EXPERTS_B, TOKENS_B) if variant else (EXPERTS_A, TOKENS_A)
    n = len(ids)
    cols: dict[str, Any] = {  # schema.Columns, whose list[object] values mypy holds invariant
        "request_id": ["r0-0-1"] * n,
        "seq_id": [0] * n,
        "decode_order": list(range(n)),
        "pos": [4 + i for i in range(n)],
        "token_id": ids,
        "step_id": list(range(n)),
        "expert_ids": experts,
    }
    meta = {"engine": {"name": "example", "version": "1"}, "layers": {"moe": [0, 1], "ffn": [0, 1]}}
    w = RecordingWriter(Path(path), meta)
    w.append("tokens", schema.frame("tokens", cols, absent=schema.TOKENS.keys() - cols.keys()))
    w.close()
    return Path(path)
