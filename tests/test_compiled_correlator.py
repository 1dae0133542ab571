"""The correlator compiled by mypyc (sparseety_prof/native/compile_correlator.py, run by
scripts/setup.sh) makes the tables its Python source makes, and is used only when it is of that
source (correlate/build_stamp.py).

The test process runs the source (conftest.py); the compiled build runs in a child process, on the
scripts tests/test_correlator.py feeds the correlator (decode runs, prompts, blocks of aggregate
records, llama-server's slots and deferred samples, logits reduced as drained), in one drain and
in seven, and the tables are compared column by column."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import PY, ROOT

from sparseety_prof.correlate import build_stamp

# child process: the compiled correlator on test_correlator's scripts, its tables pickled
_CHILD = r"""
import pickle, sys
sys.path[:0] = [sys.argv[2], sys.argv[3]]
from sparseety_prof.correlate import build_stamp
if build_stamp.STATE != "compiled":
    sys.exit("not compiled: " + build_stamp.STATE)
import test_correlator as t
from sparseety_prof.correlate import server_layout_check
server_layout_check.VERIFY_POSTS = server_layout_check.VERIFY_LAUNCHES = 2  # (_server_replay_kw)
out = {}
for name, (make, server) in sorted(t._REDUCE_SCRIPTS.items()):
    for drains in (1, 7):
        for every in (0, 3) if drains == 7 else (0,):
            kw = {"server": True} if server else {}
            out[name, drains, every] = t._replay(
                make(), drains, with_masks=False, reduce_every=every, states=False, **kw
            )[0]
rows = t.chunked_rows()
for drains, every in ((1, 0), (7, 2)):  # rows over several records, reduced as drained
    out["chunked", drains, every] = t._replay(
        t._chunked_script(rows), drains, with_masks=False, chunk=4, reduce_every=every, states=False
    )[0]
with open(sys.argv[1], "wb") as f:
    pickle.dump(out, f)
"""


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != build_stamp.PURE_ENV}


def test_the_compiled_build_is_current_and_used() -> None:
    """scripts/setup.sh compiles the correlator; a process that imports it runs the compiled
    modules (this fails after an edit of sparseety_prof/correlate until setup.sh runs again)."""
    r = subprocess.run(
        [
            PY,
            "-c",
            "from sparseety_prof.correlate import build_stamp, correlator as c; "
            "print(build_stamp.STATE); print(c.__file__)",
        ],
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    state, where = r.stdout.splitlines()
    assert state == "compiled", f"{state}: run scripts/setup.sh"
    assert where.endswith(".so") and "/native/build/compiled/" in where


def test_the_compiled_correlator_makes_the_tables_of_its_source(tmp_path: Path) -> None:
    import test_correlator as t

    from sparseety_prof.correlate import server_layout_check

    out = tmp_path / "compiled.pkl"
    r = subprocess.run(
        [PY, "-c", _CHILD, str(out), str(ROOT / "tests"), str(ROOT)],
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    with out.open("rb") as f:
        compiled = pickle.load(f)
    assert len(compiled) == len(t._REDUCE_SCRIPTS) * 3 + 2
    saved = server_layout_check.VERIFY_POSTS, server_layout_check.VERIFY_LAUNCHES
    server_layout_check.VERIFY_POSTS = server_layout_check.VERIFY_LAUNCHES = 2
    try:
        for (name, drains, every), got in compiled.items():
            kw: dict[str, Any]
            if name == "chunked":  # (the rows' addresses are handed to C: their lifetime matters)
                s, kw = t._chunked_script(t.chunked_rows()), {"chunk": 4}
            else:
                make, server = t._REDUCE_SCRIPTS[name]
                s, kw = make(), {"server": True} if server else {}
            want = t._replay(s, drains, with_masks=False, reduce_every=every, **kw)[0]
            assert got.keys() == want.keys(), name
            rows = 0
            for table in want:
                assert got[table].keys() == want[table].keys(), f"{name}: {table}"
                for col, values in want[table].items():
                    # (repr: a NaN equals a NaN, and floats are compared to the last bit)
                    assert repr(got[table][col]) == repr(values), f"{name}, {drains} drains: {table}.{col}"
                    rows = max(rows, len(values))
            assert rows > 0, name
    finally:
        server_layout_check.VERIFY_POSTS, server_layout_check.VERIFY_LAUNCHES = saved


# child process: test_sparse's rows of a prompt made at once, under the compiled build
_FILL_ROWS_CHILD = r"""
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from sparseety_prof.correlate import build_stamp
if build_stamp.STATE != "compiled":
    sys.exit("not compiled: " + build_stamp.STATE)
