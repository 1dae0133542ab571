"""Root tests of request identity on a real llama-server engine (xllamacpp) with several slots:
concurrent clients with their own X-Request-Id, requests without it, slot reuse, and the
requests table. Ground truth is what the server returned to each client (token ids and
pre-sampling probabilities, return_tokens + n_probs)."""

from __future__ import annotations

import json
import math
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import ENGINES, Engine, Recorder, align_server_probs, free_port

import sparseety_prof
from sparseety_prof.capture import events as ev

pytestmark = [pytest.mark.root, pytest.mark.engine]

LOGPROB_TOL = 1e-4  # the engine's own log-softmax of the same logits row
WORDS = [
    "hello",
    "the",
    "expert",
    "router",
    "decode",
    "sample",
    "sparse",
    "token",
    "layer",
    "gate",
    "value",
    "one",
    "two",
    "three",
]


def post(url: str, body: dict[str, Any], request_id: str | None, header: str = "X-Request-Id") -> Any:
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers[header] = request_id
    req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())


def body(prompt: str, n: int) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "n_predict": n,
        "n_probs": 1,
        "temperature": 0,
        "ignore_eos": True,
        "return_tokens": True,
        "cache_prompt": True,
    }


@pytest.fixture
def server(models: dict[str, Path]) -> Iterator[Engine]:
    e = Engine(
        [str(ENGINES / "server_engine.py"), str(models["moe"]), "--port", str(free_port()), "--parallel", "4"]
    )
    yield e
    e.close()


def at_once(n: int, send: Callable[[int], None]) -> None:
    """send(0) .. send(n - 1), each on its own thread, all at once; any error is raised here."""
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            send(i)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def check_request(tokens: pl.DataFrame, rid: str, answer: dict[str, Any]) -> None:
    got = tokens.filter(pl.col("request_id") == rid).sort("decode_order")
    ids = answer["tokens"]
    assert got["token_id"].to_list() == ids, rid
    assert got["decode_order"].to_list() == list(range(len(ids)))
    assert got["seq_id"].n_unique() == 1
    for i, entry in align_server_probs(ids, answer["completion_probabilities"]):
        assert abs(got["log_prob"][i] - entry["logprob"]) <= LOGPROB_TOL, (rid, i)


