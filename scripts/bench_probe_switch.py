"""What taking the duty cycle's probes out and putting them back costs, two ways
(capture/probe_switch.py, docs/tuning.md "Duty cycle"): detaching and attaching again (BCC
detach_uprobe / attach_uprobe), and disabling / enabling the probes' perf events
(PERF_EVENT_IOC_DISABLE / ENABLE on their fds). For each it reports the recorder's wall time per
switch, whether the breakpoint is still in the engine's code (the byte at the probe, read from
/proc/PID/mem: 0xcc is int3) and how often the probe's BPF program ran over a few tokens.

    sudo .venv/bin/python scripts/bench_probe_switch.py [--repeat 10]

Starts the test MoE model under tests/engines/llama_engine.py; root (BPF).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # probe_memory lives there

from probe_memory import byte_at, runtime_address  # noqa: E402

from sparseety_prof.capture.bpf_loader import AttachedProbe, Session  # noqa: E402
from sparseety_prof.capture.probe_switch import ProbeSwitch  # noqa: E402
from sparseety_prof.session.attach import attach  # noqa: E402
from sparseety_prof.session.options import Options  # noqa: E402
from sparseety_prof.synthetic import make_model  # noqa: E402

PERF_EVENT_IOC_ENABLE, PERF_EVENT_IOC_DISABLE = 0x2400, 0x2401


class _Engine:
    def __init__(self, model: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "engines" / "llama_engine.py"), str(model)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.pid = int(self._read()["ready"])

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the engine exited")
            if line.startswith("{"):
                return dict(json.loads(line))

    def generate(self, n: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": ["hello the expert router"], "max_tokens": n}) + "\n")
        self.proc.stdin.flush()
        self._read()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _byte(pid: int, address: int) -> str:
    return byte_at(pid, address).hex()


def _runs(sess: Session, programs: set[str]) -> int:
    return sum(v["runs"] for k, v in sess.program_costs().items() if k in programs)


def _perf_fds(sess: Session, probes: list[AttachedProbe]) -> list[int]:
    bpf = sess.bpf
    names = set()
    for p in probes:
        path, addr = bpf._check_path_symbol(p.via.encode(), b"", p.address, sess.pid, 0)
        names.add(bpf._get_uprobe_evname(b"p" if p.kind == "entry" else b"r", path, addr, sess.pid))
    return [fd for name, fd in bpf.uprobe_fds.items() if name in names]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        engine = _Engine(make_model(Path(d) / "moe.gguf", "moe"))
        try:
            a = attach(Options(pid=engine.pid, out=None), lambda s: None)
            switch = ProbeSwitch(a.session)
            probe = switch.probes[0]
            address = runtime_address(engine.pid, probe)
            programs = {p.program for p in switch.probes}
            a.session.enable_run_stats()

            def runs_over_tokens() -> int:
                r0 = _runs(a.session, programs)
                engine.generate(args.tokens)
                return _runs(a.session, programs) - r0

            print(f"probes switched: {sorted({p.symbol for p in switch.probes})}")
            print(
                f"attached: byte {_byte(engine.pid, address)}, "
                f"program runs over {args.tokens} tokens: {runs_over_tokens()}"
            )
            off_ms, on_ms = [], []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                switch.disarm()
                t1 = time.perf_counter()
                switch.arm()
                off_ms.append((t1 - t0) * 1e3)
                on_ms.append((time.perf_counter() - t1) * 1e3)
            switch.disarm()
            print(
                f"detach: {min(off_ms):.2f}-{max(off_ms):.2f} ms, "
                f"attach: {min(on_ms):.2f}-{max(on_ms):.2f} ms; "
                f"detached: byte {_byte(engine.pid, address)}, runs {runs_over_tokens()}"
            )
            switch.arm()
            fds = _perf_fds(a.session, switch.probes)
            off_ms, on_ms = [], []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                for fd in fds:
                    fcntl.ioctl(fd, PERF_EVENT_IOC_DISABLE, 0)
                t1 = time.perf_counter()
                for fd in fds:
                    fcntl.ioctl(fd, PERF_EVENT_IOC_ENABLE, 0)
                off_ms.append((t1 - t0) * 1e3)
                on_ms.append((time.perf_counter() - t1) * 1e3)
            for fd in fds:
                fcntl.ioctl(fd, PERF_EVENT_IOC_DISABLE, 0)
            print(
                f"ioctl disable: {min(off_ms):.3f}-{max(off_ms):.3f} ms, "
                f"enable: {min(on_ms):.3f}-{max(on_ms):.3f} ms; "
                f"disabled: byte {_byte(engine.pid, address)}, runs {runs_over_tokens()}"
            )
            a.session.close()
        finally:
            engine.close()


if __name__ == "__main__":
    main()
