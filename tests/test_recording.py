from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

import sparseety_prof
from sparseety_prof.errors import CorruptRecording, UsageError
from sparseety_prof.store import recording, recording_writer, schema
from sparseety_prof.store.output_dir import sudo_owner
from sparseety_prof.store.recording import META_FILE
from sparseety_prof.store.recording_writer import RecordingWriter


# ------------------------------------------------------------------ record builders
def tokens_frame(n: int, *, start: int = 0, seq_ids: tuple[int, ...] = (0, 1)) -> pl.DataFrame:
    """`n` realistic token rows; rows of one step share t_end_ns, one row per sequence."""
    rows: dict[str, list[object]] = {c: [] for c in schema.TOKENS}
    for k in range(start, start + n):
        step, seq = divmod(k, len(seq_ids))
        first = step == 0
        rows["request_id"].append(f"r0-{seq_ids[seq]}-0")
        rows["ctx_id"].append(0)
        rows["seq_id"].append(seq_ids[seq])
        rows["decode_order"].append(None if k % 7 == 3 else step)
        rows["pos"].append(10 + step)
        rows["logits_pos"].append(9 + step)
        rows["phase"].append(schema.PHASE_PREFILL if first else schema.PHASE_DECODE)
        rows["token_id"].append(300 + k)
        rows["token_text"].append(None if k % 5 == 4 else ["▁the", " café", "日本", "\n", "<0xE2>"][k % 5])
        rows["token_source"].append(schema.SOURCE_SAMPLER)
        rows["log_prob"].append(-0.25 * (k % 4))
        rows["top_ids"].append(None if k % 6 == 5 else [300 + k, 1, 2, 3, 4][: schema.TOP_K])
        rows["top_log_probs"].append(None if k % 6 == 5 else [-0.1, -1.5, -2.0, -3.25, -4.0])
        rows["entropy"].append(0.5 + (k % 3))
        rows["step_id"].append(step)
        rows["t_start_ns"].append(1_000_000 * step)
        rows["t_end_ns"].append(1_000_000 * step + 900_000)
        rows["ts_unix_ms"].append(1_739_000_000_000 + step)
        rows["batch_size"].append(12 if first else len(seq_ids))
        rows["partial"].append(k % 7 == 3)
        rows["pid"].append(4242)
        rows["tid"].append(4243)
        rows["expert_ids"].append(None if k % 4 == 1 else [[k % 8, (k + 3) % 8], [1, 2]])
        rows["expert_weights"].append(None if k % 4 == 1 else [[0.75, 0.25], [0.5, 0.5]])
        rows["router_probs"].append(None)
        rows["act_zero_ratio"].append([0.5, 0.25 * (k % 3)])
        rows["act_below_ratio"].append([0.75, 0.5])
        rows["attn_attended"].append([9 + step, min(9 + step, 4)])
        rows["attn_total"].append(10 + step)
        rows["kv_cells_used"].append(10 + step)
        rows["slowest_layer"].append(None if first else step % 2)
        rows["slowest_layer_ms"].append(None if first else 0.125 * (k % 3 + 1))
        rows["slowest_tid"].append(None if first else 4243)
    return schema.frame("tokens", rows)


def steps_frame(n: int, *, start: int = 0) -> pl.DataFrame:
    rows: dict[str, list[object]] = {c: [] for c in schema.STEPS}
    for s in range(start, start + n):
        ntok = 12 if s == 0 else 2
        rows["step_id"].append(s)
        rows["ctx_id"].append(0)
        rows["decode_id"].append(s)
        rows["t_start_ns"].append(1_000_000 * s)
        rows["t_end_ns"].append(1_000_000 * s + 900_000)
        rows["ts_unix_ms"].append(1_739_000_000_000 + s)
        rows["n_tokens"].append(ntok)
        rows["n_outputs"].append(2)
        rows["phase"].append(schema.PHASE_PREFILL if s == 0 else schema.PHASE_DECODE)
        rows["prompt_rows"].append(ntok if s == 0 else 0)
        rows["decode_rows"].append(0 if s == 0 else ntok)
        rows["seq_ids"].append([0, 1])
        rows["token_ids"].append(list(range(ntok)))
        rows["positions"].append(list(range(ntok)))
        rows["row_seq_ids"].append([i % 2 for i in range(ntok)])
        rows["output_rows"].append([ntok - 2, ntok - 1])
        rows["truncated"].append(None if s == 3 else False)
        rows["pid"].append(4242)
        rows["tid"].append(4243)
    return schema.frame("steps", rows)


