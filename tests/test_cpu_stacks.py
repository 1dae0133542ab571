"""The CPU sampler's pieces without an engine: samples joined to step windows (session/cpu_profile.py),
addresses named from ELF files (capture/stack_symbols.py), the pprof export decoded back by a
reader of our own and by the protobuf library from profile.proto's field numbers."""

from __future__ import annotations

import ctypes
import gzip
import itertools
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from test_recording import META

from sparseety_prof import cli
from sparseety_prof.capture.cpu_sampler import Sample
from sparseety_prof.capture.proc_maps import read_maps
from sparseety_prof.capture.stack_symbols import (
    KERNEL_FRAME,
    SYMBOLS_DYNAMIC,
    SYMBOLS_FULL,
    UNKNOWN_FRAME,
    Symboliser,
    build_id,
)
from sparseety_prof.session.cpu_profile import BETWEEN_STEPS, UNRECORDED_STEP, CpuProfile
from sparseety_prof.store import schema
from sparseety_prof.store.recording import open as open_recording
from sparseety_prof.store.recording_writer import RecordingWriter
from sparseety_prof.views.cpu_stacks import folded_text, self_shares
from sparseety_prof.views.export.pprof import profile_bytes

# ---------------------------------------------------------------- the join to steps


class FakeSampler:
    """Samples handed out as the test says, as CpuSampler.take would."""

    pid = 4242
    rate_hz = 100

    def __init__(self) -> None:
        self.queue: list[Sample] = []
        self.closed = False
        self.paused = False

    def pause(self) -> None:
        self.paused = True

    def take(self) -> list[Sample]:
        got, self.queue = self.queue, []
        return got

    def meta(self) -> dict[str, Any]:
        return {"rate_hz": self.rate_hz}

    def close(self) -> None:
        self.closed = True


class NamesOf:
    """Frames named after their addresses: "f<addr>"."""

    def frames_many(self, stacks: list[tuple[tuple[int, ...], bool]]) -> list[list[str]]:
        return [
            [f"f{a}" for a in reversed(stack)] + ([KERNEL_FRAME] if kernel else [])
            for stack, kernel in stacks
        ]

    def files_meta(self) -> list[dict[str, str]]:
        return []


def steps_cols(*windows: tuple[int, int, int, str, int, int]) -> dict[str, list[Any]]:
    """(step_id, t_start, t_end, phase, prompt_rows, decode_rows) -> steps columns."""
    return {
        "step_id": [w[0] for w in windows],
        "t_start_ns": [w[1] for w in windows],
        "t_end_ns": [w[2] for w in windows],
        "phase": [w[3] for w in windows],
        "ctx_id": [0] * len(windows),
        "prompt_rows": [w[4] for w in windows],
        "decode_rows": [w[5] for w in windows],
    }


def rows_of(tables: schema.Tables) -> list[tuple[Any, ...]]:
    cols = tables.get("cpu_stacks")
    if not cols:
        return []
    schema.check_columns("cpu_stacks", cols)
    keys = ("step_id", "step_kind", "phase", "tid", "in_kernel", "stack", "samples", "t_first_ns")
    return sorted(zip(*(cols[k] for k in keys), strict=True), key=lambda r: (r[7], r[3]))


