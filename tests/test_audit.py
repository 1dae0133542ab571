"""`audit` and the redaction levels without an engine: the estimators on arrays with known answers,
the attack on synthetic recordings whose routing is (or is not) a function of the token, and every
redaction level applied by RecordingWriter and by `sparseety-prof redact`, checked in the files."""

from __future__ import annotations

import itertools
import json
import math
import stat
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import run_cli

import sparseety_prof
from sparseety_prof.store import schema
from sparseety_prof.store.recording_writer import RecordingWriter
from sparseety_prof.store.redaction_levels import Redaction, parse_layers, parse_levels, redact_frame
from sparseety_prof.views.audit import estimators as est
from sparseety_prof.views.audit.attack import audit

N_EXPERT, K, LAYERS = 8, 2, (0, 1)
SETS = list(itertools.combinations(range(N_EXPERT), K))  # 28: one per token of the synthetic vocab


# ------------------------------------------------------------------ estimators
def test_mutual_information_known_answers() -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 8, 20_000)
    # y = x: I = H(x) = 3 bits
    assert est.mutual_information_bits(x, x, miller_madow=False) == pytest.approx(est.entropy_bits(x))
    assert est.entropy_bits(x) == pytest.approx(3.0, abs=0.01)
    # independent: the plug-in estimate is biased upward by about (8*8 - 8 - 8 + 1) / (2 N ln 2)
    y = rng.integers(0, 8, 20_000)
    plug_in = est.mutual_information_bits(x, y, miller_madow=False)
    corrected = est.mutual_information_bits(x, y)
    assert 0 < plug_in < 0.01 and corrected < plug_in
    assert plug_in == pytest.approx(49 / (2 * 20_000 * math.log(2)), abs=0.002)
    # binary symmetric channel, flip 0.1: I = 1 - H2(0.1) = 0.531 bits
    b = rng.integers(0, 2, 50_000)
    flipped = np.where(rng.random(50_000) < 0.1, 1 - b, b)
    h2 = -(0.1 * math.log2(0.1) + 0.9 * math.log2(0.9))
    assert est.mutual_information_bits(b, flipped) == pytest.approx(1 - h2, abs=0.01)


def test_lookup_and_centroids_recover_a_function_of_the_label() -> None:
    labels = np.repeat(np.arange(5), 10)
    keys = labels * 7 + 3  # one key per class
    s = est.lookup_scores(keys, labels, np.array([10, 24, 999, -1]), 5)
    assert list(np.argmax(s[:2], axis=1)) == [1, 3]
    assert np.allclose(s[2], s[2][0]) and np.all(s[3] == 0)  # unseen key, absent row: no evidence
    x = np.eye(5)[labels] + 0.01 * np.random.default_rng(1).standard_normal((50, 5))
    present = np.ones(50, bool)
    c = est.centroid_scores(x, labels, present, x, present, 5)
    prior = np.zeros(5)
    r = est.ranks(c, prior, labels)
    assert est.top_k(r, 1) == 1.0
    assert list(est.guesses(c, prior)) == list(labels)
    # unseen labels never count as recovered; ties go to the prior
    assert est.top_k(np.array([-1, 0, 3, 7]), 5) == 0.5
    flat = np.zeros((1, 3))
    assert est.guesses(flat, np.log(np.array([0.2, 0.5, 0.3])))[0] == 1


def test_classes_index_marks_unseen_tokens() -> None:
    c = est.Classes(np.array([5, 9, 9, 2]))
    assert list(c.tokens) == [2, 5, 9]
    assert list(c.index(np.array([9, 3, 2, 100]))) == [2, -1, 0, -1]


# ------------------------------------------------------------------ synthetic recordings
def _experts(token: int, pos: int, layer: int, mode: str, rng: np.random.Generator) -> list[int]:
    if mode == "token" and layer == 0:
        return list(SETS[token % len(SETS)])
    return [int(e) for e in rng.choice(N_EXPERT, K, replace=False)]


