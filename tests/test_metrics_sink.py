"""The Prometheus endpoint of --metrics-port, on frames made here: the exposition text (parsed
with prometheus_client's own parser) has the series series_count() promises, with values
counted independently from the frames; aggregate and redacted routing expose no expert label;
a port in use is refused before attaching. The real engine and a real Prometheus server:
test_metrics_prometheus.py."""

from __future__ import annotations

import os
import socket
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import free_port, run_cli
from prometheus_client.parser import text_string_to_metric_families
from request_latency_oracle import METRICS, want_latencies

from sparseety_prof.cli import build_parser
from sparseety_prof.commands.attach_options import options_from
from sparseety_prof.errors import MetricsEndpointError, UsageError
from sparseety_prof.session.metrics_sink import (
    AGGREGATE,
    AUTO,
    EXPERT_SERIES_BOUND,
    PER_EXPERT,
    PrometheusSink,
    expert_series_plan,
    series_count,
)
from sparseety_prof.session.metrics_tally import NLL_BUCKETS, SPARSITY_BUCKETS
from sparseety_prof.session.options import Progress
from sparseety_prof.session.request_latency import BUCKETS as LATENCY_BUCKETS
from sparseety_prof.session.request_latency import request_latencies
from sparseety_prof.session.run_outputs import metrics_sink_from
from sparseety_prof.store import schema

MOE, FFN, N_EXPERT, K = [1, 3], [0, 1, 2, 3], 4, 2
META = {
    "layers": {"moe": MOE, "ffn": FFN, "attn": FFN},
    "capture": {"routes": True, "activations": True},
    "model": {"hyperparameters": {"expert_count": N_EXPERT, "expert_used_count": K}},
}


def _routes(rng: np.random.Generator, n_rows: int) -> pl.DataFrame:
    """n_rows engine rows, one routes row per FFN layer each (experts on the MoE layers), plus
    rows the tally must not count: a layer outside the model's, an expert id out of range."""
    cols: schema.Columns = {c: [] for c in schema.ROUTES}
    for r in range(n_rows):
        for layer in [*FFN, 9]:
            moe = layer in MOE or layer == 9
            ids = [int(x) for x in rng.choice(N_EXPERT, K, replace=False)] if moe else None
            if r == 0 and layer == 3:
                ids = [0, 17]  # 17 is no expert of the model
            row: dict[str, object] = dict.fromkeys(schema.ROUTES)
            row.update(
                step_id=r,
                layer=layer,
                expert_ids=ids,
                act_zero_ratio=float(rng.random()),
                # on the 0.1 grid, as --redact sparsity stores them
                act_below_ratio=None if r % 5 == 0 else float(rng.integers(0, 11)) / 10,
            )
            for c, v in row.items():
                cols[c].append(v)
    return schema.frame("routes", cols)


def _tokens(log_probs: list[float | None]) -> pl.DataFrame:
    cols: schema.Columns = {c: [None] * len(log_probs) for c in schema.TOKENS}
    cols["log_prob"] = list(log_probs)
    return schema.frame("tokens", cols)


def _steps(durations_ns: list[int], phases: list[object]) -> pl.DataFrame:
    cols: schema.Columns = {c: [None] * len(phases) for c in schema.STEPS}
    cols.update(t_start_ns=[1000] * len(phases), t_end_ns=[1000 + d for d in durations_ns], phase=phases)
    return schema.frame("steps", cols)


def _scrape(sink: PrometheusSink) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """sample name -> labels -> value, from the endpoint over HTTP."""
    with urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _fed(
    experts: str, redact: frozenset[str] = frozenset(), redact_layers: frozenset[int] | None = None
) -> tuple[PrometheusSink, pl.DataFrame]:
    rng = np.random.default_rng(7)
    sink = PrometheusSink("127.0.0.1", 0, experts=experts, redact=redact, redact_layers=redact_layers)
    sink.open(META)
    routes = [_routes(rng, 6), _routes(rng, 3)]
    for df in routes:
        sink.take("routes", df)
    sink.take("tokens", _tokens([-0.005, -3.0, None, -20.0]))
    sink.take("tokens", _tokens([0.0]))
    sink.take("steps", _steps([2_000_000, 30_000_000, 400_000], ["decode", "prefill", "decode"]))
    sink.take("requests", schema.frame("requests", {c: [None, None] for c in schema.REQUESTS}))
    sink.drained(Progress(cpu_s=1.5, rss_bytes=123456, lag_ms=40.0, kernel_drops=2, seq_gaps=1))
    return sink, pl.concat(routes)


