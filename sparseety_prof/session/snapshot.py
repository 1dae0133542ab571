"""Configuration snapshot for meta.json: enough to reproduce a run. Everything is read from /proc
and, for HTTP servers, from the server's own read-only /props endpoint; nothing is changed.

Environment variables are kept only for the prefixes that steer inference engines (threads,
BLAS, GPU visibility, llama.cpp/ggml settings); what of them, and of /props, is stored at each
privacy level is session/redaction.py's: recordings travel, secrets must not.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import platform
import re
import socket
import threading
import time
import urllib.parse
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
PROPS_TIMEOUT_S = 2.0  # the whole fetch, connect to last byte (a slow drip cannot hold it longer)
PROPS_MAX_BYTES = 1 << 20  # /props is a few KiB; anything larger is not llama-server's answer
PROPS_MAX_DEPTH = 32  # llama-server nests 3 levels; deeper JSON is refused before it is walked


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
    or {"error": ...} when it cannot be read (API key set, older server).

    The server is the target, not trusted: no redirect is followed, the body is read up to
    PROPS_MAX_BYTES within PROPS_TIMEOUT_S in all, and JSON nested deeper than PROPS_MAX_DEPTH is
    refused; every failure is an error string, never an exception out of the recorder."""
    try:
        props = json.loads(_get_bounded(url + "/props"))
        if _depth_exceeds(props, PROPS_MAX_DEPTH):
            return {"error": f"GET {url}/props: JSON nested deeper than {PROPS_MAX_DEPTH} levels"}
    except (OSError, ValueError, RecursionError, http.client.HTTPException) as e:
        return {"error": f"GET {url}/props failed: {e}"}
    if not isinstance(props, dict):
        return {"error": "GET /props did not return an object"}
    props.pop("chat_template", None)  # long, and part of the model file already hashed
    return dict(redaction.server_answer(props, redact_text=redact_text))


def _get_bounded(url: str) -> bytes:
    """The body of a plain-HTTP GET answered 200, or ValueError/OSError/HTTPException (a redirect
    is an error). A timer shuts the socket down at the deadline, so neither a server that drips
    its headers nor one that streams an endless body holds the caller longer than the timeout."""
    u = urllib.parse.urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"not a plain http URL: {url!r}")
    deadline = time.monotonic() + PROPS_TIMEOUT_S
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=PROPS_TIMEOUT_S)
    conn.connect()
    assert conn.sock is not None
    timer = threading.Timer(PROPS_TIMEOUT_S, _shut_down, (conn.sock,))
    timer.daemon = True
    timer.start()
    try:
        conn.request("GET", u.path or "/", headers={"Accept": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise ValueError(f"HTTP {resp.status} {resp.reason} (redirects are not followed)")
        body = bytearray()
        while len(body) <= PROPS_MAX_BYTES:
            chunk = resp.read1(64 << 10)
            if not chunk:
                break
            body += chunk
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no complete answer within {PROPS_TIMEOUT_S:g} s")
        if len(body) > PROPS_MAX_BYTES:
            raise ValueError(f"answer larger than {PROPS_MAX_BYTES} bytes")
        return bytes(body)
    finally:
        timer.cancel()
        conn.close()


def _shut_down(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _depth_exceeds(obj: Any, limit: int) -> bool:
    """Whether decoded JSON nests deeper than `limit` (iterative: no recursion to exhaust)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict | list):
            if d > limit:
                return True
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return False
