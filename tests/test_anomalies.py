"""Anomaly detectors (store/anomalies/): each finds its planted anomaly at the right request and
decode order and stays quiet on clean data; `Recording.anomalies()` and `report --anomalies` show
them; `report` fits 80 columns without cutting a header; on a real engine recording the
repetition detector finds exactly the loops greedy decoding produced."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from conftest import Engine, Recorder, run_cli
from rich.console import Console

import sparseety_prof
from sparseety_prof.store import anomalies, schema
from sparseety_prof.store.recording_writer import RecordingWriter
from sparseety_prof.views.report import print_report

N_TOKENS = 60
REQUESTS = ("r0-0-1", "5f0c9f2e-7c1e-4bb1-9d43-2a8f6d1e0b77")  # a segmented id and a long HTTP id
N_LAYERS = 4
N_EXPERTS = 8
META: dict[str, Any] = {
    "layers": {"moe": [0, 1, 2, 3], "ffn": [0, 1, 2, 3], "attn": [0, 1, 2, 3]},
    "model": {"hyperparameters": {"expert_count": N_EXPERTS, "expert_used_count": 2}},
}


class Fixture:
    """Clean synthetic tables: two requests of N_TOKENS decode-ordered tokens, distinct token ids,
    log-probs around -1, random top-2 routing over 8 experts in 4 layers, ~50% activation zeros,
    full attention, 1 ms steps with a little jitter. Tests plant one anomaly by editing the arrays."""

    def __init__(self, seed: int = 7) -> None:
        rng = np.random.default_rng(seed)
        shape = (len(REQUESTS), N_TOKENS)
        self.ids = rng.permutation(1000)[: shape[0] * shape[1]].reshape(shape) + 3
        self.log_prob = np.clip(rng.normal(-1.0, 0.4, shape), -3, -0.01)
        self.experts = np.sort(
            np.array(
                [
                    [
                        [rng.choice(N_EXPERTS, 2, replace=False) for _ in range(N_LAYERS)]
                        for _ in range(N_TOKENS)
                    ]
                    for _ in REQUESTS
                ]
            ),
            axis=-1,
        )
        self.zero = 0.5 + rng.normal(0, 0.01, (*shape, N_LAYERS))
        self.kv = np.broadcast_to(np.arange(10, 10 + N_TOKENS), shape).copy()
        self.attended = np.repeat(self.kv[..., None], N_LAYERS, axis=-1)
        self.step_ms = 1.0 + rng.normal(0, 0.02, shape)
        self.text: dict[tuple[int, int], str] = {}

    def tokens(self) -> pl.DataFrame:
        cols: dict[str, list[object]] = {
            c: [] for c in ("request_id", "seq_id", "decode_order", "pos", "phase")
        }
        for c in ("token_id", "token_text", "log_prob", "step_id", "t_start_ns", "t_end_ns", "partial"):
            cols[c] = []
        for c in ("expert_ids", "act_zero_ratio", "attn_attended", "kv_cells_used"):
            cols[c] = []
        for r, rid in enumerate(REQUESTS):
            for t in range(N_TOKENS):
                step = self._step(r, t)
                cols["request_id"].append(rid)
                cols["seq_id"].append(r)
                cols["decode_order"].append(t)
                cols["pos"].append(int(self.kv[r, t]))
                cols["phase"].append("prefill" if t == 0 else "decode")
                cols["token_id"].append(int(self.ids[r, t]))
                cols["token_text"].append(self.text.get((r, t), f"w{self.ids[r, t]}"))
                cols["log_prob"].append(float(self.log_prob[r, t]))
                cols["step_id"].append(step)
                cols["t_start_ns"].append(step * 10_000_000)
                cols["t_end_ns"].append(step * 10_000_000 + int(self.step_ms[r, t] * 1e6))
                cols["partial"].append(False)
                cols["expert_ids"].append(self.experts[r, t].tolist())
                cols["act_zero_ratio"].append(self.zero[r, t].tolist())
                cols["attn_attended"].append(self.attended[r, t].tolist())
                cols["kv_cells_used"].append(int(self.kv[r, t]))
        return schema.frame("tokens", cols, absent=schema.TOKENS.keys() - cols.keys())

    def steps(self) -> pl.DataFrame:
        tok = self.tokens()
        cols = {
            "step_id": tok["step_id"].to_list(),
            "t_start_ns": tok["t_start_ns"].to_list(),
            "t_end_ns": tok["t_end_ns"].to_list(),
            "phase": tok["phase"].to_list(),
            "n_tokens": [1] * tok.height,
        }
        return schema.frame("steps", cols, absent=schema.STEPS.keys() - cols.keys())

    @staticmethod
    def _step(r: int, t: int) -> int:
        return r * N_TOKENS + t

    def detect(self) -> pl.DataFrame:
        return anomalies.detect(self.tokens(), self.steps(), META)

    def write(self, path: Path) -> Path:
        w = RecordingWriter(path, {"engine": {"name": "test", "version": "1"}, **META})
        w.append("tokens", self.tokens())
        w.append("steps", self.steps())
        reqs: dict[str, list[object]] = {
            "request_id": list(REQUESTS),
            "id_source": ["segmented", "header"],
            "ttft_ms": [12.5, 30.25],
            "itl_p50_ms": [6.25, 7.5],
            "end_reason": ["eos", "released"],
        }
        w.append("requests", schema.frame("requests", reqs, absent=schema.REQUESTS.keys() - reqs.keys()))
        w.close()
        return path


def _where(found: pl.DataFrame) -> list[tuple[Any, ...]]:
    return [
        tuple(r)
        for r in found.select("kind", "request_id", "decode_order", "decode_order_end", "layer").iter_rows()
    ]


def test_the_clean_fixture_has_no_anomalies() -> None:
    found = Fixture().detect()
    assert found.schema == pl.Schema(schema.ANOMALIES)
    assert found.is_empty(), found


def test_repetition_loop_is_found_where_the_ngram_repeats() -> None:
    f = Fixture()
    f.ids[1, 20:32] = [5, 6, 7] * 4  # a trigram four times
    f.ids[0, 40:44] = [8, 9, 8, 9]  # twice only: not a loop
    found = f.detect()
    assert _where(found) == [("repetition_loop", REQUESTS[1], 20, 31, None)]
    assert found["score"][0] == 4.0 and "[5, 6, 7]" in found["reason"][0] and "period 3" in found["reason"][0]


def test_repetition_loop_reports_the_shortest_period_once() -> None:
    f = Fixture()
    f.ids[0, 10:22] = 42
    f.ids[0, 30:42] = [7, 8] * 6  # also a period-4 and period-6 loop: reported once, at period 2
    assert _where(anomalies.repetition_loops(f.tokens())) == [
        ("repetition_loop", REQUESTS[0], 10, 21, None),
        ("repetition_loop", REQUESTS[0], 30, 41, None),
    ]


def test_logprob_collapse_is_found_in_the_run_of_unlikely_tokens() -> None:
    f = Fixture()
    f.log_prob[0, 25:29] = -9.0
    f.log_prob[1, 30] = -9.0  # one unlikely token is not a collapse
    found = f.detect()
    assert _where(found) == [("logprob_collapse", REQUESTS[0], 25, 28, None)]
    assert found["score"][0] > anomalies.text.LOGPROB_Z and "4 tokens" in found["reason"][0]


def test_routing_collapse_is_found_where_one_layer_stops_changing() -> None:
    f = Fixture()
    f.experts[1, 10:22, 2] = [3, 5]
    f.experts[1, 9, 2], f.experts[1, 22, 2] = [0, 1], [6, 7]
    found = f.detect()
    assert _where(found) == [("routing_collapse", REQUESTS[1], 10, 21, 2)]
    assert found["score"][0] == 12 and "[3, 5]" in found["reason"][0]


def test_routing_collapse_is_quiet_when_every_layer_freezes() -> None:
    f = Fixture()
    f.experts[0, 10:30] = f.experts[0, 10]  # the input froze (a period-1 loop): not a routing fault
    assert anomalies.routing_collapse(f.tokens(), META).is_empty()


def _staggered(f: Fixture) -> None:
    """Steady routing: each token exactly one layer moves to a new pair of experts."""
    for r in range(len(REQUESTS)):
        for t in range(N_TOKENS):
            for layer in range(N_LAYERS):
                k = (t + layer) // N_LAYERS
                f.experts[r, t, layer] = [(2 * k) % N_EXPERTS, (2 * k + 1) % N_EXPERTS]


def test_routing_jump_is_found_at_the_token_whose_experts_all_changed() -> None:
    f = Fixture()
    _staggered(f)
    assert f.detect().is_empty()
    f.experts[0, 30:] = (f.experts[0, 30:] + 3) % N_EXPERTS
    f.experts[0, 30:].sort(axis=-1)
    found = f.detect()
    assert _where(found) == [("routing_jump", REQUESTS[0], 30, 30, None)]
    assert found["score"][0] >= anomalies.routing.JUMP_Z


def test_sparsity_spike_is_found_in_its_layer_and_token() -> None:
    f = Fixture()
    f.zero[1, 17, 1] = 0.95
    found = f.detect()
    assert _where(found) == [("sparsity_spike", REQUESTS[1], 17, 17, 1)]
    assert "95%" in found["reason"][0] and "50%" in found["reason"][0]


def test_attention_collapse_is_found_where_coverage_drops() -> None:
    f = Fixture()
    f.attended[0, 30:34, 3] = 4
    f.attended[0, 40, 2] = 4  # a single token is not a collapse
    found = f.detect()
    assert _where(found) == [("attention_collapse", REQUESTS[0], 30, 33, 3)]
    assert "4 of 43 visible cells" in found["reason"][0]


def test_attention_collapse_needs_enough_cells() -> None:
    f = Fixture()
    f.attended[0, 0:4, 1] = 1  # at 10..13 cells, a short sequence's coverage means little
    f.attended[0, 0:8, 1] = np.minimum(f.attended[0, 0:8, 1], f.kv[0, 0:8])
    assert anomalies.attention_collapse(f.tokens(), META).filter(pl.col("decode_order") < 4).is_empty()


def test_slow_step_is_found_with_the_token_it_produced() -> None:
    f = Fixture()
    f.step_ms[1, 22] = 12.0
    found = f.detect()
    assert _where(found) == [("slow_step", REQUESTS[1], 22, 22, None)]
    assert found["step_id"][0] == N_TOKENS + 22 and "12.00 ms" in found["reason"][0]


def _reshaping_steps(first_decode_ms: list[float]) -> pl.DataFrame:
    """Ten requests on one context: a 5-row prompt step, then 20 one-row decode steps of 1 ms, the
    first of which (a new graph shape for llama.cpp) takes first_decode_ms[request]."""
    cols: dict[str, list[object]] = {c: [] for c in ("step_id", "ctx_id", "t_start_ns", "t_end_ns", "phase")}
    cols["n_tokens"], cols["n_outputs"] = [], []
    for r, first in enumerate(first_decode_ms):
        for t in range(21):
            ms = 5.0 if t == 0 else first if t == 1 else 1.0
            step = r * 21 + t
            cols["step_id"].append(step)
            cols["ctx_id"].append(0)
            cols["t_start_ns"].append(step * 100_000_000)
            cols["t_end_ns"].append(step * 100_000_000 + int(ms * 1e6))
            cols["phase"].append("prefill" if t == 0 else "decode")
            cols["n_tokens"].append(5 if t == 0 else 1)
            cols["n_outputs"].append(1)
    return schema.frame("steps", cols, absent=schema.STEPS.keys() - cols.keys())


def test_slow_steps_compare_a_new_graph_shape_with_its_kind() -> None:
    """The first decode step after a prompt step costs more in every request (llama.cpp builds a
    new graph for it): not slow against the steady decode steps, only against its own kind."""
    tokens = schema.empty("tokens")
    assert anomalies.slow_steps(_reshaping_steps([2.5] * 10), tokens).is_empty()
    found = anomalies.slow_steps(_reshaping_steps([2.5] * 9 + [12.0]), tokens)
    assert found["step_id"].to_list() == [9 * 21 + 1]
    assert "the usual 2.50 ms of steps with a new shape" in found["reason"][0]


def test_a_lone_new_shape_step_is_measured_against_the_steady_steps() -> None:
    """One request: its first decode step is the only one of its kind, so it is measured against
    the steady decode steps at a wider ratio. The usual cost of a new graph (2x) is not slow; a
    stall in that step (12x) is."""
    tokens = schema.empty("tokens")
    one = _reshaping_steps([2.0]).filter(pl.col("step_id") < 21)
    assert anomalies.slow_steps(one, tokens).is_empty()
    stalled = one.with_columns(
        pl.when(pl.col("step_id") == 1)
        .then(pl.col("t_start_ns") + 12_000_000)
        .otherwise(pl.col("t_end_ns"))
        .alias("t_end_ns")
    )
    found = anomalies.slow_steps(stalled, tokens)
    assert found["step_id"].to_list() == [1]
    assert "12.0x the usual 1.00 ms of steady steps" in found["reason"][0]
    assert anomalies.slow_steps(stalled, tokens, ratio=5.0).is_empty()


def test_load_imbalance_is_found_in_the_layer_that_favours_one_expert() -> None:
    f = Fixture()
    rng = np.random.default_rng(3)
    f.experts[:, :, 0, 0] = 0
    f.experts[:, :, 0, 1] = rng.integers(1, N_EXPERTS, (len(REQUESTS), N_TOKENS))
    found = f.detect()
    assert _where(found) == [("load_imbalance", None, None, None, 0)]
    assert found["score"][0] == pytest.approx(4.0) and "expert 0" in found["reason"][0]


def test_detectors_find_nothing_in_redacted_or_empty_tables() -> None:
    f = Fixture()
    f.ids[0, 10:22] = 42
    tok = f.tokens().with_columns(pl.lit(None, dtype=pl.Int32()).alias("token_id"))
    assert anomalies.repetition_loops(tok).is_empty()
    empty = anomalies.detect(schema.empty("tokens"), schema.empty("steps"), None)
    assert empty.is_empty() and empty.schema == pl.Schema(schema.ANOMALIES)


def test_recording_anomalies_and_report_list_them_with_the_tokens_around(tmp_path: Path) -> None:
    f = Fixture()
    f.ids[1, 20:32] = [5, 6, 7] * 4
    f.text[(1, 19)] = "\x1b[2Jevil"  # token text is untrusted: shown escaped
    f.log_prob[0, 25:29] = -9.0
    rec = f.write(tmp_path / "rec")
    got = sparseety_prof.open(rec).anomalies()
    assert sorted(got["kind"].to_list()) == ["logprob_collapse", "repetition_loop"]
    r = run_cli("report", str(rec), "--anomalies", env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())  # lines are wrapped at 80 columns
    assert "anomalies (2)" in out
    assert "repetition_loop" in out and f"request {REQUESTS[1]}, decode order 20-31" in out
    assert "logprob_collapse" in out and "decode order 25-28" in out
    assert "\x1b" not in out and "\\x1b[2Jevil" in out
    # the loop's first tokens, the context before it, then the count of those left out
    assert "w5 w6 w7" in out and "[4 more]" in out
    assert (
        "no anomalies found"
        in run_cli("report", str(Fixture().write(tmp_path / "clean")), "--anomalies").stdout
    )


@pytest.mark.parametrize("width", [80, 120])
def test_report_cuts_no_header_and_fits_the_width(tmp_path: Path, width: int) -> None:
    rec = Fixture().write(tmp_path / "rec")
    con = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    print_report(rec, console=con, anomalies=True)
    out = con.export_text()
    headers = [ln for ln in out.splitlines() if ln.startswith("┃")]
    assert headers and all("…" not in h for h in headers), headers
    assert all(len(ln) <= width for ln in out.splitlines())
    names = (
        "request",
        "tokens",
        "partial",
        "lp mean",
        "lp min",
        "span ms",
        "id",
        "ttft ms",
        "itl p50",
        "end",
    )
    for name in (*names, "phase", "p50", "p99"):
        assert any(name in h for h in headers), name
    assert REQUESTS[1][:20] in out  # the long request id folds, it is not cut
    assert ("requests (1/2)" in out) == (width == 80)  # too many columns for 80: two tables


def _reference_loops(ids: list[int]) -> set[int]:
    """Indices inside some loop, by brute force: every window that is a block of 1..16 ids repeated
    at least 3 times over at least 8 tokens."""
    inside: set[int] = set()
    for p in range(1, anomalies.text.LOOP_MAX_PERIOD + 1):
        for start in range(len(ids)):
            end = start + p
            while end < len(ids) and ids[end] == ids[end - p]:
                end += 1
            span = end - start
            if span >= anomalies.text.LOOP_MIN_SPAN and span / p >= anomalies.text.LOOP_MIN_REPEATS:
                inside.update(range(start, end))
    return inside


PROMPTS = [
    "hello the expert router",
    "the sparse decode sample",
    "one two three",
    "token expert router decode",
    "what is the time",
]


@pytest.mark.root
@pytest.mark.engine
def test_greedy_loops_of_a_real_engine_are_found_where_the_ids_repeat(
    llama_engine: Engine, tmp_path: Path
) -> None:
    rec = Recorder(llama_engine.pid, tmp_path / "rec")
    truth = llama_engine.generate(PROMPTS, max_tokens=220)
    rc, err = rec.stop(signal.SIGINT)
    assert rc == 0, err
    r = sparseety_prof.open(tmp_path / "rec")
    found = r.anomalies()
    tokens = r.tokens()
    order = (
        tokens.group_by("request_id").agg(pl.col("t_end_ns").min()).sort("t_end_ns")["request_id"].to_list()
    )
    assert len(order) == len(PROMPTS)
    loops = found.filter(pl.col("kind") == "repetition_loop")
    looping = 0
    for request_id, want in zip(order, truth, strict=True):
        expected = _reference_loops(want["ids"])
        looping += bool(expected)
        got: set[int] = set()
        for a in loops.filter(pl.col("request_id") == request_id).iter_rows(named=True):
            got.update(range(a["decode_order"], a["decode_order_end"] + 1))
        assert got == expected, (request_id, sorted(got), sorted(expected))
    assert looping, "greedy decoding of the generated model produced no loop to find"
    # the model's own statistics are unremarkable; step timing is left out (it depends on the load
    # of the machine the engine shares)
    quiet = found.filter(~pl.col("kind").is_in(["repetition_loop", "slow_step"]))
    assert quiet.is_empty(), quiet


def _layer_times(steps: pl.DataFrame, slow: dict[int, tuple[int, float]]) -> pl.DataFrame:
    """Four layers on two threads for every one-row step, the step's time shared evenly between
    layers 1-3 (layer 0's point opens the step: no duration), except `slow`: step -> (layer, ms)."""
    cols: dict[str, list[object]] = {c: [] for c in schema.LAYER_TIMES}
    for sid, t0, t1, n in steps.select("step_id", "t_start_ns", "t_end_ns", "n_tokens").iter_rows():
        if n != 1:
            continue
        layer_ns = {layer: (t1 - t0) // 4 for layer in (1, 2, 3)}
        if sid in slow:
            layer, ms = slow[sid]
            layer_ns = {
                layer: int(ms * 1e6) // 4 if layer != slow[sid][0] else int(ms * 1e6 * 0.7)
                for layer in layer_ns
            }
        for thread, tid in ((0, 100), (1, 101)):
            for layer in range(4):
                cols["step_id"].append(sid)
                cols["ctx_id"].append(0)
                cols["layer"].append(layer)
                cols["thread"].append(thread)
                cols["tid"].append(tid)
                cols["t_ns"].append(t0)
                cols["dur_ns"].append(layer_ns.get(layer))
                cols["lag_ns"].append(0)
    return schema.frame("layer_times", cols)


def test_a_slow_step_names_the_layer_that_took_far_more_than_its_median() -> None:
    tokens = schema.empty("tokens")
    steps = _reshaping_steps([2.5] * 10)
    slow_sid = 3 * 21 + 10
    steps = steps.with_columns(
        pl.when(pl.col("step_id") == slow_sid)
        .then(pl.col("t_start_ns") + 12_000_000)
        .otherwise(pl.col("t_end_ns"))
        .alias("t_end_ns")
    )
    found = anomalies.slow_steps(steps, tokens, layer_times=_layer_times(steps, {slow_sid: (2, 12.0)}))
    assert found["step_id"].to_list() == [slow_sid]
    # layer 2: 0.7 x 12 ms = 8.40 ms against its median 0.25 ms (a quarter of a 1 ms step)
    assert found["reason"][0].endswith(
        ": layer 2 took 33.6x its median (8.40 ms against 0.25 ms, thread 100)"
    )
    # a step slow all over (no one layer beyond its usual share): no layer named
    even = anomalies.slow_steps(steps, tokens, layer_times=_layer_times(steps, {}))
    assert even["step_id"].to_list() == [slow_sid] and "layer" not in even["reason"][0]
