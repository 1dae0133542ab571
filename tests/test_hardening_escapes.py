"""Issue 18, "smaller escapes": each attack performed for real against the code that meets it.

- /props: a real HTTP server that redirects, streams an endless body, drips its answer, or sends
  deeply nested JSON; the fetch stays bounded and every failure is an error string.
- GGUF: crafted files (nested arrays, token types that do not match the tokens, sizes past the
  end); only ProfError comes out.
- meta.json with the wrong types through the CLI's `report` and `diff`: exit 7, one line, no
  traceback.
- sizes read from target memory beyond the records and the model: nothing is allocated from them.
- an HTTP read record whose buffer holds a stale request's X-Request-Id past the copied bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import run_cli

from sparseety_prof.capture import events as ev
from sparseety_prof.capture.gguf_info import Vocab, read_model_info, read_tensor_infos
from sparseety_prof.correlate.drain_index import DrainIndex
from sparseety_prof.correlate.serving import ID_GENERATED, ServingTracker
from sparseety_prof.correlate.step_sparse import StepSparse
from sparseety_prof.errors import ProfError
from sparseety_prof.session import snapshot
from sparseety_prof.session.snapshot import server_props
from sparseety_prof.store import schema
from sparseety_prof.store.recording import META_FILE
from sparseety_prof.store.recording_writer import RecordingWriter

# ------------------------------------------------------------------ /props of a hostile server
Handler = Callable[[BaseHTTPRequestHandler], None]


@pytest.fixture
def serve() -> Iterator[Callable[[Handler], str]]:
    """Start real HTTP servers whose GET runs the given function; yields their base URL."""
    servers: list[ThreadingHTTPServer] = []

    def start(on_get: Handler) -> str:
        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with contextlib.suppress(OSError):  # the client gave up (that is the point)
                    on_get(self)

            def log_message(self, *args: Any) -> None:
                pass

        srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def _answer(h: BaseHTTPRequestHandler, body: bytes, status: int = 200, **headers: str) -> None:
    h.send_response(status)
    for k, v in headers.items():
        h.send_header(k.replace("_", "-"), v)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


def _timed_props(url: str) -> tuple[dict[str, Any], float]:
    t0 = time.monotonic()
    out = server_props(url)
    return out, time.monotonic() - t0


def test_props_redirect_is_not_followed(serve: Callable[[Handler], str]) -> None:
    hits: list[str] = []

    def elsewhere(h: BaseHTTPRequestHandler) -> None:
        hits.append(h.path)
        _answer(h, json.dumps({"total_slots": 1}).encode())

    other = serve(elsewhere)
    url = serve(lambda h: _answer(h, b"", 302, Location=other + "/props"))
    out, _ = _timed_props(url)
    assert "302" in out["error"] and "redirect" in out["error"]
    assert hits == []  # the redirect target was never asked


def test_props_endless_body_is_cut_at_the_cap(serve: Callable[[Handler], str]) -> None:
    def endless(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.end_headers()  # no length: the body ends when the connection does (never)
        h.wfile.write(b'{"a": "')
        chunk = b"x" * 65536
        while True:
            h.wfile.write(chunk)

    out, took = _timed_props(serve(endless))
    assert "larger than" in out["error"] and took < snapshot.PROPS_TIMEOUT_S + 1


def test_props_slow_drip_is_cut_at_the_deadline(serve: Callable[[Handler], str]) -> None:
    def drip_body(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", "1000000")
        h.end_headers()
        while True:
            h.wfile.write(b" ")
            h.wfile.flush()
            time.sleep(0.05)

    def drip_headers(h: BaseHTTPRequestHandler) -> None:
        h.wfile.write(b"HTTP/1.1 200 OK\r\n")
        while True:
            h.wfile.write(b"X-Slow: y\r\n")
            h.wfile.flush()
            time.sleep(0.05)

    for handler in (drip_body, drip_headers):
        out, took = _timed_props(serve(handler))
        assert "error" in out and took < snapshot.PROPS_TIMEOUT_S + 1, (handler.__name__, out, took)


@pytest.mark.parametrize("depth", [100, 200_000])
def test_props_deeply_nested_json_is_an_error(serve: Callable[[Handler], str], depth: int) -> None:
    body = b'{"a": ' + b"[" * depth + b"]" * depth + b"}"
    out, _ = _timed_props(serve(lambda h: _answer(h, body)))
    assert "error" in out and ("nested" in out["error"] or "recursion" in out["error"])
    json.dumps(out)  # what goes into meta.json serialises


def test_props_closed_port_and_garbage_are_errors(serve: Callable[[Handler], str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert "error" in server_props(f"http://127.0.0.1:{port}")

    def garbage(h: BaseHTTPRequestHandler) -> None:
        h.wfile.write(b"\x00\xff not http at all\r\n\r\n")

    assert "error" in server_props(serve(garbage))
    assert "error" in server_props(serve(lambda h: _answer(h, b"\xff\xfe{")))


# ------------------------------------------------------------------ crafted GGUF files
def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_bytes(kv: list[tuple[str, int, bytes]], tensors: bytes = b"", n_tensors: int = 0) -> bytes:
    """A GGUF v3 header: (key, value type, encoded value) triples, then raw tensor infos."""
    out = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kv))
    for key, vtype, value in kv:
        out += _s(key) + struct.pack("<I", vtype) + value
    return out + tensors


ARRAY, STRING, UINT32, INT32 = 9, 8, 4, 5


def nested_arrays(depth: int) -> bytes:
    """An array of an array of ... of one empty uint32 array."""
    inner = struct.pack("<IQ", UINT32, 0)
    for _ in range(depth):
        inner = struct.pack("<IQ", ARRAY, 1) + inner
    return inner


def _write(tmp_path: Path, data: bytes, name: str = "m.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _only_prof_error(path: Path) -> None:
    for read in (read_model_info, read_tensor_infos, Vocab.from_gguf):
        with pytest.raises(ProfError):
            read(path)


def test_gguf_nested_arrays_are_refused_not_recursed(tmp_path: Path) -> None:
    deep = gguf_bytes([("general.architecture", STRING, _s("llama")), ("x", ARRAY, nested_arrays(100_000))])
    _only_prof_error(_write(tmp_path, deep))
    # two levels (what writers produce) still read
    ok = gguf_bytes([("general.architecture", STRING, _s("llama")), ("x", ARRAY, nested_arrays(2))])
    assert read_model_info(_write(tmp_path, ok, "ok.gguf"), with_sha256=False).architecture == "llama"


def test_gguf_token_types_not_matching_tokens(tmp_path: Path) -> None:
    tokens = struct.pack("<IQ", STRING, 2) + _s("a") + _s("b")
    types = struct.pack("<IQ", INT32, 3) + struct.pack("<3i", 1, 1, 1)
    data = gguf_bytes(
        [
            ("general.architecture", STRING, _s("llama")),
            ("tokenizer.ggml.model", STRING, _s("llama")),
            ("tokenizer.ggml.tokens", ARRAY, tokens),
            ("tokenizer.ggml.token_type", ARRAY, types),
        ]
    )
    with pytest.raises(ProfError, match="damaged vocabulary"):
        Vocab.from_gguf(_write(tmp_path, data))


@pytest.mark.parametrize(
    "data",
    [
        b"GGUF",
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 62),  # more keys than bytes
        gguf_bytes([("x", 77, b"")]),  # unknown value type
        gguf_bytes([("x", ARRAY, struct.pack("<IQ", UINT32, 1 << 61))]),  # array past the end
        gguf_bytes([("x", ARRAY, struct.pack("<IQ", STRING, 1 << 62) + struct.pack("<Q", 1 << 63))]),
        gguf_bytes([], _s("t") + struct.pack("<I", 1 << 31), n_tensors=1),  # dims past the end
        gguf_bytes([], _s("t") + struct.pack("<IQIQ", 1, 1 << 62, 0, 0), n_tensors=1),
        gguf_bytes(
            [("general.alignment", UINT32, struct.pack("<I", 3))],
            _s("t") + struct.pack("<IQIQ", 1, 4, 0, 0),
            n_tensors=1,
        ),
    ],
)
def test_gguf_crafted_sizes_raise_prof_error(tmp_path: Path, data: bytes) -> None:
    p = _write(tmp_path, data)
    with pytest.raises(ProfError):
        read_tensor_infos(p)
    for read in (read_model_info, Vocab.from_gguf):  # may read (no tensors needed), or ProfError
        with contextlib.suppress(ProfError):
            read(p)


def test_gguf_header_claiming_more_than_the_cap_is_not_read_into_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A string whose length claims 200 MiB in a (sparse) 300 MiB file: the reader grows its
    header read up to MAX_HEADER_BYTES, then stops."""
    from sparseety_prof.capture import gguf_info

    p = _write(tmp_path, gguf_bytes([("x", STRING, struct.pack("<Q", 200 << 20))]))
    with p.open("r+b") as f:
        f.truncate(300 << 20)
    reads: list[int] = []
    real_pread = os.pread

    def counting_pread(fd: int, n: int, off: int) -> bytes:
        reads.append(n)
        return real_pread(fd, n, off)

    monkeypatch.setattr(os, "pread", counting_pread)
    with pytest.raises(ProfError, match="64 MiB"):
        read_model_info(p, with_sha256=False)
    assert max(reads) <= gguf_info.MAX_HEADER_BYTES


