"""`report DIR` on a small recording written through the real writer."""

from __future__ import annotations

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
