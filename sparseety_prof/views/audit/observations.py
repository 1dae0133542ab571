"""What an attacker sees of a recording, row by row: for every micro-batch row the engine computed,
the token it was fed (the label to recover) and the signals stored for that row, per layer.

A row's routing, activations and masks are computed from the token at that row (and its context),
so the label is the row's input token (steps.token_ids), prompt rows included. Signals:

- experts       the set of selected experts (discrete: one key per set)
- gate_weights  the gate weight of each expert (0 for those not selected)
- router_probs  the router's probability of every expert (--capture-router-probs)
- sparsity      act_zero_ratio and act_below_ratio
- masks         the activation zero mask, one value per bit (--capture-masks)
- attention     attended cells per attention layer (rows that produced a token only)
- timing        log duration of the row's micro-batch (one value for every layer)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import polars as pl

SIGNALS = ("experts", "gate_weights", "router_probs", "sparsity", "masks", "attention", "timing")
#: the layer key of signals that are not per layer
ALL_LAYERS = -1


@dataclass
class Signal:
    name: str
    discrete: bool
    #: layer -> (N,) int64 keys (-1: absent) for discrete signals, (N, F) float64 otherwise
    values: dict[int, npt.NDArray[np.generic]] = field(default_factory=dict)
    #: layer -> (N,) bool: the row has this signal at this layer
    present: dict[int, npt.NDArray[np.bool_]] = field(default_factory=dict)

    def rows(self) -> int:
        """Rows that have the signal at some layer."""
        if not self.present:
            return 0
        return int(np.logical_or.reduce(list(self.present.values())).sum())


@dataclass
class Observations:
    tokens: npt.NDArray[np.int64]  # (N,) the input token of each row
    runs: npt.NDArray[np.int64]  # (N,) which run of a sequence (up to where its position goes back)
    sources: npt.NDArray[np.int64]  # (N,) which of the given recordings it came from
    signals: dict[str, Signal]


def _row_index(steps: pl.DataFrame, keys: pl.DataFrame) -> pl.DataFrame:
    """(step_id, row, token, pos, seq, source, t_ns, idx) of every listed row that has `keys`."""
    st = steps.filter(pl.col("token_ids").is_not_null()).with_columns(
        pl.col("token_ids").list.len().alias("_listed"),
        (pl.col("t_end_ns") - pl.col("t_start_ns")).alias("t_ns"),
    )
    rows = st.explode(["token_ids", "positions", "row_seq_ids"]).filter(pl.col("token_ids").is_not_null())
    rows = rows.with_columns(
        # a truncated step lists only its last rows
        (pl.col("n_tokens") - pl.col("_listed") + pl.int_range(pl.len()).over("step_id"))
        .cast(pl.Int32)
        .alias("row")
    )
    rows = rows.join(keys, on=["step_id", "row"], how="semi").sort("step_id", "row")
    rows = rows.select(
        "step_id",
        "row",
        pl.col("token_ids").alias("token"),
        pl.col("positions").alias("pos"),
        pl.col("row_seq_ids").alias("seq"),
        "source",
        "t_ns",
    ).with_row_index("idx")
    return rows.with_columns(pl.col("idx").cast(pl.Int64))


def _runs(rows: pl.DataFrame) -> npt.NDArray[np.int64]:
    """A run starts where a sequence's position goes back (the cache was cleared, or kept only a
    common prefix such as the BOS token, as llama-cpp-python does between prompts)."""
    back = (pl.col("pos") <= pl.col("pos").shift(1)).fill_null(True)
    run_n = rows.select(back.cum_sum().over(["source", "seq"]).alias("n"))["n"]
    key = rows.select("source", "seq").with_columns(run_n)
    return np.asarray(key.select(pl.struct(pl.all()).rank("dense"))[:, 0].to_numpy(), dtype=np.int64) - 1


def observe(
    steps: pl.DataFrame,
    routes: pl.DataFrame,
    masks: pl.DataFrame,
    tokens: pl.DataFrame,
    *,
    attn_layers: list[int],
) -> Observations:
    """The frames (schema tables plus a "source" column; step ids unique across sources) as rows."""
    keys = pl.concat([routes.select("step_id", "row"), masks.select("step_id", "row")]).unique()
    rows = _row_index(steps, keys)
    n = rows.height
    index = rows.select("step_id", "row", "idx")
    sig = {name: Signal(name, discrete=name == "experts") for name in SIGNALS}
    _routes(routes.join(index, on=["step_id", "row"]), n, sig)
    _masks(masks.join(index, on=["step_id", "row"]), n, sig["masks"])
    _attention(tokens, rows, attn_layers, sig["attention"])
    t = rows["t_ns"].to_numpy().astype(np.float64)
    ok = np.isfinite(t) & (t > 0)
    sig["timing"].values[ALL_LAYERS] = np.log(np.where(ok, t, 1.0))[:, None]
    sig["timing"].present[ALL_LAYERS] = ok
    return Observations(
        tokens=rows["token"].to_numpy().astype(np.int64),
        runs=_runs(rows),
        sources=rows["source"].to_numpy().astype(np.int64),
        signals={k: v for k, v in sig.items() if v.present and v.rows()},
    )


def _put(
    signal: Signal, layer: int, n: int, idx: npt.NDArray[np.int64], vals: npt.NDArray[np.float64]
) -> None:
    full = np.zeros((n, vals.shape[1]), dtype=np.float64)
    full[idx] = vals
    present = np.zeros(n, dtype=bool)
    present[idx] = True
    signal.values[layer], signal.present[layer] = full, present


def _routes(r: pl.DataFrame, n: int, sig: dict[str, Signal]) -> None:
    set_keys: dict[tuple[int, ...], int] = {}
    n_expert = 1 + max((max(x) for x in r["expert_ids"].drop_nulls().to_list() if x), default=-1)
    for (layer,), part in r.sort("idx").group_by(["layer"], maintain_order=True):
        layer = int(layer)
        ids = part.filter(pl.col("expert_ids").is_not_null())
        if ids.height:
            idx = ids["idx"].to_numpy()
            keys = np.full(n, -1, dtype=np.int64)
            lists = ids["expert_ids"].to_list()
            keys[idx] = [set_keys.setdefault(tuple(sorted(x)), len(set_keys)) for x in lists]
            sig["experts"].values[layer], sig["experts"].present[layer] = keys, keys >= 0
            if ids["expert_weights"].null_count() == 0:
                w = np.zeros((ids.height, n_expert))
                for i, (e, g) in enumerate(zip(lists, ids["expert_weights"].to_list(), strict=True)):
                    w[i, e] = g
                _put(sig["gate_weights"], layer, n, idx, w)
        probs = part.filter(pl.col("router_probs").is_not_null())
        if probs.height:
            _put(
                sig["router_probs"],
                layer,
                n,
                probs["idx"].to_numpy(),
                np.array(probs["router_probs"].to_list()),
            )
        ratios = part.filter(pl.col("act_zero_ratio").is_not_null() & pl.col("act_below_ratio").is_not_null())
        if ratios.height:
            vals = ratios.select("act_zero_ratio", "act_below_ratio").to_numpy().astype(np.float64)
            _put(sig["sparsity"], layer, n, ratios["idx"].to_numpy(), vals)


def _masks(m: pl.DataFrame, n: int, signal: Signal) -> None:
    m = m.filter(pl.col("nonzero_bits").is_not_null())
    for (layer,), part in m.group_by(["layer"]):
        width = int(np.max(part["n_values"].fill_null(0).to_numpy(), initial=0))
        if width <= 0:
            continue
        bits = np.zeros((part.height, width))
        for i, (b, nv) in enumerate(
            zip(part["nonzero_bits"].to_list(), part["n_values"].to_list(), strict=True)
        ):
            row = np.unpackbits(np.frombuffer(b, dtype=np.uint8))[: min(nv, width)]
            bits[i, : row.size] = row
        _put(signal, int(layer), n, part["idx"].to_numpy(), bits)


def _attention(tokens: pl.DataFrame, rows: pl.DataFrame, attn_layers: list[int], signal: Signal) -> None:
    t = tokens.filter(pl.col("attn_attended").is_not_null()).select(
        "step_id", pl.col("seq_id").alias("seq"), pl.col("logits_pos").alias("pos"), "attn_attended"
    )
    j = rows.select("step_id", "seq", "pos", "idx").join(t, on=["step_id", "seq", "pos"]).unique("idx")
    if j.height == 0:
        return
    att = j["attn_attended"].to_list()
    width = max(len(a) for a in att)
    labels = attn_layers if len(attn_layers) == width else list(range(width))
    idx = j["idx"].to_numpy()
    for k, layer in enumerate(labels):
        ok = np.array([len(a) > k and a[k] is not None for a in att])
        if ok.any():
            vals = np.array([[float(a[k])] for a, good in zip(att, ok, strict=True) if good])
            _put(signal, layer, rows.height, idx[ok], vals)