# ------------------------------------------------------------------ damaged meta.json
def small_recording(path: Path) -> Path:
    """A closed recording with a few rows, through the real writer."""
    meta = {
        "engine": {"name": "llama-server", "version": "b1"},
        "model": {"path": "/m/x.gguf", "architecture": "llama", "sha256": "ab" * 32},
        "target": {"pid": 7},
    }
    with RecordingWriter(path, meta) as w:
        cols: dict[str, list[object]] = {
            "request_id": ["r1", "r1"],
            "token_id": [5, 6],
            "seq_id": [0, 0],
            "log_prob": [-0.5, -1.0],
            "partial": [False, False],
            "t_end_ns": [1_000, 2_000],
        }
        w.append("tokens", schema.frame("tokens", cols, absent=schema.TABLES["tokens"].keys() - cols.keys()))
        steps: dict[str, list[object]] = {
            "step_id": [0, 1],
            "t_start_ns": [0, 1_500],
            "t_end_ns": [1_000, 2_000],
            "phase": ["prefill", "decode"],
            "n_tokens": [3, 1],
        }
        w.append("steps", schema.frame("steps", steps, absent=schema.TABLES["steps"].keys() - steps.keys()))
    return path


WRONG_TYPES: list[tuple[str, Any]] = [
    ("engine", []),
    ("engine", "llama"),
    ("model", 3),
    ("target", [7]),
    ("losses", "none"),
    ("tables", []),
    ("tables", {"tokens": 3}),
    ("complete", "yes"),
    ("redacted", 1),
]


