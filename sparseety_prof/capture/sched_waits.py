"""Who took the CPU: the scheduler program (probes/sched_waits.bpf.c) loaded for one engine, its
per-(step, thread) records read on the consumer's thread (`take`), and unloaded (`close`).

The program traps the engine's steps at the function the token probes trap (process_ubatch),
through the same mapping and address, so that the kernel runs both on one trap. The engine's
threads that exist when it loads are given their state from /proc (a thread running or runnable
counts as on CPU until its first switch); threads made later are found by the program itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparseety_prof.capture import bpf_stats
from sparseety_prof.capture import target as tg
from sparseety_prof.capture.bpf_loader import Session, import_bcc
from sparseety_prof.capture.resources import PROBES_DIR
from sparseety_prof.errors import BpfUnavailable, MissingPrivileges

#: engine threads counted (llama-server's HTTP pool included); more are counted lost
MAX_THREADS = 512
#: pages of the record ring: one record per active thread per step, drained every drain
WAIT_PAGES = 256
#: the program's record (struct wait_rec)
WAIT_DTYPE = np.dtype(
    [
        ("t_start", "<u8"),
        ("t_end", "<u8"),
        ("step_tid", "<u4"),
        ("tid", "<u4"),
        ("on_ns", "<u8"),
        ("run_ns", "<u8"),
        ("sleep_ns", "<u8"),
        ("stop_ns", "<u8"),
        ("rec_ns", "<u8"),
        ("eng_ns", "<u8"),
        ("oth_ns", "<u8"),
        ("top_tgid", "<u4"),
        ("pad", "<u4"),
        ("top_ns", "<u8"),
        ("top_comm", "S16"),
    ]
)
# the program's states (ST_* in sched_waits.bpf.c), and the /proc state letters they start from
_ST_ON, _ST_SLEEP, _ST_STOP = 0, 2, 3
_PROC_STATE = {"R": _ST_ON, "S": _ST_SLEEP, "D": _ST_SLEEP, "I": _ST_SLEEP, "T": _ST_STOP, "t": _ST_STOP}


@dataclass(frozen=True)
class StepTrap:
    """Where the token probes trap a step: the file attached through and the address in it."""

    via: str
    address: int


def step_trap(sess: Session) -> StepTrap | None:
    """The main program's process_ubatch entry point (None: not attached)."""
    for p in sess.attached:
        if p.symbol == tg.SYM_UBATCH and p.kind == "entry":
            return StepTrap(p.via or p.library, p.address)
    return None


def load_program(pid: int, recorder_pid: int) -> tuple[Any, float]:
    """The scheduler program compiled and loaded for engine `pid` (`recorder_pid`'s threads counted
    as the recorder's), its tracepoints on and the engine's threads as they are now given their
    slots: (the BCC object, seconds its compile took). It may be loaded before the token probes
    attach (it does not need them until SchedWaits). BpfUnavailable / MissingPrivileges."""
    bcc = import_bcc()
    cflags = [
        f"-DTARGET_TGID={pid}",
        f"-DRECORDER_TGID={recorder_pid}",
        f"-DMAX_THREADS={MAX_THREADS}",
        f"-DMAX_CPUS={_possible_cpus()}",
        f"-DWAIT_PAGES={WAIT_PAGES}",
        "-Wno-macro-redefined",
    ]
    t0 = time.monotonic()
    try:
        b = bcc.BPF(src_file=str(PROBES_DIR / "sched_waits.bpf.c"), cflags=cflags)
    except Exception as e:
        if "Operation not permitted" in str(e):
            raise MissingPrivileges(f"the kernel refused the scheduler program ({e}): run as root") from None
        raise BpfUnavailable(f"could not load the scheduler program: {e}") from None
    compile_s = time.monotonic() - t0
    try:
        more = b.load_func("close_more", bcc.BPF.KPROBE)
        b["close_tail"][ctypes.c_int(0)] = ctypes.c_int(more.fd)
        _seed_threads(b, pid)
    except Exception as e:
        with contextlib.suppress(Exception):
            b.cleanup()
        raise BpfUnavailable(f"could not load the scheduler program: {e}") from None
    return b, compile_s


