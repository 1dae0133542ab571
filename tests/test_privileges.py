"""Least privilege: the recorder as a non-root user holding only the capabilities
capture/capabilities.py names, against an engine of another non-root user, records exactly what
the engine computed; without any one of them it attaches nothing; `doctor` names what is missing
and what it costs; the systemd unit grants exactly those and passes `systemd-analyze verify`."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import conftest
import numpy as np
import polars as pl
import pytest
from conftest import ENGINES, ROOT, Engine, Recorder
from other_users import SharedPython, User, make_user, remove_user, shared_python
from test_sparse_decisions import Run, check_run

import sparseety_prof
from sparseety_prof.capture import capabilities as caps
from sparseety_prof.capture.preflight import check_capabilities
from sparseety_prof.errors import MissingPrivileges

UNIT = ROOT / "packaging" / "systemd" / "sparseety-prof@.service"
#: as setpriv spells them: the required capabilities, nothing else
NEEDED = [c.name.removeprefix("CAP_").lower() for c in caps.CAPABILITIES if c.required]
PROMPTS = ["hello the expert router says the sparse decode sample", "one two three"]
MAX_TOKENS = 24
LOGPROB_TOL = 1e-4  # as tests/test_llama_cpp_python.py: the engine's own log-softmax of the row


# ---------------------------------------------------------------- doctor, without root


def _status(tmp_path: Path, names: list[str]) -> Path:
    mask = sum(1 << bit for bit in (getattr(caps, n).bit for n in names))
    p = tmp_path / "status"
    p.write_text(f"Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t{mask:016x}\n")
    return p


def test_each_missing_capability_is_named_with_its_cost(tmp_path: Path) -> None:
    every = ["CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_SYS_NICE"]
    assert all(c.ok for c in check_capabilities(None, _status(tmp_path, every)))
    for gone in every:
        checks = {
            c.name: c for c in check_capabilities(None, _status(tmp_path, [n for n in every if n != gone]))
        }
        failed = [name for name, c in checks.items() if not c.ok]
        cap = getattr(caps, gone)
        if cap.required:
            assert failed == [f"capability: {gone}"]
            assert cap.cost in checks[f"capability: {gone}"].detail
            assert f"--cap-add {gone.removeprefix('CAP_')}" in checks[f"capability: {gone}"].fix
        else:  # optional: reported, not failed
            assert failed == [] and "optional" in checks[f"capability: {gone}"].fix


def test_ptrace_and_dac_are_not_asked_for_an_engine_of_our_own_user(tmp_path: Path) -> None:
    checks = {c.name: c for c in check_capabilities(os.getpid(), _status(tmp_path, ["CAP_SYS_ADMIN"]))}
    assert (
        checks["capability: CAP_SYS_PTRACE"].ok
        and "not needed" in checks["capability: CAP_SYS_PTRACE"].detail
    )
    assert checks["capability: CAP_DAC_READ_SEARCH"].ok
    assert checks["capability: CAP_SYS_ADMIN"].ok


def test_effective_set_is_read_from_proc_status(tmp_path: Path) -> None:
    mask = caps.effective_capabilities(_status(tmp_path, ["CAP_SYS_PTRACE", "CAP_SYS_NICE"]))
    assert caps.capability_names(mask) == ["CAP_SYS_PTRACE", "CAP_SYS_NICE"]
    assert caps.capability_names(1 << 39 | 1 << 38) == ["CAP_PERFMON", "CAP_BPF"]


# ---------------------------------------------------------------- the systemd unit


def _unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    unit.read(UNIT)
    return unit


def test_unit_grants_exactly_the_needed_capabilities_and_hardens() -> None:
    svc = _unit()["Service"]
    needed = {c.name for c in caps.CAPABILITIES if c.required}
    assert set(svc["AmbientCapabilities"].split()) == needed
    assert set(svc["CapabilityBoundingSet"].split()) == needed
    assert svc["User"] != "root" and svc["NoNewPrivileges"] == "yes"
    assert svc["ProtectSystem"] == "strict" and svc["PrivateTmp"] == "yes"
    assert "--follow-unit %i.service" in svc["ExecStart"]


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze missing: scripts/setup.sh installs the systemd package"
    cli = shutil.which("sparseety-prof", path=str(Path(conftest.PY).parent))
    assert cli, "the venv's sparseety-prof entry point"
    # an instance of the template, its ExecStart at this installation's executable (verify
    # checks that the command exists)
    text = UNIT.read_text().replace("/opt/sparseety-prof/bin/sparseety-prof", cli)
    instance = tmp_path / "sparseety-prof@llama-server.service"
    instance.write_text(text)
    r = subprocess.run([analyze, "verify", str(instance)], capture_output=True, text=True, timeout=120)
    # verify only warns about an unknown key or value: any output is a failure here
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr


# ---------------------------------------------------------------- real users, real engine


class UserEngine(Engine):
    """tests/engines/llama_engine.py run as `user`, with no capability at all."""

    def __init__(self, user: User, shared: SharedPython, model: Path, *extra: str) -> None:
        engine = Path(shared.env["SPARSEETY_TEST_SOURCE"]) / "tests" / "engines" / "llama_engine.py"
        self.proc = subprocess.Popen(
            [*user.run_as((), env=shared.env), str(shared.python), str(engine), str(model), *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd="/",
        )
        self.ready = self.read()
        self.pid = int(self.ready["ready"])


class Setting:
    def __init__(self, workspace: Path, shared: SharedPython, engine: User, recorder: User) -> None:
        self.workspace, self.shared, self.engine, self.recorder = workspace, shared, engine, recorder

    def cli_as_recorder(self, held: list[str]) -> list[str]:
        return [
            *self.recorder.run_as(held, env=self.shared.env),
            str(self.shared.python),
            "-m",
            "sparseety_prof.cli",
        ]


@pytest.fixture(scope="module")
def setting() -> Iterator[Setting]:
    if os.geteuid() != 0:
        pytest.skip("creates users: needs root")
    workspace = Path(tempfile.mkdtemp(prefix="sparseety-users-"))
    workspace.chmod(0o755)  # every user enters it; only root writes outside the users' own dirs
    users: list[User] = []
    try:
        shared = shared_python(workspace)
        users.append(make_user("spx-engine", workspace))
        users.append(make_user("spx-rec", workspace))
        yield Setting(workspace, shared, *users)
    finally:
        for u in users:  # every engine the tests started as them is closed by then
            remove_user(u)
        shutil.rmtree(workspace, ignore_errors=True)


@pytest.fixture
def engine_model(setting: Setting, models: dict[str, Path]) -> Path:
    """The MoE model as the engine's user's private file (0600 in a 0700 directory): the
    recorder reaches it only through the engine's mapping, and reads it with CAP_DAC_READ_SEARCH."""
    d = setting.engine.home / "models"
    d.mkdir(mode=0o700, exist_ok=True)
    os.chown(d, setting.engine.uid, setting.engine.gid)
    model = d / "moe.gguf"
    shutil.copyfile(models["moe"], model)
    model.chmod(0o600)
    os.chown(model, setting.engine.uid, setting.engine.gid)
    return model


