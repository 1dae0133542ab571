"""--duty-cycle on a real engine: every token recorded with its exact id, routes rows only for the
steps in windows, meta.json's coverage as the windows were, and the per-layer probes really out
of the engine between windows (the breakpoint's byte read from the engine's memory)."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import polars as pl
import pytest
from conftest import Engine, Recorder
from probe_memory import INT3, runtime_address

import sparseety_prof
from sparseety_prof.capture import target as tg
from sparseety_prof.capture.bpf_loader import AttachedProbe
from sparseety_prof.store import recording

PROMPTS = ["hello the expert router", "one two three four", "the sparse decode sample"]


class _Sampler:
    """Reads, every few milliseconds while the recorder runs, the byte at the multiply probe in
    the engine's memory (0xcc: the uprobe's int3, there while any uprobe is attached at it)."""

    def __init__(self, engine_pid: int, address: int) -> None:
        self.engine_pid, self.address = engine_pid, address
        self.samples: list[tuple[int, int, bytes]] = []  # (read began, read done, byte)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # unbuffered: a buffered reader would answer a seek within its buffer from memory
        with open(f"/proc/{self.engine_pid}/mem", "rb", buffering=0) as mem:
            while not self._stop.wait(0.02):
                t0 = time.monotonic_ns()
                mem.seek(self.address)
                self.samples.append((t0, time.monotonic_ns(), mem.read(1)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.mark.root
@pytest.mark.engine
def test_duty_cycle_records_every_token_and_sparse_rows_only_in_windows(
    llama_engine: Engine, tmp_path: Path
) -> None:
    out = tmp_path / "rec"
    rec = Recorder(llama_engine.pid, out, "--duty-cycle", "1s/3s")
    # the multiply probe as attached (meta.json is written at the recording's open)
    probes = json.loads((out / recording.META_FILE).read_text())["probes"]
    mul = next(AttachedProbe(**p) for p in probes if p["symbol"] == tg.SYM_MUL)
    sampler = _Sampler(llama_engine.pid, runtime_address(llama_engine.pid, mul))
    truth = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        truth += llama_engine.generate(PROMPTS, max_tokens=12)
    sampler.stop()
    rc, err = rec.stop(signal.SIGINT)
    assert rc == 0, err

    r = sparseety_prof.open(out)
    meta = r.meta
    dc = meta["duty_cycle"]
    windows = dc["windows_ns"]
    # every token, with its exact id, request by request
    toks = r.tokens().sort("t_end_ns")
    got = [g["token_id"].to_list() for _, g in toks.group_by("request_id", maintain_order=True)]
    assert got == [t["ids"] for t in truth]

    # the windows as meta.json states them, and their coverage
    assert dc["asked"] == "1s/3s" and dc["windows"] == len(windows) >= 2
    assert tg.SYM_MUL in dc["probes"]
    covered = sum(w[2] - w[1] for w in windows) / 1e9
    assert dc["covered_s"] == pytest.approx(covered, abs=0.01)
    assert dc["coverage"] == pytest.approx(covered / dc["elapsed_s"], abs=0.01)
    assert meta["aggregates"]["sparse_coverage"] == dc["coverage"]
    assert dc["switch"]["disarms"] >= 1 and dc["switch"]["failures"] == 0

    # routes rows only for steps that overlap a window; a step wholly in one has its rows
    steps = r.steps().select("step_id", "t_start_ns", "t_end_ns")
    routed = set(r.routes()["step_id"].unique().to_list())

    def overlaps(s: dict[str, int]) -> bool:
        return any(s["t_end_ns"] >= w[0] and s["t_start_ns"] <= w[3] for w in windows)

    def inside(s: dict[str, int]) -> bool:
        return any(w[1] <= s["t_start_ns"] and s["t_end_ns"] <= w[2] for w in windows)

    rows = steps.to_dicts()
    outside = [s["step_id"] for s in rows if not overlaps(s)]
    full = [s["step_id"] for s in rows if inside(s)]
    assert outside and full  # (both kinds happened: the test can tell them apart)
    assert not routed & set(outside)
    assert set(full) <= routed
    # tokens of the steps outside windows: recorded, their experts null (not captured) in every
    # layer; those of the steps wholly in a window have them in every layer
    out_tokens = toks.filter(pl.col("step_id").is_in(outside))
    assert out_tokens.height > 0
    assert all(layer is None for v in out_tokens["expert_ids"].to_list() for layer in v)
    in_tokens = toks.filter(pl.col("step_id").is_in(full))
    assert in_tokens.height > 0
    assert all(layer for v in in_tokens["expert_ids"].to_list() for layer in v)

    # between windows the breakpoint is out of the engine's code (no trap can happen there);
    # within a window it is in
    def phase(t0: int, t1: int) -> str | None:
        for i, w in enumerate(windows):
            if w[1] <= t0 and t1 <= w[2]:
                return "in"
            nxt = windows[i + 1][0] if i + 1 < len(windows) else None
            if w[3] is not None and w[3] <= t0 and (nxt is None or t1 <= nxt):
                return "out"
        return None

    seen: dict[str, set[bytes]] = {"in": set(), "out": set()}
    for t0, t1, byte in sampler.samples:
        p = phase(t0, t1)
        if p is not None:
            seen[p].add(byte)
    assert seen["in"] == {INT3}, seen
    assert len(seen["out"]) == 1 and INT3 not in seen["out"], seen  # the instruction itself


@pytest.mark.root
@pytest.mark.engine
def test_duty_logits_leaves_log_probs_to_the_windows(llama_engine: Engine, tmp_path: Path) -> None:
    """--duty-logits: the logits probe switched with the per-layer ones. Every token is still
    recorded with its exact id; a token sampled wholly in a window has its log-prob (the engine's,
    within 1e-4), one sampled wholly between windows has none."""
    out = tmp_path / "rec"
    rec = Recorder(llama_engine.pid, out, "--duty-cycle", "1s/3s", "--duty-logits")
    truth = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        truth += llama_engine.generate(PROMPTS, max_tokens=12)
    rc, err = rec.stop(signal.SIGINT)
    assert rc == 0, err

    r = sparseety_prof.open(out)
    dc = r.meta["duty_cycle"]
    windows = dc["windows_ns"]
    assert tg.SYM_LOGITS_ITH in dc["probes"] and tg.SYM_MUL in dc["probes"]
    toks = r.tokens().sort("t_end_ns")
    requests = [g for _, g in toks.group_by("request_id", maintain_order=True)]
    assert [g["token_id"].to_list() for g in requests] == [t["ids"] for t in truth]

    def inside(t0: int, t1: int) -> bool:
        return any(w[1] <= t0 and t1 <= w[2] for w in windows)

    def outside(t0: int, t1: int) -> bool:
        edges = [w[3] for w in windows]
        starts = [w[0] for w in windows[1:]] + [None]
        return any(
            d is not None and d <= t0 and (s is None or t1 <= s) for d, s in zip(edges, starts, strict=True)
        )

    kinds = {"in": 0, "out": 0}
    for g, t in zip(requests, truth, strict=True):
        for t0, t1, lp, want in zip(
            g["t_start_ns"], g["t_end_ns"], g["log_prob"], t["log_probs"], strict=True
        ):
            if inside(t0, t1):
                kinds["in"] += 1
                assert lp == pytest.approx(want, abs=1e-4)
            elif outside(t0, t1):
                kinds["out"] += 1
                assert lp is None
    assert kinds["in"] > 0 and kinds["out"] > 0, kinds
