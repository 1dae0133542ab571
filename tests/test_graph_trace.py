"""The in-process ground truth of tests/engines/llama_engine.py --graph-trace: llama.cpp's cb_eval
graph callback records, per graph evaluation, MoE routing, activation sparsity and attention
coverage (line format in the engine's docstring). No root needed."""

from __future__ import annotations

import ctypes
import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from conftest import ENGINES, Engine
from engines import llama_engine

from sparseety_prof.synthetic import PRESETS, make_model, swa_layers

PROMPTS = ["hello the expert router", "the sparse decode sample"]
MAX_TOKENS = 8
LOGPROB_TOL = 1e-4
WEIGHT_TOL = 1e-5
# Archs whose graph (llama.cpp src/models/<arch>.cpp) calls build_moe_ffn with norm_w = true
# whatever the GGUF says: the gate weights applied are probs[ids] renormalised to sum 1. Other archs
# (deepseek2, ...) read <arch>.expert_weights_norm.
NORM_W_HARDCODED = {"llama", "qwen3moe", "smallthinker"}


@pytest.fixture(scope="module")
def extra_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("trace_models")
    return {name: make_model(d / f"{name}.gguf", name) for name in ("qwen3moe", "smallthinker")}


class TracedEngine(Engine):
    def __init__(self, model: Path, trace: Path, *extra: str) -> None:
        self.trace = trace
        super().__init__([str(ENGINES / "llama_engine.py"), str(model), "--graph-trace", str(trace), *extra])

    def teacher_force(self, items: list[dict[str, list[int]]]) -> list[dict[str, Any]]:
        self.send({"teacher_force": items})
        return list(self.read(timeout=120)["results"])

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.trace.read_text().splitlines()]


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[Any]:
    started: list[TracedEngine] = []

    def start(model: Path, *extra: str) -> TracedEngine:
        e = TracedEngine(model, tmp_path / f"trace{len(started)}.jsonl", *extra)
        started.append(e)
        return e

    yield start
    for e in started:
        e.close()


class Trace:
    """A trace file, split into its lines by kind, with the per-tensor records checked against the
    eval line they belong to."""

    def __init__(self, lines: list[dict[str, Any]]) -> None:
        self.lines = lines
        assert lines[0]["kind"] == "meta"
        self.meta = lines[0]
        self.errors = [r for r in lines if r["kind"] == "error"]
        self.evals = {r["eval"]: r for r in lines if r["kind"] == "eval"}
        self.records: dict[str, list[dict[str, Any]]] = {"moe": [], "act": [], "attn": []}
        for r in lines:
            if r["kind"] in self.records:
                self.records[r["kind"]].append(r)

    def by_eval(self, kind: str) -> dict[int, dict[int, dict[str, Any]]]:
        out: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
        for r in self.records[kind]:
            assert r["layer"] not in out[r["eval"]], "one record per layer and eval"
            out[r["eval"]][r["layer"]] = r
        return out

    def check_rows(self, last_layer_rows: str) -> None:
        """Every record's rows are those of its eval: all of them, or (FFN of the last layer) only
        the rows that produce logits."""
        n_layer = self.meta["n_layer"]
        for ev in self.evals.values():
            n_past, u = ev["n_past"], ev["n_batch_rows"]
            assert ev["positions"] == list(range(n_past, n_past + u))  # row i is position n_past + i
            assert len(ev["tokens"]) == u
        for kind, recs in self.records.items():
            if not recs:
                continue
            by_eval = self.by_eval(kind)
            assert set(by_eval) == set(self.evals), kind  # every llama_decode was traced
            for e, layers in by_eval.items():
                assert set(layers) == set(range(n_layer)), (kind, e)
            for r in recs:
                ev = self.evals[r["eval"]]
                assert r["n_past"] == ev["n_past"]  # llm.n_tokens inside the callback is n_past
                assert r["n_batch_rows"] == ev["n_batch_rows"]
                assert r["n_rows"] == len(r["positions"])
                if kind != "attn" and r["layer"] == n_layer - 1 and last_layer_rows == "outputs":
                    assert r["positions"] == ev["output_positions"]
                else:
                    assert r["positions"] == ev["positions"]

    def items(self) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """(request line, its eval lines) in order."""
        out: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
        for r in self.lines:
            if r["kind"] == "request":
                out.append((r, []))
            elif r["kind"] == "eval":
                out[-1][1].append(r)
        return out