def test_exposition_has_the_promised_series_and_the_counted_values() -> None:
    sink, routes = _fed(PER_EXPERT)
    try:
        got = _scrape(sink)
    finally:
        sink.stop()
    n = sum(len(v) for v in got.values())
    assert n == series_count(len(MOE), N_EXPERT, len(FFN), PER_EXPERT)

    # expert selections: counted here row by row, in Python (layer 9 and expert 17 are not the model's)
    want: Counter[tuple[str, str]] = Counter()
    rows: Counter[str] = Counter()
    for layer, ids in routes.select("layer", "expert_ids").iter_rows():
        if layer in MOE and ids:
            rows[str(layer)] += 1
            want.update((str(layer), str(e)) for e in ids if e < N_EXPERT)
    sel = got["sparseety_expert_selections_total"]
    assert len(sel) == len(MOE) * N_EXPERT  # every expert, selected or not
    assert {(d["layer"], d["expert"]): v for d, v in ((dict(k), v) for k, v in sel.items())} == {
        (str(layer), str(e)): float(want[(str(layer), str(e))]) for layer in MOE for e in range(N_EXPERT)
    }
    assert {dict(k)["layer"]: v for k, v in got["sparseety_moe_rows_total"].items()} == {
        k: float(v) for k, v in rows.items()
    }
    for layer in MOE:
        counts = [want[(str(layer), str(e))] for e in range(N_EXPERT)]
        assert got["sparseety_expert_load_max_share"][(("layer", str(layer)),)] == pytest.approx(
            max(counts) / sum(counts)
        )
        assert got["sparseety_expert_load_imbalance"][(("layer", str(layer)),)] == pytest.approx(
            max(counts) / (sum(counts) / N_EXPERT)
        )

    # sparsity histograms: cumulative bucket counts, by layer
    for name, col in (
        ("activation_zero_ratio", "act_zero_ratio"),
        ("activation_below_ratio", "act_below_ratio"),
    ):
        for layer in FFN:
            vals = routes.filter(pl.col("layer") == layer)[col].drop_nulls().to_list()
            for b in SPARSITY_BUCKETS:
                key = (("layer", str(layer)), ("le", str(b)))
                # compared as stored (float32): 0.3 is in the 0.3 bucket, though above float64 0.3
                want_le = sum(np.float32(v) <= np.float32(b) for v in vals)
                assert got[f"sparseety_{name}_bucket"][key] == want_le, (name, layer, b)
            assert got[f"sparseety_{name}_count"][(("layer", str(layer)),)] == len(vals)
            assert got[f"sparseety_{name}_sum"][(("layer", str(layer)),)] == pytest.approx(
                sum(vals), rel=1e-6
            )

    nll = [0.005, 3.0, 20.0, 0.0]
    for b in NLL_BUCKETS:
        assert got["sparseety_token_nll_bucket"][(("le", str(b)),)] == sum(v <= b for v in nll)
    assert got["sparseety_token_nll_count"][()] == 4 and got["sparseety_token_nll_sum"][()] == 23.005
    assert got["sparseety_tokens_total"][()] == 5  # the row with no log-prob is still a token
    assert got["sparseety_step_seconds_count"] == {(("phase", "decode"),): 2.0, (("phase", "prefill"),): 1.0}
    assert got["sparseety_step_seconds_sum"][(("phase", "decode"),)] == pytest.approx(0.0024)
    assert got["sparseety_step_seconds_bucket"][(("le", "0.001"), ("phase", "decode"))] == 1
    assert got["sparseety_requests_total"][()] == 2
    assert got["sparseety_losses_total"] == {
        (("kind", "kernel_drops"),): 2.0,
        (("kind", "logits_incomplete"),): 0.0,
        (("kind", "seq_gaps"),): 1.0,
    }
    assert got["sparseety_profiler_cpu_seconds_total"][()] == 1.5
    assert got["sparseety_profiler_resident_memory_bytes"][()] == 123456
    assert got["sparseety_profiler_lag_seconds"][()] == pytest.approx(0.04)
    assert "sparseety_sparse_coverage_ratio" not in got  # no duty cycle: every step in detail


def test_the_duty_cycles_coverage_is_a_gauge() -> None:
    sink, _ = _fed(PER_EXPERT)
    try:
        sink.drained(Progress(cpu_s=2.0, sparse_coverage=0.25))
        got = _scrape(sink)
    finally:
        sink.stop()
    assert got["sparseety_sparse_coverage_ratio"][()] == 0.25


