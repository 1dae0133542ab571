"""Root tests: the sparse decisions the profiler records (MoE routing, activation sparsity,
attention coverage) equal what the engine itself computed.

Ground truth comes from a SEPARATE run of the same engine script, model, prompts, seed and
settings with llama.cpp's in-process graph callback installed (tests/engines/llama_engine.py
--graph-trace). Each case states its logits_all setting: with logits_all=False the engine computes
the last layer only for rows that produce logits, and neither side may invent the others.
Expert ids and exact-zero counts must match exactly; gate weights within 1e-5."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from conftest import ENGINES, Engine, Recorder, run_cli

import sparseety_prof
from sparseety_prof.capture import events
from sparseety_prof.synthetic import make_model, swa_layers

pytestmark = [pytest.mark.root, pytest.mark.engine]

WEIGHT_TOL = 1e-5
# long enough for the sliding window (16) to be exceeded and for several prompt rows per thread
PROMPTS = [
    "hello the expert router says the sparse decode sample is one two three and then some more words",
    "what is the time of the day when the token expert router decode runs",
]
MAX_TOKENS = 16
#: what the recorder prints once attention masks are read at set_input_kq_mask alone
DETACHED = "graph-op probes detached"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sparse_models")


def _model(model_dir: Path, preset: str, dtype: str | None, prune: str | None = None) -> Path:
    path = model_dir / f"{preset}-{dtype or 'default'}-{(prune or 'dense').replace(':', 'of')}.gguf"
    if not path.exists():
        make_model(path, preset, dtype=dtype, prune=prune)
    return path


class Run:
    """One profiled run and one ground-truth run of the same engine and settings."""

    def __init__(
        self,
        tmp: Path,
        model: Path,
        engine_args: list[str],
        rec_args: list[str],
        *,
        after_detach: bool = False,
    ) -> None:
        """With `after_detach`, the second prompt runs once the recorder has detached the
        attention graph-op probes (its masks then come from set_input_kq_mask alone); the truth
        run makes the same two calls."""
        base = [str(ENGINES / "llama_engine.py"), str(model), *engine_args]
        batches = [PROMPTS[:1], PROMPTS[1:]] if after_detach else [PROMPTS]
        e = Engine(base)
        try:
            rec = Recorder(e.pid, tmp / "rec", *rec_args)
            self.results = e.generate(batches[0], max_tokens=MAX_TOKENS)
            for prompts in batches[1:]:
                rec.wait_for(DETACHED, timeout=30)
                self.results += e.generate(prompts, max_tokens=MAX_TOKENS)
            rc, err = rec.stop(signal.SIGINT)
            assert rc == 0, err
        finally:
            e.close()
        self.rec = sparseety_prof.open(tmp / "rec")
        trace_path = tmp / "trace.jsonl"
        t = Engine([*base, "--graph-trace", str(trace_path)])
        try:
            self.truth_results = [
                r for prompts in batches for r in t.generate(prompts, max_tokens=MAX_TOKENS)
            ]
        finally:
            t.close()
        self.trace = [json.loads(x) for x in trace_path.read_text().splitlines()]
        assert not [x for x in self.trace if x["kind"] == "error"]
        self.meta_t = self.trace[0]

    def eval_to_step(self) -> dict[int, int]:
        """The k-th llama_decode of the truth run is the k-th micro-batch of the profiled run
        (n_batch == n_ubatch: one micro-batch per decode); their positions must agree."""
        steps = self.rec.steps().sort("step_id")
        evals = [x for x in self.trace if x["kind"] == "eval"]
        assert len(evals) == steps.height, (len(evals), steps.height)
        for ev, pos in zip(evals, steps["positions"].to_list(), strict=True):
            assert ev["positions"] == pos
        return {ev["eval"]: int(s) for ev, s in zip(evals, steps["step_id"].to_list(), strict=True)}

    def records(self, kind: str) -> Iterator[dict[str, Any]]:
        return (x for x in self.trace if x["kind"] == kind)


def _routes_index(routes: pl.DataFrame) -> dict[tuple[int, int, int], dict[str, Any]]:
    return {(r["step_id"], r["pos"], r["layer"]): r for r in routes.iter_rows(named=True)}


def check_run(run: Run, *, expect_moe: bool) -> dict[str, int]:
    rec = run.rec
    # the two runs generated the same tokens (same engine, settings and seed)
    assert [r["ids"] for r in run.results] == [r["ids"] for r in run.truth_results]
    losses = rec.meta["losses"]
    for k in (
        "kernel_drops",
        "seq_gaps",
        "sparse_unattributed",
        "sparse_unmapped_rows",
        "sparse_rows_not_captured",
        "program_misses",
    ):
        assert losses[k] == 0, (k, losses)
    e2s = run.eval_to_step()
    routes = _routes_index(rec.routes())
    n_layer = run.meta_t["n_layer"]
    counts = {"moe": 0, "act": 0, "attn": 0}

    # ---- MoE routing: every (position, layer) the engine computed, prompt rows included
    moe_keys = set()
    for r in run.records("moe"):
        step = e2s[r["eval"]]
        for i, pos in enumerate(r["positions"]):
            key = (step, pos, r["layer"])
            moe_keys.add(key)
            got = routes.get(key)
            assert got is not None, f"no route recorded for step {step} pos {pos} layer {r['layer']}"
            assert got["expert_ids"] == r["ids"][i], (key, got["expert_ids"], r["ids"][i])
            np.testing.assert_allclose(
                got["expert_weights"], r["weights"][i], atol=WEIGHT_TOL, err_msg=str(key)
            )
            counts["moe"] += 1
    recorded_moe = {k for k, v in routes.items() if v["expert_ids"] is not None}
    assert recorded_moe == moe_keys  # nothing invented, nothing missing
    assert bool(moe_keys) == expect_moe
    if expect_moe:
        assert rec.meta["layers"]["moe"] == list(range(n_layer))

    # ---- activation sparsity: exact zero counts and below-threshold counts per row and layer
    act_keys = set()
    for r in run.records("act"):
        step = e2s[r["eval"]]
        for i, pos in enumerate(r["positions"]):
            key = (step, pos, r["layer"])
            act_keys.add(key)
            got = routes[key]
            assert got["act_values"] == r["values"][i]
            assert round(got["act_zero_ratio"] * got["act_values"]) == r["zeros"][i], key
            assert round(got["act_below_ratio"] * got["act_values"]) == r["below"][i], key
            counts["act"] += 1
    assert {k for k, v in routes.items() if v["act_zero_ratio"] is not None} == act_keys

    # ---- token rows carry their step's decisions at logits_pos; attention from the real mask
    truth_attn = {
        (e2s[r["eval"]], pos, r["layer"]): r["attended"][i]
        for r in run.records("attn")
        for i, pos in enumerate(r["positions"])
    }
    tokens = rec.tokens()
    assert tokens.height == sum(len(r["ids"]) for r in run.results)
    moe_layers, ffn_layers = rec.meta["layers"]["moe"], rec.meta["layers"]["ffn"]
    attn_layers = rec.meta["layers"]["attn"]
    for t in tokens.iter_rows(named=True):
        step, lp = t["step_id"], t["logits_pos"]
        if expect_moe:
            assert t["expert_ids"] == [routes[(step, lp, layer)]["expert_ids"] for layer in moe_layers]
        else:
            assert t["expert_ids"] == []
        assert t["act_zero_ratio"] == pytest.approx(
            [routes[(step, lp, layer)]["act_zero_ratio"] for layer in ffn_layers]
        )
        want = [truth_attn[(step, lp, layer)] for layer in attn_layers]
        assert t["attn_attended"] == want, (step, lp)
        assert t["attn_total"] == lp + 1
        assert t["kv_cells_used"] == max(want)
        counts["attn"] += len(want)
    cov = rec.meta["layer_coverage"]
    assert cov["ffn"]["missing"] == [] and cov["attn"]["missing"] == []
    return counts


CASES = [
    # preset, dtype, threads, logits_all, where MoE values are read (--moe-read)
    ("moe", None, 1, True, "auto"),
    ("moe", None, 2, True, "auto"),
    ("moe", None, 2, False, "auto"),
    ("qwen3moe", None, 1, True, "auto"),
    ("qwen3moe", None, 2, True, "auto"),
    ("smallthinker", None, 1, True, "auto"),
    ("smallthinker", None, 2, True, "auto"),
    ("moe", "q8_0", 2, True, "auto"),
    ("moe", "q4_0", 1, True, "auto"),
    # the router's get_rows and the GLU op instead of the weighted multiply
    ("moe", None, 2, True, "ops"),
    ("smallthinker", None, 2, False, "ops"),
]

#: the graph-op functions probed for MoE values, per --moe-read, on these all-expert-FFN models
MOE_PROBES = {
    "auto": {"ggml_compute_forward_mul"},
    "ops": {"ggml_compute_forward_mul", "ggml_compute_forward_get_rows", "ggml_compute_forward_glu"},
}


@pytest.mark.parametrize(("preset", "dtype", "threads", "logits_all", "read"), CASES)
def test_sparse_decisions_match_the_engine(
    model_dir: Path, tmp_path: Path, preset: str, dtype: str | None, threads: int, logits_all: bool, read: str
) -> None:
    model = _model(model_dir, preset, dtype)
    args = ["--threads", str(threads)] + ([] if logits_all else ["--no-logits-all"])
    run = Run(tmp_path, model, args, ["--moe-read", read])
    probed = {p["symbol"] for p in run.rec.meta["probes"]}
    moe_ops = {"ggml_compute_forward_mul", "ggml_compute_forward_get_rows", "ggml_compute_forward_glu"}
    assert probed & moe_ops == MOE_PROBES[read]
    assert run.rec.meta["moe_read_points"] == {"ids_at_mul": read == "auto", "act_at_mul": read == "auto"}
    # the values below came through the aggregate records sized to the model (a few layers, not
    # AGG_MAX_LAYERS) and the small micro-batch records
    layers = run.rec.meta["layers"]
    n_layers = 1 + max(layers["moe"] + layers["ffn"] + layers["attn"])
    layout = run.rec.meta["record_layout"]
    assert n_layers + events.AGG_ATTN_EXTRA <= layout["agg_layers"] < events.AGG_MAX_LAYERS
    assert layout["ubatch_small_rows"] == events.UB_SMALL_TOK
    counts = check_run(run, expect_moe=True)
    assert counts["moe"] > 0 and counts["act"] > 0 and counts["attn"] > 0
    phases = set(run.rec.tokens()["phase"].to_list())
    assert phases == {"prefill", "decode"}
    if preset == "smallthinker":  # ReGLU experts: real exact zeros
        zr = run.rec.routes()["act_zero_ratio"].drop_nulls()
        assert 0.2 < zr.mean() < 0.8  # type: ignore[operator]
    if not logits_all:  # the last layer ran for output rows only: fewer routes there
        last = run.meta_t["n_layer"] - 1
        per_layer = run.rec.routes().group_by("layer").len()
        n_last = per_layer.filter(pl.col("layer") == last)["len"][0]
        n_first = per_layer.filter(pl.col("layer") == 0)["len"][0]
        assert n_last < n_first


def test_glu_thread_state_without_task_storage(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GLU probes' entry-to-return state in a hash map keyed by thread id (kernels before
    5.11, or SPARSEETY_PROF_TASK_STORAGE=0) gives the same values as task-local storage."""
    monkeypatch.setenv("SPARSEETY_PROF_TASK_STORAGE", "0")
    run = Run(tmp_path, _model(model_dir, "qwen3moe", None), ["--threads", "2"], ["--moe-read", "ops"])
    assert "ggml_compute_forward_glu" in {p["symbol"] for p in run.rec.meta["probes"]}
    counts = check_run(run, expect_moe=True)
    assert counts["act"] > 0


