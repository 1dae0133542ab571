"""meta.json of a recording: what it takes to reproduce the run (written at attach), and what the
run did (losses, coverage, verification counts; written at close), plus the one-line summary."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from sparseety_prof import __version__
from sparseety_prof.capture import target as tg
from sparseety_prof.capture.bpf_loader import is_server
from sparseety_prof.capture.events import UB_SMALL_TOK
from sparseety_prof.capture.options import Capture
from sparseety_prof.capture.plans import LayerSet
from sparseety_prof.correlate import build_stamp, logits
from sparseety_prof.correlate.correlator import Correlator
from sparseety_prof.errors import ProfError
from sparseety_prof.session import redaction
from sparseety_prof.session.attach import Attached
from sparseety_prof.session.options import Options
from sparseety_prof.session.policy import probe_keep_below
from sparseety_prof.session.snapshot import engine_environment, host_info, process_info, server_props


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
            "tensor_layout_check": a.tensor_check.to_meta() if a.tensor_check else None,
            "capture_layers": {
                c.name: {"available": c.available, "detail": c.detail} for c in a.capture_layers
            },
        },
        "probes": a.session.probes_meta(),
        "moe_read_points": a.session.moe.to_meta(),
        # the sizes the probes' records were built with (events.h: AGG_LAYERS, UB_SMALL_TOK)
        "record_layout": {
            "logits_chunk": a.session.logits_chunk,
            "agg_layers": a.session.agg_layers,
            "lt_threads": a.session.lt_threads,  # engine threads an aggregate record times (LT_THREADS)
            "ubatch_small_rows": UB_SMALL_TOK,
        },
        "model": a.model.to_meta(),
        "target": {
            "pid": a.target.pid,
            "exe": a.target.exe,
            "cmdline": redaction.command_line(a.target.cmdline, redact_text=opts.redact_text),
        },
        "host": host_info(),
        "config": _config_snapshot(a, redact_text=opts.redact_text),
        "clock": "CLOCK_MONOTONIC ns (t_*_ns); ts_unix_ms is wall clock derived from it at attach",
        "redact_text": opts.redact_text,
        "capture": opts.capture.to_meta(),
        "act_threshold": opts.capture.act_threshold,
        "logits_stats": {"backend": logits.BACKEND, "x86_level": logits.native_level()},
        # "compiled" (mypyc), or "source: <why>" (correlate/build_stamp.py)
        "correlator": {"build": build_stamp.STATE},
        "layers": a.layers.to_meta(),
    }


def target_meta(pid: int, *, redact_text: bool) -> dict[str, Any]:
    t = tg.inspect(pid)
    return {"pid": pid, "exe": t.exe, "cmdline": redaction.command_line(t.cmdline, redact_text=redact_text)}


def _config_snapshot(a: Attached, *, redact_text: bool) -> dict[str, Any]:
    """What it takes to reproduce the run, beyond the engine build and model (recorded apart)."""
    pid = a.target.pid
    cfg: dict[str, Any] = {
        "environment": engine_environment(pid, redact_text=redact_text),
        "process": process_info(pid),
    }
    if is_server(a.where):
        try:
            urls = tg.listening_urls(pid)
        except ProfError:
            urls = []
        props = server_props(urls[0], redact_text=redact_text) if urls else None
        cfg["server"] = {"urls": urls, "props": props}
    return cfg


def serving_meta(corr: Correlator, a: Attached, opts: Options) -> dict[str, Any] | None:
    """How request ids were obtained, with the chain's own counts (None: not a server)."""
    sv = corr.serving
    if sv is None:
        return None
    return {
        "request_id_header": opts.request_header,
        "http_reads_probed": any(p.kind == "tracepoint" for p in a.session.attached),
        # (asdict: a compiled dataclass has no __dict__)
        **dataclasses.asdict(sv.counters),
    }


def coverage(layers: LayerSet, seen: dict[str, set[int]], capture: Capture) -> dict[str, Any]:
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


def weight_summary(w: dict[str, Any] | None) -> dict[str, Any] | None:
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