import test_sparse
test_sparse.test_a_prompts_rows_made_at_once_equal_row_by_row()
"""


def test_the_compiled_prompt_rows_made_at_once_equal_row_by_row() -> None:
    """StepSparse.fill_rows compiled (mypyc checks each annotation and gives a local one type: a
    prompt of FILL_ROWS_MIN rows or more runs code the scripts above never reach) gives every row
    what row_values gives it alone (tests/test_sparse.py's check, run in a child process)."""
    r = subprocess.run(
        [PY, "-c", _FILL_ROWS_CHILD, str(ROOT / "tests"), str(ROOT)],
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]


# ------------------------------------------------------------------ the stamp's decisions
def _fake_build(tmp: Path) -> tuple[Path, Path]:
    """A package folder of two modules and a compiled tree stamped for them (no real modules:
    compiled_dir decides from the stamp, the import system does the rest)."""
    pkg = tmp / "sparseety_prof" / "correlate"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "build_stamp.py").write_text("")
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "b.py").write_text("y = 2\n")
    root = build_stamp.compiled_root(pkg)
    (root / "sparseety_prof" / "correlate").mkdir(parents=True)
    (root / build_stamp.STAMP_NAME).write_text(json.dumps(build_stamp.make_stamp(pkg, "test")))
    return pkg, root


def test_a_stamp_of_the_sources_uses_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(build_stamp.PURE_ENV, raising=False)
    pkg, root = _fake_build(tmp_path)
    where, why = build_stamp.compiled_dir(pkg)
    assert (where, why) == (root / "sparseety_prof" / "correlate", "compiled")
    assert [p.name for p in build_stamp.source_modules(pkg)] == ["a.py", "b.py"]


def test_an_edited_source_runs_as_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(build_stamp.PURE_ENV, raising=False)
    pkg, _ = _fake_build(tmp_path)
    (pkg / "b.py").write_text("y = 3\n")
    assert build_stamp.compiled_dir(pkg) == (
        None,
        "source: b.py changed since the compiled build (rebuild it)",
    )
    (pkg / "b.py").write_text("y = 2\n")
    (pkg / "c.py").write_text("z = 1\n")  # a module the build does not have
    assert build_stamp.compiled_dir(pkg)[1] == "source: the compiled build is of other modules (rebuild it)"


def test_the_switch_another_python_and_bad_stamps_run_as_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg, root = _fake_build(tmp_path)
    monkeypatch.setenv(build_stamp.PURE_ENV, "1")
    assert build_stamp.compiled_dir(pkg)[1] == f"source: {build_stamp.PURE_ENV} is set"
    monkeypatch.setenv(build_stamp.PURE_ENV, "0")  # (0: not set)
    assert build_stamp.compiled_dir(pkg)[1] == "compiled"
    stamp_file = root / build_stamp.STAMP_NAME
    stamp = json.loads(stamp_file.read_text())
    stamp["interpreter"]["cache_tag"] = "cpython-399"
    stamp_file.write_text(json.dumps(stamp))
    assert build_stamp.compiled_dir(pkg)[1] == "source: the compiled build is for another Python"
    stamp_file.write_text("{not json")
    assert (
        build_stamp.compiled_dir(pkg)[1]
        == "source: the compiled build's stamp is unreadable (JSONDecodeError)"
    )
    stamp_file.write_text("[1, 2]")
    assert build_stamp.compiled_dir(pkg)[1] == "source: the compiled build's stamp is not one"
    stamp_file.unlink()
    assert build_stamp.compiled_dir(pkg)[1].startswith("source: no compiled build")


def test_this_process_runs_the_source() -> None:
    """(conftest.py: the tests here replace the correlator's functions)"""
    from sparseety_prof.correlate import correlator

    pure = f"source: {build_stamp.PURE_ENV} is set"
    assert pure == build_stamp.STATE
    assert correlator.__file__ is not None and correlator.__file__.endswith(".py")
    assert sys.modules["sparseety_prof.correlate.correlator"] is correlator


def test_without_mypyc_the_build_says_so_and_leaves_the_source(tmp_path: Path) -> None:
    """(python -S: no site-packages, so no mypyc) exit 0 and nothing built; 1 with --require"""
    script = ROOT / "sparseety_prof" / "native" / "compile_correlator.py"
    out = tmp_path / "compiled"
    for extra, rc in (([], 0), (["--require"], 1)):
        r = subprocess.run(
            [PY, "-S", str(script), str(out), *extra], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == rc, r.stderr
        assert "mypyc is not importable" in r.stderr and "the correlator runs as Python" in r.stderr
        assert not out.exists()
