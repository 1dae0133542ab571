"""The recorder's GPU side end to end without a GPU: rings written by the real injection library
(driven through the stub libcupti / libcuda by cupti_ext/tests/driver.c) are drained by
GpuCapture, joined to host steps, and land in the kernels / routes / steps tables; and
`sparseety-prof record` on a process that has only a CUPTI ring records its GPU side alone."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import polars as pl
import pytest
from conftest import MappingProcess, run_cli
from test_cupti_ext import WATCH, build, env_for, run_driver, shm_name  # noqa: F401 (fixtures)

import sparseety_prof
from sparseety_prof.gpu.capture import GpuCapture
from sparseety_prof.gpu.records import KernelActivity, LaunchApi
from sparseety_prof.gpu.shm_ring import SHM_PREFIX, ShmRing
from sparseety_prof.store import schema


def ring_copy(src: Path, dst: Path) -> list[object]:
    """Read a copy of the ring (the original stays undrained) and return its records."""
    shutil.copyfile(src, dst)
    try:
        with ShmRing(dst) as r:
            return list(r.drain())
    finally:
        dst.unlink(missing_ok=True)


def test_capture_joins_kernels_and_buffers_to_host_steps(build: Path, shm_name: str) -> None:  # noqa: F811
    run_driver(build, "main", env_for(build, shm_name, SPARSEETY_WATCH=WATCH))
    path = Path("/dev/shm") / shm_name
    recs = ring_copy(path, Path("/dev/shm") / f"{shm_name}-peek")
    launches = [r for r in recs if isinstance(r, LaunchApi)]
    kernels = [r for r in recs if isinstance(r, KernelActivity)]
    # one host step per launching thread, around all of its launches
    tids = sorted({r.tid for r in launches})
    steps = {"step_id": [], "tid": [], "t_start_ns": [], "t_end_ns": []}  # type: dict[str, list[object]]
    for i, tid in enumerate(tids):
        mine = [r for r in launches if r.tid == tid]
        steps["step_id"].append(10 + i)
        steps["tid"].append(tid)
        steps["t_start_ns"].append(min(r.enter_ns for r in mine) - 1)
        steps["t_end_ns"].append(max(r.exit_ns for r in mine) + 1)
    step_of_tid = dict(zip(tids, steps["step_id"], strict=True))
    gpu = GpuCapture.open(pid=1, paths=[path])
    assert gpu is not None
    gpu.add_steps(steps)
    out = {t: schema.frame(t, cols) for t, cols in gpu.poll(final=True).items()}
    k = out["kernels"]
    assert k.height == len(kernels) == 4
    launch_of = {r.correlation_id: r for r in launches}
    for row in k.iter_rows(named=True):
        la = launch_of[row["correlation_id"]]
        assert row["join"] == "thread" and row["step_id"] == step_of_tid[la.tid] and row["tid"] == la.tid
    graph = k.filter(pl.col("graph_id") == 77).row(0, named=True)
    assert graph["graph_node_id"] == 5 and graph["api"] == "cuGraphLaunch"
    # watched top-k buffers of the driver thread: int32 [4][2], value (i*31 + j*7) % 64 for
    # launch i = 0, 10, 20, ... in launch order = layer order within the step
    routes = out["routes"].sort("layer", "row")
    drv_step = step_of_tid[
        next(r.tid for r in launches if r.api == "cuLaunchKernel" and r.correlation_id < 300000)
    ]
    drv_routes = routes.filter(pl.col("step_id") == drv_step)
    assert drv_routes.height == 30 * 4
    for row in drv_routes.iter_rows(named=True):
        i = row["layer"] * 10
        assert row["expert_ids"] == [(i * 31 + (2 * row["row"] + j) * 7) % 64 for j in range(2)]
    meta = gpu.meta()
    assert meta["join_mode"] == "host" and meta["ring"]["ring_dropped"] == 0 and meta["errors"] == []
    gpu.close()
    assert not path.exists()  # a finished, drained ring is removed: nothing left behind


@pytest.mark.root
def test_record_gpu_only_process(build: Path, shm_name: str, tmp_path: Path) -> None:  # noqa: F811
    """A process with no llama.cpp but a CUPTI ring (a Python CUDA engine under `launch`):
    `record` records kernels and GPU-side steps closed by the device-to-host copy."""
    run_driver(build, "main", env_for(build, shm_name, SPARSEETY_WATCH=WATCH))
    # the engine maps its ring, as the injection library does: a ring is only read where it is mapped
    engine = MappingProcess(Path("/dev/shm") / f"{SHM_PREFIX}{{pid}}", copy_from=Path("/dev/shm") / shm_name)
    ring = engine.path
    try:
        from sparseety_prof.gpu.diagnose import check_rings

        assert check_rings(engine.pid).ok  # doctor --gpu --pid sees it
        r = run_cli("record", "--pid", str(engine.pid), "-o", str(tmp_path / "rec"), "--duration", "1.5")
        assert r.returncode == 0, r.stderr
        assert "GPU only" in r.stderr
    finally:
        engine.close()
        ring.unlink(missing_ok=True)
    rec = sparseety_prof.open(tmp_path / "rec")
    k = rec.kernels()
    assert k.height == 4 and set(k["join"].drop_nulls()) <= {"gpu_step"}
    steps = rec.steps()
    assert steps.height >= 1 and (steps["step_id"] < 0).all()
    assert rec.meta["gpu"]["join_mode"] == "gpu_step"
    assert stat.S_IMODE(os.stat(tmp_path / "rec" / "kernels").st_mode) == 0o700
