"""Recordings made elsewhere are untrusted (issue 60): each attack on a recording's files is
performed for real, on every command that reads recordings (report with each of its outputs,
export in each format, audit, diff on either side, redact, collect) and on `sparseety_prof.open()`
with its table reads. Each must end at once with exit 7 (collect: the recording refused, exit 11)
and one line naming the file; a FIFO never blocks, an endless device is never read, a
decompression bomb is refused before it is decoded (memory measured in a child process), and a
recording's name never forges an output line.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import CLI, ROOT
from test_hardening_escapes import small_recording
from test_hardening_files import within

import sparseety_prof
from sparseety_prof import cli
from sparseety_prof.errors import CorruptRecording
from sparseety_prof.store import recording_files, schema
from sparseety_prof.store.parquet_footer import parquet_facts
from sparseety_prof.store.recording import META_FILE
from sparseety_prof.terminal_text import visible

SEGMENT = Path("tokens") / "part-000000.parquet"
COLLECT_REFUSED = 11

#: (argv with {rec}, {good} and {out} to fill, the exit code of a refused recording)
COMMANDS: dict[str, tuple[list[str], int]] = {
    "report": (["report", "{rec}"], 7),
    "report --anomalies": (["report", "{rec}", "--anomalies"], 7),
    "report --json": (["report", "{rec}", "--json"], 7),
    "report --html": (["report", "{rec}", "--html", "{out}/page.html"], 7),
    "export perfetto": (["export", "{rec}", "--format", "perfetto", "-o", "{out}/trace.json"], 7),
    "export jsonl": (["export", "{rec}", "--format", "jsonl", "-o", "{out}/tokens.jsonl"], 7),
    "export --otlp": (["export", "{rec}", "--otlp", "http://127.0.0.1:9/v1/traces"], 7),
    "audit": (["audit", "{rec}"], 7),
    "audit --json": (["audit", "{rec}", "--json"], 7),
    "diff A": (["diff", "{rec}", "{good}"], 7),
    "diff B --json": (["diff", "{good}", "{rec}", "--json"], 7),
    "redact": (["redact", "{rec}", "-o", "{out}/copy", "--redact", "ids"], 7),
    "collect": (["collect", "{rec}", "{out}/dataset"], COLLECT_REFUSED),
}


# ---------------------------------------------------------------------- the attacks


def _replace(path: Path) -> Path:
    path.unlink()
    return path


def _set_rows(rec: Path, table: str, rows: int) -> None:
    meta = json.loads((rec / META_FILE).read_text())
    meta["tables"][table]["rows"] = rows
    (rec / META_FILE).write_text(json.dumps(meta))


def _tokens_segment(rec: Path, df: pl.DataFrame, *, account: bool = True) -> None:
    """Replace the tokens segment with `df`'s rows (meta.json counting them when `account`)."""
    df.write_parquet(rec / SEGMENT, compression="zstd")
    if account:
        _set_rows(rec, "tokens", df.height)


def _good_tokens(rec: Path) -> pl.DataFrame:
    return pl.read_parquet(rec / SEGMENT)


def meta_fifo(rec: Path, tmp: Path) -> Path:
    os.mkfifo(_replace(rec / META_FILE))
    return rec / META_FILE


def segment_fifo(rec: Path, tmp: Path) -> Path:
    os.mkfifo(_replace(rec / SEGMENT))
    return rec / SEGMENT


def meta_link_to_dev_zero(rec: Path, tmp: Path) -> Path:
    _replace(rec / META_FILE).symlink_to("/dev/zero")
    return rec / META_FILE


def meta_link_to_a_regular_file(rec: Path, tmp: Path) -> Path:
    elsewhere = tmp / "elsewhere.json"
    shutil.copyfile(rec / META_FILE, elsewhere)  # a valid meta.json, but not the recording's
    _replace(rec / META_FILE).symlink_to(elsewhere)
    return rec / META_FILE


def meta_sparse_2gb(rec: Path, tmp: Path) -> Path:
    os.truncate(rec / META_FILE, 2 << 30)  # its JSON, then 2 GB of holes
    return rec / META_FILE


