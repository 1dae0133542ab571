"""Root tests on a real llama-server engine (xllamacpp) over HTTP: attach by PID while it serves,
send completions, and compare with the token ids and pre-sampling log-probs the server returns."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest
from conftest import ENGINES, Engine, Recorder, align_server_probs, free_port, http_post

import sparseety_prof

pytestmark = [pytest.mark.root, pytest.mark.engine]

PROMPTS = ["hello the expert router", "the sparse decode sample", "one two three four", "what is the time"]
LOGPROB_TOL = 1e-4  # the engine's own log-softmax of the same logits row


@pytest.fixture
def server(models: dict[str, Path]) -> Iterator[Engine]:
    e = Engine([str(ENGINES / "server_engine.py"), str(models["moe"]), "--port", str(free_port())])
    yield e
    e.close()


def test_server_tokens_match_its_own_response(server: Engine, tmp_path: Path) -> None:
    url = server.ready["url"]
    rec = Recorder(server.pid, tmp_path / "rec")
    answers = []
    for p in PROMPTS:
        answers.append(
            http_post(
                url,
                "/completion",
                {
                    "prompt": p,
                    "n_predict": 260,
                    "n_probs": 1,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_tokens": True,
                },
            )
        )
    rc, err = rec.stop(signal.SIGTERM)
    assert rc == 0, err
    r = sparseety_prof.open(tmp_path / "rec")
    tokens = r.tokens()
    assert tokens.height == sum(len(a["tokens"]) for a in answers) >= 1000
    order = tokens.group_by("request_id", maintain_order=True).agg(pl.col("t_end_ns").min()).sort("t_end_ns")
    assert order.height == len(PROMPTS)
    for rid, p, a in zip(order["request_id"], PROMPTS, answers, strict=True):
        got = tokens.filter(pl.col("request_id") == rid).sort("t_end_ns")
        ids = a["tokens"]
        assert got["token_id"].to_list() == ids
        # The server folds a token that ends inside a UTF-8 character into the next one's
        # probability entry; align its entries with the tokens by id.
        matched = align_server_probs(ids, a["completion_probabilities"])
        assert len(matched) >= 0.9 * len(ids)
        texts, lps = got["token_text"].to_list(), got["log_prob"].to_list()
        for i, c in matched:
            assert abs(lps[i] - c["logprob"]) < LOGPROB_TOL, (i, lps[i], c["logprob"])
            if "\ufffd" not in c["token"]:
                assert texts[i] == c["token"]
        probs = ids
        n_prompt = len(http_post(url, "/tokenize", {"content": p, "add_special": True})["tokens"])
        assert got["logits_pos"].to_list() == list(range(n_prompt - 1, n_prompt - 1 + len(probs)))
        assert got["decode_order"].to_list() == list(range(len(probs)))
        assert got["seq_id"].unique().to_list() == [a["id_slot"]]
        assert not got["partial"].any()
    losses = r.meta["losses"]
    assert losses["kernel_drops"] == 0 and losses["seq_gaps"] == 0 and losses["logits_incomplete"] == 0
    assert r.meta["engine"]["name"] == "xllamacpp"


def test_repeated_prompt_is_a_new_request(server: Engine, tmp_path: Path) -> None:
    """The server's prompt cache re-evaluates only the tail: still a new request, decode_order from 0."""
    url = server.ready["url"]
    rec = Recorder(server.pid, tmp_path / "rec")
    body = {
        "prompt": PROMPTS[0],
        "n_predict": 12,
        "n_probs": 1,
        "temperature": 0,
        "ignore_eos": True,
        "return_tokens": True,
        "cache_prompt": True,
    }
    a1, a2 = http_post(url, "/completion", body), http_post(url, "/completion", body)
    rc, err = rec.stop()
    assert rc == 0, err
    tokens = sparseety_prof.open(tmp_path / "rec").tokens()
    reqs = tokens.partition_by("request_id", maintain_order=True)
    assert len(reqs) == 2
    for got, a in zip(reqs, (a1, a2), strict=True):
        assert got["token_id"].to_list() == a["tokens"]
        assert got["decode_order"].to_list() == list(range(12))


def test_two_slots_sequential_requests_reuse_a_slot(models: dict[str, Path], tmp_path: Path) -> None:
    e = Engine(
        [str(ENGINES / "server_engine.py"), str(models["moe"]), "--port", str(free_port()), "--parallel", "2"]
    )
    try:
        rec = Recorder(e.pid, tmp_path / "rec")
        answers = [
            http_post(
                e.ready["url"],
                "/completion",
                {
                    "prompt": p,
                    "n_predict": 20,
                    "n_probs": 1,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_tokens": True,
                },
            )
            for p in (PROMPTS[0], PROMPTS[2], PROMPTS[0])
        ]
        rc, err = rec.stop()
        assert rc == 0, err
    finally:
        e.close()
    tokens = sparseety_prof.open(tmp_path / "rec").tokens()
    reqs = tokens.partition_by("request_id", maintain_order=True)
    assert len(reqs) == 3
    for got, a in zip(reqs, answers, strict=True):
        assert got["token_id"].to_list() == a["tokens"]
        assert got["seq_id"].unique().to_list() == [a["id_slot"]]
        assert got["decode_order"].to_list() == list(range(20))
