"""`record`: attach to an engine by PID and write a recording until the engine exits, the user
stops us (Ctrl-C / SIGTERM) or the duration ends. The engine's hot path only runs the probes;
decoding, correlation, statistics and Parquet writing all happen here, in the consumer."""

from __future__ import annotations

import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from sparseety_prof import __version__
from sparseety_prof.capture import target as tg
from sparseety_prof.capture.bpf_loader import ATTENTION_OPS, Session, is_server
from sparseety_prof.capture.events import EventBatch, SeqTracker
from sparseety_prof.correlate.correlator import Correlator
from sparseety_prof.correlate.serving import ServingTracker
from sparseety_prof.errors import GpuRingUnreadable, NotAnEngine, ProfError
from sparseety_prof.gpu.capture import GpuCapture
from sparseety_prof.gpu.shm_ring import RingError
from sparseety_prof.session import metadata
from sparseety_prof.session.attach import Attached, attach
from sparseety_prof.session.collector import FlushTimedCollector
from sparseety_prof.session.cpu_profile import CpuProfile, open_cpu_profile, start_cpu_profile
from sparseety_prof.session.drain_loop import DrainLoop
from sparseety_prof.session.duty_driver import DutyDriver, open_duty_driver
from sparseety_prof.session.memory_budget import resident_bytes
from sparseety_prof.session.model_hasher import ModelHasher
from sparseety_prof.session.op_times import OpTimes, open_op_times
from sparseety_prof.session.options import Options, Progress
from sparseety_prof.session.placement import place_recorder
from sparseety_prof.session.policy import RecordingPolicy
from sparseety_prof.session.row_outlet import RowOutlet
from sparseety_prof.session.sinks import FrameSink, SinkFanout
from sparseety_prof.session.snapshot import engine_environment, host_info, process_info
from sparseety_prof.session.stage_cpu import StageCpu
from sparseety_prof.session.stop_flag import StopFlag
from sparseety_prof.session.thread_waits import ProgramLoad, ThreadWaits, open_thread_waits
from sparseety_prof.store import schema
from sparseety_prof.store.aggregates import COUNTED, Aggregator
from sparseety_prof.store.array_rows import part_rows
from sparseety_prof.store.buffers import FlushSchedule
from sparseety_prof.store.output_dir import sudo_owner
from sparseety_prof.store.recording import list_layers
from sparseety_prof.store.recording_writer import RecordingWriter
from sparseety_prof.terminal_text import line as terminal_line