META = {"pid": 4242, "engine": "llama-cpp-python", "started_unix_ms": 1_739_000_000_000}


def all_paths(root: Path) -> Iterator[Path]:
    yield root
    yield from root.rglob("*")


# ------------------------------------------------------------------ roundtrip
def test_roundtrip_preserves_rows_dtypes_lists_and_nulls(tmp_path: Path) -> None:
    tokens, steps = tokens_frame(40), steps_frame(20)
    w = RecordingWriter(tmp_path / "rec", META)
    # out of order on purpose: the reader sorts
    w.append("tokens", tokens.slice(20))
    w.append("tokens", tokens.slice(0, 20))
    w.append("steps", steps.reverse())
    w.close(lost_events=0, ended_unix_ms=1_739_000_000_999)

    rec = sparseety_prof.open(tmp_path / "rec")
    assert rec.complete
    assert not rec.redacted
    assert rec.meta["pid"] == 4242
    assert rec.meta["lost_events"] == 0
    assert rec.meta["schema_version"] == schema.SCHEMA_VERSION
    assert rec.meta["format"] == recording.FORMAT
    assert rec.meta["tables"] == {
        **{t: {"rows": 0, "segments": 0} for t in schema.TABLES},  # every table, empty ones too
        "tokens": {"rows": 40, "segments": 1},
        "steps": {"rows": 20, "segments": 1},
    }
    assert dict(rec.tokens().schema) == schema.TOKENS
    assert dict(rec.steps().schema) == schema.STEPS
    assert_frame_equal(rec.tokens(), tokens)
    assert_frame_equal(rec.steps(), steps)
    assert_frame_equal(rec.table("steps"), steps)


def test_tokens_are_ordered_by_step_end_then_sequence(tmp_path: Path) -> None:
    df = tokens_frame(6, seq_ids=(3, 1, 2))
    with RecordingWriter(tmp_path / "rec", META) as w:
        w.append("tokens", df)
    got = sparseety_prof.open(tmp_path / "rec").tokens()
    assert got["seq_id"].to_list() == [1, 2, 3, 1, 2, 3]
    assert got["t_end_ns"].is_sorted()


def test_absent_tables_read_as_empty_frames_with_schema_dtypes(tmp_path: Path) -> None:
    RecordingWriter(tmp_path / "rec", META).close()
    rec = sparseety_prof.open(tmp_path / "rec")
    assert rec.tokens().height == 0
    assert dict(rec.tokens().schema) == schema.TOKENS
    assert dict(rec.steps().schema) == schema.STEPS
    with pytest.raises(ValueError, match="unknown table"):
        rec.table("nope")


def test_open_is_exported_at_package_level() -> None:
    assert sparseety_prof.open is recording.open
    assert sparseety_prof.Recording is recording.Recording


# ------------------------------------------------------------------ segments
def test_rows_are_split_into_segments_that_scan_parquet_reads(tmp_path: Path) -> None:
    w = RecordingWriter(tmp_path / "rec", META, segment_rows=10)
    df = tokens_frame(35)
    w.append("tokens", df.slice(0, 4))
    w.append("tokens", df.slice(4, 27))  # crosses three segment boundaries
    parts = sorted(p.name for p in (tmp_path / "rec" / "tokens").iterdir())
    assert parts == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    assert w.rows_written("tokens") == 30
    w.append("tokens", df.slice(31))
    w.close()
    parts = sorted(p.name for p in (tmp_path / "rec" / "tokens").iterdir())
    assert parts[-1] == "part-000003.parquet" and len(parts) == 4
    sizes = [pl.read_parquet(tmp_path / "rec" / "tokens" / p).height for p in parts]
    assert sizes == [10, 10, 10, 5]
    scanned = pl.scan_parquet(tmp_path / "rec" / "tokens" / "*.parquet").collect()
    assert scanned.height == 35
    assert dict(scanned.schema) == schema.TOKENS
    assert_frame_equal(sparseety_prof.open(tmp_path / "rec").tokens(), df)


