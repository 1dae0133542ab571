"""Attach: validate the target, identify its build, learn its private layout where needed, and
compile and attach the probes. Nothing here runs on the engine's hot path."""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from sparseety_prof.capture import layouts
from sparseety_prof.capture import target as tg
from sparseety_prof.capture.bpf_loader import Session, compile_and_attach
from sparseety_prof.capture.discovery_probe import Discovery, run_discovery
from sparseety_prof.capture.gguf_info import ModelInfo, TensorInfo, Vocab, read_model_info, read_tensor_infos
from sparseety_prof.capture.plans import LayerSet, MoePlan, layer_set, moe_plan
from sparseety_prof.capture.tensor_probe import ProcessMemory, TensorCheck, verify_tensor_layout
from sparseety_prof.capture.untrusted_files import PinnedFile
from sparseety_prof.errors import MissingPrivileges, NotAnEngine, UnsupportedEngineBuild, UsageError
from sparseety_prof.session.options import Options
from sparseety_prof.session.policy import probe_keep_below


@dataclass
class Attached:
    target: tg.Target
    build: layouts.EngineBuild
    model: ModelInfo
    model_file: PinnedFile  # read through this opening only; closed by whoever ends the session
    vocab: Vocab
    session: Session
    where: dict[str, Path]
    layers: LayerSet
    capture_layers: list[tg.CaptureLayer]
    discovery: Discovery | None
    tensor_check: TensorCheck | None = None  # None: no sparse-decision probe reads ggml_tensor


def attach(
    opts: Options,
    log: Callable[[str], None] = print,
    stop: Callable[[], bool] = lambda: False,
    before_probes: Callable[[], None] = lambda: None,
) -> Attached:
    """Validate the target, learn its layout where needed, then compile and attach the probes.
    `before_probes` runs once the target proved to be an engine with its model, before the
    probes' compile (the recorder compiles its other BPF programs there: never for a process
    that is not an engine). Every failure is a ProfError."""
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
    model_file = pin_model(t, opts.model)
    try:
        # the sha256 of a multi-GB model takes a while: it is computed after attaching (Recorder.run)
        model = read_model_info(model_file, with_sha256=False)
        vocab = Vocab.from_gguf(model_file)
        tensors = read_tensor_infos(model_file)
        before_probes()
        return _attach_probes(
            opts, t, where, build, layers_found, model_file, model, vocab, tensors, log, stop
        )
    except BaseException:
        model_file.close()
        raise


def pin_model(t: tg.Target, model: Path | None = None) -> PinnedFile:
    """The model file, opened once for every later read (header, vocabulary, hash, weights):
    the one the engine holds, through its own mapping or descriptor, so that a name swapped after
    this does not make root read another file; or the file the operator named with --model."""
    if model is not None:
        try:
            return PinnedFile(model)
        except OSError as e:
            raise UsageError(f"cannot read model file {model}: {e.strerror or e}") from None
    if not t.models:
        raise NotAnEngine(
            f"PID {t.pid} has no .gguf model file mapped or open (deleted since, or read without mmap); "
            f"pass --model PATH"
        )
    m = t.models[0]
    try:
        try:
            return PinnedFile(m.path, source=m.source)
        except PermissionError:
            # /proc/PID/map_files needs CAP_SYS_ADMIN (or CAP_CHECKPOINT_RESTORE), which a recorder
            # given only CAP_BPF and CAP_PERFMON lacks: pinned at this first open of the name instead
            return PinnedFile(m.path)
    except PermissionError as e:
        # the engine's user may read it and we may not: CAP_DAC_READ_SEARCH reads it anyway
        raise MissingPrivileges(
            f"cannot open the model file PID {t.pid} holds ({m.path}): {e.strerror or e}; a recorder "
            f"that is not root needs CAP_DAC_READ_SEARCH (docs/privileges.md)"
        ) from None
    except OSError as e:
        raise NotAnEngine(
            f"cannot open the model file PID {t.pid} holds ({m.path}): {e.strerror or e}"
        ) from None


def _attach_probes(
    opts: Options,
    t: tg.Target,
    where: dict[str, Path],
    build: layouts.EngineBuild,
    layers_found: list[tg.CaptureLayer],
    model_file: PinnedFile,
    model: ModelInfo,
    vocab: Vocab,
    tensors: list[TensorInfo],
    log: Callable[[str], None],
    stop: Callable[[], bool],
) -> Attached:
    tensor_names = [ti.name for ti in tensors]
    head_rate = opts.policy_choice.head_in_probes
    n_layer = int(model.hyperparameters.get("block_count", 0) or 0)
    layers = layer_set(tensor_names, n_layer)
    plan = moe_plan(tensor_names, layers, model.architecture) if opts.moe_read == "auto" else MoePlan()
    discovery = None
    if build.ubatch is None or opts.discover_layout:
        log(f"sparseety-prof: {build.identity.describe()}: layout source: {build.layout_source}")
        table_params = (build.tensor.params_ith, build.tensor.params_nth)
        discovery = run_discovery(
            opts.pid,
            where,
            len(vocab),
            timeout_s=opts.discover_timeout,
            log=log,
            stop=stop,
            params_table=table_params,
        )
        if build.ubatch is not None and build.ubatch != discovery.layout:
            raise UnsupportedEngineBuild(
                f"unsupported engine build: the layout discovered on live data ({discovery.layout}) "
                f"differs from the table's for {build.identity.describe()} ({build.ubatch}); "
                f"nothing was attached"
            )
        build = replace(build, ubatch=discovery.layout, layout_source="discovered on live data")
        if discovery.params.offsets is not None:
            ith, nth = discovery.params.offsets
            build = replace(build, tensor=replace(build.tensor, params_ith=ith, params_nth=nth))
        log(
            f"sparseety-prof: llama_ubatch layout discovered from {discovery.ubatches} forward passes "
            f"in {discovery.seconds:.2f} s (+{discovery.compile_s:.2f} s compile): "
            f"{discovery.layout.describe()}"
        )
    tensor_check = None
    if opts.capture.any:
        tensor_check = verify_tensor_layout(
            ProcessMemory(opts.pid), tensors, build.tensor, what=f"PID {opts.pid}"
        )
        if discovery is not None:
            tensor_check = replace(tensor_check, params_source=f"layout discovery: {discovery.params.source}")
        build = replace(build, tensor=tensor_check.layout)
        log(
            f"sparseety-prof: ggml_tensor layout {tensor_check.source} ({tensor_check.weights} weights, "
            f"{tensor_check.nodes} graph nodes, {tensor_check.seconds:.2f} s)"
            + (f"; the table's failed: {tensor_check.table_failure}" if tensor_check.table_failure else "")
        )
    sess = compile_and_attach(
        opts.pid,
        where,
        build,
        len(vocab),
        capture=opts.capture,
        skip=opts.skip_probes,
        moe=plan,
        ring_pages=opts.ring_mb * (1 << 20) // mmap.PAGESIZE,
        n_layer=n_layer,
        head_keep_below=None if head_rate is None else probe_keep_below(head_rate),
    )
    return Attached(
        t, build, model, model_file, vocab, sess, where, layers, layers_found, discovery, tensor_check
    )
