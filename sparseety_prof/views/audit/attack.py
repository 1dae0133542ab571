"""The audit itself: fit token-recovery models on training rows, score held-out rows, per signal,
per layer and after each redaction level.

With training recordings (`--train`), the held-out recording is scored by models fitted on them.
Without, the held-out recording's runs (a sequence up to where its position goes back: one per
prompt) are each held out in turn and scored by models fitted on the others (leave-one-run-out).
Each redaction level is applied to training and held-out rows alike: the attacker can record their
own runs of the same model and redact them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from sparseety_prof.errors import UsageError
from sparseety_prof.store.recording import Recording, section
from sparseety_prof.store.recording import open as open_recording
from sparseety_prof.store.redaction_levels import Redaction
from sparseety_prof.terminal_text import visible
from sparseety_prof.views.audit import estimators as est
from sparseety_prof.views.audit.observations import ALL_LAYERS, Observations, observe

#: what the audit scores: nothing redacted, each level alone, all of them (ids is left out: it
#: removes the labels, and with ids kept the tokens are in the file); then all of them on the
#: leakiest layer only (--redact-layers)
LEVEL_SETS: tuple[tuple[str, ...], ...] = (
    (),
    ("routing",),
    ("sparsity",),
    ("masks",),
    ("routing", "sparsity", "masks"),
)
TOP = 5


@dataclass
class Score:
    top1: float
    top5: float
    bits: float  # I(token; top-1 guess), plug-in with Miller-Madow (estimators.py)
    bits_shuffled: float  # the same with the guesses shuffled: the estimator's bias on these rows
    rows: int


@dataclass
class SignalScore:
    signal: str
    all_layers: Score
    layers: dict[int, Score] = field(default_factory=dict)  # ALL_LAYERS (-1) for a signal without layers


@dataclass
class LevelScore:
    levels: list[str]
    layers: list[int] | None  # the layers the per-layer levels were applied to (None: every layer)
    signals: list[SignalScore]
    best_signal: str | None  # highest top-1 (all layers, or one layer); None when no signal is left
    best: Score


@dataclass
class AuditResult:
    heldout: str
    train: list[str]
    mode: str  # "held-out" or "leave-one-run-out"
    model_sha256: str | None
    rows: int  # held-out rows scored
    distinct_tokens: int
    token_entropy_bits: float
    coverage: float  # share of held-out rows whose token occurs in training
    chance: Score  # guessing the most frequent training tokens
    levels: list[LevelScore]
    leakiest_layers: list[tuple[str, int, float]]  # (signal, layer, top-1), nothing redacted
    notes: list[str]


def _model_sha(rec: Recording) -> str | None:
    sha = section(rec, "model").get("sha256")
    return sha if isinstance(sha, str) else None


def _check_same_model(held: Recording, train: list[Recording]) -> str | None:
    sha = _model_sha(held)
    for t in train:
        other = _model_sha(t)
        if other != sha:
            raise UsageError(
                f"{visible(t.path)} was recorded with another model (sha256 {visible(other or 'unknown')}) "
                f"than {visible(held.path)} (sha256 {visible(sha or 'unknown')}): token-recovery models "
                "only transfer within one model; "
                "give --train recordings of the same model file"
            )
    return sha


def _frames(
    recs: list[Recording], levels: tuple[str, ...], layers: frozenset[int] | None
) -> dict[str, pl.DataFrame]:
    """The tables of every recording as `levels` (on `layers`) leave them, one frame each, with a
    "source" column and step ids made unique across recordings."""
    out: dict[str, list[pl.DataFrame]] = {t: [] for t in ("steps", "routes", "masks", "tokens")}
    offset = 0
    for i, rec in enumerate(recs):
        top = 0
        kinds = section(rec, "layers")
        redaction = Redaction(
            frozenset(levels), layers, {k: v for k, v in kinds.items() if isinstance(v, list)}
        )
        for table in out:
            df = redaction.frame(table, rec.table(table))
            if df.height:
                top = max(top, int(np.max(df["step_id"].fill_null(0).to_numpy())) + 1)
            out[table].append(
                df.with_columns(
                    (pl.col("step_id") + offset).alias("step_id"), pl.lit(i, pl.Int64).alias("source")
                )
            )
        offset += top
    return {t: pl.concat(parts) for t, parts in out.items()}


def _observations(recs: list[Recording], levels: tuple[str, ...], on: frozenset[int] | None) -> Observations:
    layers = section(recs[0], "layers").get("attn")
    f = _frames(recs, levels, on)
    attn = [int(x) for x in layers] if isinstance(layers, list) else []
    return observe(f["steps"], f["routes"], f["masks"], f["tokens"], attn_layers=attn)


def _folds(obs: Observations, held_out_only: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    if held_out_only:
        return [(obs.sources > 0, obs.sources == 0)]
    return [(obs.runs != r, obs.runs == r) for r in np.unique(obs.runs)]


@dataclass
class _Predictions:
    """Per signal and layer key: rank of the true token and top-1 guess (token id) of each row."""

    rank: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    guess: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    present: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)

    def put(
        self, key: tuple[str, int], n: int, test: np.ndarray, rank: np.ndarray, guess: np.ndarray
    ) -> None:
        if key not in self.rank:
            self.rank[key], self.guess[key] = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
            self.present[key] = np.zeros(n, bool)
        self.rank[key][test], self.guess[key][test] = rank, guess


def _predict(obs: Observations, folds: list[tuple[np.ndarray, np.ndarray]]) -> _Predictions:
    n = len(obs.tokens)
    pred = _Predictions()
    for train, test in folds:
        classes = est.Classes(obs.tokens[train])
        if not len(classes.tokens) or not test.any():
            continue
        c = len(classes.tokens)
        y_train, y_test = classes.index(obs.tokens[train]), classes.index(obs.tokens[test])
        prior = classes.log_prior
        zero = np.zeros((int(test.sum()), c))
        pred.put(
            ("chance", ALL_LAYERS),
            n,
            test,
            est.ranks(zero, prior, y_test),
            classes.tokens[est.guesses(zero, prior)],
        )
        for name, sig in obs.signals.items():
            total = np.zeros((int(test.sum()), c))
            any_present = np.zeros(int(test.sum()), bool)
            for layer, values in sig.values.items():
                present = sig.present[layer]
                if sig.discrete:
                    s = est.lookup_scores(values[train], y_train, values[test], c)
                else:
                    s = est.centroid_scores(
                        values[train],
                        y_train,
                        present[train],
                        values[test],
                        present[test],
                        c,
                    )
                total += s
                any_present |= present[test]
                if layer != ALL_LAYERS:
                    layer_s = s + prior if sig.discrete else s
                    key = (name, layer)
                    pred.put(
                        key,
                        n,
                        test,
                        est.ranks(layer_s, prior, y_test),
                        classes.tokens[est.guesses(layer_s, prior)],
                    )
                    pred.present[key][test] = present[test]
            if sig.discrete:
                total += prior
            key = (name, ALL_LAYERS)
            pred.put(key, n, test, est.ranks(total, prior, y_test), classes.tokens[est.guesses(total, prior)])
            pred.present[key][test] = any_present
    return pred


def _score(obs: Observations, pred: _Predictions, key: tuple[str, int], rows: np.ndarray) -> Score:
    ok = rows & pred.present[key] if key[0] != "chance" else rows
    rank = pred.rank[key][ok]
    tokens, guess = obs.tokens[ok], pred.guess[key][ok]
    return Score(
        top1=est.top_k(rank, 1),
        top5=est.top_k(rank, TOP),
        bits=est.mutual_information_bits(tokens, guess),
        bits_shuffled=est.shuffled_information_bits(tokens, guess),
        rows=int(ok.sum()),
    )


def _level(
    recs: list[Recording], levels: tuple[str, ...], layers: frozenset[int] | None, held_out_only: bool
) -> tuple[Observations, _Predictions, np.ndarray, list[SignalScore]]:
    """Observations, predictions, the rows scored and the per-signal scores after one level."""
    heldout, has_train = recs[0].path, len(recs) > 1
    obs = _observations(recs, levels, layers)
    if not (obs.sources == 0).any():
        raise UsageError(
            f"{visible(heldout)} has no rows with token ids and sparse decisions to audit (recorded with "
            "--redact ids, or with --mode tokens): audit needs them as ground truth"
        )
    if has_train and not (obs.sources > 0).any():
        raise UsageError(
            "the --train recordings have no rows with token ids and sparse decisions (recorded with "
            "--redact ids, or with --mode tokens): the models are fitted on them"
        )
    folds = _folds(obs, held_out_only)
    if not has_train and len(folds) < 2:
        raise UsageError(
            f"{heldout} holds a single run: give --train recordings of the same model, or record "
            "several prompts so each can be held out in turn"
        )
    pred = _predict(obs, folds)
    evaluated = np.logical_or.reduce([t for _, t in folds])
    signals = []
    for name in obs.signals:
        per_layer = {
            k[1]: _score(obs, pred, k, evaluated) for k in pred.rank if k[0] == name and k[1] != ALL_LAYERS
        }
        signals.append(SignalScore(name, _score(obs, pred, (name, ALL_LAYERS), evaluated), per_layer))
    return obs, pred, evaluated, signals


def audit(heldout: Path, train: list[Path]) -> AuditResult:
    held = open_recording(heldout)
    trains = [open_recording(p) for p in train]
    sha = _check_same_model(held, trains)
    recs = [held, *trains]
    obs, pred, evaluated, signals = _level(recs, (), None, bool(trains))
    chance = _score(obs, pred, ("chance", ALL_LAYERS), evaluated)
    levels_out = [_best([], None, signals, chance)]
    per_layer = [(s.signal, layer, sc.top1) for s in signals for layer, sc in s.layers.items() if sc.rows]
    leakiest = sorted(per_layer, key=lambda t: -t[2])[:5]
    level_sets: list[tuple[tuple[str, ...], frozenset[int] | None]] = [(lv, None) for lv in LEVEL_SETS[1:]]
    if leakiest:  # what redacting only the layer that leaks most leaves
        level_sets.append((LEVEL_SETS[-1], frozenset({leakiest[0][1]})))
    for levels, layers in level_sets:
        _, _, _, after = _level(recs, levels, layers, bool(trains))
        levels_out.append(_best(list(levels), None if layers is None else sorted(layers), after, chance))
    held_tokens = obs.tokens[evaluated]
    seen = np.isin(held_tokens, obs.tokens[~evaluated]) if trains else _seen_elsewhere(obs)[evaluated]
    notes = [
        "token ids themselves are stored unless the recording was made with --redact ids: this audit "
        "measures what the other columns give away to someone who removed them, or who only has those"
    ]
    if held.redaction_levels:
        notes.append(f"{heldout} was recorded with --redact {','.join(held.redaction_levels)}")
    return AuditResult(
        heldout=str(heldout),
        train=[str(p) for p in train],
        mode="held-out" if trains else "leave-one-run-out",
        model_sha256=sha,
        rows=int(evaluated.sum()),
        distinct_tokens=len(np.unique(held_tokens)),
        token_entropy_bits=est.entropy_bits(held_tokens),
        coverage=float(np.mean(seen)) if len(seen) else 0.0,
        chance=chance,
        levels=levels_out,
        leakiest_layers=leakiest,
        notes=notes,
    )


def _best(
    levels: list[str], layers: list[int] | None, signals: list[SignalScore], chance: Score
) -> LevelScore:
    """The attacker keeps whichever model recovers most: all layers of a signal, or one layer."""
    options = [
        (sc, s.signal if layer is None else f"{s.signal} (layer {layer})")
        for s in signals
        for layer, sc in [(None, s.all_layers), *s.layers.items()]
        if sc.rows  # a signal the training rows have but the held-out rows lack recovers nothing
    ]
    if not options:
        return LevelScore(levels, layers, signals, None, chance)
    score, name = max(options, key=lambda o: (o[0].top1, o[0].top5))
    return LevelScore(levels, layers, signals, name, score)


def _seen_elsewhere(obs: Observations) -> np.ndarray:
    """For leave-one-run-out: whether each row's token occurs in another run."""
    out = np.zeros(len(obs.tokens), bool)
    for r in np.unique(obs.runs):
        here = obs.runs == r
        out[here] = np.isin(obs.tokens[here], obs.tokens[~here])
    return out
