"""The consumer's per-drain work, measured without the engine: the drains of a real run are kept,
then fed again to a new correlator as many times as wanted, timed on the thread's CPU clock.

    sudo .venv/bin/python scripts/replay_drains.py capture -o drains.pkl [--engine server]
        [--clients 4] [--threads 2] [--seconds 20] [--tokens 64] [--record-args '...']
    .venv/bin/python scripts/replay_drains.py replay drains.pkl [--repeat 3] [--profile 25]
        [--profile-sort cumulative]

`capture` starts the engine of scripts/bench_sustained.py on the `bench` model of
sparseety_prof/synthetic (llama-cpp-python, or xllamacpp's llama-server with `--clients` streaming
clients), attaches `sparseety-prof record` to it and runs the load for `--seconds`. The recorder
runs with two additions, made here and nowhere in the package: each drain's records are copied
before the consumer takes them (the logits records copied too, never read in the ring), and the
correlator's settings are kept. A drain file holds the recorded tokens' logits: about 130 KiB a
token at this vocabulary.

`replay` feeds the drains, in order, to a correlator made with those settings (token texts from
the same model file), checks that it made as many token and step rows as the recorder did (exit
1 if not), and prints, per recorded token, the bytes of records the probes sent by kind of record,
and the CPU time of each stage the recorder's
consumer has (`meta.json` consumer.cpu_s_by_stage names): `decode` (the records viewed by
layout), `correlate` (Correlator.feed), `rows` (take_tables and take_apart, less the logits statistics),
`logits` (those statistics), `frames` (the tables' rows made Polars frames, as the recorder
gathers them, and at each flush its garbage collection: session/collector.py) and `write` (the
flush: those frames, and the rows a policy set apart (Correlator head_rows_apart), to the
always-on aggregates, and the frames to a recording in a temporary folder,
Parquet segments, meta.json and its close; process CPU time, since Polars writes on its own
threads too; `--no-write` leaves it out). A flush comes every FLUSH_INTERVAL_S / the captured
run's drain interval (meta.json consumer.drain_interval_s) drains, as under load. Not replayed:
the policies and the sinks. The minimum
over `--repeat` replays is printed: the replays are identical work, so the minimum is the one
least disturbed by the rest of the machine. `--profile N` adds the Python function calls per
token in Correlator.feed (a count the VM's drift does not move) and the N functions with the
most own time there, or with `--profile-sort cumulative` the most time with what they call
(cProfile, on one more replay; its overhead inflates every figure of that replay, so it is
printed apart); `--profile-stage rows` profiles take_tables and take_apart instead, `frames` the
rows made frames (ColumnBuffer), `write` the writes (their Python on the consumer's thread:
Polars's own threads are not seen).

The correlator replayed is the one the package imports: compiled by mypyc where scripts/setup.sh
built it (the first line printed says which), its Python source with SPARSEETY_PROF_PURE_PYTHON=1
(cProfile sees no call inside compiled modules: profile the source). `capture` records with the
source's correlator (it replaces Correlator.__init__); the probes' records are the same.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pickle
import pstats
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

STAGES = ("decode", "correlate", "rows", "logits", "frames", "write")


# ------------------------------------------------------------------ capture

#: the longest pause between drains of a capture whose meta.json does not say it (before
#: --drain-interval: a fixed 0.5 s)
LEGACY_DRAIN_S = 0.5


def captured_drain_s(kept: dict[str, Any]) -> float:
    """The captured recorder's longest pause between drains (meta.json consumer.drain_interval_s):
    the replay flushes once per FLUSH_INTERVAL_S of drains at that pace, as the recorder did
    under load, whatever the replaying package's default."""
    consumer = kept.get("meta", {}).get("consumer")
    value = consumer.get("drain_interval_s") if isinstance(consumer, dict) else None
    return float(value) if isinstance(value, (int, float)) and value > 0 else LEGACY_DRAIN_S