def test_flush_writes_a_partial_segment(tmp_path: Path) -> None:
    w = RecordingWriter(tmp_path / "rec", META)
    w.append("steps", steps_frame(3))
    assert not (tmp_path / "rec" / "steps").exists()
    w.flush()
    assert [p.name for p in (tmp_path / "rec" / "steps").iterdir()] == ["part-000000.parquet"]
    meta = json.loads((tmp_path / "rec" / META_FILE).read_text())
    assert meta["tables"]["steps"] == {"rows": 3, "segments": 1}
    assert meta["complete"] is False


def test_flush_in_steps_writes_one_table_per_step_and_meta_json_last(tmp_path: Path) -> None:
    """RecordingWriter.flush_steps: the consumer drains between its steps (session/flush_round.py);
    rows appended in between are written by their table's step when it comes later."""
    w = RecordingWriter(tmp_path / "rec", META)
    tok, st = tokens_frame(6), steps_frame(4)
    w.append("tokens", tok.slice(0, 4))
    w.append("steps", st.slice(0, 3))
    steps = w.flush_steps()
    assert next(steps) == "segment tokens"  # tokens come first in schema.TABLES
    assert [p.name for p in (tmp_path / "rec" / "tokens").iterdir()] == ["part-000000.parquet"]
    assert not (tmp_path / "rec" / "steps").exists()
    assert json.loads((tmp_path / "rec" / META_FILE).read_text())["tables"]["tokens"]["rows"] == 0
    w.append("steps", st.slice(3))  # a drain between two steps
    w.append("tokens", tok.slice(4))
    assert next(steps) == "segment steps"
    assert pl.read_parquet(tmp_path / "rec" / "steps" / "part-000000.parquet").height == 4
    assert list(steps) == [META_FILE]
    tables = json.loads((tmp_path / "rec" / META_FILE).read_text())["tables"]
    assert tables["steps"] == {"rows": 4, "segments": 1} and tables["tokens"] == {"rows": 4, "segments": 1}
    late = w.flush_steps()
    w.close()  # writes the tokens appended late; a step after it does nothing
    assert list(late) == []
    r = sparseety_prof.open(tmp_path / "rec")
    assert_frame_equal(r.tokens(), tok)
    assert_frame_equal(r.steps(), st)


def test_a_failed_segment_write_leaves_no_file_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = RecordingWriter(tmp_path / "rec", META, segment_rows=5)
    w.append("tokens", tokens_frame(5))

    def interrupted(self: pl.DataFrame, f: object, **kw: object) -> None:
        assert hasattr(f, "write")
        f.write(b"PAR1 half a segment")
        raise KeyboardInterrupt

    monkeypatch.setattr(pl.DataFrame, "write_parquet", interrupted)
    with pytest.raises(KeyboardInterrupt):
        w.append("tokens", tokens_frame(5, start=5))
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "rec" / "tokens").iterdir()) == ["part-000000.parquet"]
    rec = sparseety_prof.open(tmp_path / "rec")
    assert rec.tokens().height == 5
    assert not rec.complete


def test_leftover_temp_files_are_never_read_as_segments(tmp_path: Path) -> None:
    w = RecordingWriter(tmp_path / "rec", META)
    w.append("tokens", tokens_frame(4))
    w.close()
    (tmp_path / "rec" / "tokens" / ".part-000001.parquet.tmp").write_bytes(b"PAR1 garbage")
    (tmp_path / "rec" / ".meta.json.tmp").write_text("{")
    assert sparseety_prof.open(tmp_path / "rec").tokens().height == 4
    assert pl.scan_parquet(tmp_path / "rec" / "tokens" / "*.parquet").collect().height == 4


# ------------------------------------------------------------------ permissions, ownership
def test_files_are_0600_and_directories_0700_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        w = RecordingWriter(tmp_path / "deep" / "er" / "rec", META, segment_rows=3)
        w.append("tokens", tokens_frame(4))
        w.append("steps", steps_frame(4))
        w.close()
    finally:
        os.umask(old)
    root = tmp_path / "deep"
    seen = 0
    for p in all_paths(root):
        mode = stat.S_IMODE(p.lstat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), f"{p}: {oct(mode)}"
        seen += 1
    assert seen == 3 + 1 + 2 + 2 + 2  # deep, er, rec; meta.json; 2 table dirs; 2 + 2 segments