class Recorder:
    """The consumer loop. `run()` blocks until stopped; `stop()` may be called from any thread."""

    def __init__(
        self,
        opts: Options,
        *,
        policy: RecordingPolicy,
        on_update: Callable[[Mapping[str, list[Any]], Mapping[str, list[Any]], Progress], None] | None = None,
        log: Callable[[str], None] | None = None,
        sinks: Sequence[FrameSink] = (),
    ) -> None:
        """`policy`: what the recording keeps, made from `opts` (RecordingPolicy.for_session)."""
        self.opts = opts
        self._sink_list = list(sinks)
        self._policy = policy
        # head sampling in the probes: the requests' verdicts, from the correlator to the policy
        self._head_rate = opts.policy_choice.head_in_probes
        self._head_verdicts = policy.probe_verdicts
        self.on_update = on_update
        self._outlet: RowOutlet | None = None  # where the rows go (run opens it)
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
        self._attach_began = 0.0  # (time.monotonic) when the probes began to go in
        self._cpu: CpuProfile | None = None  # the CPU sampler and its join to steps (--cpu-sample-hz)
        self._waits: ThreadWaits | None = None  # the scheduler program and its join to steps
        self._ops: OpTimes | None = None  # the node probes and their join to steps (--trace-ops)

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
        """Attach, record until stopped, close the recording: its meta.json's content."""
        opts = self.opts
        self._cpu0 = _cpu_s()
        # (issue 61) a core the engine does not use, before the compile: threads inherit it
        placement = place_recorder(opts.recorder_cpus, opts.pid)
        self.log(f"sparseety-prof: {placement.line()}")
        self._attach_began = time.monotonic()  # the duty cycle's first window: the probes go in
        # the scheduler program and the CPU sampler compiled once the target proved to be an
        # engine, before the probes attach: their compile then delays the attach, not the first
        # drain after it (thread_waits.py ProgramLoad)
        waits_load = ProgramLoad(False, opts.pid, os.getpid())
        cpu_load: CpuProfile | ProfError | None = None

        def compile_optional() -> None:
            nonlocal waits_load, cpu_load
            waits_load = ProgramLoad(opts.sched_waits, opts.pid, os.getpid())
            cpu_load = open_cpu_profile(opts.pid, opts.cpu_sample_hz)

        try:
            a = attach(opts, self.log, self._stop.is_set, before_probes=compile_optional)
        except BaseException as e:
            waits_load.discard()
            if isinstance(cpu_load, CpuProfile):
                cpu_load.close()
            if not isinstance(e, NotAnEngine):
                raise
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
        self._cpu = start_cpu_profile(cpu_load, self.log)
        self._waits = open_thread_waits(waits_load, a.session, self.log)
        try:
            libs = [lib.path for lib in a.target.libs]
            self._ops = open_op_times(opts.pid, opts.trace_ops, libs, a.build.tensor, self.log)
        except BaseException:
            a.session.close()
            a.model_file.close()
            for part in (gpu, self._cpu):
                if part is not None:
                    part.close()
            raise
        # From here on the consumer only drains, correlates and writes: it yields the CPU to the
        # engine whenever both want it (the ring buffer absorbs the delay; losses are counted).
        if opts.nice:
            os.nice(opts.nice)
        self.meta = metadata.run_metadata(a, opts)
        self.meta["recorder_placement"] = placement.to_meta()
        self._policy.read_layout(self.meta)  # the anomaly policy's detectors read the layer map
        writer = None
        if opts.out is not None:
            try:
                writer = _open_writer(opts, opts.out, self.meta)
            except BaseException:  # -o swapped since the check, or the disk is full: detach, record nothing
                a.session.close()
                a.model_file.close()
                if gpu is not None:
                    gpu.close()
                if self._cpu is not None:
                    self._cpu.close()
                if self._waits is not None:
                    self._waits.close()
                if self._ops is not None:
                    self._ops.close()
                raise
        try:
            return self._record(a, gpu, writer)
        finally:
            if self._cpu is not None:  # (closed at detach already, unless something failed before)
                self._cpu.close()

    def _record(self, a: Attached, gpu: GpuCapture | None, writer: RecordingWriter | None) -> dict[str, Any]:
        """The drains, correlated and written until stopped; then the probes detached, the last
        records consumed and the recording closed."""
        opts = self.opts
        out = self._open_outlet(writer, _aggregator(opts, self.meta))
        corr = self._corr = self._open_correlator(a, gpu, time.time_ns() - time.monotonic_ns())
        self.attached.set()
        hasher = ModelHasher(a.model_file)
        hasher.start()
        start_unix_ms = time.time_ns() // 1_000_000
        self.log(
            f"sparseety-prof: attached to PID {opts.pid} ({a.build.engine} {a.build.version}, model "
            f"{a.model.path.name}, {len(a.session.attached)} probes, compiled in {a.session.compile_s:.1f}s)"
            + (f"; recording to {opts.out}" if opts.out else "")
        )
        bpf_stats = self._bpf_stats(a.session)
        loop = DrainLoop.open(opts, a.session, self.progress, self._stages)
        duty = open_duty_driver(opts.duty_cycle, a.session, self.log, since=self._attach_began)
        cpu_drains0 = _cpu_s()
        self._stages.restart()  # on this thread; attach's CPU is not a stage's
        self._collector.start()  # the cyclic collector runs after flushes only (collector.py)
        try:
            error = self._drive(loop, corr, a.session, gpu, duty)
        finally:
            self._collector.stop()  # what follows runs once: the collector as usual
        final, error = self._detach(loop, corr, a.session, gpu, duty, bpf_stats, error)
        if self._cpu is not None:
            final["cpu_sampler"] = self._cpu.meta()
        if self._waits is not None:
            final["sched_waits"] = self._waits.meta()
            self._waits.close()
        if self._ops is not None:
            final["trace_ops"] = self._ops.meta()
            self._ops.close()
        final["start_unix_ms"] = start_unix_ms
        final.update(metadata.outcome(a, opts, corr))
        sha256, weights = hasher.finish(self.log)
        # a hasher still reading gets refused from here on (PinnedFile.reopen), never another file
        a.model_file.close()
        final["model"] = {**self.meta["model"], "sha256": sha256}
        final["weight_sparsity"] = metadata.weight_summary(weights)
        if gpu is not None:
            final["gpu"] = gpu.meta()
            gpu.close()
        if self._head_rate is not None:
            final["head_in_probes"] = metadata.head_in_probes(final.pop("_counters"), corr, self._head_rate)
        else:
            final.pop("_counters")
        if duty is not None:  # the sparse aggregates are of the windows only
            final["duty_cycle"] = duty.meta()
        extra_cpu = {"model_hash": hasher.cpu_s}
        return self._finish(out, writer, final, error, cpu_drains0=cpu_drains0, extra_cpu=extra_cpu)

    def _bpf_stats(self, sess: Session) -> str:
        """--bpf-stats: the kernel's run statistics of the probes' programs, "on" when enabled."""
        if not self.opts.bpf_stats:
            return "off"
        why = sess.enable_run_stats()
        if why:
            self.log(f"sparseety-prof: --bpf-stats: {why}")
        return "on" if not why else f"unavailable: {why}"

    def _drive(
        self,
        loop: DrainLoop,
        corr: Correlator,
        sess: Session,
        gpu: GpuCapture | None,
        duty: DutyDriver | None,
    ) -> BaseException | None:
        """For each batch the drains give: correlated, its rows to their readers; until stopped.
        Returns what went wrong, if anything (the close runs either way)."""
        deadline = time.monotonic() + self.opts.duration if self.opts.duration else None

        def after_drain(now: float) -> None:
            self._maybe_detach_attention_ops(corr, sess)
            self._maybe_ablate(loop, corr, sess, gpu)
            if duty is not None:  # what the drain saw, for the duty cycle's controller
                duty.observe_drain(now, self.progress, loop.reader.last_take_bytes)
            if deadline is not None and time.monotonic() >= deadline:
                self.stop("duration reached")
            if not _alive(self.opts.pid):
                self.stop("target exited")

        try:
            for batch in loop.batches(
                self._out,
                stopped=self._stop.is_set,
                stop=self.stop,
                wait=self._stop.wait,
                after_drain=after_drain,
            ):
                self._consume(batch, corr, loop.tracker, sess, gpu=gpu)
        except BaseException as e:
            return e
        return None

    def _maybe_ablate(self, loop: DrainLoop, corr: Correlator, sess: Session, gpu: GpuCapture | None) -> None:
        """--ablate-consumer: once the start-up work is done, the drains waiting correlated and
        the rows flushed; from then on the loop drops what it drains (session/ablation.py)."""
        if not loop.ablation.begins(self.progress.tokens, sess.kv_mask_probe, corr.attn_map.detach_tried):
            return
        for b in loop.waiting():
            self._consume(b, corr, loop.tracker, sess, gpu=gpu)
        self._out.flush_now()  # the rows of the start-up work: the recording's last
        self.log(
            "sparseety-prof: --ablate-consumer: start-up work done after "
            f"{loop.ablation.began_after_s:.1f} s ({self.progress.tokens} tokens recorded); "
            "from now on its records are drained and discarded"
        )

    def _detach(
        self,
        loop: DrainLoop,
        corr: Correlator,
        sess: Session,
        gpu: GpuCapture | None,
        duty: DutyDriver | None,
        bpf_stats: str,
        error: BaseException | None,
    ) -> tuple[dict[str, Any], BaseException | None]:
        """The probes out (their counters read first), the ring's last records consumed, and the
        capture's part of meta.json; with the first error met."""
        rest = loop.close()
        if duty is not None:
            duty.close()  # before the session detaches the probes it switches
        counters = sess.counters()
        counters["program_misses"] = sess.program_misses()  # before close: read off the fds
        programs = sess.program_costs() if bpf_stats == "on" else {}
        sess.close()
        stages = self._stages
        stages.lap("detach")
        if self._cpu is not None:  # sampling ends with the probes
            self._cpu.stop()
            stages.lap("cpu_stacks")
        if self._waits is not None:  # its counts of what was lost, before it is unloaded
            self._waits.stop()
            stages.lap("thread_waits")
        if self._ops is not None:  # the node probes too (the nodes still open read)
            self._ops.stop()
            stages.lap("op_times")
        try:
            batches = loop.rest(rest, error)
            for i, b in enumerate(batches):
                last = i == len(batches) - 1
                self._consume(b, corr, loop.tracker, sess, counters=counters, final=last, gpu=gpu)
        except BaseException as e:
            error = error or e
        self.progress.cpu_s = _cpu_s() - self._cpu0
        final: dict[str, Any] = {
            "probes": sess.probes_meta(),  # the graph-op probes now marked detached
            "end_unix_ms": time.time_ns() // 1_000_000,
            "stop_reason": self.stop_reason or (type(error).__name__ if error else ""),
            "losses": metadata.losses(  # (records an ablated consumer never decoded: seen too)
                counters,
                corr,
                seq_gaps=loop.tracker.gaps,
                records_seen=loop.tracker.seen + loop.ablation.records_untracked,
            ),
            "counts": {"tokens": self.progress.tokens, "steps": self.progress.steps},
            "profiler_cpu_s": round(self.progress.cpu_s, 3),
            "profiler_memory": {**_memory_meta(), "budget": loop.budget.meta()},
            "consumer": self._consumer_meta(loop, corr),
            "bpf_compile_s": round(sess.compile_s, 3),
            "bpf_programs": {
                "stats": bpf_stats,
                "runs": sum(p["runs"] for p in programs.values()),
                "run_ns": sum(p["run_ns"] for p in programs.values()),
                "programs": programs,
            },
            "_counters": counters,  # (for head_in_probes; taken out before meta.json)
        }
        return final, error

    def _finish(
        self,
        out: RowOutlet,
        writer: RecordingWriter | None,
        final: dict[str, Any],
        error: BaseException | None,
        *,
        cpu_drains0: float | None = None,
        extra_cpu: Mapping[str, float] | None = None,
    ) -> dict[str, Any]:
        """The one closing sequence of every run, GPU-only included: the rows still held into the
        recording (a flush under way, the rows gathered, the policies' last decisions, every
        aggregate bucket), the policy's, the aggregates' and the sinks' parts of meta.json, the
        recording closed; then the error met, if any, raised."""
        self._stages.lap("loop")
        try:
            out.close_rows()
        except BaseException as e:
            error = error or e
        self._stages.lap("flush")
        final["policy"] = self._policy.to_meta()
        if "head_in_probes" in final:
            final["policy"]["head_in_probes"].update(final.pop("head_in_probes"))
        if out.aggregates is not None:
            final["aggregates"] = {
                "bucket_s": self.opts.aggregate_s,
                "left_out": sorted(out.aggregates.leave_out),
            }
        if "duty_cycle" in final and "aggregates" in final:
            final["aggregates"]["sparse_coverage"] = final["duty_cycle"]["coverage"]
        if self._sink_list:
            final["sinks"] = out.sinks.close({**self.meta, **final})
        self._stages.lap("frames_sinks")
        if cpu_drains0 is not None:  # (the hasher starts a few statements before the span: counted whole)
            final["consumer"]["cpu_s_by_stage"] = self._stages.meta(
                _cpu_s() - cpu_drains0, dict(extra_cpu or {})
            )
        self.meta.update(final)
        if writer is not None:
            writer.close(complete=error is None, **final)
        if error is not None:
            raise error
        _raise_write_failure(writer)
        return self.meta

    def _consumer_meta(self, c: DrainLoop, corr: Correlator) -> dict[str, Any]:
        """meta.json `consumer`: how the consumer kept pace (cpu_s_by_stage is added at close)."""
        batches, out = c.batched, self._out
        return {
            **c.sched.meta(),
            "flushes": out.round.rounds,  # each done in pieces between drains (flush_round.py)
            "flush_pieces": out.round.pieces,
            "ring_watch_wakeups": c.watch.wakeups,
            # its readings while following the ring after a wakeup below the threshold (ring_watch.py)
            "ring_watch_polls": c.watch.polls,
            "drains": c.reader.takes,  # that took any record; with the logits read in the ring:
            "drains_logits_by_ref": c.reader.takes_by_ref,
            # drains go to the correlator together (drain_batches.py): how often it ran, and the
            # logits records of a sampler call a drain cut, reduced with the next
            "correlate_every_s": self.opts.correlate_every if batches is not None else 0,
            "correlations": batches.correlations if batches is not None else c.reader.takes,
            "logits_carried": batches.reducer.carried if batches is not None else 0,
            # reduced rows whose statistics were of another token than the token row's (never
            # expected: both are the sampler call's result); left null
            "logits_token_mismatch": corr.requests.stats.token_mismatch,
            "gc_collections": self._collector.collections,
            # Polars' thread pool: 1 unless the user set POLARS_MAX_THREADS (session/thread_pools.py)
            "polars_threads": pl.thread_pool_size(),
            "ablated": c.ablation.meta(),  # --ablate-consumer (session/ablation.py)
        }

    def _open_correlator(self, a: Attached, gpu: GpuCapture | None, wall_offset_ns: int) -> Correlator:
        """The correlator for this engine, making the rows that something reads."""
        opts, hp = self.opts, a.model.hyperparameters
        wants_routes = self._out.sinks.wants("routes")
        n_expert_used = int(hp.get("expert_used_count", 0) or 0)
        if gpu is not None and n_expert_used:
            # a llama.cpp engine on a GPU: its routing kernels' rows rank every expert, the
            # first n_expert_used are the chosen ones (gpu/llamacpp_kernels.py)
            gpu.correlator.route_columns = n_expert_used
        return Correlator(
            pid=opts.pid,
            n_vocab=len(a.vocab),
            wall_offset_ns=wall_offset_ns,
            texts=a.vocab.texts,
            layers=a.layers,
            n_expert=int(hp.get("expert_count", 0) or 0),
            n_expert_used=n_expert_used,
            with_masks=opts.capture.masks,
            serving=ServingTracker(opts.pid, opts.request_header) if is_server(a.where) else None,
            slot_tokens=any(p.symbol == tg.SYM_PROCESS_TOKEN for p in a.session.attached),
            # routes rows nothing stores or reads (--policy aggregate without --metrics-port) are
            # counted, not made
            routes_rows=self._policy.stores("routes") or wants_routes or opts.capture.masks,
            head_verdicts=self._head_verdicts,
            head_drops_routes=not wants_routes,
            head_rows_apart=self._apart_columns(gpu),
        )

    def _open_outlet(self, writer: RecordingWriter | None, aggregates: Aggregator | None) -> RowOutlet:
        """The rows' readers: the recording, the aggregates, the policy, the sinks."""
        opts = self.opts
        sinks = SinkFanout(
            self._sink_list,
            self.meta,
            redact_text=opts.redact_text,
            redact=opts.redact,
            redact_layers=opts.redact_layers,
            log=self.log,
        )
        self._outlet = RowOutlet(
            writer,
            self._policy,
            aggregates,
            sinks,
            stages=self._stages,
            collector=self._collector,
            log=self.log,
        )
        return self._outlet

    @property
    def _out(self) -> RowOutlet:
        assert self._outlet is not None, "run() opens the outlet before any row"
        return self._outlet

    def _stop_on_write_error(self) -> None:
        if self._out.write_failed:
            self.stop("write error")

    def _apart_columns(self, gpu: GpuCapture | None) -> dict[str, frozenset[str]] | None:
        """With head sampling in the probes, when nothing but the recording, the aggregates and
        the sinks read the token and steps rows (no live view, no GPU capture joining kernels to
        steps, no masks), the rows of a dropped request are set apart from the others by the
        correlator with only the columns the always-on aggregates, the policy and the sinks read
        (SinkFanout.columns): they are counted from their arrays and given to the sinks as
        frames of those columns, never framed whole nor held. None otherwise, or when a sink
        that reads them does not say which columns."""
        sinks = self._out.sinks
        if (
            self._head_rate is None
            or self.on_update is not None
            or gpu is not None
            or self.opts.capture.masks
        ):
            return None
        out: dict[str, frozenset[str]] = {}
        for table in ("tokens", "steps"):
            wanted = sinks.columns(table)
            if wanted is None:
                return None
            out[table] = COUNTED[table] | self._policy.learns(table) | wanted
        return out

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
        out = self._open_outlet(writer, None)
        self.log(f"sparseety-prof: attached to PID {opts.pid} (GPU only: {len(gpu.rings)} CUPTI ring(s))")
        start_unix_ms = time.time_ns() // 1_000_000
        deadline = time.monotonic() + opts.duration if opts.duration else None
        error: BaseException | None = None
        flush = FlushSchedule(opts.flush_s)
        try:
            while True:
                stop = self._stop.wait(flush.wait_s(opts.drain_interval))
                if deadline is not None and time.monotonic() >= deadline:
                    self.stop("duration reached")
                if not _alive(opts.pid):
                    self.stop("target exited")
                final = stop or self._stop.is_set()
                for table, cols in gpu.poll(final=final).items():
                    out.add(table, cols, final=final)
                    if table == "steps":
                        self.progress.steps += part_rows(cols)
                self.progress.cpu_s = _cpu_s() - self._cpu0
                out.keep_durable(flush, time.monotonic())
                self._stop_on_write_error()
                if final:
                    break
        except BaseException as e:
            error = e
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
        return self._finish(out, writer, final_meta, error)

    def _consume(
        self,
        batch: EventBatch,
        corr: Correlator,
        tracker: SeqTracker,
        sess: Session,
        *,
        counters: dict[str, int] | None = None,
        final: bool = False,
        gpu: GpuCapture | None = None,
    ) -> None:
        """Drained records through the correlator to the rows' destinations."""
        stages, out = self._stages, self._out
        drops = (counters or sess.counters())["kernel_drops"]
        if len(batch):
            corr.feed(batch, losses_seen=drops > 0 or tracker.gaps > 0)
        stages.lap("correlate")
        logits0 = corr.logits_cpu_s
        tables = corr.take_tables(final=final)
        unmade = corr.routes.take_not_made()
        if unmade:
            out.policy.count_dropped("routes", unmade)
        unmade = corr.routes.take_head_dropped()
        if unmade:
            out.policy.count_head_dropped("routes", unmade)
        stages.lap("rows")
        stages.move(corr.logits_cpu_s - logits0, "rows", "logits")
        tok, steps = tables["tokens"], tables["steps"]
        gpu_tables = self._poll_gpu(gpu, steps, final=final)
        apart = corr.take_apart()
        stages.lap("frames_sinks")
        cpu_tables = (
            self._cpu.rows(steps, apart.get("steps", ()), final=final) if self._cpu is not None else {}
        )
        stages.lap("cpu_stacks")
        if self._waits is not None:
            cpu_tables = {**cpu_tables, **self._waits.rows(steps, final=final)}
            stages.lap("thread_waits")
        if self._ops is not None:
            cpu_tables = {**cpu_tables, **self._ops.rows(steps, final=final)}
            stages.lap("op_times")
        if out.wanted:
            out.add_apart(apart)
            for table, cols in (*tables.items(), *gpu_tables.items(), *cpu_tables.items()):
                out.add(table, cols, final=final)
        stages.lap("frames_sinks")
        p = self.progress
        p.tokens += sum(r.n for r in apart.get("tokens", ()))
        p.steps += sum(r.n for r in apart.get("steps", ()))
        p.requests += len(tables.get("requests", {}).get("request_id", []))
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
        if out.sinks:
            out.sinks.drained(p)
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
        # a journal: each drain's rows in the page cache (None: none, rows at flushes only)
        fsync_interval=opts.fsync_interval if opts.journal else None,
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
        grace_s=max(10.0, 2 * opts.flush_s),
        leave_out=leave_out,
    )


def _open_gpu(pid: int) -> GpuCapture | None:
    try:
        return GpuCapture.open(pid)
    except RingError as e:
        raise GpuRingUnreadable(f"the CUPTI ring of PID {pid} cannot be read: {e}") from None


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
