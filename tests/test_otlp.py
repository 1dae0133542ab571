"""`--otlp URL`: requests as OpenTelemetry spans, received by a real OTLP/HTTP receiver that decodes
the protobuf (tests/otlp_receiver.py), compared with the recording made alongside and with what the
engine answered; `export DIR --otlp` sends the same spans; a collector that hangs costs the
recording nothing but counted drops."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import ENGINES, Engine, Recorder, free_port, run_cli
from otlp_receiver import Blackhole, OtlpReceiver

import sparseety_prof
from sparseety_prof.session.options import Progress
from sparseety_prof.session.otlp_sink import CLOSE_TIMEOUT_S, EXPORT_TIMEOUT_S, OtlpSink
from sparseety_prof.store import schema

PROMPTS = ["hello the expert router", "the sparse decode sample", "one two three four"]
N_PREDICT = 24
MS = 1_000_000


def _complete(url: str, prompt: str, request_id: str) -> dict[str, Any]:
    body = {
        "prompt": prompt,
        "n_predict": N_PREDICT,
        "temperature": 0,
        "ignore_eos": True,
        "return_tokens": True,
    }
    req = urllib.request.Request(
        url + "/completion",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(json.loads(r.read()))


@pytest.fixture(scope="module")
def server(models: dict[str, Path]) -> Iterator[Engine]:
    e = Engine([str(ENGINES / "server_engine.py"), str(models["moe"]), "--port", str(free_port())])
    yield e
    e.close()


@pytest.fixture(scope="module")
def live(server: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One recording made with --otlp (every token as an event, step spans), its spans as received,
    and the engine's answers."""
    out = tmp_path_factory.mktemp("otlp") / "rec"
    receiver = OtlpReceiver()
    try:
        rec = Recorder(server.pid, out, "--otlp", receiver.url, "--otlp-token-events", "1", "--otlp-steps")
        answers = {
            f"client-{i}": _complete(server.ready["url"], p, f"client-{i}") for i, p in enumerate(PROMPTS)
        }
        rc, err = rec.stop(signal.SIGTERM)
        assert rc == 0, err
        yield {
            "dir": out,
            "spans": list(receiver.spans),
            "answers": answers,
            "stderr": err,
            "bad": receiver.bad,
        }
    finally:
        receiver.close()


