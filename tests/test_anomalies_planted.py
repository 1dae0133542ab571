"""Every anomaly detector on recordings of real llama.cpp engines (llama-cpp-python in-process,
tests/engines/llama_engine.py) made to contain its anomaly, and on clean recordings of the same
model: the detector fires at the planted request, decode order and layer, and nowhere else.

The anomalies are planted by what the engine is fed (tokens forced through a logits processor, so
the raw logits and log-probs stay the model's), by the model (sparseety_prof/synthetic presets
"planted", "loud_context" and "swa") or by stalling the engine process:

- logprob_collapse: the least likely token forced four times in a row
- sparsity_spike: the "planted" model's token with an all-zero embedding (layer 0 sees only the
  embedding, so every activation of layer 0 is exactly 0 for its row)
- routing_collapse: ten distinct tokens forced whose layer-0 experts (a function of the token in the
  "planted" model, computed here from the GGUF weights) are the same
- load_imbalance: a long request of tokens that all route to one expert in layer 0
- routing_jump: the "loud_context" model's loud token, whose own row is routed by the token while
  every other row is routed by the prefix
- attention_collapse: the sliding-window model decoding past twice its window
- slow_step: the engine stopped (SIGSTOP) for STALL_S at a time, its steps measured against the
  stall windows taken here

The repetition loop's real-engine test is in tests/test_anomalies.py. Greedy decoding of these
random models loops, so repetition loops are left out of the comparisons here. The engine runs
SCHED_FIFO while it is recorded, so that the other processes of a shared CI machine cannot preempt
it; the kernel still can (interrupts, the 5% of each second realtime tasks leave to others), and on
a loaded 2-core VM a step of ~1 ms was flagged in about one run in five, and one of 11.7 ms that no
stall touched in one CI run. Such a step is really slow, so the tests allow slow steps shorter than
NOISE_MS, half a stall (a step a stall lands in lasts a whole stall), and in the stall test a few
longer ones (LONG_NOISE_PER)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import polars as pl
import pytest
from conftest import ENGINES, Engine, Recorder

import sparseety_prof
from sparseety_prof.synthetic import PRESETS, SPACE, build_vocab, make_model

pytestmark = [pytest.mark.root, pytest.mark.engine]

PROMPTS = ["hello the expert router", "one two three", "what is the time"]
#: llama-cpp-python keeps the KV cache of a prompt it evaluated last: the same prompt again would start
#: with a single-row step, a request the profiler sees as joined mid-way. Each batch's first prompt
#: differs from the one before it.
LONG_PROMPT = "token expert router decode"
N_TOKENS = 40
#: where the plants go (decode orders of the forced tokens)
LEAST_AT = range(20, 24)
ZERO_AT = 20
SAME_SET_AT = range(16, 26)
LOUD_AT = 20
IMBALANCE_TOKENS = 160
STALL_S = 0.05
STALLS = 12
NOISE_MS = STALL_S * 1e3 / 2
#: one decode step in LONG_NOISE_PER (at least 2 a run) may be longer than NOISE_MS without a stall:
#: on a slow shared VM a fresh-clone CI run saw steps of 26-51 ms that no stall touched (the
#: hypervisor's, which the engine's SCHED_FIFO cannot keep off)
LONG_NOISE_PER = 100
#: kinds each comparison ignores: the loops greedy decoding makes (tested in test_anomalies.py)
LOOPS = ("repetition_loop",)


@dataclass
class Run:
    """A recording and the engine's own account of it: results in request order, request ids."""

    path: Path
    results: list[dict[str, Any]]
    request_ids: list[str]
    found: pl.DataFrame
    steps: pl.DataFrame

    def where(self, kind: str) -> list[tuple[Any, ...]]:
        return [
            tuple(r)
            for r in self.found.filter(pl.col("kind") == kind)
            .select("request_id", "decode_order", "decode_order_end", "layer")
            .iter_rows()
        ]

    def slow_ms(self) -> list[float]:
        """Durations of the steps the slow-step detector flagged."""
        ids = self.found.filter(pl.col("kind") == "slow_step")["step_id"].implode()
        flagged = self.steps.filter(pl.col("step_id").is_in(ids))
        return ((flagged["t_end_ns"] - flagged["t_start_ns"]) / 1e6).to_list()

    def kinds(self) -> set[str]:
        return set(self.found.filter(~pl.col("kind").is_in(LOOPS))["kind"].to_list())


