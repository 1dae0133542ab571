"""The ggml_tensor layout the sparse-decision probes read: verified on live memory at attach time,
discovered where the table's does not hold, refused (exit 6, naming the invariant) where none does.

Unit tests build ggml_tensor structs byte by byte, as ggml lays them out for a given set of
offsets, next to the noise a real heap has (bare copies of the names, zeros); the engine tests
read a live llama-cpp-python process."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from conftest import ENGINES, ROOT, Engine, Recorder

from sparseety_prof.capture import params_check as pc
from sparseety_prof.capture import tensor_layout_solver as tls
from sparseety_prof.capture.gguf_info import TensorInfo, read_tensor_infos
from sparseety_prof.capture.layouts import TensorLayout
from sparseety_prof.capture.tensor_probe import ProcessMemory, verify_tensor_layout
from sparseety_prof.errors import UnsupportedEngineBuild

TABLE = tls.Solved(type=0, ne=16, nb=48, src=152, data=248, name=256)
# older ggml: a grad pointer and GGML_MAX_SRC 6 (src 4 slots earlier, one more pointer before data)
OLD = tls.Solved(type=0, ne=16, nb=48, src=160, data=224, name=240)
SHIFTED = tls.Solved(type=0, ne=24, nb=56, src=168, data=264, name=272)  # a field more after type
LAYOUTS = [TABLE, OLD, SHIFTED]

INFOS = [
    TensorInfo("token_embd.weight", 12, (256, 1000), 0, None),  # Q4_K
    *(
        t
        for i in range(3)
        for t in (
            TensorInfo(f"blk.{i}.attn_norm.weight", 0, (256,), 0, None),  # F32
            TensorInfo(f"blk.{i}.attn_q.weight", 8, (256, 256), 0, None),  # Q8_0
            TensorInfo(f"blk.{i}.ffn_down.weight", 1, (512, 256), 0, None),  # F16
        )
    ),
    TensorInfo("output.weight", 14, (256, 1000), 0, None),  # Q6_K
]
SPECS = tls.weight_specs(INFOS)
BASE = 0x5555_0000_0000
STRIDE = 512  # one tensor per slot, as in a ggml context (object header + struct + padding)


@dataclass
class Heap:
    """ggml contexts written with layout `lay`: the model's weights, then a graph."""

    lay: tls.Solved
    data: bytearray

    def put(self, slot: int, name: bytes, typ: int, ne: tuple[int, ...], nb: tuple[int, ...],
            data: int, src: tuple[int, ...] = ()) -> int:  # fmt: skip
        at = slot * STRIDE + STRIDE + 64  # after an object header; the first slot left to other data
        lay = self.lay
        struct.pack_into("<i", self.data, at + lay.type, typ)
        struct.pack_into("<Q", self.data, at + lay.type + 8, BASE + 0xDEAD000)  # a buffer pointer
        struct.pack_into("<4q", self.data, at + lay.ne, *ne)
        struct.pack_into("<4Q", self.data, at + lay.nb, *nb)
        for i, s in enumerate(src):
            struct.pack_into("<Q", self.data, at + lay.src + 8 * i, s)
        struct.pack_into("<Q", self.data, at + lay.data, data)
        self.data[at + lay.name : at + lay.name + len(name) + 1] = name + b"\x00"
        return BASE + at


def heap(lay: tls.Solved, perturb: str = "") -> tls.BytesMemory:
    h = Heap(lay, bytearray(STRIDE * (len(SPECS) + 10)))
    addr: dict[str, int] = {}
    for i, (raw, spec) in enumerate(SPECS.items()):
        name = raw[:-1].upper() if perturb == "garbage names" else raw[:-1]
        ne = (spec.ne[0], spec.ne[1] + 1, *spec.ne[2:]) if perturb == "wrong shapes" else spec.ne
        nb = (spec.nb[0] + 1, *spec.nb[1:]) if perturb == "wrong strides" else spec.nb
        typ = spec.ggml_type + 1 if perturb == "wrong types" else spec.ggml_type
        data = 0 if perturb == "null data" else 0x7F00_0000_0000 + 0x100000 * i
        addr[spec.name] = h.put(i, name, typ, ne, nb, data)
    n = len(SPECS)
    tokens = h.put(n, b"inp_tokens", 26, (7, 1, 1, 1), (4, 28, 28, 28), 0x7F10_0000_0000)
    norm = h.put(n + 1, b"result_norm", 0, (256, 7, 1, 1), (4, 1024, 7168, 7168), 0x7F10_0001_0000)
    embd_src = BASE + 8 if perturb == "src elsewhere" else addr["token_embd.weight"]
    if perturb != "no graph":
        h.put(n + 2, b"inp_embd", 0, (256, 7, 1, 1), (4, 1024, 7168, 7168), 0, (embd_src, tokens))
        h.put(n + 3, b"result_output", 0, (1000, 7, 1, 1), (4, 4000, 28000, 28000), 0,
              (addr["output.weight"] if perturb != "src elsewhere" else BASE + 8, norm))  # fmt: skip
    # what else a heap holds: a stale struct in freed memory, partly overwritten (its type), and
    # the names as bare strings (a GGUF string table, std::strings)
    spec = SPECS[b"token_embd.weight\x00"]
    h.put(n + 4, b"token_embd.weight", 0x5EED, spec.ne, spec.nb, 0x7F20_0000_0000)
    strings = b"".join(raw + b"\x00\x00\x00" for raw in SPECS) + b"inp_embd\x00"
    if perturb == "garbage names":
        strings = strings.upper()
    return tls.BytesMemory([(BASE, bytes(h.data)), (BASE + 0x100000, strings)])


