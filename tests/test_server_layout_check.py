"""The llama-server struct offsets checked on the first live records: task ids must grow on each
posting thread and never repeat, a launched slot's id must be the sequence id of its micro-batch
rows; a misread offset is refused with exit 6 naming the invariant."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, Engine, free_port, server_engine_args

from sparseety_prof.correlate import server_layout_check as slc
from sparseety_prof.errors import UnsupportedEngineBuild


def test_a_server_that_behaves_is_verified() -> None:
    c = slc.ServerLayoutCheck()
    for i in range(slc.VERIFY_POSTS):
        c.on_task_post(100 + i % 3, 10 + i)  # three HTTP threads, one id counter
        c.on_task_post(100, -1)  # a cancel task: the queue numbers it
        c.on_slot_launch(i % 4, 10 + i)
        c.on_ubatch([0, 0, 1, 2, 3, 3])
    assert c.done and c.posts_verified == slc.VERIFY_POSTS


@pytest.mark.parametrize("ids", [[5, 5], [7, 3], [-4]], ids=["constant", "shrinking", "negative"])
def test_task_ids_read_at_a_wrong_offset_are_refused(ids: list[int]) -> None:
    c = slc.ServerLayoutCheck()
    with pytest.raises(UnsupportedEngineBuild, match=slc.INV_TASKS_GROW) as e:
        for i in ids:
            c.on_task_post(1, i)
    assert e.value.exit_code == 6


def test_a_repeated_task_id_on_another_thread_is_refused() -> None:
    c = slc.ServerLayoutCheck()
    c.on_task_post(1, 9)
    with pytest.raises(UnsupportedEngineBuild, match=slc.INV_TASKS_GROW):
        c.on_task_post(2, 9)


def test_a_slot_id_that_is_no_sequence_id_is_refused() -> None:
    c = slc.ServerLayoutCheck()
    with pytest.raises(UnsupportedEngineBuild, match=slc.INV_SLOT_IS_SEQ):
        c.on_slot_launch(-559038737, 1)


def test_a_slot_whose_sequence_never_decodes_is_refused() -> None:
    c = slc.ServerLayoutCheck()
    c.on_slot_launch(3, 1)
    with pytest.raises(UnsupportedEngineBuild, match=slc.INV_SLOT_IS_SEQ):
        for _ in range(slc.MAX_WAIT_UBATCHES + 1):
            c.on_ubatch([0])


def test_a_slot_released_before_its_rows_is_no_verdict() -> None:
    c = slc.ServerLayoutCheck()
    c.on_slot_launch(3, 1)
    c.on_slot_release(3)
    for _ in range(slc.MAX_WAIT_UBATCHES + 1):
        c.on_ubatch([0])
    assert c.launches_verified == 0


# ---- a live llama-server (xllamacpp) -------------------------------------------------------------


def _complete(url: str, prompt: str) -> None:
    body = json.dumps({"prompt": prompt, "n_predict": 4, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()


def _record(pid: int, out: Path, server_layout: str | None) -> subprocess.Popen[str]:
    """The recorder, with the build's ServerLayout replaced by `server_layout` (an expression over
    L = capture.layouts) when given."""
    patch = (
        "import dataclasses; from sparseety_prof.capture import layouts as L; r = L.resolve; "
        f"L.resolve = lambda *a: dataclasses.replace(r(*a), server={server_layout}); "
        if server_layout
        else ""
    )
    code = f"import sys; {patch}from sparseety_prof.cli import main; sys.exit(main())"
    return subprocess.Popen(
        [sys.executable, "-c", code, "record", "--pid", str(pid), "-o", str(out), "--mode", "tokens"],
        stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def _wait_attached(rec: subprocess.Popen[str]) -> None:
    assert rec.stderr is not None
    for line in rec.stderr:
        if "attached to PID" in line:
            return
    raise AssertionError(f"recorder exited with {rec.wait()} before attaching")


@pytest.mark.root
@pytest.mark.engine
def test_live_server_layout_verified_and_a_misread_task_id_refused(
    models: dict[str, Path], tmp_path: Path
) -> None:
    e = Engine(server_engine_args(None, models["moe"], free_port()))
    try:
        url = e.ready["url"]
        rec = _record(e.pid, tmp_path / "ok", None)
        _wait_attached(rec)
        for i in range(3):
            _complete(url, f"request number {i}")
        rec.send_signal(signal.SIGINT)
        _, err = rec.communicate(timeout=120)
        assert rec.returncode == 0, err
        verification = json.loads((tmp_path / "ok" / "meta.json").read_text())["verification"]
        assert verification["verified_task_posts"] >= 3 and verification["verified_slot_launches"] >= 1

        # server_task::index read as the id: 0 for every single-prompt request
        rec = _record(e.pid, tmp_path / "bad", "L.ServerLayout(task_id=4)")
        _wait_attached(rec)
        for i in range(3):
            if rec.poll() is not None:
                break
            _complete(url, f"request number {i}")
        _, err = rec.communicate(timeout=120)
    finally:
        e.close()
    assert rec.returncode == 6, err
    assert f"invariant '{slc.INV_TASKS_GROW}' failed" in err
