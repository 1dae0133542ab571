"""scripts/gpu_check_llamacpp.py's comparisons, which decide the llama.cpp section of the GPU check,
on hand-made inputs in the formats they read: the oracle's JSON lines
(scripts/llamacpp_gpu_oracle.cpp), the server's answer, and `routes` rows whose steps are the
prompt's micro-batch then one row per decoded token."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def check() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gpu_check_llamacpp", ROOT / "scripts" / "gpu_check_llamacpp.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


N_PROMPT = 3
LAYERS = 2


def oracle_text(n_tokens: int) -> str:
    """Ids of (position p, layer l) = [p % 8, (p + l + 1) % 8]; greedy choice at p = 100 + p."""
    lines = [{"kind": "meta", "n_tokens": n_tokens, "n_vocab": 512, "n_gpu_layers": 99}]
    for layer in range(LAYERS):
        ids = [[p % 8, (p + layer + 1) % 8] for p in range(n_tokens)]
        lines.append({"kind": "moe", "layer": layer, "positions": list(range(n_tokens)), "ids": ids})
    for p in range(n_tokens - 1):
        lines.append({"kind": "logprob", "pos": p, "next": 100 + p, "logprob": -0.5 - p, "argmax": 100 + p})
    return "\n".join(json.dumps(x) for x in lines)


def recorded_rows(
    steps: list[int], n_prompt: int, n_decoded: int, width: int = 8
) -> list[tuple[int, int, int, list[int]]]:
    """routes rows as the recording holds them: the prompt step, then one step per decoded token;
    rows rank every expert (width 8), the first two the chosen ones."""
    rows = []
    pos = 0
    for i, step in enumerate(steps):
        n = n_prompt if i == 0 else 1
        for r in range(n):
            for layer in range(LAYERS):
                top = [pos % 8, (pos + layer + 1) % 8]
                rows.append((step, r, layer, top + [e for e in range(width) if e not in top]))
            pos += 1
    assert pos == n_prompt + n_decoded
    return rows


def test_answer_equal_to_the_oracle_and_a_logprob_off_by_more_than_the_tolerance(check: ModuleType) -> None:
    oracle = check.read_oracle(oracle_text(N_PROMPT + 4))
    prompt = [1, 5, 9]
    # generated token i is predicted at position N_PROMPT + i - 1
    tokens = [100 + N_PROMPT - 1 + i for i in range(4)]
    probs = [{"id": t, "logprob": -0.5 - (N_PROMPT - 1 + i)} for i, t in enumerate(tokens)]
    res = check.compare_answer(prompt, {"tokens": tokens, "completion_probabilities": probs}, oracle)
    assert res["tokens_equal_oracle"] and res["logprobs_within_tol"] and res["logprobs_compared"] == 4
    probs[2] = {"id": tokens[2], "logprob": probs[2]["logprob"] + 2e-4}
    res = check.compare_answer(prompt, {"tokens": tokens, "completion_probabilities": probs}, oracle)
    assert not res["logprobs_within_tol"] and res["logprob_max_abs_diff"] == pytest.approx(2e-4)
    res = check.compare_answer(prompt, {"tokens": [*tokens[:3], 7], "completion_probabilities": []}, oracle)
    assert not res["tokens_equal_oracle"] and res["logprobs_compared"] == 0 and not res["logprobs_within_tol"]


def test_routes_joined_to_positions_in_both_step_id_spaces(check: ModuleType) -> None:
    oracle = check.read_oracle(oracle_text(N_PROMPT + 4))
    for steps in ([10, 11, 12, 13], [-1, -2, -3, -4]):  # host step ids, GPU-only step ids
        rows = recorded_rows(steps, N_PROMPT, 3)
        chronological = steps  # as analyse_recording orders them
        res = check.compare_routes(rows, chronological, N_PROMPT, 2, oracle["ids"])
        # positions 0..5 recorded (the last generated token is never decoded), 2 layers each
        assert res["routes_pairs"] == res["routes_pairs_compared"] == res["routes_pairs_equal"] == 12
        assert res["routes_equal_oracle"] and res["routes_row_width"] == 8


def test_a_step_before_the_prompt_is_not_the_requests_and_a_difference_is_found(check: ModuleType) -> None:
    oracle = check.read_oracle(oracle_text(N_PROMPT + 4))
    rows = recorded_rows([20, 21, 22, 23], N_PROMPT, 3)
    warmup = [(19, 0, layer, [7, 6, 5, 4, 3, 2, 1, 0]) for layer in range(LAYERS)]  # 1 row: not the prompt
    swapped = [
        (s, r, la, ([ids[1], ids[0], *ids[2:]] if (s, la) == (22, 1) else ids)) for s, r, la, ids in rows
    ]
    res = check.compare_routes(warmup + swapped, [19, 20, 21, 22, 23], N_PROMPT, 2, oracle["ids"])
    assert res["routes_pairs"] == 12 and res["routes_pairs_equal"] == 11
    assert res["routes_pairs_rank_swapped"] == 1 and res["routes_first_difference"] == [4, 1]
    assert not res["routes_equal_oracle"]
    other = [(s, r, la, ([3, 3, *ids[2:]] if (s, r, la) == (20, 0, 0) else ids)) for s, r, la, ids in rows]
    res = check.compare_routes(other, [20, 21, 22, 23], N_PROMPT, 2, oracle["ids"])
    assert res["routes_first_difference"] == [0, 0] and res["routes_pairs_rank_swapped"] == 0


def test_a_last_layer_run_only_on_the_output_row_is_that_rows_position(check: ModuleType) -> None:
    """llama.cpp runs the last layer's FFN only on the rows giving logits: the prompt step's last
    layer has one row, the prompt's last position."""
    oracle = check.read_oracle(oracle_text(N_PROMPT + 4))
    rows = recorded_rows([30, 31, 32, 33], N_PROMPT, 3)
    last = LAYERS - 1
    trimmed = [(s, r, la, ids) for s, r, la, ids in rows if not (s == 30 and la == last and r < N_PROMPT - 1)]
    trimmed = [(s, (0 if (s == 30 and la == last) else r), la, ids) for s, r, la, ids in trimmed]
    res = check.compare_routes(trimmed, [30, 31, 32, 33], N_PROMPT, 2, oracle["ids"])
    assert res["routes_pairs"] == 12 - (N_PROMPT - 1)
    assert res["routes_equal_oracle"] and res["routes_pairs_equal"] == res["routes_pairs_compared"]


def test_oracle_errors_are_kept(check: ModuleType) -> None:
    text = oracle_text(2) + "\n" + json.dumps({"kind": "error", "error": "llama_decode returned 1"})
    assert check.read_oracle(text)["errors"] == ["llama_decode returned 1"]


def test_dry_run_plans_the_preset_the_record_and_the_oracle() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check_llamacpp.py"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["throughput_modes"]["off"][0] == "PKG/bin/llama-server"
    buffers = p["throughput_modes"]["buffers"]
    assert buffers[buffers.index("launch") + 1 : buffers.index("--")] == [
        "--preset",
        "llamacpp",
        "--flush-ms",
        "100",
    ]
    assert "--preset" not in p["throughput_modes"]["kernels"]
    assert p["record"]["record"][-5:] == ["record", "--pid", "PID", "-o", "REC"]
    assert p["oracle"] == ["PKG/bin/llamacpp-gpu-oracle", "MODEL.gguf", "99", "TOKENS_FILE"]
