#!/usr/bin/env python3
"""What the scheduler program (thread_waits, probes/sched_waits.bpf.c) costs, as the kernel counts
its programs' runs and run time (record --bpf-stats): one recording of a test engine
(tests/engines/llama_engine.py on the generated MoE model) over PROMPTS x TOKENS greedy tokens.

    sudo .venv/bin/python scripts/sched_waits_cost.py --prompts 4 --tokens 128

Prints meta.json's sched_waits, then per program its runs and mean run time, the step handlers'
time per step, and the same for the main probe programs. The tracepoints run on every switch and
wakeup of the machine (each returns at once for another process's task), so their time is spent
by whatever runs, the engine among them; the step handlers' time is the engine's.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from conftest import ENGINES, Engine, Recorder  # noqa: E402

from sparseety_prof.synthetic import make_model  # noqa: E402

STEP_HANDLERS = ("step_enter", "step_return", "close_more")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="sched-waits-cost-"))
    engine = Engine([str(ENGINES / "llama_engine.py"), str(make_model(d / "moe.gguf", "moe"))])
    try:
        rec = Recorder(engine.pid, d / "rec", "--bpf-stats")
        engine.generate(["Once upon a time"] * a.prompts, max_tokens=a.tokens)
        rc, err = rec.stop(signal.SIGINT)
        if rc != 0:
            print(err, file=sys.stderr)
            return 1
    finally:
        engine.close()
    meta = json.loads((d / "rec" / "meta.json").read_text())
    sw, main_progs = meta["sched_waits"], meta["bpf_programs"]
    steps = meta["counts"]["steps"]
    print(json.dumps({k: v for k, v in sw.items() if k != "programs"}))
    for name, p in sorted(sw["programs"].items()):
        print(f"{name}: {p['runs']} runs, {p['run_ns'] / max(p['runs'], 1):.0f} ns per run")
    handlers = sum(sw["programs"].get(n, {}).get("run_ns", 0) for n in STEP_HANDLERS)
    print(f"steps {steps}: step handlers {handlers / max(steps, 1):.0f} ns per step")
    print(
        f"main probe programs: {main_progs['runs']} runs, {main_progs['run_ns'] / 1e6:.2f} ms, "
        f"{main_progs['run_ns'] / max(steps, 1):.0f} ns per step"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