def test_an_existing_empty_directory_is_used_but_its_mode_left_alone(tmp_path: Path) -> None:
    # the writer never changes the mode or owner of a directory it did not create (issue 18):
    # what it creates inside is private whatever the directory's mode
    d = tmp_path / "rec"
    d.mkdir()
    d.chmod(0o755)
    w = RecordingWriter(d, META, segment_rows=2)
    w.append("tokens", tokens_frame(3))
    w.close()
    assert stat.S_IMODE(d.stat().st_mode) == 0o755
    for p in d.rglob("*"):
        mode = stat.S_IMODE(p.lstat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), f"{p}: {oct(mode)}"
    assert sparseety_prof.open(d).complete


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_everything_is_chowned_to_the_owner(tmp_path: Path) -> None:
    w = RecordingWriter(tmp_path / "new" / "rec", META, owner=(65534, 65534), segment_rows=2)
    w.append("tokens", tokens_frame(3))
    w.append("steps", steps_frame(1))
    w.update_meta(note="x")
    w.close()
    paths = list(all_paths(tmp_path / "new"))
    assert len(paths) >= 7
    for p in paths:
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (65534, 65534), p


def test_sudo_owner_reads_sudo_uid_and_gid_only_as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUDO_UID", "1000")
    monkeypatch.setenv("SUDO_GID", "1001")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert sudo_owner() == (1000, 1001)
    monkeypatch.setenv("SUDO_GID", "x")
    assert sudo_owner() is None
    monkeypatch.delenv("SUDO_GID")
    assert sudo_owner() is None
    monkeypatch.setenv("SUDO_GID", "1001")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert sudo_owner() is None


# ------------------------------------------------------------------ redaction
def test_redaction_nulls_token_text_but_keeps_the_column(tmp_path: Path) -> None:
    df = tokens_frame(10)
    w = RecordingWriter(tmp_path / "rec", META, redact_text=True)
    w.append("tokens", df)
    w.close()
    rec = sparseety_prof.open(tmp_path / "rec")
    assert rec.redacted and rec.meta["redacted"] is True
    got = rec.tokens()
    assert dict(got.schema) == schema.TOKENS
    assert got["token_text"].null_count() == 10
    assert_frame_equal(got.drop("token_text"), df.drop("token_text"))
    raw = pl.read_parquet(tmp_path / "rec" / "tokens" / "part-000000.parquet")
    assert raw["token_text"].null_count() == 10


def test_without_redaction_text_is_kept(tmp_path: Path) -> None:
    with RecordingWriter(tmp_path / "rec", META) as w:
        w.append("tokens", tokens_frame(3))
    rec = sparseety_prof.open(tmp_path / "rec")
    assert rec.meta["redacted"] is False
    assert rec.tokens()["token_text"].to_list() == ["▁the", " café", "日本"]


# ------------------------------------------------------------------ writer misuse
def test_frames_that_do_not_match_the_schema_are_rejected(tmp_path: Path) -> None:
    w = RecordingWriter(tmp_path / "rec", META)
    df = tokens_frame(2)
    with pytest.raises(ValueError, match=r"wrong dtypes token_id: Int64"):
        w.append("tokens", df.with_columns(pl.col("token_id").cast(pl.Int64)))
    with pytest.raises(ValueError, match=r"missing columns \['entropy'\]"):
        w.append("tokens", df.drop("entropy"))
    with pytest.raises(ValueError, match=r"unexpected columns \['extra'\]"):
        w.append("tokens", df.with_columns(pl.lit(1).alias("extra")))
    with pytest.raises(ValueError, match="out of order"):
        w.append("tokens", df.select(reversed(df.columns)))
    with pytest.raises(ValueError, match="unknown table"):
        w.append("nope", df)
    with pytest.raises(ValueError, match="set by the writer"):
        w.update_meta(complete=True)
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.append("tokens", df)
    w.close()  # a second close is harmless


def test_an_existing_recording_is_never_overwritten(tmp_path: Path) -> None:
    RecordingWriter(tmp_path / "rec", META).close()
    with pytest.raises(UsageError, match=r"already holds a recording.*choose another"):
        RecordingWriter(tmp_path / "rec", META)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not empty"):
        RecordingWriter(tmp_path / "other", META)
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="not a directory"):
        RecordingWriter(tmp_path / "file", META)


