"""The manifest (llamacpp-cuda-bBUILD.manifest.json) of a CUDA build of llama.cpp
(scripts/build_llamacpp_cuda.sh writes it beside the archive): the build, the toolchain, every
packed file with its size, and the shared libraries the package needs from the machine it runs on
(ELF NEEDED entries that no packed file provides), the CUDA ones named apart: on the GPU machine
they come from PyTorch's CUDA 13 wheels (site-packages/nvidia/cu13/lib) or the driver
(libcuda.so.1).

    python3 scripts/llamacpp_cuda_manifest.py --bin DIR --archive FILE --build N ... > MANIFEST

Standard library only: it runs with whatever python3 built the package.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

# the CUDA libraries, by SONAME prefix: toolkit ones ship in the nvidia wheels, libcuda with the driver
CUDA_SONAMES = re.compile(r"^lib(cudart|cublas|cublasLt|cuda|nvrtc|curand|cusparse|cufft|nvJitLink)\.so")


def needed(path: Path) -> list[str]:
    """The DT_NEEDED entries of an ELF file (readelf -d), [] for anything else."""
    r = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=False)
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", r.stdout)


def soname(path: Path) -> str | None:
    r = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=False)
    m = re.search(r"\(SONAME\)\s+Library soname: \[([^\]]+)\]", r.stdout)
    return m.group(1) if m else None


def newest_versions(files: list[Path]) -> dict[str, str]:
    """The newest GLIBC_ / GLIBCXX_ / CXXABI_ symbol versions the files ask for (objdump -T): the
    oldest C and C++ runtimes the package runs with."""
    seen: dict[str, tuple[int, ...]] = {}
    for p in files:
        r = subprocess.run(["objdump", "-T", str(p)], capture_output=True, text=True, check=False)
        for family, ver in re.findall(r"\b(GLIBC|GLIBCXX|CXXABI)_(\d+(?:\.\d+)*)\b", r.stdout):
            v = tuple(int(x) for x in ver.split("."))
            seen[family] = max(seen.get(family, v), v)
    return {f: f"{f}_{'.'.join(map(str, v))}" for f, v in sorted(seen.items())}


def manifest(a: argparse.Namespace) -> dict[str, object]:
    files = sorted(p for p in Path(a.bin).iterdir() if p.is_file() and not p.is_symlink())
    provided = {p.name for p in Path(a.bin).iterdir()} | {s for p in files if (s := soname(p))}
    need: dict[str, list[str]] = {}
    for p in files:
        for lib in needed(p):
            if lib not in provided:
                need.setdefault(lib, []).append(p.name)
    cuda = sorted(x for x in need if CUDA_SONAMES.match(x))
    archive = Path(a.archive)
    return {
        "llama_cpp_build": int(a.build),
        "revision": f"b{a.build}",
        "sdist": a.sdist,
        "sdist_sha256": a.sdist_sha256,
        "nvcc": a.nvcc,
        "cuda_architectures": "90",
        "toolchain": a.toolchain.split(),
        "cmake_args": a.cmake_args,
        "build_seconds": int(a.build_seconds),
        "jobs": int(a.jobs),
        "archive": archive.name,
        "archive_bytes": archive.stat().st_size,
        "files": {p.name: p.stat().st_size for p in files},
        "unpacked_bytes": sum(p.stat().st_size for p in files),
        "needs_cuda_libraries": cuda,
        "needs_system_libraries": sorted(x for x in need if x not in cuda),
        "needed_by": need,
        "newest_symbol_versions": newest_versions(files),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in (
        "--bin",
        "--archive",
        "--build",
        "--sdist",
        "--sdist-sha256",
        "--nvcc",
        "--build-seconds",
        "--jobs",
        "--toolchain",
        "--cmake-args",
    ):
        ap.add_argument(flag, required=True)
    json.dump(manifest(ap.parse_args()), sys.stdout, indent=1, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
