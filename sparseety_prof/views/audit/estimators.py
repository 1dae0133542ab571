"""The token-recovery models and the information estimate `audit` reports (numpy only).

- Lookup: naive Bayes over discrete keys (one expert set per layer). Per layer it is a lookup table
  of how often each token produced each key; over several layers the layers' log-likelihoods add
  up (the naive-Bayes independence assumption, which over-counts correlated layers but ranks well).
- Centroids: nearest centroid over standardized features (gate weights, probabilities, ratios,
  mask bits): each token's mean vector in training; a row scores each token by minus its mean
  squared z-distance, summed over layers.
Both score every token seen in training; the training frequency breaks ties (so with nothing to go
on, a model guesses the most frequent tokens: the chance baseline). A token never seen in training
cannot be named by either.

Information: `mutual_information_bits(tokens, guesses)` is the plug-in estimate of I(token; guess)
with the Miller-Madow correction. By the data-processing inequality I(token; guess) is at most
what the signal carries, so it is a lower bound on the signal's information, up to estimation bias:
the plug-in estimate is biased upward by about (cells - rows - cols + 1) / (2 N ln 2) bits for N
rows (Miller-Madow removes that first-order term), and remains biased when most (token, guess)
pairs are seen once or twice. `shuffled_information_bits` measures that remaining bias on the
same counts (the guesses shuffled against the tokens): a signal carries information only as far as
its estimate exceeds the shuffled one.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]


class Classes:
    """The tokens seen in training, their indices and their log prior (add-one smoothed)."""

    def __init__(self, train_tokens: Ints) -> None:
        self.tokens, counts = np.unique(train_tokens, return_counts=True)
        self.log_prior = np.log((counts + 1.0) / (counts.sum() + len(counts)))

    def index(self, tokens: Ints) -> Ints:
        """Class index of each token; -1 for a token not seen in training."""
        pos = np.searchsorted(self.tokens, tokens)
        pos = np.clip(pos, 0, max(len(self.tokens) - 1, 0))
        ok = (self.tokens[pos] == tokens) if len(self.tokens) else np.zeros(len(tokens), bool)
        return np.where(ok, pos, -1).astype(np.int64)


def lookup_scores(train_keys: Ints, train_labels: Ints, test_keys: Ints, n_classes: int) -> Floats:
    """log P(key | token) of each test row for each class (naive Bayes); rows whose key is absent
    (-1) score 0 for every class. Labels are class indices. Smoothing adds one pseudo-observation
    per class, spread over the keys (and "unseen"): a token seen once with a key then beats a
    frequent token never seen with it, as a lookup should."""
    ok = (train_keys >= 0) & (train_labels >= 0)
    keys, key_of = np.unique(train_keys[ok], return_inverse=True)
    alpha = 1.0 / (len(keys) + 1)
    counts = np.zeros((len(keys) + 1, n_classes))  # the last row: a key never seen in training
    np.add.at(counts, (key_of, train_labels[ok]), 1.0)
    per_class = counts.sum(axis=0)
    loglik = np.log((counts + alpha) / (per_class + alpha * (len(keys) + 1)))
    where = np.searchsorted(keys, test_keys)
    where = np.clip(where, 0, max(len(keys) - 1, 0))
    seen = (keys[where] == test_keys) if len(keys) else np.zeros(len(test_keys), bool)
    rows = np.where(seen, where, len(keys))
    out = loglik[rows]
    out[test_keys < 0] = 0.0
    return out


def centroid_scores(
    train_x: Floats,
    train_labels: Ints,
    train_present: Bools,
    test_x: Floats,
    test_present: Bools,
    n_classes: int,
) -> Floats:
    """Minus the mean squared z-distance of each test row to each class's training mean; 0 for
    absent rows. Features constant in training are left out; a class with no training row here
    gets the overall mean (it neither wins nor loses on this layer)."""
    ok = train_present & (train_labels >= 0)
    out = np.zeros((len(test_x), n_classes))
    if not ok.any() or not test_present.any():
        return out
    x, y = train_x[ok], train_labels[ok]
    mean, std = x.mean(axis=0), x.std(axis=0)
    keep = std > 1e-12
    if not keep.any():
        return out
    z = (x[:, keep] - mean[keep]) / std[keep]
    sums = np.zeros((n_classes, z.shape[1]))
    np.add.at(sums, y, z)
    n = np.bincount(y, minlength=n_classes)[:, None]
    cent = np.divide(sums, n, out=np.zeros_like(sums), where=n > 0)  # no row: the overall mean, 0
    t = (test_x[test_present][:, keep] - mean[keep]) / std[keep]
    d2 = (t**2).sum(axis=1)[:, None] - 2.0 * t @ cent.T + (cent**2).sum(axis=1)[None, :]
    out[test_present] = -np.maximum(d2, 0.0) / z.shape[1]
    return out


def ranks(scores: Floats, log_prior: Floats, labels: Ints) -> Ints:
    """0-based rank of each row's true class (ties broken by the prior); -1 for an unseen token."""
    tie = log_prior[None, :] * 1e-6 * (np.abs(scores).max() + 1.0)
    s = scores + tie
    true = np.take_along_axis(s, np.clip(labels, 0, None)[:, None], axis=1)
    r = (s > true).sum(axis=1)
    return np.where(labels >= 0, r, -1).astype(np.int64)