def check_moe(trace: Trace) -> None:
    arch = trace.meta["arch"]
    assert arch in NORM_W_HARDCODED
    n_expert, k = trace.meta["n_expert"], trace.meta["n_expert_used"]
    assert trace.records["moe"]
    for r in trace.records["moe"]:
        assert r["k"] == k and r["n_expert"] == n_expert
        ids = np.array(r["ids"])
        probs = np.array(r["probs"], dtype=np.float64)
        weights = np.array(r["weights"], dtype=np.float64)
        assert ids.shape == weights.shape == (r["n_rows"], k)
        assert probs.shape == (r["n_rows"], n_expert)
        assert ((ids >= 0) & (ids < n_expert)).all()
        assert all(len(set(row)) == k for row in ids.tolist())
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)  # softmax gating
        chosen = np.take_along_axis(probs, ids, axis=1)
        # argsort descending: ids are the top-k, best first
        assert (np.diff(chosen, axis=1) <= 0).all()
        others = probs.copy()
        np.put_along_axis(others, ids, -1.0, axis=1)
        assert (chosen.min(axis=1) >= others.max(axis=1)).all()
        # weights as applied: renormalised (norm_w), not the raw probabilities
        np.testing.assert_allclose(weights, chosen / chosen.sum(axis=1, keepdims=True), atol=WEIGHT_TOL)
        assert (chosen.sum(axis=1) < 1 - 1e-6).all()


def check_causal_attention(trace: Trace) -> None:
    assert trace.records["attn"]
    for r in trace.records["attn"]:
        assert r["attended"] == [p + 1 for p in r["positions"]]  # one sequence, causal, no SWA
        assert max(r["attended"]) <= r["n_kv"]


def routes_by_position(trace: Trace) -> dict[tuple[int, int], dict[str, Any]]:
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for r in trace.records["moe"]:
        for i, pos in enumerate(r["positions"]):
            assert (r["layer"], pos) not in out
            out[(r["layer"], pos)] = {"ids": r["ids"][i], "weights": r["weights"][i]}
    return out


def gguf_value(path: Path, key: str) -> Any:
    field = gguf.GGUFReader(path).get_field(key)
    return None if field is None else field.contents()


@pytest.mark.engine
def test_moe_trace_routing_attention_positions_and_teacher_forcing(
    traced: Any, llama_engine: Engine, models: dict[str, Path]
) -> None:
    e = traced(models["moe"])
    got = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
    trace = Trace(e.lines())  # readable right after the results message
    assert not trace.errors, trace.errors
    assert trace.meta["arch"] == "llama" and trace.meta["logits_all"]
    assert gguf_value(models["moe"], "llama.expert_weights_norm") is None
    assert trace.meta["expert_weights_norm"] is None

    # the trace does not change what the engine computes
    plain = llama_engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
    for a, b in zip(got, plain, strict=True):
        assert a["ids"] == b["ids"] and a["log_probs"] == b["log_probs"]

    # one eval per llama_decode: the prompt (the 2nd prompt reuses the cached <s>), then one per token
    items = trace.items()
    assert [r["mode"] for r, _ in items] == ["generate", "generate"]
    for (req, evals), res in zip(items, got, strict=True):
        assert req["prompt_tokens"] == res["prompt_tokens"]
        assert len(evals) == len(res["ids"])
        assert evals[0]["positions"][-1] == len(res["prompt_tokens"]) - 1
        assert [ev["tokens"] for ev in evals[1:]] == [[t] for t in res["ids"][:-1]]
    assert items[1][1][0]["n_past"] == 1
    trace.check_rows(last_layer_rows="all")
    check_moe(trace)
    check_causal_attention(trace)
    acts = trace.records["act"]
    assert {r["name"] for r in acts} == {"ffn_moe_swiglu"} and all(r["moe"] for r in acts)
    for r in acts:
        assert r["values"] == [PRESETS["moe"].n_ff * 2] * r["n_rows"]
        assert all(0 <= z <= b <= v for z, b, v in zip(r["zeros"], r["below"], r["values"], strict=True))

    # teacher forcing the generated ids reproduces their log-probs, and the routing of each position
    n_lines = len(trace.lines)
    forced = e.teacher_force([{"prompt_ids": r["prompt_tokens"], "ids": r["ids"]} for r in got])
    for f, g in zip(forced, got, strict=True):
        assert f["ids"] == g["ids"]
        np.testing.assert_allclose(f["log_probs"], g["log_probs"], atol=LOGPROB_TOL, rtol=0)
    full = Trace(e.lines())
    assert not full.errors
    new_items = full.items()[2:]
    assert [r["mode"] for r, _ in new_items] == ["teacher_force"] * 2
    for (req, evals), g in zip(new_items, got, strict=True):
        assert req["prompt_tokens"] == g["prompt_tokens"]
        assert evals[0]["n_past"] == 0 and len(evals) == len(g["ids"])  # prompt, then ids[:-1]
    routes: dict[tuple[int, int, int], dict[str, Any]] = {}
    for r in full.lines[n_lines:]:
        if r["kind"] == "moe":
            item = full.evals[r["eval"]]["item"]
            for i, pos in enumerate(r["positions"]):
                routes[(item, r["layer"], pos)] = {"ids": r["ids"][i], "weights": r["weights"][i]}
    assert routes
    for r in trace.records["moe"]:
        item = trace.evals[r["eval"]]["item"]
        for i, pos in enumerate(r["positions"]):
            want = routes.pop((item, r["layer"], pos))
            assert r["ids"][i] == want["ids"]
            np.testing.assert_allclose(r["weights"][i], want["weights"], atol=WEIGHT_TOL)
    # only the <s> row of the 2nd prompt, which the generation took from the cache, is left over
    assert set(routes) == {(1, layer, 0) for layer in range(trace.meta["n_layer"])}