def test_aggregate_exposes_no_expert_label() -> None:
    sink, _ = _fed(AGGREGATE)
    try:
        got = _scrape(sink)
    finally:
        sink.stop()
    assert sum(len(v) for v in got.values()) == series_count(len(MOE), N_EXPERT, len(FFN), AGGREGATE)
    assert "sparseety_expert_selections_total" not in got
    assert all("expert" not in dict(k) for samples in got.values() for k in samples)
    assert len(got["sparseety_expert_load_imbalance"]) == len(MOE)


def test_redacted_routing_exposes_no_expert_load_for_its_layers() -> None:
    """--redact routing leaves no per-token experts in the rows the sink gets: their layers have
    no expert series at all (not zeros); --redact-layers keeps the others."""
    sink, _ = _fed(PER_EXPERT, redact=frozenset({"routing"}), redact_layers=frozenset({3}))
    try:
        got = _scrape(sink)
    finally:
        sink.stop()
    assert {dict(k)["layer"] for k in got["sparseety_expert_selections_total"]} == {"1"}
    assert {dict(k)["layer"] for k in got["sparseety_expert_load_imbalance"]} == {"1"}
    sink, _ = _fed(PER_EXPERT, redact=frozenset({"routing"}))
    try:
        got = _scrape(sink)
    finally:
        sink.stop()
    assert not any(name.startswith(("sparseety_expert", "sparseety_moe")) for name in got)
    assert "sparseety_activation_zero_ratio_bucket" in got  # sparsity stays


def test_a_model_file_claiming_too_many_experts_gets_no_endpoint() -> None:
    """The expert count comes from the target's model file: past the bounds, open() refuses
    (the fan-out then switches the sink off) and the port is closed, nothing allocated."""
    sink = PrometheusSink("127.0.0.1", 0)
    huge = {**META, "model": {"hyperparameters": {"expert_count": 10**9}}}
    with pytest.raises(ValueError, match="1000000000 experts"):
        sink.open(huge)
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", sink.port), timeout=5):
        pass
    sink = PrometheusSink("127.0.0.1", 0, experts=AGGREGATE)
    many_layers = {**META, "layers": {"moe": list(range(9000)), "ffn": list(range(9000))}}
    with pytest.raises(ValueError, match="9000 MoE layers"):
        sink.open(many_layers)
    # a layer number no model has costs no table as large as it
    sink = PrometheusSink("127.0.0.1", 0)
    try:
        sink.open({**META, "layers": {"moe": [1, 2**40], "ffn": [1, 2**40]}})
        sink.take("routes", _routes(np.random.default_rng(1), 2))
        got = _scrape(sink)
    finally:
        sink.stop()
    assert {dict(k)["layer"] for k in got["sparseety_moe_rows_total"]} == {"1", str(2**40)}
    assert got["sparseety_moe_rows_total"][(("layer", "1"),)] == 2


def test_series_count_grows_with_layers_times_experts() -> None:
    small = series_count(24, 8, 24, PER_EXPERT)
    assert series_count(24, 16, 24, PER_EXPERT) - small == 24 * 8
    assert series_count(24, 16, 24, AGGREGATE) == series_count(24, 8, 24, AGGREGATE)