def _record(dump: Path, argv: list[str]) -> int:
    """The recorder (`sparseety-prof record argv...`) with its drains and correlator settings
    kept in `dump` when it exits."""
    # (the source's correlator: a compiled class's __init__ cannot be replaced; the drains are the
    # probes' records either way)
    os.environ["SPARSEETY_PROF_PURE_PYTHON"] = "1"
    from sparseety_prof import cli
    from sparseety_prof.capture.bpf_loader import RingReader
    from sparseety_prof.correlate.correlator import Correlator
    from sparseety_prof.session.drain_loop import DrainLoop
    from sparseety_prof.store.recording_writer import WRITER_META_KEYS

    drains: list[dict[int, Any]] = []
    kept: dict[str, Any] = {}
    take, decode, init = RingReader.take, DrainLoop.decode, Correlator.__init__

    def take_copied(self: RingReader, *a: Any, **kw: Any) -> Any:
        return take(self, *a, **{**kw, "by_ref": False})  # logits records copied, not referenced

    def decode_kept(self: DrainLoop, records: dict[int, Any], **kw: Any) -> Any:
        drains.append({size: buf.copy() for size, buf in records.items()})
        kept["logits_chunk"] = self.sess.logits_chunk
        return decode(self, records, **kw)

    def init_kept(self: Correlator, **kw: Any) -> None:
        kept["correlator"] = {
            **{k: v for k, v in kw.items() if k not in ("texts", "serving")},
            "serving": kw.get("serving") is not None,
        }
        init(self, **kw)

    RingReader.take = take_copied  # type: ignore[method-assign]
    DrainLoop.decode = decode_kept  # type: ignore[method-assign]
    Correlator.__init__ = init_kept  # type: ignore[method-assign]
    rc = cli.main(["record", *argv])
    # what the recorder made of them, for the replay to compare with
    meta = json.loads((Path(argv[argv.index("-o") + 1]) / "meta.json").read_text())
    kept["recorded"] = {"tokens": meta["counts"]["tokens"], "steps": meta["counts"]["steps"]}
    kept["meta"] = {k: v for k, v in meta.items() if k not in WRITER_META_KEYS}
    with dump.open("wb") as f:
        pickle.dump({**kept, "drains": drains}, f, protocol=pickle.HIGHEST_PROTOCOL)
    return rc


def capture(a: argparse.Namespace) -> int:
    from bench_overhead import EngineProc, start_recorder
    from bench_policy_cpu import generate
    from bench_sustained import PROMPTS, Server

    from sparseety_prof.synthetic import make_model

    model = make_model(ROOT / "models" / "bench.gguf", "bench")
    engine: EngineProc | Server = (
        Server(model, threads=a.threads, clients=a.clients)
        if a.engine == "server"
        else EngineProc(model, threads=a.threads)
    )
    try:
        with tempfile.TemporaryDirectory(prefix="sparseety-replay-") as tmp:
            cmd = [sys.executable, __file__, "_record", str(a.out.resolve()), "--pid", str(engine.pid)]
            cmd += ["-o", str(Path(tmp) / "rec"), *shlex.split(a.record_args)]
            rec = start_recorder(cmd)
            assert rec.stderr is not None
            if isinstance(engine, Server):
                n = engine.load(a.seconds, a.tokens).tokens
            else:
                deadline, n, i = time.monotonic() + a.seconds, 0, 0
                while time.monotonic() < deadline:
                    n += generate(engine, [PROMPTS[i % len(PROMPTS)]], a.tokens)
                    i += 1
            rec.send_signal(signal.SIGINT)
            rest = rec.stderr.read()
            if rec.wait() != 0:
                raise RuntimeError(f"recorder exited {rec.returncode}: {rest}")
    finally:
        engine.close()
    os.chmod(a.out, 0o600)  # logits and tokens of the run: as sensitive as a recording
    print(f"[replay] {n} tokens generated; drains kept in {a.out} ({a.out.stat().st_size >> 20} MiB)")
    return 0


# ------------------------------------------------------------------ replay
@contextlib.contextmanager
def _profiled(prof: cProfile.Profile | None, on: bool) -> Iterator[None]:
    """cProfile on around the block when `on` (the stage --profile-stage names)."""
    if prof is None or not on:
        yield
        return
    prof.enable()
    try:
        yield
    finally:
        prof.disable()