def _mutate_meta(rec: Path, key: str, value: Any) -> None:
    meta = json.loads((rec / META_FILE).read_text())
    meta[key] = value
    (rec / META_FILE).write_text(json.dumps(meta))


def _assert_exit_7_one_line(r: Any) -> None:
    assert r.returncode == 7, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize(("key", "value"), WRONG_TYPES)
def test_report_on_meta_with_wrong_types_exits_7(tmp_path: Path, key: str, value: Any) -> None:
    rec = small_recording(tmp_path / "rec")
    _mutate_meta(rec, key, value)
    _assert_exit_7_one_line(run_cli("report", str(rec)))


@pytest.mark.parametrize(("key", "value"), [("tables", []), ("complete", "yes"), ("tables", {"tokens": 3})])
def test_diff_on_meta_with_wrong_types_exits_7(tmp_path: Path, key: str, value: Any) -> None:
    good = small_recording(tmp_path / "a")
    bad = small_recording(tmp_path / "b")
    _mutate_meta(bad, key, value)
    _assert_exit_7_one_line(run_cli("diff", str(good), str(bad)))
    _assert_exit_7_one_line(run_cli("diff", str(bad), str(good)))


# ------------------------------------------------------------------ sizes from target memory
def _record(dtype: np.dtype, **fields: Any) -> dict[str, Any]:
    a = np.zeros(1, dtype)
    for k, v in fields.items():
        a[k] = v
    return {n: (a[n][0] if dtype[n].shape else a[n][0].item()) for n in dtype.names or ()}


def test_routing_tensor_sizes_beyond_the_record_allocate_nothing() -> None:
    huge = {"name": b"ffn_moe_topk-3", "tag": ev.TAG_EXPERT_IDS, "type": 26}
    for bad in (
        {"rows_total": 0xFFFF_FFFF, "ne0": 2, "row_stride": 8, "n_rows": 1, "n_bytes": 8},  # 32 GiB
        {"rows_total": 1 << 20, "ne0": 1 << 20, "row_stride": 1 << 22, "n_rows": 0, "n_bytes": 0},
        {"rows_total": 4, "ne0": 2, "row_stride": 512, "n_rows": 4, "n_bytes": 0xFFFF_FFFF},  # past data
    ):
        sp = StepSparse()
        r = _record(ev.TENSOR_S_DTYPE, **huge, **bad)
        assert sp.add_tensor(r) is None and not sp.ids
    sp = StepSparse()  # a sane record still lands
    r = _record(ev.TENSOR_S_DTYPE, **huge, rows_total=1, ne0=2, row_stride=8, n_rows=1, n_bytes=8)
    assert sp.add_tensor(r) == ("ffn_moe_topk", 3) and sp.ids[3].values.shape == (1, 2)


