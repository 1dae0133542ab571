"""`sparseety-prof collect`: recordings into one Hive-partitioned Parquet dataset. Each table read
back through the dataset equals the recording's own table (read by store/recording.py); the
manifest's counts and hashes equal the files; hostile and damaged recordings are refused or made
safe. The real-engine acceptance test (Polars, DuckDB, Spark on real recordings):
test_dataset_engines.py."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import ROOT
from polars.testing import assert_frame_equal
from test_recording import steps_frame, tokens_frame

import sparseety_prof
from sparseety_prof import cli
from sparseety_prof.commands.exit_codes import CHECK_FAILED, COLLECT_REFUSED, EXIT_CODES_HELP
from sparseety_prof.errors import ProfError
from sparseety_prof.store import dataset, schema
from sparseety_prof.store.dataset import MANIFEST
from sparseety_prof.store.dataset_partition import MAX_VALUE_CHARS, sanitise
from sparseety_prof.store.recording import META_FILE
from sparseety_prof.store.recording_writer import RecordingWriter

DAY_MS = 86_400_000
T0 = 1_739_000_000_000  # 2025-02-08 07:33:20 UTC


def meta(host: object, *, engine: object = "llama-cpp-python", model: object = "moe") -> dict[str, Any]:
    return {
        "host": {"hostname": host},
        "engine": {"name": engine},
        "model": {"name": model, "path": "/models/x.gguf"},
        "start_unix_ms": T0,
        "end_unix_ms": T0 + DAY_MS,  # spans midnight: two dates
    }


def make_recording(path: Path, m: dict[str, Any], n_tokens: int = 12, *, complete: bool = True) -> Path:
    w = RecordingWriter(path, m, segment_rows=5)
    w.append("tokens", tokens_frame(n_tokens))
    w.append("steps", steps_frame(n_tokens // 2))
    w.close(complete=complete)
    return path


def collect(*args: Path) -> int:
    return cli.main(["collect", *map(str, args)])


def manifest(dest: Path) -> dict[str, Any]:
    return dict(json.loads((dest / MANIFEST).read_text()))


def dataset_table(dest: Path, table: str) -> pl.DataFrame:
    return pl.scan_parquet(dest / table / "**" / "*.parquet", hive_partitioning=True).collect()


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_each_table_reads_back_as_the_recordings_own_with_partitions_and_manifest(tmp_path: Path) -> None:
    a = make_recording(tmp_path / "a", meta("host-a"), 12)
    b = make_recording(tmp_path / "b", meta("host-b", model="dense"), 8)
    dest = tmp_path / "ds"
    assert collect(a, b, dest) == 0

    m = manifest(dest)
    assert m["schema_version"] == schema.SCHEMA_VERSION
    assert m["partitions"] == list(schema.DATASET_PARTITIONS)
    entries = {e["source"]: e for e in m["recordings"]}
    assert set(entries) == {str(a), str(b)}
    for src, host, model in ((a, "host-a", "moe"), (b, "host-b", "dense")):
        e, rec = entries[str(src)], sparseety_prof.open(src)
        assert e["id"] == hashlib.sha256((src / META_FILE).read_bytes()).hexdigest()[:32]
        assert (e["host"], e["engine"], e["model"]) == (host, "llama-cpp-python", model)
        assert (e["date"], e["dates"]) == ("2025-02-08", ["2025-02-08", "2025-02-09"])
        assert e["rows"] == {t: rec.table(t).height for t in schema.TABLES}
        for table, f in e["files"].items():
            data = (dest / f["path"]).read_bytes()
            assert f["sha256"] == hashlib.sha256(data).hexdigest() and f["bytes"] == len(data)
            folder = f"host={host}/date=2025-02-08/engine=llama-cpp-python/model={model}"
            assert f["path"] == f"{table}/{folder}/part-{e['id']}.parquet"

    for table in schema.TABLES:
        got = dataset_table(dest, table)
        assert list(got.columns) == [*schema.dataset_table(table), *schema.DATASET_PARTITIONS]
        assert dict(got.drop(*schema.DATASET_PARTITIONS).schema) == schema.dataset_table(table)
        for src in (a, b):
            e = entries[str(src)]
            mine = got.filter(pl.col(schema.RECORDING_ID) == e["id"])
            assert mine["host"].unique().to_list() in ([], [e["host"]])
            want = sparseety_prof.open(src).table(table)
            keys = list(want.columns[:4])
            assert_frame_equal(
                mine.select(want.columns).sort(keys, maintain_order=True),
                want.sort(keys, maintain_order=True),
            )

    # owner-only, as a recording: files 0600, folders 0700
    for p in [dest, *dest.rglob("*")]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), p


def test_collecting_a_recording_again_from_anywhere_adds_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = make_recording(tmp_path / "a", meta("host-a"))
    dest = tmp_path / "ds"
    assert collect(a, dest) == 0
    before = {p: p.read_bytes() for p in files_under(dest) if p.name != MANIFEST}
    copy = tmp_path / "elsewhere" / "a-copy"
    shutil.copytree(a, copy)
    capsys.readouterr()
    assert collect(a, copy, dest) == 0
    err = capsys.readouterr().err
    assert err.count("already in") == 2 and "0 collected, 2 already there, 0 refused" in err
    assert len(manifest(dest)["recordings"]) == 1
    assert {p: p.read_bytes() for p in files_under(dest) if p.name != MANIFEST} == before
    assert dataset_table(dest, "tokens").height == sparseety_prof.open(a).tokens().height


HOSTILE_HOSTS = ["../../etc", "a/b=c", "\x1b[2J\x07evil\x00", "..", ".hidden", "x" * 300, "", "日本", None, 7]


def test_hostile_partition_values_stay_inside_the_dataset_and_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    srcs = [
        make_recording(tmp_path / f"r{i}", meta(h, engine="eng=../x", model="m/" + "y" * 200), 4)
        for i, h in enumerate(HOSTILE_HOSTS)
    ]
    dest = tmp_path / "ds"
    assert collect(*srcs, dest) == 0
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "\x00" not in err
    value = re.compile(r"^(host|date|engine|model)=[A-Za-z0-9_+-][A-Za-z0-9._+-]*$")
    for p in dest.rglob("*"):
        assert p.resolve().is_relative_to(dest.resolve()), p
        if p.is_dir() and p.parent != dest:
            assert value.match(p.name) and ".." not in p.name, p.name
            assert len(p.name.split("=", 1)[1]) <= MAX_VALUE_CHARS, p.name
    hosts = [e["host"] for e in manifest(dest)["recordings"]]
    # text hosts that differ land apart; no text at all is "unknown"
    assert len(set(hosts)) == len(hosts) - 2 and hosts.count("unknown") == 3
    got = dataset_table(dest, "tokens")
    assert got.height == 4 * len(srcs) and set(got["host"]) == set(hosts)
    assert sanitise("host-1.example.com") == "host-1.example.com"  # a plain name is kept as it is


def test_a_damaged_or_hostile_recording_is_refused_and_the_others_collected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = make_recording(tmp_path / "good", meta("host-a"))
    truncated = make_recording(tmp_path / "truncated", meta("host-b"))
    seg = truncated / "tokens" / "part-000001.parquet"
    seg.write_bytes(seg.read_bytes()[:100])
    unclosed = make_recording(tmp_path / "unclosed", meta("host-c"), complete=False)
    linked = make_recording(tmp_path / "linked", meta("host-d"))
    (linked / "steps" / "part-000000.parquet").unlink()
    (linked / "steps" / "part-000000.parquet").symlink_to(good / "steps" / "part-000000.parquet")
    extra = make_recording(tmp_path / "extra", meta("host-e"))
    tokens = pl.read_parquet(extra / "tokens" / "part-000000.parquet").with_columns(secret=pl.lit(1))
    tokens.write_parquet(extra / "tokens" / "part-000000.parquet")
    wrong_type = make_recording(tmp_path / "wrong-type", meta("host-g"))
    steps = pl.read_parquet(wrong_type / "steps" / "part-000000.parquet")
    steps.with_columns(pl.lit("abc").alias("n_tokens")).write_parquet(
        wrong_type / "steps" / "part-000000.parquet"
    )
    not_json = make_recording(tmp_path / "not-json", meta("host-f"))
    (not_json / META_FILE).write_text("{")
    missing = tmp_path / "no-such-recording"
    dest = tmp_path / "ds"

    rc = collect(truncated, good, unclosed, linked, extra, wrong_type, not_json, missing, dest)
    err = capsys.readouterr().err
    assert rc == COLLECT_REFUSED == 11
    refused = {
        line.split(": ", 2)[1].removeprefix("refused "): line
        for line in err.splitlines()
        if "refused /" in line
    }
    assert set(refused) == {
        str(p) for p in (truncated, unclosed, linked, extra, wrong_type, not_json, missing)
    }
    assert "not a readable Parquet segment" in refused[str(truncated)]
    assert "was not closed" in refused[str(unclosed)]
    assert "not a plain file" in refused[str(linked)]
    assert "'secret'" in refused[str(extra)]
    assert "steps" in refused[str(wrong_type)] and "abc" in refused[str(wrong_type)]
    assert "not valid JSON" in refused[str(not_json)]
    assert "does not exist" in refused[str(missing)]
    assert "1 collected, 0 already there, 7 refused" in err
    assert [e["source"] for e in manifest(dest)["recordings"]] == [str(good)]
    # nothing of a refused recording is left where a reader looks, not even a staged file
    assert all(
        p.name.startswith("part-") for p in files_under(dest) if p.name not in (MANIFEST, ".collect.lock")
    )
    assert len([p for p in files_under(dest) if p.name.startswith("part-")]) == len(schema.TABLES)
    assert dataset_table(dest, "tokens").height == sparseety_prof.open(good).tokens().height


def test_a_column_an_older_recording_lacks_is_written_as_nulls_of_the_schema_dtype(tmp_path: Path) -> None:
    new = make_recording(tmp_path / "new", meta("host-a"))
    old = make_recording(tmp_path / "old", meta("host-b"))
    for seg in sorted((old / "tokens").glob("part-*.parquet")):
        pl.read_parquet(seg).drop("kv_cells_used", "attn_attended").write_parquet(seg)
    m = json.loads((old / META_FILE).read_text())
    (old / META_FILE).write_text(json.dumps({**m, "schema_version": 2}))
    dest = tmp_path / "ds"
    assert collect(new, old, dest) == 0
    got = dataset_table(dest, "tokens")
    old_id = next(e["id"] for e in manifest(dest)["recordings"] if e["source"] == str(old))
    olds = got.filter(pl.col(schema.RECORDING_ID) == old_id)
    assert olds.height == 12 and olds["kv_cells_used"].null_count() == 12
    assert got.schema["kv_cells_used"] == schema.TOKENS["kv_cells_used"]
    assert got.schema["attn_attended"] == schema.TOKENS["attn_attended"]
    assert got.filter(pl.col(schema.RECORDING_ID) != old_id)["kv_cells_used"].null_count() == 0
    assert olds["token_id"].to_list() == pl.read_parquet(old / "tokens" / "*.parquet")["token_id"].to_list()


def test_a_folder_that_is_not_a_dataset_is_refused_with_exit_2(tmp_path: Path) -> None:
    a = make_recording(tmp_path / "a", meta("host-a"))
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert collect(a, other) == 2
    assert sorted(os.listdir(other)) == ["notes.txt"]
    real = tmp_path / "real"
    assert collect(a, real) == 0
    link = tmp_path / "link"
    link.symlink_to(real)
    assert collect(a, link) == 2
    (real / MANIFEST).write_text(json.dumps({**manifest(real), "schema_version": schema.SCHEMA_VERSION + 1}))
    assert collect(make_recording(tmp_path / "b", meta("host-b")), real) == 2


def test_dataset_flag_needs_a_recording_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["attach", "--pid", "1", "--dataset", str(tmp_path / "ds")]) == 2
    assert "give the recording's directory with -o" in capsys.readouterr().err
    assert not (tmp_path / "ds").exists()


def test_the_refusal_exit_code_is_its_own_and_documented() -> None:
    classes: list[type[ProfError]] = [ProfError, *_subclasses(ProfError)]
    codes = {c.exit_code for c in classes}
    assert COLLECT_REFUSED not in codes | {0, CHECK_FAILED}
    assert f"  {COLLECT_REFUSED} collect: some recordings were refused" in EXIT_CODES_HELP
    assert (
        f"| {COLLECT_REFUSED} | `collect`: some recordings were refused"
        in (ROOT / "docs" / "exit-codes.md").read_text()
    )


def _subclasses(cls: type[ProfError]) -> list[type[ProfError]]:
    return [s for c in cls.__subclasses__() for s in (c, *_subclasses(c))]


@pytest.mark.root
def test_under_sudo_every_file_and_folder_made_is_the_sudo_users(tmp_path: Path) -> None:
    nobody = 65534
    a = make_recording(tmp_path / "a", meta("host-a"))
    dest = tmp_path / "ds"
    report = dataset.collect([a], dest, owner=(nobody, nobody))
    assert len(report.collected) == 1 and not report.refused
    made = [dest, *dest.rglob("*")]
    assert len(made) > len(schema.TABLES) * 5  # the folders of each partition level, and the files
    for p in made:
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (nobody, nobody), p
        assert stat.S_IMODE(st.st_mode) == (0o700 if p.is_dir() else 0o600), p
