"""`record`: attach to an engine by PID and write a recording until the engine exits, the user
stops us (Ctrl-C / SIGTERM) or the duration ends. The engine's hot path only runs the probes;
decoding, correlation, statistics and Parquet writing all happen here, in the consumer."""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from sparseety_prof import __version__
from sparseety_prof.capture import layouts
from sparseety_prof.capture import target as tg
from sparseety_prof.capture.bpf_loader import (
    ATTENTION_OPS,
    RING_BUFFER_PAGES,
    RingReader,
    Session,
    compile_and_attach,
    is_server,
)
from sparseety_prof.capture.discovery_probe import Discovery, run_discovery
from sparseety_prof.capture.events import SeqTracker, decode_groups
from sparseety_prof.capture.gguf_info import ModelInfo, Vocab, read_model_info, read_tensor_infos, sha256_file
from sparseety_prof.capture.options import Capture
from sparseety_prof.capture.plans import LayerSet, MoePlan, layer_set, moe_plan
from sparseety_prof.capture.weight_sparsity import analyze as analyze_weights
from sparseety_prof.correlate import logits
from sparseety_prof.correlate.correlator import Correlator
from sparseety_prof.correlate.serving import DEFAULT_HEADER, ServingTracker
from sparseety_prof.errors import NotAnEngine, ProfError, UnsupportedEngineBuild
from sparseety_prof.gpu.capture import GpuCapture
from sparseety_prof.gpu.shm_ring import RingError
from sparseety_prof.session.snapshot import engine_environment, host_info, process_info, server_props
from sparseety_prof.store import schema
from sparseety_prof.store.recording import RecordingWriter, sudo_owner

DRAIN_INTERVAL_S = 0.5  # consumer batches: fewer, larger frames cost less CPU per token
RING_BYTES = RING_BUFFER_PAGES * 4096


@dataclass
class Options:
    pid: int
    out: Path | None
    duration: float | None = None
    redact_text: bool = False
    model: Path | None = None  # override when the process has no GGUF file mapped or open
    skip_probes: frozenset[str] = frozenset()  # for tests: disable a probe point on purpose
    nice: int = 10  # consumer priority once attached: the engine's threads win any contention
    sched: str = "nice"  # "nice": compete at `nice`; "idle": SCHED_IDLE, escalating when the ring fills
    request_header: str = DEFAULT_HEADER  # HTTP header carrying the client's request id
    capture: Capture = field(default_factory=Capture)  # sparse decisions to capture
    # where MoE values are read: "auto" = at the weighted multiply where the graph allows; "ops" =
    # at get_rows and the GLU op (capture.plans.MoePlan)
    moe_read: str = "auto"
    discover_layout: bool = False  # learn the llama_ubatch layout on live data even if the table has it
    discover_timeout: float = 120.0  # seconds to wait for forward passes to learn a layout from


@dataclass
class Progress:
    """What the live view and the summary line show; updated by the consumer loop."""

    tokens: int = 0
    steps: int = 0
    records: int = 0
    kernel_drops: int = 0
    seq_gaps: int = 0
    cpu_s: float = 0.0
    lag_ms: float = 0.0
    logits_incomplete: int = 0
    ring_fill_peak: float = 0.0  # largest share of the ring one drain found filled
    drain_gap_max_ms: float = 0.0  # longest time between two drains (the consumer waited for CPU)
    escalations: int = 0  # times the consumer left SCHED_IDLE because the ring was filling

    def counters(self) -> dict[str, float]:
        return {
            "cpu_s": self.cpu_s,
            "lag_ms": self.lag_ms,
            "kernel_drops": self.kernel_drops,
            "seq_gaps": self.seq_gaps,
            "logits_incomplete": self.logits_incomplete,
        }


@dataclass
class Attached:
    target: tg.Target
    build: layouts.EngineBuild
    model: ModelInfo
    vocab: Vocab
    session: Session
    where: dict[str, Path]
    layers: LayerSet
    capture_layers: list[tg.CaptureLayer]
    discovery: Discovery | None