def _replay_once(
    kept: dict[str, Any],
    texts: Any,
    prof: cProfile.Profile | None,
    out: Path | None,
    *,
    correlate_every: float,
    profile_stage: str = "correlate",
    evict_mib: int = 0,
) -> tuple[dict[str, float], dict[str, int]]:
    import numpy as np

    from sparseety_prof.capture.events import decode_groups
    from sparseety_prof.correlate.correlator import Correlator
    from sparseety_prof.correlate.serving import ServingTracker
    from sparseety_prof.session.collector import FlushTimedCollector
    from sparseety_prof.session.drain_batches import DrainBatches
    from sparseety_prof.session.options import FLUSH_INTERVAL_S
    from sparseety_prof.store.buffers import ColumnBuffer

    drain_s = captured_drain_s(kept)
    flush_every = max(1, round(FLUSH_INTERVAL_S / drain_s))  # drains, under load
    # each drain correlated as taken, its logits rows' statistics made at take_tables, or as the
    # recorder's --correlate-every: reduced as taken, correlated together (session/drain_batches.py)
    together = DrainBatches(correlate_every) if correlate_every and DrainBatches.available() else None
    drains_per = max(1, round(correlate_every / drain_s))
    kw = dict(kept["correlator"])
    serving = ServingTracker(kw["pid"]) if kw.pop("serving") else None
    corr = Correlator(**kw, texts=texts, serving=serving)
    rows = ColumnBuffer()
    writes = _Writes(kept["meta"], out) if out is not None else None
    cpu = dict.fromkeys(STAGES, 0.0)
    made = {"tokens": 0, "steps": 0}
    clock = time.thread_time
    drains = kept["drains"]
    collector = FlushTimedCollector()
    collector.start()
    # live, the engine runs between two drains and streams its weights through the caches
    evict = np.zeros(evict_mib << 17, dtype=np.float64) if evict_mib else None
    for k, groups in enumerate(drains):
        final = k == len(drains) - 1
        if evict is not None:
            evict += 1.0  # (read and written: the caches hold these lines, dirty, and not the consumer's)
        t0 = clock()
        batch = decode_groups(groups, kept["logits_chunk"])
        t1 = clock()
        cpu["decode"] += t1 - t0
        batches = [batch]
        if together is not None:
            together.add(batch, final=final)
            cpu["logits"] += clock() - t1
            flushing = (k + 1) % flush_every == 0
            if not (final or flushing or (k + 1) % drains_per == 0):
                continue
            batches = together.take()
        for b, batch in enumerate(batches):
            last = final and b == len(batches) - 1
            t1 = clock()
            with _profiled(prof, profile_stage == "correlate"):
                corr.feed(batch)
            t2 = clock()
            logits0 = corr.logits_cpu_s
            with _profiled(prof, profile_stage == "rows"):
                tables = corr.take_tables(final=last)
                apart = corr.take_apart()  # (head sampling in the probes: a dropped request's rows)
            t3 = clock()
            with _profiled(prof, profile_stage == "frames"):
                due = [(t, df) for t, cols in tables.items() for df in rows.add(t, cols, final=last)]
            t4 = clock()
            if writes is not None and (due or apart):  # the recorder hands them on at once (_emit)
                p = time.process_time()
                with _profiled(prof, profile_stage == "write"):
                    writes.emit(due)
                    writes.emit_apart(apart)
                cpu["write"] += time.process_time() - p
            logits = corr.logits_cpu_s - logits0
            made["tokens"] += len(tables["tokens"]["step_id"])
            made["steps"] += len(tables["steps"]["step_id"])
            for table, parts in apart.items():
                made[table] += sum(p.n for p in parts)
            stages = ("correlate", "rows", "logits", "frames")
            for stage, dt in zip(stages, (t2 - t1, t3 - t2 - logits, logits, t4 - t3), strict=True):
                cpu[stage] += dt
        if (k + 1) % flush_every == 0 or final:  # the recorder's flush: the rest of the rows framed
            t = clock()
            with _profiled(prof, profile_stage == "frames"):
                frames = rows.take_all()
            t5, p5 = clock(), time.process_time()  # Polars writes and aggregates on its own threads too
            if writes is not None:
                with _profiled(prof, profile_stage == "write"):
                    writes.flush(frames, final=final)
            t6, p6 = clock(), time.process_time()
            collector.after_flush()
            cpu["frames"] += t5 - t + clock() - t6
            cpu["write"] += p6 - p5
    collector.stop()
    if writes is not None:
        p = time.process_time()
        writes.close()
        cpu["write"] += time.process_time() - p
    return cpu, made