Batch = tuple[list[str], int, list[dict[str, Any]] | None]


def realtime(pid: int) -> None:
    """SCHED_FIFO for every thread of the engine (root), so no ordinary process preempts it."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setscheduler(int(tid), os.SCHED_FIFO, os.sched_param(1))


def record(
    engine: Engine, out: Path, batches: list[Batch], during: Callable[[threading.Event], None] | None = None
) -> Run:
    """Record `batches` (prompts, max_tokens, force plans) generated greedily in turn; `during`
    runs in a thread while they generate, until the event is set."""
    rec = Recorder(engine.pid, out)
    done = threading.Event()
    side = threading.Thread(target=during, args=(done,)) if during else None
    if side:
        side.start()
    results: list[dict[str, Any]] = []
    try:
        for prompts, max_tokens, force in batches:
            engine.send(
                {"prompts": prompts, "max_tokens": max_tokens, "temp": 0.0, "seed": 1, "force": force}
            )
            results += engine.read(timeout=600)["results"]
    finally:
        done.set()
        if side:
            side.join()
    rc, err = rec.stop(signal.SIGINT)
    assert rc == 0, err
    r = sparseety_prof.open(out)
    tokens = r.tokens()
    order = tokens.group_by("request_id").agg(pl.col("t_end_ns").min()).sort("t_end_ns")["request_id"]
    assert len(order) == len(results)
    # the recording holds what the engine generated, request by request
    for request_id, want in zip(order, results, strict=True):
        got = tokens.filter(pl.col("request_id") == request_id).sort("decode_order")["token_id"].to_list()
        assert got == want["ids"], request_id
    return Run(out, results, order.to_list(), r.anomalies(), r.steps())


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], tuple[Engine, Path]]]:
    """One engine process per preset, started on first use (SCHED_FIFO) and closed at the end."""
    d = tmp_path_factory.mktemp("planted")
    started: dict[str, tuple[Engine, Path]] = {}

    def get(preset: str) -> tuple[Engine, Path]:
        if preset not in started:
            model = make_model(d / f"{preset}.gguf", preset)
            e = Engine([str(ENGINES / "llama_engine.py"), str(model)])
            realtime(e.pid)
            started[preset] = (e, model)
        return started[preset]

    yield get
    for e, _ in started.values():
        e.close()


# ---------------------------------------------------------------- the "planted" model


def layer0_experts(model: Path) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """Per token id, the "planted" model's layer-0 experts (sorted) and the router's margin between
    the last chosen and the first unchosen expert. Layer 0's attention output is zero, so its FFN
    input is the RMS-normed embedding (norm weights 1): the router sees the token alone."""
    tensors = {t.name: np.array(t.data, dtype=np.float64) for t in gguf.GGUFReader(str(model)).tensors}
    emb, router = tensors["token_embd.weight"], tensors["blk.0.ffn_gate_inp.weight"]
    normed = emb / np.sqrt((emb**2).mean(axis=1, keepdims=True) + 1e-5)
    logits = normed @ router.T
    k = PRESETS["planted"].n_expert_used
    ranked = np.argsort(-logits, axis=1)
    top = np.sort(logits, axis=1)[:, ::-1]
    return [tuple(sorted(int(e) for e in row[:k])) for row in ranked], top[:, k - 1] - top[:, k]


@dataclass
class Planted:
    clean: Run
    planted: Run
    same_set: list[int]  # the tokens forced at SAME_SET_AT
    imbalance_expert: int
    experts: list[tuple[int, ...]]
    zero: int  # the token with the all-zero embedding


@pytest.fixture(scope="module")
def planted(
    engines: Callable[[str], tuple[Engine, Path]], tmp_path_factory: pytest.TempPathFactory
) -> Planted:
    engine, model = engines("planted")
    experts, margin = layer0_experts(model)
    vocab = build_vocab()
    zero = vocab.tokens.index(SPACE + "sparse")
    # ordinary word and character pieces whose layer-0 choice is clear (no near tie)
    usable = [
        i
        for i in range(len(vocab.tokens))
        if vocab.types[i] == gguf.TokenType.NORMAL and i != zero and margin[i] > 0.1
    ]
    rng = np.random.default_rng(5)
    by_set: dict[tuple[int, ...], list[int]] = {}
    for i in usable:
        by_set.setdefault(experts[i], []).append(i)
    biggest = max(by_set, key=lambda s: len(by_set[s]))
    same_set = [int(x) for x in rng.choice(by_set[biggest], len(SAME_SET_AT), replace=False)]

    def varied(pool: list[int], n: int) -> list[int]:
        """n distinct tokens of `pool`, each with other layer-0 experts than the one before."""
        out: list[int] = []
        for t in rng.permutation(pool):
            if not out or experts[int(t)] != experts[out[-1]]:
                out.append(int(t))
            if len(out) == n:
                return out
        raise AssertionError("pool too small")

    others = [i for i in usable if experts[i] != biggest]
    around = varied(others, N_TOKENS - len(SAME_SET_AT))
    collapse_plan = around[: SAME_SET_AT.start] + same_set + around[SAME_SET_AT.start :]
    busy = biggest[0]
    imbalance_plan = varied([i for i in usable if busy in experts[i]], IMBALANCE_TOKENS)

    def plan(at: dict[int, Any]) -> dict[str, Any]:
        """The engine's "force" plan: decode order (a string, as JSON keys are) -> token."""
        return {str(d): t for d, t in at.items()}

    force = [
        plan(dict.fromkeys(LEAST_AT, "least")),
        plan({ZERO_AT: zero}),
        plan(dict(enumerate(collapse_plan))),
    ]
    d = tmp_path_factory.mktemp("planted-recordings")
    both = [(PROMPTS, N_TOKENS), ([LONG_PROMPT], IMBALANCE_TOKENS)]
    clean = record(engine, d / "clean", [(p, n, None) for p, n in both])
    planted = record(
        engine,
        d / "planted",
        [
            (PROMPTS, N_TOKENS, force),
            ([LONG_PROMPT], IMBALANCE_TOKENS, [plan(dict(enumerate(imbalance_plan)))]),
        ],
    )
    # the engine returned what was forced
    assert planted.results[2]["ids"] == collapse_plan and planted.results[3]["ids"] == imbalance_plan
    assert planted.results[1]["ids"][ZERO_AT] == zero
    return Planted(clean, planted, same_set, busy, experts, zero)