def _seed_threads(b: Any, pid: int) -> None:
    """The engine's threads as they are now, each from its /proc state (their time before this is
    nobody's); those the program already gave a slot (its tracepoints are on) keep theirs."""
    thr, slots, count = b["thr"], b["tid_slot"], b["nslots"]
    now = time.monotonic_ns()  # bpf_ktime_get_ns's clock
    k = int(count[ctypes.c_int(0)].value)
    for tid, state in _thread_states(pid):
        if k >= MAX_THREADS:
            break
        if ctypes.c_uint32(tid) in slots:
            continue
        leaf = thr.Leaf()
        leaf.tid, leaf.idx, leaf.state, leaf.since = tid, k, state, now
        thr[ctypes.c_int(k)] = leaf
        slots[ctypes.c_uint32(tid)] = ctypes.c_uint32(k)
        k += 1
        count[ctypes.c_int(0)] = ctypes.c_uint32(k)


class SchedWaits:
    """The scheduler program (load_program) attached to engine `pid`'s steps at `trap`.
    BpfUnavailable when it cannot be; the program is unloaded then."""

    def __init__(self, bpf: Any, compile_s: float, pid: int, trap: StepTrap) -> None:
        self._bpf = bpf
        self.compile_s = compile_s
        self.pid = pid
        self._chunks: list[bytes] = []
        try:
            self._bpf["waits"].open_ring_buffer(self._on_record)
            # the return handler first: a step whose start this program sees must have its end seen
            self._bpf.attach_uretprobe(name=trap.via, addr=trap.address, fn_name="step_return", pid=pid)
            self._bpf.attach_uprobe(name=trap.via, addr=trap.address, fn_name="step_enter", pid=pid)
        except Exception as e:
            self.close()
            tg.check_process(pid)
            raise BpfUnavailable(f"could not attach the scheduler program to PID {pid}: {e}") from None

    def _on_record(self, _ctx: object, data: int, size: int) -> None:
        self._chunks.append(ctypes.string_at(data, size))

    def take(self) -> np.ndarray:
        """The records the program left since the last take (WAIT_DTYPE)."""
        self._bpf.ring_buffer_consume()
        chunks, self._chunks = self._chunks, []
        if not chunks:
            return np.zeros(0, WAIT_DTYPE)
        return np.frombuffer(b"".join(c[: WAIT_DTYPE.itemsize] for c in chunks), WAIT_DTYPE)

    def losses(self) -> dict[str, int]:
        """Threads beyond MAX_THREADS and records a full ring lost."""
        lost = self._bpf["lost"]
        return {
            "threads_not_counted": int(lost[ctypes.c_int(0)].value),
            "records_lost": int(lost[ctypes.c_int(1)].value),
        }

    def program_costs(self) -> dict[str, dict[str, int]]:
        """Each of its programs' runs and nanoseconds run so far, counted by the kernel while its run
        statistics are on (record --bpf-stats); programs that never ran are left out."""
        out: dict[str, dict[str, int]] = {}
        for name, fn in list(getattr(self._bpf, "funcs", {}).items()):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                runs, ns = bpf_stats.program_runs(Path(f"/proc/self/fdinfo/{fn.fd}").read_text())
                if runs:
                    out[name.decode() if isinstance(name, bytes) else str(name)] = {
                        "runs": runs,
                        "run_ns": ns,
                    }
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._bpf.cleanup()


def _possible_cpus() -> int:
    """How many CPUs the kernel may ever run (a CPU's number is below it)."""
    try:
        text = Path("/sys/devices/system/cpu/possible").read_text().strip()
        return int(text.replace(",", "-").split("-")[-1]) + 1
    except (OSError, ValueError):
        return os.cpu_count() or 1


def _thread_states(pid: int) -> list[tuple[int, int]]:
    """(tid, program state) of each thread of `pid` (those gone meanwhile left out)."""
    out: list[tuple[int, int]] = []
    try:
        entries = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # gone: the attach says so
        return out
    for entry in entries:
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the state follows the command name, which is in parentheses and may hold anything
        letter = stat[stat.rfind(")") + 2 : stat.rfind(")") + 3]
        if letter in _PROC_STATE:
            out.append((int(entry.name), _PROC_STATE[letter]))
    return out