@pytest.mark.engine
def test_logits_all_false_last_layer_has_only_the_output_rows(
    traced: Any, llama_engine: Engine, models: dict[str, Path]
) -> None:
    truth = llama_engine.generate(PROMPTS[:1], max_tokens=MAX_TOKENS)[0]
    e = traced(models["moe"], "--no-logits-all", "--n-batch", "4")
    got = e.generate(PROMPTS[:1], max_tokens=MAX_TOKENS)[0]
    assert got["ids"] == truth["ids"] and got["log_probs"] == []
    trace = Trace(e.lines())
    assert not trace.errors and not trace.meta["logits_all"]
    assert trace.meta["n_batch"] == trace.meta["n_ubatch"] == 4
    # the 5-token prompt is two llama_decode calls of n_batch rows; each outputs its last row only
    evals = list(trace.evals.values())
    assert [ev["positions"] for ev in evals[:2]] == [[0, 1, 2, 3], [4]]
    assert all(ev["output_positions"] == ev["positions"][-1:] for ev in evals)
    trace.check_rows(last_layer_rows="outputs")
    last = trace.meta["n_layer"] - 1
    for r in trace.records["moe"] + trace.records["act"]:
        if r["eval"] == 0:
            assert r["n_rows"] == (1 if r["layer"] == last else 4)
    check_moe(trace)
    check_causal_attention(trace)
    # the rows really are those positions: same routing as a run that computes every row
    full = traced(models["moe"])
    full.generate(PROMPTS[:1], max_tokens=MAX_TOKENS)
    want = routes_by_position(Trace(full.lines()))
    for r in trace.records["moe"]:
        for i, pos in enumerate(r["positions"]):
            assert r["ids"][i] == want[(r["layer"], pos)]["ids"]
            np.testing.assert_allclose(r["weights"][i], want[(r["layer"], pos)]["weights"], atol=WEIGHT_TOL)
    # teacher forcing without logits_all (logits of the last row of each eval), prompt in chunks of 4
    forced = e.teacher_force([{"prompt_ids": truth["prompt_tokens"], "ids": truth["ids"]}])[0]
    np.testing.assert_allclose(forced["log_probs"], truth["log_probs"], atol=LOGPROB_TOL, rtol=0)


@pytest.mark.engine
def test_dense_swiglu_has_no_exact_zeros(traced: Any, models: dict[str, Path]) -> None:
    e = traced(models["dense"], "--act-threshold", "0.05")
    e.generate(PROMPTS[:1], max_tokens=4)
    trace = Trace(e.lines())
    assert not trace.errors and not trace.records["moe"]
    trace.check_rows(last_layer_rows="all")
    check_causal_attention(trace)
    acts = trace.records["act"]
    assert {r["name"] for r in acts} == {"ffn_swiglu"}
    for r in acts:
        assert not r["moe"] and r["threshold"] == 0.05
        assert r["values"] == [PRESETS["dense"].n_ff] * r["n_rows"]
        assert r["zeros"] == [0] * r["n_rows"]
        assert all(0 < b < v for b, v in zip(r["below"], r["values"], strict=True))


