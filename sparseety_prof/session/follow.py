"""`record/attach --follow NAME`: wait for a process of that name, record it until it exits, then
wait for the next one (the engine restarted) and record that, until stopped or --duration ends.

Each attach is an ordinary Recorder run (session/recorder.py, unchanged) writing its own complete
recording DIR/<n>-<pid>; DIR/follow.json lists them. Which processes match is
session/follow_target.py's (by name: capture/process_match.py's rule, exact name and same user;
or a systemd unit's main process). A follower restarted by its service manager reopens its own
DIR (session/follow_dir.py) and numbers its runs on from the last. With --max-disk the runs
together are bounded (session/follow_disk.py); the metrics endpoint and exporters live as long
as the follower (commands/record.py makes each run's sinks). A matching process is often found
before it is an engine (it has not loaded llama.cpp or its model yet): the attach is refused as
"not an engine" and retried while the process lives, from every 0.5 s up to every 5 s, so a
long-lived process of that name that never becomes an engine costs little and does not keep a
newer one from being followed.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sparseety_prof.capture.process_match import Candidate, ProcessRule
from sparseety_prof.errors import NoSuchProcess, NotAnEngine, UnsupportedEngineBuild
from sparseety_prof.session.follow_dir import FOLLOW_FILE, RUN_DIR, open_follow_dir
from sparseety_prof.session.follow_disk import make_room
from sparseety_prof.session.follow_target import FollowTarget, as_target
from sparseety_prof.session.options import Options
from sparseety_prof.session.recorder import Recorder
from sparseety_prof.session.status_line import ProgressTotals, StatusReading
from sparseety_prof.session.stop_flag import StopFlag
from sparseety_prof.store.output_dir import OutputDir, sudo_owner

__all__ = ["FOLLOW_FILE", "Follower", "install_follow_signal_handlers"]

#: the stop reason given to a run an earlier follower left open (it was killed while recording)
FOLLOWER_ENDED = "follower ended"
POLL_S = 0.5  # one pass over /proc this often while waiting
RETRY_MAX_S = 5.0  # a process refused again and again is retried at most this rarely
TARGET_EXITED = "target exited"  # Recorder's stop reason when the engine goes away: follow on
# refusals that may pass once the process has finished starting (libraries, model, graph)
NOT_READY = (NotAnEngine, UnsupportedEngineBuild)


@dataclass
class _Retry:
    at: float = 0.0  # monotonic time of the next attempt
    wait_s: float = POLL_S
    said: str = ""  # the refusal last logged (each new one is shown once)


class Follower:
    """The follow loop. `run()` blocks until stopped; `stop()` may be called from any thread
    (signal handlers, the live view's q key)."""

    def __init__(
        self,
        rule: ProcessRule | FollowTarget,
        opts: Options,
        make_recorder: Callable[[Options], Recorder],
        log: Callable[[str], None],
        *,
        on_recorded: Callable[[dict[str, Any]], None] | None = None,
        after_run: Callable[[dict[str, Any]], None] | None = None,
        proc: Path = Path("/proc"),
    ) -> None:
        self.target = as_target(rule)
        self.opts = opts  # the template of every attach: pid, out and duration are set per attach
        self.make_recorder = make_recorder
        self.log = log
        self.on_recorded = on_recorded  # each closed recording's meta (the summary line)
        self.after_run = after_run  # each closed run's follow.json entry (--dataset)
        self.proc = proc
        self.recordings: list[dict[str, Any]] = []
        self.stop_reason = ""
        self._stop = StopFlag()  # set by signal handlers: threading.Event would deadlock there
        # re-entrant: a signal handler runs stop() on the main thread, which may hold it already
        self._lock = threading.RLock()
        self._current: Recorder | None = None
        self._niceness = os.getpriority(os.PRIO_PROCESS, 0)  # restored after each run
        self._folder: OutputDir | None = None  # DIR, open while following (None without -o)
        self._started = 0
        self._next_n = 1
        self.attaches = 0  # runs attached by this follower (follow.json also lists earlier ones)
        self.totals = ProgressTotals()  # of this follower's closed runs (the status line)

    def stop(self, reason: str) -> None:
        with self._lock:
            if not self._stop.is_set():
                self.stop_reason = reason
                self._stop.set()
            if self._current is not None:
                self._current.stop(reason)

    def run(self) -> list[dict[str, Any]]:
        """Follow until stopped; the recordings made (as follow.json lists them). A failure that
        is not the target's (privileges, BPF, a full disk) ends the loop and is raised, after
        follow.json says so."""
        out = self.opts.out
        self._started = _now_ms()
        if out is not None:
            self._folder, earlier = open_follow_dir(out, self.target.to_meta(), sudo_owner())
            if earlier is not None:
                self._resume(earlier)
        deadline = time.monotonic() + self.opts.duration if self.opts.duration else None
        retries: dict[Candidate, _Retry] = {}
        try:
            self._save()
            self.log(f"sparseety-prof: waiting for {self.target.describe()}")
            while not self._stop.is_set():
                if deadline is not None and time.monotonic() >= deadline:
                    self.stop("duration reached")
                    break
                cand = self._next(retries)
                if cand is None:
                    self._stop.wait(POLL_S)
                    continue
                entry = self._record(cand, retries, deadline)
                if entry is None:
                    continue  # refused for now, or gone: keep waiting
                if entry["stop_reason"] == TARGET_EXITED and not self._stop.is_set():
                    self.log(
                        f"sparseety-prof: PID {cand.pid} exited; waiting for {self.target.label!r} again"
                    )
                elif not self._stop.is_set():
                    self.stop(entry["stop_reason"])  # duration reached, write error: the run's end is ours
        except BaseException as e:
            if not self.stop_reason:
                self.stop_reason = type(e).__name__
            raise
        finally:
            with contextlib.suppress(OSError):
                self._save(ended=True)
            if self._folder is not None:
                self._folder.close()
        return self.recordings

    def summary(self) -> str:
        return (
            f"sparseety-prof: followed {self.target.label!r}: {len(self.recordings)} recording(s); "
            f"stopped: {self.stop_reason}"
        )

    def _next(self, retries: dict[Candidate, _Retry]) -> Candidate | None:
        """The oldest matching process not waiting for a retry."""
        live = self.target.find(self.proc, os.getpid())
        for gone in retries.keys() - set(live):
            del retries[gone]
        now = time.monotonic()
        return next((c for c in live if c not in retries or retries[c].at <= now), None)

    def _record(
        self, cand: Candidate, retries: dict[Candidate, _Retry], deadline: float | None
    ) -> dict[str, Any] | None:
        """One Recorder run on `cand`: its follow.json entry once it ended, or None when the
        process could not be attached (not ready: retried later; gone)."""
        n = self._next_n
        name = f"{n}-{cand.pid}"
        max_disk = self.opts.max_disk
        if max_disk is not None and self._folder is not None:
            with self._lock:  # the runs before this one together within half the bound
                max_disk = make_room(self._folder, self.recordings, max_disk, self.log)
                self._save()
        opts = replace(
            self.opts,
            pid=cand.pid,
            out=self.opts.out / name if self.opts.out is not None else None,
            duration=max(0.1, deadline - time.monotonic()) if deadline is not None else None,
            max_disk=max_disk,
        )
        if cand not in retries:
            self.log(f"sparseety-prof: PID {cand.pid} is {self.target.describe()}: attaching")
        rec = self.make_recorder(opts)
        with self._lock:
            if self._stop.is_set():
                return None
            self._current = rec
        entry: dict[str, Any] = {
            "n": n,
            "pid": cand.pid,
            "dir": name if self.opts.out is not None else None,
            "start_unix_ms": None,
            "end_unix_ms": None,
            "stop_reason": None,  # null while it records
            "tokens": None,
        }
        ended = threading.Event()
        lister = threading.Thread(target=self._list_once_attached, args=(rec, entry, ended), daemon=True)
        lister.start()
        try:
            meta = rec.run()
        except NOT_READY as e:
            if rec.attached.is_set():
                self._close_entry(entry, rec.meta, type(e).__name__)
                raise
            self._retry_later(cand, retries, str(e))
            return None
        except NoSuchProcess:
            self.log(f"sparseety-prof: PID {cand.pid} exited before it could be attached")
            return None
        except BaseException as e:
            if rec.attached.is_set() or rec.meta:
                self._close_entry(entry, rec.meta, type(e).__name__)
            raise
        finally:
            ended.set()
            lister.join()
            with self._lock:
                self._current = None
                if rec.attached.is_set():
                    self.totals.add_closed(rec.progress)
            _restore_priority(self._niceness)  # each Recorder run lowers this thread's priority
            gc.unfreeze()  # the Recorder froze its session's objects: let them go with it
            gc.collect()
        retries.pop(cand, None)
        if self.on_recorded is not None:
            self.on_recorded(meta)
        entry["tokens"] = (meta.get("counts") or {}).get("tokens")
        self._close_entry(entry, meta, meta.get("stop_reason") or "")
        if self.after_run is not None:
            self.after_run(entry)
        return entry

    def status(self) -> StatusReading:
        """The status line's reading (any thread): this follower's runs and the one recording."""
        with self._lock:
            rec = self._current if self._current is not None and self._current.attached.is_set() else None
            return self.totals.reading(
                rec.progress if rec is not None else None,
                runs=self.attaches,
                attached_pid=rec.opts.pid if rec is not None else None,
            )

    def _resume(self, earlier: dict[str, Any]) -> None:
        """Go on in the directory an earlier follower (this one, restarted) made: its runs stay
        listed and the new ones are numbered after them, in folders of their own."""
        runs = [r for r in earlier["recordings"] if isinstance(r, dict) and isinstance(r.get("n"), int)]
        for r in runs:
            if r.get("stop_reason") is None:  # it was killed while recording this one
                r["stop_reason"] = FOLLOWER_ENDED
                r["end_unix_ms"] = r.get("end_unix_ms") or r.get("start_unix_ms")
        self.recordings = runs
        # (a run's folder made but not listed yet when the follower was killed counts too)
        made = (
            [int(n.split("-", 1)[0]) for n in os.listdir(self._folder.fd) if RUN_DIR.fullmatch(n)]
            if self._folder
            else []
        )
        self._next_n = max((*(r["n"] for r in runs), *made), default=0) + 1
        self._started = earlier.get("start_unix_ms") or self._started
        self.log(
            f"sparseety-prof: going on in {self.opts.out} after its {len(runs)} recording(s); "
            f"the next is number {self._next_n}"
        )

    def _list_once_attached(self, rec: Recorder, entry: dict[str, Any], ended: threading.Event) -> None:
        """List the recording in follow.json as soon as it is attached (still recording), so
        that a follower killed outright leaves its last recording listed too."""
        while not ended.is_set():
            if rec.attached.wait(0.2):
                with self._lock:
                    entry["start_unix_ms"] = _now_ms()
                    self.recordings.append(entry)
                    self._next_n = entry["n"] + 1
                    self.attaches += 1
                    with contextlib.suppress(OSError):
                        self._save()
                return

    def _close_entry(self, entry: dict[str, Any], meta: dict[str, Any], reason: str) -> None:
        with self._lock:
            entry["start_unix_ms"] = meta.get("start_unix_ms") or entry["start_unix_ms"]
            entry["end_unix_ms"] = meta.get("end_unix_ms") or _now_ms()
            entry["stop_reason"] = reason
            if not any(e is entry for e in self.recordings):
                self.recordings.append(entry)
                self._next_n = entry["n"] + 1
            self._save()

    def _retry_later(self, cand: Candidate, retries: dict[Candidate, _Retry], why: str) -> None:
        r = retries.setdefault(cand, _Retry())
        if why != r.said:
            self.log(f"sparseety-prof: PID {cand.pid} not attachable yet ({why}); retrying while it runs")
            r.said = why
        r.at = time.monotonic() + r.wait_s
        r.wait_s = min(RETRY_MAX_S, r.wait_s * 2)

    def _save(self, *, ended: bool = False) -> None:
        """follow.json, rewritten whole (owner-only; never half-written: OutputDir.write_atomic)."""
        if self._folder is None:
            return
        with self._lock:
            doc = {
                "follow": self.target.to_meta(),
                "start_unix_ms": self._started,
                "end_unix_ms": _now_ms() if ended else None,
                "stop_reason": self.stop_reason if ended else None,
                "recordings": self.recordings,
            }
            data = json.dumps(doc, indent=1).encode() + b"\n"
            self._folder.write_atomic(FOLLOW_FILE, lambda f: f.write(data))


def _times(meta: dict[str, Any]) -> dict[str, Any]:
    return {"start_unix_ms": meta.get("start_unix_ms"), "end_unix_ms": meta.get("end_unix_ms")}


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _restore_priority(niceness: int) -> None:
    """Back to the priority the follow began with: each Recorder run adds --nice to this thread's
    niceness (os.nice) and may leave it at SCHED_IDLE; unrestored, the second run would start at
    twice --nice. Raising a priority again needs root (CAP_SYS_NICE); without it, it stays low."""
    with contextlib.suppress(OSError):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, niceness)


def install_follow_signal_handlers(follower: Follower) -> None:
    """Ctrl-C, SIGTERM, SIGHUP: the recording being made is closed complete, and the follow ends."""

    def handler(signum: int, _frame: object) -> None:
        follower.stop(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)
