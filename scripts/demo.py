"""The main job on the built-in default: generate a model, start a real engine, attach the
profiler by PID, send prompts, and show what was recorded: each request's tokens with the experts
and the sparsity of every layer.

    bash scripts/demo.sh                 # as root: scripts/install.sh first, then this
    .venv/bin/python scripts/demo.py [--engine xllamacpp|llama-cpp-python] [--out DIR]

The engine is xllamacpp's llama-server (scripts/install.sh installs its wheel); llama-cpp-python
is the test set-up's engine (scripts/setup.sh builds it).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparseety_prof.synthetic import PRESETS, make_model  # noqa: E402
from sparseety_prof.views.decisions import Row  # noqa: E402

PROMPTS = ["hello the expert router", "the sparse decode sample", "one two three"]


def log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def start(cmd: list[str]) -> tuple[subprocess.Popen[str], dict[str, object]]:
    p = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith("{"):
            return p, json.loads(line)
    raise SystemExit(f"engine failed to start: {' '.join(cmd)}")


def free_port() -> int:
    """A TCP port of 127.0.0.1 nothing listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Polars lines shown at the end of the demo, with what each gives ({request}: the request shown);
#: tests run each against a recording
POLARS_LINES = (
    ("one request's tokens", "r.tokens().filter(pl.col('request_id') == {request!r})"),
    ("expert load per layer", "r.routes().explode('expert_ids').group_by('layer', 'expert_ids').len()"),
    ("what the anomaly detectors find, as a frame", "r.anomalies()"),
)


def next_steps(out: Path, request: str) -> list[str]:
    """Where to look next: the commands and Python lines that go further into the recording (the
    HTML report only where this checkout's `report` has it)."""
    from sparseety_prof.commands import report

    sub = argparse.ArgumentParser().add_subparsers()
    report.add_parser(sub)
    html = any("--html" in a.option_strings for a in sub.choices["report"]._actions)
    rec = str(out)
    cmds = [
        (
            '.venv/bin/sparseety-prof report "$REC" --anomalies',
            "what the anomaly detectors find, tokens around",
        ),
        *(
            [('.venv/bin/sparseety-prof report "$REC" --html report.html', "heat maps, routing, sparsity")]
            if html
            else []
        ),
        (
            '.venv/bin/sparseety-prof export "$REC" --format perfetto -o trace.json',
            "open it in ui.perfetto.dev",
        ),
    ]
    # the path once, in a shell variable: the commands stay within 80 columns
    lines = ["where to look next:", f"  REC={shlex.quote(rec)}", *(f"  {c}\n      {why}" for c, why in cmds)]
    lines += [
        "  in Python (more in sparseety_prof/views/examples.py):",
        "    import sparseety_prof, polars as pl",
    ]
    lines.append(f"    r = sparseety_prof.open({rec!r})")
    for why, code in POLARS_LINES:
        lines += [f"    # {why}", "    " + code.format(request=request)]
    return lines


def final_screen(out: Path, console: Console | None = None) -> list[Row]:
    """The demo's last screen: one request's tokens with their experts and sparsity per layer, and
    where to look next; returns the decision rows shown."""
    import sparseety_prof
    from sparseety_prof.terminal_text import line
    from sparseety_prof.views.decisions import first_request, print_decisions

    con = console or Console()
    rec = sparseety_prof.open(out)
    tokens = rec.tokens()
    request = first_request(tokens)
    if request is None:
        con.print("no request was recorded from its start", style="bold red")
        return []
    rows = print_decisions(con, tokens, rec.meta, request)
    for text in next_steps(out, request):
        con.print(line(text), markup=False, highlight=False)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--engine",
        choices=["xllamacpp", "llama-cpp-python"],
        default="xllamacpp",
        help="xllamacpp: llama-server from its wheel (default); llama-cpp-python: needs scripts/setup.sh",
    )
    # smallthinker's experts are ReGLU: about half their activations are exactly zero, so the
    # sparsity columns have something to show (SwiGLU, as in "moe", gives almost no exact zeros)
    ap.add_argument(
        "--preset", default="smallthinker", choices=list(PRESETS), help="model (sparseety_prof/synthetic)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "recordings" / time.strftime("demo-%Y%m%d-%H%M%S"))
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt")
    a = ap.parse_args()

    model = make_model(ROOT / "models" / f"{a.preset}.gguf", a.preset)
    log(f"model: {model} ({model.stat().st_size / 1e6:.1f} MB)")
    if a.engine == "llama-cpp-python":
        eng, ready = start([sys.executable, str(ROOT / "tests" / "engines" / "llama_engine.py"), str(model)])
    else:
        server = [sys.executable, str(ROOT / "scripts" / "demo_server.py"), str(model)]
        eng, ready = start([*server, "--port", str(free_port())])
    pid = int(str(ready["ready"]))
    log(f"engine {a.engine} running as PID {pid}")

    cmd = [sys.executable, "-m", "sparseety_prof.cli", "record", "--pid", str(pid), "-o", str(a.out)]
    log("attaching: " + " ".join(["sparseety-prof", *cmd[3:]]))
    rec = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert rec.stderr is not None
    for line in rec.stderr:
        sys.stderr.write(line)
        if "attached to PID" in line:
            break
        if rec.poll() is not None:
            return rec.returncode
    try:
        if a.engine == "llama-cpp-python":
            assert eng.stdin and eng.stdout
            eng.stdin.write(json.dumps({"prompts": PROMPTS, "max_tokens": a.tokens}) + "\n")
            eng.stdin.flush()
            json.loads(eng.stdout.readline())
        else:
            for p in PROMPTS:
                body = json.dumps({"prompt": p, "n_predict": a.tokens, "temperature": 0}).encode()
                req = urllib.request.Request(f"{ready['url']}/completion", data=body)
                urllib.request.urlopen(req, timeout=300).read()
        log(f"sent {len(PROMPTS)} prompts")
    finally:
        rec.send_signal(signal.SIGINT)
        _, err = rec.communicate(timeout=60)
        sys.stderr.write(err)
        eng.kill()
        eng.wait()
    if rec.returncode != 0:
        return rec.returncode
    from sparseety_prof.views.report import print_report

    print_report(a.out)
    final_screen(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