class _Writes:
    """The recorder's flush (session/recorder.py `_flush_now`) without its policy and sinks: each
    frame to the always-on aggregates and the recording, then the aggregates of closed buckets
    and the recording's Parquet segments and meta.json, in a new recording under `out`."""

    def __init__(self, meta: dict[str, Any], out: Path) -> None:
        from sparseety_prof.session.options import FLUSH_INTERVAL_S
        from sparseety_prof.store.aggregates import Aggregator
        from sparseety_prof.store.recording import list_layers
        from sparseety_prof.store.recording_writer import RecordingWriter

        shutil.rmtree(out, ignore_errors=True)
        self.writer = RecordingWriter(out, meta)
        self.aggregates = Aggregator(list_layers(meta), grace_s=max(10.0, 2 * FLUSH_INTERVAL_S))

    def emit(self, frames: Any) -> None:
        for table, df in frames:
            self.aggregates.add(table, df)
            self.writer.append(table, df)

    def emit_apart(self, apart: Any) -> None:
        for table, parts in apart.items():  # (AggregateReader.take_apart; the policy is not replayed)
            self.aggregates.add_rows(table, parts)

    def flush(self, frames: Any, *, final: bool) -> None:
        self.emit(frames)
        # the replay's clock is not the recording's: every bucket is closed at the end only
        agg = self.aggregates.take(None) if final else None
        if agg is not None and agg.height:
            self.writer.append("aggregates", agg)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def replay(a: argparse.Namespace) -> int:
    from sparseety_prof.capture.gguf_info import Vocab
    from sparseety_prof.correlate import build_stamp
    from sparseety_prof.synthetic import make_model

    print(f"correlator: {build_stamp.STATE}")
    if a.profile and build_stamp.STATE == "compiled":
        print(
            "[replay] cProfile sees no call inside the compiled correlator: "
            f"{build_stamp.PURE_ENV}=1 profiles its source",
            file=sys.stderr,
        )
    with a.drains.open("rb") as f:
        kept = pickle.load(f)
    texts = Vocab.from_gguf(make_model(ROOT / "models" / "bench.gguf", "bench")).texts
    best: dict[str, float] = {}
    made = {"tokens": 0, "steps": 0}
    for _ in range(a.repeat):
        with tempfile.TemporaryDirectory(prefix="sparseety-replay-") as tmp:
            cpu, made = _replay_once(
                kept,
                texts,
                None,
                None if a.no_write else Path(tmp) / "rec",
                correlate_every=a.correlate_every,
                evict_mib=a.evict_mib,
            )
        best = {s: min(best.get(s, float("inf")), v) for s, v in cpu.items()}
    n = max(made["tokens"], 1)
    size = sum(len(buf) for d in kept["drains"] for buf in d.values())
    print(
        f"{len(kept['drains'])} drains ({size >> 20} MiB of records): the recorder made "
        f"{kept['recorded']['tokens']} token rows and {kept['recorded']['steps']} step rows of "
        f"them, this replay {made['tokens']} and {made['steps']}"
    )
    if made != kept["recorded"]:
        print("[replay] the replay's rows differ from the recorder's", file=sys.stderr)
        return 1
    print(_record_bytes(kept, n))
    print(f"CPU per token, the minimum of {a.repeat} replays:")
    print("| " + " | ".join(STAGES) + " | sum |")
    print("| --- " * (len(STAGES) + 1) + "|")
    print(
        "| "
        + " | ".join(f"{best[s] / n * 1e6:.1f}" for s in STAGES)
        + f" | {sum(best.values()) / n * 1e6:.1f} µs |"
    )
    if a.profile:
        prof = cProfile.Profile()
        with tempfile.TemporaryDirectory(prefix="sparseety-replay-") as tmp:
            _replay_once(
                kept,
                texts,
                prof,
                None if a.no_write else Path(tmp) / "rec",
                correlate_every=a.correlate_every,
                evict_mib=a.evict_mib,
                profile_stage=a.profile_stage,
            )
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats(a.profile_sort).print_stats(a.profile)
        order = "own time" if a.profile_sort == "tottime" else "with what it calls"
        where = {
            "correlate": "Correlator.feed",
            "rows": "take_tables and take_apart",
            "frames": "the frames",
            "write": "the writes",
        }[a.profile_stage]
        print(f"\n{where} under cProfile ({order}, one more replay):")
        # the Python calls per token: a count the VM's speed does not move, unlike the times
        calls: int = stats.total_calls  # type: ignore[attr-defined]  # (set by pstats, not in its stubs)
        print(f"{calls / n:.1f} Python function calls per token")
        print(out.getvalue())
    return 0


