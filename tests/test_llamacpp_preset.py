"""`--preset llamacpp`: the watch rules for ggml-cuda's MoE routing kernels, derived from the mangled
names of the real kernels (tests/data/llamacpp-b11434-cuda-kernels.txt: what nvcc named the
kernels of llama.cpp b11434's topk-moe.cu and argsort.cu, and where that came from), played on the
stub driver, turned into `routes` rows of the model's experts per token, and refused for a layout
the preset does not know."""

from __future__ import annotations

import os
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
from test_cupti_ext import build, by_type, env_for, shm_name  # noqa: F401 (fixtures)

from sparseety_prof.errors import UnsupportedEngineBuild
from sparseety_prof.gpu import llamacpp_kernels, watch_rules
from sparseety_prof.gpu.kernel_rows import KernelRows
from sparseety_prof.gpu.presets import PRESETS, watch_spec
from sparseety_prof.gpu.records import WatchedBuffer
from sparseety_prof.gpu.shm_ring import ShmRing

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "llamacpp-b11434-cuda-kernels.txt"
PATTERN = bytes((i * 37 + 11) % 256 for i in range(1 << 20))  # driver.c scenario_launch's buffer


def fixture_names() -> list[str]:
    return [x for x in FIXTURE.read_text().splitlines() if x and not x.startswith("#")]


def fake_binary(path: Path, names: list[str], noise: bytes = b"") -> Path:
    """A file holding the names as a binary's string table does: NUL-separated."""
    path.write_bytes(b"\x7fELF\x00" + noise + b"\x00".join(n.encode() for n in names) + b"\x00")
    return path


def test_the_built_revisions_kernels_are_the_ones_nvcc_named() -> None:
    names = fixture_names()
    routing = {n for n in names if n.startswith(("_Z13topk_moe_cuda", "_Z17k_argsort_f32_i32"))}
    assert set(llamacpp_kernels.BUILT_REVISION_KERNELS) == routing
    assert PRESETS["llamacpp"] == llamacpp_kernels.rules(names)
    assert len(PRESETS["llamacpp"]) <= watch_rules.MAX_ENTRIES


def test_each_fused_instantiation_reaches_its_own_rule_with_its_expert_count() -> None:
    rules = [r.rule() for r in PRESETS["llamacpp"]]
    names = fixture_names()
    matched = 0
    for name in names:
        rule = watch_rules.match(rules, name)
        if name.startswith("_Z13topk_moe_cuda"):
            n_expert = int(name.split("ILi")[1].split("E")[0])
            assert rule is not None and (rule.arg_index, rule.dtype) == (2, "int32"), name
            # topk_moe_cuda(logits, weights, ids, bias, n_rows, n_expert_used, ...): rows x n_expert
            assert rule.shape({4: 5, 5: 2}) == (5, n_expert), name
            matched += 1
        elif name == "_Z17k_argsort_f32_i32IL15ggml_sort_order1EEvPKfPiii":  # descending
            assert rule is not None and (rule.arg_index, rule.dtype) == (1, "int32")
            # k_argsort_f32_i32(x, dst, ncols, ncols_pad), one block per row
            assert rule.shape({2: 16, 3: 16}, grid=(7, 1, 1)) == (7, 16)
            matched += 1
        else:  # the ascending sort, cub's kernels, init_indices ...: not routing
            assert rule is None, name
    assert matched == 25


@pytest.mark.parametrize(
    "name",
    [
        # another parameter list: the ids (or the row count) could be at another index
        "_Z13topk_moe_cudaILi128ELb1EEvPKfPfPiii",
        "_Z13topk_moe_cudaILi128ELb0EEvPKfPfPiS2_iif15topk_moe_config",
        # other template arguments (n_experts not an int, a third parameter)
        "_Z13topk_moe_cudaILm128ELb0EEvPKfPfPiS2_iiff15topk_moe_config",
        "_Z13topk_moe_cudaILi128ELb0ELb1EEvPKfPfPiS2_iiff15topk_moe_config",
        "_Z17k_argsort_f32_i32IL15ggml_sort_order1EEvPKfPiiii",
    ],
)
def test_a_layout_it_does_not_know_is_refused(name: str) -> None:
    with pytest.raises(UnsupportedEngineBuild, match="not one this preset knows") as e:
        llamacpp_kernels.rules([*llamacpp_kernels.BUILT_REVISION_KERNELS, name])
    assert e.value.exit_code == 6


def test_no_routing_kernel_is_refused() -> None:
    with pytest.raises(UnsupportedEngineBuild, match="no ggml-cuda MoE routing kernel"):
        llamacpp_kernels.rules(["_Z12init_indicesPiii"])