def test_activation_sizes_beyond_any_model_allocate_nothing() -> None:
    sp = StepSparse()
    r = _record(ev.ACT_MASK_DTYPE, name=b"ffn_out-1", ne0=0xFFFF_FFFF, ne1=1, nr_total=0xFFFF_FFFF, n_rows=1)
    assert sp.add_act(r, with_bits=True) is None and not sp.act_zeros and not sp.act_bits
    r = _record(ev.ACT_MASK_DTYPE, name=b"ffn_out-1", ne0=1 << 18, ne1=1, nr_total=1 << 20, n_rows=1)
    sp.add_act(r, with_bits=True)  # rows within bounds but the mask would be 256 GiB: counts only
    assert len(sp.act_zeros[1]) == 1 << 20 and 1 not in sp.act_bits
    r = _record(ev.ACT_MASK_DTYPE, name=b"ffn_out-2", ne0=0, ne1=1, nr_total=1, n_rows=1)
    assert sp.add_act(r, with_bits=False) is None and 2 not in sp.act_zeros  # 0 wide: no ratio


def test_micro_batch_row_offset_from_target_memory_is_clamped() -> None:
    from sparseety_prof.correlate.correlator import Correlator
    from sparseety_prof.correlate.verification import MAX_BATCH_ROWS, VERIFY_UBATCHES

    corr = Correlator(pid=1, n_vocab=100, wall_offset_ns=0)
    corr.counters.verified_ubatches = VERIFY_UBATCHES  # past the first, verified micro-batches
    r = _record(
        ev.UBATCH_DTYPE,
        kind=ev.EV_UBATCH,
        ctx=1,
        tid=1,
        n_tokens=0xFFFF_FFFF,
        n_copied=0xFFFF_FFFF,
        row_offset=0xFFFF_FFFF,
    )
    corr._on_ubatch(r)
    c = corr.state.ctx(1)
    assert len(c.rows) <= MAX_BATCH_ROWS
    corr._on_ubatch(r)  # a second one in the same decode does not add to the rows beyond the cap
    assert len(c.rows) <= MAX_BATCH_ROWS


def test_logits_chunks_out_of_order_are_incomplete_not_a_crash() -> None:
    from sparseety_prof.correlate.correlator import Correlator
    from sparseety_prof.correlate.state import SampleState

    corr = Correlator(pid=1, n_vocab=2048, wall_offset_ns=0)
    c = corr.state.ctx(1)
    c.ubatches_seen = 1
    c.sampling[1] = SampleState(idx=0, tid=1)
    ldt = ev.logits_dtype(1024)
    for chunk in (0, 7, 0xFFFF_FFFF):  # two chunks expected (2048 / 1024), 0 and 7 arrive
        corr._on_logits(_record(ldt, kind=ev.EV_LOGITS, ctx=1, tid=1, chunk=chunk, n_vals=1024, n_vocab=2048))
    corr._on_sample_end(_record(ev.SMALL_DTYPE, kind=ev.EV_SAMPLE_END, ctx=1, tid=1))
    assert corr.counters.logits_incomplete == 1


# ------------------------------------------------------------------ stale bytes in an HTTP record
def test_http_record_stale_bytes_past_the_copy_supply_no_request_id() -> None:
    """The ring buffer's record memory is reserved uncleared: an earlier request's headers lie past
    this read's copied bytes. The request id must come from the copied bytes only."""
    stale = b"POST /completion HTTP/1.1\r\nHost: h\r\nX-Request-Id: victim-request\r\n\r\n"
    rec = np.zeros(1, ev.HTTP_DTYPE)
    buf = bytearray(stale.ljust(ev.HTTP_BYTES, b"\0"))
    fresh = b"POST /completion HTTP/1.1\r\nHost: h\r\n"  # this read ends within the head
    buf[: len(fresh)] = fresh
    rec["kind"], rec["tid"], rec["len"], rec["n_copied"] = ev.EV_HTTP_READ, 5, len(fresh), len(fresh)
    rec["data"] = bytes(buf)
    raw = rec.tobytes()  # as the ring holds it
    batch = ev.decode_groups({len(raw): np.frombuffer(raw, np.uint8)}, 1024)
    data = DrainIndex(batch).record(0)["data"]
    assert data == fresh
    t = ServingTracker(pid=1)
    t.on_http(tid=5, t_ns=1, data=data)
    (req,) = t._pending_http[5]
    assert req.id_source == ID_GENERATED and "victim" not in req.request_id

    # a header line cut at the copy limit gives no (truncated) id either
    cut = b"POST /completion HTTP/1.1\r\nX-Request-Id: abcdef"[:-3]
    t.on_http(tid=6, t_ns=2, data=cut)
    assert t._pending_http[6][0].id_source == ID_GENERATED
