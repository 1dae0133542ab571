"""The per-request policies (`--policy head:RATE`, `tail:Q`, `anomaly`; session/request_hold.py):
on a simulated stream of two batched sequences running requests back to back, every row of a kept
request reaches the recording and no row of a dropped one does, wherever its rows come from (tokens by
request id; routes and steps by sequence and step, prompt steps before the first token included);
a steps row is kept when any request in it is; the window's bound decides early and counts it. The
real-engine tests are in tests/test_policies_engine.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from math import sqrt

import polars as pl
import pytest

from sparseety_prof.session.metadata import summary_line
from sparseety_prof.session.policy import PolicyChoice, RecordingPolicy, probe_keep_below
from sparseety_prof.session.request_hold import DEFAULT_WINDOW_BYTES, STEPS_AROUND
from sparseety_prof.session.request_verdicts import Tail, head_fraction
from sparseety_prof.store import schema

PROMPT_STEPS = 2
LAYERS = (0, 1)


@dataclass
class Sim:
    """Rows as the consumer makes them, flush by flush, and which request each row belongs to."""

    flushes: list[dict[str, pl.DataFrame]] = field(default_factory=list)
    owner_of_step: dict[tuple[int, int], str] = field(default_factory=dict)  # (step, seq) -> request
    n_tokens: dict[str, int] = field(default_factory=dict)


def simulate(
    n_requests: int, *, tokens_per: int = 6, slow: frozenset[str] = frozenset(), per_flush: int = 7
) -> Sim:
    """Requests r<seq>-<n> alternate over sequences 0 and 1, each PROMPT_STEPS prompt steps then
    tokens_per tokens (the first from the last prompt step); both sequences share every step. A
    request in `slow` takes 50 ms per step, the others 1 ms."""
    sim = Sim()
    queues = {s: [f"r{s}-{n}" for n in range(n_requests) if n % 2 == s] for s in (0, 1)}
    state = {s: (0, 0) for s in (0, 1)}  # seq -> (index in its queue, steps done of the request)
    started: dict[str, int] = {}
    t, step = 0, 0
    rows: dict[str, list[dict[str, object]]] = {"tokens": [], "steps": [], "routes": [], "requests": []}
    steps_in_flush = 0
    while any(state[s][0] < len(queues[s]) for s in (0, 1)):
        step += 1
        active = [s for s in (0, 1) if state[s][0] < len(queues[s])]
        dt = max(50_000_000 if queues[s][state[s][0]] in slow else 1_000_000 for s in active)
        rows["steps"].append(
            {"step_id": step, "ctx_id": 0, "seq_ids": active, "t_start_ns": t, "t_end_ns": t + dt}
        )
        for s in active:
            i, done = state[s]
            rid = queues[s][i]
            started.setdefault(rid, t)
            sim.owner_of_step[(step, s)] = rid
            for layer in LAYERS:
                rows["routes"].append(
                    {"step_id": step, "ctx_id": 0, "seq_id": s, "pos": done, "row": 0, "layer": layer}
                )
            done += 1
            if done >= PROMPT_STEPS:
                order = done - PROMPT_STEPS
                rows["tokens"].append(
                    {
                        "request_id": rid,
                        "ctx_id": 0,
                        "seq_id": s,
                        "step_id": step,
                        "decode_order": order,
                        "token_id": order,
                        "log_prob": -1.0,
                        "t_end_ns": t + dt,
                    }
                )
                sim.n_tokens[rid] = order + 1
            if done >= PROMPT_STEPS + tokens_per - 1:
                rows["requests"].append(
                    {
                        "request_id": rid,
                        "ctx_id": 0,
                        "seq_id": s,
                        "t_started_ns": started[rid],
                        "t_last_token_ns": t + dt,
                        "output_tokens": tokens_per,
                    }
                )
                state[s] = (i + 1, 0)
            else:
                state[s] = (i, done)
        t += dt
        steps_in_flush += 1
        if steps_in_flush == per_flush or not any(state[s][0] < len(queues[s]) for s in (0, 1)):
            sim.flushes.append({k: _frame(k, v) for k, v in rows.items()})
            rows = {k: [] for k in rows}
            steps_in_flush = 0
    return sim


def _frame(table: str, rows: list[dict[str, object]]) -> pl.DataFrame:
    cols: schema.Columns = {c: [r.get(c) for r in rows] for c in getattr(schema, table.upper())}
    return schema.frame(table, cols)


def run(
    sim: Sim,
    specs: list[str],
    window_bytes: int = DEFAULT_WINDOW_BYTES,
    probe_verdicts: dict[str, bool] | None = None,
) -> tuple[dict[str, pl.DataFrame], RecordingPolicy]:
    """The policy over the simulated flushes: every frame it stores, by table."""
    pol = RecordingPolicy(specs, window_bytes=window_bytes, probe_verdicts=probe_verdicts)
    out: dict[str, list[pl.DataFrame]] = {}
    for i, flush in enumerate(sim.flushes):
        for table, df in flush.items():
            for t, kept in pol.take(table, df):
                out.setdefault(t, []).append(kept)
        for t, kept in pol.settle(final=i == len(sim.flushes) - 1):
            out.setdefault(t, []).append(kept)
    return {t: pl.concat(fs) for t, fs in out.items()}, pol


def check_rows(sim: Sim, written: dict[str, pl.DataFrame], kept: set[str], pol: RecordingPolicy) -> None:
    """Exactly the rows of the kept requests, every table; the rest counted as dropped."""
    everything = {t: pl.concat([f[t] for f in sim.flushes]) for t in ("tokens", "steps", "routes")}
    tok = written["tokens"]
    assert sorted(tok["request_id"].unique()) == sorted(kept)
    assert tok.height == sum(sim.n_tokens[r] for r in kept)
    routes = written.get("routes", pl.DataFrame(schema=schema.ROUTES))
    got = sorted(zip(routes["step_id"], routes["seq_id"], routes["layer"], strict=True))
    want = sorted((st, s, lay) for (st, s), r in sim.owner_of_step.items() if r in kept for lay in LAYERS)
    assert got == want
    steps = written.get("steps", pl.DataFrame(schema=schema.STEPS))
    want_steps = {st for (st, _s), r in sim.owner_of_step.items() if r in kept}
    assert sorted(steps["step_id"]) == sorted(want_steps)
    dropped = pol.to_meta()["rows_dropped"]
    for t in ("tokens", "routes", "steps"):
        assert dropped.get(t, 0) + written.get(t, pl.DataFrame()).height == everything[t].height, t
    assert written["requests"].height == everything["tokens"]["request_id"].n_unique()
    meta = pol.to_meta()
    assert meta["requests"] == {"kept": len(kept), "dropped": len(sim.n_tokens) - len(kept)}


def test_head_keeps_the_requests_whose_id_hashes_below_the_rate_and_all_their_rows() -> None:
    sim = simulate(40)
    written, pol = run(sim, ["head:0.3"])
    kept = {r for r in sim.n_tokens if head_fraction(r) < 0.3}
    assert 0 < len(kept) < 40
    check_rows(sim, written, kept, pol)
    assert pol.to_meta()["by_policy"]["head:0.3"] == {"kept": len(kept), "dropped": 40 - len(kept)}


def test_head_in_the_probes_keeps_the_requests_whose_draw_kept_them_and_all_their_rows() -> None:
    """With head sampling in the probes the verdicts are the probes' draws (the correlator puts
    them by request id at a request's first token): taken once each; a request without one is
    kept and counted."""
    sim = simulate(40)
    draws = {r: i % 3 == 0 for i, r in enumerate(sorted(sim.n_tokens))}
    verdicts = {r: k for r, k in draws.items() if r != "r1-39"}  # r1-39: no draw seen
    written, pol = run(sim, ["head:0.3"], probe_verdicts=verdicts)
    kept = {r for r, k in draws.items() if k} | {"r1-39"}
    check_rows(sim, written, kept, pol)
    assert verdicts == {}  # each taken at its request's start
    meta = pol.to_meta()
    assert meta["head_in_probes"] == {"unjudged_requests": 1}
    assert meta["by_policy"]["head:0.3"] == {"kept": len(kept), "dropped": 40 - len(kept)}


@pytest.mark.parametrize(
    ("specs", "rate"),
    [
        (["head:0.25"], 0.25),
        (["aggregate", "head:0.1"], 0.1),  # aggregate keeps nothing a request policy decides
        (["head:0"], 0.0),
        (["head:0.1", "tail:0.99"], None),  # tail decides at the end: every request is captured
        (["head:0.1", "anomaly"], None),
        (["head:0.1", "head:0.2"], None),
        (["full"], None),
        (["aggregate"], None),
        (["tail:0.9"], None),
    ],
)
def test_head_is_drawn_in_the_probes_only_when_nothing_else_may_keep_a_request(
    specs: list[str], rate: float | None
) -> None:
    assert PolicyChoice.parse(specs).head_in_probes == rate


def test_the_probes_threshold_keeps_the_rate_of_32_bit_draws() -> None:
    assert probe_keep_below(0.0) == 0  # no draw is below 0: every request dropped
    assert probe_keep_below(1.0) == 1 << 32  # every u32 draw is below 2^32: every request kept
    assert probe_keep_below(0.25) == 1 << 30
    assert probe_keep_below(1e-12) == 0 and probe_keep_below(0.5) == 1 << 31


def test_head_fraction_is_uniform_and_stable() -> None:
    ids = [f"req-{i}" for i in range(4000)]
    share = sum(head_fraction(i) < 0.1 for i in ids) / len(ids)
    assert abs(share - 0.1) < 4 * sqrt(0.1 * 0.9 / len(ids))
    assert head_fraction("r0-0-1") == head_fraction("r0-0-1")
    assert head_fraction("r0-0-1") == 0.8930146999291153  # BLAKE2b-64 of the id: the same on every machine


def test_tail_keeps_the_slow_request_and_the_warmup() -> None:
    sim = simulate(40, slow=frozenset({"r1-31"}))
    written, pol = run(sim, ["tail:0.9"])
    # the first TAIL_WARMUP requests are kept (no quantile yet); then those beyond the running
    # quantile: here only the slow one and those sharing its steps (every step takes its 50 ms)
    assert "r1-31" in set(written["tokens"]["request_id"])
    ended = pl.concat([f["requests"] for f in sim.flushes])
    tail = Tail(0.9)
    want = set()
    for req in ended.to_dicts():
        if tail.keeps_at_end(req):
            want.add(req["request_id"])
    check_rows(sim, written, want, pol)
    assert len(want) < 20


def test_policies_combine_as_any() -> None:
    sim = simulate(40, slow=frozenset({"r0-20"}))
    head, _ = run(sim, ["head:0.2"])
    tail, _ = run(sim, ["tail:0.95"])
    both, pol = run(sim, ["head:0.2", "tail:0.95"])
    kept = set(head["tokens"]["request_id"]) | set(tail["tokens"]["request_id"])
    assert set(both["tokens"]["request_id"]) == kept
    check_rows(sim, both, kept, pol)
    # each policy's own verdicts, counted once per request
    n_head = len(set(head["tokens"]["request_id"]))
    n_tail = len(set(tail["tokens"]["request_id"]))
    by_policy = pol.to_meta()["by_policy"]
    assert by_policy["head:0.2"] == {"kept": n_head, "dropped": 40 - n_head}
    assert by_policy["tail:0.95"] == {"kept": n_tail, "dropped": 40 - n_tail}


def test_a_full_window_keeps_the_oldest_undecided_requests_early_and_counts_them() -> None:
    sim = simulate(20, tokens_per=20)  # a request's rows span flushes: they wait in the window
    written, pol = run(sim, ["tail:0.99"], window_bytes=1)
    meta = pol.to_meta()
    # every request still running at a flush overflows the window: kept early, counted
    assert meta["window"]["overflow_requests"] > 0
    assert meta["window"]["overflow_decision"] == "kept"
    kept = set(written["tokens"]["request_id"])
    check_rows(sim, written, kept, pol)


def test_anomaly_keeps_a_log_prob_collapse_and_the_steps_around_it() -> None:
    sim = simulate(10, tokens_per=24)
    # plant a collapse: four tokens of r0-4 far below its usual log-prob, right after its start
    fire = None
    for f in sim.flushes:
        tok = f["tokens"]
        hit = (pl.col("request_id") == "r0-4") & pl.col("decode_order").is_between(1, 4)
        first = tok.filter(hit & (pl.col("decode_order") == 1))["step_id"]
        fire = int(first[0]) if first.len() else fire
        f["tokens"] = tok.with_columns(
            pl.when(hit).then(-30.0).otherwise(pl.col("log_prob")).alias("log_prob")
        )
    written, pol = run(sim, ["anomaly:logprob_collapse"])
    assert set(written["tokens"]["request_id"]) == {"r0-4"}
    meta = pol.to_meta()
    assert meta["anomalies_fired"] == {"logprob_collapse": 1}
    # the request's steps, and those within STEPS_AROUND of the collapse: before the request's
    # start, steps of the requests before it, dropped already and then kept after all
    own = {st for (st, _s), r in sim.owner_of_step.items() if r == "r0-4"}
    assert fire is not None
    around = set(range(fire - STEPS_AROUND, fire + STEPS_AROUND + 1))
    assert around - own
    assert sorted(written["steps"]["step_id"]) == sorted(own | around)
    everything = sum(f["steps"].height for f in sim.flushes)
    assert meta["rows_dropped"]["steps"] == everything - len(own | around)


@pytest.mark.parametrize(
    "specs, message",
    [
        (["full", "head:0.1"], "cannot be combined"),
        (["head:2"], "0 <= RATE <= 1"),
        (["tail:1"], "0 < Q < 1"),
        (["anomaly:nope"], "unknown detector"),
        (["sample:3"], "unknown policy"),
        (["head:x"], "needs a number"),
    ],
)
def test_bad_policies_are_refused_with_what_is_wrong(specs: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PolicyChoice.parse(specs)


def test_policy_flags_reach_the_options_and_bad_ones_are_usage_errors() -> None:
    from sparseety_prof.cli import build_parser
    from sparseety_prof.commands.attach_options import options_from
    from sparseety_prof.errors import UsageError

    p = build_parser()
    base = ["record", "--pid", "7", "-o", "rec"]
    o = options_from(
        p.parse_args([*base, "--policy", "head:0.1", "--policy", "anomaly", "--policy-window", "8M"])
    )
    assert (o.policy, o.policy_window) == (("head:0.1", "anomaly"), 8 << 20)
    assert options_from(p.parse_args(base)).policy == ("full",)
    for bad, message in (
        (["--policy", "tail:2"], "--policy: tail:Q"),
        (["--policy-window", "9Q"], "--policy-window"),
    ):
        with pytest.raises(UsageError, match=message) as e:
            options_from(p.parse_args([*base, *bad]))
        assert e.value.exit_code == 2


def test_only_a_policy_that_never_stores_a_table_lets_its_rows_be_counted_unmade() -> None:
    agg = RecordingPolicy(["aggregate"])
    assert not agg.stores("routes") and not agg.stores("tokens") and agg.stores("requests")
    agg.count_dropped("routes", 40)
    agg.count_dropped("routes", 2)
    assert agg.to_meta()["rows_dropped"] == {"routes": 42}
    for specs in (["full"], ["head:0.1"], ["tail:0.9"], ["anomaly"]):
        pol = RecordingPolicy(specs)
        assert pol.stores("routes"), specs
        with pytest.raises(ValueError, match="must be made"):
            pol.count_dropped("routes", 1)


def test_the_summary_line_says_what_head_sampling_in_the_probes_kept() -> None:
    meta = {"counts": {"tokens": 90, "steps": 95}, "losses": {}, "profiler_cpu_s": 1.0, "bpf_compile_s": 0.5}
    meta |= {"stop_reason": "SIGINT"}
    assert "head sampling" not in summary_line(meta)
    meta["policy"] = {"head_in_probes": {"draws": {"kept": 3, "dropped": 7}, "logits_rows_not_copied": 60}}
    line = summary_line(meta)
    assert "head sampling in the probes: 3 of 10 requests drawn kept, 60 logits rows not copied;" in line
