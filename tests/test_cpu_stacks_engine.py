"""The CPU sampler on a real llama-cpp-python engine (root): its profile against perf's on the same
threads and window, and its samples per request against the steps they fell in."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import polars as pl
import pytest
from conftest import (
    ENGINES,
    Engine,
    Recorder,
    free_port,
    require_build,
    server_builds,
    server_engine_args,
    start_build,
    which,
)

import sparseety_prof
from sparseety_prof.views.cpu_stacks import stacks_by_request

pytestmark = [pytest.mark.root, pytest.mark.engine]

RATE_HZ = 1999  # both samplers: enough samples from the short generations of the tiny test model
PROMPTS = ["The quick brown fox jumps over the lazy dog and", "Once upon a time in a land far away"]
TOP = 5  # functions compared (those perf names: it prints "[unknown]" for what it cannot)
#: the least share difference accepted; the sampling error of the counts may widen it (below)
MIN_TOLERANCE = 0.03


def _perf_self_counts(data: Path) -> Counter[str]:
    """Self samples per function of a perf.data (user-mode leaves only), from `perf script`."""
    out = subprocess.run(
        [which("perf"), "script", "-i", str(data), "-F", "ip,sym,dso", "--no-inline"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    counts: Counter[str] = Counter()
    leaf_next = True
    for line in out.splitlines():
        if not line.strip():  # a blank line ends a sample's stack
            leaf_next = True
            continue
        if not leaf_next:
            continue
        leaf_next = False
        parts = line.split(None, 1)
        rest = parts[1] if len(parts) > 1 else ""
        sym, _, dso = rest.rpartition(" (")
        if "kernel" in dso or (dso.startswith("[") and "vdso" not in dso):
            continue  # a sample in the kernel: ours are "[kernel]", left out the same way
        counts[sym.split("+0x")[0].strip() or "[unknown]"] += 1
    return counts


def _ours_self_counts(stacks: pl.DataFrame, tids: set[int]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for stack, n, kernel, tid in stacks.select("stack", "samples", "in_kernel", "tid").iter_rows():
        if kernel or tid not in tids:
            continue
        counts[stack.rsplit(";", 1)[-1]] += n
    return counts


def _same_name(ours: str, perf: str) -> bool:
    """The same function: perf prints a C++ name without its parameters, nm -C with them and, for
    a function template, with its return type ("void std::__adjust_heap<...>(...)")."""
    o, p = ours.split("(")[0], perf.split("(")[0]
    return o == p or o.endswith(" " + p)


def _agrees_with_perf(pid: int, load: Callable[[], object], tmp_path: Path) -> None:
    """`load` run under the recorder's sampler and `perf record` on the same threads at once: the
    top functions' self-time shares agree."""
    tids = {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    out, data = tmp_path / "rec", tmp_path / "perf.data"
    rec = Recorder(pid, out, "--cpu-sample-hz", str(RATE_HZ), "--mode", "tokens")
    # perf starts with its event off and turns it on when told (its control FIFO), answering on
    # its ack FIFO: the load then runs under both samplers
    ctl, ack = tmp_path / "ctl", tmp_path / "ack"
    os.mkfifo(ctl)
    os.mkfifo(ack)
    perf = subprocess.Popen(
        [which("perf"), "record", "-e", "cpu-clock", "-F", str(RATE_HZ), "-g", "-o", str(data), "-D", "-1",
         "--control", f"fifo:{ctl},{ack}", "--tid", ",".join(map(str, sorted(tids)))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        with open(ctl, "w") as c, open(ack) as a:
            c.write("enable\n")
            c.flush()
            assert a.readline().strip() == "ack"
        load()
    finally:
        perf.send_signal(signal.SIGINT)
        perf_err = perf.communicate(timeout=120)[1]
        rc, err = rec.stop()
    assert rc == 0, err
    assert perf.returncode in (0, -signal.SIGINT), perf_err
    r = sparseety_prof.open(out)
    ours = _ours_self_counts(r.cpu_stacks(), tids)
    theirs = _perf_self_counts(data)
    n_ours, n_theirs = sum(ours.values()), sum(theirs.values())
    assert min(n_ours, n_theirs) >= 300, (n_ours, n_theirs)
    named = [(name, n) for name, n in theirs.most_common() if name != "[unknown]"]
    assert len(named) >= TOP, theirs
    for name, n in named[:TOP]:
        p_theirs = n / n_theirs
        p_ours = sum(v for k, v in ours.items() if _same_name(k, name)) / n_ours
        # two samplers of the same run: the difference of two shares of n_ours and n_theirs
        # samples has a standard error of sqrt(p(1-p)(1/n1 + 1/n2)); 4 of them, at least 3 points
        p = (p_ours + p_theirs) / 2
        tol = max(MIN_TOLERANCE, 4 * math.sqrt(p * (1 - p) * (1 / n_ours + 1 / n_theirs)))
        assert abs(p_ours - p_theirs) <= tol, (
            name,
            p_ours,
            p_theirs,
            tol,
            ours.most_common(TOP),
            named[:TOP],
        )
    meta = r.meta["cpu_sampler"]
    assert meta["rate_hz"] == RATE_HZ
    assert meta["lost"] == {"ring": 0, "stacks": meta["lost"]["stacks"], "counts": 0}
    # every sample counted in the kernel reached the table (none lost to the ring)
    assert int(r.cpu_stacks()["samples"].sum()) == meta["samples"]


def test_the_sampled_profile_agrees_with_perf_on_llama_cpp_python(engine_cpu: Engine, tmp_path: Path) -> None:
    engine_cpu.generate(PROMPTS[:1], max_tokens=4)  # the thread pool started before the tids are listed
    _agrees_with_perf(engine_cpu.pid, lambda: engine_cpu.generate(PROMPTS * 8, max_tokens=128), tmp_path)


def test_the_sampled_profile_agrees_with_perf_on_a_llama_server_build(
    models: dict[str, Path], tmp_path: Path
) -> None:
    name, env = next((n, e) for n, e in server_builds() if e is not None and "LLAMA_SERVER_BIN" in e)
    require_build(env)
    server = start_build(name, server_engine_args(env, models["dense"], free_port()), env)
    try:
        url = str(server.ready["url"])

        def complete(n: int) -> None:
            for prompt in PROMPTS:
                body = {
                    "prompt": prompt,
                    "n_predict": n,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                }
                req = urllib.request.Request(
                    url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(req, timeout=300) as answer:
                    answer.read()  # (streamed: builds that fail to answer this model in one piece)

        complete(4)  # the thread pool started before the tids are listed
        _agrees_with_perf(server.pid, lambda: complete(1536), tmp_path)
    finally:
        server.close()


def test_folded_stacks_per_request_sum_to_the_samples_of_its_steps(
    engine_cpu: Engine, tmp_path: Path
) -> None:
    out = tmp_path / "rec"
    rec = Recorder(engine_cpu.pid, out, "--cpu-sample-hz", str(RATE_HZ), "--mode", "tokens")
    engine_cpu.generate(PROMPTS, max_tokens=32)
    rc, err = rec.stop()
    assert rc == 0, err
    r = sparseety_prof.open(out)
    stacks, steps, tokens = r.cpu_stacks(), r.steps(), r.tokens()
    assert stacks.height and set(stacks["step_kind"]) >= {"prompt", "decode"}
    # in steps: the step's phase; outside: none
    inside = stacks.filter(pl.col("step_id").is_not_null())
    joined = inside.join(steps.select("step_id", pl.col("phase").alias("step_phase")), on="step_id")
    assert joined.height == inside.height and (joined["phase"] == joined["step_phase"]).all()
    # every sample in a step lies within its window
    times = inside.join(steps.select("step_id", "t_start_ns", "t_end_ns"), on="step_id")
    assert ((times["t_first_ns"] >= times["t_start_ns"]) & (times["t_first_ns"] <= times["t_end_ns"])).all()
    # per request: the samples of the steps that computed its rows (one sequence at a time here:
    # a request's steps are those from its first step to its last token's, on its sequence)
    by_request = stacks_by_request(r)
    assert set(by_request["request_id"]) == set(tokens["request_id"])
    for req in tokens.partition_by("request_id"):
        rid = req["request_id"][0]
        first = r.requests().filter(pl.col("request_id") == rid)["t_started_ns"][0]
        last_step = req["step_id"].max()
        ids = steps.filter((pl.col("t_start_ns") >= first) & (pl.col("step_id") <= last_step))["step_id"]
        want = int(stacks.filter(pl.col("step_id").is_in(ids.implode()))["samples"].sum())
        got = by_request.filter(pl.col("request_id") == rid)
        assert int(got["samples"].sum()) == want > 0, rid
        assert set(got["phase"]) == {"prefill", "decode"}


@pytest.fixture
def engine_cpu(models: dict[str, Path]) -> Iterator[Engine]:
    e = Engine([str(ENGINES / "llama_engine.py"), str(models["dense"])])
    yield e
    e.close()


def test_steps_a_head_policy_drops_keep_their_samples_apart(engine_cpu: Engine, tmp_path: Path) -> None:
    out = tmp_path / "rec"
    # head sampling in the probes: a dropped request's steps are set apart, their windows only
    rec = Recorder(engine_cpu.pid, out, "--cpu-sample-hz", str(RATE_HZ), "--policy", "head:0.5")
    engine_cpu.generate([f"{p} {i}" for i in range(6) for p in PROMPTS], max_tokens=24)
    rc, err = rec.stop()
    assert rc == 0, err
    r = sparseety_prof.open(out)
    stacks, steps = r.cpu_stacks(), r.steps()
    kinds = set(stacks["step_kind"])
    dropped = r.meta["policy"]["rows_dropped"].get("steps", 0)
    assert dropped > 0 and steps.height > 0  # (12 requests, each kept with probability 1/2)
    assert "unrecorded_step" in kinds and kinds & {"prompt", "decode"}
    # a step id always names a step the recording holds
    ids = stacks["step_id"].drop_nulls().unique()
    assert ids.is_in(steps["step_id"].implode()).all()
    assert int(stacks["samples"].sum()) == r.meta["cpu_sampler"]["samples"]