def attach(
    opts: Options, log: Callable[[str], None] = print, stop: Callable[[], bool] = lambda: False
) -> Attached:
    """Validate the target, learn its layout where needed, then compile and attach the probes.
    Every failure is a ProfError."""
    tg.check_process(opts.pid)
    tg.check_privileges()
    t = tg.inspect(opts.pid)
    where = tg.find_engine_libs(t)
    if tg.SYM_LLAMA_SAMPLER not in where and tg.SYM_COMMON_SAMPLER not in where:
        raise NotAnEngine(f"PID {opts.pid} maps llama.cpp but no sampler entry point was found")
    build = layouts.identify_build(t, where)
    layers_found = tg.capture_layers(where)
    for layer in layers_found:
        if not layer.available:
            log(f"sparseety-prof: capture layer '{layer.name}' degraded: {layer.detail}")
    model_path = opts.model or (t.model_paths[0] if t.model_paths else None)
    if model_path is None:
        raise NotAnEngine(
            f"PID {opts.pid} has no .gguf model file mapped or open (deleted since, or read without mmap); "
            f"pass --model PATH"
        )
    # the sha256 of a multi-GB model takes a while: it is computed after attaching (Recorder.run)
    model = read_model_info(model_path, with_sha256=False)
    vocab = Vocab.from_gguf(model_path)
    n_layer = int(model.hyperparameters.get("block_count", 0) or 0)
    tensor_names = [ti.name for ti in read_tensor_infos(model_path)]
    layers = layer_set(tensor_names, n_layer)
    plan = moe_plan(tensor_names, layers, model.architecture) if opts.moe_read == "auto" else MoePlan()
    discovery = None
    if build.ubatch is None or opts.discover_layout:
        log(f"sparseety-prof: {build.identity.describe()}: layout source: {build.layout_source}")
        discovery = run_discovery(
            opts.pid, where, len(vocab), timeout_s=opts.discover_timeout, log=log, stop=stop
        )
        if build.ubatch is not None and build.ubatch != discovery.layout:
            raise UnsupportedEngineBuild(
                f"unsupported engine build: the layout discovered on live data ({discovery.layout}) "
                f"differs from the table's for {build.identity.describe()} ({build.ubatch}); "
                f"nothing was attached"
            )
        build = replace(build, ubatch=discovery.layout, layout_source="discovered on live data")
        log(
            f"sparseety-prof: llama_ubatch layout discovered from {discovery.ubatches} forward passes "
            f"in {discovery.seconds:.2f} s (+{discovery.compile_s:.2f} s compile): "
            f"{discovery.layout.describe()}"
        )
    sess = compile_and_attach(
        opts.pid, where, build, len(vocab), capture=opts.capture, skip=opts.skip_probes, moe=plan
    )
    return Attached(t, build, model, vocab, sess, where, layers, layers_found, discovery)


def run_metadata(a: Attached, opts: Options) -> dict[str, Any]:
    libs = sorted({str(p) for p in a.where.values()})
    return {
        "profiler": {"name": "sparseety-prof", "version": __version__},
        "engine": {
            "name": a.build.engine,
            "version": a.build.version,
            "llama_cpp_commit": a.build.llama_cpp_commit,
            "identity": a.build.identity.to_meta(),
            "libraries": [{"path": p, "build_id": tg.build_id(Path(p))} for p in libs],
            "ubatch_layout": a.build.ubatch.__dict__ if a.build.ubatch else None,
            "layout_source": a.build.layout_source,
            "layout_discovery": a.discovery.to_meta() if a.discovery else None,
            "capture_layers": {
                c.name: {"available": c.available, "detail": c.detail} for c in a.capture_layers
            },
        },
        "probes": [p.__dict__ for p in a.session.attached],
        "moe_read_points": a.session.moe.to_meta(),
        "model": a.model.to_meta(),
        "target": {"pid": a.target.pid, "exe": a.target.exe, "cmdline": a.target.cmdline},
        "host": host_info(),
        "config": _config_snapshot(a),
        "clock": "CLOCK_MONOTONIC ns (t_*_ns); ts_unix_ms is wall clock derived from it at attach",
        "redact_text": opts.redact_text,
        "capture": opts.capture.to_meta(),
        "act_threshold": opts.capture.act_threshold,
        "logits_stats": {"backend": logits.BACKEND, "x86_level": logits.native_level()},
        "layers": a.layers.to_meta(),
    }