def meta_nested_arrays(rec: Path, tmp: Path) -> Path:
    (rec / META_FILE).write_text("[" * 100_000 + "]" * 100_000)
    return rec / META_FILE


def meta_nested_objects(rec: Path, tmp: Path) -> Path:
    (rec / META_FILE).write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    return rec / META_FILE


def meta_is_a_directory(rec: Path, tmp: Path) -> Path:
    _replace(rec / META_FILE).mkdir()
    return rec / META_FILE


def segment_is_a_directory(rec: Path, tmp: Path) -> Path:
    _replace(rec / SEGMENT).mkdir()
    return rec / SEGMENT


def segment_is_a_socket(rec: Path, tmp: Path) -> Path:
    # bound under a short name (a socket path has at most 107 bytes), then moved into place
    short = Path(tempfile.mkdtemp(prefix="s60-", dir="/tmp")) / "s"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(short))
    s.close()
    os.rename(short, _replace(rec / SEGMENT))
    short.parent.rmdir()
    return rec / SEGMENT


def segment_link_to_a_regular_file(rec: Path, tmp: Path) -> Path:
    elsewhere = tmp / "elsewhere.parquet"
    shutil.copyfile(rec / SEGMENT, elsewhere)
    _replace(rec / SEGMENT).symlink_to(elsewhere)
    return rec / SEGMENT


def table_folder_is_a_link(rec: Path, tmp: Path) -> Path:
    shutil.move(rec / "tokens", tmp / "tokens-elsewhere")
    (rec / "tokens").symlink_to(tmp / "tokens-elsewhere")
    return rec / "tokens"


def meta_tables_count_too_few_rows(rec: Path, tmp: Path) -> Path:
    _set_rows(rec, "tokens", 1)  # the segment holds 2
    return rec / SEGMENT


def segment_rows_meta_does_not_account_for(rec: Path, tmp: Path) -> Path:
    good = _good_tokens(rec)
    _tokens_segment(rec, good.select(pl.all().gather(np.zeros(200_000, np.int64))), account=False)
    return rec / SEGMENT


def segment_list_bomb(rec: Path, tmp: Path) -> Path:
    """5,000 tokens whose top_ids lists hold 60,000 zeros each (within what a list may hold):
    1.2 GB decoded from tens of KB."""
    shutil.copyfile(_list_bomb_file(tmp), rec / SEGMENT)
    _set_rows(rec, "tokens", 5_000)
    return rec / SEGMENT


def segment_one_huge_list(rec: Path, tmp: Path) -> Path:
    """One token whose top_ids list is longer than any list of its column may be."""
    big = pl.Series("top_ids", np.zeros(1_000_000, np.int32)).implode()
    _tokens_segment(rec, _good_tokens(rec).head(1).with_columns(big))
    return rec / SEGMENT


def segment_string_bomb(rec: Path, tmp: Path) -> Path:
    """100,000 tokens of one 4 KiB text: 400 MB of values from a dictionary of one entry."""
    rows = _good_tokens(rec).select(pl.all().gather(np.zeros(100_000, np.int64)))
    _tokens_segment(
        rec, rows.with_columns(pl.repeat("x" * 4096, rows.height, eager=True).alias("token_text"))
    )
    return rec / SEGMENT


_BOMB_CACHE: dict[str, Path] = {}


def _list_bomb_file(tmp: Path) -> Path:
    """Built once per session (a 1.2 GB frame to write), kept as the small file it makes."""
    if "list" not in _BOMB_CACHE:
        d = Path(tempfile.mkdtemp(prefix="sparseety-bomb-"))
        ref = pl.read_parquet(tmp / "good" / SEGMENT).select(pl.all().gather(np.zeros(5_000, np.int64)))
        zeros = pl.Series("top_ids", np.zeros(300_000_000, np.int32))
        lists = zeros.reshape((5_000, 60_000)).cast(pl.List(pl.Int32))
        ref.with_columns(lists).write_parquet(d / "bomb.parquet", compression="zstd")
        del zeros, lists
        _BOMB_CACHE["list"] = d / "bomb.parquet"
    return _BOMB_CACHE["list"]


