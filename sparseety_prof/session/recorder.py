"""`record`: attach to an engine by PID and write a recording until the engine exits, the user
stops us (Ctrl-C / SIGTERM) or the duration ends. The engine's hot path only runs the probes;
decoding, correlation, statistics and Parquet writing all happen here, in the consumer."""

from __future__ import annotations

import mmap
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from sparseety_prof import __version__
from sparseety_prof.capture import target as tg
from sparseety_prof.capture.bpf_loader import ATTENTION_OPS, RingReader, Session, is_server
from sparseety_prof.capture.events import EventBatch, SeqTracker, decode_groups
from sparseety_prof.capture.weight_sparsity import analyze as analyze_weights
from sparseety_prof.capture.weight_sparsity import model_sha256
from sparseety_prof.correlate.correlator import Correlator
from sparseety_prof.correlate.serving import ServingTracker
from sparseety_prof.errors import NotAnEngine, ProfError
from sparseety_prof.gpu.capture import GpuCapture
from sparseety_prof.gpu.shm_ring import RingError
from sparseety_prof.session import metadata
from sparseety_prof.session.ablation import ConsumerAblation
from sparseety_prof.session.attach import attach
from sparseety_prof.session.collector import FlushTimedCollector
from sparseety_prof.session.drain_batches import DrainBatches
from sparseety_prof.session.flush_round import FlushRound
from sparseety_prof.session.memory_budget import (
    PRESSURE_GAP_S,
    MemoryBudget,
    anon_bytes,
    resident_bytes,
    trim_heap,
)
from sparseety_prof.session.options import Options, Progress
from sparseety_prof.session.policy import RecordingPolicy, probe_head_rate
from sparseety_prof.session.sched import ConsumerSched
from sparseety_prof.session.sinks import FrameSink, SinkFanout
from sparseety_prof.session.snapshot import engine_environment, host_info, process_info
from sparseety_prof.session.stage_cpu import StageCpu
from sparseety_prof.session.stop_flag import StopFlag
from sparseety_prof.store import schema
from sparseety_prof.store.aggregates import COUNTED, Aggregator
from sparseety_prof.store.array_rows import ArrayRows
from sparseety_prof.store.buffers import ColumnBuffer, FlushSchedule
from sparseety_prof.store.output_dir import sudo_owner
from sparseety_prof.store.recording import list_layers
from sparseety_prof.store.recording_writer import RecordingWriter
from sparseety_prof.terminal_text import line as terminal_line

DRAIN_INTERVAL_S = 0.5  # the longest pause between drains: fewer, larger ones cost less CPU per token
HASH_STALL_S = 30.0  # close gives up on the model's sha256 after this long without progress