class Recorder:
    """The consumer loop. `run()` blocks until stopped; `stop()` may be called from any thread."""

    def __init__(
        self,
        opts: Options,
        *,
        on_update: Callable[[dict[str, list[Any]], dict[str, list[Any]], Progress], None] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.opts = opts
        self.on_update = on_update
        self._rows = _ColumnBuffer()
        self.log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self.progress = Progress()
        self._stop = threading.Event()
        self.stop_reason = ""
        self.meta: dict[str, Any] = {}
        self.correlator: Correlator | None = None  # once attached (check.py reads its serving trace)
        self._cpu0 = 0.0

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
        self.meta = run_metadata(a, opts)
        writer = None
        if opts.out is not None:
            writer = RecordingWriter(opts.out, self.meta, owner=sudo_owner(), redact_text=opts.redact_text)
        hp = a.model.hyperparameters
        corr = self.correlator = Correlator(
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
        )
        tracker = SeqTracker()
        # Everything made so far (modules, the vocabulary's strings, the model's metadata) lives
        # as long as the recording: out of the collector's sight, its full passes over the rows
        # being gathered cost about half as much.
        gc.freeze()
        reader = RingReader(a.session)
        model_hash: dict[str, Any] = {}

        def hash_and_scan() -> None:
            # the model's sha256, then its static weight sparsity (cached per sha256)
            model_hash["sha256"] = sha256_file(a.model.path)
            try:
                model_hash["weights"] = analyze_weights(a.model.path, sha256=model_hash["sha256"])
            except Exception as e:  # a cache problem must not lose the recording
                model_hash["weights"] = {"error": str(e)}

        hasher = threading.Thread(target=hash_and_scan, name="model-sha256", daemon=True)
        hasher.start()
        start_unix_ms = time.time_ns() // 1_000_000
        self.log(
            f"sparseety-prof: attached to PID {opts.pid} ({a.build.engine} {a.build.version}, model "
            f"{a.model.path.name}, {len(a.session.attached)} probes, compiled in {a.session.compile_s:.1f}s)"
            + (f"; recording to {opts.out}" if opts.out else "")
        )
        deadline = time.monotonic() + opts.duration if opts.duration else None
        error: BaseException | None = None
        sched = _ConsumerSched(opts, self.progress)
        try:
            t_prev = time.monotonic()
            while not self._stop.is_set():
                self._stop.wait(DRAIN_INTERVAL_S)
                records = reader.take(sched.on_backlog)
                now = time.monotonic()
                sched.after_drain(sum(len(b) for b in records.values()) / RING_BYTES, (now - t_prev) * 1e3)
                t_prev = now
                self._consume(records, corr, tracker, writer, a.session, gpu=gpu)
                self._maybe_detach_attention_ops(corr, a.session)
                if deadline is not None and time.monotonic() >= deadline:
                    self.stop("duration reached")
                if not _alive(opts.pid):
                    self.stop("target exited")
        except BaseException as e:
            error = e
        finally:
            rest = reader.stop()
            counters = a.session.counters()
            counters["program_misses"] = a.session.program_misses()  # before close: read off the fds
            a.session.close()
            if error is None:
                try:
                    self._consume(
                        rest, corr, tracker, writer, a.session, counters=counters, final=True, gpu=gpu
                    )
                except BaseException as e:
                    error = e
            else:
                tracker.update(decode_groups(rest, a.session.logits_chunk).seqs(), final=True)
            self.progress.cpu_s = _cpu_s() - cpu0
            final = {
                "start_unix_ms": start_unix_ms,
                "end_unix_ms": time.time_ns() // 1_000_000,
                "stop_reason": self.stop_reason or (type(error).__name__ if error else ""),
                "losses": {
                    "kernel_drops": counters["kernel_drops"],
                    "seq_gaps": tracker.gaps,
                    "records_produced": counters["records_produced"],
                    "records_seen": tracker.seen,
                    "ubatch_rows_not_copied": counters["ubatch_rows_not_copied"],
                    "logits_incomplete": corr.counters.logits_incomplete,
                    "samples_unresolved": corr.counters.samples_unresolved,
                    "sparse_rows_not_captured": counters["sparse_rows_not_captured"],
                    "attention_rows_not_counted": counters["attention_rows_not_counted"],
                    "sparse_unattributed": corr.counters.sparse_unattributed,
                    "sparse_unmapped_rows": corr.problems.unmapped_rows,
                    "slot_tokens_unresolved": corr.counters.slot_tokens_unresolved,
                    "samples_before_first_step": corr.counters.samples_before_first_step,
                    "program_misses": counters["program_misses"],
                },
                "serving": _serving_meta(corr, a, opts),
                "verification": {
                    "verified_ubatches": corr.counters.verified_ubatches,
                    "verified_decodes": corr.counters.verified_decodes,
                    "verified_routing": corr.counters.verified_sparse,
                },
                "layer_coverage": _coverage(a.layers, corr.layers_seen, opts.capture),
                "attention_masks": corr.attn_map.meta() if opts.capture.attention else None,
                "counts": {"tokens": self.progress.tokens, "steps": self.progress.steps},
                "profiler_cpu_s": round(self.progress.cpu_s, 3),
                "consumer": sched.meta(),
                "bpf_compile_s": round(a.session.compile_s, 3),
            }
            if hasher.is_alive():
                self.log("sparseety-prof: finishing the model file's sha256 ...")
            hasher.join()
            final["model"] = {**self.meta["model"], "sha256": model_hash.get("sha256")}
            final["weight_sparsity"] = _weight_summary(model_hash.get("weights"))
            if gpu is not None:
                final["gpu"] = gpu.meta()
                gpu.close()
            self.meta.update(final)
            if writer is not None:
                for table, df in self._rows.take_all():  # rows of drains before an error
                    writer.append(table, df)
                writer.close(**final)
        if error is not None:
            raise error
        return self.meta

    def _maybe_detach_attention_ops(self, corr: Correlator, sess: Session) -> None:
        """Once the layer -> mask map is learned (attention_map), the soft_max / flash-attention
        probes only cost: two uprobe hits per layer and engine thread per token."""
        amap = corr.attn_map
        if amap.ready and not amap.detach_tried and sess.kv_mask_probe:
            amap.detach_tried = True  # once: a probe that would not detach keeps agreeing records
            n = sess.detach_attention_ops()
            amap.ops_detached = not any(p.symbol in ATTENTION_OPS for p in sess.attached)
            self.log(
                f"sparseety-prof: attention masks now counted where the engine writes them "
                f"(layer map learned after {amap.learned_after} passes); {n} graph-op probes detached"
            )

    def _poll_gpu(self, gpu: GpuCapture | None, steps: schema.Columns, *, final: bool) -> schema.Tables:
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
            "target": _target_meta(opts.pid),
            "host": host_info(),
            "config": {"environment": engine_environment(opts.pid), "process": process_info(opts.pid)},
            "clock": "CLOCK_MONOTONIC ns (t_*_ns, start_ns, end_ns)",
        }
        writer = None
        if opts.out is not None:
            writer = RecordingWriter(opts.out, self.meta, owner=sudo_owner(), redact_text=opts.redact_text)
        self.log(f"sparseety-prof: attached to PID {opts.pid} (GPU only: {len(gpu.rings)} CUPTI ring(s))")
        start_unix_ms = time.time_ns() // 1_000_000
        deadline = time.monotonic() + opts.duration if opts.duration else None
        error: BaseException | None = None
        try:
            while True:
                stop = self._stop.wait(DRAIN_INTERVAL_S)
                if deadline is not None and time.monotonic() >= deadline:
                    self.stop("duration reached")
                if not _alive(opts.pid):
                    self.stop("target exited")
                final = stop or self._stop.is_set()
                for table, cols in gpu.poll(final=final).items():
                    df = schema.frame(table, cols)
                    if writer is not None and df.height:
                        writer.append(table, df)
                    if table == "steps":
                        self.progress.steps += df.height
                self.progress.cpu_s = _cpu_s() - self._cpu0
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
            self.meta.update(final_meta)
            if writer is not None:
                writer.close(**final_meta)
        if error is not None:
            raise error
        return self.meta

    def _consume(
        self,
        records: dict[int, np.ndarray],
        corr: Correlator,
        tracker: SeqTracker,
        writer: RecordingWriter | None,
        sess: Session,
        *,
        counters: dict[str, int] | None = None,
        final: bool = False,
        gpu: GpuCapture | None = None,
    ) -> None:
        batch = decode_groups(records, sess.logits_chunk)
        tracker.update(batch.seqs(), final=final)
        if len(batch):
            corr.feed(batch)
        tables = corr.take_tables(final=final)
        tok, steps = tables["tokens"], tables["steps"]
        gpu_tables = self._poll_gpu(gpu, steps, final=final)
        if writer is not None:
            rows = self._rows
            for table, cols in (*tables.items(), *gpu_tables.items()):
                for df in rows.add(table, cols, final=final):
                    writer.append(table, df)
        p = self.progress
        p.records = tracker.seen
        p.seq_gaps = tracker.gaps
        p.kernel_drops = (counters or sess.counters())["kernel_drops"]
        p.steps += len(steps.get("step_id", []))
        n_tok = len(tok.get("token_id", []))
        p.tokens += n_tok
        p.logits_incomplete = corr.counters.logits_incomplete
        if n_tok and tok["t_end_ns"][-1] is not None:
            # how far behind the engine the consumer is: both clocks are CLOCK_MONOTONIC
            p.lag_ms = (time.monotonic_ns() - int(str(tok["t_end_ns"][-1]))) / 1e6
        p.cpu_s = _cpu_s() - self._cpu0
        if self.on_update is not None:
            self.on_update(tok, steps, p)