def test_concurrent_clients_each_get_their_own_tokens(server: Engine, tmp_path: Path) -> None:
    """10 clients at once on 4 slots: 8 send X-Request-Id, 2 do not. Every token lands on the
    request that asked for it, nothing is lost or invented, and slots are reused."""
    url = server.ready["url"]
    rec = Recorder(server.pid, tmp_path / "rec")
    n_clients = 10
    answers: dict[int, dict[str, Any]] = {}

    def client(i: int) -> None:
        prompt = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 5))
        rid = f"client-{i:02d}" if i < 8 else None
        answers[i] = post(url, body(prompt, 20 + 7 * i), rid)

    at_once(n_clients, client)
    rc, err = rec.stop(signal.SIGTERM)
    assert rc == 0, err
    r = sparseety_prof.open(tmp_path / "rec")
    tokens = r.tokens()
    assert tokens.height == sum(len(a["tokens"]) for a in answers.values())
    for i in range(8):
        check_request(tokens, f"client-{i:02d}", answers[i])
    # the two without a header: distinct generated ids, matched by their token sequences
    generated = sorted(set(tokens["request_id"].to_list()) - {f"client-{i:02d}" for i in range(8)})
    assert len(generated) == 2 and all(g.startswith(f"gen-{server.pid}-") for g in generated)
    by_ids = {
        tuple(tokens.filter(pl.col("request_id") == g).sort("decode_order")["token_id"]): g for g in generated
    }
    for i in (8, 9):
        check_request(tokens, by_ids[tuple(answers[i]["tokens"])], answers[i])
    # 10 requests on 4 slots: slots were reused, each time under the new request's id
    reqs = r.requests()
    assert reqs.height == n_clients
    assert reqs["slot_id"].n_unique() <= 4 and reqs["slot_id"].n_unique() < reqs.height
    assert (reqs["seq_id"] == reqs["slot_id"]).all()
    assert sorted(reqs.filter(pl.col("id_source") == "header")["request_id"]) == [
        f"client-{i:02d}" for i in range(8)
    ]
    assert reqs.filter(pl.col("id_source") == "generated").height == 2
    for i in range(n_clients):
        rid = f"client-{i:02d}" if i < 8 else by_ids[tuple(answers[i]["tokens"])]
        row = reqs.filter(pl.col("request_id") == rid).row(0, named=True)
        a = answers[i]
        assert row["output_tokens"] == len(a["tokens"])
        assert row["prompt_tokens"] == a["tokens_evaluated"]
        assert row["end_reason"] == "released"
        assert (
            row["t_received_ns"] <= row["t_started_ns"] <= row["t_first_token_ns"] <= row["t_last_token_ns"]
        )
        assert (
            0 < row["ttft_ms"] < 60_000 and row["itl_p50_ms"] > 0 and row["itl_p99_ms"] >= row["itl_p50_ms"]
        )
    # batches: several requests shared forward passes
    steps = r.steps()
    assert steps.filter(pl.col("seq_ids").list.len() > 1).height > 0
    # prompt vs decode rows: every token but each request's last is fed back as a decode row
    assert (steps["prompt_rows"] + steps["decode_rows"] == steps["n_tokens"]).all()
    max_decode_rows: int = steps["decode_rows"].max()  # type: ignore[assignment]
    assert steps["decode_rows"].sum() == tokens.height - n_clients and max_decode_rows >= 2
    # prompt rows the engine computed: the prompts less the prefixes it found in its cache
    assert steps["prompt_rows"].sum() == sum(a["timings"]["prompt_n"] for a in answers.values())
    meta = r.meta
    assert meta["losses"]["kernel_drops"] == 0 and meta["losses"]["seq_gaps"] == 0
    assert meta["losses"]["samples_unresolved"] == 0 and meta["losses"]["slot_tokens_unresolved"] == 0
    sv = meta["serving"]
    assert sv["http_requests"] >= n_clients and sv["http_with_header"] >= 8 and sv["tasks_unbound"] == 0
    assert sv["slot_token_mismatch"] == 0


def test_head_in_the_probes_keeps_whole_requests_on_shared_batches(server: Engine, tmp_path: Path) -> None:
    """--policy head:0.5 on 12 clients over 4 slots, whose rows share forward passes: the probes
    draw each request once, at its first output row; a kept request has every token with the
    server's own log-probs; a dropped one's rows are copied only in decodes shared with a kept
    one; a full recorder attached at the same time sees every request."""
    url = server.ready["url"]
    full = Recorder(server.pid, tmp_path / "full")
    head = Recorder(server.pid, tmp_path / "head", "--policy", "head:0.5")
    low = Recorder(server.pid, tmp_path / "low", "--policy", "head:0.05")
    n_clients = 12
    answers: dict[str, dict[str, Any]] = {}

    def client(i: int) -> None:
        prompt = " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(3 + i % 5))
        answers[f"client-{i:02d}"] = post(url, body(prompt, 16 + 3 * i), f"client-{i:02d}")

    at_once(n_clients, client)
    for rec in (full, head, low):
        rc, err = rec.stop(signal.SIGTERM)
        assert rc == 0, err
    r = sparseety_prof.open(tmp_path / "head")
    tokens = r.tokens()
    kept = set(tokens["request_id"].unique().to_list())
    for rid in kept:
        check_request(tokens, rid, answers[rid])
    assert tokens["log_prob"].null_count() == 0
    assert r.requests().height == n_clients  # every request has its row
    meta = r.meta["policy"]
    probes = meta["head_in_probes"]
    assert meta["requests"] == {"kept": len(kept), "dropped": n_clients - len(kept)}
    assert probes["draws"] == meta["requests"], probes  # one draw per request
    assert probes["unjudged_requests"] == 0
    # a dropped request's row is copied when a kept one shares its decode (mixed), else not
    dropped_tokens = sum(len(a["tokens"]) for rid, a in answers.items() if rid not in kept)
    assert probes["logits_rows_not_copied"] <= dropped_tokens
    assert probes["logits_rows_not_copied"] + probes["logits_rows_copied_mixed"] >= dropped_tokens
    full_rec = sparseety_prof.open(tmp_path / "full")
    assert full_rec.tokens().height == tokens.height + dropped_tokens
    assert r.steps().filter(pl.col("seq_ids").list.len() > 1).height > 0  # batches were shared
    # a dropped request's token rows were set apart (nothing but the recording reads them): counted
    # by the aggregates and dropped, as the steps rows whose every slot's request drew drop
    apart, dropped = probes["rows_set_apart"], meta["rows_dropped"]
    assert apart["tokens"] == dropped["tokens"] == dropped_tokens
    assert 0 < apart["steps"] <= dropped["steps"]
    assert full_rec.steps().height == r.steps().height + dropped["steps"]
    assert int(r.aggregates().filter(pl.col("metric") == "tokens")["count"].sum()) == full_rec.tokens().height
    _counts_no_activations_of_dropped_steps(r, full_rec)
    # at head:0.05 most steps the slots share hold dropped requests only
    low_rec = sparseety_prof.open(tmp_path / "low")
    assert _counts_no_activations_of_dropped_steps(low_rec, full_rec) > 0
    assert full_rec.meta["act_sampling"]["steps_not_counted"] == 0
    losses = r.meta["losses"]
    assert losses["kernel_drops"] == 0 and losses["seq_gaps"] == 0 and losses["samples_unresolved"] == 0