def test_logprob_collapse_is_found_where_the_least_likely_tokens_were_forced(planted: Planted) -> None:
    run = planted.planted
    lp = run.results[0]["log_probs"]
    assert max(lp[d] for d in LEAST_AT) < min(np.median(lp) - 5, -10)  # the engine's own log-probs
    assert run.where("logprob_collapse") == [(run.request_ids[0], LEAST_AT.start, LEAST_AT[-1], None)]
    assert "logprob_collapse" not in planted.clean.kinds()


def test_sparsity_spike_is_found_in_layer_0_of_the_zero_embedding_tokens_row(planted: Planted) -> None:
    run = planted.planted
    # the token's row is the next one: its logits came from the forward pass that read the token
    assert run.where("sparsity_spike") == [(run.request_ids[1], ZERO_AT + 1, ZERO_AT + 1, 0)]
    row = (
        sparseety_prof.open(run.path)
        .tokens()
        .filter((pl.col("request_id") == run.request_ids[1]) & (pl.col("decode_order") == ZERO_AT + 1))
    )
    assert row["act_zero_ratio"][0][0] == 1.0
    assert "sparsity_spike" not in planted.clean.kinds()


def test_routing_collapse_is_found_where_the_forced_tokens_share_their_layer_0_experts(
    planted: Planted,
) -> None:
    run = planted.planted
    # rows SAME_SET_AT + 1 read the forced tokens: their layer-0 experts, as the GGUF weights say
    tokens = sparseety_prof.open(run.path).tokens().filter(pl.col("request_id") == run.request_ids[2])
    layer0 = tokens.sort("decode_order")["expert_ids"].to_list()
    ids = run.results[2]["ids"]
    for d in range(1, len(ids)):
        assert tuple(sorted(layer0[d][0])) == planted.experts[ids[d - 1]], d
    assert len({planted.experts[t] for t in planted.same_set}) == 1
    first, last = SAME_SET_AT.start + 1, SAME_SET_AT[-1] + 1
    assert run.where("routing_collapse") == [(run.request_ids[2], first, last, 0)]
    assert "routing_collapse" not in planted.clean.kinds()


