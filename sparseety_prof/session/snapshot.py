"""Configuration snapshot for meta.json: enough to reproduce a run. Everything is read from /proc
and, for HTTP servers, from the server's own read-only /props endpoint; nothing is changed.

Environment variables are kept only for the prefixes that steer inference engines (threads,
BLAS, GPU visibility, llama.cpp/ggml settings); what of them, and of /props, is stored at each
privacy level is session/redaction.py's: recordings travel, secrets must not.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import urllib.request
from pathlib import Path
from typing import Any

from sparseety_prof.session import redaction

ENV_PREFIXES = (
    "LLAMA_",
    "GGML_",
    "XLLAMACPP_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "MKL_",
    "CUDA_",
    "HIP_",
    "ROCR_",
    "NVIDIA_",
    "VLLM_",
    "SGLANG_",
    "PYTORCH_",
    "SPARSEETY_",
)
PROPS_TIMEOUT_S = 2.0


def engine_environment(pid: int, *, redact_text: bool = False) -> dict[str, str]:
    """The engine-relevant part of the process's environment (as it was at exec), redacted."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.decode("utf-8", "replace").partition("=")
        if sep and name.startswith(ENV_PREFIXES):
            out[name] = value
    return dict(sorted(redaction.environment(out, redact_text=redact_text).items()))


def process_info(pid: int) -> dict[str, Any]:
    """Threads and CPU affinity of the engine process."""
    info: dict[str, Any] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("Threads", "Cpus_allowed_list", "VmRSS"):
                info[key.lower()] = value.strip()
    except OSError:
        pass
    with contextlib.suppress(OSError):
        info["cwd"] = os.readlink(f"/proc/{pid}/cwd")
    return info


def host_info() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kb = 0
    try:
        m = re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())
        mem_kb = int(m.group(1)) if m else 0
    except OSError:
        pass
    return {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_gib": round(mem_kb / 2**20, 1),
    }


def server_props(url: str, *, redact_text: bool = False) -> dict[str, Any]:
    """llama-server's GET /props (context size, slots, default sampling settings, build), redacted,
    or {"error": ...} when it cannot be read (API key set, older server)."""
    try:
        with urllib.request.urlopen(url + "/props", timeout=PROPS_TIMEOUT_S) as r:
            props = json.loads(r.read())
    except (OSError, ValueError) as e:
        return {"error": f"GET {url}/props failed: {e}"}
    if not isinstance(props, dict):
        return {"error": "GET /props did not return an object"}
    props.pop("chat_template", None)  # long, and part of the model file already hashed
    return dict(redaction.server_answer(props, redact_text=redact_text))