ATTACKS: dict[str, Callable[[Path, Path], Path]] = {
    f.__name__: f
    for f in (
        meta_fifo,
        segment_fifo,
        meta_link_to_dev_zero,
        meta_link_to_a_regular_file,
        meta_sparse_2gb,
        meta_nested_arrays,
        meta_nested_objects,
        meta_is_a_directory,
        segment_is_a_directory,
        segment_is_a_socket,
        segment_link_to_a_regular_file,
        table_folder_is_a_link,
        meta_tables_count_too_few_rows,
        segment_rows_meta_does_not_account_for,
        segment_list_bomb,
        segment_one_huge_list,
        segment_string_bomb,
    )
}
BOMBS = (
    "segment_list_bomb",
    "segment_one_huge_list",
    "segment_string_bomb",
    "segment_rows_meta_does_not_account_for",
)


@pytest.fixture(scope="session", autouse=True)
def _remove_bombs() -> Iterator[None]:
    yield
    for p in _BOMB_CACHE.values():
        shutil.rmtree(p.parent, ignore_errors=True)


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return small_recording(tmp_path / "good")


def attacked(tmp_path: Path, attack: str, name: str = "rec") -> tuple[Path, Path]:
    """A copy of the good recording at `name`, attacked; (recording, the file the attack is on)."""
    rec = tmp_path / name
    shutil.copytree(tmp_path / "good", rec)
    return rec, ATTACKS[attack](rec, tmp_path)


def argv(command: str, rec: Path, good: Path, out: Path) -> list[str]:
    out.mkdir(exist_ok=True)
    args, _ = COMMANDS[command]
    return [a.format(rec=rec, good=good, out=out) for a in args]


def cli_in_process(args: list[str]) -> tuple[int, str, str]:
    """cli.main's exit code, stdout and stderr; a test failure when it blocks (a FIFO read)."""
    out, err = io.StringIO(), io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return cli.main(args)

    return within(60, run), out.getvalue(), err.getvalue()


