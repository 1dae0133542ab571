"""`diff A B`: recordings written through the real writer, compared by the pure `compare` and by
the CLI (exit 0 equal, 1 different, 2 usage, 7 not a recording)."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import run_cli
from rich.console import Console

from sparseety_prof.store import recording, schema
from sparseety_prof.store.recording_writer import RecordingWriter
from sparseety_prof.views.diff import Tolerances, compare, diff_recordings, render, result_json

VOCAB = ["▁The", "▁cat", "▁sat", "▁on", "▁the", "▁mat", ".", "\n", "▁It", "▁was", "▁warm", "▁and"]
LAYERS = {"moe": [3, 7], "ffn": [0, 3, 7], "attn": [0, 1]}
META = {"engine": {"name": "llama-cpp-python", "version": "0.3.36"}, "layers": LAYERS}

Row = dict[str, Any]
Mutate = Callable[[int, Row], None]


def request(
    rid: str,
    n: int = 10,
    *,
    seq: int = 0,
    t0: int = 0,
    base: int = 100,
    partial: bool = False,
    mutate: Mutate | None = None,
) -> list[Row]:
    """`n` token rows of one request; `mutate(k, row)` edits the row of decode_order k."""
    rows = []
    for k in range(n):
        row: Row = {
            "request_id": rid,
            "ctx_id": 0,
            "seq_id": seq,
            "decode_order": None if partial else k,
            "pos": 20 + k,
            "logits_pos": 19 + k,
            "phase": schema.PHASE_PREFILL if k == 0 else schema.PHASE_DECODE,
            "token_id": base + k,
            "token_text": VOCAB[k % len(VOCAB)],
            "token_source": schema.SOURCE_SAMPLER,
            "log_prob": -0.125 * (k % 5),
            "step_id": k,
            "t_start_ns": t0 + 1_000_000 * k,
            "t_end_ns": t0 + 1_000_000 * k + 900_000,
            "partial": partial,
            "pid": 4242,
            "tid": 4243,
            "expert_ids": [[k % 8, (k + 3) % 8], [2, 5]],
            "expert_weights": [[0.75, 0.25], [0.5, 0.5]],
            "act_zero_ratio": [0.5, 0.25, 0.125 * (k % 4)],
            "attn_attended": [20 + k, 8],
        }
        if mutate is not None:
            mutate(k, row)
        rows.append(row)
    return rows


def tokens(*requests: list[Row]) -> pl.DataFrame:
    rows = [r for req in requests for r in req]
    return schema.frame("tokens", {c: [r.get(c) for r in rows] for c in schema.TOKENS})


def write(path: Path, df: pl.DataFrame, meta: dict[str, Any] | None = None, **kw: Any) -> Path:
    with RecordingWriter(path, META if meta is None else meta, **kw) as w:
        w.append("tokens", df)
    return path


def two_requests(mutate: Mutate | None = None) -> pl.DataFrame:
    """Two concurrent requests; `mutate` applies to the second (the later first token)."""
    return tokens(request("r0-0-1", seq=0), request("r0-1-2", seq=1, t0=500_000, base=200, mutate=mutate))


def diverge_at_5(k: int, row: Row) -> None:
    if k >= 5:
        row["token_id"] += 50
        row["token_text"] = f"▁other{k}"
        row["log_prob"] = -2.0
    if k >= 6:  # later routing differs too: conditioned on other tokens, not compared by default
        row["expert_ids"] = [[7, 6], [1, 0]]


def shown(result: Any) -> str:
    buf = io.StringIO()
    render(result, Console(file=buf, width=220, color_system=None), name_a="dense", name_b="sparse")
    return buf.getvalue()


# ------------------------------------------------------------------ compare
def test_identical_runs_are_equal() -> None:
    r = compare(two_requests(), two_requests(), meta_a=META, meta_b=META)
    assert r.equal and r.pairs_different == 0 and r.pairs_diverged == 0
    assert [(p.request_a, p.request_b, p.compared) for p in r.pairs] == [
        ("r0-0-1", "r0-0-1", 10),
        ("r0-1-2", "r0-1-2", 10),
    ]
    assert r.tokens_compared == 20
    assert r.routing is not None and r.routing.agreement == 1.0 and r.routing.set_agreement == 1.0
    assert r.routing.compared == 40 and r.routing.weights_compared == 80
    assert r.act_zero_ratio is not None and r.act_zero_ratio.max_abs_delta == 0
    assert [x.layer.layer for x in r.act_zero_ratio.layers] == [0, 3, 7]
    assert r.attn is not None and r.attn.differing == 0 and r.attn.compared == 40
    assert r.log_prob.max_abs_delta == 0 and r.log_prob.compared == 20
    assert r.not_comparable == {} and r.notes == []
    assert "the runs are equal within tolerances" in shown(r)


def test_a_token_divergence_is_reported_exactly_where_it_happens() -> None:
    r = compare(two_requests(), two_requests(diverge_at_5), meta_a=META, meta_b=META)
    assert not r.equal
    first, second = r.pairs
    assert first.equal and first.divergence is None
    p = second
    assert p.divergence == 5 and r.first_divergence is not None
    assert (r.first_divergence.pair, r.first_divergence.decode_order) == (1, 5)
    assert p.token_a is not None and p.token_b is not None
    assert (p.token_a.token_id, p.token_a.text) == (205, "▁mat")
    assert (p.token_b.token_id, p.token_b.text) == (255, "▁other5")
    assert p.compared == 6  # decode orders 0..5: nothing after the divergence by default
    assert p.token_mismatches == 1
    assert p.first_difference is not None and p.first_difference.kind == "token"
    assert p.first_difference.decode_order == 5
    # routing at 5 is still conditioned on the same history and agrees; 6+ is not compared
    assert p.routing is not None and p.routing.set_agreement == 1.0 and p.routing.compared == 12
    assert p.log_prob.compared == 5 and p.log_prob.max_abs_delta == 0
    # the surrounding tokens, 3 before and after, from both runs
    assert [c.decode_order for c in p.context] == [2, 3, 4, 5, 6, 7, 8]
    assert [c.a.text for c in p.context if c.a] == ["▁sat", "▁on", "▁the", "▁mat", ".", "\n", "▁It"]
    assert [c.b.token_id for c in p.context if c.b] == [202, 203, 204, 255, 256, 257, 258]
    out = shown(r)
    assert "diverges at token 5" in out
    assert "'▁mat' #205" in out and "'▁other5' #255" in out
    assert "'\\n' #207" in out  # control characters are escaped
    assert "◀ diverge" in out and "the runs differ" in out


def test_all_keeps_comparing_after_the_divergence() -> None:
    r = compare(two_requests(), two_requests(diverge_at_5), all_positions=True)
    p = r.pairs[1]
    assert p.divergence == 5 and p.compared == 10 and p.token_mismatches == 5
    assert p.routing is not None and p.routing.set_agreement == pytest.approx(12 / 20)
    assert p.log_prob.compared == 5  # log-probs of different tokens are never compared


def test_a_routing_change_without_a_token_change_names_the_layer() -> None:
    def reroute(k: int, row: Row) -> None:
        if k == 3:
            row["expert_ids"] = [row["expert_ids"][0], [2, 6]]
        if k == 4:  # same set, other order, weights follow their experts: reported, not a difference
            row["expert_ids"] = [row["expert_ids"][0][::-1], [2, 5]]
            row["expert_weights"] = [[0.25, 0.75], [0.5, 0.5]]

    r = compare(two_requests(), two_requests(reroute), meta_a=META, meta_b=META)
    assert not r.equal and r.pairs_diverged == 0
    p = r.pairs[1]
    assert p.divergence is None and p.compared == 10
    rt = p.routing
    assert rt is not None and rt.compared == 20 and rt.same_set == 19 and rt.identical == 18
    assert rt.set_agreement == pytest.approx(0.95) and rt.agreement == pytest.approx(0.9)
    assert rt.first_difference is not None
    w = rt.first_difference.where
    assert (w.pair, w.decode_order) == (1, 3)
    assert w.layer is not None and (w.layer.index, w.layer.layer) == (1, 7)
    assert (rt.first_difference.experts_a, rt.first_difference.experts_b) == ([2, 5], [2, 6])
    assert rt.first_reorder is not None and rt.first_reorder.decode_order == 4
    assert rt.weights_beyond_tol == 0 and rt.max_weight_delta == 0
    assert p.first_difference is not None and p.first_difference.kind == "routing"
    assert "MoE layer 7" in p.first_difference.detail
    assert r.routing is not None and r.routing.agreement == pytest.approx(38 / 40)
    out = shown(r)
    assert "MoE layer 7: [2, 5] vs [2, 6]" in out


def test_without_layer_names_layers_are_named_by_position() -> None:
    def reroute(k: int, row: Row) -> None:
        if k == 3:
            row["expert_ids"] = [row["expert_ids"][0], [2, 6]]

    r = compare(two_requests(), two_requests(reroute))
    assert r.routing is not None and r.routing.first_difference is not None
    layer = r.routing.first_difference.where.layer
    assert layer is not None and (layer.index, layer.layer) == (1, None)
    assert "MoE layer #1" in shown(r)


@pytest.mark.parametrize(
    ("drift", "tol", "equal"), [(5e-4, 1e-3, True), (5e-3, 1e-3, False), (5e-3, 1e-2, True)]
)
def test_log_prob_drift_within_and_beyond_tolerance(drift: float, tol: float, equal: bool) -> None:
    def shift(k: int, row: Row) -> None:
        if k >= 2:
            row["log_prob"] -= drift * (1.5 if k == 6 else 1.0)

    r = compare(two_requests(), two_requests(shift), tolerances=Tolerances(logprob=tol))
    assert r.equal is equal
    lp = r.pairs[1].log_prob
    assert lp.compared == 10
    assert lp.max_abs_delta == pytest.approx(1.5 * drift)
    assert lp.max_at is not None and lp.max_at.decode_order == 6
    if equal:
        assert lp.beyond_tol == 0 and lp.first_beyond is None
    else:
        assert lp.beyond_tol == 8
        assert lp.first_beyond is not None and lp.first_beyond.decode_order == 2
        fd = r.pairs[1].first_difference
        assert fd is not None and (fd.kind, fd.decode_order) == ("log_prob", 2)


def test_weight_ratio_and_attention_differences_against_their_tolerances() -> None:
    def tweak(k: int, row: Row) -> None:
        if k == 2:
            row["expert_weights"] = [[0.75 + 1e-3, 0.25], [0.5, 0.5]]
        if k == 7:
            row["act_zero_ratio"] = [0.5, 0.25 + 0.01, row["act_zero_ratio"][2]]
        if k == 8:
            row["attn_attended"] = [20 + k - 2, 8]

    a, b = two_requests(), two_requests(tweak)
    r = compare(a, b, meta_a=META, meta_b=META)
    p = r.pairs[1]
    assert p.routing is not None and p.routing.set_agreement == 1.0
    assert p.routing.weights_beyond_tol == 1 and p.routing.max_weight_delta == pytest.approx(1e-3, rel=1e-3)
    assert p.routing.first_weight_beyond is not None and p.routing.first_weight_beyond.decode_order == 2
    z = p.act_zero_ratio
    assert z is not None and z.beyond_tol == 1 and z.max_abs_delta == pytest.approx(0.01, rel=1e-4)
    assert z.max_at is not None and z.max_at.layer is not None and z.max_at.layer.layer == 3
    by_layer = {x.layer.layer: x for x in z.layers}
    assert by_layer[3].mean_abs_delta == pytest.approx(0.001, rel=1e-4) and by_layer[0].max_abs_delta == 0
    at = p.attn
    assert at is not None and at.differing == 1 and at.max_abs_delta == 2
    assert at.first_difference is not None and (
        at.first_difference.attended_a,
        at.first_difference.attended_b,
    ) == (
        28,
        26,
    )
    assert p.first_difference is not None and (p.first_difference.kind, p.first_difference.decode_order) == (
        "weights",
        2,
    )
    assert "activation zero ratio by layer" in shown(r)

    loose = compare(a, b, tolerances=Tolerances(weight=1e-2, ratio=0.05))
    fd = loose.pairs[1].first_difference
    assert fd is not None and fd.kind == "attn" and fd.decode_order == 8  # attended cells: no tolerance


def test_requests_are_paired_by_first_token_time_and_count_mismatches_reported() -> None:
    a = tokens(
        request("r0-0-1", seq=0, t0=0),
        request("r0-1-2", seq=1, t0=400_000, base=200),
        request("r0-0-3", seq=0, t0=50_000_000, base=300),
    )
    # other ids, rows written out of order: only first-token time pairs them
    b = tokens(request("r0-3-9", seq=3, t0=7_000_000, base=200), request("r0-2-8", seq=2, t0=6_000_000))
    r = compare(a, b)
    assert [(p.request_a, p.request_b) for p in r.pairs] == [("r0-0-1", "r0-2-8"), ("r0-1-2", "r0-3-9")]
    assert all(p.equal for p in r.pairs)
    assert r.unpaired_a == ["r0-0-3"] and r.unpaired_b == []
    assert not r.equal
    assert any("request counts differ: A has 3, B 2" in n for n in r.notes)
    assert "unpaired: A ['r0-0-3']" in shown(r)


def test_pairs_that_differ_at_their_first_token_hint_at_a_wrong_pairing() -> None:
    a = tokens(request("a", t0=0), request("b", seq=1, t0=10, base=200), request("c", seq=2, t0=20, base=300))
    b = tokens(request("a", t0=0, base=200), request("b", seq=1, t0=10, base=300), request("c", seq=2, t0=20))
    r = compare(a, b)
    assert [p.divergence for p in r.pairs] == [0, 0, 0]
    assert any("pairing by first-token time may be wrong" in n for n in r.notes)


def test_columns_not_captured_are_not_comparable_never_different() -> None:
    def dense(k: int, row: Row) -> None:
        row["expert_ids"], row["expert_weights"], row["act_zero_ratio"] = [], [], None

    def no_routing(k: int, row: Row) -> None:
        row["expert_ids"] = row["expert_weights"] = row["attn_attended"] = None

    a = tokens(request("r1", mutate=dense))
    b = tokens(request("r2", mutate=no_routing))
    r = compare(a, b)
    assert r.equal
    assert r.not_comparable == {
        "expert_ids": "empty lists (no MoE layers: a dense model?) in A, not captured in B",
        "expert_weights": "empty lists (no MoE layers: a dense model?) in A, not captured in B",
        "act_zero_ratio": "not captured in A",
        "attn_attended": "not captured in B",
    }
    assert r.routing is None and r.act_zero_ratio is None and r.attn is None
    assert r.pairs[0].routing is None
    assert r.log_prob.compared == 10
    out = shown(r)
    assert "not comparable" in out and "expert_ids: empty lists" in out


def test_partial_requests_are_excluded_and_said_so() -> None:
    a = tokens(request("early", t0=0, base=900, partial=True, n=4), request("r0-0-1", t0=5_000_000))
    b = tokens(request("r0-0-7", t0=1_000))
    r = compare(a, b)
    assert r.equal
    assert [(p.request_a, p.request_b) for p in r.pairs] == [("r0-0-1", "r0-0-7")]
    assert (r.a.partial_requests, r.a.partial_rows, r.a.requests) == (1, 4, 1)
    assert (r.b.partial_requests, r.b.requests) == (0, 1)
    assert any("A: 1 partial request(s) (4 token rows)" in n and "excluded" in n for n in r.notes)


def test_a_run_that_goes_on_with_the_same_tokens_differs_in_length() -> None:
    r = compare(tokens(request("r", n=10)), tokens(request("s", n=12)))
    p = r.pairs[0]
    assert not r.equal and p.divergence is None and p.length_difference == "B"
    assert p.first_difference is not None and (p.first_difference.kind, p.first_difference.decode_order) == (
        "length",
        10,
    )
    one = compare(tokens(request("r", n=1)), tokens(request("s", n=2))).pairs[0]
    assert one.length_difference == "B" and one.first_difference is not None
    assert one.first_difference.detail == "A ends after 1 token, B goes on"


def test_rows_lost_from_one_run_are_gaps_not_differences() -> None:
    a = tokens(request("r")).filter(pl.col("decode_order") != 4)
    r = compare(a, tokens(request("s")))
    assert r.equal and r.pairs[0].gaps_a == 1 and r.pairs[0].compared == 9
    assert any("recorded in one run only" in n for n in r.notes)


def test_layers_named_differently_in_meta_are_matched_by_model_layer() -> None:
    def drop_first_moe(k: int, row: Row) -> None:
        row["expert_ids"], row["expert_weights"] = row["expert_ids"][1:], row["expert_weights"][1:]

    meta_b = {"layers": {"moe": [7], "ffn": [0, 3, 7], "attn": [0, 1]}}
    b = tokens(
        request("x", mutate=drop_first_moe), request("y", seq=1, t0=500_000, base=200, mutate=drop_first_moe)
    )
    r = compare(two_requests(), b, meta_a=META, meta_b=meta_b)
    assert r.equal
    assert r.routing is not None and r.routing.compared == 20  # layer 7 only, both requests
    assert any("only in A: [3]" in n for n in r.notes)


# ------------------------------------------------------------------ recordings, JSON, CLI
def test_redacted_text_shows_ids(tmp_path: Path) -> None:
    a = write(tmp_path / "a", two_requests())
    b = write(tmp_path / "b", two_requests(diverge_at_5), redact_text=True)
    r = diff_recordings(a, b)
    p = r.pairs[1]
    assert p.token_b is not None and p.token_b.text is None and p.token_b.token_id == 255
    out = shown(r)
    assert "#255" in out and "'▁mat' #205" in out
    assert "token 205 '▁mat' in A, 255 in B" in out


def test_json_output_parses_and_carries_the_same_numbers(tmp_path: Path) -> None:
    a = write(tmp_path / "a", two_requests())
    b = write(tmp_path / "b", two_requests(diverge_at_5))
    cp = run_cli("diff", str(a), str(b), "--json")
    assert cp.returncode == 1, cp.stderr
    got = json.loads(cp.stdout)
    assert got["format"] == "sparseety-prof-diff" and got["version"] == 1
    assert got["equal"] is False
    assert got["pairs"][1]["divergence"] == 5
    assert got["pairs"][1]["token_b"] == {"token_id": 255, "text": "▁other5", "log_prob": -2.0}
    assert got["first_divergence"] == {"pair": 1, "decode_order": 5, "layer": None}
    assert got["tolerances"] == {"logprob": 1e-3, "weight": 1e-5, "ratio": 0.0}
    ra, rb = recording.open(a), recording.open(b)
    assert got["a"]["complete"] is True
    expected = result_json(compare(ra.tokens(), rb.tokens(), meta_a=ra.meta, meta_b=rb.meta))
    assert got == json.loads(json.dumps(expected))


def test_cli_exit_status(tmp_path: Path) -> None:
    a = write(tmp_path / "a", two_requests())
    same = write(tmp_path / "same", two_requests())
    other = write(tmp_path / "other", two_requests(diverge_at_5))
    env = {**os.environ, "COLUMNS": "200"}

    cp = run_cli("diff", str(a), str(same), env=env)
    assert cp.returncode == 0, cp.stderr
    assert "the runs are equal within tolerances" in cp.stdout

    cp = run_cli("diff", str(a), str(other), env=env)
    assert cp.returncode == 1, cp.stderr
    assert "diverges at token 5" in cp.stdout and "the runs differ" in cp.stdout

    cp = run_cli("diff", str(a), str(tmp_path / "missing"))
    assert cp.returncode == 2 and "does not exist" in cp.stderr

    (tmp_path / "empty").mkdir()
    cp = run_cli("diff", str(tmp_path / "empty"), str(a))
    assert cp.returncode == 7 and "not a sparseety-prof recording" in cp.stderr

    cp = run_cli("diff", str(a), str(same), "--logprob-tol", "-1")
    assert cp.returncode == 2 and "must be >= 0" in cp.stderr


def test_cli_tolerances_and_all_reach_the_comparison(tmp_path: Path) -> None:
    def shift(k: int, row: Row) -> None:
        row["log_prob"] -= 5e-3

    a = write(tmp_path / "a", two_requests())
    b = write(tmp_path / "b", two_requests(shift))
    assert run_cli("diff", str(a), str(b)).returncode == 1
    assert run_cli("diff", str(a), str(b), "--logprob-tol", "0.01").returncode == 0
    c = write(tmp_path / "c", two_requests(diverge_at_5))
    got = json.loads(run_cli("diff", str(a), str(c), "--json", "--all", "--context", "1").stdout)
    assert got["all_positions"] is True and got["pairs"][1]["compared"] == 10
    assert [row["decode_order"] for row in got["pairs"][1]["context"]] == [4, 5, 6]
