"""Importing the package leaves the importer's environment and thread pools alone; the CLI's
process (the recorder) gets one thread per pool, set before polars is imported, and keeps a
value the user chose. Each case runs in a fresh interpreter: the variables act only at import."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT

from sparseety_prof.session.thread_pools import THREAD_POOL_VARS, limit_thread_pools


def _run(code: str, **env: str) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if k not in THREAD_POOL_VARS}
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **env},
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    result: dict[str, object] = json.loads(r.stdout.splitlines()[-1])
    return result


_REPORT = f"""
import json, os, sys
env = {{v: os.environ.get(v) for v in {THREAD_POOL_VARS!r}}}
imported = "polars" in sys.modules
import polars
print(json.dumps({{"env": env, "polars": imported, "threads": polars.thread_pool_size()}}))
"""
_CLI = "from sparseety_prof import cli\ntry:\n    cli.main(['--version'])\nexcept SystemExit:\n    pass\n"


def test_importing_the_package_sets_nothing() -> None:
    # the package, its reading API (which imports polars) and the CLI module, as a notebook might
    got = _run(
        "import sparseety_prof, sparseety_prof.cli, sys\n"
        "assert 'polars' not in sys.modules and 'numpy' not in sys.modules\n"
        "sparseety_prof.open, sparseety_prof.Recording\n" + _REPORT
    )
    assert got["env"] == dict.fromkeys(THREAD_POOL_VARS)
    assert got["threads"] == len(os.sched_getaffinity(0))  # polars' own default: every core


def test_the_cli_process_gets_one_thread_per_pool_before_polars() -> None:
    # cli.main builds the parser (command modules import polars) after sizing the pools
    got = _run(
        "import sys\nfrom sparseety_prof import cli\nassert 'polars' not in sys.modules\n" + _CLI + _REPORT
    )
    assert got["polars"] is True
    assert got["env"] == dict.fromkeys(THREAD_POOL_VARS, "1")
    assert got["threads"] == 1


def test_a_value_the_user_set_is_kept() -> None:
    got = _run(
        _CLI + _REPORT,
        POLARS_MAX_THREADS="2",
        OMP_NUM_THREADS="3",
    )
    assert got["env"] == {
        **dict.fromkeys(THREAD_POOL_VARS, "1"),
        "POLARS_MAX_THREADS": "2",
        "OMP_NUM_THREADS": "3",
    }
    assert got["threads"] == 2
    environ = {"MKL_NUM_THREADS": "4"}
    limit_thread_pools(environ)
    assert environ == {**dict.fromkeys(THREAD_POOL_VARS, "1"), "MKL_NUM_THREADS": "4"}