def test_samples_join_the_step_whose_window_holds_them_and_wait_for_steps_not_yet_ended() -> None:
    s = FakeSampler()
    p = CpuProfile(s, NamesOf(), hold_s=1e-6, clock=lambda: 1000)  # type: ignore[arg-type]
    s.queue = [
        Sample(100, 1, (1, 2), False),  # in step 7 (prompt)
        Sample(150, 2, (1, 2), False),  # in step 7, another thread: a row of its own
        Sample(160, 1, (1, 2), False),  # in step 7, same thread and stack: counted with the first
        Sample(250, 1, (3,), True),  # between steps 7 and 8, in the kernel
        Sample(300, 1, (1, 4), False),  # in step 8, which has not ended yet: held
    ]
    got = rows_of(p.poll())
    assert got == []  # no step seen: every sample may lie in a step still running
    got = rows_of(p.rows(steps_cols((7, 90, 200, "prefill", 5, 0)), ()))
    assert got == [
        (7, "prompt", "prefill", 1, False, "f2;f1", 2, 100),
        (7, "prompt", "prefill", 2, False, "f2;f1", 1, 150),
    ]
    # step 8 ends: the sample between the steps and the one in step 8 are decided
    got = rows_of(p.rows(steps_cols((8, 280, 320, "decode", 0, 1)), ()))
    assert got == [
        (None, BETWEEN_STEPS, None, 1, True, f"f3;{KERNEL_FRAME}", 1, 250),
        (8, "decode", "decode", 1, False, "f4;f1", 1, 300),
    ]
    # a step the policy set apart: its window only
    s.queue = [Sample(410, 3, (5,), False), Sample(900, 3, (5,), False)]
    apart = [FakeParts({"t_start_ns": [400], "t_end_ns": [450]})]
    got = rows_of(p.rows(steps_cols(), apart))  # type: ignore[arg-type]
    assert got == [(None, UNRECORDED_STEP, None, 3, False, "f5", 1, 410)]
    # the last sample waits for a step that never comes: decided at the end
    got = rows_of(p.poll(final=True))
    assert got == [(None, BETWEEN_STEPS, None, 3, False, "f5", 1, 900)]
    assert p.joined == {"prompt": 3, "decode": 1, "mixed": 0, BETWEEN_STEPS: 2, UNRECORDED_STEP: 1}
    p.stop()
    assert s.closed


def test_a_sample_older_than_the_hold_is_decided_without_a_step() -> None:
    s = FakeSampler()
    p = CpuProfile(s, NamesOf(), hold_s=1e-6, clock=lambda: 2000)  # type: ignore[arg-type]
    s.queue = [Sample(5, 1, (), False), Sample(1500, 1, (), False)]  # held 1995 and 500 ns
    assert rows_of(p.poll()) == [(None, BETWEEN_STEPS, None, 1, False, "", 1, 5)]


class FakeParts:
    """An ArrayRows of the columns a policy keeps of a dropped step: only its window."""

    def __init__(self, cols: dict[str, list[int]]) -> None:
        self.arrays = cols

    def column(self, name: str) -> list[int]:
        return self.arrays[name]


# ---------------------------------------------------------------- names from ELF files

LIB_C = r"""
static int __attribute__((noinline)) hidden_work(int x) { return x * 7 + 1; }
int visible_entry(int x) { return hidden_work(x) + 2; }
"""