def test_dense_model_has_empty_routing_and_real_sparsity(model_dir: Path, tmp_path: Path) -> None:
    run = Run(tmp_path, _model(model_dir, "dense", None), ["--threads", "2"], [])
    counts = check_run(run, expect_moe=False)
    assert counts["act"] > 0
    assert run.rec.meta["layers"]["moe"] == []
    # SwiGLU: no exact zeros, but some values below the threshold
    routes = run.rec.routes()
    assert routes["act_zero_ratio"].max() == 0.0
    assert routes["act_below_ratio"].max() > 0.0  # type: ignore[operator]


def test_sliding_window_attention_follows_the_mask(model_dir: Path, tmp_path: Path) -> None:
    run = Run(tmp_path, _model(model_dir, "swa", None), ["--threads", "2"], [])
    check_run(run, expect_moe=False)
    tokens = run.rec.tokens()
    swa = set(swa_layers("swa"))
    attn_layers = run.rec.meta["layers"]["attn"]
    beyond = tokens.filter(pl.col("logits_pos") >= 16)
    assert beyond.height > 0
    for t in beyond.iter_rows(named=True):
        for layer, att in zip(attn_layers, t["attn_attended"], strict=True):
            if layer in swa:
                assert att < t["attn_total"]  # the window masks the older positions
            else:
                assert att == t["attn_total"]


