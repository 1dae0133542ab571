"""Vectorised logits statistics against a plain float64 reference."""

from __future__ import annotations

import numpy as np

from sparseety_prof.logits import row_stats, top_k


def _reference(row: np.ndarray, tok: int) -> tuple[float, list[int], float]:
    x = row.astype(np.float64)
    lp = x - x.max() - np.log(np.exp(x - x.max()).sum())
    order = sorted(range(len(x)), key=lambda i: (-lp[i], i))[:5]
    return float(lp[tok]), order, float(-(np.exp(lp) * lp).sum())


def test_matches_reference_on_wide_and_peaky_rows() -> None:
    rng = np.random.default_rng(3)
    rows = np.stack(
        [
            rng.standard_normal(32000).astype(np.float32) * 3,  # broad
            rng.standard_normal(32000).astype(np.float32) * 40,  # very peaky: most terms underflow
            np.zeros(32000, np.float32),  # uniform: ties everywhere
        ]
    )
    toks = np.array([17, 31999, 5])
    st = row_stats(rows, toks)
    for i, row in enumerate(rows):
        lp, top, ent = _reference(row, int(toks[i]))
        assert abs(st.log_prob[i] - lp) < 1e-5
        assert st.top_ids[i].tolist() == top
        assert abs(st.entropy[i] - ent) < 1e-4
        assert np.allclose(
            st.top_log_probs[i],
            [
                lp_
                for lp_ in (
                    row.astype(np.float64)
                    - row.max()
                    - np.log(np.exp(row.astype(np.float64) - row.max()).sum())
                )[top]
            ],
            atol=1e-5,
        )


def test_out_of_range_token_gives_nan_not_garbage() -> None:
    st = row_stats(np.zeros((1, 10), np.float32), np.array([10]))
    assert np.isnan(st.log_prob[0])


def test_top_k_does_not_touch_its_input_unless_asked() -> None:
    rows = np.array([[1.0, 3.0, 2.0]], np.float32)
    assert top_k(rows, 2).tolist() == [[1, 2]]
    assert rows.tolist() == [[1.0, 3.0, 2.0]]