def losses(counters: dict[str, int], corr: Correlator, *, seq_gaps: int, records_seen: int) -> dict[str, int]:
    """Every count of what the recording missed, in one place: the kernel side's (ring drops,
    rows beyond the in-kernel budgets, programs that did not run) and the correlator's."""
    return {
        "kernel_drops": counters["kernel_drops"],
        "seq_gaps": seq_gaps,
        "records_produced": counters["records_produced"],
        "records_seen": records_seen,
        "ubatch_rows_not_copied": counters["ubatch_rows_not_copied"],
        "logits_incomplete": corr.counters.logits_incomplete,
        "samples_unresolved": corr.counters.samples_unresolved,
        "sparse_rows_not_captured": counters["sparse_rows_not_captured"],
        "attention_rows_not_counted": counters["attention_rows_not_counted"],
        "sparse_unattributed": corr.counters.sparse_unattributed,
        "sparse_unmapped_rows": corr.problems.unmapped_rows,
        "slot_tokens_unresolved": corr.counters.slot_tokens_unresolved,
        "samples_before_first_step": corr.counters.samples_before_first_step,
        "sparse_before_first_step": corr.counters.sparse_before_first_step,
        "program_misses": counters["program_misses"],
        # layer times (layer_times table): probe points the probes could not time (a thread index
        # past the record's thread slots), and timed steps that never reached the steps table
        "layer_points_lost": corr.layer_clock.lost_points,
        "layer_times_unjoined": corr.layer_clock.unjoined,
    }


def head_in_probes(counters: dict[str, int], corr: Correlator, rate: float) -> dict[str, Any]:
    """Head sampling done in the probes at `rate` (session/policy.py PolicyChoice.head_in_probes): their draws
    and the logits rows they did not copy, by design (not losses)."""
    return {
        "rate": rate,
        "keep_below": probe_keep_below(rate),
        "draws": {"kept": corr.counters.head_draws_kept, "dropped": corr.counters.head_draws_dropped},
        "logits_rows_not_copied": counters.get("head_logits_not_copied", 0),
        # rows copied because their decode's outputs drew both keep and drop (a server's decode
        # over several slots): the probes cannot tell which output a sampler reads
        "logits_rows_copied_mixed": counters.get("head_logits_copied_mixed", 0),
        # routes rows of dropped requests counted and never made (from the draw on; with no
        # sink reading routes rows): in policy.rows_dropped too
        "routes_rows_not_made": corr.routes.rows_head_dropped_total,
        # token and steps rows of dropped requests set apart, counted by the aggregates, given
        # to the sinks as frames of the columns they read, and dropped, never framed whole nor
        # held (when no live view, GPU capture or masks read those rows): in policy.rows_dropped too
        "rows_set_apart": dict(corr.rows_set_apart),
    }


def outcome(a: Attached, opts: Options, corr: Correlator) -> dict[str, Any]:
    """What the correlator verified and saw, for meta.json at close."""
    return {
        "serving": serving_meta(corr, a, opts),
        "verification": {
            "verified_ubatches": corr.counters.verified_ubatches,
            "verified_decodes": corr.counters.verified_decodes,
            "verified_routing": corr.counters.verified_sparse,
            "verified_task_posts": corr.server_check.posts_verified,
            "verified_slot_launches": corr.server_check.launches_verified,
        },
        "layer_coverage": coverage(a.layers, corr.layers_seen, opts.capture),
        # --act-every: decode steps whose activations were not counted, by design (not a loss)
        "act_sampling": {"every": opts.capture.act_every, "steps_not_counted": corr.counters.act_sampled_out},
        "attention_masks": corr.attn_map.meta() if opts.capture.attention else None,
    }


def summary_line(meta: dict[str, Any]) -> str:
    losses = meta.get("losses", {})
    return (
        f"sparseety-prof: {meta['counts']['tokens']} tokens, {meta['counts']['steps']} steps; "
        f"losses: {losses.get('kernel_drops', 0)} dropped in kernel, "
        f"{losses.get('seq_gaps', 0)} sequence gaps, "
        f"{losses.get('logits_incomplete', 0)} incomplete logits, "
        f"{losses.get('samples_unresolved', 0)} unresolved samples; "
        f"{_head_part(meta)}"
        f"profiler CPU {meta['profiler_cpu_s']:.2f}s "
        f"(BPF compile {meta['bpf_compile_s']:.2f}s); stopped: {meta['stop_reason']}"
    )


def _head_part(meta: dict[str, Any]) -> str:
    """What head sampling in the probes kept, for the summary line ("" without it)."""
    head = (meta.get("policy") or {}).get("head_in_probes")
    if not head:
        return ""
    draws = head.get("draws", {})
    kept, dropped = draws.get("kept", 0), draws.get("dropped", 0)
    return (
        f"head sampling in the probes: {kept} of {kept + dropped} requests drawn kept, "
        f"{head.get('logits_rows_not_copied', 0)} logits rows not copied; "
    )
