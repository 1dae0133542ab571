"""The recorder's GPU side end to end without a GPU: rings written by the real injection library
(driven through the stub libcupti / libcuda by cupti_ext/tests/driver.c) are drained by
GpuCapture, joined to host steps, and land in the kernels / routes / steps tables; and
`sparseety-prof record` on a process that has only a CUPTI ring records its GPU side alone."""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
from array import array
from pathlib import Path

import polars as pl
import pytest
from conftest import MappingProcess, run_cli
from test_cupti_ext import WATCH, build, env_for, run_driver, shm_name  # noqa: F401 (fixtures)

import sparseety_prof
from sparseety_prof.gpu.capture import GpuCapture
from sparseety_prof.gpu.records import KernelActivity
from sparseety_prof.gpu.shm_ring import SHM_PREFIX, ShmRing
from sparseety_prof.store import schema

ROOT = Path(__file__).resolve().parent.parent


def ring_copy(src: Path, dst: Path) -> list[object]:
    """Read a copy of the ring (the original stays undrained) and return its records."""
    shutil.copyfile(src, dst)
    try:
        with ShmRing(dst) as r:
            return list(r.drain())
    finally:
        dst.unlink(missing_ok=True)


def test_capture_joins_kernels_and_buffers_to_the_engines_own_steps(build: Path, shm_name: str) -> None:  # noqa: F811
    """The steps come from the "engine" (driver.c prints the windows it read on its own clock
    around each 50 launches of a thread, and one around the graph launch of the main thread), and
    the expected step of every kernel and buffer from its loop index, not from the ring's times."""
    r = subprocess.run(
        [str(build / "driver"), "main"],
        env=env_for(build, shm_name, SPARSEETY_WATCH=WATCH),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    windows = [line.split()[1:] for line in r.stdout.splitlines() if line.startswith("step ")]
    steps: dict[str, list[object]] = {"step_id": [], "tid": [], "t_start_ns": [], "t_end_ns": []}
    for fields in windows:
        for col, v in zip(steps, fields, strict=True):
            steps[col].append(int(v))
    # driver thread: steps 0-5, runtime thread: steps 100-105 (50 launches each), main thread: 200
    assert sorted(steps["step_id"]) == [*range(6), *range(100, 106), 200]  # type: ignore[type-var]
    path = Path("/dev/shm") / shm_name
    recs = ring_copy(path, Path("/dev/shm") / f"{shm_name}-peek")
    kernels = [x for x in recs if isinstance(x, KernelActivity)]
    gpu = GpuCapture.open(pid=1, paths=[path])
    assert gpu is not None
    gpu.add_steps(steps)
    out = {t: schema.frame(t, cols) for t, cols in gpu.poll(final=True).items()}
    k = out["kernels"]
    assert k.height == len(kernels) == 4
    # launch i of the driver thread (correlation id 100000 + i) is in its step i // 50
    want = {100000: 0, 100001: 0, 100002: 0, 300000: 200}
    got = {row["correlation_id"]: (row["step_id"], row["join"]) for row in k.iter_rows(named=True)}
    assert got == {corr: (step, "thread") for corr, step in want.items()}
    graph = k.filter(pl.col("graph_id") == 77).row(0, named=True)
    assert graph["graph_node_id"] == 5 and graph["api"] == "cuGraphLaunch"
    # watched top-k buffers of the driver thread: launch i = 0, 10, ..., 290, int32 [4][2] with
    # value (i*31 + j*7) % 64: step i // 50, layer (i % 50) // 10 (its order among the step's
    # watched launches). The runtime thread's buffers are 1-D: captured, but no routes rows.
    routes = out["routes"]
    assert routes.height == 30 * 4
    for row in routes.iter_rows(named=True):
        i = row["step_id"] * 50 + row["layer"] * 10
        assert row["expert_ids"] == [(i * 31 + (2 * row["row"] + j) * 7) % 64 for j in range(2)]
    assert sorted(set(zip(routes["step_id"], routes["layer"], strict=True))) == [
        (i // 50, (i % 50) // 10) for i in range(0, 300, 10)
    ]
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

    # scripts/gpu_check.py's table analysis (what decides its launch / late-attach cases on a GPU)
    # on this recording: the driver thread's 30 watched launches (i = 0, 10, ..., 290; int32 [4][2],
    # value (i*31 + j*7) % 64) all precede the one device-to-host copy, so they are one GPU step
    # of 30 layers; only launch 0 has a kernel record.
    spec = importlib.util.spec_from_file_location("gpu_check_tables", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    ids = array("i", [(i * 31 + j * 7) % 64 for i in range(0, 300, 10) for j in range(8)]).tobytes()
    res = gpu_check.analyse_tables(tmp_path / "rec", ids, 30, 4, 2, "topk_hist_kernel")
    assert res["routes_equal"] and res["routes_first_mismatch"] is None
    assert (res["routes_rows"], res["routes_rows_expected"], res["routes_steps"]) == (120, 120, 1)
    assert res["routes_layers_per_step"] == [30]
    assert (res["watched_kernel_rows"], res["watched_kernels_captured"]) == (1, 1)
    assert res["watched_kernel_joins"] == ["gpu_step"] and res["watched_kernel_steps_match"]
    assert res["gpu_meta"]["join_mode"] == "gpu_step"
    off = bytearray(ids)
    off[4 * (7 * 8 + 2 * 2 + 1)] ^= 1  # layer 7, row 2, second id: one id off
    res = gpu_check.analyse_tables(tmp_path / "rec", bytes(off), 30, 4, 2, "topk_hist_kernel")
    assert not res["routes_equal"] and res["routes_first_mismatch"] == 7 * 4 + 2
    assert not gpu_check.tables_ok(res, 1)