def test_router_probs_and_masks_on_request(model_dir: Path, tmp_path: Path) -> None:
    """--capture-router-probs records every expert's probability (top-k agree with the ids);
    --capture-masks records the zero mask, whose popcount equals the counted zeros."""
    run = Run(
        tmp_path,
        _model(model_dir, "smallthinker", None),
        ["--threads", "2"],
        ["--capture-router-probs", "--capture-masks"],
    )
    check_run(run, expect_moe=True)
    routes = run.rec.routes().filter(pl.col("expert_ids").is_not_null())
    truth_probs = {
        (r["eval"], pos, r["layer"]): r["probs"][i]
        for r in run.records("moe")
        for i, pos in enumerate(r["positions"])
    }
    e2s = run.eval_to_step()
    s2e = {s: e for e, s in e2s.items()}
    for r in routes.iter_rows(named=True):
        want = truth_probs[(s2e[r["step_id"]], r["pos"], r["layer"])]
        np.testing.assert_allclose(r["router_probs"], want, atol=1e-6)
        order = np.argsort(-np.array(r["router_probs"]), kind="stable")[: len(r["expert_ids"])]
        assert sorted(order.tolist()) == sorted(r["expert_ids"])
    masks = run.rec.masks()
    assert masks.height > 0
    joined = masks.join(run.rec.routes(), on=["step_id", "row", "layer"])
    for m in joined.iter_rows(named=True):
        bits = np.unpackbits(np.frombuffer(m["nonzero_bits"], dtype=np.uint8))[: m["n_values"]]
        assert m["n_values"] == m["act_values"]
        assert m["n_values"] - int(bits.sum()) == round(m["act_zero_ratio"] * m["act_values"])


