"""The tables the correlator fills: their columns, named through the schema (a misspelt name
fails when this module is imported), and RowBuffer, which keeps a table's rows as tuples until
they are taken as columns."""

from __future__ import annotations

from collections.abc import Iterable

from sparseety_prof.store import schema

#: a token row's sparse decisions for its logits row (null when not captured)
SPARSE_TOKEN_COLUMNS = schema.columns(
    "tokens",
    "expert_ids",
    "expert_weights",
    "router_probs",
    "act_zero_ratio",
    "act_below_ratio",
    "attn_attended",
    "kv_cells_used",
)
NO_SPARSE_VALUES: tuple[object, ...] = (None,) * len(SPARSE_TOKEN_COLUMNS)
#: of those, the attention's (RequestTokens._attention_values)
ATTENTION_COLUMNS = SPARSE_TOKEN_COLUMNS[5:]
#: a token row as it is emitted, one tuple per token in this order
TOKEN_ROW = schema.columns(
    "tokens",
    "request_id",
    "ctx_id",
    "seq_id",
    "decode_order",
    "pos",
    "logits_pos",
    "phase",
    "token_id",
    "token_source",
    "step_id",
    "t_start_ns",
    "t_end_ns",
    "ts_unix_ms",
    "batch_size",
    "partial",
    "pid",
    "tid",
    "attn_total",
    *SPARSE_TOKEN_COLUMNS,
)
#: the logits row's statistics, computed for a whole drain when the rows are taken
TOKEN_STATS = schema.columns("tokens", "log_prob", "top_ids", "top_log_probs", "entropy")
(TOKEN_TEXT,) = schema.columns("tokens", "token_text")
#: the step's slowest layer, filled when the rows are taken (layer_times.LayerClock.slowest)
TOKEN_SLOWEST = schema.columns("tokens", "slowest_layer", "slowest_layer_ms", "slowest_tid")
schema.check_columns("tokens", (*TOKEN_ROW, *TOKEN_STATS, TOKEN_TEXT, *TOKEN_SLOWEST))

#: a steps row as it is emitted (StepsTable.add_values), one tuple per micro-batch in this order
STEP_ROW = schema.columns(
    "steps",
    "step_id",
    "ctx_id",
    "decode_id",
    "t_start_ns",
    "t_end_ns",
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
    "pid",
    "tid",
)
schema.check_columns("steps", STEP_ROW)
MASK_ROW = tuple(schema.MASKS)
REQUEST_ROW = tuple(schema.REQUESTS)

#: a routes row: the batch row it is about, the layer, and the layer's values; the value columns
#: are also the keys of StepSparse.row_values' per-layer lists
ROUTE_KEYS = schema.columns("routes", "step_id", "ctx_id", "seq_id", "pos", "row")
(ROUTE_LAYER,) = schema.columns("routes", "layer")
ROUTE_VALUES = schema.columns(
    "routes",
    "expert_ids",
    "expert_weights",
    "router_probs",
    "act_zero_ratio",
    "act_below_ratio",
    "act_values",
)
ROUTE_ROW = (*ROUTE_KEYS, ROUTE_LAYER, *ROUTE_VALUES)
schema.check_columns("routes", ROUTE_ROW)


class RowBuffer:
    """Rows of one table, kept as tuples in the order of `names` and made into columns when
    taken: one list append per row instead of one dict lookup and append per column (~45 per
    token for the token and step rows)."""

    __slots__ = ("names", "rows")

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.rows: list[tuple[object, ...]] = []

    def add(self, **row: object) -> None:
        """A row by column name: every column, in the buffer's order."""
        if tuple(row) != self.names:
            raise ValueError(f"row with columns {list(row)}, expected {list(self.names)}")
        self.rows.append(tuple(row.values()))

    def add_values(self, values: tuple[object, ...]) -> None:
        """A row as its values, in the buffer's column order (checked when taken)."""
        self.rows.append(values)

    def extend_values(self, rows: Iterable[tuple[object, ...]]) -> None:
        """Rows as their values (zip over columns: no Python call per row)."""
        self.rows.extend(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def take(self) -> schema.Columns:
        """The rows so far as columns (every column, empty lists without rows); the buffer is
        empty afterwards."""
        rows, self.rows = self.rows, []
        if not rows:
            return {name: [] for name in self.names}
        return {name: list(col) for name, col in zip(self.names, zip(*rows, strict=True), strict=True)}