def write_synthetic(
    path: Path, runs: list[list[int]], *, mode: str, sha: str = "a" * 64, seed: int = 0, **writer: object
) -> None:
    """One prefill step per run; routing a function of the token at layer 0 (mode "token") or
    random (mode "noise"); masks one byte per row equal to the token (mode "token")."""
    rng = np.random.default_rng(seed)
    steps: dict[str, list[object]] = {c: [] for c in schema.STEPS}
    routes: dict[str, list[object]] = {c: [] for c in schema.ROUTES}
    masks: dict[str, list[object]] = {c: [] for c in schema.MASKS}
    for step, run in enumerate(runs):
        n = len(run)
        _add(
            steps, step_id=step, ctx_id=0, decode_id=step, t_start_ns=1000 * step, t_end_ns=1000 * step + 500,
            ts_unix_ms=0, n_tokens=n, n_outputs=1, phase="prefill", prompt_rows=n, decode_rows=0, seq_ids=[0],
            token_ids=run, positions=list(range(n)), row_seq_ids=[0] * n, output_rows=[n - 1],
            truncated=False, pid=1, tid=1,
        )  # fmt: skip
        for row, tok in enumerate(run):
            for layer in LAYERS:
                ids = _experts(tok, row, layer, mode, rng)
                w = [0.6, 0.4] if mode == "token" else list(rng.dirichlet([1, 1]))
                ratio = (tok * 0.37) % 1.0 if mode == "token" else float(rng.random())
                key = {"step_id": step, "ctx_id": 0, "seq_id": 0, "pos": row, "row": row, "layer": layer}
                _add(
                    routes, **key, expert_ids=ids, expert_weights=w, router_probs=None,
                    act_zero_ratio=ratio, act_below_ratio=ratio, act_values=512,
                )  # fmt: skip
                bits = bytes([tok % 256]) if mode == "token" else bytes([int(rng.integers(256))])
                _add(masks, **key, n_values=8, nonzero_bits=bits)
    meta = {
        "model": {"sha256": sha},
        "layers": {"moe": list(LAYERS), "ffn": list(LAYERS), "attn": list(LAYERS)},
    }
    with RecordingWriter(path, meta, **writer) as out:  # type: ignore[arg-type]
        out.append("steps", schema.frame("steps", steps))
        out.append("routes", schema.frame("routes", routes))
        out.append("masks", schema.frame("masks", masks))


def _add(cols: dict[str, list[object]], **values: object) -> None:
    for name, value in values.items():
        cols[name].append(value)


def _runs(seed: int, n_runs: int = 6, length: int = 40, vocab: int = 25) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 3 + vocab, length)] for _ in range(n_runs)]


def test_audit_token_routing_is_recovered_noise_is_not(tmp_path: Path) -> None:
    write_synthetic(tmp_path / "train", _runs(1), mode="token")
    write_synthetic(tmp_path / "held", _runs(2, n_runs=2), mode="token")
    r = audit(tmp_path / "held", [tmp_path / "train"])
    assert r.mode == "held-out" and r.rows == 80 and r.coverage == 1.0
    base = {s.signal: s for s in r.levels[0].signals}
    assert base["experts"].layers[0].top1 == 1.0  # layer 0's set is a function of the token
    assert base["experts"].layers[1].top1 < 0.25  # layer 1 is random
    assert base["masks"].all_layers.top1 > 0.9
    assert r.leakiest_layers[0][1] == 0
    # the information estimate is near H(token) for the exact signal
    assert base["experts"].layers[0].bits == pytest.approx(r.token_entropy_bits, abs=0.6)
    by_level = {tuple(lv.levels): lv for lv in r.levels if lv.layers is None}
    # all three on the leakiest layer only (layer 0): layer 1's exact ratios and masks remain
    only_0 = r.levels[-1]
    assert only_0.layers == [0] and only_0.levels == ["routing", "sparsity", "masks"]
    assert only_0.best.top1 == 1.0
    left = {s.signal: s for s in only_0.signals}
    assert left["experts"].layers[1].rows and 0 not in {
        k for k, v in left["experts"].layers.items() if v.rows
    }
    routing = by_level[("routing",)]
    assert {s.signal for s in routing.signals}.isdisjoint({"experts", "gate_weights"})
    everything = by_level[("routing", "sparsity", "masks")]
    assert everything.best.top1 < r.levels[0].best.top1
    # exact ratios name the token; rounded to 0.1, ten values are left for 25 tokens
    assert base["sparsity"].all_layers.top1 == 1.0
    coarse = {s.signal: s for s in by_level[("sparsity",)].signals}["sparsity"]
    assert coarse.all_layers.top1 < 0.6 and everything.best_signal == "sparsity"

    write_synthetic(tmp_path / "noise_train", _runs(1), mode="noise", seed=3)
    write_synthetic(tmp_path / "noise", _runs(2, n_runs=2), mode="noise", seed=4)
    n = audit(tmp_path / "noise", [tmp_path / "noise_train"])
    for s in n.levels[0].signals:
        if s.signal != "timing":
            assert s.all_layers.top1 < n.chance.top1 + 0.1, (s.signal, s.all_layers, n.chance)


