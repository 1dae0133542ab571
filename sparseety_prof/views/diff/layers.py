"""Which positions of the per-layer lists of A and B hold the same model layer.

With meta.json's ``"layers"`` on both sides, layers are matched by model layer (the common ones,
when the runs cover different layers); otherwise by position, up to the shorter list."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from sparseety_prof.views.diff.result import KIND_NAMES, LayerRef


@dataclass(frozen=True)
class LayerMap:
    """Which list positions of A and B hold the same layer, slot by slot."""

    idx_a: list[int]
    idx_b: list[int]
    refs: list[LayerRef]  # the layer of each slot


def _max_layers(df: pl.DataFrame, column: str) -> int:
    if df.height == 0:
        return 0
    n = df[column].list.len().max()
    return int(n) if isinstance(n, int) else 0


def _meta_layers(
    meta: Mapping[str, Any] | None, kind: str, n: int, side: str, notes: list[str]
) -> list[int] | None:
    """The model layer of each list position, from meta; None (with a note if malformed) without."""
    layers = meta.get("layers") if meta else None
    names = layers.get(kind) if isinstance(layers, Mapping) else None
    if names is None:
        return None
    if not isinstance(names, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in names):
        notes.append(f"{side}: meta layers.{kind} is not a list of layer numbers: layers named by position")
        return None
    if n and len(names) != n:
        notes.append(
            f"{side}: meta layers.{kind} names {len(names)} layers but the tokens hold {n}: "
            "layers named by position"
        )
        return None
    return names


def layer_map(
    kind: str,
    column: str,
    a: pl.DataFrame,
    b: pl.DataFrame,
    meta_a: Mapping[str, Any] | None,
    meta_b: Mapping[str, Any] | None,
    notes: list[str],
) -> LayerMap:
    n_a, n_b = _max_layers(a, column), _max_layers(b, column)
    names_a = _meta_layers(meta_a, kind, n_a, "A", notes)
    names_b = _meta_layers(meta_b, kind, n_b, "B", notes)
    label = KIND_NAMES[kind] + "s"
    if names_a is not None and names_b is not None and names_a != names_b:
        in_b = set(names_b)
        common = [x for x in names_a if x in in_b]
        only_a = sorted(set(names_a) - in_b)
        only_b = sorted(in_b - set(names_a))
        if only_a or only_b:
            notes.append(
                f"{column}: the runs cover different {label} (only in A: {only_a or 'none'}, "
                f"only in B: {only_b or 'none'}): the common ones are compared by model layer"
            )
        idx_a = [names_a.index(x) for x in common]
        idx_b = [names_b.index(x) for x in common]
        return LayerMap(
            idx_a, idx_b, [LayerRef(index=i, layer=x) for i, x in zip(idx_a, common, strict=True)]
        )
    if n_a != n_b and n_a and n_b:
        notes.append(
            f"{column}: A holds {n_a} {label} per token, B {n_b}: the first {min(n_a, n_b)} are compared"
        )
    m = min(n_a, n_b)
    names = names_a if names_a is not None else names_b
    refs = [
        LayerRef(index=j, layer=names[j] if names is not None and j < len(names) else None) for j in range(m)
    ]
    return LayerMap(list(range(m)), list(range(m)), refs)
