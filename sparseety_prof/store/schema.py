"""Single source of truth for every column name and dtype the profiler writes.

Recordings store these tables as Parquet segments; `sparseety_prof.open()` returns them as Polars
frames with exactly these schemas. A producer names the columns it fills through `columns()` (checked
when its module is imported), and `frame()` refuses a table whose columns are not exactly the
schema's: a misspelt or forgotten column is an error, never a column of nulls.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import polars as pl

SCHEMA_VERSION = 3

#: One row per token the sampler returned (EOS included).
TOKENS: dict[str, pl.DataType] = {
    "request_id": pl.String(),  # segmented request ("r<ctx>-<seq>-<n>") or, later, the HTTP id
    "ctx_id": pl.Int32(),  # engine context ordinal within the process (draft/embedding ctxs differ)
    "seq_id": pl.Int32(),  # llama.cpp sequence id of the logits row
    "decode_order": pl.Int32(),  # 0 = first generated token of the request; null when partial
    "pos": pl.Int32(),  # position the sampled token will occupy (logits_pos + 1)
    "logits_pos": pl.Int32(),  # position of the row whose logits produced it
    "phase": pl.String(),  # "prefill" (sampled from a prompt step) or "decode"
    "token_id": pl.Int32(),
    "token_text": pl.String(),  # from the GGUF vocabulary; null with --redact-text
    "token_source": pl.String(),  # "sampler" (sampler return value) or "next_input"
    "log_prob": pl.Float64(),  # log-softmax of the raw logits row (before temperature/penalties)
    "top_ids": pl.List(pl.Int32()),
    "top_log_probs": pl.List(pl.Float32()),
    "entropy": pl.Float32(),  # of softmax(raw logits), nats
    "step_id": pl.Int64(),  # the micro-batch (steps table) whose logits produced the token
    "t_start_ns": pl.Int64(),  # CLOCK_MONOTONIC, step start
    "t_end_ns": pl.Int64(),  # CLOCK_MONOTONIC, step end
    "ts_unix_ms": pl.Int64(),  # wall clock of t_end_ns
    "batch_size": pl.Int32(),  # tokens in that micro-batch
    "partial": pl.Boolean(),  # request already running when the profiler attached
    "pid": pl.Int32(),
    "tid": pl.Int32(),  # thread that called the sampler
    # ---- sparse decisions of the step, for the token's logits_pos row (null when not captured).
    # Lists are layer-major; meta.json's "layers" says which model layers each list covers.
    "expert_ids": pl.List(pl.List(pl.Int32())),  # per MoE layer: the engine's selected experts, its order
    "expert_weights": pl.List(pl.List(pl.Float32())),  # per MoE layer: gate weights as applied
    "router_probs": pl.List(pl.List(pl.Float32())),  # per MoE layer, all experts (--capture-router-probs)
    "act_zero_ratio": pl.List(pl.Float32()),  # per FFN layer: exact zeros / activation values
    "act_below_ratio": pl.List(pl.Float32()),  # per FFN layer: |x| < meta act_threshold / values
    "attn_attended": pl.List(pl.Int32()),  # per attention layer: unmasked cells in the mask row
    "attn_total": pl.Int32(),  # positions of the sequence so far (logits_pos + 1)
    "kv_cells_used": pl.Int32(),  # cells of the sequence visible to full attention (max attended)
    # ---- the step's slowest layer (layer_times: the largest dur_ns of the step on any thread);
    # null where the step's layer times were not captured (a capture without the aggregate
    # record: docs/recording-format.md, layer_times)
    "slowest_layer": pl.Int32(),  # model layer
    "slowest_layer_ms": pl.Float64(),  # its dur_ns, in ms
    "slowest_tid": pl.Int32(),  # the engine thread (OS thread id) it was measured on
}

#: One row per micro-batch (one forward pass, `llama_context::process_ubatch`).
STEPS: dict[str, pl.DataType] = {
    "step_id": pl.Int64(),
    "ctx_id": pl.Int32(),
    "decode_id": pl.Int64(),  # the decode call (llama_decode) this micro-batch belongs to
    "t_start_ns": pl.Int64(),
    "t_end_ns": pl.Int64(),
    "ts_unix_ms": pl.Int64(),  # wall clock of t_start_ns
    "n_tokens": pl.Int32(),
    "n_outputs": pl.Int32(),  # rows that produce logits
    "phase": pl.String(),  # "prefill" if it holds more than one token of some sequence
    "prompt_rows": pl.Int32(),  # rows of prompts (or of a request the profiler saw start mid-way)
    "decode_rows": pl.Int32(),  # rows feeding back a token sampled for their sequence
    "seq_ids": pl.List(pl.Int32()),  # distinct sequences in the step (the batch context)
    "token_ids": pl.List(pl.Int32()),  # per row
    "positions": pl.List(pl.Int32()),  # per row
    "row_seq_ids": pl.List(pl.Int32()),  # per row (first seq id of the row)
    "output_rows": pl.List(pl.Int32()),  # row indices that produce logits
    "truncated": pl.Boolean(),  # more rows than the probe copies: only the last ones are listed
    "pid": pl.Int32(),
    "tid": pl.Int32(),
}

#: One row per (micro-batch row, FFN layer) the engine computed, prompt rows included: the long form
#: of the token rows' sparse-decision lists. Join to tokens on (step_id, seq_id, pos = logits_pos).
ROUTES: dict[str, pl.DataType] = {
    "step_id": pl.Int64(),
    "ctx_id": pl.Int32(),
    "seq_id": pl.Int32(),
    "pos": pl.Int32(),  # position of the row (a token row's logits_pos)
    "row": pl.Int32(),  # row index within the micro-batch
    "layer": pl.Int32(),  # model layer (block) index
    "expert_ids": pl.List(pl.Int32()),  # null for a dense FFN layer
    "expert_weights": pl.List(pl.Float32()),
    "router_probs": pl.List(pl.Float32()),  # with --capture-router-probs
    "act_zero_ratio": pl.Float32(),  # over the experts actually run, for MoE layers
    "act_below_ratio": pl.Float32(),
    "act_values": pl.Int32(),  # activation values the ratios are over
}

#: With --capture-masks: the activation zero mask itself, bit-packed (numpy.packbits order, bit set =
#: value non-zero), one row per (micro-batch row, FFN layer), keyed like routes.
MASKS: dict[str, pl.DataType] = {
    "step_id": pl.Int64(),
    "ctx_id": pl.Int32(),
    "seq_id": pl.Int32(),
    "pos": pl.Int32(),
    "row": pl.Int32(),
    "layer": pl.Int32(),
    "n_values": pl.Int32(),  # bits that are meaningful (the mask is padded to whole bytes)
    "nonzero_bits": pl.Binary(),
}

#: One row per (micro-batch, model layer, engine thread) the sparse probes timed: when the
#: thread reached the layer's probe point (its first FFN activation (GLU) node, or the MoE
#: "ffn_moe_weighted" multiply where activations are read there: no probe of its own) and the time
#: since its previous probe point in the step. Per step and thread, with the thread's probe points
#: in time order, sum(dur_ns) + head + tail == steps.t_end_ns - steps.t_start_ns exactly, where the
#: probes' own gaps are head = first t_ns - t_start_ns (graph build, inputs, the first layer up to
#: its probe point) and tail = t_end_ns - last t_ns (the rest of the last layer, the output head,
#: the logits). A layer's interval therefore ends at its own probe point and holds the end of the
#: layer before. Join to steps on step_id.
LAYER_TIMES: dict[str, pl.DataType] = {
    "step_id": pl.Int64(),
    "ctx_id": pl.Int32(),
    "layer": pl.Int32(),  # model layer (block) index
    "thread": pl.Int32(),  # the engine's graph thread index (ggml_compute_params.ith)
    "tid": pl.Int32(),  # its OS thread id
    "t_ns": pl.Int64(),  # CLOCK_MONOTONIC: the thread reached the layer's probe point
    "dur_ns": pl.Int64(),  # since its previous probe point in the step; null for its first (the head gap)
    # after the first thread reached the same probe point: every thread leaves the same barrier
    # before the node, so this is time the thread came late to it (woken late, preempted), not
    # the barrier's wait itself, which the probes do not see
    "lag_ns": pl.Int64(),
}

#: One row per request the profiler saw (HTTP engines: one per client request; other front ends:
#: one per segmented sequence run). Built from the tokens and the request-identity probes.
REQUESTS: dict[str, pl.DataType] = {
    "request_id": pl.String(),  # the client's header value, or a generated "gen-..." id
    "id_source": pl.String(),  # "header", "generated" (HTTP request without the header), "segmented"
    "ctx_id": pl.Int32(),
    "seq_id": pl.Int32(),  # engine sequence the request ran in (llama-server: slot id)
    "slot_id": pl.Int32(),  # server slot (null for non-server front ends)
    "task_id": pl.Int64(),  # server task id (null for non-server front ends)
    "parent_seq_id": pl.Int32(),  # sequence it was forked from (llama_memory_seq_cp), else null
    "t_received_ns": pl.Int64(),  # CLOCK_MONOTONIC: request bytes read from the socket
    "t_started_ns": pl.Int64(),  # slot launch (server) or first step of the sequence
    "t_first_token_ns": pl.Int64(),
    "t_last_token_ns": pl.Int64(),
    "ttft_ms": pl.Float64(),  # first token - received (or - started without a socket read)
    "itl_p50_ms": pl.Float64(),  # inter-token latency over the decode tokens
    "itl_p99_ms": pl.Float64(),
    "prompt_tokens": pl.Int32(),  # prompt rows the engine computed for it (cached prefix excluded)
    "output_tokens": pl.Int32(),
    # "eos", "released" (slot released), "detached", "records_lost" (records were lost after its
    # last token seen: it may have gone on), or null
    "end_reason": pl.String(),
    "partial": pl.Boolean(),  # already running when the profiler attached
    "pid": pl.Int32(),
}

#: GPU path: one row per kernel execution (CUPTI concurrent-kernel activity), joined to its step.
KERNELS: dict[str, pl.DataType] = {
    "step_id": pl.Int64(),  # token step the launch belongs to; null when unjoined
    "join": pl.String(),  # "thread" (exact), "window" (time fallback), "gpu_step", or null
    "join_error_ns": pl.Int64(),  # window join: distance outside the step window (0 inside)
    "pid": pl.Int32(),
    "tid": pl.Int32(),  # launching thread (from the launch API record)
    "device": pl.Int32(),
    "context_id": pl.Int32(),
    "stream_id": pl.Int64(),
    "correlation_id": pl.Int64(),
    "name": pl.String(),  # kernel name as CUPTI reports it (mangled)
    "api": pl.String(),  # launch API: cuLaunchKernel, cudaLaunchKernel, cuGraphLaunch, ...
    "launch_ns": pl.Int64(),  # CLOCK_MONOTONIC: launch API entry on the host
    "start_ns": pl.Int64(),  # CLOCK_MONOTONIC: kernel start on the device (null when CUPTI gave 0)
    "end_ns": pl.Int64(),
    "grid": pl.List(pl.Int32()),  # x, y, z
    "block": pl.List(pl.Int32()),
    "shared_mem_bytes": pl.Int32(),
    "graph_id": pl.Int64(),  # non-null: the kernel ran as a node of a CUDA graph replay
    "graph_node_id": pl.Int64(),
    "buffer_captured": pl.Boolean(),  # a watched argument buffer was copied for this launch
}

#: Always-on aggregates (session/aggregates.py), whatever a policy keeps of the rows: per wall-clock
#: bucket, counts of one metric in bins. Long form, so that a model with many layers and experts
#: costs rows, not columns: (bucket, metric, layer, bin) -> count.
AGGREGATES: dict[str, pl.DataType] = {
    "bucket_unix_ms": pl.Int64(),  # start of the bucket, wall clock (tokens' ts_unix_ms, steps' ts_unix_ms)
    "bucket_s": pl.Int32(),  # its length
    "metric": pl.String(),  # one of AGGREGATE_METRICS
    "layer": pl.Int32(),  # model layer for the per-layer metrics, else null
    "bin": pl.Int32(),  # expert id (expert_load), or the index of the bin in AGGREGATE_EDGES[metric]
    "count": pl.Int64(),
}
#: metric -> what is counted. Token metrics are over the rows that produced a token (tokens table);
#: step_ms over every micro-batch (steps table).
AGGREGATE_METRICS: dict[str, str] = {
    "tokens": "tokens sampled (bin 0)",
    "expert_load": "selections of expert `bin` in `layer` by token rows",
    "act_zero_ratio": "token rows whose exact-zero activation ratio in `layer` falls in bin",
    "act_below_ratio": "token rows whose below-threshold activation ratio in `layer` falls in bin",
    "log_prob": "tokens whose log-prob falls in bin",
    "step_ms": "micro-batches whose duration (ms) falls in bin",
}
#: Histogram bin edges: bin i holds edges[i] <= x < edges[i + 1] (the last bin includes its top
#: edge; values below the first edge go to bin 0, above the last to the last bin).
_RATIO_EDGES = tuple(round(i * 0.05, 2) for i in range(21))
AGGREGATE_EDGES: dict[str, tuple[float, ...]] = {
    "act_zero_ratio": _RATIO_EDGES,
    "act_below_ratio": _RATIO_EDGES,
    "log_prob": (
        -50.0,
        -20.0,
        -15.0,
        -10.0,
        -8.0,
        -6.0,
        -5.0,
        -4.0,
        -3.0,
        -2.0,
        -1.5,
        -1.0,
        -0.5,
        -0.25,
        -0.1,
        -0.01,
        0.0,
    ),
    "step_ms": (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0, 1e9),
}

#: The CPU sampler (capture/cpu_sampler.py, session/cpu_profile.py): per step and engine thread,
#: how many samples each folded stack got. Rows are bounded by the samples (the rate times the
#: engine's busy CPU time): each row holds one sample or more. Samples between steps are grouped
#: per thread and stack over each drain.
CPU_STACKS: dict[str, pl.DataType] = {
    "step_id": pl.Int64(),  # the step the samples fell in; null outside a recorded step
    # "prompt" (prompt rows only), "decode" (decode rows only), "mixed", "between_steps" (no step
    # running), "unrecorded_step" (a step whose rows the policy did not keep)
    "step_kind": pl.String(),
    "phase": pl.String(),  # the step's phase (steps.phase); null outside a recorded step
    "ctx_id": pl.Int32(),  # the step's engine context; null outside a recorded step
    "pid": pl.Int32(),
    "tid": pl.Int32(),  # the sampled thread
    "in_kernel": pl.Boolean(),  # the CPU was in the kernel for the thread (the stack ends "[kernel]")
    "stack": pl.String(),  # folded: frame names root first, joined by ";" (meta cpu_sampler.files)
    "samples": pl.Int64(),
    "t_first_ns": pl.Int64(),  # CLOCK_MONOTONIC: the first of these samples
}

#: Per-operator tracing (`record --trace-ops`: capture/op_trace.py, session/op_times.py): one row
#: per graph node the CPU backend computed, per engine thread, in the steps that ran whole inside
#: a tracing window (the probes are in for a window every period).
OP_TIMES: dict[str, pl.DataType] = {
    "step_id": pl.Int64(),
    "ctx_id": pl.Int32(),
    "tid": pl.Int32(),  # the engine thread
    "thread": pl.Int32(),  # its index in the graph (ggml_compute_params.ith)
    "node": pl.Int32(),  # the node's order among the nodes the thread computed in the step
    # ggml's operator name (GGML_OP_NAME), or "op N" where it was not read; "RMS_NORM+MUL": the
    # node and the MUL after it, computed by ggml-cpu as one (the MUL has no row of its own)
    "op": pl.String(),
    "name": pl.String(),  # the node's tensor name ("ffn_moe_gate-3")
    "layer": pl.Int32(),  # from the name's "-N" suffix; null for a node of no layer
    "t_start_ns": pl.Int64(),  # CLOCK_MONOTONIC: the thread entered the node
    # to the thread's next node entry, or to the end of the graph (its wait at the barrier after
    # the node included)
    "dur_ns": pl.Int64(),
}

#: Who took the CPU (capture/sched_waits.py, session/thread_waits.py; off with --no-sched-waits):
#: one row per (step, engine thread that was on CPU, runnable or stopped during it), from the
#: scheduler's tracepoints: where the thread's time went between the step's start and end.
THREAD_WAITS: dict[str, pl.DataType] = {
    "step_id": pl.Int64(),
    "pid": pl.Int32(),
    "tid": pl.Int32(),  # the engine thread
    "step_thread": pl.Boolean(),  # the thread that ran the step (the steps row's tid)
    "on_cpu_ns": pl.Int64(),
    "runnable_ns": pl.Int64(),  # runnable, waiting for a CPU (preempted, or woken and not yet run)
    "sleep_ns": pl.Int64(),  # waiting for something else (a lock, a condition, I/O)
    "stopped_ns": pl.Int64(),  # stopped by a signal (SIGSTOP, SIGTSTP) or a tracer
    # of runnable_ns, by who ran on the CPU just before the thread got it back:
    "waited_recorder_ns": pl.Int64(),  # the recorder's threads (the profiler's own share)
    "waited_engine_ns": pl.Int64(),  # another thread of the engine
    "waited_other_ns": pl.Int64(),  # another process, or an idle CPU (a wakeup's latency)
    "top_pid": pl.Int32(),  # the process that held the CPU longest while the thread waited; null: none
    "top_comm": pl.String(),  # its thread's name, as that process set it (escape before printing)
    "top_ns": pl.Int64(),  # how long the thread waited for it in the step
}

TABLES: dict[str, dict[str, pl.DataType]] = {
    "tokens": TOKENS,
    "steps": STEPS,
    "routes": ROUTES,
    "masks": MASKS,
    "layer_times": LAYER_TIMES,
    "requests": REQUESTS,
    "kernels": KERNELS,
    "aggregates": AGGREGATES,
    "cpu_stacks": CPU_STACKS,
    "op_times": OP_TIMES,
    "thread_waits": THREAD_WAITS,
}

#: Datasets (`collect`, store/dataset.py): every table of many recordings as one Hive-partitioned
#: Parquet dataset. Each file holds a table's columns plus DATASET_COLUMNS; the partition columns are
#: the folder names (host=../date=../engine=../model=..), not stored in the files.
RECORDING_ID = "recording_id"
DATASET_COLUMNS: dict[str, pl.DataType] = {
    RECORDING_ID: pl.String(),  # which recording the row came from (the manifest's "id")
}
#: The partition keys, outermost first: the host the recording was made on, the UTC date it started,
#: the engine's name and the model's name, all from its meta.json (sanitised: store/dataset_partition.py).
DATASET_PARTITIONS: tuple[str, ...] = ("host", "date", "engine", "model")
for _name in (*DATASET_COLUMNS, *DATASET_PARTITIONS):
    if any(_name in _t for _t in TABLES.values()):  # pragma: no cover - guards against a clash
        raise ImportError(f"schema: dataset column {_name!r} is also a column of a recording table")


def dataset_table(table: str) -> dict[str, pl.DataType]:
    """The columns and dtypes of `table` in a dataset's files: DATASET_COLUMNS, then the table's."""
    return {**DATASET_COLUMNS, **TABLES[table]}


#: What each redaction level (`--redact LEVEL`, store/redaction_levels.py) does to which columns:
#: "null" columns are stored as nulls (the column stays, the schema is unchanged), "coarsen" columns
#: keep their values rounded to REDACT_SPARSITY_STEP. The text column (--redact-text) is separate.
REDACT_NULL: dict[str, dict[str, tuple[str, ...]]] = {
    # token ids are the text to anyone with the model's vocabulary
    "ids": {"tokens": ("token_id", "token_text", "top_ids"), "steps": ("token_ids",)},
    # per-token expert choices: the MoE side channel (aggregate expert load stays in meta.json)
    "routing": {
        "tokens": ("expert_ids", "expert_weights", "router_probs"),
        "routes": ("expert_ids", "expert_weights", "router_probs"),
    },
    "masks": {"masks": ("nonzero_bits",)},
}
REDACT_COARSEN: dict[str, dict[str, tuple[str, ...]]] = {
    "sparsity": {
        "tokens": ("act_zero_ratio", "act_below_ratio"),
        "routes": ("act_zero_ratio", "act_below_ratio"),
    },
}
REDACT_LEVELS: tuple[str, ...] = ("ids", "routing", "sparsity", "masks")
#: Levels that `--redact-layers` can limit to some layers (token ids belong to no layer).
REDACT_PER_LAYER: tuple[str, ...] = ("routing", "sparsity", "masks")
#: Which kind of layer each per-layer list of the tokens table covers (meta.json "layers"[kind]).
TOKEN_LIST_LAYERS: dict[str, str] = {
    "expert_ids": "moe",
    "expert_weights": "moe",
    "router_probs": "moe",
    "act_zero_ratio": "ffn",
    "act_below_ratio": "ffn",
    "attn_attended": "attn",
}
#: grid the ratios of the "sparsity" level are rounded to (ten bins: enough for a sparsity profile)
REDACT_SPARSITY_STEP = 0.1
for _levels in (REDACT_NULL, REDACT_COARSEN):
    for _level, _tables in _levels.items():
        for _table, _names in _tables.items():
            if _level not in REDACT_LEVELS or any(n not in TABLES[_table] for n in _names):
                raise ImportError(f"schema: redaction level {_level!r} names unknown columns of {_table}")
if any(c not in TOKENS for c in TOKEN_LIST_LAYERS):  # pragma: no cover - guards against a rename
    raise ImportError("schema: TOKEN_LIST_LAYERS names a column the tokens table lacks")

PHASE_PREFILL = "prefill"
PHASE_DECODE = "decode"
SOURCE_SAMPLER = "sampler"
SOURCE_NEXT_INPUT = "next_input"
TOP_K = 5


#: One table's rows as columns: column name -> one value per row.
Columns = dict[str, list[object]]
#: What a correlator hands over: table name -> its rows since the last call, every column present.
Tables = dict[str, Columns]
#: The same, where a table's rows may also be store/array_rows.py's RowParts (column lists and
#: numpy arrays, read as columns the same way): the CPU correlator's tables.
RowTables = dict[str, Mapping[str, list[object]]]


def empty(table: str) -> pl.DataFrame:
    return pl.DataFrame(schema=TABLES[table])


def columns(table: str, *names: str) -> tuple[str, ...]:
    """`names`, each checked to be a column of `table`. Producers declare the columns they fill
    with it, so a misspelt name fails when their module is imported."""
    unknown = [n for n in names if n not in TABLES[table]]
    if unknown:
        raise ValueError(f"not columns of the {table} table: {unknown}")
    return names


def check_columns(table: str, names: Iterable[str], *, absent: Collection[str] = ()) -> None:
    """Raise ValueError unless `names` are exactly the columns of `table`, less any of `absent`."""
    want, got = TABLES[table], set(names)
    unknown = sorted(got - want.keys())
    missing = [c for c in want if c not in got and c not in absent]
    bad_absent = sorted(set(absent) - want.keys())
    if unknown or missing or bad_absent:
        problems = [
            f"{what} {cols}"
            for what, cols in (
                ("missing columns", missing),
                ("unknown columns", unknown),
                ("declared absent but not in the table", bad_absent),
            )
            if cols
        ]
        raise ValueError(f"{table} table: " + "; ".join(problems))


def fill_absent(table: str, cols: Columns, absent: Collection[str]) -> Columns:
    """`cols` with a column of nulls for each of `absent` it lacks: the way a producer that does not
    have some of a table's columns says which (the caller documents why). Any other column
    missing, or one not in the table, is a ValueError."""
    check_columns(table, cols, absent=absent)
    n = _n_rows(table, cols)
    return {**cols, **{name: [None] * n for name in absent if name not in cols}}


def frame(table: str, cols: Columns, *, absent: Collection[str] = (), split: bool = True) -> pl.DataFrame:
    """Build a table from column lists, in schema order with schema dtypes. `cols` must hold every
    column of the table, except those named in `absent`, which are null when not given; a missing
    or unknown column is a ValueError naming them."""
    if absent:
        cols = fill_absent(table, cols, absent)
    else:
        check_columns(table, cols)
    schema = TABLES[table]
    n = _n_rows(table, cols)
    fast: dict[str, pl.Series | None] = {}
    ragged_parts: dict[str, _Ragged] = {}
    for name, dtype in schema.items():
        if isinstance(dtype, pl.List):
            got = _regular_list_series(name, cols[name], dtype)
            if got is None and (parts := _ragged_parts(cols[name], dtype)) is not None:
                ragged_parts[name] = parts
            fast[name] = got
    fast.update(_ragged_series(ragged_parts, schema))
    ragged = [k for k, v in fast.items() if v is None and any(x is not None for x in cols[k])]
    if split and ragged and n > _RAGGED_MIN_ROWS:
        by_shape = _frame_by_shape(table, cols, ragged, n)
        if by_shape is not None:
            return by_shape
    out = []
    for name, dtype in schema.items():
        got = fast.get(name)
        out.append(got if got is not None else _plain_series(name, cols[name], dtype))
    return pl.DataFrame(out)


def series(name: str, values: list[Any], dtype: pl.DataType) -> pl.Series:
    """One column from its values, as `frame` makes it (without regrouping ragged rows)."""
    if isinstance(dtype, pl.List):
        got = _regular_list_series(name, values, dtype)
        if got is None and (parts := _ragged_parts(values, dtype)) is not None:
            got = _ragged_series({name: parts}, {name: dtype})[name]
        if got is not None:
            return got
    return _plain_series(name, values, dtype)


def _plain_series(name: str, values: list[Any], dtype: pl.DataType) -> pl.Series:
    n = len(values)
    if n and values[0] is None and values.count(None) == n:
        return null_series(name, dtype, n)
    return pl.Series(name, values, dtype=dtype, strict=False)


def repeated_series(name: str, value: object, dtype: pl.DataType, n: int) -> pl.Series:
    """`value` n times, as `dtype`: one value repeated (a list column of nulls built from Python
    Nones, or by extend_constant, costs in proportion to n; this does not)."""
    return pl.Series(name, [value], dtype=dtype).new_from_index(0, n)


def null_series(name: str, dtype: pl.DataType, n: int) -> pl.Series:
    """n nulls of `dtype` (repeated_series)."""
    return repeated_series(name, None, dtype, n)


def _n_rows(table: str, cols: Columns) -> int:
    lengths = {len(v) for v in cols.values()}
    if len(lengths) > 1:
        raise ValueError(f"{table} table: columns of different lengths {sorted(lengths)}")
    return lengths.pop() if lengths else 0


_RAGGED_MIN_ROWS = 16


def _frame_by_shape(table: str, cols: Columns, ragged: list[str], n: int) -> pl.DataFrame | None:
    """Rows whose list columns have different lengths (a prompt step among one-row decode steps)
    defeat the numpy fast path, and polars' element-by-element construction costs time per
    row and column. Rows are grouped by the lengths of their list values, each group takes the
    fast path, and the groups are put back in the original row order. Few groups (prompt
    chunks) is the common case; with many, this gives up (None) and the caller's frame stands."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in range(n):
        key = tuple(-1 if (v := cols[name][i]) is None else len(v) for name in ragged)  # type: ignore[arg-type]
        groups.setdefault(key, []).append(i)
    if len(groups) > max(4, n // 16):
        return None
    parts = []
    for idx in groups.values():
        sub = {k: [v[i] for i in idx] for k, v in cols.items()}
        parts.append(frame(table, sub, split=False).with_columns(pl.Series("__row", idx, dtype=pl.Int64())))
    return pl.concat(parts).sort("__row").drop("__row")


_NUMPY_OF = {pl.Int32(): np.int32, pl.Int64(): np.int64, pl.Float32(): np.float32, pl.Float64(): np.float64}


def _regular_list_series(name: str, values: list[object], dtype: pl.DataType) -> pl.Series | None:
    """Fast path for list columns whose rows are all lists of one shape (expert ids, per-layer
    ratios, top-k): one numpy conversion instead of polars' element-by-element construction,
    which dominated the consumer's CPU per token. Rows that are None stay null; rows whose items
    are all None (a step whose activations were not counted, --act-every) stay lists of nulls.
    Anything else irregular (ragged, None among values) returns None and takes the general path."""
    leaf: Any = dtype
    depth = 0
    while isinstance(leaf, pl.List):
        leaf = leaf.inner
        depth += 1
    np_type = _NUMPY_OF.get(leaf)
    if np_type is None or not values:
        return None
    valid = [v is not None for v in values]
    if not any(valid):
        return None
    first = values[valid.index(True)]
    if not (isinstance(first, list) and first and first.count(None) == len(first)):
        # (a first row of nulls: the numpy conversion of all rows would fail on it)
        s = _numpy_list_series(name, values, valid, np_type, depth, dtype)
        if s is not None:
            return s
    # rows of nulls among regular rows (or alone: a step whose probes were out, --duty-cycle): the
    # regular rows converted, the rows of nulls put in as one repeated row
    nulls = [isinstance(v, list) and len(v) > 0 and v.count(None) == len(v) for v in values]
    null_rows = [v for v, n in zip(values, nulls, strict=True) if n]
    regular = [ok and not n for n, ok in zip(nulls, valid, strict=True)]
    if not null_rows or len({len(v) for v in null_rows}) > 1:  # type: ignore[arg-type]
        return None
    row_of_nulls = repeated_series(name, null_rows[0], dtype, len(values))
    if all(nulls):
        return row_of_nulls
    if any(regular):
        s = _numpy_list_series(name, values, regular, np_type, depth, dtype)
        if s is None:
            return None
    else:
        s = null_series(name, dtype, len(values))
    return pl.select(pl.when(pl.Series(nulls)).then(row_of_nulls).otherwise(s).alias(name)).to_series()


@dataclass(frozen=True)
class _Ragged:
    """A ragged list column's values flattened: what `_ragged_series` slices back into rows."""

    flat: np.ndarray  # every row's values, one after the other
    lens: np.ndarray  # per row, how many (0 for a null row)
    nulls: list[bool] | None  # per row, whether it is null (None: no null row)


def _ragged_parts(values: list[object], dtype: pl.DataType) -> _Ragged | None:
    """Fast path for lists of numbers of different lengths (the steps table's per-row lists: one
    value for a decode step, one per row for a prompt), None rows null: the values flattened into
    one numpy array, each row later sliced out of it by polars (`_ragged_series`), instead of
    polars' element-by-element construction, whose cost grows with every row. Lists of lists,
    and None among a row's values, return None (the general path)."""
    inner: Any = dtype.inner if isinstance(dtype, pl.List) else None
    np_type = _NUMPY_OF.get(inner)
    if np_type is None or not values:
        return None
    nulls = [v is None for v in values]
    any_null = any(nulls)
    if any_null and all(nulls):
        return None  # a column of nulls: cheap on the general path
    rows = [() if v is None else v for v in values] if any_null else values
    if not all(type(v) is list or type(v) is tuple for v in rows):
        return None
    try:
        lens = np.fromiter(map(len, rows), np.int64, count=len(rows))  # type: ignore[arg-type]
        flat: Any = np.fromiter(chain.from_iterable(rows), np_type, count=int(lens.sum()))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None  # None or something not a number among the values
    if flat.dtype.kind == "f" and np.isnan(flat).any():
        return None  # numpy reads None as NaN into floats: let polars keep it null
    return _Ragged(flat, lens, nulls if any_null else None)


def _ragged_series(parts: Mapping[str, _Ragged], dtypes: Mapping[str, pl.DataType]) -> dict[str, pl.Series]:
    """The ragged columns of one frame, each sliced back into its rows, all in ONE query: a query
    has a fixed cost (planning, its threads) that a small frame, a journal's drain of rows,
    would otherwise pay once per ragged column."""
    if not parts:
        return {}
    offsets: dict[str, np.ndarray] = {}
    exprs = []
    for i, (name, p) in enumerate(parts.items()):
        offsets[f"s{i}"], offsets[f"n{i}"] = np.cumsum(p.lens) - p.lens, p.lens
        whole = pl.Series(name, p.flat).implode()
        sliced = pl.lit(whole).first().list.slice(pl.col(f"s{i}"), pl.col(f"n{i}"))
        if p.nulls is not None:
            sliced = pl.when(pl.Series(p.nulls)).then(None).otherwise(sliced)
        exprs.append(sliced.cast(dtypes[name]).alias(name))
    got = pl.DataFrame(offsets).select_seq(exprs)
    return {name: got.get_column(name) for name in parts}


def _numpy_list_series(
    name: str, values: list[object], take: list[bool], np_type: Any, depth: int, dtype: pl.DataType
) -> pl.Series | None:
    """The rows marked in `take` through one numpy array (the others null), or None when they
    are not all lists of one shape of numbers."""
    template = next(v for v, t in zip(values, take, strict=True) if t)
    rows = values if all(take) else [v if t else template for v, t in zip(values, take, strict=True)]
    try:
        arr = np.array(rows, dtype=np_type)
    except (ValueError, TypeError):
        return None  # ragged, or None inside a row
    if arr.ndim != depth + 1 or 0 in arr.shape[1:]:
        return None
    if arr.dtype.kind == "f" and np.isnan(arr).any():
        return None  # numpy turns None inside a row into NaN: let polars keep it null
    s = pl.Series(name, arr.reshape(-1)).reshape(arr.shape).cast(dtype)
    if not all(take):
        s = pl.select(pl.when(pl.Series(take)).then(s).alias(name)).to_series()
    return s


#: What `Recording.anomalies()` returns (store/anomalies/): one row per anomaly a detector found. Not
#: a stored table: it is computed from the tokens and steps tables whenever it is asked for.
ANOMALIES: dict[str, pl.DataType] = {
    "kind": pl.String(),  # one of ANOMALY_KINDS
    "score": pl.Float64(),  # how far past the detector's threshold (each detector says its unit)
    "request_id": pl.String(),  # null for recording-wide findings (load imbalance)
    "seq_id": pl.Int32(),
    "decode_order": pl.Int32(),  # first token of the anomaly (null: recording-wide, or partial)
    "decode_order_end": pl.Int32(),  # last token of it (= decode_order for a single token)
    "step_id": pl.Int64(),  # the step of its first token
    "layer": pl.Int32(),  # model layer, for per-layer detectors; else null
    "reason": pl.String(),  # one sentence a person can read
}
ANOMALY_KINDS: tuple[str, ...] = (
    "repetition_loop",
    "logprob_collapse",
    "routing_collapse",
    "routing_jump",
    "sparsity_spike",
    "attention_collapse",
    "slow_step",
    "load_imbalance",
)