class _ColumnBuffer:
    """Rows of each table gathered over drains, as columns, and made into a frame once
    FRAME_ROWS rows are there (or at the end): building a polars frame has a fixed cost per
    column (~70 columns over the tables), which one drain's hundred tokens did not amortise
    (measured: 16 us per token at a frame per drain). The writer keeps frames in memory up to a
    segment anyway, so nothing reaches the disk later than before for a long recording."""

    FRAME_ROWS = 2048

    def __init__(self) -> None:
        self._cols: dict[str, dict[str, list[Any]]] = {}

    def add(self, table: str, cols: dict[str, list[Any]], *, final: bool) -> list[pl.DataFrame]:
        out = []
        buf = self._cols.get(table)
        if cols:
            if buf is not None and buf.keys() != cols.keys():  # another shape: close the old one
                out.append(schema.frame(table, buf))
                buf = None
            if buf is None:
                buf = self._cols[table] = {k: list(v) for k, v in cols.items()}
            else:
                for k, v in cols.items():
                    buf[k].extend(v)
        if buf is not None and (final or len(next(iter(buf.values()), ())) >= self.FRAME_ROWS):
            out.append(schema.frame(table, buf))
            del self._cols[table]
        return out

    def take_all(self) -> list[tuple[str, pl.DataFrame]]:
        """Frames of every row still gathered."""
        out = [(table, schema.frame(table, cols)) for table, cols in self._cols.items()]
        self._cols.clear()
        return out


