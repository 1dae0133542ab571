"""Routing of a recording against the llama-cpp-python graph-trace oracle (tests/engines/llama_engine.py
--graph-trace), teacher-forced with the same token sequence: shared by the server acceptance test
(test_xllamacpp_sparse.py) and the build matrix (test_build_matrix.py)."""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

Key = tuple[int, int]  # (position, layer)


def oracle_routes(lines: list[dict[str, Any]], n_items: int) -> list[dict[Key, dict[str, Any]]]:
    """Per teacher-forced item, (position, layer) -> ids/weights/probs from the trace's moe lines."""
    evals = {r["eval"]: r for r in lines if r["kind"] == "eval"}
    out: list[dict[Key, dict[str, Any]]] = [{} for _ in range(n_items)]
    for r in lines:
        if r["kind"] != "moe":
            continue
        assert r["positions"] is not None, r
        item = evals[r["eval"]]["item"]
        for i, pos in enumerate(r["positions"]):
            key = (pos, r["layer"])
            assert key not in out[item], (item, key)
            out[item][key] = {"ids": r["ids"][i], "weights": r["weights"][i], "probs": r["probs"][i]}
    return out


def read_trace(path: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["kind"] == "meta" and lines[0]["logits_all"]
    assert not [x for x in lines if x["kind"] == "error"]
    return lines


def routes_by_request(routes: pl.DataFrame, last_steps: list[int]) -> list[dict[Key, dict[str, Any]]]:
    """Route rows per request, for sequential requests of one slot: request k owns the steps in
    (last_steps[k-1], last_steps[k]] (step ids follow execution order). Joined to the oracle by
    position, never by row index: the server's micro-batches need not match the oracle's."""
    out: list[dict[Key, dict[str, Any]]] = [{} for _ in last_steps]
    for row in routes.iter_rows(named=True):
        k = bisect.bisect_left(last_steps, row["step_id"])
        if k == len(last_steps):
            continue  # after the last request: none of ours
        key = (row["pos"], row["layer"])
        assert key not in out[k], ("row recorded twice", k, key)
        out[k][key] = row
    return out


@dataclass
class Agreement:
    pairs: int = 0
    agree: int = 0
    downstream: int = 0  # pairs after a difference in their request (their hidden state differs)
    ties: list[tuple[int, int, int, list[int], list[int], float]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.agree / self.pairs if self.pairs else 0.0


def compare(
    recorded: list[dict[Key, dict[str, Any]]],
    truth: list[dict[Key, dict[str, Any]]],
    *,
    k_used: int,
    n_expert: int,
    weight_tol: float,
    prob_tol: float,
    tie_tol: float,
) -> Agreement:
    """Every (position, layer) both have. Expert ids must be equal, except where the experts that
    swapped ranks are a near tie in the recorded router probabilities (`tie_tol`); a routing
    difference flips the hidden state of that position from its layer on, so pairs (pos' >= pos,
    layer' > layer) after one count for the agreement rate but need not be ties. Where ids agree and
    no difference came before, gate weights and router probabilities are within their tolerances."""
    a = Agreement()
    for k, (rec, want_k) in enumerate(zip(recorded, truth, strict=True)):
        flip_layer = None  # lowest layer of a difference so far in this request
        common = sorted(set(rec) & set(want_k))
        assert len(common) == len(rec), (k, sorted(set(rec) - set(want_k))[:8])  # the oracle has every row
        for pos, layer in common:
            row, want = rec[(pos, layer)], want_k[(pos, layer)]
            ids, probs = list(row["expert_ids"]), np.array(row["router_probs"], dtype=np.float64)
            assert len(ids) == k_used and probs.shape == (n_expert,)
            # the recorded ids are the top-k of the recorded probabilities of the same row
            assert np.sort(probs)[::-1][:k_used].tolist() == probs[ids].tolist(), row
            a.pairs += 1
            after_flip = flip_layer is not None and layer > flip_layer
            a.downstream += after_flip
            if ids == want["ids"]:
                a.agree += 1
                if not after_flip:
                    np.testing.assert_allclose(row["expert_weights"], want["weights"], atol=weight_tol)
                    np.testing.assert_allclose(probs, want["probs"], atol=prob_tol)
                continue
            if not after_flip:
                # allowed only where the experts that swapped ranks are a near tie in the recording
                # (for the usual swap of the k-th and (k+1)-th expert: sorted probs[k-1] - probs[k])
                gap = max(
                    abs(float(probs[x]) - float(probs[y]))
                    for x, y in zip(ids, want["ids"], strict=True)
                    if x != y
                )
                assert gap <= tie_tol, (
                    f"request {k} position {pos} layer {layer}: recorded experts {ids} "
                    f"(weights {row['expert_weights']}), oracle {want['ids']} (weights {want['weights']}); "
                    f"recorded router probabilities {probs.round(6).tolist()} differ by {gap:.3g} > {tie_tol}"
                )
                a.ties.append((k, pos, layer, ids, want["ids"], gap))
            flip_layer = layer if flip_layer is None else min(flip_layer, layer)
    return a
