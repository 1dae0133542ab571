"""`--preset vllm|sglang|llamacpp` and the Python watch-spec parser, checked against the library itself: each
preset rule's kernel (its mangled name and argument layout, sparseety_prof/gpu/presets.py) is
launched on the stub driver with the presets as SPARSEETY_WATCH, and the buffer the library copies
must have the shape the Python parser evaluates and the bytes the "engine" held; a set of specs,
good and bad, must be accepted or refused by both parsers alike."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cupti_ext import build, by_type, env_for, shm_name  # noqa: F401 (fixtures)

from sparseety_prof.gpu import watch_rules
from sparseety_prof.gpu.llamacpp_kernels import BUILT_REVISION_KERNELS
from sparseety_prof.gpu.presets import PRESETS, PresetRule, watch_spec
from sparseety_prof.gpu.records import WatchedBuffer
from sparseety_prof.gpu.shm_ring import ShmRing

ROOT = Path(__file__).resolve().parent.parent
GRID_X = 3
PATTERN = bytes((i * 37 + 11) % 256 for i in range(1 << 20))  # driver.c scenario_launch's buffer

ALL_RULES = [(name, i, r) for name, rules in PRESETS.items() for i, r in enumerate(rules)]


def launch_args(layout: tuple[str, ...]) -> tuple[list[str], dict[int, int]]:
    """driver.c `launch` arguments for a layout, and the scalar values they carry (small and
    distinct, so a rule reading the wrong argument gets another shape)."""
    argv, values = [], {}
    for i, kind in enumerate(layout):
        if kind == "p":
            argv.append("p")
        elif kind == "b":
            argv.append("b:1")
        else:
            values[i] = 2 + i
            argv.append(f"{kind}:{values[i]}")
    return argv, values


def test_each_preset_parses_and_each_rule_is_the_first_to_match_its_kernel() -> None:
    for rules in PRESETS.values():
        parsed = watch_rules.parse(";".join(r.entry for r in rules))
        assert parsed == [r.rule() for r in rules]
        for r in rules:
            # the library applies the first matching entry: each kernel must reach its own rule
            assert watch_rules.match(parsed, r.example) == r.rule(), r.example
            rule = r.rule()
            assert r.layout[rule.arg_index] == "p"
            for index, size in rule.args_read().items():
                assert {"i32": 4, "i64": 8}.get(r.layout[index]) == size, (r.entry, index)


def test_explicit_watch_entries_come_first_and_limits_are_the_librarys() -> None:
    spec = watch_spec("topkGatingSoftmax:4:int64:arg3", ["sglang"])
    assert spec is not None and spec.startswith("topkGatingSoftmax:4:int64:arg3;")
    first = watch_rules.match(watch_rules.parse(spec), PRESETS["sglang"][0].example)
    assert first is not None and first.dtype == "int64"  # the explicit entry wins
    assert watch_spec(None, None) is None
    with pytest.raises(watch_rules.WatchSpecError, match="more than 16"):
        watch_spec(None, ["vllm", "sglang"])
    with pytest.raises(watch_rules.WatchSpecError, match="unknown preset"):
        watch_spec(None, ["trtllm"])


@pytest.mark.parametrize(("preset", "index", "rule"), ALL_RULES, ids=[f"{p}-{i}" for p, i, _ in ALL_RULES])
def test_preset_rule_copies_the_shape_it_says_on_the_stub_driver(
    build: Path,  # noqa: F811
    shm_name: str,  # noqa: F811
    preset: str,
    index: int,
    rule: PresetRule,
    tmp_path: Path,
) -> None:
    argv, values = launch_args(rule.layout)
    files = []
    if preset == "llamacpp":  # read from the engine's kernels: here the built revision's names
        files = [tmp_path / "libggml-cuda.so"]
        files[0].write_bytes(b"\0" + b"\0".join(n.encode() for n in BUILT_REVISION_KERNELS) + b"\0")
    spec = watch_spec(None, [preset], files)
    assert spec is not None
    env = env_for(build, shm_name, SPARSEETY_WATCH=spec)
    r = subprocess.run(
        [str(build / "driver"), "launch", rule.example, str(GRID_X), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    with ShmRing(Path("/dev/shm") / shm_name) as ring:
        records = ring.drain()
        c = ring.counters()
    assert c.errors == [] and c.buffers_failed == 0
    parsed = rule.rule()
    shape = parsed.shape(values, grid=(GRID_X, 1, 1), block=(128, 1, 1))
    watched = sorted(by_type(records, WatchedBuffer), key=lambda w: w.correlation_id)
    # corr 1: cuLaunchKernel (indices and sizes checked by cuFuncGetParamInfo); 2: cudaLaunchKernel
    assert [w.correlation_id for w in watched] == [1, 2]
    for w in watched:
        assert (w.kernel, w.arg_index, w.dtype, w.shape) == (
            rule.example,
            parsed.arg_index,
            parsed.dtype,
            shape,
        )
        assert w.data == PATTERN[: parsed.nbytes(shape)]


# (spec, the shape for kernel `k_kernel` launched with (p, i32:4, i64:5) on grid.x 3), None = refused
SPECS: list[tuple[str, tuple[int, ...] | None]] = [
    ("k_kernel:0:int32:arg1,arg2.i64", (4, 5)),
    ("k_kernel:0:int32:arg1**2,,grid.x", (8, 3)),  # empty pieces are skipped, as strtok does
    (" k_kernel : 0 : uint8 : 3 # a comment; k_kernel:0:int8:7", (3,)),
    ("other:0:int8:1;\n;k_kernel:0:bfloat16:block.x*arg1", (512,)),
    ("k_kernel:0:int33:arg1", None),
    ("k_kernel:256:int32:arg1", None),
    ("k_kernel:-1:int32:arg1", None),
    ("k_kernel:0:int32:arg1.i32", None),
    ("k_kernel:0:int32:arg", None),
    ("k_kernel:0:int32:", None),
    ("k_kernel:0:int32", None),
    ("k_kernel:0:int32:1,2,3,4,5", None),
    ("k_kernel:0:int32:1*1*1*1*1*1*1", None),
    ("k_kernel:0:int32:+1", None),
    ("k" * 128 + ":0:int32:1", None),
    (";".join(f"k{i}:0:int8:1" for i in range(17)), None),
]


def test_python_parser_accepts_and_refuses_what_the_library_does(build: Path, shm_name: str) -> None:  # noqa: F811
    for spec, want in SPECS:
        try:
            rules = watch_rules.parse(spec)
        except watch_rules.WatchSpecError:
            rules = None
        assert (rules is None) == (want is None), spec
        Path("/dev/shm", shm_name).unlink(missing_ok=True)
        env = env_for(build, shm_name, SPARSEETY_WATCH=spec)
        r = subprocess.run(
            [str(build / "driver"), "launch", "k_kernel", str(GRID_X), "p", "i32:4", "i64:5"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        with ShmRing(Path("/dev/shm") / shm_name) as ring:
            records = ring.drain()
            c = ring.counters()
        refused = any("SPARSEETY_WATCH" in e for e in c.errors)
        assert refused == (want is None), (spec, c.errors)
        if rules is not None:
            rule = watch_rules.match(rules, "k_kernel")
            assert rule is not None
            assert rule.shape({1: 4, 2: 5}, grid=(GRID_X, 1, 1), block=(128, 1, 1)) == want
            assert {w.shape for w in by_type(records, WatchedBuffer)} == {want}, spec


def test_cli_preset_reaches_the_engine_and_bad_use_is_exit_2(tmp_path: Path) -> None:
    lib = tmp_path / "libsparseety_cupti.so"
    lib.write_bytes(b"")  # launch only checks that the library exists; the child never loads it
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARSEETY_CUPTI_LIB": str(lib)}
    cli = [sys.executable, "-m", "sparseety_prof.cli"]
    show = ["--", sys.executable, "-c", "import os; print(os.environ['SPARSEETY_WATCH'])"]
    r = subprocess.run(
        [*cli, "launch", "--watch", "mine:0:int32:arg1", "--preset", "sglang", *show],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ";".join(["mine:0:int32:arg1", *(x.entry for x in PRESETS["sglang"])])
    for args in (
        ["launch", "--preset", "trtllm", "--", "true"],
        ["launch", "--watch", "x:0:int33:arg1", "--", "true"],
        ["launch", "--preset", "vllm", "--preset", "sglang", "--", "true"],
        ["record", "--pid", str(os.getpid()), "--preset", "vllm", "-o", str(tmp_path / "rec")],
    ):
        r = subprocess.run([*cli, *args], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        assert "preset" in r.stderr or "watch" in r.stderr, r.stderr
