"""The per-request policies on a real llama.cpp engine (llama-cpp-python in-process,
tests/engines/llama_engine.py), three recorders attached at once: `full` (the reference),
`head:0.3` (drawn in the probes), and `tail:0.9` combined with `anomaly:logprob_collapse`. The
requests are ordinary ones, one planted slow request (the engine sleeps TOKEN_DELAY_S between its
tokens: its process is slow, as a stalled engine would be) and one planted log-prob collapse (the
least likely token forced at four decode orders). The planted requests must be kept, the ordinary
ones dropped at the stated rate; every kept request's token ids equal the engine's, and what was
dropped is counted. A fourth recorder, `head:0.3` with `--otlp` (every token an event), sends a
span for every request, those the probes dropped included, from the rows it set apart (its sink
says which columns it reads): compared with the full recording's rows."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from math import sqrt
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import ENGINES, Engine, Recorder
from otlp_receiver import OtlpReceiver
from test_anomalies_planted import realtime

import sparseety_prof
from sparseety_prof.capture import events as ev
from sparseety_prof.session.request_verdicts import TAIL_WARMUP, Tail

pytestmark = [pytest.mark.root, pytest.mark.engine]

#: consecutive prompts differ (llama-cpp-python would reuse the cached prompt of the one before)
PROMPTS = ["hello the expert router", "one two three four", "the sparse decode sample"]
N_ORDINARY = 45
N_TOKENS = 24
TOKEN_DELAY_S = 0.015  # the slow request: about 0.35 s more over its tokens
LEAST_AT = range(10, 14)
HEAD_RATE = 0.3


@dataclass
class Runs:
    full: Any
    head: Any
    tail_anomaly: Any
    head_otlp: Any  # head:HEAD_RATE with --otlp
    spans: list[dict[str, Any]]  # what its receiver decoded
    results: list[dict[str, Any]]  # the engine's, in request order
    ids: list[str]  # request ids in the same order (from the full recording)
    slow: str
    collapse: str


@pytest.fixture(scope="module")
def runs(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    d = tmp_path_factory.mktemp("policies")
    engine = Engine([str(ENGINES / "llama_engine.py"), str(models["moe"])])
    # SCHED_FIFO, so that the other processes of a shared machine (the three recorders among them)
    # do not make the engine's latency drift over the run: a running quantile assumes it does not
    realtime(engine.pid)
    receiver = OtlpReceiver()
    try:
        recs = {
            "full": Recorder(engine.pid, d / "full"),
            "head": Recorder(engine.pid, d / "head", "--policy", f"head:{HEAD_RATE}"),
            "tail_anomaly": Recorder(
                engine.pid, d / "ta", "--policy", "tail:0.9", "--policy", "anomaly:logprob_collapse"
            ),
            "head_otlp": Recorder(
                engine.pid,
                d / "head_otlp",
                "--policy",
                f"head:{HEAD_RATE}",
                "--otlp",
                receiver.url,
                "--otlp-token-events",
                "1",
            ),
        }
        prompts = [PROMPTS[i % 3] for i in range(N_ORDINARY)]
        results = _generate(engine, prompts[:20])
        results += _generate(engine, [PROMPTS[1]], token_delay=TOKEN_DELAY_S)  # the slow one
        results += _generate(engine, prompts[21:30])
        results += _generate(engine, [PROMPTS[2]], force=[{str(i): "least" for i in LEAST_AT}])
        results += _generate(engine, prompts[31:])
        for rec in recs.values():
            rc, err = rec.stop(signal.SIGINT)
            assert rc == 0, err
        opened = {k: sparseety_prof.open(d / ("ta" if k == "tail_anomaly" else k)) for k in recs}
        assert receiver.bad == []
        tokens = opened["full"].tokens()
        ids = (
            tokens.group_by("request_id")
            .agg(pl.col("t_end_ns").min())
            .sort("t_end_ns")["request_id"]
            .to_list()
        )
        assert len(ids) == len(results)
        yield Runs(
            opened["full"],
            opened["head"],
            opened["tail_anomaly"],
            opened["head_otlp"],
            list(receiver.spans),
            results,
            ids,
            ids[20],
            ids[30],
        )
    finally:
        receiver.close()
        engine.close()


def _generate(engine: Engine, prompts: list[str], **extra: Any) -> list[dict[str, Any]]:
    engine.send({"prompts": prompts, "max_tokens": N_TOKENS, "temp": 0.0, "seed": 1, **extra})
    return list(engine.read(timeout=600)["results"])


def _kept_ids_match_the_engine(runs: Runs, rec: Any) -> set[str]:
    """The requests a recording kept; each one's token ids are the engine's, in order."""
    tokens = rec.tokens()
    kept = set(tokens["request_id"].unique())
    engine_ids = dict(zip(runs.ids, (r["ids"] for r in runs.results), strict=True))
    for rid in kept:
        got = tokens.filter(pl.col("request_id") == rid).sort("decode_order")["token_id"].to_list()
        assert got == engine_ids[rid], rid
    return kept


def _rows_of(runs: Runs, rec: Any, table: str, kept: set[str]) -> int:
    """Rows of `table` in the full recording that belong to the kept requests: one sequence, so a
    request owns the steps after the previous request's last token step up to its own."""
    last = runs.full.tokens().group_by("request_id").agg(pl.col("step_id").max())
    bounds = dict(last.iter_rows())
    n = 0
    prev = -1
    for rid in runs.ids:
        if rid in kept:
            steps = runs.full.table(table)["step_id"]
            n += int(((steps > prev) & (steps <= bounds[rid])).sum())
        prev = bounds[rid]
    return n