@pytest.mark.engine
@pytest.mark.parametrize("preset", ["qwen3moe", "smallthinker"])
def test_other_moe_archs(traced: Any, extra_models: dict[str, Path], preset: str) -> None:
    model = extra_models[preset]
    assert gguf_value(model, f"{preset}.expert_weights_norm") is None  # normalised all the same
    e = traced(model)
    e.generate(PROMPTS, max_tokens=4)
    trace = Trace(e.lines())
    assert not trace.errors and trace.meta["arch"] == preset
    trace.check_rows(last_layer_rows="all")
    check_moe(trace)
    check_causal_attention(trace)
    acts = trace.records["act"]
    n_ff = PRESETS[preset].n_ff
    assert all(r["values"] == [n_ff * 2] * r["n_rows"] for r in acts)
    zeros = sum(sum(r["zeros"]) for r in acts)
    values = sum(sum(r["values"]) for r in acts)
    if preset == "smallthinker":  # ReGLU experts: relu(gate) * up is exactly 0 where gate <= 0
        assert {r["name"] for r in acts} == {"ffn_moe_reglu"}
        assert 0.4 < zeros / values < 0.6
        for r in acts:
            assert all(0.25 * v < z <= b for z, b, v in zip(r["zeros"], r["below"], r["values"], strict=True))
    else:
        assert {r["name"] for r in acts} == {"ffn_moe_swiglu"}
        assert zeros == 0


@pytest.mark.engine
def test_flash_attention_mask(traced: Any, models: dict[str, Path]) -> None:
    e = traced(models["moe"], "--flash-attn")
    e.generate(PROMPTS[:1], max_tokens=4)
    trace = Trace(e.lines())
    assert not trace.errors and trace.meta["flash_attn"]
    trace.check_rows(last_layer_rows="all")
    assert {r["source"] for r in trace.records["attn"]} == {"flash_attn"}
    check_causal_attention(trace)
    check_moe(trace)


@pytest.mark.engine
def test_sliding_window_attention_mask(traced: Any, tmp_path: Path) -> None:
    window, swa = PRESETS["swa"].n_swa, set(swa_layers("swa"))
    assert swa and window
    e = traced(make_model(tmp_path / "swa.gguf", "swa"))
    e.generate([" ".join(["hello the expert router"] * 5)], max_tokens=6)
    trace = Trace(e.lines())
    assert not trace.errors
    trace.check_rows(last_layer_rows="all")
    assert max(trace.evals[0]["positions"]) >= window  # the window does cut
    for r in trace.records["attn"]:
        lim = window if r["layer"] in swa else None
        assert r["attended"] == [p + 1 if lim is None else min(p + 1, lim) for p in r["positions"]]


# ---------------------------------------------------------------- the callback itself, in-process


def _tensor(name: bytes, ne: tuple[int, ...], nb: tuple[int, ...], data: int, typ: int = 0) -> Any:
    t = llama_engine.GgmlTensor()
    t.name = name
    t.type = typ
    for i in range(4):
        t.ne[i] = ne[i] if i < len(ne) else 1
        t.nb[i] = nb[i] if i < len(nb) else nb[-1] * t.ne[i - 1]
    t.data = data
    return t


def test_callback_asks_only_for_its_tensors_and_never_raises(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    tr = llama_engine.GraphTrace(str(path), 1e-2, flash_attn=False)
    cb = tr._callback
    # a strided view, as ffn_moe_topk is of the argsort: 2 of each row of 8
    argsort = (ctypes.c_int32 * 24)(*[(i * 5 + 3) % 8 for i in range(24)])
    topk = _tensor(b"ffn_moe_topk-3", (2, 3), (4, 32), ctypes.addressof(argsort), llama_engine.GGML_TYPE_I32)
    assert llama_engine._read(topk)[0, 0].tolist() == [[3, 0], [3, 0], [3, 0]]
    wanted = [b"ffn_moe_topk-3", b"ffn_moe_weighted-0", b"ffn_moe_probs-12", b"kq_soft_max-1"]
    wanted += [b"ffn_moe_reglu-2", b"ffn_swiglu-0", b"ffn_geglu-7", b"__fattn__-0"]
    for name in wanted:
        assert cb(ctypes.addressof(_tensor(name, (1,), (4,), 0)), True, None) is True, name
    unwanted = [b"ffn_moe_argsort-3", b"ffn_moe_topk-3 (view)", b"kq-0", b"kqv_out-0", b"result_output"]
    unwanted += [b"ffn_moe_weights-1", b"ffn_moe_topk", b"ffn_moe_topk-x", b""]
    for name in unwanted:
        assert cb(ctypes.addressof(_tensor(name, (1,), (4,), 0)), True, None) is False, name
    # errors inside the callback (no data, no src, no llm) are recorded and the graph goes on
    assert cb(ctypes.addressof(_tensor(b"ffn_moe_topk-0", (2, 3), (4, 32), 0, 26)), False, None) is True
    assert cb(ctypes.addressof(_tensor(b"kq_soft_max-0", (8, 3), (4, 32), 0)), False, None) is True
    assert cb(None, False, None) is True and cb(None, True, None) is False
    tr.flush()
    errors = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kind"] for r in errors] == ["error", "error"]
    assert [r["name"] for r in errors] == ["ffn_moe_topk-0", "kq_soft_max-0"]