def _counts_no_activations_of_dropped_steps(rec: Any, full_rec: Any) -> int:
    """The head-sampling recording `rec` counted no activations of a step all of whose rows are
    requests' it dropped (one row: its aggregate record says so; several: its end record): every
    row an output of such a request, or every row one sequence's whose outputs are (a dropped
    request's prompt, up to MAX_UB_TOK rows), as `full_rec`, made at the same time, shows those
    steps; its kept requests' rows, shared steps' included, have every layer's. Returns how many
    such steps had several rows."""
    kept = rec.tokens()["request_id"].unique().to_list()
    per_step = (
        full_rec.tokens()
        .group_by("step_id")
        .agg(pl.len().alias("outputs"), pl.col("request_id").is_in(kept).any().alias("any_kept"))
    )
    one_prompt = (pl.col("seq_ids").list.len() == 1) & (pl.col("n_tokens") <= ev.MAX_UB_TOK)
    all_dropped = (
        full_rec.steps()
        .join(per_step, on="step_id")
        .filter(
            ((pl.col("n_tokens") == pl.col("n_outputs")) | one_prompt)
            & (pl.col("outputs") == pl.col("n_outputs"))
            & ~pl.col("any_kept")
        )
    )
    assert rec.meta["act_sampling"]["steps_not_counted"] == all_dropped.height
    act = rec.tokens()["act_zero_ratio"]
    assert act.list.eval(pl.element().is_null()).list.any().sum() == 0
    assert act.is_empty() or act.list.len().min() > 0
    return all_dropped.filter(pl.col("n_tokens") > 1).height


def test_slot_reuse_across_sequential_requests(server: Engine, tmp_path: Path) -> None:
    """The same slot serves one request after another (same prompt: the cached prefix makes the
    second look like a continuation to position-based segmentation): each keeps its own id."""
    from conftest import bpf_prog_ids, uprobe_events

    url = server.ready["url"]
    progs_before = bpf_prog_ids()
    rec = Recorder(server.pid, tmp_path / "rec", "--request-header", "X-Trace")
    answers = [post(url, body("one two three four", 12), f"seq-{k}", header="X-Trace") for k in range(3)]
    assert bpf_prog_ids() - progs_before  # uprobes and the socket-read tracepoints
    rc, err = rec.stop(signal.SIGTERM)
    assert rc == 0, err
    # detaching leaves nothing behind: no BPF program, no uprobe event (freed asynchronously)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and bpf_prog_ids() - progs_before:
        time.sleep(0.2)
    assert not (bpf_prog_ids() - progs_before), "BPF programs left loaded"
    assert "xllamacpp" not in uprobe_events()
    r = sparseety_prof.open(tmp_path / "rec")
    tokens = r.tokens()
    for k, a in enumerate(answers):
        check_request(tokens, f"seq-{k}", a)
    reqs = r.requests().sort("t_started_ns")
    assert reqs["request_id"].to_list() == ["seq-0", "seq-1", "seq-2"]
    assert reqs["slot_id"].n_unique() == 1  # llama-server picks the slot holding the prompt
    assert all(not math.isnan(x) for x in reqs["ttft_ms"].to_list())
    # the configuration snapshot: the server's own settings, its process, the host
    cfg = r.meta["config"]
    props = cfg["server"]["props"]
    assert props["total_slots"] == 4 and cfg["server"]["urls"] == [server.ready["url"]]
    assert props["default_generation_settings"]["n_ctx"] > 0
    assert int(cfg["process"]["threads"]) >= 2 and r.meta["host"]["cpus"] >= 1