def test_pruned_quantized_model_routing_and_weight_sparsity(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2:4-pruned, q4_0 MoE: routing still exact (another code path in the engine), and the
    metadata names the pruned tensors and their N:M pattern (computed once, cached by sha256)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run = Run(tmp_path, _model(model_dir, "moe", "q4_0", "2:4"), ["--threads", "2"], [])
    check_run(run, expect_moe=True)
    ws = run.rec.meta["weight_sparsity"]
    pruned = {t["name"]: t for t in ws["tensors"]}
    ffn = [n for n in pruned if "ffn_" in n and "gate_inp" not in n]
    assert ffn and all(pruned[n]["nm_pattern"] == "2:4" for n in ffn)
    # half pruned, plus the small kept values q4_0 rounds to 0
    assert all(0.5 <= pruned[n]["zero_fraction"] < 0.6 for n in ffn)
    # only the FFN weights were pruned (q4_0 rounds some small attention weights to 0: no pattern)
    assert all(pruned[n]["nm_pattern"] is None for n in pruned if "attn" in n)


def test_diff_of_a_dense_and_a_pruned_run_finds_where_they_diverge(model_dir: Path, tmp_path: Path) -> None:
    """The brief's dense-vs-sparse workflow end to end: the same prompts on the MoE model and on
    its 2:4-pruned twin, each recorded from a real engine; `diff` reports the first divergence
    with its routing context, and a run against itself is equal."""
    recs = {}
    for name, prune in (("dense", None), ("pruned", "2:4")):
        e = Engine(
            [str(ENGINES / "llama_engine.py"), str(_model(model_dir, "moe", None, prune)), "--threads", "2"]
        )
        try:
            rec = Recorder(e.pid, tmp_path / name)
            e.generate(PROMPTS, max_tokens=MAX_TOKENS)
            rc, err = rec.stop(signal.SIGINT)
            assert rc == 0, err
        finally:
            e.close()
        recs[name] = tmp_path / name
    same = run_cli("diff", str(recs["dense"]), str(recs["dense"]), "--json")
    assert same.returncode == 0, same.stderr
    assert json.loads(same.stdout)["equal"] is True
    res = run_cli("diff", str(recs["dense"]), str(recs["pruned"]), "--json")
    assert res.returncode == 1, res.stderr
    out = json.loads(res.stdout)
    assert out["equal"] is False and len(out["pairs"]) == len(PROMPTS)
    # pruning half of every expert's weights changes routing right away
    assert out["routing"]["agreement"] < 1.0
    assert out["routing"]["first_difference"] is not None
    human = run_cli("diff", str(recs["dense"]), str(recs["pruned"]))
    assert human.returncode == 1 and "diverge" in (human.stdout + human.stderr).lower()


@pytest.mark.parametrize(
    ("preset", "engine_args"),
    [
        ("swa", ["--threads", "2"]),  # two masks: full attention and sliding window
        ("swa", ["--threads", "2", "--flash-attn"]),  # flash attention: an F16 cast of the mask
        ("moe", ["--threads", "1", "--no-logits-all"]),
    ],
)
def test_attention_after_the_graph_op_probes_are_detached(
    model_dir: Path, tmp_path: Path, preset: str, engine_args: list[str]
) -> None:
    """Once the layer -> mask map is learned the soft_max / flash-attention probes are detached:
    the second prompt's attention counts come from set_input_kq_mask alone, and every token's
    still equals the mask the engine applied in that layer."""
    run = Run(tmp_path, _model(model_dir, preset, None), engine_args, [], after_detach=True)
    counts = check_run(run, expect_moe=preset == "moe")
    assert counts["attn"] > 0
    masks = run.rec.meta["attention_masks"]
    assert masks["mask_read"] == "set_input_kq_mask" and masks["disagreements"] == 0
    calls = set(masks["layer_calls"].values())
    assert calls == ({0, 1} if preset == "swa" else {0})  # one call per kind of mask
    assert sorted(int(k) for k in masks["layer_calls"]) == run.rec.meta["layers"]["attn"]


def test_attention_is_counted_for_a_long_cache(model_dir: Path, tmp_path: Path) -> None:
    """Past 1,100 positions a mask row (F32, the KV cache padded to 256 cells) needs 10 of the
    counting budget's 16 blocks of 64 words: every token row still carries its counts."""
    e = Engine(
        [
            str(ENGINES / "llama_engine.py"),
            str(_model(model_dir, "moe", None)),
            "--threads",
            "2",
            "--n-ctx",
            "2048",
        ]
    )
    try:
        rec = Recorder(e.pid, tmp_path / "rec")
        out = e.generate([PROMPTS[0]], max_tokens=1200)
        rc, err = rec.stop(signal.SIGINT)
        assert rc == 0, err
    finally:
        e.close()
    r = sparseety_prof.open(tmp_path / "rec")
    tokens = r.tokens()
    assert tokens.height == len(out[0]["ids"]) and tokens["logits_pos"].max() > 1100  # type: ignore[operator]
    n_attn = len(r.meta["layers"]["attn"])
    for t in tokens.iter_rows(named=True):
        assert t["attn_attended"] == [t["logits_pos"] + 1] * n_attn, t["logits_pos"]
    assert r.meta["losses"]["attention_rows_not_counted"] == 0