def test_load_imbalance_is_found_in_layer_0_whose_busy_expert_the_long_request_favoured(
    planted: Planted,
) -> None:
    run = planted.planted
    # layer 0's experts of every token row, from the ids the engine read (the prompt's last token,
    # then each token but the last) and the GGUF weights; the zero-embedding token's row is a tie of
    # all experts, left to the recording
    counts = np.zeros(PRESETS["planted"].n_expert)
    tokens = sparseety_prof.open(run.path).tokens()
    for rid, res in zip(run.request_ids, run.results, strict=True):
        read = [res["prompt_tokens"][-1], *res["ids"][:-1]]
        recorded = tokens.filter(pl.col("request_id") == rid).sort("decode_order")["expert_ids"].to_list()
        for token, layers in zip(read, recorded, strict=True):
            if token == planted.zero:
                counts[layers[0]] += 1
                continue
            assert tuple(sorted(layers[0])) == planted.experts[token]
            counts[list(planted.experts[token])] += 1
    found = run.found.filter(pl.col("kind") == "load_imbalance")
    assert found["layer"].to_list() == [0]
    assert int(counts.argmax()) == planted.imbalance_expert
    assert f"expert {planted.imbalance_expert} took" in found["reason"][0]
    assert found["score"][0] == pytest.approx(counts.max() / counts.mean())
    assert "load_imbalance" not in planted.clean.kinds()


def test_the_planted_recording_holds_only_the_planted_anomalies(planted: Planted) -> None:
    """Each plant makes its own anomaly and no other; steps are slow only by the kernel's doing."""
    for run in (planted.planted, planted.clean):
        assert all(ms < NOISE_MS for ms in run.slow_ms()), run.slow_ms()
    assert planted.planted.kinds() - {"slow_step"} == {
        "logprob_collapse",
        "sparsity_spike",
        "routing_collapse",
        "load_imbalance",
    }
    assert planted.clean.kinds() - {"slow_step"} == set()


def test_the_first_decode_step_of_a_request_costs_more_and_is_not_flagged(planted: Planted) -> None:
    """llama.cpp builds a new graph for the first one-row step after a prompt step: it costs more
    than the steady decode steps in every request, and the slow-step detector compares it only with
    its kind (here too few to judge)."""
    run = planted.clean
    tokens = sparseety_prof.open(run.path).tokens()
    ms = run.steps.select("step_id", ((pl.col("t_end_ns") - pl.col("t_start_ns")) / 1e6).alias("ms"))
    decode = tokens.filter(pl.col("decode_order") >= 1).join(ms, on="step_id")
    steady = decode.filter(pl.col("decode_order") >= 2)["ms"].median()
    first = decode.filter(pl.col("decode_order") == 1)
    assert first.height == len(run.request_ids)
    assert (first["ms"] > steady).all(), (first["ms"].to_list(), steady)
    assert (
        not run.found.filter(pl.col("kind") == "slow_step")["step_id"].is_in(first["step_id"].implode()).any()
    )


# ---------------------------------------------------------------- routing jump


def test_routing_jumps_into_and_out_of_the_loud_token(
    engines: Callable[[str], tuple[Engine, Path]], tmp_path: Path
) -> None:
    """The loud token is forced in the second request; the first and third are clean."""
    engine, _ = engines("loud_context")
    loud = build_vocab().tokens.index(SPACE + "expert")
    force = [{}, {str(LOUD_AT): loud}, {}]
    run = record(engine, tmp_path / "rec", [(PROMPTS, N_TOKENS, force)])
    assert (
        run.results[1]["ids"][LOUD_AT] == loud and loud not in run.results[0]["ids"] + run.results[2]["ids"]
    )
    # the loud token's own row (the next one) is routed by the token; the row after it by the prefix
    rid = run.request_ids[1]
    assert run.where("routing_jump") == [
        (rid, LOUD_AT + 1, LOUD_AT + 1, None),
        (rid, LOUD_AT + 2, LOUD_AT + 2, None),
    ]


