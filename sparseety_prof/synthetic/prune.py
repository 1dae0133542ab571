"""Static weight sparsity for the generated models' FFN weights (ffn_gate/ffn_up/ffn_down and
ffn_gate_exps/ffn_up_exps/ffn_down_exps), applied to the f32 values before any f16 cast or
quantization. Rows are the innermost dimension (ggml ne0, the fan-in):
  N:M           in every group of M consecutive values of a row keep the N largest magnitudes and set
                the other M-N to exactly 0 (e.g. 2:4, NVIDIA's semi-structured sparsity);
                1 <= N < M, and M must divide the row lengths (n_embd for gate/up, n_ff for down)
  FRACTION      0 < FRACTION < 1: in every row set the round(FRACTION * row length) smallest
                magnitudes to exactly 0 (e.g. 0.5)
Magnitude ties are broken by position (the earlier value is zeroed), so pruning is deterministic.
The zeros survive q8_0 and q4_0: symmetric block quantization maps 0 to the zero code (q8_0: 0,
q4_0: 8, which dequantizes to (8 - 8) * d), and the writer checks that it did. Pruned files carry
the spec in the extra key "sparseety.prune" (llama.cpp ignores unknown keys).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class Prune:
    """A static weight-sparsity pattern: N:M (``n`` of every ``m`` kept) or a zero ``fraction``."""

    n: int = 0
    m: int = 0
    fraction: float = 0.0

    def __post_init__(self) -> None:
        # a Prune built directly (not by parse_prune) must be as valid as a parsed one
        if self.m or self.n:
            if not 1 <= self.n < self.m or self.fraction:
                raise ValueError(f"bad prune N:M {self.n}:{self.m}: needs 1 <= N < M and no fraction")
        elif not 0.0 < self.fraction < 1.0:
            raise ValueError(f"bad prune fraction {self.fraction!r}: needs 0 < fraction < 1")

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.m else repr(self.fraction)

    def zeros_per_row(self, row_len: int) -> int:
        """How many values of a row of ``row_len`` values are set to 0."""
        if self.m:
            return row_len // self.m * (self.m - self.n)
        return math.floor(self.fraction * row_len + 0.5)  # round half up, not numpy's half-even

    def check_row(self, row_len: int, what: str) -> None:
        if self.m and row_len % self.m:
            raise ValueError(f"prune {self}: M={self.m} does not divide the row length {row_len} of {what}")


_NM_RE = re.compile(r"\s*(\d+)\s*:\s*(\d+)\s*")


def parse_prune(spec: str | float | Prune | None) -> Prune | None:
    """Parse ``"N:M"`` (1 <= N < M) or a fraction ``0 < f < 1`` (``"0.5"`` or ``0.5``).

    Raises ValueError with the accepted forms on anything else (``"3:2"``, ``"0:4"``, ``1.5``,
    ``"abc"``).
    """
    if spec is None or isinstance(spec, Prune):
        return spec
    forms = 'use N:M with 1 <= N < M (e.g. "2:4") or a zero fraction 0 < f < 1 (e.g. "0.5")'
    if isinstance(spec, str):
        if mt := _NM_RE.fullmatch(spec):
            n, m = int(mt.group(1)), int(mt.group(2))
            if not 1 <= n < m:
                raise ValueError(f'bad prune spec {spec!r}: N:M needs 1 <= N < M (e.g. "2:4")')
            return Prune(n=n, m=m)
        try:
            frac = float(spec)
        except ValueError:
            raise ValueError(f"bad prune spec {spec!r}; {forms}") from None
    elif isinstance(spec, int | float) and not isinstance(spec, bool):
        frac = float(spec)
    else:
        raise ValueError(f"bad prune spec {spec!r}; {forms}")
    if not 0.0 < frac < 1.0:  # also rejects nan
        raise ValueError(f"bad prune spec {spec!r}: a fraction must be > 0 and < 1; {forms}")
    return Prune(fraction=frac)


def prune_array(a: npt.NDArray[np.float32], spec: Prune) -> npt.NDArray[np.float32]:
    """``a`` with ``spec`` applied along its last axis (ggml's ne0, a row); returns a new array.

    Each group of M (N:M) or each row (fraction) loses its k smallest magnitudes; among equal
    magnitudes the earlier position is zeroed first, so the result depends on the values only.
    """
    row_len = a.shape[-1]
    spec.check_row(row_len, f"a tensor of shape {a.shape}")
    width = spec.m if spec.m else row_len
    k = spec.m - spec.n if spec.m else spec.zeros_per_row(row_len)
    groups = np.array(a, dtype=np.float32).reshape(-1, width)  # a copy; rows split into groups
    if k == 0:
        return groups.reshape(a.shape)
    mag = np.abs(groups)
    if width <= 64:
        # short groups: a stable argsort is fastest, and its order is the tie rule itself
        order = np.argsort(mag, axis=-1, kind="stable")
        np.put_along_axis(groups, order[:, :k], np.float32(0.0), axis=-1)  # +0.0, never -0.0
    else:
        # long rows (fraction): O(n) selection, faster than sorting rows this long. Zero
        # everything below the k-th smallest magnitude, then as many of the values equal to it,
        # earliest first, as k still needs: the same set a stable argsort's first k would give.
        kth = np.partition(mag, k - 1, axis=-1)[:, k - 1 : k]
        below = mag < kth
        need = k - below.sum(axis=-1, keepdims=True)
        at = mag == kth
        groups[below | (at & (np.cumsum(at, axis=-1) <= need))] = np.float32(0.0)
    return groups.reshape(a.shape)
