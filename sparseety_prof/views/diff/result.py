"""The result of a diff: plain frozen dataclasses, so that rendering and JSON need nothing else.

A statistic of a column that is not comparable is None; "where the largest difference is" is None
when that difference is 0."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Layer kinds of the per-layer list columns, as named in meta.json's "layers".
MOE, FFN, ATTN = "moe", "ffn", "attn"
KIND_NAMES = {MOE: "MoE layer", FFN: "FFN layer", ATTN: "attention layer"}

#: First-difference kinds, in the order they win at the same decode_order (causes before effects).
KINDS = ("attn", "routing", "weights", "act_zero_ratio", "log_prob", "token", "length")


@dataclass(frozen=True)
class Tolerances:
    logprob: float = 1e-3  # |Δ log_prob| above this is a difference
    weight: float = 1e-5  # |Δ gate weight| of an expert both runs selected
    ratio: float = 0.0  # |Δ act_zero_ratio| of a layer


@dataclass(frozen=True)
class LayerRef:
    index: int  # position in the per-layer list (A's, when layers are matched by model layer)
    layer: int | None  # model layer (block) index, when the recording's meta names it

    def label(self, kind: str) -> str:
        name = KIND_NAMES.get(kind, kind)
        return f"{name} {self.layer}" if self.layer is not None else f"{name} #{self.index}"


@dataclass(frozen=True)
class Where:
    pair: int  # index of the request pair (0 = earliest first token)
    decode_order: int
    layer: LayerRef | None = None


@dataclass(frozen=True)
class TokenRef:
    token_id: int | None
    text: str | None  # null when the recording was made with --redact-text
    log_prob: float | None


@dataclass(frozen=True)
class ContextRow:
    decode_order: int
    a: TokenRef | None  # None: no such token in that run (ended, or the row was lost)
    b: TokenRef | None


@dataclass(frozen=True)
class SideSummary:
    requests: int  # complete requests (partial ones excluded)
    tokens: int  # their token rows
    partial_requests: int  # requests already running when the recording began: excluded
    partial_rows: int
    duplicate_rows: int  # second rows for the same (request, decode_order): ignored
    complete: bool | None  # the recording was closed (None: unknown)


@dataclass(frozen=True)
class LogProbStats:
    compared: int  # positions where both runs sampled the same token and both log-probs exist
    max_abs_delta: float | None
    max_at: Where | None
    beyond_tol: int
    first_beyond: Where | None
    first_beyond_delta: float | None


@dataclass(frozen=True)
class RoutingDifference:
    where: Where
    experts_a: list[int]
    experts_b: list[int]


@dataclass(frozen=True)
class RoutingStats:
    compared: int  # (token, MoE layer) pairs with expert ids on both sides
    identical: int  # same experts in the same order
    same_set: int  # same experts, any order
    agreement: float | None  # identical / compared
    set_agreement: float | None  # same_set / compared
    first_difference: RoutingDifference | None  # first (token, layer) whose expert *set* differs
    first_reorder: Where | None  # first (token, layer) with the same set in another order
    weights_compared: int  # (token, layer, expert) selected by both runs, with weights on both sides
    max_weight_delta: float | None
    max_weight_at: Where | None
    weights_beyond_tol: int
    first_weight_beyond: Where | None


@dataclass(frozen=True)
class LayerRatio:
    layer: LayerRef
    compared: int
    mean_abs_delta: float
    max_abs_delta: float
    beyond_tol: int


@dataclass(frozen=True)
class RatioStats:
    compared: int  # (token, FFN layer) pairs
    mean_abs_delta: float | None
    max_abs_delta: float | None
    max_at: Where | None
    beyond_tol: int
    first_beyond: Where | None
    layers: list[LayerRatio]  # in layer order


@dataclass(frozen=True)
class AttnDifference:
    where: Where
    attended_a: int
    attended_b: int


@dataclass(frozen=True)
class AttnStats:
    compared: int  # (token, attention layer) pairs
    differing: int
    max_abs_delta: int | None
    first_difference: AttnDifference | None


#: The statistics of a comparison that had nothing to compare.
EMPTY_LOG_PROB = LogProbStats(0, None, None, 0, None, None)
EMPTY_ROUTING = RoutingStats(0, 0, 0, None, None, None, None, 0, None, None, 0, None)
EMPTY_RATIO = RatioStats(0, None, None, None, 0, None, [])
EMPTY_ATTN = AttnStats(0, 0, None, None)


@dataclass(frozen=True)
class FirstDifference:
    decode_order: int
    kind: str  # one of KINDS
    detail: str


@dataclass(frozen=True)
class PairResult:
    pair: int
    request_a: str
    request_b: str
    tokens_a: int
    tokens_b: int
    compared: int  # aligned positions compared (up to and including the divergence by default)
    divergence: int | None  # first decode_order whose token ids differ
    token_a: TokenRef | None  # the two tokens at the divergence
    token_b: TokenRef | None
    token_mismatches: int  # compared positions whose token ids differ (> 1 only with --all)
    length_difference: str | None  # "A"/"B": that run goes on after the other ended, same tokens
    gaps_a: int  # positions B has and A lacks inside A's range (lost rows), not compared
    gaps_b: int
    log_prob: LogProbStats
    routing: RoutingStats | None  # None: not comparable
    act_zero_ratio: RatioStats | None
    attn: AttnStats | None
    first_difference: FirstDifference | None
    context_at: int | None  # decode_order the context is centred on
    context: list[ContextRow]
    equal: bool


@dataclass(frozen=True)
class DiffResult:
    equal: bool
    tolerances: Tolerances
    all_positions: bool
    a: SideSummary
    b: SideSummary
    pairs: list[PairResult]
    unpaired_a: list[str]  # request ids of A with no counterpart in B (in first-token order)
    unpaired_b: list[str]
    tokens_compared: int
    pairs_diverged: int  # pairs whose token ids diverge
    pairs_different: int  # pairs with any difference
    first_divergence: Where | None  # first pair (in order) whose tokens diverge, and where
    log_prob: LogProbStats
    routing: RoutingStats | None
    act_zero_ratio: RatioStats | None
    attn: AttnStats | None
    not_comparable: dict[str, str]  # column -> why
    notes: list[str] = field(default_factory=list)