def assert_refused(command: str, rc: int, err: str, named: Path) -> None:
    """Exit 7 (collect: 11) and one line naming the file, spelled out as token text is."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert rc == COMMANDS[command][1], err
    if command == "collect":
        refused = [ln for ln in lines if ln.startswith("sparseety-prof: refused ")]
        assert len(refused) == 1 and len(lines) == 2, lines  # the refusal, then the summary
        line = refused[0]
    else:
        assert len(lines) == 1, lines
        line = lines[0]
    assert visible(str(named)) in line, line


# ---------------------------------------------------------------------- every command, every attack


@pytest.mark.parametrize("attack", [a for a in ATTACKS if a not in BOMBS])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_command_refuses_each_attack_at_once_with_one_line(
    good: Path, tmp_path: Path, command: str, attack: str
) -> None:
    rec, named = attacked(tmp_path, attack)
    rc, _, err = cli_in_process(argv(command, rec, good, tmp_path / "out"))
    assert_refused(command, rc, err, named)


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_open_and_table_reads_refuse_each_attack(good: Path, tmp_path: Path, attack: str) -> None:
    rec, named = attacked(tmp_path, attack)

    def read_all() -> None:
        r = sparseety_prof.open(rec)
        for table in schema.TABLES:
            r.table(table)

    with pytest.raises(CorruptRecording) as e:
        within(60, read_all)
    assert visible(str(named)) in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert CorruptRecording.exit_code == 7


#: runs the command given and writes its peak resident memory (KiB, Linux's ru_maxrss) to the
#: file named first: the CLI's own, measured apart from the test process
_RSS_PARENT = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.call(sys.argv[2:])\n"
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
    "sys.exit(rc)\n"
)


def _cli_with_rss(args: list[str], tmp: Path) -> tuple[int, str, int]:
    """The CLI in a child process: (exit code, stderr, its peak resident memory in bytes)."""
    rss = tmp / "rss"
    r = subprocess.run(
        [sys.executable, "-c", _RSS_PARENT, str(rss), *CLI, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,  # a hang guard only
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
    )
    return r.returncode, r.stderr, int(rss.read_text()) * 1024


#: what the CLI takes to refuse a recording: the interpreter, polars and the recording's small
#: files; the bombs decoded would take more than a gigabyte
MEMORY_BOUND = 768 << 20


@pytest.mark.parametrize("attack", BOMBS)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_bombs_are_refused_before_they_are_decoded(
    good: Path, tmp_path: Path, command: str, attack: str
) -> None:
    rec, named = attacked(tmp_path, attack)
    rc, err, rss = _cli_with_rss(argv(command, rec, good, tmp_path / "out"), tmp_path)
    assert_refused(command, rc, err, named)
    assert rss < MEMORY_BOUND, f"{command} took {rss} bytes refusing {attack}"


def test_the_bombs_are_what_they_claim(good: Path, tmp_path: Path) -> None:
    """Ground truth for the bomb tests: decoded without the checks, each is far larger inside
    than on disk (the list bomb past a gigabyte), and refused for what it is."""
    rec, named = attacked(tmp_path, "segment_list_bomb")
    facts = parquet_facts(named.read_bytes())
    assert named.stat().st_size < 1 << 20 and facts.decompressed_bytes > 1 << 30
    with pytest.raises(CorruptRecording, match=r"would take .* bytes to decode"):
        sparseety_prof.open(rec).tokens()
    rec, named = attacked(tmp_path, "segment_one_huge_list", "one-list")
    with pytest.raises(CorruptRecording, match="declares 1000000 values in column top_ids for 1 rows"):
        sparseety_prof.open(rec).tokens()
    rec, named = attacked(tmp_path, "segment_string_bomb", "strings")
    assert pl.read_parquet(named).estimated_size() > 100 * named.stat().st_size
    with pytest.raises(CorruptRecording, match="bytes of values in"):
        sparseety_prof.open(rec).tokens()
    rec, named = attacked(tmp_path, "segment_rows_meta_does_not_account_for", "rows")
    with pytest.raises(CorruptRecording, match="holds 200000 rows, more than the recording accounts for"):
        sparseety_prof.open(rec).tokens()


# ---------------------------------------------------------------------- names from a recording

FORGED = "x\nFAKE: ok\x1b]0;owned\x07\u202e"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_recording_name_cannot_forge_an_output_line(good: Path, tmp_path: Path, command: str) -> None:
    rec, named = attacked(tmp_path, "meta_fifo", FORGED)
    rc, out, err = cli_in_process(argv(command, rec, good, tmp_path / "out"))
    assert_refused(command, rc, err, named)
    for text in (out, err):
        assert not any(ln.startswith("FAKE") for ln in text.splitlines()), text
        assert "\x1b" not in text and "\u202e" not in text and "\x07" not in text
    assert "x\\nFAKE: ok\\x1b]0;owned\\x07\\u202e" in err


def test_a_recording_name_is_spelled_out_by_the_real_cli(good: Path, tmp_path: Path) -> None:
    rec, _ = attacked(tmp_path, "segment_fifo", FORGED)
    for args in (["report", str(rec)], ["collect", str(rec), str(tmp_path / "ds")]):
        r = subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert not any(ln.startswith("FAKE") for ln in r.stderr.splitlines()), r.stderr
        assert "\x1b" not in r.stderr and "x\\nFAKE: ok" in r.stderr


# ---------------------------------------------------------------------- variants


def test_a_hard_link_is_a_regular_file_and_judged_by_its_content(good: Path, tmp_path: Path) -> None:
    """A hard link is the file itself (no name to follow): a recording copied with `cp -al`
    reads as the original; a meta.json hard-linked to another file is refused for what it holds."""
    copy = tmp_path / "linked-copy"
    shutil.copytree(good, copy, copy_function=os.link)
    assert sparseety_prof.open(copy).tokens().equals(sparseety_prof.open(good).tokens())
    other = tmp_path / "not-a-recording.txt"
    other.write_text("root:x:0:0:root:/root:/bin/bash\n")
    rec = tmp_path / "hostile"
    shutil.copytree(good, rec)
    os.link(other, _replace(rec / META_FILE))
    with pytest.raises(CorruptRecording, match=r"meta\.json is not valid JSON"):
        sparseety_prof.open(rec)


def test_a_closed_recording_whose_segments_hold_fewer_rows_than_recorded_is_damaged(
    good: Path, tmp_path: Path
) -> None:
    _set_rows(good, "tokens", 10**9)
    with pytest.raises(CorruptRecording, match=r"holds 2 rows but .*meta\.json records 1000000000"):
        sparseety_prof.open(good).tokens()
    r = sparseety_prof.open(good, skip_damaged=True)
    assert r.tokens().height == 2 and any("records 1000000000" in d for d in r.damaged)


def test_segments_a_closed_recording_does_not_count_add_no_rows(good: Path) -> None:
    meta = json.loads((good / META_FILE).read_text())
    meta["tables"]["tokens"]["segments"] = 0  # the segment is there, its 2 rows counted
    (good / META_FILE).write_text(json.dumps(meta))
    assert sparseety_prof.open(good).tokens().height == 2
    shutil.copyfile(good / SEGMENT, good / "tokens" / "part-000001.parquet")  # 2 rows more
    with pytest.raises(CorruptRecording, match=r"part-000001\.parquet holds 2 rows, more than the recording"):
        sparseety_prof.open(good).tokens()


def test_a_list_longer_than_meta_json_layers_allow_is_refused(good: Path, tmp_path: Path) -> None:
    meta = json.loads((good / META_FILE).read_text())
    meta["layers"] = {"moe": [0, 1], "ffn": [0, 1], "attn": [0, 1]}
    (good / META_FILE).write_text(json.dumps(meta))
    ratios = pl.List(pl.Float32)
    rows = _good_tokens(good).with_columns(pl.Series("act_zero_ratio", [[0.5] * 3, [0.5] * 2], dtype=ratios))
    _tokens_segment(good, rows)  # 5 values for 2 rows of at most 2: refused from the page headers
    with pytest.raises(CorruptRecording, match="declares 5 values in column act_zero_ratio for 2 rows"):
        sparseety_prof.open(good).tokens()
    rows = rows.with_columns(pl.Series("act_zero_ratio", [[0.5] * 3, None], dtype=ratios))
    _tokens_segment(good, rows)  # 4 value slots fit 2 rows; the decoded list of 3 does not
    with pytest.raises(
        CorruptRecording, match="column act_zero_ratio holds a list of 3 elements, more than 2"
    ):
        sparseety_prof.open(good).tokens()
    _tokens_segment(
        good, rows.with_columns(pl.lit([0.5, 0.5], dtype=pl.List(pl.Float32)).alias("act_zero_ratio"))
    )
    assert sparseety_prof.open(good).tokens()["act_zero_ratio"].to_list() == [[0.5, 0.5]] * 2


def test_a_number_of_a_million_digits_in_meta_json_is_refused(good: Path) -> None:
    (good / META_FILE).write_text('{"format": ' + "1" * 1_000_000 + "}")
    with pytest.raises(CorruptRecording, match=r"meta\.json is not valid JSON"):
        sparseety_prof.open(good)


def test_a_segment_bigger_than_a_segment_may_be_is_refused_before_it_is_read(good: Path) -> None:
    seg = good / SEGMENT
    os.truncate(seg, recording_files.MAX_SEGMENT_BYTES + 1)  # sparse: nothing is written
    with pytest.raises(CorruptRecording, match=r"part-000000\.parquet is \d+ bytes, more than the"):
        sparseety_prof.open(good).tokens()


def test_a_sparse_segment_with_parquet_ends_is_refused_unread(good: Path) -> None:
    """Magic at both ends and a real footer, 2 GB of holes between: the footer describes a few
    KB of columns, so the file is refused before its holes are read."""
    seg = good / SEGMENT
    data = seg.read_bytes()
    footer_len = int.from_bytes(data[-8:-4], "little")
    tail = data[-8 - footer_len :]
    with seg.open("r+b") as f:
        f.truncate(2 << 30)
        f.seek((2 << 30) - len(tail))
        f.write(tail)
    with pytest.raises(
        CorruptRecording, match=r"part-000000\.parquet is 2147483648 bytes, but its footer describes"
    ):
        within(60, lambda: sparseety_prof.open(good).tokens())


def test_valid_recordings_read_as_before_through_the_checks(good: Path, tmp_path: Path) -> None:
    """The checks refuse nothing real: rows, lists and text of every kind round-trip."""
    r = sparseety_prof.open(good)
    assert r.tokens()["token_id"].to_list() == [5, 6]
    assert r.meta_bytes == (good / META_FILE).read_bytes()


@pytest.mark.parametrize("kind", ["fifo", "nested", "link"])
def test_a_dataset_whose_manifest_is_hostile_is_refused_at_once(
    good: Path, tmp_path: Path, kind: str
) -> None:
    """collect's DEST may come from elsewhere too: its manifest.json is read as untrusted."""
    dest = tmp_path / "dataset"
    dest.mkdir()
    manifest = dest / "manifest.json"
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "nested":
        manifest.write_text("[" * 100_000 + "]" * 100_000)
    else:
        manifest.symlink_to("/dev/zero")
    rc, _, err = cli_in_process(["collect", str(good), str(dest)])
    assert rc == 2 and "Traceback" not in err, err
    assert [ln for ln in err.splitlines() if ln.strip()] == [
        ln for ln in err.splitlines() if "manifest.json" in ln
    ]


