"""`report DIR` on a small recording written through the real writer."""

from __future__ import annotations

import itertools
from pathlib import Path

from conftest import run_cli

from sparseety_prof.store import schema
from sparseety_prof.store.recording_writer import RecordingWriter


def _recording(path: Path) -> None:
    meta = {
        "engine": {"name": "llama-cpp-python", "version": "0.3.36"},
        "model": {"path": "/m/moe.gguf", "architecture": "llama", "sha256": "ab" * 32},
        "target": {"pid": 99},
    }
    w = RecordingWriter(path, meta)
    tables: dict[str, dict[str, list[object]]] = {
        "steps": {
            "step_id": [0, 1, 2],
            "t_start_ns": [0, 10_000_000, 20_000_000],
            "t_end_ns": [5_000_000, 11_000_000, 21_500_000],
            "phase": ["prefill", "decode", "decode"],
            "n_tokens": [5, 1, 1],
        },
        "tokens": {
            "request_id": ["r0-0-1", "r0-0-1", "r0-0-2"],
            "token_id": [7, 8, 9],
            "seq_id": [0, 0, 0],
            "log_prob": [-0.5, -1.5, -3.0],
            "partial": [False, False, True],
            "t_end_ns": [5_000_000, 11_000_000, 21_500_000],
        },
        "requests": {
            "request_id": ["r0-0-1", "r0-0-2"],
            "id_source": ["header", "generated"],
            "ttft_ms": [12.5, None],
            "itl_p50_ms": [6.25, None],
            "end_reason": ["released", "detached"],
        },
        "kernels": {
            "name": ["moe_topk_kernel", "gemm_bf16", "gemm_bf16"],
            "start_ns": [0, 100_000, 300_000],
            "end_ns": [50_000, 250_000, 450_000],
            "step_id": [1, 1, None],
        },
    }
    for table, cols in tables.items():
        w.append(table, schema.frame(table, cols, absent=schema.TABLES[table].keys() - cols.keys()))
    w.close(losses={"kernel_drops": 0, "seq_gaps": 1})


def test_report_shows_requests_latency_losses_and_metadata(tmp_path: Path) -> None:
    _recording(tmp_path / "rec")
    r = run_cli("report", str(tmp_path / "rec"), env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for text in (
        "llama-cpp-python 0.3.36",
        "/m/moe.gguf",
        "PID 99",
        "seq_gaps=1",
        "3 / 3",
        "r0-0-1",
        "r0-0-2",
        "prefill",
        "decode",
        "-1.000",
        "True",
        "header",
        "12.500",
        "6.250",
        "released",
        "GPU kernels (3, 2 joined to a step)",
        "gemm_bf16",
        "300.0",
    ):
        assert text in out, text


# ---------------------------------------------------------------- where the time went

MS = 1_000_000
#: steps: (start ms, end ms, rows, prompt rows, sequences); A's prompt, A decodes, B's prompt
#: shares a step with A's decode, then both decode together
STEPS = [
    (1, 5, 6, 6, [0]),
    (6, 7, 1, 0, [0]),
    (8, 16, 9, 8, [0, 1]),
    (17, 18, 2, 0, [0, 1]),
    (19, 20, 2, 0, [0, 1]),
]
#: tokens per request: (step index, decode order)
TOKENS = {"A": [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)], "B": [(2, 0), (3, 1), (4, 2)]}
#: requests: received, started, first token, last token (ms; None: not seen), prompt rows, tokens out
REQUESTS = {
    "A": (0, 1, 5, 20, 6, 5),
    "B": (2, 8, 16, 20, 8, 3),
    "C": (21, None, None, None, None, 0),  # detached before its first token
}


def _timed_recording(path: Path) -> None:
    w = RecordingWriter(path, {"engine": {"name": "llama-server", "version": "b7000"}, "target": {"pid": 5}})
    ns = lambda v: None if v is None else v * MS  # noqa: E731
    cols: dict[str, dict[str, list[object]]] = {
        "steps": {
            "step_id": list(range(len(STEPS))),
            "t_start_ns": [ns(s[0]) for s in STEPS],
            "t_end_ns": [ns(s[1]) for s in STEPS],
            "n_tokens": [s[2] for s in STEPS],
            "prompt_rows": [s[3] for s in STEPS],
            "seq_ids": [s[4] for s in STEPS],
            "phase": ["prefill" if s[3] else "decode" for s in STEPS],
        },
        "tokens": {
            "request_id": [r for r, toks in TOKENS.items() for _ in toks],
            "seq_id": [0 if r == "A" else 1 for r, toks in TOKENS.items() for _ in toks],
            "token_id": [100 + i for i in range(sum(map(len, TOKENS.values())))],
            "step_id": [s for toks in TOKENS.values() for s, _ in toks],
            "decode_order": [d for toks in TOKENS.values() for _, d in toks],
            "t_end_ns": [ns(STEPS[s][1]) for toks in TOKENS.values() for s, _ in toks],
            "log_prob": [-0.25] * sum(map(len, TOKENS.values())),
            "partial": [False] * sum(map(len, TOKENS.values())),
        },
        "requests": {
            "request_id": list(REQUESTS),
            "id_source": ["header"] * len(REQUESTS),
            "t_received_ns": [ns(v[0]) for v in REQUESTS.values()],
            "t_started_ns": [ns(v[1]) for v in REQUESTS.values()],
            "t_first_token_ns": [ns(v[2]) for v in REQUESTS.values()],
            "t_last_token_ns": [ns(v[3]) for v in REQUESTS.values()],
            "ttft_ms": [None if v[2] is None else float(v[2] - v[0]) for v in REQUESTS.values()],
            "prompt_tokens": [v[4] for v in REQUESTS.values()],
            "output_tokens": [v[5] for v in REQUESTS.values()],
            "end_reason": ["released", "released", "detached"],
        },
    }
    for table, c in cols.items():
        w.append(table, schema.frame(table, c, absent=schema.TABLES[table].keys() - c.keys()))
    w.close(losses={"kernel_drops": 0})