def _build_lib(tmp_path: Path, name: str, *, strip: bool) -> Path:
    src = tmp_path / "lib.c"
    src.write_text(LIB_C)
    lib = tmp_path / name
    gcc = shutil.which("gcc")
    assert gcc, "gcc is part of the set-up (scripts/install.sh)"
    subprocess.run([gcc, "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=120)
    if strip:
        subprocess.run(["/usr/bin/strip", "--strip-all", str(lib)], check=True, timeout=60)
    return lib


def _symbol_address(lib: Path, name: str, base: int) -> int:
    """Where `name` of `lib` is mapped, from nm's value in the unstripped build and the mapping."""
    out = subprocess.run(["/usr/bin/nm", str(lib)], capture_output=True, text=True, check=True).stdout
    value = next(int(line.split()[0], 16) for line in out.splitlines() if line.endswith(" " + name))
    return base + value


def _load_base(lib: Path) -> int:
    """The load address of `lib` in this process (the start of its mapping at file offset 0)."""
    return min(m.start - m.offset for m in read_maps(os.getpid()) if m.path == str(lib))


@pytest.mark.parametrize("strip", [False, True])
def test_addresses_are_named_from_the_file_the_process_maps(tmp_path: Path, strip: bool) -> None:
    plain = _build_lib(tmp_path, "libplain.so", strip=False)
    lib = _build_lib(tmp_path, f"libs{int(strip)}.so", strip=strip)
    handle = ctypes.CDLL(str(lib))
    assert handle.visible_entry(1) == 10
    base = _load_base(lib)
    # the two builds are the same code: nm of the unstripped one says where each function is
    entry = _symbol_address(plain, "visible_entry", base)
    hidden = _symbol_address(plain, "hidden_work", base)
    names = Symboliser(os.getpid())
    assert names.name(entry) == "visible_entry"
    assert names.name(entry + 1) == "visible_entry"
    if strip:  # a stripped file: its exported functions only; the rest by file offset, never misnamed
        assert names.name(hidden).startswith(f"{lib.name}+0x")
        want = SYMBOLS_DYNAMIC
    else:
        assert names.name(hidden) == "hidden_work"
        want = SYMBOLS_FULL
    files = {f["path"]: f["symbols"] for f in names.files_meta()}
    assert files[str(lib)] == want
    assert names.frames((entry, hidden), kernel=True)[0] == names.name(hidden)  # root first
    assert names.frames((entry,), kernel=True)[-1] == KERNEL_FRAME


def test_build_id_is_the_one_readelf_shows(tmp_path: Path) -> None:
    lib = _build_lib(tmp_path, "libid.so", strip=False)
    notes = subprocess.run(["/usr/bin/readelf", "-n", str(lib)], capture_output=True, text=True, check=True)
    want = next(line.split(":")[1].strip() for line in notes.stdout.splitlines() if "Build ID" in line)
    fd = os.open(lib, os.O_RDONLY)
    try:
        assert build_id(fd) == want
    finally:
        os.close(fd)


# ---------------------------------------------------------------- pprof


def _varint(b: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return v, i


def decode(b: bytes) -> dict[int, list[Any]]:
    """A protobuf message's fields: number -> values (ints, or bytes for length-delimited)."""
    out: dict[int, list[Any]] = {}
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        field, wire = key >> 3, key & 7
        v: int | bytes
        if wire == 0:
            v, i = _varint(b, i)
        elif wire == 2:
            n, i = _varint(b, i)
            v, i = b[i : i + n], i + n
        else:
            raise AssertionError(f"wire type {wire} is not one the export writes")
        out.setdefault(field, []).append(v)
    return out


def packed(b: bytes) -> list[int]:
    vals, i = [], 0
    while i < len(b):
        v, i = _varint(b, i)
        vals.append(v)
    return vals


def stacks_frame() -> pl.DataFrame:
    rows = [
        (1, "prompt", "prefill", 11, False, "main;llama_decode;ggml_vec_dot_f16", 30, 100),
        (1, "prompt", "prefill", 12, False, "start_thread;worker;ggml_vec_dot_f16", 25, 110),
        (2, "decode", "decode", 11, False, "main;llama_decode;ggml_vec_dot_f16", 6, 300),
        (2, "decode", "decode", 11, True, "main;llama_decode;read;[kernel]", 2, 310),
        (None, BETWEEN_STEPS, None, 11, False, "main;_PyEval_EvalFrameDefault", 4, 400),
        (3, "decode", "decode", 11, False, "main;llama_decode;ggml_vec_dot_f16", 3, 500),
    ]
    keys = ("step_id", "step_kind", "phase", "tid", "in_kernel", "stack", "samples", "t_first_ns")
    cols: dict[str, list[object]] = {k: [r[i] for r in rows] for i, k in enumerate(keys)}
    cols["ctx_id"] = [0 if r[0] is not None else None for r in rows]
    cols["pid"] = [7] * len(rows)
    return schema.frame("cpu_stacks", cols)


def _own_reader(
    data: bytes,
) -> tuple[Counter[tuple[tuple[str, ...], tuple[tuple[str, str], ...]]], dict[str, Any]]:
    """(frames leaf first, labels) -> sample count, and the header fields, by our own decoder."""
    p = decode(data)
    strings = [s.decode() for s in p[6]]
    assert strings[0] == ""
    funcs = {d[1][0]: strings[d[2][0]] for d in map(decode, p[5])}
    locs = {d[1][0]: funcs[decode(d[4][0])[1][0]] for d in map(decode, p[4])}
    got: Counter[tuple[tuple[str, ...], tuple[tuple[str, str], ...]]] = Counter()
    for raw in p[2]:
        s = decode(raw)
        frames = tuple(locs[i] for i in packed(s[1][0]))
        count, cpu_ns = packed(s[2][0])
        labels = []
        for lab in map(decode, s.get(3, [])):
            key = strings[lab[1][0]]
            labels.append((key, strings[lab[2][0]] if 2 in lab else str(lab[3][0])))
        got[(frames, tuple(sorted(labels)))] += count
        assert cpu_ns == count * decode_period(p)
    types = [(strings[decode(t)[1][0]], strings[decode(t)[2][0]]) for t in p[1]]
    period_type = decode(p[11][0])
    header = {
        "sample_type": types,
        "period_type": (strings[period_type[1][0]], strings[period_type[2][0]]),
        "period": p[12][0],
        "time_nanos": p[9][0],
        "default_sample_type": strings[p[14][0]],
    }
    return got, header


def decode_period(p: dict[int, list[Any]]) -> int:
    return int(p[12][0])


def _want(stacks: pl.DataFrame) -> Counter[tuple[tuple[str, ...], tuple[tuple[str, str], ...]]]:
    want: Counter[tuple[tuple[str, ...], tuple[tuple[str, str], ...]]] = Counter()
    for stack, kind, phase, tid, n in stacks.select(
        "stack", "step_kind", "phase", "tid", "samples"
    ).iter_rows():
        labels = [("step_kind", kind), ("thread id", str(tid))] + ([("phase", phase)] if phase else [])
        want[(tuple(reversed(stack.split(";"))), tuple(sorted(labels)))] += n
    return want


def test_the_pprof_profile_decodes_back_to_the_rows(tmp_path: Path) -> None:
    stacks = stacks_frame()
    data = profile_bytes(stacks, period_ns=10_000_000, time_nanos=5_000_000_000, comment="test")
    got, header = _own_reader(data)
    assert got == _want(stacks)
    assert header == {
        "sample_type": [("samples", "count"), ("cpu", "nanoseconds")],
        "period_type": ("cpu", "nanoseconds"),
        "period": 10_000_000,
        "time_nanos": 5_000_000_000,
        "default_sample_type": "cpu",
    }


def _protobuf_profile_class() -> Any:
    """perftools.profiles.Profile built from profile.proto's field numbers and types, for the
    protobuf library (an independent decoder of the export)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    T = descriptor_pb2.FieldDescriptorProto
    f = descriptor_pb2.FileDescriptorProto(
        name="profile_test.proto", package="perftools.profiles", syntax="proto3"
    )

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        m = f.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            fd = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                fd.type_name = f".perftools.profiles.{type_name}"

    opt, rep = T.LABEL_OPTIONAL, T.LABEL_REPEATED
    i64, u64, s, msg, b = T.TYPE_INT64, T.TYPE_UINT64, T.TYPE_STRING, T.TYPE_MESSAGE, T.TYPE_BOOL
    message(
        "Profile",
        ("sample_type", 1, msg, rep, "ValueType"),
        ("sample", 2, msg, rep, "Sample"),
        ("mapping", 3, msg, rep, "Mapping"),
        ("location", 4, msg, rep, "Location"),
        ("function", 5, msg, rep, "Function"),
        ("string_table", 6, s, rep, ""),
        ("drop_frames", 7, i64, opt, ""),
        ("keep_frames", 8, i64, opt, ""),
        ("time_nanos", 9, i64, opt, ""),
        ("duration_nanos", 10, i64, opt, ""),
        ("period_type", 11, msg, opt, "ValueType"),
        ("period", 12, i64, opt, ""),
        ("comment", 13, i64, rep, ""),
        ("default_sample_type", 14, i64, opt, ""),
    )
    message("ValueType", ("type", 1, i64, opt, ""), ("unit", 2, i64, opt, ""))
    message(
        "Sample",
        ("location_id", 1, u64, rep, ""),
        ("value", 2, i64, rep, ""),
        ("label", 3, msg, rep, "Label"),
    )
    message(
        "Label",
        ("key", 1, i64, opt, ""),
        ("str", 2, i64, opt, ""),
        ("num", 3, i64, opt, ""),
        ("num_unit", 4, i64, opt, ""),
    )
    message(
        "Mapping",
        ("id", 1, u64, opt, ""),
        ("memory_start", 2, u64, opt, ""),
        ("memory_limit", 3, u64, opt, ""),
        ("file_offset", 4, u64, opt, ""),
        ("filename", 5, i64, opt, ""),
        ("build_id", 6, i64, opt, ""),
        ("has_functions", 7, b, opt, ""),
    )
    message(
        "Location",
        ("id", 1, u64, opt, ""),
        ("mapping_id", 2, u64, opt, ""),
        ("address", 3, u64, opt, ""),
        ("line", 4, msg, rep, "Line"),
        ("is_folded", 5, b, opt, ""),
    )
    message("Line", ("function_id", 1, u64, opt, ""), ("line", 2, i64, opt, ""))
    message(
        "Function",
        ("id", 1, u64, opt, ""),
        ("name", 2, i64, opt, ""),
        ("system_name", 3, i64, opt, ""),
        ("filename", 4, i64, opt, ""),
        ("start_line", 5, i64, opt, ""),
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("perftools.profiles.Profile"))


def test_the_protobuf_library_reads_the_export_file_as_profile_proto(tmp_path: Path) -> None:
    rec = tmp_path / "rec"
    stacks = stacks_frame()
    meta = {
        **META,
        "start_unix_ms": 1_700_000_000_000,
        "end_unix_ms": 1_700_000_002_500,
        "cpu_sampler": {"rate_hz": 100, "period_ns": 10_000_000},
    }
    with RecordingWriter(rec, meta) as w:
        w.append("cpu_stacks", stacks)
    assert open_recording(rec).cpu_stacks().height == stacks.height
    out = tmp_path / "cpu.pb.gz"
    assert cli.main(["export", str(rec), "--pprof", str(out)]) == 0
    profile = _protobuf_profile_class()()
    profile.ParseFromString(gzip.decompress(out.read_bytes()))
    st = list(profile.string_table)
    funcs = {fn.id: st[fn.name] for fn in profile.function}
    locs = {loc.id: funcs[loc.line[0].function_id] for loc in profile.location}
    got: Counter[tuple[tuple[str, ...], tuple[tuple[str, str], ...]]] = Counter()
    for s in profile.sample:
        labels = tuple(sorted((st[lab.key], st[lab.str] if lab.str else str(lab.num)) for lab in s.label))
        got[(tuple(locs[i] for i in s.location_id), labels)] += s.value[0]
        assert s.value[1] == s.value[0] * profile.period
    assert got == _want(stacks)
    assert [(st[t.type], st[t.unit]) for t in profile.sample_type] == [
        ("samples", "count"),
        ("cpu", "nanoseconds"),
    ]
    assert profile.period == 10_000_000 and st[profile.default_sample_type] == "cpu"
    assert profile.time_nanos == 1_700_000_000_000 * 1_000_000
    assert profile.duration_nanos == 2_500 * 1_000_000
    # the same recording, the same bytes
    again = tmp_path / "again.pb.gz"
    assert cli.main(["export", str(rec), "--pprof", str(again)]) == 0
    assert again.read_bytes() == out.read_bytes()


def test_a_recording_without_samples_is_refused_by_export_pprof(tmp_path: Path) -> None:
    rec = tmp_path / "rec"
    with RecordingWriter(rec, META):
        pass
    assert cli.main(["export", str(rec), "--pprof", str(tmp_path / "x.pb.gz")]) != 0
    assert not (tmp_path / "x.pb.gz").exists()


def test_folded_text_and_self_shares() -> None:
    stacks = stacks_frame()
    text = folded_text(stacks)
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines())
    assert lines["main;llama_decode;ggml_vec_dot_f16"] == "39"
    assert sum(int(v) for v in lines.values()) == int(stacks["samples"].sum())
    shares = dict(self_shares(stacks))
    assert shares["ggml_vec_dot_f16"] == pytest.approx(64 / 70)
    assert shares[KERNEL_FRAME] == pytest.approx(2 / 70)


# ---------------------------------------------------------------- the report's flame graph


def test_the_flame_graph_boxes_hold_the_samples_under_them_and_names_stay_text(tmp_path: Path) -> None:
    import re

    from sparseety_prof.views.html_report import write_html
    from sparseety_prof.views.html_report.flame import WIDTH, flame_svg

    stacks = stacks_frame()
    hostile = "<script>alert(1)</script>"
    stacks = stacks.with_columns(pl.col("stack").str.replace("worker", hostile, literal=True))
    rec = tmp_path / "rec"
    meta = {
        "pid": 7,
        "engine": {"name": "llama.cpp", "version": "b1"},
        "model": {"name": "m"},
        "cpu_sampler": {"rate_hz": 100, "period_ns": 10_000_000, "samples": 70, "files": []},
    }
    with RecordingWriter(rec, meta) as w:
        w.append("cpu_stacks", stacks)
    page = tmp_path / "r.html"
    with page.open("wb") as f:
        write_html(open_recording(rec), f)
    text = page.read_text()
    assert "<script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    # every box: its title's samples, and a width in proportion to them
    svg = flame_svg([(s, n) for s, n in stacks.select("stack", "samples").iter_rows()], "t")
    boxes = re.findall(
        r'<title>([^<]*) \((\d+) samples, [\d.]+%\)</title><rect x="[\d.]+" y="\d+" width="([\d.]+)"', svg
    )
    by_name = {name: (int(n), float(w)) for name, n, w in boxes}
    assert by_name["all"] == (70, WIDTH - 0.5)
    # the same function under llama_decode (39 samples) and under the worker thread (25): two boxes
    assert sorted(int(n) for name, n, _ in boxes if name == "ggml_vec_dot_f16") == [25, 39]
    for _name, n, w in boxes:
        assert float(w) == pytest.approx(WIDTH * int(n) / 70 - 0.5, abs=0.01)
    # the sample totals of the panel's folded-away graphs: prefill, decode, between steps
    sums = dict(re.findall(r"<summary>([a-z ]+?)(?: steps)?: (\d+) samples</summary>", text))
    assert sums == {"prefill": "55", "decode": "11", "between": "4"}  # ("between steps")


def test_a_recording_without_the_sampler_says_so_in_the_report(tmp_path: Path) -> None:
    from sparseety_prof.views.html_report import write_html

    rec = tmp_path / "rec"
    with RecordingWriter(rec, {"pid": 7, "engine": {"name": "llama.cpp"}}):
        pass
    page = tmp_path / "r.html"
    with page.open("wb") as f:
        write_html(open_recording(rec), f)
    assert "made without the CPU sampler" in page.read_text()


def test_a_process_that_exits_leaves_names_by_file_offset_not_an_error() -> None:
    import time

    child = subprocess.Popen(["/bin/sleep", "60"])
    try:
        deadline = time.monotonic() + 30
        while True:  # its code mapped yet (exec'd)?
            m = next((m for m in read_maps(child.pid) if "x" in m.perms and m.path.endswith("/sleep")), None)
            if m is not None:
                break
            assert time.monotonic() < deadline
            time.sleep(0.01)
        names = Symboliser(child.pid)  # its mappings read now, while it lives
    finally:
        child.kill()
        child.wait()
    # the file can no longer be opened through the process: the address is named by its offset
    assert names.name(m.start + 0x10) == f"sleep+{m.offset + 0x10:#x}"
    assert names.name(1) == "[unknown]"  # in no mapping, and the maps cannot be read again
    assert names.files_meta()[0]["symbols"] == "none"


# ---------------------------------------------------------------- the sampler itself (root)

SPIN_C = r"""
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>
#include <sys/syscall.h>
volatile unsigned long sink;
__attribute__((noinline)) void hot_leaf(void) { while (++sink) {} }
__attribute__((noinline)) void caller_of_leaf(void) { hot_leaf(); sink--; }
__attribute__((noinline)) void *worker(void *arg) { (void)arg; caller_of_leaf(); return NULL; }
int main(void) {
    pthread_t t;
    pthread_create(&t, NULL, worker, NULL);
    printf("%ld\n", (long)syscall(SYS_gettid)); fflush(stdout);
    for (;;) pause();  /* the main thread sleeps: it takes no CPU, so no sample */
}
"""


@pytest.mark.root
def test_the_sampler_takes_the_spinning_threads_stack_and_only_the_target_process(tmp_path: Path) -> None:
    import time

    from sparseety_prof.capture.cpu_sampler import CpuSampler

    src, exe = tmp_path / "spin.c", tmp_path / "spin"
    src.write_text(SPIN_C)
    gcc = shutil.which("gcc")
    assert gcc
    # frame pointers, so that the kernel can walk the stack above the leaf
    cflags = ["-O0", "-fno-omit-frame-pointer", "-pthread"]  # (-O0: the leaf, too, sets up its frame)
    subprocess.run([gcc, *cflags, "-o", str(exe), str(src)], check=True, timeout=120)
    spin = subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True)  # the same code, not sampled
    try:
        assert spin.stdout is not None
        main_tid = int(spin.stdout.readline())
        held_before = _bpf_and_perf_fds()
        sampler = CpuSampler.attach(spin.pid, 97)
        assert _bpf_and_perf_fds() - held_before  # its program, maps and one perf event per CPU
        try:
            samples: list[Sample] = []
            deadline = time.monotonic() + 60
            while len(samples) < 50 and time.monotonic() < deadline:
                time.sleep(0.2)
                samples += sampler.take()
            lagging = sum(sampler.counts().values())
            sampler.pause()  # no sample after this: the records and the counts agree
            samples += sampler.take()
            counted = sampler.counts()
            lost = sampler.lost()
            time.sleep(0.1)  # a spinning thread would be sampled ten times over by now
            assert sampler.take() == [] and sampler.counts() == counted
        finally:
            sampler.close()
        assert _bpf_and_perf_fds() == held_before  # closed: nothing of it is left in this process
        names = Symboliser(spin.pid)
        folded = Counter(";".join(names.frames(s.stack, kernel=s.kernel)) for s in samples)  # (while it runs)
        tids = {s.tid for s in samples}
        worker = next(int(t) for t in os.listdir(f"/proc/{spin.pid}/task") if int(t) != main_tid)
    finally:
        spin.kill()
        other.kill()
        spin.wait()
        other.wait()
    assert len(samples) >= 50
    assert tids == {worker}  # the sleeping main thread and the other process: never sampled
    user = {stack: n for stack, n in folded.items() if not stack.endswith(KERNEL_FRAME)}
    # the user stack, root first: the thread's start in libc, then worker -> caller -> leaf
    top, n_top = max(user.items(), key=lambda kv: kv[1])
    assert top.endswith("worker;caller_of_leaf;hot_leaf"), folded
    assert n_top >= 0.9 * len(samples), folded
    # paused, the kernel's counts and the records hold the same samples (while it ran, the
    # records could only lag the counts)
    assert sum(n for (tid, _), n in counted.items() if tid == worker) == len(samples) >= lagging
    assert lost == {"ring": 0, "stacks": 0, "counts": 0}


def _bpf_and_perf_fds() -> Counter[str]:
    """This process's descriptors of BPF objects and perf events, by kind."""
    kinds: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("anon_inode:") and ("bpf" in target or "perf_event" in target):
            kinds[target] += 1
    return kinds


def test_a_step_belongs_to_the_requests_of_its_sequences_running_at_its_start() -> None:
    from sparseety_prof.views.cpu_stacks import request_steps

    steps = pl.DataFrame(
        {
            "step_id": [1, 2, 3, 4, 5],
            "ctx_id": [0, 0, 0, 0, 0],
            "t_start_ns": [10, 20, 30, 45, 60],
            "seq_ids": [[0], [0, 1], [1], [0], [0]],
        }
    )
    requests = pl.DataFrame(
        {
            "request_id": ["a", "b", "c"],
            "ctx_id": [0, 0, 0],
            "seq_id": [0, 1, 0],
            "t_started_ns": [5, 18, 50],
            "t_last_token_ns": [35, 40, 70],
        }
    )
    got = sorted(request_steps(steps, requests).iter_rows())
    # step 2 batched a and b (both count its samples); step 4 ran after a's last token and before
    # c started on the same sequence: no request's
    assert got == [(1, "a"), (2, "a"), (2, "b"), (3, "b"), (5, "c")]


def test_addresses_outside_every_mapping_reread_the_maps_at_most_once_a_period(tmp_path: Path) -> None:
    """A stack walked through code without frame pointers ends in addresses no mapping holds:
    each would re-read the process's maps. They are re-read once per MAPS_REREAD_S at most, and a
    library mapped after a read is named once the next read is due."""
    now = [100.0]
    names = Symboliser(os.getpid(), clock=lambda: now[0])
    assert names.maps_reads == 1
    astray = [0x10 + 8 * i for i in range(500)]  # below every mapping
    assert {names.name(a) for a in astray} == {UNKNOWN_FRAME}
    assert names.maps_reads == 1  # none of them re-read the maps: read an instant ago
    plain = _build_lib(tmp_path, "libmappedlate.so", strip=False)
    ctypes.CDLL(str(plain))
    entry = _symbol_address(plain, "visible_entry", _load_base(plain))
    assert names.name(entry) == UNKNOWN_FRAME  # mapped after the last read: not yet known
    now[0] += Symboliser.MAPS_REREAD_S
    assert names.name(entry) == "visible_entry" and names.maps_reads == 2
    assert names.name(astray[0]) == UNKNOWN_FRAME and names.maps_reads == 2


def test_re_reads_that_place_nothing_back_off_and_one_that_places_a_library_resets(tmp_path: Path) -> None:
    """Addresses astray at every drain re-read the maps at doubling periods, up to the most;
    a library mapped meanwhile is named at the next re-read, and the period starts over."""
    now = [100.0]
    names = Symboliser(os.getpid(), clock=lambda: now[0])
    reads_at = []
    for step in range(200):  # one drain a second, each with a new address astray
        now[0] = 101.0 + step
        before = names.maps_reads
        assert names.name(0x10 + 8 * step) == UNKNOWN_FRAME
        if names.maps_reads > before:
            reads_at.append(step)
    gaps = [b - a for a, b in itertools.pairwise(reads_at)]
    assert gaps[:5] == [2, 4, 8, 16, 32]
    assert set(gaps[5:]) == {32}  # Symboliser.MAPS_REREAD_MAX_S
    plain = _build_lib(tmp_path, "libmappedlater.so", strip=False)
    ctypes.CDLL(str(plain))
    entry = _symbol_address(plain, "visible_entry", _load_base(plain))
    now[0] = 101.0 + reads_at[-1] + Symboliser.MAPS_REREAD_MAX_S
    assert names.name(entry) == "visible_entry"
    now[0] += Symboliser.MAPS_REREAD_S
    before = names.maps_reads
    assert names.name(0x8) == UNKNOWN_FRAME and names.maps_reads == before + 1  # back to the shortest