@pytest.mark.parametrize("lay", LAYOUTS, ids=["table", "old", "shifted"])
def test_finds_the_layout_from_weights_and_graph_nodes(lay: tls.Solved) -> None:
    v = tls.solve(heap(lay), SPECS)
    assert v.layout == lay, v.reason
    assert v.weights == len(SPECS) and v.nodes == 2


def test_table_holds_on_its_own_layout_only() -> None:
    assert tls.check(heap(TABLE), SPECS, TABLE).layout == TABLE
    for other in (OLD, SHIFTED):
        v = tls.check(heap(other), SPECS, TABLE)
        assert v.layout is None and "invariant '" in v.reason


@pytest.mark.parametrize(
    "perturb, invariant",
    [
        ("garbage names", "name"),
        ("wrong shapes", "ne"),
        ("wrong strides", "nb"),
        ("null data", "data"),
        ("wrong types", "type"),
        ("src elsewhere", "src"),
        ("no graph", "src"),
    ],
)
def test_perturbed_structs_are_refused_naming_the_invariant(perturb: str, invariant: str) -> None:
    v = tls.solve(heap(TABLE, perturb), SPECS)
    assert v.layout is None
    assert v.reason.startswith(f"invariant '{invariant}' failed"), v.reason
    assert tls.check(heap(TABLE, perturb), SPECS, TABLE).layout is None


def test_fields_out_of_ggml_order_are_refused() -> None:
    swapped = tls.Solved(type=0, ne=48, nb=16, src=152, data=248, name=256)
    v = tls.solve(heap(swapped), SPECS)
    assert v.layout is None and v.reason.startswith("invariant 'order' failed"), v.reason


def test_verify_prefers_the_table_and_falls_back_to_discovery() -> None:
    table = TensorLayout()
    c = verify_tensor_layout(heap(TABLE), INFOS, table, what="test")
    assert c.source == "table, verified on live data" and c.layout == table and c.table_failure is None
    c = verify_tensor_layout(heap(OLD), INFOS, table, what="test")
    assert c.source == "discovered on live data"
    assert (c.layout.ne, c.layout.src, c.layout.data, c.layout.name) == (16, 160, 224, 240)
    assert c.table_failure is not None and c.table_failure.startswith("invariant '")
    assert c.to_meta()["tensor_layout"] == c.layout.__dict__


def test_refusal_is_exit_6_naming_both_failures() -> None:
    with pytest.raises(UnsupportedEngineBuild) as e:
        verify_tensor_layout(heap(TABLE, "wrong shapes"), INFOS, TensorLayout(), what="test")
    assert e.value.exit_code == 6
    assert str(e.value).count("invariant 'ne' failed") == 2


def test_another_programs_memory_is_refused() -> None:
    """This test process holds the model's weight names (as Python strings) but no ggml tensor."""
    names = [i.name for i in INFOS]  # noqa: F841 (kept alive: the names are in this process's heap)
    with pytest.raises(UnsupportedEngineBuild, match=r"invariant '(name|ne)' failed"):
        verify_tensor_layout(ProcessMemory(os.getpid()), INFOS, TensorLayout(), what="this process")


# ---- a live llama-cpp-python engine ------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Path]]:
    from sparseety_prof.synthetic import make_model

    model = make_model(tmp_path_factory.mktemp("m") / "moe.gguf", "moe")
    e = Engine([str(ENGINES / "llama_engine.py"), str(model)])
    yield e, model
    e.close()


@pytest.mark.root
@pytest.mark.engine
def test_live_engine_has_the_tables_layout_and_a_wrong_table_is_caught(live: tuple[Engine, Path]) -> None:
    e, model = live
    infos = read_tensor_infos(model)
    table = TensorLayout()
    found = tls.solve(ProcessMemory(e.pid), tls.weight_specs(infos))
    assert found.layout == tls.Solved(table.type, table.ne, table.nb, table.src, table.data, table.name)
    assert found.weights == len(tls.weight_specs(infos)) and found.nodes >= 1  # before any request
    for wrong in (replace(table, name=264, data=256), replace(table, src=160), replace(table, ne=24, nb=56)):
        c = verify_tensor_layout(ProcessMemory(e.pid), infos, wrong, what=f"PID {e.pid}")
        assert c.source == "discovered on live data" and c.layout == table
        assert c.table_failure is not None and c.table_failure.startswith("invariant '")


