"""The rows the kernel correlator emits: `kernels`, `routes` of watched top-k buffers, and the
`steps` of GPU-side step closes, as the columns of the schema's tables; and `summarize`, per-step
GPU busy time of a kernels frame."""

from __future__ import annotations

import array
import sys
from typing import TYPE_CHECKING

from sparseety_prof.gpu.records import KernelActivity, LaunchApi, WatchedBuffer
from sparseety_prof.store import schema

if TYPE_CHECKING:
    import polars as pl

_ID_CODES = {"int32": "i", "uint32": "I", "int64": "q"}  # vLLM's top-k kernels write any of the three
_ID_MIN, _ID_MAX = -(2**31), 2**31 - 1  # routes.expert_ids is Int32: anything else is not an expert id

# The GPU sees kernels and buffers, not batches. Its routes rows have no sequence, position, gate
# weights or activation values; its steps (closed by a device-to-host copy) no batch contents.
# Those columns stay null.
ROUTES_COLUMNS = schema.columns("routes", "step_id", "row", "layer", "expert_ids")
ROUTES_ABSENT = schema.columns(
    "routes",
    "ctx_id",
    "seq_id",
    "pos",
    "expert_weights",
    "router_probs",
    "act_zero_ratio",
    "act_below_ratio",
    "act_values",
)
STEPS_COLUMNS = schema.columns("steps", "step_id", "t_start_ns", "t_end_ns", "pid", "tid")
STEPS_ABSENT = schema.columns(
    "steps",
    "ctx_id",
    "decode_id",
    "ts_unix_ms",
    "n_tokens",
    "n_outputs",
    "phase",
    "prompt_rows",
    "decode_rows",
    "seq_ids",
    "token_ids",
    "positions",
    "row_seq_ids",
    "output_rows",
    "truncated",
)
schema.check_columns("routes", ROUTES_COLUMNS, absent=ROUTES_ABSENT)
schema.check_columns("steps", STEPS_COLUMNS, absent=STEPS_ABSENT)
# kernel rows list their values in schema order (add_kernel)
_KERNEL_ORDER = schema.columns(
    "kernels",
    "step_id",
    "join",
    "join_error_ns",
    "pid",
    "tid",
    "device",
    "context_id",
    "stream_id",
    "correlation_id",
    "name",
    "api",
    "launch_ns",
    "start_ns",
    "end_ns",
    "grid",
    "block",
    "shared_mem_bytes",
    "graph_id",
    "graph_node_id",
    "buffer_captured",
)
schema.check_columns("kernels", _KERNEL_ORDER)


def gpu_step_id(n: int) -> int:
    """`step_id` of GPU step `n` (0, 1, ...): negative, so it never collides with uprobe steps."""
    return -1 - n


def gpu_step_index(step_id: int) -> int:
    """Inverse of `gpu_step_id`."""
    return -1 - step_id