def test_head_in_the_probes_keeps_the_drawn_share_whole_and_copies_no_logits_of_the_rest(runs: Runs) -> None:
    """head:0.3 alone is drawn in the probes (session/policy.py PolicyChoice.head_in_probes): one draw per
    request at its first token, no logits row copied for a dropped request, and every row of a
    kept one, equal to the full recording's."""
    kept = _kept_ids_match_the_engine(runs, runs.head)
    n = len(runs.ids)
    assert abs(len(kept) / n - HEAD_RATE) <= 4 * sqrt(HEAD_RATE * (1 - HEAD_RATE) / n)  # binomial bound
    meta = runs.head.meta["policy"]
    assert meta["requests"] == {"kept": len(kept), "dropped": n - len(kept)}
    probes = meta["head_in_probes"]
    assert probes["rate"] == HEAD_RATE and probes["keep_below"] == round(HEAD_RATE * 2**32)
    assert probes["draws"] == {"kept": len(kept), "dropped": n - len(kept)}  # one per request
    assert probes["unjudged_requests"] == 0 and probes["logits_rows_copied_mixed"] == 0  # one sequence
    full_tokens = runs.full.tokens()
    dropped_tokens = full_tokens.filter(~pl.col("request_id").is_in(kept)).height
    assert probes["logits_rows_not_copied"] == dropped_tokens
    # nor counted the activations of the steps of their tokens: llama-cpp-python runs one sequence,
    # so every row of such a step is the dropped request's, its prompt's rows included (its last
    # micro-batch's: the one with the output row); up to MAX_UB_TOK rows, which the probes check
    shapes = runs.full.steps().select("step_id", "n_tokens", "n_outputs", "seq_ids")
    dropped_rows = full_tokens.filter(~pl.col("request_id").is_in(kept)).join(shapes, on="step_id")
    assert dropped_rows["step_id"].n_unique() == dropped_rows.height  # one sequence: a token per step
    assert (dropped_rows["seq_ids"].list.len() == 1).all()
    assert (dropped_rows["n_tokens"] > 1).any()  # prompts among them
    uncounted = dropped_rows.filter(pl.col("n_tokens") <= ev.MAX_UB_TOK)
    assert runs.head.meta["act_sampling"]["steps_not_counted"] == uncounted.height
    assert runs.full.meta["act_sampling"]["steps_not_counted"] == 0
    # the kept requests' token rows are the full recording's, log-probs and routing included
    cols = ["request_id", "step_id", "decode_order", "token_id", "log_prob", "top_ids", "entropy"]
    cols += ["expert_ids", "expert_weights", "act_zero_ratio", "attn_attended"]
    got = runs.head.tokens().sort("step_id").select(cols)
    want = full_tokens.filter(pl.col("request_id").is_in(kept)).sort("step_id").select(cols)
    assert got["log_prob"].null_count() == 0
    assert got.equals(want)
    assert meta["rows_dropped"]["tokens"] == full_tokens.height - runs.head.tokens().height
    for table in ("routes", "steps"):
        assert runs.head.table(table).height == _rows_of(runs, runs.head, table, kept), table
        assert meta["rows_dropped"][table] == runs.full.table(table).height - runs.head.table(table).height
    assert runs.head.requests().height == n  # one row per request whatever the policy
    assert runs.head.meta["losses"]["seq_gaps"] == 0 and runs.head.meta["losses"]["kernel_drops"] == 0
    # the routes rows of the dropped requests were counted, never made: all of them after its first
    # token, and its first steps' too where the probes' draw came before them (after its prompt's
    # micro-batch record; a prompt the engine re-evaluates as its last position alone draws
    # nothing, and its first token takes the sequence's last draw)
    first = dict(full_tokens.filter(pl.col("decode_order") == 0).select("request_id", "step_id").iter_rows())
    last = dict(full_tokens.group_by("request_id").agg(pl.col("step_id").max()).iter_rows())
    routes_steps = runs.full.routes()["step_id"]
    before_judged, prev = 0, -1
    for rid in runs.ids:
        if rid not in kept:
            before_judged += int(((routes_steps > prev) & (routes_steps <= first[rid])).sum())
        prev = last[rid]
    dropped_routes = meta["rows_dropped"]["routes"]
    assert dropped_routes - before_judged <= probes["routes_rows_not_made"] <= dropped_routes
    assert probes["routes_rows_not_made"] > dropped_routes / 2
    # the always-on aggregates count every token; the log-prob histogram those whose row was copied
    agg = runs.head.aggregates()
    count = {m: int(agg.filter(pl.col("metric") == m)["count"].sum()) for m in ("tokens", "log_prob")}
    assert count == {"tokens": full_tokens.height, "log_prob": got.height}
    # a dropped request's token rows were all set apart (counted by the aggregates and dropped,
    # never framed whole nor held: nothing but the recording reads them), and its steps rows made
    # after its draw; the aggregates of every token and step are still the full recording's
    apart = probes["rows_set_apart"]
    assert apart["tokens"] == meta["rows_dropped"]["tokens"] == dropped_tokens
    step_ids = runs.full.steps()["step_id"]
    steps_before, prev = 0, -1
    for rid in runs.ids:
        if rid not in kept:
            steps_before += int(((step_ids > prev) & (step_ids < first[rid])).sum())
        prev = last[rid]
    dropped_steps = meta["rows_dropped"]["steps"]
    assert dropped_steps - steps_before <= apart["steps"] <= dropped_steps and apart["steps"] > 0

    def totals(rec: Any, metric: str) -> pl.DataFrame:
        rows = rec.aggregates().filter(pl.col("metric") == metric)
        return rows.group_by("layer", "bin").agg(pl.col("count").sum()).sort("layer", "bin")

    for metric in ("tokens", "expert_load"):
        assert totals(runs.head, metric).equals(totals(runs.full, metric)), metric
    # every step's latency, each recorder's probes timing it (a step near a bin's edge may fall
    # on either side)
    assert totals(runs.head, "step_ms")["count"].sum() == totals(runs.full, "step_ms")["count"].sum()