def _expected_times(rid: str) -> dict[str, float | None]:
    """Where a request's time went, from REQUESTS by hand (the definitions in the report's legend)."""
    received, started, first, last, prompt, out = REQUESTS[rid]

    def diff(a: int | None, b: int | None) -> float | None:
        return None if a is None or b is None else float(a - b)

    prompt_ms, decode_ms = diff(first, started), diff(last, first)
    return {
        "queued_ms": diff(started, received),
        "prompt_ms": prompt_ms,
        "decode_ms": decode_ms,
        "total_ms": diff(last, received),
        "prompt_tok_s": prompt / (prompt_ms / 1e3) if prompt and prompt_ms else None,
        "decode_tok_s": (out - 1) / (decode_ms / 1e3) if out > 1 and decode_ms else None,
    }


def _expected_gaps() -> list[tuple[float, str, int, int]]:
    """(gap ms, request, decode order, step) of every token after its request's first, slowest first
    (ties: the earlier token, then by request id)."""
    gaps = []
    for rid, toks in TOKENS.items():
        for (prev, _), (step, order) in itertools.pairwise(toks):
            gaps.append((float(STEPS[step][1] - STEPS[prev][1]), rid, order, step))
    return sorted(gaps, key=lambda g: (-g[0], STEPS[g[3]][1], g[1]))


def test_report_json_counts_are_the_recordings_and_the_times_are_the_requests(tmp_path: Path) -> None:
    import json
    from collections import Counter

    from sparseety_prof.store.recording import open as open_recording

    _timed_recording(tmp_path / "rec")
    r = run_cli("report", str(tmp_path / "rec"), "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    rec = open_recording(tmp_path / "rec")
    frames = {t: rec.table(t) for t in ("tokens", "steps", "requests", "routes", "kernels")}
    assert got["counts"] == {t: f.height for t, f in frames.items()}
    per_request = {e["request_id"]: e for e in got["requests"]}
    assert set(per_request) == set(frames["requests"]["request_id"]) | set(frames["tokens"]["request_id"])
    produced = Counter(frames["tokens"]["request_id"].to_list())
    for rid, entry in per_request.items():
        assert entry["tokens"] == produced.get(rid, 0), rid
        for key, want in _expected_times(rid).items():
            if want is None:
                assert entry[key] is None, (rid, key)
            else:
                assert abs(entry[key] - want) < 1e-9, (rid, key, entry[key], want)

    slowest = got["slowest_tokens"]
    gaps = _expected_gaps()
    assert [(t["request_id"], t["decode_order"]) for t in slowest] == [(g[1], g[2]) for g in gaps[:5]]
    top, (gap, _, _, step) = slowest[0], gaps[0]
    start, end, rows, prompt_rows, seqs = STEPS[step]
    assert (top["gap_ms"], top["step_ms"]) == (gap, float(end - start))
    assert (top["step_rows"], top["step_prompt_rows"], top["step_seqs"]) == (rows, prompt_rows, len(seqs))

    by_total = sorted(
        (t for t in REQUESTS if _expected_times(t)["total_ms"] is not None),
        key=lambda t: -(_expected_times(t)["total_ms"] or 0),
    )
    assert [e["request_id"] for e in got["slowest_requests"]] == by_total
    for e in got["slowest_requests"]:
        decode = [(s, STEPS[s]) for s, order in TOKENS[e["request_id"]] if order > 0]
        assert e["decode_steps"] == len(decode)
        assert e["steps_with_prompt_rows"] == sum(1 for _, s in decode if s[3] > 0)
        assert abs(e["mean_step_seqs"] - sum(len(s[4]) for _, s in decode) / len(decode)) < 1e-9
        assert e["max_gap_ms"] == max(g[0] for g in gaps if g[1] == e["request_id"])


def test_report_shows_where_the_time_went_and_the_slowest_tokens(tmp_path: Path) -> None:
    _timed_recording(tmp_path / "rec")
    r = run_cli("report", str(tmp_path / "rec"), env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "where the time went" in out and "slowest requests" in out and "slowest tokens" in out
    a = _expected_times("A")
    row = next(ln for ln in out.split("where the time went", 1)[1].splitlines() if "│ A " in ln)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[1:6] == [f"{a[k]:.1f}" for k in ("queued_ms", "prompt_ms", "decode_ms")] + [
        "5.0",
        f"{a['total_ms']:.1f}",
    ]
    assert cells[8:10] == [f"{a['prompt_tok_s']:.1f}", f"{a['decode_tok_s']:.1f}"]
    gap, rid, order, step = _expected_gaps()[0]
    token_row = next(ln for ln in out.split("slowest tokens", 1)[1].splitlines() if f"│ {rid} " in ln)
    start, end, rows, prompt_rows, seqs = STEPS[step]
    cells = [c.strip() for c in token_row.strip("│ ").split("│")]
    assert cells == [
        rid,
        str(order),
        f"#{100 + step}",
        f"{gap:.2f}",
        f"{end - start:.2f}",
        str(len(seqs)),
        str(rows),
        str(prompt_rows),
    ]