class _ConsumerSched:
    """Where the consumer's CPU comes from. It runs at a low priority (`--nice`, default 10), or
    with `--sched idle` as SCHED_IDLE (only CPU the engine leaves idle), so that the engine's
    threads win contention. A low priority can starve it while the engine keeps every core busy
    (measured: 2-3 s without a drain during a 2-thread generation on 2 cores), and the ring holds
    about 1.5 s of tokens: when one drain finds the ring filling (ESCALATE_FILL), the consumer
    takes the engine's own priority (nice 0, SCHED_OTHER) until it has caught up (RELAX_FILL):
    losing records is worse than taking a few percent of the engine's time. Escalations are
    counted in meta.json ("consumer")."""

    ESCALATE_FILL = 0.5
    RELAX_FILL = 0.1

    def __init__(self, opts: Options, progress: Progress) -> None:
        self.progress = progress
        self.mode = opts.sched
        self.nice = opts.nice
        self.tid = threading.get_native_id()
        self.escalated = False
        if self.mode == "idle":
            self._policy(os.SCHED_IDLE)

    def _policy(self, policy: int) -> None:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, policy, os.sched_param(0))  # this thread: the consumer

    def _niceness(self, value: int) -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, self.tid, value)  # Linux: a TID sets one thread

    def on_backlog(self, backlog: float) -> None:
        if not self.escalated and backlog > self.ESCALATE_FILL:
            self._escalate()

    def _escalate(self) -> None:
        self.escalated = True
        self.progress.escalations += 1
        if self.mode == "idle":
            self._policy(os.SCHED_OTHER)
        self._niceness(0)

    def after_drain(self, fill: float, gap_ms: float) -> None:
        p = self.progress
        p.ring_fill_peak = max(p.ring_fill_peak, fill)
        p.drain_gap_max_ms = max(p.drain_gap_max_ms, gap_ms)
        if not self.escalated and fill > self.ESCALATE_FILL:
            self._escalate()
        elif self.escalated and fill < self.RELAX_FILL:
            self.escalated = False
            self._niceness(self.nice)
            if self.mode == "idle":
                self._policy(os.SCHED_IDLE)

    def meta(self) -> dict[str, Any]:
        p = self.progress
        return {
            "sched": self.mode,
            "nice": self.nice,
            "ring_fill_peak": round(p.ring_fill_peak, 4),
            "drain_gap_max_ms": round(p.drain_gap_max_ms, 1),
            "escalations": p.escalations,
        }