def test_audit_without_train_holds_each_run_out(tmp_path: Path) -> None:
    write_synthetic(tmp_path / "rec", _runs(5), mode="token")
    r = audit(tmp_path / "rec", [])
    assert r.mode == "leave-one-run-out" and r.rows == 240
    assert {s.signal: s for s in r.levels[0].signals}["experts"].layers[0].top1 > 0.9


def test_audit_cli_json_refuses_other_models_and_single_runs(tmp_path: Path) -> None:
    write_synthetic(tmp_path / "a", _runs(1), mode="token")
    write_synthetic(tmp_path / "b", _runs(2, n_runs=2), mode="token", sha="b" * 64)
    p = run_cli("audit", str(tmp_path / "a"), "--train", str(tmp_path / "b"))
    assert p.returncode == 2 and "another model" in p.stderr and "b" * 64 in p.stderr
    write_synthetic(tmp_path / "one", _runs(1, n_runs=1), mode="token")
    p = run_cli("audit", str(tmp_path / "one"))
    assert p.returncode == 2 and "single run" in p.stderr
    write_synthetic(tmp_path / "c", _runs(3, n_runs=2), mode="token")
    p = run_cli("audit", str(tmp_path / "c"), "--train", str(tmp_path / "a"), "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["format"] == "sparseety-prof-audit" and doc["levels"][0]["levels"] == []
    assert doc["levels"][0]["best"]["top1"] > 0.9
    p = run_cli(
        "audit",
        str(tmp_path / "c"),
        "--train",
        str(tmp_path / "a"),
        env={"COLUMNS": "160", "PATH": "/usr/bin"},
    )
    assert p.returncode == 0, p.stderr
    assert "token recovery" in p.stdout and "--redact routing" in p.stdout


def test_audit_refuses_a_recording_without_ids(tmp_path: Path) -> None:
    write_synthetic(tmp_path / "rec", _runs(1), mode="token", redact=("ids",))
    write_synthetic(tmp_path / "plain", _runs(2), mode="token")
    p = run_cli("audit", str(tmp_path / "rec"))
    assert p.returncode == 2 and "token ids" in p.stderr
    p = run_cli("audit", str(tmp_path / "plain"), "--train", str(tmp_path / "rec"))
    assert p.returncode == 2 and "--train recordings have no rows with token ids" in p.stderr


# ------------------------------------------------------------------ redaction levels
def test_parse_levels() -> None:
    assert parse_levels(["routing,masks", "ids"]) == {"routing", "masks", "ids"}
    with pytest.raises(ValueError, match="unknown redaction level bogus; levels are ids, routing"):
        parse_levels(["routing,bogus"])


def _check_redacted(path: Path, levels: set[str]) -> None:
    """Read the segment files themselves: nulled columns hold only nulls, coarsened ratios only
    multiples of 0.1."""
    for table, cols in (
        ("steps", ["token_ids"]),
        ("routes", ["expert_ids", "expert_weights"]),
        ("masks", ["nonzero_bits"]),
    ):
        df = pl.concat([pl.read_parquet(f) for f in sorted((path / table).glob("part-*.parquet"))])
        assert df.height > 0
        for c in cols:
            nulled = any(c in schema.REDACT_NULL.get(lv, {}).get(table, ()) for lv in levels)
            assert (df[c].null_count() == df.height) == nulled, (table, c)
        if table == "routes":
            grid = df["act_zero_ratio"].to_numpy() * 10
            assert np.allclose(grid, np.round(grid), atol=1e-4) == ("sparsity" in levels)


@pytest.mark.parametrize(
    "levels", [{"ids"}, {"routing"}, {"sparsity"}, {"masks"}, {"ids", "routing", "sparsity", "masks"}]
)
def test_each_level_at_record_time_and_at_export(tmp_path: Path, levels: set[str]) -> None:
    runs = _runs(1, n_runs=2)
    write_synthetic(tmp_path / "rec", runs, mode="noise", redact=levels)
    _check_redacted(tmp_path / "rec", levels)
    meta = sparseety_prof.open(tmp_path / "rec").meta
    assert meta["redaction"]["levels"] == [lv for lv in schema.REDACT_LEVELS if lv in levels]
    if "routing" in levels:  # the aggregate stays: every row's k experts counted per layer
        load = meta["redaction"]["expert_load"]
        assert sum(load["0"]["selections"]) == K * sum(len(r) for r in runs) == K * load["0"]["rows"]

    write_synthetic(tmp_path / "plain", runs, mode="noise")
    _check_redacted(tmp_path / "plain", set())
    args = [f"--redact={','.join(sorted(levels))}"]
    p = run_cli("redact", str(tmp_path / "plain"), "-o", str(tmp_path / "out"), *args)
    assert p.returncode == 0, p.stderr
    _check_redacted(tmp_path / "out", levels)
    out = sparseety_prof.open(tmp_path / "out")
    assert out.complete and out.redaction_levels == [lv for lv in schema.REDACT_LEVELS if lv in levels]
    for f in (tmp_path / "out").rglob("*"):
        assert stat.S_IMODE(f.stat().st_mode) == (0o700 if f.is_dir() else 0o600), f
    # the same rows and values, apart from what was redacted
    src = sparseety_prof.open(tmp_path / "plain")
    for table in ("steps", "routes", "masks"):
        assert out.table(table).equals(redact_frame(table, src.table(table), levels))


def test_export_keeps_source_levels_adds_text_and_refuses_a_used_output(tmp_path: Path) -> None:
    write_synthetic(tmp_path / "rec", _runs(1, n_runs=2), mode="noise", redact=("masks",))
    p = run_cli(
        "redact", str(tmp_path / "rec"), "-o", str(tmp_path / "out"), "--redact", "routing", "--redact-text"
    )
    assert p.returncode == 0, p.stderr
    out = sparseety_prof.open(tmp_path / "out")
    assert out.redaction_levels == ["routing", "masks"] and out.redacted
    p = run_cli("redact", str(tmp_path / "rec"), "-o", str(tmp_path / "out"), "--redact", "routing")
    assert p.returncode == 2, p.stderr
    p = run_cli("redact", str(tmp_path / "rec"), "-o", str(tmp_path / "new"))
    assert p.returncode == 2 and "nothing to redact" in p.stderr
    p = run_cli("redact", str(tmp_path / "rec"), "-o", str(tmp_path / "new"), "--redact", "nope")
    assert p.returncode == 2 and "unknown redaction level nope" in p.stderr


def test_diff_refuses_recordings_without_token_ids(tmp_path: Path) -> None:
    """A diff pairs and compares tokens: with the ids redacted every pair would look equal."""
    from test_recording import tokens_frame

    from sparseety_prof.store.recording_writer import RecordingWriter

    for name, redact in (("plain", ()), ("ids", ("ids",))):
        with RecordingWriter(tmp_path / name, {}, redact=redact) as w:
            w.append("tokens", tokens_frame(40))
    assert sparseety_prof.open(tmp_path / "ids").tokens()["token_id"].null_count() == 40
    for a, b in (("ids", "ids"), ("plain", "ids")):
        p = run_cli("diff", str(tmp_path / a), str(tmp_path / b))
        assert p.returncode == 2 and "no token ids" in p.stderr, (a, b, p.stdout, p.stderr)
    p = run_cli("diff", str(tmp_path / "plain"), str(tmp_path / "plain"))
    assert p.returncode == 0, p.stdout + p.stderr


def test_audit_shows_planted_strings_escaped(tmp_path: Path) -> None:
    planted = "\x1b]52;c;cGF5bG9hZA==\x07\u202e[red]x[/red]"
    write_synthetic(tmp_path / "a", _runs(1), mode="token", sha=planted)
    write_synthetic(tmp_path / "b", _runs(2, n_runs=2), mode="token", sha=planted)
    for args in ([], ["--json"]):
        p = run_cli("audit", str(tmp_path / "b"), "--train", str(tmp_path / "a"), *args)
        assert p.returncode == 0, p.stderr
        assert "\x1b" not in p.stdout and "\u202e" not in p.stdout and "\x07" not in p.stdout
        assert "\\x1b" in p.stdout or "\\u001b" in p.stdout
    write_synthetic(tmp_path / "c", _runs(3, n_runs=2), mode="token")
    p = run_cli("audit", str(tmp_path / "c"), "--train", str(tmp_path / "a"))
    assert p.returncode == 2 and "\x1b" not in p.stderr and "\\x1b" in p.stderr


def _token_rows() -> pl.DataFrame:
    cols: dict[str, list[object]] = {c: [None] for c in schema.TOKENS}
    cols.update(
        token_id=[7],
        expert_ids=[[[0, 1], [2, 3], [4, 5]]],
        expert_weights=[[[0.5, 0.5], [0.7, 0.3], [0.6, 0.4]]],
        act_zero_ratio=[[0.123, 0.456, 0.789]],
        act_below_ratio=[[0.2, 0.3, 0.4]],
    )
    return schema.frame("tokens", cols)


def test_layer_subsets_redact_only_those_layers() -> None:
    assert parse_layers("0,2,5-7") == {0, 2, 5, 6, 7}
    for bad in ("", "a", "3-1", "1-"):
        with pytest.raises(ValueError):
            parse_layers(bad)
    # the tokens table's lists: element i is layer meta["layers"][kind][i]
    r = Redaction(frozenset({"routing", "sparsity"}), frozenset({2}), {"moe": [0, 2, 3], "ffn": [0, 2, 3]})
    row = r.frame("tokens", _token_rows()).row(0, named=True)
    assert row["token_id"] == 7 and row["expert_ids"] == [[0, 1], None, [4, 5]]
    assert row["expert_weights"][1] is None and row["expert_weights"][2] == pytest.approx([0.6, 0.4])
    assert row["act_zero_ratio"] == pytest.approx([0.123, 0.5, 0.789])
    # without a layer map, the whole list goes (never less than asked)
    row = Redaction(frozenset({"routing"}), frozenset({2})).frame("tokens", _token_rows()).row(0, named=True)
    assert row["expert_ids"] is None and row["act_zero_ratio"] == pytest.approx([0.123, 0.456, 0.789])
    with pytest.raises(ValueError, match="layer subset needs"):
        Redaction(frozenset({"ids"}), frozenset({0}))


def test_layer_subsets_at_record_time_and_export(tmp_path: Path) -> None:
    runs = _runs(1, n_runs=2)
    write_synthetic(tmp_path / "rec", runs, mode="token", redact=("routing", "masks"), redact_layers=[0])
    routes, masks = _segments(tmp_path / "rec", "routes"), _segments(tmp_path / "rec", "masks")
    for df, c in ((routes, "expert_ids"), (masks, "nonzero_bits")):
        assert df.filter(pl.col("layer") == 0)[c].null_count() == df.filter(pl.col("layer") == 0).height > 0
        assert df.filter(pl.col("layer") == 1)[c].null_count() == 0
    rec = sparseety_prof.open(tmp_path / "rec")
    assert rec.redaction_layers == [0] and rec.meta["redaction"]["layers"] == [0]
    # export: the source's levels and layers are kept, the new ones added on their layers
    p = run_cli(
        "redact",
        str(tmp_path / "rec"),
        "-o",
        str(tmp_path / "out"),
        "--redact",
        "sparsity",
        "--redact-layers",
        "1",
    )
    assert p.returncode == 0, p.stderr
    out = sparseety_prof.open(tmp_path / "out")
    assert out.redaction_levels == ["routing", "sparsity", "masks"] and out.redaction_layers == [0, 1]
    assert out.routes()["expert_ids"].null_count() == out.routes().height
    for args, msg in (
        (["--redact", "ids", "--redact-layers", "0"], "--redact-layers needs --redact with one of"),
        (["--redact", "routing", "--redact-layers", "x"], "bad layer list"),
    ):
        p = run_cli("redact", str(tmp_path / "rec"), "-o", str(tmp_path / "new"), *args)
        assert p.returncode == 2 and msg in p.stderr, p.stderr


def _segments(rec: Path, table: str) -> pl.DataFrame:
    return pl.concat([pl.read_parquet(f) for f in sorted((rec / table).glob("part-*.parquet"))])
