"""The CUDA build of llama.cpp (scripts/build_llamacpp_cuda.sh) is checked in CI without a GPU: its
build number is inside the verified range, the build that --preset llamacpp was read from, and the
recipe configures (CUDA toolchain from the registry's wheels, the fixes of the recipe in place) for
sm_90 with the CUDA backend and the kernels the preset watches. The full build is cached, never
rebuilt here. The first run downloads the toolchain wheels and the sources into the cache
(/var/cache/sparseety-prof, as scripts/setup.sh's other downloads); later runs only configure."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from sparseety_prof.capture.layouts import VERIFIED
from sparseety_prof.gpu import llamacpp_kernels

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "build_llamacpp_cuda.sh"


def recipe_build() -> int:
    lines = (ROOT / "scripts" / "matrix-llama-server-cuda.txt").read_text().splitlines()
    return int(next(x.split()[0] for x in lines if x.strip() and not x.startswith("#")))


def test_the_cuda_build_is_inside_the_verified_range_and_is_the_presets_revision() -> None:
    build = recipe_build()
    assert any(r.first_build <= build <= r.last_build for r in VERIFIED)
    assert f"b{build}" == llamacpp_kernels.BUILT_REVISION


def test_the_cuda_recipe_configures_for_sm90_with_the_routing_kernels() -> None:
    env = {**os.environ, "PIP_ROOT_USER_ACTION": "ignore"}
    r = subprocess.run(
        ["bash", str(SCRIPT), "--configure-only"], capture_output=True, text=True, timeout=900, env=env
    )
    assert r.returncode == 0, r.stderr[-4000:]
    bld = Path(r.stdout.strip().splitlines()[-1])
    cache = (bld / "CMakeCache.txt").read_text()
    assert re.search(r"^GGML_CUDA:BOOL=ON$", cache, re.M)
    assert re.search(r"^CMAKE_CUDA_ARCHITECTURES:\w+=90$", cache, re.M)
    assert re.search(r"^GGML_CUDA_NO_VMM:BOOL=ON$", cache, re.M)  # no driver to link on the build machine
    assert re.search(r"^BUILD_SHARED_LIBS:BOOL=ON$", cache, re.M)  # libllama for the oracle
    compiler = re.search(r"^CMAKE_CUDA_COMPILER:\w+=(.+)$", cache, re.M)
    assert compiler is not None and compiler.group(1).endswith("/nvidia/cu13/bin/nvcc")
    assert not compiler.group(1).startswith(str(ROOT / ".venv"))  # its own toolchain folder
    ninja = next(p for p in (bld / "build.ninja", bld / "Makefile") if p.exists()).read_text()
    # the kernels the llamacpp preset watches are compiled by this build
    assert "ggml-cuda/topk-moe.cu" in ninja and "ggml-cuda/argsort.cu" in ninja
    # the CUDA language was enabled with the pinned compiler (the GPU machine runs CUDA 13.0)
    found = sorted((bld / "CMakeFiles").glob("*/CMakeCUDACompiler.cmake"))
    assert len(found) == 1
    assert 'set(CMAKE_CUDA_COMPILER_VERSION "13.0.88")' in found[0].read_text()