def _by_request(tokens: pl.DataFrame) -> list[pl.DataFrame]:
    order = tokens.group_by("request_id", maintain_order=True).agg(pl.col("t_end_ns").min()).sort("t_end_ns")
    return [tokens.filter(pl.col("request_id") == r).sort("t_end_ns") for r in order["request_id"]]


@pytest.mark.root
@pytest.mark.engine
def test_recorder_with_only_the_needed_capabilities_records_another_users_engine_exactly(
    setting: Setting, engine_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = setting.recorder.home / "rec"
    monkeypatch.setattr(conftest, "CLI", setting.cli_as_recorder(NEEDED))
    e = UserEngine(setting.engine, setting.shared, engine_model)
    try:
        assert os.stat(f"/proc/{e.pid}").st_uid == setting.engine.uid
        rec = Recorder(e.pid, out)
        results = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
        rc, err = rec.stop(signal.SIGINT)
        assert rc == 0, err
    finally:
        e.close()
    r = sparseety_prof.open(out)
    assert r.complete

    # tokens and log-probs: the engine's own
    requests = _by_request(r.tokens())
    assert len(requests) == len(PROMPTS)
    for got, want in zip(requests, results, strict=True):
        assert got["token_id"].to_list() == want["ids"]
        diff = np.abs(got["log_prob"].to_numpy() - np.array(want["log_probs"]))
        assert diff.max() < LOGPROB_TOL, diff.max()

    # expert ids (and weights, activation sparsity, attention) against the engine's graph
    # callback in a separate run of the same engine, model and prompts (test_sparse_decisions)
    trace_path = tmp_path / "trace.jsonl"
    truth = Engine([str(ENGINES / "llama_engine.py"), str(engine_model), "--graph-trace", str(trace_path)])
    try:
        truth_results = truth.generate(PROMPTS, max_tokens=MAX_TOKENS)
    finally:
        truth.close()
    run = Run.__new__(Run)
    run.rec, run.results, run.truth_results = r, results, truth_results
    run.trace = [json.loads(x) for x in trace_path.read_text().splitlines()]
    assert not [x for x in run.trace if x["kind"] == "error"]
    run.meta_t = run.trace[0]
    counts = check_run(run, expect_moe=True)
    assert counts["moe"] > 0

    # everything it wrote belongs to the recorder's user, private to it
    entries = [out, *out.rglob("*")]
    assert len(entries) > 2
    for p in entries:
        st = p.lstat()
        assert st.st_uid == setting.recorder.uid, p
        want_mode = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
        assert stat.S_IMODE(st.st_mode) == want_mode, (p, oct(st.st_mode))


@pytest.mark.root
@pytest.mark.engine
@pytest.mark.parametrize("missing", NEEDED)
def test_without_any_one_capability_nothing_is_attached(
    setting: Setting, engine_model: Path, missing: str
) -> None:
    out = setting.recorder.home / f"rec-without-{missing}"
    e = UserEngine(setting.engine, setting.shared, engine_model)
    try:
        r = subprocess.run(
            [
                *setting.cli_as_recorder([c for c in NEEDED if c != missing]),
                "record",
                "--pid",
                str(e.pid),
                "-o",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd="/",
        )
    finally:
        e.close()
    assert r.returncode != 0, r.stderr
    assert "attached to PID" not in r.stderr
    assert not (out / "meta.json").exists()
    if missing == "sys_admin":  # the uprobe refused: the error says which capability places one
        assert "CAP_SYS_ADMIN" in r.stderr, r.stderr
    else:  # the engine's /proc files or its private model refused before any probe
        assert r.returncode == MissingPrivileges.exit_code, r.stderr
        assert f"CAP_{missing.upper()}" in r.stderr, r.stderr


@pytest.mark.root
@pytest.mark.engine
def test_doctor_as_the_recorders_user_names_the_missing_capability(
    setting: Setting, engine_model: Path
) -> None:
    e = UserEngine(setting.engine, setting.shared, engine_model)
    try:
        reports = {}
        for held in (NEEDED, [c for c in NEEDED if c != "sys_ptrace"]):
            r = subprocess.run(
                [*setting.cli_as_recorder(held), "doctor", "--json", "-p", str(e.pid)],
                capture_output=True,
                text=True,
                timeout=300,
                cwd="/",
            )
            reports[len(held)] = json.loads(r.stdout)
    finally:
        e.close()
    full, short = reports[len(NEEDED)], reports[len(NEEDED) - 1]
    by_name = {c["name"]: c for c in full["checks"]}
    assert all(by_name[f"capability: {c.name}"]["ok"] for c in caps.CAPABILITIES if c.required)
    assert full["capabilities"]["missing"] == []
    assert full["capabilities"]["uid"] == setting.recorder.uid
    assert set(full["capabilities"]["effective"]) == {f"CAP_{c.upper()}" for c in NEEDED}
    assert by_name["privileges"]["ok"] and by_name["BPF load"]["ok"]
    assert short["capabilities"]["missing"] == ["CAP_SYS_PTRACE"]
    failed = {c["name"]: c for c in short["checks"] if not c["ok"]}
    assert "capability: CAP_SYS_PTRACE" in failed
    assert caps.CAP_SYS_PTRACE.cost in failed["capability: CAP_SYS_PTRACE"]["detail"]
    assert "process" in failed  # the engine itself cannot be inspected without it


@pytest.mark.root
@pytest.mark.engine
def test_follower_with_only_the_needed_capabilities_records_another_users_engine(
    setting: Setting, engine_model: Path
) -> None:
    """`record --follow NAME --follow-user USER` (what the systemd unit runs, by unit there) with
    the same capabilities: started before the engine, it records the engine's tokens exactly."""
    out = setting.recorder.home / "follow"
    name = setting.shared.python.name[:15]  # /proc/PID/comm: the executed file's name
    follower = subprocess.Popen(
        [
            *setting.cli_as_recorder(NEEDED),
            "record",
            "--follow",
            name,
            "--follow-user",
            setting.engine.name,
            "-o",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    e = None
    try:
        e = UserEngine(setting.engine, setting.shared, engine_model)
        assert follower.stderr is not None
        for line in follower.stderr:
            if "attached to PID" in line:
                assert f"PID {e.pid} " in line, line
                break
        else:
            raise AssertionError(f"the follower exited with {follower.wait()} before attaching")
        results = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
        follower.send_signal(signal.SIGINT)
        _, err = follower.communicate(timeout=120)
        assert follower.returncode == 0, err
    finally:
        if e is not None:
            e.close()
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    runs = [p for p in out.iterdir() if p.is_dir()]
    assert len(runs) == 1
    requests = _by_request(sparseety_prof.open(runs[0]).tokens())
    assert [r["token_id"].to_list() for r in requests] == [w["ids"] for w in results]
    for p in [out, *out.rglob("*")]:
        assert p.lstat().st_uid == setting.recorder.uid, p