# ------------------------------------------------------------------ interrupted recordings
def test_a_recording_that_was_never_closed_is_readable_and_incomplete(tmp_path: Path) -> None:
    w = RecordingWriter(tmp_path / "rec", META, segment_rows=4)
    w.append("tokens", tokens_frame(10))  # two segments written, two rows only buffered
    w.append("steps", steps_frame(2))
    del w  # the process died: no close
    rec = sparseety_prof.open(tmp_path / "rec")
    assert not rec.complete
    assert rec.tokens().height == 8
    assert rec.steps().height == 0


def test_an_exception_inside_the_with_block_keeps_rows_but_not_completeness(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), RecordingWriter(tmp_path / "rec", META) as w:
        w.append("steps", steps_frame(2))
        raise RuntimeError("engine went away")
    rec = sparseety_prof.open(tmp_path / "rec")
    assert not rec.complete
    assert rec.steps().height == 2


# ------------------------------------------------------------------ corruption
@pytest.fixture
def rec_dir(tmp_path: Path) -> Path:
    w = RecordingWriter(tmp_path / "rec", META, segment_rows=5)
    w.append("tokens", tokens_frame(12))
    w.append("steps", steps_frame(3))
    w.close()
    return tmp_path / "rec"


def test_missing_meta_is_corrupt(rec_dir: Path) -> None:
    (rec_dir / META_FILE).unlink()
    with pytest.raises(CorruptRecording, match=r"meta\.json is missing"):
        sparseety_prof.open(rec_dir)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"format": "sparseety-prof-rec', r"meta\.json is not valid JSON \(.* line 1 column"),
        ("[1, 2]", r"meta\.json must hold a JSON object"),
        ('{"format": "something-else", "schema_version": 1}', r"format 'something-else'.*not a sparseety"),
        ('{"schema_version": 1}', r"format None"),
        ('{"format": "sparseety-prof-recording", "schema_version": "1"}', "invalid schema_version"),
        (
            '{"format": "sparseety-prof-recording", "schema_version": 999}',
            r"schema version 999.*upgrade sparseety-prof",
        ),
    ],
)
def test_bad_meta_is_corrupt(rec_dir: Path, content: str, message: str) -> None:
    (rec_dir / META_FILE).write_text(content)
    with pytest.raises(CorruptRecording, match=message) as exc:
        sparseety_prof.open(rec_dir)
    assert str(rec_dir / META_FILE) in str(exc.value)


