"""`sparseety-prof check --pid N`: an end-to-end correlation check on a live HTTP engine.

Attaches (recording to a private temporary directory), sends ONE request tagged with a fresh
request id to the engine's own endpoint, and follows the id through every capture layer, in
the order the request travels:

    entry    the socket read carrying the header       (syscall tracepoints)
    task     the task(s) the HTTP thread posted         (server_queue::post)
    slot     the slot the task was launched on          (launch_slot_with_task)
    steps    forward passes computing that slot's rows  (process_ubatch)
    tokens   token rows with the id, equal to the server's answer (sampler, process_token)
    routing  expert ids on those token rows             (MoE graph ops; n/a on dense models)

The first layer that lost the id is named; layers after it cannot see it either.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from sparseety_prof.capture.target import listening_urls
from sparseety_prof.correlate.serving import DEFAULT_HEADER
from sparseety_prof.errors import CheckRequestFailed, NotAnEngine, UsageError
from sparseety_prof.store.recording import open as open_recording

PROMPT = "sparseety-prof correlation check"


@dataclass
class LayerResult:
    layer: str
    ok: bool
    detail: str


def send(url: str, header: str, request_id: str, n_predict: int, timeout: float) -> dict[str, Any]:
    body = {
        "prompt": PROMPT,
        "n_predict": n_predict,
        "temperature": 0,
        "return_tokens": True,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        url + "/completion",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", header: request_id},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return dict(json.loads(r.read()))
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise CheckRequestFailed(f"the check request to {url}/completion failed: {e}") from None


def run_check(
    pid: int,
    *,
    url: str | None = None,
    header: str = DEFAULT_HEADER,
    n_predict: int = 4,
    timeout: float = 120.0,
    skip_probes: frozenset[str] = frozenset(),
    log: Any = None,
) -> tuple[str, list[LayerResult]]:
    """(request id, per-layer results). Raises ProfError when it cannot run at all."""
    from sparseety_prof.session.options import Options
    from sparseety_prof.session.policy import RecordingPolicy
    from sparseety_prof.session.recorder import Recorder  # imports bcc: not needed for --help

    log = log or (lambda s: None)
    with tempfile.TemporaryDirectory(prefix="sparseety-check-") as tmp:
        out = Path(tmp) / "rec"
        opts = Options(pid=pid, out=out, skip_probes=skip_probes, request_header=header, nice=0)
        rec = Recorder(
            opts, policy=RecordingPolicy.for_session(opts.policy_choice, opts.policy_window), log=log
        )
        errors: list[BaseException] = []

        def run() -> None:
            try:
                rec.run()
            except BaseException as e:
                errors.append(e)

        th = threading.Thread(target=run, name="check-recorder", daemon=True)
        th.start()
        deadline = time.monotonic() + timeout
        while not rec.attached.wait(0.05) and th.is_alive() and time.monotonic() < deadline:
            pass
        if errors or not rec.attached.is_set():
            th.join(timeout=5)
            if errors:
                raise errors[0]
            raise CheckRequestFailed(f"could not attach to PID {pid} within {timeout:.0f}s")
        try:
            if not rec.serves_http:
                raise NotAnEngine(
                    f"PID {pid} is not an HTTP server engine (no llama-server task/slot functions): "
                    "the correlation check needs one"
                )
            if url is None:
                urls = listening_urls(pid)
                if not urls:
                    raise UsageError(f"PID {pid} listens on no TCP port; pass --url")
                url = urls[0]
            request_id = f"sparseety-check-{uuid.uuid4().hex[:12]}"
            log(f"sparseety-prof check: POST {url}/completion with {header}: {request_id}")
            answer = send(url, header, request_id, n_predict, timeout)
            want = len(answer.get("tokens", []))
            # the consumer drains twice a second: wait until it has the tokens (or gives up)
            t_end = time.monotonic() + 5
            while time.monotonic() < t_end and rec.progress.tokens < want:
                time.sleep(0.1)
            time.sleep(0.6)
        finally:
            rec.stop("check done")
            th.join(timeout=60)
        if errors:
            raise errors[0]
        trace = rec.request_trace(request_id)
        r = open_recording(out)
        return request_id, evaluate(request_id, answer, trace, r.steps(), r.tokens(), r.meta)


def evaluate(
    rid: str,
    answer: dict[str, Any],
    trace: dict[str, list[int]],
    steps: pl.DataFrame,
    tokens: pl.DataFrame,
    meta: dict[str, Any],
) -> list[LayerResult]:
    """Follow the id layer by layer (pure: unit-tested on synthetic inputs)."""
    res: list[LayerResult] = []
    entry = trace.get("entry_ns", [])
    res.append(
        LayerResult("entry", bool(entry), "header read from the socket" if entry else "header never seen")
    )
    tasks = trace.get("tasks", [])
    res.append(
        LayerResult(
            "task", bool(tasks), f"task ids {tasks}" if tasks else "no task posted by the request's thread"
        )
    )
    slots = trace.get("slots", [])
    slot, t_launch = (slots[0], slots[1]) if len(slots) >= 2 else (None, None)
    res.append(
        LayerResult(
            "slot", slot is not None, f"slot {slot}" if slot is not None else "no slot launched its task"
        )
    )
    n_steps = 0
    if slot is not None and steps.height:
        n_steps = steps.filter(
            (pl.col("t_start_ns") >= t_launch) & pl.col("seq_ids").list.contains(slot)
        ).height
    res.append(
        LayerResult(
            "steps", n_steps > 0, f"{n_steps} forward passes" if n_steps else "no forward pass for the slot"
        )
    )
    mine = tokens.filter(pl.col("request_id") == rid).sort("decode_order") if tokens.height else tokens
    want = answer.get("tokens", [])
    got = mine["token_id"].to_list() if mine.height else []
    ok = bool(want) and got == want
    res.append(
        LayerResult(
            "tokens",
            ok,
            f"{len(got)} tokens equal to the server's answer"
            if ok
            else f"{len(got)} tokens recorded under the id, the server returned {len(want)}"
            + (" (ids differ)" if got and len(got) == len(want) else ""),
        )
    )
    moe = bool((meta.get("layers") or {}).get("moe"))
    if not moe:
        res.append(LayerResult("routing", True, "n/a (dense model)"))
    else:
        routed = mine.filter(pl.col("expert_ids").list.len() > 0).height if mine.height else 0
        ok = bool(mine.height) and routed == mine.height
        res.append(LayerResult("routing", ok, f"{routed}/{mine.height} tokens carry expert ids"))
    return res


def first_missing(results: list[LayerResult]) -> LayerResult | None:
    return next((r for r in results if not r.ok), None)