# ---------------------------------------------------------------------- crafted Parquet metadata
# Thrift compact encoding (Parquet's metadata), for footers no writer makes


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _zz(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63))


I32, I64, BINARY, LIST, STRUCT = 5, 6, 8, 9, 12


def _struct(*fields: tuple[int, int, bytes]) -> bytes:
    """A struct of (field id, compact type, encoded value), ids ascending."""
    out, last = bytearray(), 0
    for fid, kind, value in fields:
        out.append(((fid - last) << 4) | kind)
        out += value
        last = fid
    return bytes(out) + b"\x00"


def _list(kind: int, items: list[bytes]) -> bytes:
    head = (
        bytes([(len(items) << 4) | kind]) if len(items) < 15 else bytes([0xF0 | kind]) + _varint(len(items))
    )
    return head + b"".join(items)


def _parquet(body: bytes, footer: bytes) -> bytes:
    return b"PAR1" + body + footer + len(footer).to_bytes(4, "little") + b"PAR1"


def _segment_with(good: Path, data: bytes) -> Path:
    (good / SEGMENT).write_bytes(data)
    return good / SEGMENT


def test_a_footer_of_millions_of_empty_structures_is_refused_unbuilt(good: Path) -> None:
    """3 MB of footer that a naive reader would turn into three million objects."""
    groups = b"\x49" + bytes([0xF0 | STRUCT]) + _varint(3_000_000) + b"\x00" * 3_000_000  # field 4
    _segment_with(good, _parquet(b"", groups + b"\x00"))
    with pytest.raises(CorruptRecording, match="metadata of more values than a segment's footer holds"):
        within(60, lambda: sparseety_prof.open(good).tokens())