def test_a_port_in_use_is_refused_before_attaching(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(MetricsEndpointError, match=f"127.0.0.1:{port}"):
            PrometheusSink("127.0.0.1", port)
        # as a command: the error and its code, and nothing attached or created (the pid is this
        # test's own, no engine: attaching would fail with another code)
        r = run_cli(
            "record", "--pid", str(os.getpid()), "-o", str(tmp_path / "rec"), "--metrics-port", str(port)
        )
    assert r.returncode == MetricsEndpointError.exit_code, r.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in r.stderr and "--metrics-port" in r.stderr
    assert not (tmp_path / "rec").exists()
    r = run_cli("attach", "--pid", str(os.getpid()), "--metrics-port", "1", "--metrics-bind", "192.0.2.1")
    assert r.returncode == MetricsEndpointError.exit_code, r.stderr


def test_record_and_attach_flags_make_the_sink() -> None:
    p = build_parser()
    for cmd in ("record", "attach"):
        port = free_port()
        args = p.parse_args(
            [cmd, "--pid", "7", "-o", "rec", "--metrics-port", str(port), "--metrics-experts", "aggregate"]
        )
        sink = metrics_sink_from(options_from(args))
        assert sink is not None
        try:
            assert (sink.host, sink.port, sink.experts) == ("127.0.0.1", port, AGGREGATE)
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass  # listening before anything is attached
        finally:
            sink.stop()
        args = p.parse_args([cmd, "--pid", "7", "-o", "rec"])
        assert metrics_sink_from(options_from(args)) is None
        args = p.parse_args([cmd, "--pid", "7", "-o", "rec", "--metrics-port", "70000"])
        with pytest.raises(UsageError, match="--metrics-port"):
            metrics_sink_from(options_from(args))


# ---------------------------------------------------------------- request latencies (SRE)
NAMED_META = {
    **META,
    "model": {**META["model"], "name": "tiny-moe"},  # type: ignore[dict-item]
    "engine": {"name": "llama-server"},
}
S = 1_000_000_000  # ns per second


def _request(**values: object) -> dict[str, object]:
    row: dict[str, object] = dict.fromkeys(schema.REQUESTS)
    row.update({"partial": False, **values})
    return row


# Requests a server and a plain front end give, and those a latency must leave out: times in
# CLOCK_MONOTONIC ns. Some land exactly on a bucket boundary (it is "le": counted in it).
REQUESTS = [
    # server: read, launched 0.3 s later, first token 0.1 s after the read (a boundary), 5 tokens
    _request(
        t_received_ns=10 * S,
        t_started_ns=10 * S + 3 * S // 10,
        t_first_token_ns=10 * S + S // 10,
        t_last_token_ns=12 * S,
        output_tokens=5,
        end_reason="released",
    ),
    # no socket read (a plain front end): arrival is the start; 0.5 ms to the first token
    _request(
        t_started_ns=20 * S,
        t_first_token_ns=20 * S + 500_000,
        t_last_token_ns=20 * S + 40_500_000,
        output_tokens=2,
        end_reason="eos",
    ),
    # one token: no time per output token
    _request(
        t_received_ns=30 * S,
        t_started_ns=30 * S,
        t_first_token_ns=42 * S,
        t_last_token_ns=42 * S,
        output_tokens=1,
        end_reason="released",
    ),
    # running when the recorder attached: only its time per output token
    _request(
        t_started_ns=40 * S,
        t_first_token_ns=41 * S,
        t_last_token_ns=41 * S + 250_000_000,
        output_tokens=11,
        partial=True,
        end_reason="eos",
    ),
    # ended by the detach: no duration (its end was not seen), the rest stands
    _request(
        t_received_ns=50 * S,
        t_started_ns=51 * S,
        t_first_token_ns=52 * S,
        t_last_token_ns=150 * S,
        output_tokens=300,
        end_reason="detached",
    ),
    _request(
        t_received_ns=60 * S,
        t_started_ns=60 * S + 1,
        t_first_token_ns=60 * S + 2,
        t_last_token_ns=61 * S,
        output_tokens=4,
        end_reason="records_lost",
    ),
    # nothing sampled: no latency at all
    _request(t_received_ns=70 * S, t_started_ns=70 * S + 5, end_reason="detached", output_tokens=0),
    # a server request with null partial (unknown): counted as whole
    _request(
        t_received_ns=80 * S,
        t_started_ns=80 * S + 20_480_000,
        t_first_token_ns=81 * S,
        t_last_token_ns=81 * S + 81_920_000_000 - S,
        output_tokens=3,
        partial=None,
        end_reason="eos",
    ),
]


def test_request_latency_histograms_equal_the_requests_table() -> None:
    """Each SRE histogram's buckets, count and sum, with the model and engine labels, against
    the requests rows counted here one by one; the rows come in two frames."""
    sink = PrometheusSink("127.0.0.1", 0)
    try:
        sink.open(NAMED_META)
        for part in (REQUESTS[:3], REQUESTS[3:]):
            cols = {c: [r[c] for r in part] for c in schema.REQUESTS}
            sink.take("requests", schema.frame("requests", cols))
        got = _scrape(sink)
    finally:
        sink.stop()
    want = want_latencies(REQUESTS)
    assert {k: len(v) for k, v in want.items()} == {
        "time_to_first_token": 6,
        "time_per_output_token": 6,
        "request_duration": 4,
        "request_queue_time": 6,
    }
    labels = (("engine", "llama-server"), ("model", "tiny-moe"))
    assert set(METRICS) == set(LATENCY_BUCKETS)
    for name, bounds in LATENCY_BUCKETS.items():
        metric, values = METRICS[name], want[name]
        assert got[f"{metric}_count"] == {labels: float(len(values))}, name
        assert got[f"{metric}_sum"][labels] == pytest.approx(sum(values), rel=1e-12), name
        buckets = {dict(k)["le"]: v for k, v in got[f"{metric}_bucket"].items()}
        assert buckets == {
            **{str(b): float(sum(v <= b for v in values)) for b in bounds},
            "+Inf": float(len(values)),
        }, name
    # what lands on a boundary is in its bucket: 0.1 s to the first token, 0.02048 s queued
    ttft = {dict(k)["le"]: v for k, v in got["sparseety_time_to_first_token_seconds_bucket"].items()}
    assert ttft["0.1"] - ttft["0.08"] == 1
    assert got["sparseety_requests_total"][()] == len(REQUESTS)


def test_request_latencies_of_a_requests_frame_row_by_row() -> None:
    """request_latencies itself: NaN where a row gives no value, the value where it does."""
    cols = {c: [r[c] for r in REQUESTS] for c in schema.REQUESTS}
    got = request_latencies(schema.frame("requests", cols))
    want = want_latencies(REQUESTS)
    for name in LATENCY_BUCKETS:
        assert got[name][~np.isnan(got[name])].tolist() == want[name], name
    assert np.isnan(got["request_duration"][4]) and got["time_to_first_token"][4] == 2.0
    assert all(np.isnan(got[name][6]) for name in ("time_to_first_token", "time_per_output_token"))


# ---------------------------------------------------------------- expert series bound
def test_expert_series_per_expert_within_the_bound_per_layer_beyond() -> None:
    assert EXPERT_SERIES_BOUND == 2000
    # the tests' model and Mixtral stay per expert; DeepSeek-V3's 58 MoE layers x 256 do not
    for n_moe, n_expert, experts in ((4, 8, PER_EXPERT), (32, 8, PER_EXPERT), (58, 256, AGGREGATE)):
        plan = expert_series_plan(n_moe, n_expert)
        assert (plan.experts, plan.per_expert_series) == (experts, n_moe * n_expert)
    # exactly at the bound is within it; label sets multiply
    assert expert_series_plan(250, 8).experts == PER_EXPERT
    assert expert_series_plan(3, 667).experts == AGGREGATE
    assert expert_series_plan(125, 8, label_sets=2).experts == PER_EXPERT
    assert expert_series_plan(125, 8, label_sets=3).experts == AGGREGATE
    assert expert_series_plan(4, 8, bound=31).experts == AGGREGATE
    # asked for, either stands whatever the shape; and says so
    assert expert_series_plan(58, 256, requested=PER_EXPERT).experts == PER_EXPERT
    assert expert_series_plan(4, 8, requested=AGGREGATE).experts == AGGREGATE
    assert "14848 per-expert series would pass the bound of 2000" in expert_series_plan(58, 256).line()
    assert "within the bound" in expert_series_plan(4, 8).line()
    with pytest.raises(ValueError, match="experts must be one of"):
        expert_series_plan(4, 8, requested="some")
    # series_count resolves auto the same way
    assert series_count(58, 256, 61, AUTO) == series_count(58, 256, 61, AGGREGATE)
    assert series_count(4, 8, 4, AUTO) == series_count(4, 8, 4, PER_EXPERT)


def test_the_endpoint_decides_at_open_and_exposes_the_decision() -> None:
    """auto (the default) with a model past the bound: no expert label, the per-layer gauges, and
    an info series naming the decision; the same sink class within the bound: per expert."""
    cases = ((3, 0, AGGREGATE), (8, 1, PER_EXPERT))  # (bound, _, decision) for the 2 x 4 model
    for bound, _, decision in cases:
        sink = PrometheusSink("127.0.0.1", 0, expert_series_bound=bound)
        try:
            sink.open(META)
            sink.take("routes", _routes(np.random.default_rng(3), 2))
            sink.drained(Progress())
            got = _scrape(sink)
            account = sink.close(META)
        finally:
            sink.stop()
        (info,) = got["sparseety_metrics_experts_info"]
        assert dict(info) == {
            "experts": decision,
            "requested": AUTO,
            "per_expert_series": str(len(MOE) * N_EXPERT),
            "bound": str(bound),
        }
        assert ("sparseety_expert_selections_total" in got) == (decision == PER_EXPERT)
        assert len(got["sparseety_expert_load_imbalance"]) == len(MOE)
        assert sum(len(v) for v in got.values()) == series_count(len(MOE), N_EXPERT, len(FFN), decision)
        assert account["experts"] == decision and account["expert_series"]["experts"] == decision