def test_tail_and_anomaly_keep_the_planted_requests_and_drop_the_ordinary_ones(runs: Runs) -> None:
    rec = runs.tail_anomaly
    kept = _kept_ids_match_the_engine(runs, rec)
    assert runs.slow in kept and runs.collapse in kept
    meta = rec.meta["policy"]
    assert meta["anomalies_fired"] == {"logprob_collapse": 1}
    # tail's verdicts, recomputed from the recording's own requests rows in the order they ended
    tail = Tail(0.9)
    reqs = rec.requests().sort("t_last_token_ns")
    by_tail = {r["request_id"] for r in reqs.to_dicts() if tail.keeps_at_end(r)}
    assert runs.slow in by_tail
    assert kept == by_tail | {runs.collapse}
    ordinary_after_warmup = [r for r in runs.ids[TAIL_WARMUP:] if r not in (runs.slow, runs.collapse)]
    share = len(set(ordinary_after_warmup) & kept) / len(ordinary_after_warmup)
    assert share <= 0.1 + 4 * sqrt(0.1 * 0.9 / len(ordinary_after_warmup))
    assert meta["requests"] == {"kept": len(kept), "dropped": len(runs.ids) - len(kept)}
    assert meta["by_policy"]["anomaly:logprob_collapse"]["kept"] == 1
    assert meta["by_policy"]["tail:0.9"] == {"kept": len(by_tail), "dropped": len(runs.ids) - len(by_tail)}
    assert meta["rows_dropped"]["tokens"] == runs.full.tokens().height - rec.tokens().height
    assert rec.routes().height == _rows_of(runs, rec, "routes", kept)
    assert meta["window"]["overflow_requests"] == 0