def test_kernel_names_are_whole_strings_of_the_binary(tmp_path: Path) -> None:
    # nvcc's host stubs hold the kernel's name inside their own: never taken for a kernel
    stub = "_ZZL65__device_stub__Z17k_argsort_f32_i32IL15ggml_sort_order1EEvPKfPiiiPKfPiiiE5__tmp"
    lib = fake_binary(tmp_path / "libggml-cuda.so", [stub, *fixture_names()], noise=b"\x01\x02")
    found = llamacpp_kernels.kernel_names([lib])
    assert found == set(llamacpp_kernels.BUILT_REVISION_KERNELS)
    assert llamacpp_kernels.rules(found) == PRESETS["llamacpp"]


def test_engine_files_are_the_executable_and_its_ggml_cuda(tmp_path: Path) -> None:
    exe = tmp_path / "bin" / "llama-server"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    lib = fake_binary(exe.parent / "libggml-cuda.so.0.9.7", [])
    (exe.parent / "libggml-cuda.so").symlink_to(lib.name)
    assert llamacpp_kernels.engine_files([str(exe), "-m", "x.gguf"]) == [exe, lib]
    assert llamacpp_kernels.engine_files([str(tmp_path / "absent")]) == []


def test_a_running_engines_files_are_its_executable_and_the_ggml_cuda_it_maps(tmp_path: Path) -> None:
    lib = fake_binary(tmp_path / "libggml-cuda.so.0", fixture_names())
    code = (
        f"import mmap, sys; f = open({str(lib)!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); "
        "print('ok', flush=True); sys.stdin.read()"
    )
    mapper = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert mapper.stdout is not None and mapper.stdout.readline().strip() == "ok"
        files = llamacpp_kernels.mapped_engine_files(mapper.pid)
        assert files == [
            Path(f"/proc/{mapper.pid}/exe"),
            Path(f"/proc/{mapper.pid}/root") / str(lib).lstrip("/"),
        ]
        assert llamacpp_kernels.rules(llamacpp_kernels.kernel_names(files)) == PRESETS["llamacpp"]
    finally:
        mapper.kill()
        mapper.wait()


def test_watch_spec_needs_the_engines_files() -> None:
    with pytest.raises(watch_rules.WatchSpecError, match="llamacpp"):
        watch_spec(None, ["llamacpp"])


def test_fused_rule_on_the_stub_driver_gives_routes_of_the_models_experts(
    build: Path,  # noqa: F811
    shm_name: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The b11434 fused kernel for 8 experts launched with n_rows 3 and n_expert_used 2 (its
    arguments as the real one has them): the library copies 3 x 8 ids, and `routes` keeps the
    first 2 of each row (what the kernel wrote; the other columns are the argsort view's rest)."""
    lib = fake_binary(tmp_path / "libggml-cuda.so", fixture_names())
    spec = watch_spec(None, ["llamacpp"], [lib])
    assert spec is not None
    name = "_Z13topk_moe_cudaILi8ELb0EEvPKfPfPiS2_iiff15topk_moe_config"
    argv = ["p", "p", "p", "p", "i32:3", "i32:2", "i32:0", "i32:1065353216", "i32:0"]
    env = env_for(build, shm_name, SPARSEETY_WATCH=spec)
    r = subprocess.run(
        [str(build / "driver"), "launch", name, "1", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    with ShmRing(Path("/dev/shm") / shm_name) as ring:
        watched = by_type(ring.drain(), WatchedBuffer)
        assert ring.counters().errors == []
    assert [w.shape for w in watched] == [(3, 8), (3, 8)]  # driver API and runtime API launch
    ids = array("i", PATTERN[: 3 * 8 * 4]).tolist()
    out = KernelRows(route_columns=2)
    assert out.add_routes([(0, watched[0])]) == 0
    assert out.routes["expert_ids"] == [ids[0:2], ids[8:10], ids[16:18]]
    assert out.routes["row"] == [0, 1, 2]
    whole = KernelRows()
    whole.add_routes([(0, watched[0])])
    assert whole.routes["expert_ids"] == [ids[0:8], ids[8:16], ids[16:24]]


def test_cli_launch_reads_the_preset_from_the_engine_and_refuses_an_unknown_layout(tmp_path: Path) -> None:
    lib = tmp_path / "libsparseety_cupti.so"
    lib.write_bytes(b"")  # launch only checks that the library exists; the child never loads it
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARSEETY_CUPTI_LIB": str(lib)}
    cli = [sys.executable, "-m", "sparseety_prof.cli", "launch", "--preset", "llamacpp", "--"]
    engine = tmp_path / "engine"
    engine.mkdir()
    server = engine / "llama-server"
    server.write_text('#!/bin/sh\necho "$SPARSEETY_WATCH"\n')
    server.chmod(0o755)
    fake_binary(engine / "libggml-cuda.so", fixture_names())
    r = subprocess.run([*cli, str(server)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ";".join(x.entry for x in PRESETS["llamacpp"])
    fake_binary(engine / "libggml-cuda.so", ["_Z13topk_moe_cudaILi8ELb0EEvPKfPfPiii"])
    r = subprocess.run([*cli, str(server)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 6, r.stderr
    assert "not one this preset knows" in r.stderr and r.stdout == ""