def _record_bytes(kept: dict[str, Any], tokens: int) -> str:
    """What the probes sent per token, by kind of record (their bytes as the walk copies them,
    without the ring's 8-byte headers)."""
    from sparseety_prof.capture.events import layout_names

    names = layout_names(kept["logits_chunk"])
    by_kind: dict[str, int] = {}
    for drain in kept["drains"]:
        for size, buf in drain.items():
            kind = names.get(size, f"{size}-byte")
            by_kind[kind] = by_kind.get(kind, 0) + len(buf)
    parts = [f"{kind} {b / tokens:,.0f}" for kind, b in sorted(by_kind.items(), key=lambda kv: -kv[1])]
    return "record bytes per token: " + ", ".join(parts)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "_record":  # the recorder subprocess of `capture`
        return _record(Path(sys.argv[2]), sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture", help="run an engine under the recorder and keep its drains")
    c.add_argument("-o", "--out", type=Path, required=True)
    c.add_argument("--engine", choices=("llama-cpp-python", "server"), default="llama-cpp-python")
    c.add_argument("--clients", type=int, default=1, help="server: concurrent clients (and slots)")
    c.add_argument("--threads", type=int, default=2, help="engine threads")
    c.add_argument("--seconds", type=float, default=20.0)
    c.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    c.add_argument("--record-args", default="", help="extra recorder options")
    r = sub.add_parser("replay", help="feed kept drains to the correlator again, timed")
    r.add_argument("drains", type=Path)
    r.add_argument("--repeat", type=int, default=3)
    r.add_argument(
        "--no-write", action="store_true", help="leave out the flush's aggregates and Parquet writes"
    )
    r.add_argument(
        "--correlate-every",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="as the recorder's --correlate-every: each drain's logits rows reduced as taken and "
        "the drains of SECONDS (at its 0.5 s drain interval) correlated together; default 0, each "
        "drain correlated as taken",
    )
    r.add_argument(
        "--evict-mib",
        type=int,
        default=0,
        metavar="MIB",
        help="before each drain (not timed), write MIB MiB of memory, as the engine's weights "
        "pass through the caches between two drains live",
    )
    r.add_argument("--profile", type=int, default=0, metavar="N", help="also the N costliest functions")
    r.add_argument(
        "--profile-sort",
        choices=("tottime", "cumulative"),
        default="tottime",
        help="--profile's order: a function's own time, or with what it calls",
    )
    r.add_argument(
        "--profile-stage",
        choices=("correlate", "rows", "frames", "write"),
        default="correlate",
        help="--profile's stage: Correlator.feed, take_tables and take_apart, the frames (the rows "
        "gathered and made Polars frames, as the recorder's ColumnBuffer does), or the writes (the "
        "aggregates, the Parquet segments and meta.json; on the consumer's thread only)",
    )
    a = ap.parse_args()
    return capture(a) if a.cmd == "capture" else replay(a)


if __name__ == "__main__":
    sys.exit(main())
