"""Root tests: `audit` on real recordings of the three sanity models (sparseety_prof/synthetic), and
the redaction levels on real recordings, at record time and at export.

Each model is recorded twice with the llama-cpp-python engine, the recorder attached as a user
would (`sparseety-prof record`): training prompts, then other held-out prompts of the same words
(tests/audit_runs.py).
- token_routed: layer 0's routing is a function of the token: near-total recovery (every held-out
  token that occurs in training), from layer 0.
- context_routed: routing follows the prefix, not the token: near chance.
- smallthinker (ReGLU experts) with --capture-masks: the masks recover more than the ratios.
scripts/audit_sanity.py makes the same recordings and prints the figures docs/privacy.md quotes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from audit_runs import MODELS, Recorded, record_model
from conftest import run_cli

import sparseety_prof
from sparseety_prof.views.audit.attack import AuditResult, LevelScore, audit

pytestmark = [pytest.mark.root, pytest.mark.engine]

ALL_THREE = ("routing", "sparsity", "masks")


@pytest.fixture(scope="module")
def token_routed(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    return record_model(tmp_path_factory.mktemp("token_routed"), "token_routed", MODELS["token_routed"])


@pytest.fixture(scope="module")
def context_routed(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    return record_model(tmp_path_factory.mktemp("context_routed"), "context_routed", MODELS["context_routed"])


@pytest.fixture(scope="module")
def reglu_masks(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    every_level = ["--capture-masks", "--redact", "ids,routing", "--redact=sparsity,masks", "--redact-text"]
    three = ["--capture-masks", "--redact", ",".join(ALL_THREE)]
    return record_model(
        tmp_path_factory.mktemp("reglu"),
        "smallthinker",
        MODELS["smallthinker"],
        extra={
            "all_levels": every_level,
            "three_levels": three,
            "layer_0": ["--capture-masks", "--redact", "routing,masks", "--redact-layers", "0"],
        },
    )


def level(r: AuditResult, *levels: str) -> LevelScore:
    return next(lv for lv in r.levels if lv.levels == list(levels))


def signal_top1(lv: LevelScore, name: str, layer: int | None = None) -> float:
    s = next(s for s in lv.signals if s.signal == name)
    return s.all_layers.top1 if layer is None else s.layers[layer].top1


def test_token_routed_model_gives_its_tokens_away(token_routed: Recorded) -> None:
    r = audit(token_routed.held, [token_routed.train])
    none = level(r, *())
    assert r.coverage > 0.8, r  # the held-out prompts reuse the training words
    # every held-out token seen in training is named, from layer 0
    assert none.best.top1 >= r.coverage - 0.05, none.best
    assert signal_top1(none, "gate_weights", 0) >= r.coverage - 0.05
    assert signal_top1(none, "experts", 0) >= r.coverage - 0.15  # a few sets are shared
    assert r.leakiest_layers[0][1] == 0
    assert none.best.top1 > 10 * r.chance.top1
    # redaction: routing leaves the sparsity ratios (their exact values still name tokens),
    # all three leave coarse ratios and timing
    routing, everything = level(r, "routing"), level(r, *ALL_THREE)
    assert not {s.signal for s in routing.signals} & {"experts", "gate_weights", "router_probs"}
    assert routing.best.top1 < none.best.top1 - 0.3
    assert everything.best.top1 < 0.3 and everything.best.top1 < routing.best.top1
    # all three on layer 0 alone: the deeper layers still give most tokens away
    only_0 = r.levels[-1]
    assert only_0.layers == [0] and only_0.levels == list(ALL_THREE)
    assert everything.best.top1 + 0.3 < only_0.best.top1 < none.best.top1


def test_context_routed_model_is_near_chance(context_routed: Recorded, token_routed: Recorded) -> None:
    r = audit(context_routed.held, [context_routed.train])
    none = level(r, *())
    for name in ("experts", "gate_weights"):
        assert signal_top1(none, name) <= r.chance.top1 + 0.1, (name, none)
    leaky = level(audit(token_routed.held, [token_routed.train]), *())
    assert signal_top1(none, "experts") < signal_top1(leaky, "experts") - 0.5


def test_reglu_masks_leak_more_than_ratios(reglu_masks: Recorded) -> None:
    r = audit(reglu_masks.held, [reglu_masks.train])
    none = level(r, *())
    masks = max(signal_top1(none, "masks", layer) for layer in (0, 1, 2, 3))
    ratios = max(signal_top1(none, "sparsity", layer) for layer in (0, 1, 2, 3))
    assert masks >= r.coverage - 0.05 and masks > ratios + 0.3, (masks, ratios)
    assert signal_top1(none, "masks") > signal_top1(none, "sparsity") + 0.3
    # with the masks redacted, the routing still names the tokens; with all three, little is left
    assert "masks" not in {s.signal for s in level(r, "masks").signals}
    assert level(r, *ALL_THREE).best.top1 < none.best.top1 - 0.4


def _segments(rec: Path, table: str) -> pl.DataFrame:
    return pl.concat([pl.read_parquet(f) for f in sorted((rec / table).glob("part-*.parquet"))])


def _on_grid(values: pl.Series) -> bool:
    x = values.drop_nulls().to_numpy().astype(np.float64) * 10
    return bool(np.allclose(x, np.round(x), atol=1e-4))


def test_every_level_at_record_time(reglu_masks: Recorded) -> None:
    """Recorded with --redact ids,routing,sparsity,masks and --redact-text: the files hold nulls
    where the levels say, ratios on the 0.1 grid, and meta.json says so."""
    path = reglu_masks.extra["all_levels"]
    rec = sparseety_prof.open(path)
    assert rec.redaction_levels == ["ids", "routing", "sparsity", "masks"] and rec.redacted
    tokens, steps, routes, masks = (_segments(path, t) for t in ("tokens", "steps", "routes", "masks"))
    assert tokens.height and steps.height and routes.height and masks.height
    for df, cols in (
        (tokens, ("token_id", "token_text", "top_ids", "expert_ids", "expert_weights", "router_probs")),
        (steps, ("token_ids",)),
        (routes, ("expert_ids", "expert_weights", "router_probs")),
        (masks, ("nonzero_bits",)),
    ):
        for c in cols:
            assert df[c].null_count() == df.height, c
    assert _on_grid(routes["act_zero_ratio"]) and _on_grid(routes["act_below_ratio"])
    assert _on_grid(tokens["act_zero_ratio"].explode())
    # what is kept: log-probs, timing, positions, and the expert load per layer
    assert tokens["log_prob"].null_count() == 0 and steps["positions"].null_count() == 0
    load = rec.meta["redaction"]["expert_load"]
    assert sorted(load) == ["0", "1", "2", "3"]
    assert sum(load["0"]["selections"]) == 2 * load["0"]["rows"] > 0
    # nothing left to audit against: the ground truth (token ids) is gone
    p = run_cli("audit", str(path), "--train", str(reglu_masks.train))
    assert p.returncode == 2 and "token ids" in p.stderr


def test_redaction_at_record_time_lowers_recovery(reglu_masks: Recorded) -> None:
    before = audit(reglu_masks.held, [reglu_masks.train])
    after = audit(reglu_masks.extra["three_levels"], [reglu_masks.train])
    assert level(after, *()).best.top1 < level(before, *()).best.top1 - 0.4
    assert {s.signal for s in level(after, *()).signals if s.all_layers.rows} <= {
        "sparsity",
        "attention",
        "timing",
    }


def test_export_redacts_a_real_recording(token_routed: Recorded, tmp_path: Path) -> None:
    out = tmp_path / "shared"
    p = run_cli("redact", str(token_routed.held), "-o", str(out), "--redact", "routing,masks")
    assert p.returncode == 0, p.stderr
    routes = _segments(out, "routes")
    assert routes["expert_ids"].null_count() == routes["expert_weights"].null_count() == routes.height > 0
    src = sparseety_prof.open(token_routed.held)
    assert sparseety_prof.open(out).tokens()["token_id"].to_list() == src.tokens()["token_id"].to_list()
    p = run_cli("audit", str(out), "--train", str(token_routed.train), "--json")
    assert p.returncode == 0, p.stderr
    shared = json.loads(p.stdout)["levels"][0]["best"]["top1"]
    original = level(audit(token_routed.held, [token_routed.train]), *()).best.top1
    assert shared < original - 0.3, (shared, original)


def test_audit_refuses_another_models_training(token_routed: Recorded, context_routed: Recorded) -> None:
    p = run_cli("audit", str(token_routed.held), "--train", str(context_routed.train))
    assert p.returncode == 2 and "another model" in p.stderr


def test_layer_subset_at_record_time(reglu_masks: Recorded) -> None:
    """--redact routing,masks --redact-layers 0: layer 0's experts and masks are gone, in the
    routes and masks tables and in the tokens table's per-layer lists; the other layers stay."""
    path = reglu_masks.extra["layer_0"]
    rec = sparseety_prof.open(path)
    assert rec.redaction_levels == ["routing", "masks"] and rec.redaction_layers == [0]
    routes, masks, tokens = (_segments(path, t) for t in ("routes", "masks", "tokens"))
    for df, c in ((routes, "expert_ids"), (routes, "expert_weights"), (masks, "nonzero_bits")):
        at_0, others = df.filter(pl.col("layer") == 0), df.filter(pl.col("layer") != 0)
        assert at_0.height and at_0[c].null_count() == at_0.height, c
        assert others.height and others[c].null_count() == 0, c
    assert rec.meta["layers"]["moe"] == [0, 1, 2, 3]
    lists = tokens["expert_ids"].to_list()
    assert lists and all(x[0] is None and all(e is not None for e in x[1:]) for x in lists)
    after = audit(path, [reglu_masks.train])
    best_layer0 = max(
        (sc.top1 for s in level(after, *()).signals if s.signal in ("experts", "gate_weights", "masks")
         for layer, sc in s.layers.items() if layer == 0 and sc.rows),
        default=0.0,
    )  # fmt: skip
    assert best_layer0 == 0.0