def test_a_sink_sees_the_requests_head_sampling_drops_from_the_rows_set_apart(runs: Runs) -> None:
    """With --otlp beside head sampling in the probes, the token rows of the dropped requests are
    still set apart (never framed whole nor held: the sink says which columns it reads), and the
    sink gets those columns: every request's span, the dropped ones' included, carries its tokens
    as events and its routing and sparsity summary, equal to the full recording's rows."""
    rec = runs.head_otlp
    kept = _kept_ids_match_the_engine(runs, rec)
    n = len(runs.ids)
    assert 0 < len(kept) < n
    meta = rec.meta["policy"]
    apart = meta["head_in_probes"]["rows_set_apart"]
    assert apart["tokens"] == meta["rows_dropped"]["tokens"] > 0
    assert apart["steps"] > 0
    assert rec.meta["sinks"]["otlp"]["dropped"] == 0
    spans = {s["attributes"]["sparseety.request_id"]: s for s in runs.spans}
    assert len(spans) == len(runs.spans) == n
    full = runs.full.tokens()
    engine_ids = dict(zip(runs.ids, (r["ids"] for r in runs.results), strict=True))
    for rid in runs.ids:
        a, events = spans[rid]["attributes"], spans[rid]["events"]
        toks = full.filter(pl.col("request_id") == rid).sort("decode_order")
        assert [e[2]["sparseety.token.id"] for e in events] == engine_ids[rid] == toks["token_id"].to_list()
        assert a["sparseety.tokens_recorded"] == toks.height == N_TOKENS
        per_token = toks["expert_ids"].to_list()
        distinct = [len({e for tok in per_token for e in tok[layer]}) for layer in range(len(per_token[0]))]
        assert a["sparseety.experts.distinct_per_layer"] == distinct, rid
        log_probs = [e[2].get("sparseety.token.log_prob") for e in events]
        if rid in kept:  # its logits rows copied, its activations counted: the full recording's
            assert log_probs == toks["log_prob"].to_list()
            zero_means = [sum(x) / len(x) for x in toks["act_zero_ratio"].to_list()]
            mean_zero = sum(zero_means) / len(zero_means)
            assert a["sparseety.act_zero_ratio.mean"] == pytest.approx(mean_zero, rel=1e-6)
        else:  # the probes neither copied a dropped request's logits rows nor counted its activations
            assert log_probs == [None] * N_TOKENS and "sparseety.log_prob.mean" not in a
            assert "sparseety.act_zero_ratio.mean" not in a