class KernelRows:
    """The column lists of one flush."""

    def __init__(self, route_columns: int | None = None) -> None:
        # keep the first `route_columns` ids of each row (llama.cpp's rows hold every expert,
        # ranked: gpu/llamacpp_kernels.py); None keeps the row whole
        self.route_columns = route_columns
        self.kernels: schema.Columns = {c: [] for c in _KERNEL_ORDER}
        self.routes: schema.Columns = {c: [] for c in ROUTES_COLUMNS}
        self.steps: schema.Columns = {c: [] for c in STEPS_COLUMNS}

    def tables(self) -> schema.Tables:
        """Every column of each table; kernels in device order (start, then launch time)."""
        return {
            "kernels": _sorted(self.kernels, ("start_ns", "launch_ns", "correlation_id")),
            "routes": schema.fill_absent("routes", self.routes, ROUTES_ABSENT),
            "steps": schema.fill_absent("steps", self.steps, STEPS_ABSENT),
        }

    def add_kernel(
        self,
        k: KernelActivity,
        start: int | None,
        end: int | None,
        launch: LaunchApi | None,
        step_id: int | None,
        join: str | None,
        error: int | None,
        pid: int | None,
        captured: bool,
    ) -> None:
        values = (  # in _KERNEL_ORDER
            step_id,
            join,
            error,
            pid or None,
            launch.tid if launch is not None else None,
            k.device,
            k.context_id,
            k.stream_id,
            k.correlation_id,
            k.name,
            launch.api if launch is not None else None,
            launch.enter_ns if launch is not None else None,
            start,
            end,
            list(k.grid),
            list(k.block),
            k.shared_mem_bytes,
            k.graph_id or None,
            k.graph_node_id or None,
            captured,
        )
        for col, v in zip(self.kernels.values(), values, strict=True):
            col.append(v)

    def add_step(
        self, step_id: int, t_start: int | None, t_end: int, pid: int | None, tid: int | None
    ) -> None:
        for col, v in zip(self.steps.values(), (step_id, t_start, t_end, pid, tid), strict=True):
            col.append(v)

    def add_routes(self, ready: list[tuple[int, WatchedBuffer]]) -> int:
        """Routes rows of the watched buffers whose step is settled. The layer is the buffer's
        launch ordinal among those of the same (kernel, argument) in its step. Returns how many
        id buffers were malformed (and skipped)."""
        # chronological steps (GPU step ids count down), then one group per watch, in launch order
        ready.sort(
            key=lambda sw: (
                sw[0] if sw[0] >= 0 else gpu_step_index(sw[0]),
                sw[1].kernel,
                sw[1].arg_index,
                sw[1].correlation_id,
                sw[1].graph_node_id,  # one graph replay: its nodes in capture order
            )
        )
        malformed = 0
        layer = 0
        group: tuple[int, str, int] | None = None
        r = self.routes
        for step_id, w in ready:
            g = (step_id, w.kernel, w.arg_index)
            layer = layer + 1 if g == group else 0
            group = g
            ids = _decode_ids(w)
            if ids is None:
                if w.dtype in _ID_CODES:
                    malformed += 1
                continue
            n_rows, k = w.shape
            keep = min(k, self.route_columns) if self.route_columns else k
            for i in range(n_rows):
                r["step_id"].append(step_id)
                r["row"].append(i)
                r["layer"].append(layer)
                r["expert_ids"].append(ids[i * k : i * k + keep])
        return malformed


def _sorted(cols: schema.Columns, keys: tuple[str, ...]) -> schema.Columns:
    """Rows ordered by `keys`, nulls last in each (Python's sort is stable: ties keep their order)."""
    n = len(cols[keys[0]])
    if n < 2:
        return cols
    key_cols = [cols[k] for k in keys]
    order = sorted(range(n), key=lambda i: tuple((v is None, v or 0) for v in (c[i] for c in key_cols)))
    return {name: [col[i] for i in order] for name, col in cols.items()}


def _decode_ids(w: WatchedBuffer) -> list[int] | None:
    """The ids of a 2-D int32/uint32/int64 buffer, row-major; None when it is not one, or is
    malformed: the wrong size, or an id outside Int32 (a rule that reads the wrong buffer)."""
    code = _ID_CODES.get(w.dtype)
    if code is None or len(w.shape) != 2:
        return None
    a = array.array(code)
    if len(w.data) != w.shape[0] * w.shape[1] * a.itemsize:
        return None
    a.frombytes(w.data)
    if sys.byteorder == "big":
        a.byteswap()  # CUDA devices and their hosts are little-endian
    ids = a.tolist()
    if ids and (min(ids) < _ID_MIN or max(ids) > _ID_MAX):
        return None
    return ids


def summarize(kernels: pl.DataFrame) -> pl.DataFrame:
    """Per step of a `kernels` frame: kernel count, GPU busy time (union of the kernel intervals,
    so overlapping streams are not counted twice), first start and last end. Unjoined kernels form
    the null step; kernels without timestamps count but add no busy time."""
    import polars as pl

    step, start, end = pl.col("step_id"), pl.col("start_ns"), pl.col("end_ns")
    prev_end = end.cum_max().shift(1).over("step_id")
    busy = (end - pl.max_horizontal(start, prev_end)).clip(lower_bound=0)
    return (
        kernels.sort(["step_id", "start_ns"], nulls_last=True)
        .with_columns(busy.alias("_busy"))
        .group_by(step, maintain_order=True)
        .agg(
            pl.len().cast(pl.Int64).alias("kernels"),
            pl.col("_busy").sum().cast(pl.Int64).alias("busy_ns"),
            start.min().alias("first_start_ns"),
            end.max().alias("last_end_ns"),
        )
    )
