"""`diff A B`: compare two recordings of the same prompts, request by request and token by token.

Run the same prompts twice (a dense and a sparse configuration, two engine builds, with and
without a change), record both, and ``sparseety-prof diff A B`` says whether the runs agree and,
where they do not, where they first diverge and how: token id, log-prob, MoE routing, activation
sparsity, attention.

Per pair (and over all pairs) the result holds: tokens compared; the divergence point with the
surrounding tokens of both runs; the largest ``|Δ log_prob|`` and the positions beyond
``logprob`` tolerance; for MoE layers the agreement rate of the selected experts (identical
lists, and identical as sets), the first token and layer whose expert set differs with both
lists, and gate weights of the experts both runs selected against ``weight`` tolerance; per FFN
layer the mean and largest ``|Δ act_zero_ratio|`` against ``ratio`` tolerance; attended cells per
attention layer. Layers are named by model layer when the recordings' meta has ``"layers"``.

The pipeline, one module a step:
    pairing           requests of A and B paired by first-token time (partial ones excluded)
    columns           the columns read, and those one run did not capture (not comparable)
    alignment         tokens side by side by decode_order, up to each pair's divergence
    layers            which per-layer list positions of A and B are the same model layer
    deltas            per-column differences: log-prob, expert ids and weights, zero ratio, attention
    stats             those differences reduced per pair and over the run
    first_difference  a pair's earliest difference, causes before effects
    compare           the pure `compare` (and `diff_recordings`, which opens two recordings)
    result            the `DiffResult` model
    render, output    the terminal report; JSON and the `diff` command (`run`)
"""

from sparseety_prof.views.diff.compare import compare, diff_recordings
from sparseety_prof.views.diff.output import result_json, run
from sparseety_prof.views.diff.render import render
from sparseety_prof.views.diff.result import DiffResult, PairResult, Tolerances

__all__ = [
    "DiffResult",
    "PairResult",
    "Tolerances",
    "compare",
    "diff_recordings",
    "render",
    "result_json",
    "run",
]