def test_check_command_passes_and_names_the_layer_that_lost_the_id(server: Engine) -> None:
    """`check` on a healthy server: every layer sees the id. With a probe disabled on purpose,
    it names that layer and exits 9."""
    from conftest import run_cli

    from sparseety_prof.capture import target as tg

    ok = run_cli("check", "--pid", str(server.pid))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for layer in ("entry", "task", "slot", "steps", "tokens", "routing"):
        assert layer in ok.stdout
    assert "LOST" not in ok.stdout and "reached every layer" in ok.stderr
    cases = [
        (["http_reads"], "entry"),
        ([tg.SYM_TASK_POST_ONE, tg.SYM_TASK_POST_VEC], "task"),
        ([tg.SYM_SLOT_LAUNCH], "slot"),
    ]
    for skip, layer in cases:
        flags = [a for s in skip for a in ("--skip-probe", s)]
        bad = run_cli("check", "--pid", str(server.pid), *flags)
        assert bad.returncode == 9, bad.stdout + bad.stderr
        assert f"lost at the {layer} layer" in bad.stderr


def test_parallel_completions_fork_the_parent_sequence(server: Engine, tmp_path: Path) -> None:
    """n_cmpl = 2: llama-server runs the prompt once in a parent slot and forks a child slot
    from it. Both carry the client's id; the child's parent_seq_id is the parent's sequence and
    its tokens, in decode order, are the server's answer for that completion."""
    url = server.ready["url"]
    rec = Recorder(server.pid, tmp_path / "rec")
    b = {**body("hello the expert router", 10), "n_cmpl": 2, "temperature": 1.0, "seed": 3}
    answers = post(url, b, "forked")
    rc, err = rec.stop(signal.SIGTERM)
    assert rc == 0, err
    assert isinstance(answers, list) and len(answers) == 2
    r = sparseety_prof.open(tmp_path / "rec")
    reqs = r.requests().filter(pl.col("request_id") == "forked")
    assert reqs.height == 2
    parent = reqs.filter(pl.col("parent_seq_id").is_null()).row(0, named=True)
    child = reqs.filter(pl.col("parent_seq_id").is_not_null()).row(0, named=True)
    assert child["parent_seq_id"] == parent["seq_id"] != child["seq_id"]
    assert child["prompt_tokens"] == parent["prompt_tokens"]
    tokens = r.tokens().filter(pl.col("request_id") == "forked")
    for a in answers:
        got = tokens.filter(pl.col("seq_id") == a["id_slot"]).sort("decode_order")
        n = len(a["tokens"])
        # the child's first token(s) were generated by the parent before the fork
        assert got["token_id"].to_list() == a["tokens"][n - got.height :]
        assert got["decode_order"].to_list() == list(range(n - got.height, n))
    assert {parent["output_tokens"], child["output_tokens"]} == {len(answers[0]["tokens"])}


def test_check_refuses_an_engine_without_http_server(llama_engine: Engine) -> None:
    """llama-cpp-python has no request objects: `check` says so (exit 4), attaches nothing."""
    from conftest import run_cli

    r = run_cli("check", "--pid", str(llama_engine.pid))
    assert r.returncode == 4, r.stdout + r.stderr
    assert "not an HTTP server engine" in r.stderr