def _request_spans(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    req = [s for s in spans if s["name"] != "sparseety.step"]
    by_id = {s["attributes"]["sparseety.request_id"]: s for s in req}
    assert len(by_id) == len(req), "one span per request id"
    return by_id


def test_each_request_is_one_genai_span_matching_the_recording(live: dict[str, Any]) -> None:
    r = sparseety_prof.open(live["dir"])
    requests, tokens = r.requests(), r.tokens()
    assert live["bad"] == []
    spans = _request_spans(live["spans"])
    assert sorted(spans) == sorted(requests["request_id"].to_list()) == sorted(live["answers"])
    # the wall clock offset of the recording, from its own rows (ts_unix_ms = floor((t + offset) / 1 ms))
    offset = tokens.select((pl.col("ts_unix_ms") * MS - pl.col("t_end_ns")).max()).item()
    model = r.meta["model"]["name"] or Path(r.meta["model"]["path"]).name
    for row in requests.iter_rows(named=True):
        s = spans[row["request_id"]]
        a = s["attributes"]
        answer = live["answers"][row["request_id"]]
        assert s["name"] == f"text_completion {model}" and s["kind"] == "SPAN_KIND_CLIENT"
        assert s["parent"] == ""
        assert a["gen_ai.operation.name"] == "text_completion"
        assert a["gen_ai.request.model"] == model
        assert a["gen_ai.response.id"] == row["request_id"]
        assert a["sparseety.request_id.source"] == "header"
        # token counts: the engine's own answer, and the recording's row
        assert a["gen_ai.usage.output_tokens"] == row["output_tokens"] == len(answer["tokens"]) == N_PREDICT
        assert a["gen_ai.usage.input_tokens"] == row["prompt_tokens"] == answer["tokens_evaluated"]
        assert a["sparseety.ttft_ms"] == row["ttft_ms"] > 0
        assert (
            a["sparseety.itl_p50_ms"] == row["itl_p50_ms"] and a["sparseety.itl_p99_ms"] == row["itl_p99_ms"]
        )
        # times: the row's CLOCK_MONOTONIC stamps on the wall clock (offset measured live, within 1 ms)
        assert abs(s["start_ns"] - (row["t_received_ns"] + offset)) < MS
        assert abs(s["end_ns"] - (row["t_last_token_ns"] + offset)) < MS
        assert s["end_ns"] - s["start_ns"] == row["t_last_token_ns"] - row["t_received_ns"]
        # every token an event (rate 1), in order, with the engine's token ids and the recording's log-probs
        toks = tokens.filter(pl.col("request_id") == row["request_id"]).sort("t_end_ns")
        events = s["events"]
        assert [e[2]["sparseety.token.id"] for e in events] == answer["tokens"] == toks["token_id"].to_list()
        assert [e[2]["sparseety.token.log_prob"] for e in events] == toks["log_prob"].to_list()
        assert [e[2]["sparseety.token.text"] for e in events] == toks["token_text"].to_list()
        assert [e[1] - s["start_ns"] for e in events] == [t - row["t_received_ns"] for t in toks["t_end_ns"]]
        # the routing and sparsity summary, recomputed from the recording's token rows
        assert a["sparseety.tokens_recorded"] == toks.height
        assert a["sparseety.log_prob.mean"] == pytest.approx(toks["log_prob"].mean(), rel=1e-12)
        assert a["sparseety.log_prob.min"] == toks["log_prob"].min()
        zero_means = [sum(x) / len(x) for x in toks["act_zero_ratio"].to_list()]
        assert a["sparseety.act_zero_ratio.mean"] == pytest.approx(
            sum(zero_means) / len(zero_means), rel=1e-6
        )
        per_token = toks["expert_ids"].to_list()
        n_layers = len(per_token[0])
        distinct = [len({e for tok in per_token for e in tok[layer]}) for layer in range(n_layers)]
        assert a["sparseety.experts.distinct_per_layer"] == distinct
        assert max(distinct) > r.meta["model"]["hyperparameters"]["expert_used_count"]
        assert s["resource"]["service.name"] == "sparseety-prof"
        assert s["resource"]["process.pid"] == r.meta["target"]["pid"]


def test_step_spans_and_the_account_in_meta(live: dict[str, Any]) -> None:
    r = sparseety_prof.open(live["dir"])
    steps = r.steps()
    step_spans = sorted(
        (s for s in live["spans"] if s["name"] == "sparseety.step"),
        key=lambda s: s["attributes"]["sparseety.step.step_id"],
    )
    assert [s["attributes"]["sparseety.step.step_id"] for s in step_spans] == steps["step_id"].to_list()
    assert [s["end_ns"] - s["start_ns"] for s in step_spans] == (
        steps["t_end_ns"] - steps["t_start_ns"]
    ).to_list()
    assert [s["attributes"]["sparseety.step.n_tokens"] for s in step_spans] == steps["n_tokens"].to_list()
    acc = r.meta["sinks"]["otlp"]
    n_req = r.requests().height
    assert acc["spans"] == {"request": n_req, "step": steps.height}
    assert acc["sent"] == n_req + steps.height == len(live["spans"])
    assert acc["dropped"] == 0 and acc["export_failed"] == 0
    assert acc["token_events"] == r.tokens().height
    assert f"{acc['sent']} of {acc['sent']} spans sent" in live["stderr"]


def test_export_sends_the_same_spans(live: dict[str, Any]) -> None:
    receiver = OtlpReceiver()
    try:
        p = run_cli(
            "export", str(live["dir"]), "--otlp", receiver.url, "--otlp-token-events", "1", "--otlp-steps"
        )
        assert p.returncode == 0, p.stderr
        sent = list(receiver.spans)
    finally:
        receiver.close()
    assert len(sent) == len(live["spans"])
    got, want = _request_spans(sent), _request_spans(live["spans"])
    assert sorted(got) == sorted(want)
    for rid, s in want.items():
        g = got[rid]
        assert g["attributes"] == s["attributes"]
        assert g["end_ns"] - g["start_ns"] == s["end_ns"] - s["start_ns"]
        # offline, the offset comes from the rows' millisecond wall clock: within 1 ms of the live one
        assert abs(g["start_ns"] - s["start_ns"]) < MS
        assert [(n, a) for n, _, a in g["events"]] == [(n, a) for n, _, a in s["events"]]
    assert _step_ids(sent) == _step_ids(live["spans"])


def _step_ids(spans: list[dict[str, Any]]) -> list[int]:
    return sorted(x["attributes"]["sparseety.step.step_id"] for x in spans if x["name"] == "sparseety.step")


def test_a_hanging_collector_costs_only_counted_drops(server: Engine, tmp_path: Path) -> None:
    hole = Blackhole()
    try:
        rec = Recorder(server.pid, tmp_path / "rec", "--otlp", hole.url, "--otlp-steps")
        answers = [_complete(server.ready["url"], p, f"hole-{i}") for i, p in enumerate(PROMPTS)]
        time.sleep(1.5)  # the export thread is now waiting on the collector
        t0 = time.monotonic()
        rc, err = rec.stop(signal.SIGTERM)
        stop_s = time.monotonic() - t0
    finally:
        hole.close()
    assert rc == 0, err
    r = sparseety_prof.open(tmp_path / "rec")
    assert r.complete
    assert sorted(r.requests()["request_id"].to_list()) == [f"hole-{i}" for i in range(len(PROMPTS))]
    assert r.tokens().height == sum(len(a["tokens"]) for a in answers)
    acc = r.meta["sinks"]["otlp"]
    total = acc["spans"]["request"] + acc["spans"]["step"]
    assert acc["spans"]["request"] == len(PROMPTS) and total > len(PROMPTS)
    assert acc["sent"] == 0 and acc["export_failed"] + acc["dropped"] == total
    assert acc["close_s"] <= CLOSE_TIMEOUT_S + 1
    assert stop_s < 30, stop_s


def _requests_frame(n: int, t0: int) -> pl.DataFrame:
    cols: dict[str, list[Any]] = {c: [None] * n for c in schema.REQUESTS}
    cols.update(
        request_id=[f"r{i}" for i in range(n)],
        id_source=["segmented"] * n,
        ctx_id=[0] * n,
        seq_id=[0] * n,
        t_started_ns=[t0 + i * 1000 for i in range(n)],
        t_first_token_ns=[t0 + i * 1000 + 10 for i in range(n)],
        t_last_token_ns=[t0 + i * 1000 + 500 for i in range(n)],
        output_tokens=[1] * n,
        partial=[False] * n,
        pid=[1] * n,
    )
    return schema.frame("requests", cols)


def test_a_full_queue_never_blocks_the_consumer_and_every_span_is_counted() -> None:
    """More spans than the queue holds, to a collector that hangs: each call returns at once,
    what the queue cannot hold is counted as dropped, and close gives up within its bound."""
    hole = Blackhole()
    queue = 64
    sink = OtlpSink(hole.url, wall_offset_ns=0, queue_spans=queue)
    n = queue * 4
    try:
        sink.open({"model": {"name": "m"}, "engine": {"name": "e"}})
        t0 = time.monotonic()
        sink.take("requests", _requests_frame(n, 1_000_000_000))
        sink.drained(Progress())
        took = time.monotonic() - t0
        t1 = time.monotonic()
        acc = sink.close({})
        close_s = time.monotonic() - t1
    finally:
        hole.close()
    assert took < EXPORT_TIMEOUT_S / 3, took  # never waited for a send (one takes EXPORT_TIMEOUT_S)
    assert acc["spans"] == {"request": n, "step": 0}
    assert acc["sent"] == 0 and acc["export_failed"] + acc["dropped"] == n
    assert acc["dropped"] >= n - queue  # at least what the queue could not hold
    assert close_s <= CLOSE_TIMEOUT_S + 1 and acc["close_s"] <= CLOSE_TIMEOUT_S + 1


@pytest.mark.parametrize(
    "args, message",
    [
        (("--otlp", "ftp://collector:4318"), "--otlp: not an http(s) URL"),
        (("--otlp", "http://127.0.0.1:4318", "--otlp-token-events", "1.5"), "within 0..1"),
        (("--otlp-steps",), "need --otlp URL"),
    ],
)
def test_bad_otlp_flags_are_usage_errors(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    p = run_cli("record", "--pid", "1", "-o", str(tmp_path / "rec"), *args)
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert not (tmp_path / "rec").exists()
    q = run_cli("export", str(tmp_path), *args)
    assert q.returncode == 2 and message in q.stderr, q.stderr


def _tokens_frame(request_id: str, t_end: list[int]) -> pl.DataFrame:
    n = len(t_end)
    cols: dict[str, list[Any]] = {c: [None] * n for c in schema.TOKENS}
    cols.update(
        request_id=[request_id] * n,
        ctx_id=[0] * n,
        seq_id=[0] * n,
        decode_order=list(range(n)),
        token_id=[100 + i for i in range(n)],
        token_text=[f"tok{i}" for i in range(n)],
        log_prob=[-0.5 * (i + 1) for i in range(n)],
        t_end_ns=t_end,
        expert_ids=[[[i, 7], [3, 4]] for i in range(n)],
        act_zero_ratio=[[0.5, 0.25]] * n,
    )
    return schema.frame("tokens", cols)


def test_spans_carry_rows_as_stored_and_wait_for_their_tokens() -> None:
    """Through the recorder's fan-out with --redact-text: the token events carry ids but no text; a
    requests frame handed over before its tokens frame (one flush) still gets their summary."""
    from sparseety_prof.session.sinks import SinkFanout

    receiver = OtlpReceiver()
    try:
        sink = OtlpSink(receiver.url, token_event_rate=1.0, wall_offset_ns=5_000)
        meta = {"model": {"name": "m"}, "engine": {"name": "e"}}
        fan = SinkFanout([sink], meta, redact_text=True, redact=frozenset(), redact_layers=None, log=print)
        req = _requests_frame(1, 1_000_000)
        fan.take("requests", req.with_columns(pl.lit("r0").alias("request_id")))
        fan.take("tokens", _tokens_frame("r0", [1_000_010, 1_000_300, 1_000_500]))
        fan.drained(Progress())
        acc = fan.close({})["otlp"]
    finally:
        receiver.close()
    assert acc["sent"] == 1 and acc["requests_without_tokens"] == 0 and acc["tokens_of_no_request"] == 0
    (span,) = receiver.spans
    a = span["attributes"]
    assert span["start_ns"] == 1_000_000 + 5_000 and span["end_ns"] == 1_000_500 + 5_000
    assert a["sparseety.tokens_recorded"] == 3
    assert a["sparseety.log_prob.mean"] == pytest.approx(-1.0) and a["sparseety.log_prob.min"] == -1.5
    assert a["sparseety.act_zero_ratio.mean"] == pytest.approx(0.375)
    assert a["sparseety.experts.distinct_per_layer"] == [4, 2]  # {0, 1, 2, 7} and {3, 4}
    assert [e[1] for e in span["events"]] == [1_005_010, 1_005_300, 1_005_500]
    assert [e[2]["sparseety.token.id"] for e in span["events"]] == [100, 101, 102]
    assert all("sparseety.token.text" not in e[2] for e in span["events"])


def test_token_events_are_the_same_tokens_however_the_rows_are_framed() -> None:
    """Rate 0.25 of 12 tokens: 3 events, evenly spaced, alike in one frame (export) or three (live)."""
    from sparseety_prof.session.otlp_spans import TokenSummaries

    rows = _tokens_frame("r0", [1_000 * (i + 1) for i in range(12)])
    whole, parts = TokenSummaries(0.25), TokenSummaries(0.25)
    whole.add(rows, 0)
    for lo, hi in ((0, 5), (5, 6), (6, 12)):
        parts.add(rows.slice(lo, hi - lo), 0)
    a, b = whole.pop("r0", 0, 0), parts.pop("r0", 0, 0)
    assert a is not None and b is not None
    assert [e[2]["sparseety.token.decode_order"] for e in a.events] == [3, 7, 11]
    assert a.events == b.events and a.tokens == b.tokens == 12
