"""Fuzzing (issue 18): every reader of bytes others control, fed crafted input for a time budget;
only each reader's documented error types may come out.

- the GGUF parser (capture/gguf_info.py): ProfError;
- the BPF ring reader (capture/bpf_loader.py RingReader's walk, events.decode_groups) and the
  correlator behind it: records carry what the target's memory held; UnsupportedEngineBuild
  (verification of the first records), and ValueError from decode_groups only for a record size
  no probe writes;
- the CUPTI shm ring reader (gpu/shm_ring.py): RingError;
- the HTTP request-head parser (correlate/serving.py): nothing;
- the recording loader (store/recording.py) and `report`/`diff` on damaged recordings:
  CorruptRecording (exit 7) or UsageError, never a traceback; and on recordings whose files are
  of another kind (FIFO, socket, directory, links), size (empty, sparse gigabytes), nesting or
  compression ratio (lists and text far larger inside than on disk, counts meta.json lies
  about): the same, at once (a hang guard fails the round) and without decoding a bomb.

Each fuzzer runs hypothesis in rounds until SPARSEETY_FUZZ_SECONDS (default 60) have passed, so
CI spends a minute on each; set it lower to run them quickly (SPARSEETY_FUZZ_SECONDS=5). A
failure prints hypothesis's shrunk example; each one found so far is kept as an @example.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_hardening_escapes import (
    ARRAY,
    INT32,
    STRING,
    UINT32,
    _s,
    gguf_bytes,
    nested_arrays,
    small_recording,
)
from test_hardening_files import within
from test_ring_walk import SIZE as RING_SIZE
from test_ring_walk import FakeRing

from sparseety_prof import cli
from sparseety_prof.capture import bpf_loader as bl
from sparseety_prof.capture import events as ev
from sparseety_prof.capture.gguf_info import Vocab, read_model_info, read_tensor_infos
from sparseety_prof.capture.plans import LayerSet
from sparseety_prof.correlate.correlator import Correlator
from sparseety_prof.correlate.server_layout_check import VERIFY_LAUNCHES, VERIFY_POSTS
from sparseety_prof.correlate.serving import ServingTracker, parse_request_head
from sparseety_prof.correlate.verification import VERIFY_UBATCHES
from sparseety_prof.errors import CorruptRecording, ProfError, UnsupportedEngineBuild, UsageError
from sparseety_prof.gpu import shm_ring as sr
from sparseety_prof.store import recording

FUZZ_SECONDS = float(os.environ.get("SPARSEETY_FUZZ_SECONDS", "60"))


def fuzz_for_budget(run: Callable[[], None]) -> None:
    """Call a @given test (one round of its max_examples) until the budget is spent."""
    deadline = time.monotonic() + FUZZ_SECONDS
    while True:
        run()
        if time.monotonic() >= deadline:
            return


def rounds(n: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """hypothesis settings of one round: `n` examples, no per-example deadline (CI machines are
    slow and shared), no example database (nothing written into the tree)."""
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="sparseety-fuzz-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------ GGUF
def _base_gguf() -> bytes:
    tokens = struct.pack("<IQ", STRING, 4) + b"".join(_s(t) for t in ("<s>", "\u2581a", "<0x41>", "b"))
    types = struct.pack("<IQ", INT32, 4) + struct.pack("<4i", 3, 1, 6, 1)
    tensors = _s("blk.0.ffn_up.weight") + struct.pack("<I2QIQ", 2, 32, 2, 0, 0)
    tensors += _s("output.weight") + struct.pack("<I1QIQ", 1, 4, 1, 256)
    kv = [
        ("general.architecture", STRING, _s("llama")),
        ("general.alignment", UINT32, struct.pack("<I", 32)),
        ("llama.block_count", UINT32, struct.pack("<I", 1)),
        ("tokenizer.ggml.model", STRING, _s("llama")),
        ("tokenizer.ggml.tokens", ARRAY, tokens),
        ("tokenizer.ggml.token_type", ARRAY, types),
        ("nested", ARRAY, nested_arrays(2)),
    ]
    head = gguf_bytes(kv, tensors, n_tensors=2)
    head += b"\0" * (-len(head) % 32)
    return head + b"\x01" * 512


BASE_GGUF = _base_gguf()
WORDS = st.sampled_from(
    [0, 1, 2, 3, 7, 8, 9, 0xFF, 0xFFFF, 0x7FFF_FFFF, 0xFFFF_FFFF, 1 << 32, 1 << 62, (1 << 64) - 1]
)


@st.composite
def mutated_gguf(draw: st.DrawFn) -> bytes:
    data = bytearray(BASE_GGUF if draw(st.booleans()) else b"GGUF" + draw(st.binary(max_size=300)))
    for _ in range(draw(st.integers(0, 6))):
        at = draw(st.integers(0, max(0, len(data) - 1)))
        how = draw(st.sampled_from(["byte", "u32", "u64", "cut", "insert"]))
        if how == "byte":
            data[at : at + 1] = bytes([draw(st.integers(0, 255))])
        elif how in ("u32", "u64"):
            n = 4 if how == "u32" else 8
            data[at : at + n] = (draw(WORDS) & ((1 << (8 * n)) - 1)).to_bytes(n, "little")
        elif how == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


def test_fuzz_gguf_parser(scratch: Path) -> None:
    path = scratch / "m.gguf"

    @rounds(200)
    @given(mutated_gguf())
    @example(gguf_bytes([("x", ARRAY, nested_arrays(5000))]))  # recursion
    @example(gguf_bytes([("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, 1) + _s("a")),
                         ("tokenizer.ggml.token_type", ARRAY, struct.pack("<IQ", INT32, 0))]))  # fmt: skip
    def one(data: bytes) -> None:
        path.write_bytes(data)
        for read in (
            lambda: read_model_info(path),
            lambda: read_tensor_infos(path),
            lambda: Vocab.from_gguf(path).texts(list(range(-1, 6))),
        ):
            with contextlib.suppress(ProfError):
                read()

    fuzz_for_budget(one)


# ------------------------------------------------------------------ BPF ring records -> correlator
LOGITS_CHUNK = 1024
LAYOUT_KINDS: dict[str, list[int]] = {
    "small": [
        ev.EV_DECODE_BEGIN, ev.EV_UBATCH_END, ev.EV_SAMPLE_BEGIN, ev.EV_SAMPLE_END, ev.EV_SEQ_RM,
        ev.EV_MEM_CLEAR, ev.EV_TASK_POST, ev.EV_SLOT_LAUNCH, ev.EV_SLOT_CHILD, ev.EV_SLOT_RELEASE,
        ev.EV_SLOT_TOKEN, ev.EV_HEAD_DRAW,
    ],
    "ubatch": [ev.EV_UBATCH],
    "logits": [ev.EV_LOGITS],
    "tensor_s": [ev.EV_TENSOR],
    "tensor_l": [ev.EV_TENSOR],
    "act": [ev.EV_ACT],
    "act_mask": [ev.EV_ACT_MASK],
    "attn": [ev.EV_ATTN],
    "step_agg": [ev.EV_STEP_AGG],
    "http": [ev.EV_HTTP_READ],
}  # fmt: skip
DTYPES: dict[str, np.dtype] = {name: dt for name, dt in ev._layouts(LOGITS_CHUNK).values()}
SMALL_INTS = st.sampled_from(
    [0, 1, 2, 3, -1, 4, 7, 8, 100, 1023, 1024, 2047, 1 << 20, 0x7FFF_FFFF, -(1 << 31)]
)
NAMES = st.sampled_from(
    [b"ffn_moe_topk-0", b"ffn_moe_weights-1", b"ffn_moe_probs-0", b"ffn_moe_gate_par-1", b"ffn_out-0",
     b"kq_mask-0", b"__fattn__-1", b"attn_norm-0", b"", b"\xff\xfe-1", b"ffn_moe_topk-99999999999"]
)  # fmt: skip


def _fill_field(rec: np.ndarray, name: str, value: int) -> None:
    """Set a scalar or the first cells of an array field to `value`, wrapped to its type."""
    dt = rec.dtype[name]
    base = dt.base if dt.shape else dt
    if base.kind not in "iu":
        return
    bits = base.itemsize * 8
    v = value & ((1 << bits) - 1)
    if base.kind == "i" and v >= 1 << (bits - 1):
        v -= 1 << bits
    if dt.shape:
        rec[name].reshape(-1)[: 1 + (abs(value) % 4)] = v
    else:
        rec[name] = v


@st.composite
def ring_records(draw: st.DrawFn) -> list[bytes]:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = []
    for seq in range(draw(st.integers(1, 12))):
        layout = draw(st.sampled_from(sorted(LAYOUT_KINDS)))
        dt = DTYPES[layout]
        rec = np.zeros(1, dt)
        if draw(st.booleans()):  # random payload, or zeros with a few fields set
            rec = np.frombuffer(rng.bytes(dt.itemsize), dt).copy()
        rec["seq"], rec["kind"] = seq, draw(st.sampled_from(LAYOUT_KINDS[layout]))
        rec["tid"], rec["ctx"] = draw(st.sampled_from([1, 2])), draw(st.sampled_from([7, 8]))
        rec["flags"] = draw(st.sampled_from([0, 1, 2, 3, 0xFFFF]))
        names = dt.names or ()
        if "name" in names:
            rec["name"] = draw(NAMES)
        for field in draw(
            st.lists(st.sampled_from([n for n in names if n not in ("seq", "kind")]), max_size=6)
        ):
            _fill_field(rec, field, draw(SMALL_INTS))
        out.append(rec.tobytes())
    if draw(st.integers(0, 9)) == 0:  # a size no probe writes
        out.append(rng.bytes(8 * draw(st.integers(1, 64))))
    return out


def test_fuzz_bpf_ring_records_through_the_correlator() -> None:
    sizes = set(DTYPES[name].itemsize for name in DTYPES)

    @rounds(30)
    @given(ring_records(), st.booleans(), st.booleans())
    def one(records: list[bytes], verified: bool, python_walk: bool) -> None:
        ring = FakeRing()
        room = RING_SIZE  # the kernel never lets the producer lap the consumer
        records = [r for r in records if (room := room - ((len(r) + 15) & ~7)) >= 0]
        for r in records:
            ring.put(r)
        reader = ring.reader(python=python_walk or bl._ring_walk is None, sizes=tuple(sorted(sizes)))
        groups = reader.take()
        assert sum(len(b) for b in groups.values()) == sum(len(r) for r in records)
        try:
            batch = ev.decode_groups(groups, LOGITS_CHUNK)
        except ValueError:
            assert set(groups) - sizes  # only a size no probe writes
            return
        corr = Correlator(
            pid=1,
            n_vocab=1000,
            wall_offset_ns=0,
            texts=lambda ids: [str(i) for i in ids],
            layers=LayerSet(moe=(0, 1), ffn=(0, 1), attn=(0, 1)),
            n_expert=8,
            n_expert_used=2,
            with_masks=True,
            serving=ServingTracker(pid=1),
            slot_tokens=True,
            head_verdicts={},  # head sampling in the probes: their draws reach it (EV_HEAD_DRAW)
        )
        if verified:  # an engine that passed the checks of its first records, then sends garbage
            corr.counters.verified_ubatches = VERIFY_UBATCHES
            corr.counters.verified_sparse = VERIFY_UBATCHES
            # the server structs are verified on their own first records (server_layout_check)
            corr.server_check.posts_verified = VERIFY_POSTS
            corr.server_check.launches_verified = VERIFY_LAUNCHES
        try:
            corr.feed(batch)
            corr.take_tables()
            corr.take_tables(final=True)
        except UnsupportedEngineBuild:
            assert not verified or corr.counters.verified_ubatches < VERIFY_UBATCHES

    fuzz_for_budget(one)


# ------------------------------------------------------------------ CUPTI shm ring
REC_TYPES = st.sampled_from(
    [
        sr.REC_KERNEL,
        sr.REC_LAUNCH_API,
        sr.REC_MEMCPY,
        sr.REC_WATCHED_BUFFER,
        sr.REC_WATCHED_GRAPH_BUFFER,
        sr.REC_ERROR,
        sr.REC_PAD,
        0,
        9,
    ]
)
CAPACITY = 4096


@st.composite
def shm_ring_file(draw: st.DrawFn) -> bytes:
    header = bytearray(sr.HEADER_SIZE)
    struct.pack_into(
        "<QIIQII",
        header,
        0,
        sr.MAGIC,
        sr.VERSION,
        sr.HEADER_SIZE,
        CAPACITY,
        1,
        draw(st.sampled_from([0, 1, 7])),
    )
    struct.pack_into("<QQQ", header, 32, *draw(st.tuples(WORDS, WORDS, WORDS)))
    data = bytearray(CAPACITY)
    off = tail = draw(st.integers(0, CAPACITY // 8 - 1)) * 8
    for _ in range(draw(st.integers(0, 8))):
        rtype = draw(REC_TYPES)
        payload = bytearray(draw(st.binary(max_size=160)))
        for _ in range(draw(st.integers(0, 3))):  # sizes inside the payload (name_len, text_len, ndim...)
            if len(payload) >= 4:
                at = draw(st.integers(0, len(payload) - 4)) // 4 * 4
                payload[at : at + 4] = (draw(WORDS) & 0xFFFF_FFFF).to_bytes(4, "little")
        length = 8 + len(payload)
        if draw(st.integers(0, 5)) == 0:
            length = draw(WORDS) & 0xFFFF_FFFF  # a length that lies
        rec = struct.pack("<IHH", length, rtype, 0) + bytes(payload)
        rec += b"\0" * (-len(rec) % 8)
        if off + len(rec) > CAPACITY:
            break
        data[off : off + len(rec)] = rec
        off += len(rec)
    head = tail + (off - tail if draw(st.booleans()) else draw(WORDS))
    struct.pack_into("<Q", header, 64, head & ((1 << 64) - 1))
    struct.pack_into("<Q", header, 128, tail)
    struct.pack_into("<I", header, 56, draw(st.integers(0, 1)))
    raw = bytes(header + data)
    if draw(st.integers(0, 9)) == 0:
        raw = raw[: draw(st.integers(0, len(raw)))]
    return raw


def test_fuzz_cupti_shm_ring(scratch: Path) -> None:
    path = scratch / "sparseety-prof-cupti.1"

    @rounds(200)
    @given(shm_ring_file())
    def one(raw: bytes) -> None:
        path.write_bytes(raw)
        os.chmod(path, 0o600)
        try:
            with sr.ShmRing(path) as ring:
                for _ in range(3):
                    ring.drain(max_records=64)
                ring.counters()
        except sr.RingError:
            pass

    fuzz_for_budget(one)


# ------------------------------------------------------------------ HTTP request heads
LINE = st.binary(max_size=40).map(lambda b: b.replace(b"\r\n", b""))
HEADER_LINES = st.lists(
    st.one_of(
        st.tuples(st.sampled_from([b"X-Request-Id", b"x-request-id", b" X-REQUEST-ID ", b"Host"]), LINE),
        st.tuples(LINE, LINE),
    ).map(lambda kv: kv[0] + b":" + kv[1]),
    max_size=6,
)


@st.composite
def http_reads(draw: st.DrawFn) -> bytes:
    heads = []
    for _ in range(draw(st.integers(1, 3))):
        first = draw(
            st.sampled_from([b"POST /completion HTTP/1.1", b"GET / HTTP/1.0", b"GET  HTTP/1.1", b""])
        )
        body = b"\r\n".join([first, *draw(HEADER_LINES)]) + draw(st.sampled_from([b"\r\n\r\n", b"\r\n", b""]))
        heads.append(body + draw(st.binary(max_size=30)))
    data = b"".join(heads)
    return data[: draw(st.integers(0, len(data)))] if draw(st.booleans()) else data


def test_fuzz_http_header_parser() -> None:
    @rounds(500)
    @given(
        st.lists(st.tuples(http_reads(), st.integers(0, 3), st.integers(-2, 5)), max_size=8),
        st.binary(max_size=200),
    )
    def one(reads: list[tuple[bytes, int, int]], raw: bytes) -> None:
        parse_request_head(raw, "X-Request-Id")
        t = ServingTracker(pid=1)
        for data, tid, task in reads:
            parsed = parse_request_head(data, "X-Request-Id")
            if parsed is not None and parsed[2] is not None:
                assert len(parsed[2]) <= 256 and "\r\n" not in parsed[2]
            t.on_http(tid=tid, t_ns=1, data=data)
            t.on_task_post(tid, task, task % 2 == 0, task * 8)
            t.on_slot_launch(2, task % 2, task)

    fuzz_for_budget(one)


# ------------------------------------------------------------------ damaged recordings
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
META_KEYS = st.sampled_from(
    [
        "engine",
        "model",
        "target",
        "losses",
        "tables",
        "layers",
        "complete",
        "redacted",
        "format",
        "schema_version",
    ]
)


@st.composite
def damage(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """What to do to a copy of a good recording: meta.json changes, segment bytes, files."""
    steps: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 4))):
        what = draw(st.sampled_from(["meta_key", "meta_sub", "meta_bytes", "segment", "remove", "extra"]))
        if what == "meta_key":
            steps.append((what, (draw(META_KEYS), draw(JSON_VALUES))))
        elif what == "meta_sub":
            steps.append((what, (draw(META_KEYS), draw(st.text(max_size=8)), draw(JSON_VALUES))))
        elif what == "meta_bytes":
            steps.append((what, (draw(st.integers(0, 400)), draw(st.binary(min_size=1, max_size=4)))))
        elif what == "segment":
            steps.append((what, (draw(st.sampled_from(["tokens", "steps"])), draw(st.integers(0, 2000)),
                                 draw(st.binary(min_size=1, max_size=8)), draw(st.booleans()))))  # fmt: skip
        elif what == "remove":
            steps.append((what, draw(st.sampled_from(["tokens", "steps"]))))
        else:
            steps.append((what, (draw(st.sampled_from(["tokens", "kernels"])), draw(st.binary(max_size=64)))))
    return steps


def _apply(rec: Path, steps: list[tuple[str, Any]]) -> None:
    meta_path = rec / recording.META_FILE
    for what, arg in steps:
        if what in ("meta_key", "meta_sub"):
            try:
                meta = json.loads(meta_path.read_text())
            except (ValueError, UnicodeDecodeError):
                continue
            if not isinstance(meta, dict):
                continue
            if what == "meta_key":
                meta[arg[0]] = arg[1]
            elif isinstance(meta.get(arg[0]), dict):
                meta[arg[0]][arg[1]] = arg[2]
            meta_path.write_text(json.dumps(meta))
        elif what == "meta_bytes":
            b = bytearray(meta_path.read_bytes())
            at = arg[0] % max(1, len(b))
            b[at : at + len(arg[1])] = arg[1]
            meta_path.write_bytes(bytes(b))
        elif what == "segment":
            table, at, data, cut = arg
            for seg in sorted((rec / table).glob("*.parquet")):
                b = bytearray(seg.read_bytes())
                at %= max(1, len(b))
                b[at : at + len(data)] = data
                seg.write_bytes(bytes(b[:at] if cut else b))
        elif what == "remove":
            for seg in sorted((rec / arg).glob("*.parquet"))[:1]:
                seg.unlink()
        else:
            (rec / arg[0]).mkdir(exist_ok=True)
            (rec / arg[0] / "seg-000007.parquet").write_bytes(arg[1])


def _cli(*args: str) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return cli.main(list(args))


def test_fuzz_recording_loader_report_and_diff(scratch: Path) -> None:
    good = small_recording(scratch / "good")

    @rounds(20)
    @given(damage())
    def one(steps: list[tuple[str, Any]]) -> None:
        rec = scratch / "damaged"
        shutil.rmtree(rec, ignore_errors=True)
        shutil.copytree(good, rec)
        _apply(rec, steps)
        for skip in (False, True):
            try:
                r = recording.open(rec, skip_damaged=skip)
                for table in ("tokens", "steps", "routes", "masks", "requests", "kernels"):
                    r.table(table)
            except ProfError as e:
                assert isinstance(e, CorruptRecording | UsageError), e
        assert _cli("report", str(rec)) in (0, 7)
        assert _cli("diff", str(good), str(rec)) in (0, 1, 7)
        assert _cli("diff", str(rec), str(rec)) in (0, 7)

    fuzz_for_budget(one)


# ------------------------------------------------------------------ hostile recording files
# Not only bytes: the kinds, sizes and contents a recording from elsewhere may hold (issue 60).
# Every reader must refuse them at once (store/recording_files.py): a FIFO that blocked, or a
# bomb that was decoded, would hang the round or exhaust the machine, not only fail an assert.
FILE_TARGETS = ("meta.json", "tokens/part-000000.parquet", "steps/part-000000.parquet", "tokens")
FILE_KINDS = ("fifo", "directory", "socket", "link_dev_zero", "link_regular", "link_dangling", "hard_link")


@st.composite
def file_attacks(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """File-type, size, nesting and compression-ratio mutations of a recording."""
    steps: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["kind", "size", "nesting", "ratio", "rows_lie"]))
        if what == "kind":
            steps.append((what, (draw(st.sampled_from(FILE_TARGETS)), draw(st.sampled_from(FILE_KINDS)))))
        elif what == "size":
            size = draw(st.sampled_from([0, 1, 7, 8, 12, 4 << 20, (4 << 20) + 1, 2 << 30, (4 << 30) + 1]))
            steps.append((what, (draw(st.sampled_from(FILE_TARGETS[:3])), size)))
        elif what == "nesting":
            steps.append((what, (draw(st.sampled_from("[{")), draw(st.integers(0, 200_000)))))
        elif what == "ratio":
            steps.append(
                (
                    what,
                    (
                        draw(st.integers(0, 50_000)),  # rows
                        draw(st.integers(0, 400)),  # top_ids per row
                        draw(st.integers(0, 2_000)),  # bytes of token text
                        draw(st.sampled_from(["zstd", "lz4", "snappy", "gzip", "uncompressed"])),
                        draw(st.sampled_from([None, 0, 1, -1, 10**12])),  # meta.json's count
                    ),
                )
            )
        else:
            steps.append((what, (draw(st.sampled_from(["tokens", "steps"])), draw(st.integers(-5, 10**9)))))
    return steps


def _set_meta_rows(rec: Path, table: str, rows: int) -> None:
    meta_path = rec / recording.META_FILE
    if not meta_path.is_file() or meta_path.is_symlink() or meta_path.stat().st_size > 1 << 20:
        return  # a FIFO, a link to /dev/zero, a sparse gigabyte: the mutation's own reading would hang
    try:
        meta = json.loads(meta_path.read_text())
        meta["tables"][table]["rows"] = rows
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return  # meta.json is already something else
    (rec / recording.META_FILE).write_text(json.dumps(meta))


def _clear(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


def _apply_file_attacks(rec: Path, steps: list[tuple[str, Any]], scratch: Path) -> None:
    meta_path = rec / recording.META_FILE
    for what, arg in steps:
        if what == "kind":
            target, kind = rec / arg[0], arg[1]
            if not (target.exists() or target.is_symlink()):
                continue
            elsewhere = scratch / "elsewhere"
            if kind in ("link_regular", "hard_link") and target.is_file() and target.stat().st_size < 1 << 20:
                # read first: the target may already be a link to `elsewhere` (an earlier step)
                data = target.read_bytes()
                elsewhere.unlink(missing_ok=True)
                elsewhere.write_bytes(data)
            _clear(target)
            if kind == "fifo":
                os.mkfifo(target)
            elif kind == "directory":
                target.mkdir()
            elif kind == "socket":
                short = Path(tempfile.mkdtemp(prefix="f60-", dir="/tmp")) / "s"
                with socket.socket(socket.AF_UNIX) as s:
                    s.bind(str(short))
                os.rename(short, target)
                short.parent.rmdir()
            elif kind == "link_dev_zero":
                target.symlink_to("/dev/zero")
            elif kind == "link_dangling":
                target.symlink_to(scratch / "nothing-here")
            elif elsewhere.exists() and kind == "link_regular":
                target.symlink_to(elsewhere)
            elif elsewhere.exists():
                os.link(elsewhere, target)
        elif what == "size":
            target = rec / arg[0]
            if target.is_file() and not target.is_symlink():
                os.truncate(target, arg[1])  # beyond the end: a sparse file of holes
        elif what == "nesting":
            opening, depth = arg
            body = ('{"a":' * depth + "1" + "}" * depth) if opening == "{" else "[" * depth + "]" * depth
            if meta_path.is_file() and not meta_path.is_symlink():
                meta_path.write_text(body)
        elif what == "ratio":
            rows, per_row, text_len, codec, count = arg
            seg = rec / "tokens" / "part-000000.parquet"
            if not seg.is_file() or seg.is_symlink() or seg.stat().st_size > 1 << 20:
                continue
            try:
                base = pl.read_parquet(seg).head(1)
            except Exception:
                continue
            if base.height == 0:
                continue
            df = base.select(pl.all().gather(np.zeros(rows, np.int64))).with_columns(
                pl.Series("top_ids", np.zeros(rows * per_row, np.int32))
                .reshape((rows, per_row))
                .cast(pl.List(pl.Int32))
                if rows and per_row
                else pl.lit(None, pl.List(pl.Int32)).alias("top_ids"),
                pl.repeat("t" * text_len, rows, eager=True).alias("token_text"),
            )
            df.write_parquet(seg, compression=codec)
            _set_meta_rows(rec, "tokens", rows if count is None else count)
        else:
            _set_meta_rows(rec, arg[0], arg[1])


def _cli_within(*args: str) -> int:
    code: int = within(60, lambda: _cli(*args))
    return code


def test_fuzz_recording_file_types_sizes_and_ratios(scratch: Path) -> None:
    good = small_recording(scratch / "good-files")

    @rounds(10)
    @given(file_attacks())
    def one(steps: list[tuple[str, Any]]) -> None:
        rec = scratch / "hostile"
        for p in (rec, scratch / "elsewhere"):
            _clear(p)
        shutil.copytree(good, rec)
        _apply_file_attacks(rec, steps, scratch)

        def read_all() -> None:
            try:
                r = recording.open(rec)
                for table in ("tokens", "steps", "routes", "masks", "requests", "kernels"):
                    r.table(table)
            except ProfError as e:
                assert isinstance(e, CorruptRecording | UsageError), e
                assert "\n" not in str(e), str(e)

        within(60, read_all)
        assert _cli_within("report", str(rec)) in (0, 7)
        assert _cli_within("diff", str(good), str(rec)) in (0, 1, 7)

    fuzz_for_budget(one)


# ------------------------------------------------------------------ what the fuzzers found
def test_found_a_mask_count_record_whose_name_is_not_the_probes() -> None:
    """An attention record flagged as a kq_mask count whose name does not end in the call's digit
    raised ValueError out of the correlator (int(b"t"))."""
    from sparseety_prof.correlate.step_sparse import StepSparse

    rec = np.zeros(1, ev.ATTN_DTYPE)
    rec["kind"], rec["aflags"], rec["name"], rec["n_counted"] = (
        ev.EV_ATTN,
        ev.ATT_FLAG_KV_MASK,
        b"ffn_moe_topk-0",
        1,
    )
    r = {n: (rec[n][0] if ev.ATTN_DTYPE[n].shape else rec[n][0].item()) for n in ev.ATTN_DTYPE.names or ()}
    sp = StepSparse()
    assert sp.add_attn(r) is None and not sp.kv_masks
    r["name"] = b"kq_mask-3"
    sp.add_attn(r)
    assert list(sp.kv_masks) == [3]
