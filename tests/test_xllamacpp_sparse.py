"""Acceptance test of the sparse decisions on a real llama-server engine (xllamacpp): attached by PID
while it serves HTTP completions, the recording's tokens and log-probs equal the server's own
responses, and its MoE routing agrees with the llama-cpp-python graph-trace oracle
(tests/engines/llama_engine.py --graph-trace) fed the same token sequence, teacher-forced: each
request's prompt ids, then the ids the server generated, one at a time."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest
from conftest import ENGINES, Engine, Recorder, align_server_probs, free_port, http_post
from routing_oracle import compare, oracle_routes, read_trace, routes_by_request

import sparseety_prof

pytestmark = [pytest.mark.root, pytest.mark.engine]

# Distinct first words, so the server's prompt cache reuses only the <s> row of the previous prompt.
PROMPTS = ["hello the expert router", "the sparse decode sample", "one two three four", "what is the time"]
N_PREDICT = 50
LOGPROB_TOL = 1e-4  # recorded vs the server's own n_probs answer (same logits row)
# Oracle vs server. llama-server's flash_attn_type is "auto", which is on for this CPU build; the oracle
# runs with --flash-attn too. Measured (4 prompts x 50 tokens, 845 (position, layer) pairs): gate weights
# within 3.2e-4 and router probabilities within 3.0e-4 (without --flash-attn in the oracle: 1.8e-3 and
# 1.5e-3; the server's KV cache and attention kernel differ in rounding, not in what they compute).
WEIGHT_TOL = 1e-3
PROB_TOL = 1e-3
# Two experts whose recorded router probabilities are this close may swap ranks between the kernels.
TIE_TOL = 1e-3
# Measured: 844 of 845 pairs equal; the one difference, request 2 position 23 layer 3, is a near tie
# (recorded [3, 5], oracle [3, 0]; probabilities of the 2nd and 3rd expert 5.6e-5 apart).
MIN_AGREEMENT = 0.98


@pytest.fixture
def server(models: dict[str, Path]) -> Iterator[Engine]:
    e = Engine(
        [str(ENGINES / "server_engine.py"), str(models["moe"]), "--port", str(free_port()), "--threads", "2"]
    )
    yield e
    e.close()


@pytest.fixture
def oracle(models: dict[str, Path], tmp_path: Path) -> Iterator[Engine]:
    trace = tmp_path / "trace.jsonl"
    e = Engine(
        [
            str(ENGINES / "llama_engine.py"),
            str(models["moe"]),
            "--graph-trace",
            str(trace),
            "--threads",
            "2",
            "--flash-attn",
        ]
    )
    yield e
    e.close()


def test_server_routing_agrees_with_teacher_forced_oracle(
    server: Engine, oracle: Engine, tmp_path: Path
) -> None:
    url = server.ready["url"]
    rec = Recorder(server.pid, tmp_path / "rec", "--capture-router-probs")
    answers, prompt_ids = [], []
    for p in PROMPTS:
        answers.append(
            http_post(
                url,
                "/completion",
                {
                    "prompt": p,
                    "n_predict": N_PREDICT,
                    "n_probs": 1,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_tokens": True,
                },
            )
        )
        prompt_ids.append(http_post(url, "/tokenize", {"content": p, "add_special": True})["tokens"])
    rc, err = rec.stop(signal.SIGTERM)
    assert rc == 0, err
    server.close()

    r = sparseety_prof.open(tmp_path / "rec")
    meta = r.meta
    assert meta["engine"]["name"] == "xllamacpp"
    losses = meta["losses"]
    for name in ("kernel_drops", "seq_gaps", "sparse_unattributed", "sparse_unmapped_rows"):
        assert losses[name] == 0, (name, losses)
    assert meta["layer_coverage"]["moe"]["missing"] == []
    # attention from the flash-attention mask (this build leaves the node unnamed: matched by order)
    assert meta["layer_coverage"]["attn"]["missing"] == []
    moe_layers = meta["layers"]["moe"]
    assert moe_layers
    last_layer = max(meta["layers"]["ffn"])

    # ---- tokens and log-probs: the server's own answers, request by request
    tokens = r.tokens()
    # one slot, one sequence in the cache, causal, no sliding window: every earlier cell is attended
    for t in tokens.iter_rows(named=True):
        assert t["attn_attended"] == [t["logits_pos"] + 1] * len(meta["layers"]["attn"]), t["logits_pos"]
        assert t["kv_cells_used"] == t["logits_pos"] + 1
    order = (
        tokens.group_by("request_id", maintain_order=True)
        .agg(pl.col("t_end_ns").min(), pl.col("step_id").max().alias("last_step"))
        .sort("t_end_ns")
    )
    assert order.height == len(PROMPTS)
    for rid, a in zip(order["request_id"], answers, strict=True):
        got = tokens.filter(pl.col("request_id") == rid).sort("t_end_ns")
        assert got["token_id"].to_list() == a["tokens"]
        assert len(a["tokens"]) == N_PREDICT
        lps = got["log_prob"].to_list()
        matched = align_server_probs(a["tokens"], a["completion_probabilities"])
        assert len(matched) >= 0.9 * N_PREDICT
        for i, c in matched:
            assert abs(lps[i] - c["logprob"]) < LOGPROB_TOL, (rid, i, lps[i], c["logprob"])

    # ---- routes per request. One slot and sequential requests: every micro-batch of request k runs
    # after request k-1's last sampled token and up to request k's own last one, and step ids follow
    # execution order, so request k owns the steps in (last_step[k-1], last_step[k]]. (seq_id is the
    # slot, 0 for all; positions restart at 1, not 0, when the cache keeps the previous <s>.) Rows are
    # joined to the oracle by position, never by row index: the server's micro-batches need not match.
    routes = r.routes().filter(pl.col("layer").is_in(moe_layers))
    assert routes.height > 0
    for col in ("expert_ids", "expert_weights", "router_probs"):
        assert routes[col].null_count() == 0, col
    bounds = order["last_step"].to_list()
    assert routes["step_id"].max() <= bounds[-1]
    recorded = routes_by_request(routes, bounds)

    # exactly the rows the server computed: the prompt from where its cache stopped (timings.prompt_n
    # rows evaluated), every generated token but the last (sampled, never evaluated); the last layer's
    # FFN runs only on rows that produce logits, i.e. the prompt's last row and the decode rows
    for k, (a, ids) in enumerate(zip(answers, prompt_ids, strict=True)):
        n_prompt = len(ids)
        first = n_prompt - a["timings"]["prompt_n"]
        assert first <= 1  # distinct prompts: at most the shared <s> was reused
        expected = {
            (pos, layer)
            for pos in range(first, n_prompt + N_PREDICT - 1)
            for layer in moe_layers
            if layer != last_layer or pos >= n_prompt - 1
        }
        assert set(recorded[k]) == expected, (k, sorted(set(recorded[k]) ^ expected))

    # ---- the tokens' per-layer lists are the routes rows of their logits row
    for tok in tokens.iter_rows(named=True):
        rows = routes.filter(
            (pl.col("step_id") == tok["step_id"])
            & (pl.col("seq_id") == tok["seq_id"])
            & (pl.col("pos") == tok["logits_pos"])
        ).sort("layer")
        assert rows["layer"].to_list() == moe_layers, tok["request_id"]
        assert tok["expert_ids"] == rows["expert_ids"].to_list()
        assert tok["expert_weights"] == rows["expert_weights"].to_list()
        assert tok["router_probs"] == rows["router_probs"].to_list()

    # ---- the oracle: same prompt ids, the server's generated ids forced one at a time
    items = [{"prompt_ids": p, "ids": a["tokens"]} for p, a in zip(prompt_ids, answers, strict=True)]
    oracle.send({"teacher_force": items})
    forced = oracle.read(timeout=120)["results"]
    assert [f["ids"] for f in forced] == [a["tokens"] for a in answers]
    lines = read_trace(tmp_path / "trace.jsonl")
    assert lines[0]["flash_attn"]
    truth = oracle_routes(lines, len(PROMPTS))
    agreement = compare(
        recorded,
        truth,
        k_used=lines[0]["n_expert_used"],
        n_expert=lines[0]["n_expert"],
        weight_tol=WEIGHT_TOL,
        prob_tol=PROB_TOL,
        tie_tol=TIE_TOL,
    )
    print(
        f"routing agreement {agreement.rate:.4f} over {agreement.pairs} (position, layer) pairs; "
        f"near-tie differences {agreement.ties}; {agreement.downstream} pairs after a difference"
    )
    assert agreement.pairs >= len(PROMPTS) * N_PREDICT * len(moe_layers) * 0.9
    assert agreement.rate >= MIN_AGREEMENT, (
        f"routing agreement {agreement.rate:.4f} over {agreement.pairs} pairs, ties {agreement.ties}"
    )