def _target_meta(pid: int) -> dict[str, Any]:
    t = tg.inspect(pid)
    return {"pid": pid, "exe": t.exe, "cmdline": t.cmdline}


def _open_gpu(pid: int) -> GpuCapture | None:
    try:
        return GpuCapture.open(pid)
    except RingError as e:
        raise ProfError(f"the CUPTI ring of PID {pid} cannot be read: {e}") from None


def _config_snapshot(a: Attached) -> dict[str, Any]:
    """What it takes to reproduce the run, beyond the engine build and model (recorded apart)."""
    pid = a.target.pid
    cfg: dict[str, Any] = {"environment": engine_environment(pid), "process": process_info(pid)}
    if is_server(a.where):
        try:
            urls = tg.listening_urls(pid)
        except ProfError:
            urls = []
        cfg["server"] = {"urls": urls, "props": server_props(urls[0]) if urls else None}
    return cfg


def _serving_meta(corr: Correlator, a: Attached, opts: Options) -> dict[str, Any] | None:
    """How request ids were obtained, with the chain's own counts (None: not a server)."""
    sv = corr.serving
    if sv is None:
        return None
    return {
        "request_id_header": opts.request_header,
        "http_reads_probed": any(p.kind == "tracepoint" for p in a.session.attached),
        **sv.counters.__dict__,
    }


def _coverage(layers: LayerSet, seen: dict[str, set[int]], capture: Capture) -> dict[str, Any]:
    """Per kind of decision: the model's layers, those observed, and those missing. A layer that
    ran elsewhere (offloaded) or a probe that never fired shows up as missing, never as absent."""
    wanted = {"moe": capture.routes, "ffn": capture.activations, "attn": capture.attention}
    out: dict[str, Any] = {}
    for kind, expected in (("moe", layers.moe), ("ffn", layers.ffn), ("attn", layers.attn)):
        if not wanted[kind]:
            out[kind] = {"captured": False}
            continue
        got = seen.get(kind, set())
        out[kind] = {
            "captured": True,
            "layers": list(expected),
            "observed": sorted(got & set(expected)),
            "missing": sorted(set(expected) - got),
        }
    return out


def _weight_summary(w: dict[str, Any] | None) -> dict[str, Any] | None:
    """Static weight sparsity for meta.json: per-tensor figures only for tensors with zeros."""
    if not w or "tensors" not in w:
        return w
    return {
        "summary": w["summary"],
        "tensors": [
            {k: t[k] for k in ("name", "type", "zero_fraction", "nm_pattern")}
            for t in w["tensors"]
            if t.get("zero_fraction") or t.get("nm_pattern")
        ],
    }


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


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


def summary_line(meta: dict[str, Any]) -> str:
    losses = meta.get("losses", {})
    return (
        f"sparseety-prof: {meta['counts']['tokens']} tokens, {meta['counts']['steps']} steps; "
        f"losses: {losses.get('kernel_drops', 0)} dropped in kernel, "
        f"{losses.get('seq_gaps', 0)} sequence gaps, "
        f"{losses.get('logits_incomplete', 0)} incomplete logits, "
        f"{losses.get('samples_unresolved', 0)} unresolved samples; "
        f"profiler CPU {meta['profiler_cpu_s']:.2f}s "
        f"(BPF compile {meta['bpf_compile_s']:.2f}s); stopped: {meta['stop_reason']}"
    )


__all__ = [
    "Options",
    "ProfError",
    "Progress",
    "Recorder",
    "attach",
    "install_signal_handlers",
    "summary_line",
]