class Recorder:
    """The consumer loop. `run()` blocks until stopped; `stop()` may be called from any thread."""

    def __init__(
        self,
        opts: Options,
        *,
        on_update: Callable[[Mapping[str, list[Any]], Mapping[str, list[Any]], Progress], None] | None = None,
        log: Callable[[str], None] | None = None,
        sinks: Sequence[FrameSink] = (),
    ) -> None:
        self.opts = opts
        self._sink_list = list(sinks)
        self._sinks: SinkFanout | None = None
        # head sampling in the probes: the requests' verdicts, from the correlator to the policy
        self._head_rate = probe_head_rate(opts.policy)
        self._head_verdicts: dict[str, bool] | None = {} if self._head_rate is not None else None
        self._policy = RecordingPolicy(
            opts.policy, window_bytes=opts.policy_window, probe_verdicts=self._head_verdicts
        )
        self._aggregates: Aggregator | None = None
        self.on_update = on_update
        self._rows = ColumnBuffer()
        self._round = FlushRound()  # the flush under way, done in pieces between drains
        self._stages = StageCpu()  # where the consumer's CPU goes (meta.json consumer.cpu_s_by_stage)
        self._collector = FlushTimedCollector()
        sink = log or (lambda s: print(s, file=sys.stderr, flush=True))
        # messages carry target strings (model path, build, layer details): shown, never obeyed
        self.log: Callable[[str], None] = lambda s: sink(terminal_line(s))
        self.progress = Progress()
        self._stop = StopFlag()  # set by signal handlers: threading.Event would deadlock there
        self.stop_reason = ""
        self.meta: dict[str, Any] = {}
        self._corr: Correlator | None = None
        self.attached = threading.Event()  # set once the probes are in and the consumer runs
        self._cpu0 = 0.0

    @property
    def serves_http(self) -> bool:
        """Once attached: the target is an HTTP server whose requests are traced."""
        return self._corr is not None and self._corr.serving is not None

    def request_trace(self, request_id: str) -> dict[str, Any]:
        """The capture layers one client request id went through (empty when unseen)."""
        sv = self._corr.serving if self._corr is not None else None
        return dict(sv.trace.get(request_id, {})) if sv is not None else {}

    def stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            self._stop.set()

    def run(self) -> dict[str, Any]:
        opts = self.opts
        cpu0 = self._cpu0 = _cpu_s()
        try:
            a = attach(opts, self.log, self._stop.is_set)
        except NotAnEngine:
            # a CUDA engine with a Python decode loop (vLLM, SGLang, PyTorch): no llama.cpp to
            # probe, but started under `sparseety-prof launch`: record its GPU side alone
            gpu_only = _open_gpu(opts.pid)
            if gpu_only is None:
                raise
            return self._run_gpu_only(gpu_only)
        try:
            gpu = _open_gpu(opts.pid)
        except ProfError as e:
            self.log(f"sparseety-prof: GPU ring not read: {e}")
            gpu = None
        # From here on the consumer only drains, correlates and writes: it yields the CPU to the
        # engine whenever both want it (the ring buffer absorbs the delay; losses are counted).
        if opts.nice:
            os.nice(opts.nice)
        wall_offset = time.time_ns() - time.monotonic_ns()
        self.meta = metadata.run_metadata(a, opts)
        # the anomaly policy's detectors read the layer map
        self._policy = RecordingPolicy(
            opts.policy, self.meta, window_bytes=opts.policy_window, probe_verdicts=self._head_verdicts
        )
        writer = None
        if opts.out is not None:
            try:
                writer = _open_writer(opts, opts.out, self.meta)
            except BaseException:  # -o swapped since the check, or the disk is full: detach, record nothing
                a.session.close()
                a.model_file.close()
                if gpu is not None:
                    gpu.close()
                raise
        self._sinks = self._open_sinks()
        self._aggregates = _aggregator(opts, self.meta)
        hp = a.model.hyperparameters
        corr = self._corr = Correlator(
            pid=opts.pid,
            n_vocab=len(a.vocab),
            wall_offset_ns=wall_offset,
            texts=a.vocab.texts,
            layers=a.layers,
            n_expert=int(hp.get("expert_count", 0) or 0),
            n_expert_used=int(hp.get("expert_used_count", 0) or 0),
            with_masks=opts.capture.masks,
            serving=ServingTracker(opts.pid, opts.request_header) if is_server(a.where) else None,
            slot_tokens=any(p.symbol == tg.SYM_PROCESS_TOKEN for p in a.session.attached),
            # routes rows nothing stores or reads (--policy aggregate without --metrics-port) are
            # counted, not made
            routes_rows=self._policy.stores("routes") or self._sinks.wants("routes") or opts.capture.masks,
            head_verdicts=self._head_verdicts,
            head_drops_routes=not self._sinks.wants("routes"),
            head_rows_apart=self._apart_columns(gpu),
        )
        tracker = SeqTracker()
        self.attached.set()
        reader = RingReader(a.session)
        model_hash: dict[str, Any] = {}
        hash_moved = [time.monotonic()]  # when the hashing thread last read something

        def hash_and_scan() -> None:
            # the model's sha256, then its static weight sparsity (cached per sha256)
            def moved(_done: int, _total: int) -> None:
                hash_moved[0] = time.monotonic()

            try:
                model_hash["sha256"] = model_sha256(a.model_file, progress=moved)
            except OSError as e:  # the file is the target's: gone, swapped, unreadable
                model_hash["weights"] = {"error": f"model file not hashed: {e}"}
                return
            try:
                model_hash["weights"] = analyze_weights(
                    a.model_file, sha256=model_hash["sha256"], progress=moved
                )
            except Exception as e:  # a cache problem must not lose the recording
                model_hash["weights"] = {"error": str(e)}

        def hasher_run() -> None:
            try:
                hash_and_scan()
            finally:
                hash_cpu_s[0] = time.thread_time()  # this thread's CPU, from its start

        hash_cpu_s = [0.0]  # the hasher's CPU time (meta.json consumer.cpu_s_by_stage model_hash)
        hasher = threading.Thread(target=hasher_run, name="model-sha256", daemon=True)
        hasher.start()
        start_unix_ms = time.time_ns() // 1_000_000
        self.log(
            f"sparseety-prof: attached to PID {opts.pid} ({a.build.engine} {a.build.version}, model "
            f"{a.model.path.name}, {len(a.session.attached)} probes, compiled in {a.session.compile_s:.1f}s)"
            + (f"; recording to {opts.out}" if opts.out else "")
        )
        deadline = time.monotonic() + opts.duration if opts.duration else None
        error: BaseException | None = None
        bpf_stats = "off"
        if opts.bpf_stats:
            why = a.session.enable_run_stats()
            bpf_stats = "on" if not why else f"unavailable: {why}"
            if why:
                self.log(f"sparseety-prof: --bpf-stats: {why}")
        sched = ConsumerSched(opts, self.progress, DRAIN_INTERVAL_S)
        flush = FlushSchedule(opts.flush_interval)
        budget = MemoryBudget(opts.max_memory)
        watch = sched.watch(reader.pending_share, reader.wake_fd, reader.arm_watch)
        ablation = ConsumerAblation(opts.ablate_consumer)
        # --correlate-every: drains reduced as taken and correlated together (None: each as taken)
        drains = (
            DrainBatches(opts.correlate_every) if opts.correlate_every and DrainBatches.available() else None
        )
        stages, cpu_drains0 = self._stages, _cpu_s()
        stages.restart()  # on this thread; attach's CPU is not a stage's
        self._collector.start()  # the cyclic collector runs after flushes only (collector.py)
        try:
            t_prev = time.monotonic()
            while not self._stop.is_set():
                # the pieces of a flush under way until the next drain is due; the pace is counted
                # from the last drain: the work since (its correlation, a flush's pieces that
                # waited for the CPU at nice 10) is part of the wait, not added to it
                self._flush_pieces(writer, sched, until=t_prev + sched.wait_s)
                self._stop.wait(flush.wait_s(max(0.0, sched.wait_s - (time.monotonic() - t_prev))))
                stages.lap("loop")
                records = reader.take(sched.on_backlog)
                stages.lap("ring_walk")
                now = time.monotonic()
                filled = reader.last_take_bytes / (a.session.ring_pages * mmap.PAGESIZE)
                sched.after_drain(filled, (now - t_prev) * 1e3)
                t_prev = now
                if ablation.active:  # --ablate-consumer: drained and dropped, nothing else
                    ablation.discard(records, reader.last_take_bytes)
                    reader.release()
                elif drains is None:
                    batch = self._decode(records, tracker, a.session, ring_data=reader.data)
                    self._consume(batch, corr, tracker, writer, a.session, gpu=gpu)
                    reader.release()  # the logits rows read where they lay: their space goes back now
                else:
                    batch = self._decode(records, tracker, a.session, ring_data=reader.data)
                    drains.add(batch)  # the logits rows reduced to their statistics
                    stages.lap("logits")
                    reader.release()
                    behind = filled > ConsumerSched.PACE_FILL or sched.escalated
                    if drains.due(now, flush_due=flush.is_due(now), behind=behind):
                        for b in drains.take():
                            self._consume(b, corr, tracker, writer, a.session, gpu=gpu)
                watch.rearm()
                self._keep_durable(writer, flush, now, in_pieces=True)  # (its pieces: _flush_pieces)
                self._watch_memory(writer, budget, now, sched)
                stages.lap("flush")
                self._maybe_detach_attention_ops(corr, a.session)
                if ablation.begins(self.progress.tokens, a.session.kv_mask_probe, corr.attn_map.detach_tried):
                    for b in drains.take() if drains is not None else ():  # (those still waiting)
                        self._consume(b, corr, tracker, writer, a.session, gpu=gpu)
                    self._flush_now(writer)  # the rows of the start-up work: the recording's last
                    self.log(
                        "sparseety-prof: --ablate-consumer: start-up work done after "
                        f"{ablation.began_after_s:.1f} s ({self.progress.tokens} tokens recorded); "
                        "from now on its records are drained and discarded"
                    )
                if deadline is not None and time.monotonic() >= deadline:
                    self.stop("duration reached")
                if not _alive(opts.pid):
                    self.stop("target exited")
        except BaseException as e:
            error = e
        finally:
            self._collector.stop()  # what follows runs once: the collector as usual
            watch.close()
            stages.lap("loop")
            rest = reader.stop()
            stages.lap("ring_walk")
            counters = a.session.counters()
            counters["program_misses"] = a.session.program_misses()  # before close: read off the fds
            programs = a.session.program_costs() if bpf_stats == "on" else {}
            a.session.close()
            stages.lap("detach")
            if error is None and ablation.active:  # the last records dropped too; open requests ended
                ablation.discard(rest, 0)
                try:
                    empty = EventBatch(logits_chunk=a.session.logits_chunk)
                    self._consume(
                        empty, corr, tracker, writer, a.session, counters=counters, final=True, gpu=gpu
                    )
                except BaseException as e:
                    error = e
            elif error is None:
                try:
                    batch = self._decode(rest, tracker, a.session, final=True)
                    batches = [batch]
                    if drains is not None:
                        drains.add(batch, final=True)
                        stages.lap("logits")
                        batches = drains.take()
                    for i, b in enumerate(batches):
                        last = i == len(batches) - 1
                        self._consume(
                            b, corr, tracker, writer, a.session, counters=counters, final=last, gpu=gpu
                        )
                except BaseException as e:
                    error = e
            else:
                tracker.update(decode_groups(rest, a.session.logits_chunk).seqs(), final=True)
            self.progress.cpu_s = _cpu_s() - cpu0
            final = {
                "probes": a.session.probes_meta(),  # the graph-op probes now marked detached
                "start_unix_ms": start_unix_ms,
                "end_unix_ms": time.time_ns() // 1_000_000,
                "stop_reason": self.stop_reason or (type(error).__name__ if error else ""),
                "losses": metadata.losses(
                    counters, corr, seq_gaps=tracker.gaps, records_seen=tracker.seen + ablation.records
                ),
                **metadata.outcome(a, opts, corr),
                "counts": {"tokens": self.progress.tokens, "steps": self.progress.steps},
                "profiler_cpu_s": round(self.progress.cpu_s, 3),
                "profiler_memory": {**_memory_meta(), "budget": budget.meta()},
                "consumer": {
                    **sched.meta(),
                    "flushes": self._round.rounds,  # each done in pieces between drains (flush_round.py)
                    "flush_pieces": self._round.pieces,
                    "ring_watch_wakeups": watch.wakeups,
                    "drains": reader.takes,  # that took any record; with the logits read in the ring:
                    "drains_logits_by_ref": reader.takes_by_ref,
                    # drains go to the correlator together (drain_batches.py): how often it ran,
                    # and the logits records of a sampler call a drain cut, reduced with the next
                    "correlate_every_s": opts.correlate_every if drains is not None else 0,
                    "correlations": drains.correlations if drains is not None else reader.takes,
                    "logits_carried": drains.reducer.carried if drains is not None else 0,
                    # reduced rows whose statistics were of another token than the token row's
                    # (never expected: both are the sampler call's result); left null
                    "logits_token_mismatch": corr.requests.stats.token_mismatch,
                    "gc_collections": self._collector.collections,
                    "ablated": ablation.meta(),  # --ablate-consumer (session/ablation.py)
                },
                "bpf_compile_s": round(a.session.compile_s, 3),
                "bpf_programs": {
                    "stats": bpf_stats,
                    "runs": sum(p["runs"] for p in programs.values()),
                    "run_ns": sum(p["run_ns"] for p in programs.values()),
                    "programs": programs,
                },
            }
            if hasher.is_alive():
                self.log("sparseety-prof: finishing the model file's sha256 ...")
            # waited for as long as it reads on (a big model takes minutes), not for a read that hangs
            while hasher.is_alive() and time.monotonic() - hash_moved[0] < HASH_STALL_S:
                hasher.join(0.5)
            if hasher.is_alive():
                self.log(
                    f"sparseety-prof: model file's sha256 abandoned (no progress for {HASH_STALL_S:.0f} s)"
                )
                model_hash.clear()
                model_hash["weights"] = {"error": "model file not hashed: reading it stalled"}
            # a hasher still reading gets refused from here on (PinnedFile.reopen), never another file
            a.model_file.close()
            final["model"] = {**self.meta["model"], "sha256": model_hash.get("sha256")}
            final["weight_sparsity"] = metadata.weight_summary(model_hash.get("weights"))
            if gpu is not None:
                final["gpu"] = gpu.meta()
                gpu.close()
            stages.lap("loop")
            try:
                self._round.finish()  # a flush under way: its rows before those gathered since
            except BaseException as e:
                error = error or e
            for table, df in self._rows.take_all():  # rows of drains before an error
                self._emit(writer, table, df)
            self._settle(writer, final=True)
            for _ in self._store_aggregates(writer, final=True):
                pass
            stages.lap("flush")
            final["policy"] = self._policy.to_meta()
            if self._head_rate is not None:
                probes = metadata.head_in_probes(counters, corr, self._head_rate)
                final["policy"]["head_in_probes"].update(probes)
            final["aggregates"] = {
                "bucket_s": opts.aggregate_s,
                "left_out": sorted(self._aggregates.leave_out) if self._aggregates else [],
            }
            if self._sinks is not None and self._sink_list:
                final["sinks"] = self._sinks.close({**self.meta, **final})
            stages.lap("frames_sinks")
            # (the hasher starts a few statements before the span: its CPU is counted whole)
            final["consumer"]["cpu_s_by_stage"] = stages.meta(
                _cpu_s() - cpu_drains0, {"model_hash": hash_cpu_s[0]}
            )
            self.meta.update(final)
            if writer is not None:
                writer.close(complete=error is None, **final)
        if error is not None:
            raise error
        _raise_write_failure(writer)
        return self.meta

    def _open_sinks(self) -> SinkFanout:
        opts = self.opts
        return SinkFanout(
            self._sink_list,
            self.meta,
            redact_text=opts.redact_text,
            redact=opts.redact,
            redact_layers=opts.redact_layers,
            log=self.log,
        )

    def _keep_durable(
        self,
        writer: RecordingWriter | None,
        flush: FlushSchedule,
        drained_at: float,
        *,
        in_pieces: bool = False,
    ) -> None:
        """Flush on schedule (a SIGKILL then loses only the last flush interval; sinks get rows
        no older than that either), at once or, `in_pieces`, started here and done by
        `_flush_pieces` between drains; after a write error (disk full), stop: the writer keeps
        count of what is lost."""
        if writer is None and not self._sinks:
            return
        if flush.due(drained_at):
            if in_pieces:
                self._start_flush(writer)
            else:
                self._flush_now(writer)
        self._stop_on_write_error(writer)

    def _stop_on_write_error(self, writer: RecordingWriter | None) -> None:
        if writer is not None and writer.write_error is not None:
            self.stop("write error")

    def _start_flush(self, writer: RecordingWriter | None) -> None:
        """A flush of the rows gathered since the last one to the aggregates, the sinks and the
        recording, in pieces (flush_round.py): the rows are fixed now, their writes follow."""
        self._round.start(
            self._rows.detach(), lambda table, df: self._emit(writer, table, df), self._flush_writes(writer)
        )

    def _flush_now(self, writer: RecordingWriter | None) -> None:
        """A flush of the rows gathered since the last one (after the one under way), all at once."""
        self._start_flush(writer)
        self._round.finish()

    def _flush_writes(self, writer: RecordingWriter | None) -> Iterator[str]:
        """A flush's pieces after its rows were handed over, each named: the requests the
        policies decided, the closed aggregate buckets, a Parquet segment per table and
        meta.json, and the collector's pass (collector.py)."""
        self._settle(writer, final=False)
        yield "policy"
        yield from self._store_aggregates(writer, final=False)
        if writer is not None:
            yield from writer.flush_steps()
        self._collector.after_flush()
        yield "collector"

    def _flush_pieces(self, writer: RecordingWriter | None, sched: ConsumerSched, *, until: float) -> None:
        """The pieces of a flush under way until `until` (time.monotonic), when the next drain is
        due; one at least, so that a consumer pressed to drain all the time still flushes."""
        if not self._round.active:
            return
        self._stages.lap("loop")
        first = True
        while self._round.active and (first or time.monotonic() < until) and not self._stop.is_set():
            t, cpu = time.monotonic(), time.thread_time()
            piece = self._round.step()
            sched.after_flush((time.monotonic() - t) * 1e3, (time.thread_time() - cpu) * 1e3, piece or "")
            first = False
        self._stages.lap("flush")
        self._stop_on_write_error(writer)

    def _watch_memory(
        self, writer: RecordingWriter | None, budget: MemoryBudget, now: float, sched: ConsumerSched
    ) -> None:
        """Above --max-memory: the gathered rows go out now (a whole flush, timed as a piece of
        one), and the freed heap back to the kernel (memory_budget.py)."""
        if not budget.pressed(self.progress.anon_bytes, now):  # read by this drain's _consume
            return
        t, cpu = time.monotonic(), time.thread_time()
        self._flush_now(writer)
        sched.after_flush((time.monotonic() - t) * 1e3, (time.thread_time() - cpu) * 1e3, "memory pressure")
        trim_heap()
        anon = anon_bytes()
        if not budget.relieved(anon) and budget.over_after_flush == 1:
            assert budget.limit is not None
            self.log(
                f"sparseety-prof: --max-memory {budget.limit >> 20} MiB is below what the recorder holds "
                f"with its rows written out ({anon >> 20} MiB anonymous): it writes them out every "
                f"{PRESSURE_GAP_S:g} s while it stays above (counted in meta.json profiler_memory.budget)"
            )

    def _emit(self, writer: RecordingWriter | None, table: str, df: pl.DataFrame) -> None:
        """One frame of rows to the aggregates and the sinks (all of them), and to the recording
        (what the policy keeps)."""
        if self._aggregates is not None:
            self._aggregates.add(table, df)
        if writer is not None:
            for kept_table, kept in self._policy.take(table, df):
                writer.append(kept_table, kept)
        if self._sinks:
            self._sinks.take(table, df)

    def _emit_apart(self, table: str, parts: list[ArrayRows]) -> None:
        """One drain's rows set apart (dropped requests' rows, only the columns that are read,
        as arrays: never framed) to the aggregates, and to the policy, which counts them dropped
        and learns their requests."""
        if self._aggregates is not None:
            self._aggregates.add_rows(table, parts)
        self._policy.set_apart(table, parts)

    def _apart_columns(self, gpu: GpuCapture | None) -> dict[str, frozenset[str]] | None:
        """With head sampling in the probes, when the recording is the only reader of the token
        and steps rows (no sink reads them, no live view, no GPU capture joining kernels to
        steps, no masks), the rows of a dropped request are set apart from the others by the
        correlator with only the columns the always-on aggregates and the policy read: they
        are counted from their arrays, never framed nor held. None otherwise."""
        sinks = self._sinks
        if (
            self._head_rate is None
            or self.on_update is not None
            or gpu is not None
            or self.opts.capture.masks
            or (sinks is not None and (sinks.wants("tokens") or sinks.wants("steps")))
        ):
            return None
        return {table: COUNTED[table] | self._policy.learns(table) for table in ("tokens", "steps")}

    def _settle(self, writer: RecordingWriter | None, *, final: bool) -> None:
        """The rows the per-request policies decided since the last flush, to the recording. Called
        after a flush's frames (the requests rows among them) have all been emitted."""
        if writer is not None:
            for table, df in self._policy.settle(final=final):
                writer.append(table, df)

    def _store_aggregates(self, writer: RecordingWriter | None, *, final: bool) -> Iterator[str]:
        """The aggregates of buckets now closed (all of them at the end) into the recording: a
        yield after each metric's counts (a flush's pieces, flush_round.py) and at the end."""
        if self._aggregates is None or writer is None:
            return
        closed: list[pl.DataFrame] = []
        yield from self._aggregates.take_steps(None if final else time.time_ns() // 1_000_000, closed)
        for rows in closed:
            if rows.height:
                writer.append("aggregates", rows)
        yield "aggregates"

    def _maybe_detach_attention_ops(self, corr: Correlator, sess: Session) -> None:
        """Once the layer -> mask map is learned (attention_map), the soft_max / flash-attention
        probes only cost: two uprobe hits per layer and engine thread per token."""
        amap = corr.attn_map
        if amap.wants_ops_detached and sess.kv_mask_probe:
            t0 = time.monotonic()
            n = sess.detach_attention_ops()
            wall_ms = (time.monotonic() - t0) * 1e3
            none_left = not any(p.symbol in ATTENTION_OPS for p in sess.attached)
            amap.ops_detach_done(none_left=none_left, wall_ms=wall_ms)
            self.log(
                f"sparseety-prof: attention masks now counted where the engine writes them "
                f"(layer map learned after {amap.learned_after} passes); {n} graph-op probes detached "
                f"in {wall_ms:.0f} ms"
            )

    def _poll_gpu(
        self, gpu: GpuCapture | None, steps: Mapping[str, list[Any]], *, final: bool
    ) -> schema.Tables:
        if gpu is None:
            return {}
        gpu.add_steps(steps)
        return gpu.poll(final=final)

    def _run_gpu_only(self, gpu: GpuCapture) -> dict[str, Any]:
        """Record the kernels, GPU-side steps and watched buffers of an engine with no host
        probes (steps close at the device-to-host copy of the sampled ids)."""
        opts = self.opts
        if opts.nice:
            os.nice(opts.nice)
        self.meta = {
            "profiler": {"name": "sparseety-prof", "version": __version__},
            "engine": {"name": "cuda (gpu only)", "version": ""},
            "target": metadata.target_meta(opts.pid, redact_text=opts.redact_text),
            "host": host_info(),
            "config": {
                "environment": engine_environment(opts.pid, redact_text=opts.redact_text),
                "process": process_info(opts.pid),
            },
            "clock": "CLOCK_MONOTONIC ns (t_*_ns, start_ns, end_ns)",
        }
        writer = None
        if opts.out is not None:
            writer = _open_writer(opts, opts.out, self.meta)
        self._sinks = self._open_sinks()
        self.log(f"sparseety-prof: attached to PID {opts.pid} (GPU only: {len(gpu.rings)} CUPTI ring(s))")
        start_unix_ms = time.time_ns() // 1_000_000
        deadline = time.monotonic() + opts.duration if opts.duration else None
        error: BaseException | None = None
        flush = FlushSchedule(opts.flush_interval)
        try:
            while True:
                stop = self._stop.wait(flush.wait_s(DRAIN_INTERVAL_S))
                if deadline is not None and time.monotonic() >= deadline:
                    self.stop("duration reached")
                if not _alive(opts.pid):
                    self.stop("target exited")
                final = stop or self._stop.is_set()
                for table, cols in gpu.poll(final=final).items():
                    df = schema.frame(table, cols)
                    if df.height:
                        self._emit(writer, table, df)
                    if table == "steps":
                        self.progress.steps += df.height
                self.progress.cpu_s = _cpu_s() - self._cpu0
                self._keep_durable(writer, flush, time.monotonic())
                if final:
                    break
        except BaseException as e:
            error = e
        finally:
            final_meta = {
                "start_unix_ms": start_unix_ms,
                "end_unix_ms": time.time_ns() // 1_000_000,
                "stop_reason": self.stop_reason or (type(error).__name__ if error else ""),
                "gpu": gpu.meta(),
                "counts": {"tokens": 0, "steps": self.progress.steps},
                "losses": {},
                "profiler_cpu_s": round(_cpu_s() - self._cpu0, 3),
                "bpf_compile_s": 0.0,
            }
            gpu.close()
            self._settle(writer, final=True)
            final_meta["policy"] = self._policy.to_meta()
            if self._sink_list:
                final_meta["sinks"] = self._sinks.close({**self.meta, **final_meta})
            self.meta.update(final_meta)
            if writer is not None:
                writer.close(complete=error is None, **final_meta)
        if error is not None:
            raise error
        _raise_write_failure(writer)
        return self.meta

    def _decode(
        self,
        records: dict[int, np.ndarray],
        tracker: SeqTracker,
        sess: Session,
        *,
        ring_data: np.ndarray | None = None,
        final: bool = False,
    ) -> EventBatch:
        """One drain's records, by layout; their sequence numbers counted (losses). Logits
        records taken by reference are read in `ring_data` (the ring's memory), until the caller
        hands their space back."""
        batch = decode_groups(records, sess.logits_chunk, ring_data)
        tracker.update(batch.seqs(), final=final)
        self._stages.lap("decode")
        return batch

    def _consume(
        self,
        batch: EventBatch,
        corr: Correlator,
        tracker: SeqTracker,
        writer: RecordingWriter | None,
        sess: Session,
        *,
        counters: dict[str, int] | None = None,
        final: bool = False,
        gpu: GpuCapture | None = None,
    ) -> None:
        """Drained records through the correlator to the rows' destinations."""
        stages = self._stages
        drops = (counters or sess.counters())["kernel_drops"]
        if len(batch):
            corr.feed(batch, losses_seen=drops > 0 or tracker.gaps > 0)
        stages.lap("correlate")
        logits0 = corr.logits_cpu_s
        tables = corr.take_tables(final=final)
        unmade = corr.routes.take_not_made()
        if unmade:
            self._policy.count_dropped("routes", unmade)
        unmade = corr.routes.take_head_dropped()
        if unmade:
            self._policy.count_head_dropped("routes", unmade)
        stages.lap("rows")
        stages.move(corr.logits_cpu_s - logits0, "rows", "logits")
        tok, steps = tables["tokens"], tables["steps"]
        gpu_tables = self._poll_gpu(gpu, steps, final=final)
        apart = corr.take_apart()
        if writer is not None or self._sinks:
            rows = self._rows
            for table, cols in (*tables.items(), *gpu_tables.items()):
                for df in rows.add(table, cols, final=final):
                    self._round.before_frames(table)  # a flush under way holds older rows of it
                    self._emit(writer, table, df)
            for table, parts in apart.items():
                self._emit_apart(table, parts)
        stages.lap("frames_sinks")
        p = self.progress
        p.tokens += sum(r.n for r in apart.get("tokens", ()))
        p.steps += sum(r.n for r in apart.get("steps", ()))
        p.records = tracker.seen
        p.seq_gaps = tracker.gaps
        p.kernel_drops = drops
        p.steps += len(steps.get("step_id", []))
        n_tok = len(tok.get("token_id", []))
        p.tokens += n_tok
        p.logits_incomplete = corr.counters.logits_incomplete
        if n_tok and tok["t_end_ns"][-1] is not None:
            # how far behind the engine the consumer is: both clocks are CLOCK_MONOTONIC
            p.lag_ms = (time.monotonic_ns() - int(str(tok["t_end_ns"][-1]))) / 1e6
        p.cpu_s = _cpu_s() - self._cpu0
        p.rss_bytes, p.anon_bytes = resident_bytes()
        if self._sinks:
            self._sinks.drained(p)
        if self.on_update is not None:
            self.on_update(tok, steps, p)


def _open_writer(opts: Options, out: Path, meta: dict[str, Any]) -> RecordingWriter:
    """The recording, with what the options ask of it (redaction, disk budget)."""
    return RecordingWriter(
        out,
        meta,
        owner=sudo_owner(),
        redact_text=opts.redact_text,
        redact=opts.redact,
        redact_layers=opts.redact_layers,
        max_disk=opts.max_disk,
    )


def _aggregator(opts: Options, meta: dict[str, Any]) -> Aggregator:
    """The always-on aggregates, less what the redaction levels remove from the rows (routing: the
    per-bucket expert load; sparsity: the ratio histograms)."""
    leave_out = set()
    if "routing" in opts.redact:
        leave_out.add("expert_load")
    if "sparsity" in opts.redact:
        leave_out.update({"act_zero_ratio", "act_below_ratio"})
    return Aggregator(
        list_layers(meta),
        bucket_s=opts.aggregate_s,
        grace_s=max(10.0, 2 * opts.flush_interval),
        leave_out=leave_out,
    )


def _open_gpu(pid: int) -> GpuCapture | None:
    try:
        return GpuCapture.open(pid)
    except RingError as e:
        raise ProfError(f"the CUPTI ring of PID {pid} cannot be read: {e}") from None


def _raise_write_failure(writer: RecordingWriter | None) -> None:
    failure = writer.failure() if writer is not None else None
    if failure is not None:
        raise failure


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _memory_meta() -> dict[str, int]:
    """The recorder's own memory at close: its peak resident size (the BPF compile is usually
    it: BCC's LLVM), and what is resident now, anonymous (its heap: rows, state) and file-backed
    (shared libraries' pages)."""
    out = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile"):
                    out[f"{key[3:].lower()}_rss_bytes"] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped by its parent) no longer runs anything
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def install_signal_handlers(rec: Recorder) -> None:
    def handler(signum: int, _frame: object) -> None:
        rec.stop(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)  # the terminal went away: close the recording too


__all__ = ["Options", "ProfError", "Progress", "Recorder", "install_signal_handlers"]