def test_a_truncated_segment_is_corrupt_and_named(rec_dir: Path) -> None:
    seg = rec_dir / "tokens" / "part-000001.parquet"
    data = seg.read_bytes()
    seg.write_bytes(data[: len(data) // 2])
    rec = sparseety_prof.open(rec_dir)
    assert rec.steps().height == 3  # other tables still read
    with pytest.raises(
        CorruptRecording, match=r"part-000001\.parquet is not a readable Parquet segment"
    ) as exc:
        rec.tokens()
    assert str(seg) in str(exc.value)
    assert "skip_damaged=True" in str(exc.value)
    assert exc.value.__cause__ is None and exc.value.__context__ is None  # no polars traceback


def test_a_segment_that_is_not_parquet_at_all_is_corrupt(rec_dir: Path) -> None:
    seg = rec_dir / "steps" / "part-000000.parquet"
    seg.write_bytes(b"")
    with pytest.raises(CorruptRecording, match=r"steps/part-000000\.parquet is not a readable"):
        sparseety_prof.open(rec_dir).steps()


def test_a_segment_with_other_columns_is_corrupt(rec_dir: Path) -> None:
    seg = rec_dir / "tokens" / "part-000002.parquet"
    pl.read_parquet(seg).drop("entropy").with_columns(pl.col("pid").cast(pl.Int64)).write_parquet(seg)
    with pytest.raises(
        CorruptRecording, match=r"part-000002\.parquet does not match the tokens table schema"
    ) as e:
        sparseety_prof.open(rec_dir).tokens()
    assert "missing columns ['entropy']" in str(e.value)
    assert "pid: Int64 (expected Int32)" in str(e.value)


def test_a_missing_segment_is_corrupt(rec_dir: Path) -> None:
    (rec_dir / "tokens" / "part-000001.parquet").unlink()
    with pytest.raises(CorruptRecording, match=r"part-000001\.parquet is missing"):
        sparseety_prof.open(rec_dir).tokens()


def test_a_removed_last_segment_of_a_closed_recording_is_corrupt(rec_dir: Path) -> None:
    (rec_dir / "tokens" / "part-000002.parquet").unlink()
    with pytest.raises(CorruptRecording, match=r"holds 2 segments but .*meta\.json records 3"):
        sparseety_prof.open(rec_dir).tokens()


def test_opening_a_path_that_is_not_a_directory_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        sparseety_prof.open(tmp_path / "nothing")


def test_skip_damaged_reads_the_intact_segments_and_lists_the_rest(rec_dir: Path) -> None:
    seg = rec_dir / "tokens" / "part-000001.parquet"
    seg.write_bytes(seg.read_bytes()[:100])
    (rec_dir / "tokens" / "part-000002.parquet").unlink()
    (rec_dir / "tokens" / "part-000000.parquet").rename(rec_dir / "tokens" / "part-000003.parquet")
    rec = sparseety_prof.open(rec_dir, skip_damaged=True)
    assert rec.tokens().height == 5
    assert len(rec.damaged) == 3
    assert "part-000000.parquet is missing" in rec.damaged[0]
    assert "part-000002.parquet is missing" in rec.damaged[1]
    assert "part-000001.parquet is not a readable Parquet segment" in rec.damaged[2]
    assert rec.steps().height == 3


# ------------------------------------------------------------------ --max-disk: rotation
def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in all_paths(root) if p.is_file())


def test_max_disk_keeps_the_newest_rows_within_the_budget(tmp_path: Path) -> None:
    budget = recording_writer.MIN_MAX_DISK
    rec_path = tmp_path / "rec"
    peak, total = 0, 0
    with RecordingWriter(rec_path, {"run": 1}, segment_rows=500, max_disk=budget) as w:
        for i in range(120):
            w.append("tokens", tokens_frame(500, start=i * 500))
            w.flush()
            total += 500
            peak = max(peak, _disk_bytes(rec_path))
    segment = max(p.stat().st_size for p in (rec_path / "tokens").iterdir())
    assert peak <= budget + segment  # over by at most the segment being written
    rec = sparseety_prof.open(rec_path)
    assert rec.complete
    tokens = rec.tokens()
    rotation = rec.meta["rotation"]
    assert rotation["max_disk_bytes"] == budget and rotation["segments_removed"] > 0
    assert rotation["rows_removed"]["tokens"] + tokens.height == total  # counted, not lost
    # what remains is the latest stretch, without gaps
    assert sorted(tokens["token_id"].to_list()) == list(range(300 + total - tokens.height, 300 + total))
    assert rec.meta["tables"]["tokens"]["first_segment"] == rotation["segments_removed"]
    assert "losses" not in rec.meta or not rec.meta["losses"].get("rows_not_written")


def test_a_segment_left_behind_by_a_kill_during_rotation_is_ignored(tmp_path: Path) -> None:
    rec_path = tmp_path / "rec"
    with RecordingWriter(rec_path, {}, segment_rows=500, max_disk=recording_writer.MIN_MAX_DISK) as w:
        for i in range(120):
            w.append("tokens", tokens_frame(500, start=i * 500))
            w.flush()
    first = json.loads((rec_path / META_FILE).read_text())["tables"]["tokens"]["first_segment"]
    assert first > 0
    want = sparseety_prof.open(rec_path).tokens()
    # the state a recorder killed between moving first_segment and removing the file leaves
    (rec_path / "tokens" / recording.segment_name(first - 1)).write_bytes(
        (rec_path / "tokens" / recording.segment_name(first)).read_bytes()
    )
    assert_frame_equal(sparseety_prof.open(rec_path).tokens(), want)
    # a segment missing AFTER the first kept is still damage
    (rec_path / "tokens" / recording.segment_name(first + 1)).unlink()
    with pytest.raises(CorruptRecording, match="missing"):
        sparseety_prof.open(rec_path).tokens()