@pytest.mark.root
@pytest.mark.engine
def test_recording_states_the_verified_layout_and_a_wrong_table_is_replaced(
    live: tuple[Engine, Path], tmp_path: Path
) -> None:
    e, _ = live
    rec = Recorder(e.pid, tmp_path / "table")
    e.generate(["The quick brown fox"], 4)
    assert rec.stop()[0] == 0
    check = json.loads((tmp_path / "table" / "meta.json").read_text())["engine"]["tensor_layout_check"]
    assert check["source"] == "table, verified on live data"
    assert check["tensor_layout"] == TensorLayout().__dict__ and check["weights_checked"] > 0

    # the recorder with a table that is wrong for this build: the live check must replace it
    patched = (
        "import dataclasses, sys; from sparseety_prof.capture import layouts as L; r = L.resolve; "
        "L.resolve = lambda *a: dataclasses.replace(r(*a), tensor=L.TensorLayout(src=160, name=264)); "
        "from sparseety_prof.cli import main; sys.exit(main())"
    )
    out = tmp_path / "wrong"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rec_proc = subprocess.Popen(
        [sys.executable, "-c", patched, "record", "--pid", str(e.pid), "-o", str(out)],
        stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    assert rec_proc.stderr is not None
    for line in rec_proc.stderr:
        if "attached to PID" in line:
            break
    e.generate(["The quick brown fox"], 4)
    rec_proc.send_signal(2)
    _, err = rec_proc.communicate(timeout=60)
    assert rec_proc.returncode == 0, err
    check = json.loads((out / "meta.json").read_text())["engine"]["tensor_layout_check"]
    assert check["source"] == "discovered on live data"
    assert check["tensor_layout"] == TensorLayout().__dict__
    assert check["table_failure"].startswith("invariant '")


# ---- ggml_compute_params (ith, nth) on copies of live compute calls -----------------------------


def params_records(
    n_threads: int, *, ith_at: int = 0, nth_at: int = 4, wsize: int = 0x12345, calls: int = 6
) -> list[bytes]:
    """The first 16 bytes of ggml_compute_params as each of `n_threads` threads passes them
    (ith, nth, then the low and high halves of wsize), with the record header of dsc_params."""
    out = []
    for _ in range(calls):
        for ith in range(n_threads):
            raw = bytearray(16)
            struct.pack_into("<Q", raw, 8, wsize)
            struct.pack_into("<i", raw, ith_at, ith)
            struct.pack_into("<i", raw, nth_at, n_threads)
            out.append(struct.pack("<II", 1000 + ith, 1) + bytes(raw))
    return out


def test_params_table_verified() -> None:
    v = pc.check_params(params_records(4), (0, 4))
    assert v.offsets == (0, 4) and v.source == "table, verified on live data" and v.calls == 24


def test_params_discovered_where_the_table_fails() -> None:
    v = pc.check_params(params_records(4, ith_at=4, nth_at=0), (0, 4))
    assert v.offsets == (4, 0) and v.source.startswith(
        "discovered on live data (the table's failed: 0 <= ith"
    )


def test_params_refused_where_one_thread_cannot_tell_the_pairs_apart() -> None:
    v = pc.check_params(params_records(1, ith_at=4, nth_at=0, wsize=0), (0, 4))
    assert v.offsets is None and "invariant failed at the table's offsets: 0 <= ith < nth" in v.source


def test_params_not_checked_without_a_cpu_call() -> None:
    v = pc.check_params([], (0, 4))
    assert v.offsets is None and v.calls == 0 and v.source.startswith("not checked")


@pytest.mark.root
@pytest.mark.engine
def test_discovery_pass_verifies_the_params_table_on_live_calls(
    live: tuple[Engine, Path], tmp_path: Path
) -> None:
    e, _ = live
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            e.generate(["keep the engine working"], 4)

    worker = threading.Thread(target=traffic, daemon=True)
    worker.start()
    try:
        rec = Recorder(e.pid, tmp_path / "rec", "--discover-layout")
    finally:
        stop.set()
        worker.join(timeout=120)
    assert rec.stop()[0] == 0
    eng = json.loads((tmp_path / "rec" / "meta.json").read_text())["engine"]
    params = eng["layout_discovery"]["compute_params"]
    assert params["source"] == "table, verified on live data" and params["offsets"] == [0, 4]
    assert params["calls"] > 0
    assert eng["tensor_layout_check"]["compute_params"] == "layout discovery: table, verified on live data"