def test_a_file_of_empty_pages_is_refused_without_walking_them_all(good: Path) -> None:
    """A column chunk of 300,000 empty data pages: every page header would be parsed."""
    page = _struct(
        (1, I32, _zz(0)), (2, I32, _zz(0)), (3, I32, _zz(0)), (5, STRUCT, _struct((1, I32, _zz(0))))
    )
    pages = page * 300_000
    column_meta = _struct(
        (1, I32, _zz(1)),  # INT32
        (2, LIST, _list(I32, [_zz(0)])),
        (3, LIST, _list(BINARY, [_varint(8) + b"token_id"])),
        (4, I32, _zz(0)),
        (5, I64, _zz(0)),
        (6, I64, _zz(len(pages))),
        (7, I64, _zz(len(pages))),
        (9, I64, _zz(4)),
    )
    chunk = _struct((2, I64, _zz(4)), (3, STRUCT, column_meta))
    group = _struct((1, LIST, _list(STRUCT, [chunk])), (2, I64, _zz(len(pages))), (3, I64, _zz(0)))
    footer = _struct((1, I32, _zz(1)), (3, I64, _zz(0)), (4, LIST, _list(STRUCT, [group])))
    _segment_with(good, _parquet(pages, footer))
    _set_rows(good, "tokens", 0)
    with pytest.raises(CorruptRecording, match="more than 200000 pages"):
        within(60, lambda: sparseety_prof.open(good).tokens())
