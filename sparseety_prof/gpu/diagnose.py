"""`doctor --gpu`: what the GPU path needs, each check pointing at its own input so tests can
break it. cupti-python (NVIDIA's binding of the CUPTI C API) is optional and imported lazily:
it answers whether a CUDA driver is there without starting a CUDA context."""

from __future__ import annotations

import importlib
from pathlib import Path

from sparseety_prof.capture import target as tg
from sparseety_prof.checks import Check
from sparseety_prof.gpu.launch import find_libcupti, library_path
from sparseety_prof.gpu.shm_ring import RingError, find_rings, open_ring

INJECTION_SYMBOL = "InitializeInjection"


def check_injection_library(path: Path | None = None) -> Check:
    lib = path or library_path()
    fix = "sparseety-prof build-cupti (needs the CUDA 13 headers; scripts/setup.sh runs it in a checkout)"
    if not lib.is_file():
        return Check("cupti_ext library", False, f"{lib} is missing", fix)
    try:
        syms = tg.elf_symbols(lib)
    except (OSError, ValueError) as e:
        return Check("cupti_ext library", False, f"{lib} is not a readable shared library ({e})", fix)
    if INJECTION_SYMBOL not in syms:
        return Check("cupti_ext library", False, f"{lib} does not export {INJECTION_SYMBOL}", fix)
    return Check("cupti_ext library", True, f"{lib} exports {INJECTION_SYMBOL}")


def check_libcupti(found: Path | None = None, *, search: bool = True) -> Check:
    lib = found if found is not None or not search else find_libcupti()
    if lib is None:
        return Check(
            "libcupti",
            False,
            "libcupti.so.13 not found in the nvidia-cuda-cupti wheel or /usr/local/cuda",
            "pip install 'nvidia-cuda-cupti==13.*' in the engine's environment, or set SPARSEETY_CUPTI_PATH",
        )
    return Check("libcupti", True, str(lib))


def check_cupti_python(module: str = "cupti") -> Check:
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        return Check(
            "cupti-python",
            False,
            f"not importable ({e}); optional, used for GPU diagnostics only",
            "pip install cupti-python (NVIDIA EULA; needs CUDA 13)",
        )
    version = getattr(mod, "__version__", "?")
    return Check("cupti-python", True, f"cupti-python {version}")


def check_cuda_driver(module: str = "cupti", proc_driver: Path = Path("/proc/driver/nvidia")) -> Check:
    """A CUDA driver, asked through cupti-python when it is installed (get_timestamp needs the
    driver but no context), else from the kernel driver's /proc entry."""
    fix = "run on a machine with an NVIDIA GPU and driver (r580+ for CUDA 13)"
    try:
        mod = importlib.import_module(module)
        api = getattr(mod, "cupti", mod)
    except ImportError:
        api = None
    if api is not None and hasattr(api, "get_timestamp"):
        try:
            api.get_timestamp()
        except Exception as e:  # cupti._internal.utils.NotSupportedError and driver errors
            return Check("CUDA driver", False, f"cupti-python: {e}", fix)
        return Check("CUDA driver", True, "CUPTI answered (driver loaded)")
    if proc_driver.exists():
        return Check("CUDA driver", True, f"{proc_driver} present")
    return Check("CUDA driver", False, f"no NVIDIA driver ({proc_driver} missing)", fix)


def check_rings(pid: int) -> Check:
    try:
        rings = find_rings(pid)
    except OSError as e:
        return Check("GPU ring", False, f"cannot scan /proc for PID {pid}: {e}", "run as root")
    if not rings:
        return Check(
            "GPU ring",
            False,
            f"no CUPTI ring mapped by PID {pid} or its children",
            "start the engine with `sparseety-prof launch -- <command>` (CUPTI cannot attach later)",
        )
    notes = []
    for f in rings:
        try:
            with open_ring(f) as r:
                c = r.counters()
                notes.append(
                    f"{f.path.name}: clock {r.clock_domain}, {c.launches_seen} launches, "
                    f"{c.ring_dropped} dropped"
                )
        except RingError as e:
            return Check("GPU ring", False, str(e), "restart the engine under `sparseety-prof launch`")
    return Check("GPU ring", True, "; ".join(notes))


def gpu_checks(pid: int | None) -> list[Check]:
    out = [check_injection_library(), check_libcupti(), check_cupti_python(), check_cuda_driver()]
    if pid is not None:
        out.append(check_rings(pid))
    return out