# ---------------------------------------------------------------- attention coverage


def test_attention_collapse_is_found_in_the_sliding_window_layers_past_twice_the_window(
    engines: Callable[[str], tuple[Engine, Path]], tmp_path: Path
) -> None:
    """The same prompts decoded within twice the window (clean), then past it."""
    engine, _ = engines("swa")
    preset = PRESETS["swa"]
    window = preset.n_swa
    run = record(engine, tmp_path / "rec", [(PROMPTS, 2 * window - 8, None), (PROMPTS, 3 * window, None)])
    want = []
    for rid, res in zip(run.request_ids[len(PROMPTS) :], run.results[len(PROMPTS) :], strict=True):
        n_prompt = len(res["prompt_tokens"])
        # a token row at decode order d sees n_prompt + d cells; a window layer attends `window` of
        # them, half the request's start (all) once the sequence holds 2 * window cells
        first = 2 * window - n_prompt
        assert 8 < first < len(res["ids"]) - 2
        want += [(rid, first, len(res["ids"]) - 1, layer) for layer in preset.swa_layers]
    for res in run.results[: len(PROMPTS)]:
        assert len(res["prompt_tokens"]) + len(res["ids"]) < 2 * window  # the clean ones stay within
    assert sorted(run.where("attention_collapse")) == sorted(want)


# ---------------------------------------------------------------- slow steps


def test_slow_steps_are_found_where_the_engine_was_stopped(
    engines: Callable[[str], tuple[Engine, Path]], tmp_path: Path
) -> None:
    engine, _ = engines("swa")
    windows: list[tuple[int, int]] = []

    def stall(done: threading.Event) -> None:
        # above the engine's SCHED_FIFO threads: on a loaded machine they would otherwise keep
        # this thread from running until the request ended (a CI run saw too few stalls)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(2))
        rng = np.random.default_rng(3)
        while len(windows) < STALLS and not done.wait(float(rng.uniform(0.005, 0.02))):
            t0 = time.monotonic_ns()  # CLOCK_MONOTONIC, as the recording's step times
            os.kill(engine.pid, signal.SIGSTOP)
            time.sleep(STALL_S)
            t1 = time.monotonic_ns()
            os.kill(engine.pid, signal.SIGCONT)
            windows.append((t0, t1))

    run = record(engine, tmp_path / "stalled", [([LONG_PROMPT], 600, None)], during=stall)
    assert len(windows) == STALLS, "the request ended before every stall"
    # a step the engine was stopped in was still running when it was continued (t1 is taken before
    # SIGCONT; a stopped engine starts no step, and one that ended before the stop took effect
    # ended before t1)
    spans = pl.any_horizontal(*[(pl.col("t_start_ns") < t1) & (pl.col("t_end_ns") > t1) for _, t1 in windows])
    # a recording of one request has one prompt step: it has no usual cost to be judged against
    # (slow_steps needs SLOW_MIN_STEPS steps of a kind, or steady ones of its phase), so a stall
    # that lands in it (on a slow machine the prompt outlasts the first wait) is not a miss
    stalled = run.steps.filter(spans & (pl.col("phase") == "decode"))["step_id"].to_list()
    assert stalled, "no stall landed inside a decode step"
    found = run.found.filter(pl.col("kind") == "slow_step")["step_id"].to_list()
    assert set(stalled) <= set(found)
    extra = run.steps.filter(pl.col("step_id").is_in(set(found) - set(stalled)))
    decode = run.steps.filter(pl.col("phase") == "decode")
    decode_ns = decode["t_end_ns"] - decode["t_start_ns"]
    n_decode, median_ns = len(decode_ns), float(np.median(decode_ns.to_numpy()))
    extra_ns = extra["t_end_ns"] - extra["t_start_ns"]
    # each step found that no stall touched was really slow (twice the usual decode step at least:
    # the host took it, not the detector's noise), and few of them are longer than NOISE_MS
    assert (extra_ns >= 2 * median_ns).all(), (median_ns, extra)
    assert int((extra_ns >= NOISE_MS * 1e6).sum()) <= max(2, n_decode // LONG_NOISE_PER), (n_decode, extra)
    assert run.kinds() - {"slow_step", "attention_collapse"} == set()
