"""The uprobe traps alone: a no-op BPF program at every probe point a recording kept, on a live engine.

    sudo .venv/bin/python scripts/bare_traps.py --pid N --probes rec/meta.json [--stats]

The recorder's cost to the engine has three parts: the traps (the breakpoint, the kernel's entry
and exit, the uprobe's dispatch to its BPF program), the programs' own work (reading tensors,
counting activations, copying logits rows into the ring) and the consumer's CPU on the same
cores. `--ablate-consumer` (record/attach) takes the third away; this takes the second away too:
it attaches, through the process's own mappings, a program that returns at once to each point of
the recording's `meta.json` `probes` (entry points as uprobes, return points as uretprobes, the
server's socket tracepoints as tracepoints) but those marked `detached` (the graph-op attention
probes the recorder detaches once the layer map is learned): the set the recorder keeps. Nothing is
read from the engine and nothing goes to a ring: what the engine loses with these attached is the
trap floor of the probe set, whatever the programs do.

It says `attached to PID N (K points, no-op programs)` on stderr once every point is in, then waits
for SIGINT or SIGTERM (or the engine's exit), detaches everything and prints one JSON line on
stdout: the points, and with `--stats` (the kernel's run statistics, on for this process's
lifetime only: capture/bpf_stats.py) each point's runs, i.e. its traps. Exit 0, or 1 with a
message when the recording or the process does not do. scripts/bench_sustained.py --bare-traps
runs it as the B side of its pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparseety_prof.capture import target as tg  # noqa: E402
from sparseety_prof.capture.bpf_stats import enable_run_stats, program_runs  # noqa: E402
from sparseety_prof.errors import NoSuchProcess, NotAnEngine  # noqa: E402

# the recorder's server probes name their four socket tracepoints in one entry
_TRACEPOINTS = ("sys_enter_recvfrom", "sys_exit_recvfrom", "sys_enter_read", "sys_exit_read")


def noop_source(n: int) -> str:
    """n programs that return at once: one per point, so that each one's runs are its point's traps
    (BCC loads a function once per name)."""
    return "".join(f"int noop_{i}(void *ctx) {{ return 0; }}\n" for i in range(n))


def probe_points(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The recording's probe points, as meta.json lists them, less those it detached while it
    ran (the graph-op attention probes, once the layer map was learned): the set it kept."""
    points = meta.get("probes")
    if not isinstance(points, list) or not points:
        raise ValueError("meta.json lists no probes: not a recording of the BPF capture")
    for p in points:
        if not isinstance(p, dict) or p.get("kind") not in ("entry", "return", "tracepoint"):
            raise ValueError(f"meta.json probes: an entry this script does not know: {p!r}")
    return [p for p in points if not p.get("detached")]


def point_label(p: dict[str, Any]) -> str:
    """How a uprobe point of meta.json `probes` is named in the runs this script prints."""
    return f"{p['kind']} {p['symbol']} {Path(p['library']).name}+{int(p['address']):#x}"


class BareTraps:
    """No-op programs at `points` in process `pid`; close() detaches them (idempotent)."""

    def __init__(self, pid: int, points: list[dict[str, Any]], stats: bool = False) -> None:
        import bcc  # Debian's python3-bpfcc (scripts/setup.sh)

        self.stats_fd: int | None = None
        if stats:
            self.stats_fd, why = enable_run_stats()
            if self.stats_fd is None:
                raise RuntimeError(f"run statistics: {why}")
        # the server's one tracepoint entry stands for four tracepoints
        n = sum(len(_TRACEPOINTS) if p["kind"] == "tracepoint" else 1 for p in points)
        self.b = bcc.BPF(text=noop_source(n))
        self.fds: list[tuple[str, int]] = []  # (point, program fd)
        self.closed = False
        try:
            for p in points:
                if p["kind"] == "tracepoint":
                    for tp in _TRACEPOINTS:
                        fn = self.b.load_func(f"noop_{len(self.fds)}", bcc.BPF.TRACEPOINT)
                        self.b.attach_tracepoint(tp=f"syscalls:{tp}", fn_name=fn.name)
                        self.fds.append((f"tracepoint syscalls:{tp}", fn.fd))
                    continue
                fn = self.b.load_func(f"noop_{len(self.fds)}", bcc.BPF.KPROBE)
                # through the process's own mapping of the library, as the recorder attaches
                name = tg.pinned_path(pid, Path(p["library"]))
                attach = self.b.attach_uretprobe if p["kind"] == "return" else self.b.attach_uprobe
                attach(name=name, addr=int(p["address"]), fn_name=fn.name, pid=pid)
                self.fds.append((point_label(p), fn.fd))
        except BaseException:
            self.close()
            raise

    def runs(self) -> dict[str, int]:
        """Each point's runs so far (0 everywhere without the run statistics)."""
        out: dict[str, int] = {}
        for point, fd in self.fds:
            try:
                with open(f"/proc/self/fdinfo/{fd}") as f:
                    out[point] = program_runs(f.read())[0]
            except OSError:
                out[point] = 0
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.b.cleanup()
        if self.stats_fd is not None:
            os.close(self.stats_fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--probes", type=Path, required=True, help="a recording's meta.json")
    ap.add_argument("--stats", action="store_true", help="count each point's runs (kernel run statistics)")
    a = ap.parse_args()
    try:
        points = probe_points(json.loads(a.probes.read_text()))
        traps = BareTraps(a.pid, points, stats=a.stats)
    except (OSError, ValueError, RuntimeError, NotAnEngine, NoSuchProcess) as e:
        print(f"bare_traps: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"bare_traps: attached to PID {a.pid} ({len(traps.fds)} points, no-op programs)", file=sys.stderr)
    while not stop.wait(0.5):
        if not os.path.exists(f"/proc/{a.pid}"):
            break
    runs = traps.runs()
    traps.close()
    print(json.dumps({"points": [p for p, _ in traps.fds], "runs": runs if a.stats else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