def guesses(scores: Floats, log_prior: Floats) -> Ints:
    """The top-1 class of each row (ties broken by the prior)."""
    tie = log_prior[None, :] * 1e-6 * (np.abs(scores).max() + 1.0)
    return np.asarray(np.argmax(scores + tie, axis=1), dtype=np.int64)


def top_k(rank: Ints, k: int) -> float:
    """Share of rows whose true token is among the first `k` guesses (unseen tokens count as misses)."""
    if len(rank) == 0:
        return float("nan")
    return float(((rank >= 0) & (rank < k)).mean())


def entropy_bits(x: Ints) -> float:
    """Plug-in entropy of the values of `x`, in bits."""
    if len(x) == 0:
        return 0.0
    _, c = np.unique(x, return_counts=True)
    p = c / c.sum()
    return float(-(p * np.log2(p)).sum())


def mutual_information_bits(x: Ints, y: Ints, *, miller_madow: bool = True) -> float:
    """Plug-in I(x; y) in bits from paired samples, with the Miller-Madow bias correction of each
    entropy ((cells - 1) / (2 N ln 2)) unless `miller_madow` is False; between 0 and the plug-in
    H(x) and H(y)."""
    n = len(x)
    if n == 0:
        return 0.0
    pairs = np.stack([x, y], axis=1)
    h_x, h_y, h_xy = entropy_bits(x), entropy_bits(y), _joint_entropy_bits(pairs)
    ceiling = min(h_x, h_y)  # I <= H: the corrections must not lift it above the entropies shown
    if miller_madow:
        c = 1.0 / (2.0 * n * np.log(2.0))
        bx, by, bxy = len(np.unique(x)), len(np.unique(y)), len(np.unique(pairs, axis=0))
        h_x, h_y, h_xy = h_x + (bx - 1) * c, h_y + (by - 1) * c, h_xy + (bxy - 1) * c
    return min(max(0.0, h_x + h_y - h_xy), ceiling)


def shuffled_information_bits(x: Ints, y: Ints, *, rounds: int = 20, seed: int = 0) -> float:
    """The same estimate with `y` shuffled against `x` (mean over `rounds`): what the estimator
    reports for these counts when there is no information at all, i.e. its bias here. A signal
    leaks only as far as its estimate exceeds this."""
    if len(x) == 0:
        return 0.0
    rng = np.random.default_rng(seed)
    return float(np.mean([mutual_information_bits(x, rng.permutation(y)) for _ in range(rounds)]))


def _joint_entropy_bits(pairs: Ints) -> float:
    _, c = np.unique(pairs, axis=0, return_counts=True)
    p = c / c.sum()
    return float(-(p * np.log2(p)).sum())
