"""Acceptance: real recordings of real engines, collected into one dataset, give the same answers in
Polars, DuckDB and Spark (PySpark, local mode), and those answers equal the recordings' own tables
read one recording at a time (and, for token counts, what the engines generated).

Recordings (one module-scoped setup, two short engine runs):
  host A (this machine, real): the MoE model, recorded with `record` and then `collect`ed; the
      dense model, recorded with `record --dataset DEST` (collected by the recorder at close).
  host B (simulated): a copy of the MoE recording with meta.json's host.hostname rewritten to
      SECOND_HOST, as a recorder on that host would have written it. Nothing else differs, so
      host B's rows equal host A's MoE rows; the copy has its own recording id (its meta.json
      differs) and lands in its own host= partition. No second machine is involved.
"""

from __future__ import annotations

import json
import platform
import shutil
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import polars as pl
import pytest
from conftest import ENGINES, Engine, Recorder, run_cli

import sparseety_prof
from sparseety_prof.store import schema
from sparseety_prof.store.dataset import MANIFEST
from sparseety_prof.store.dataset_partition import sanitise

pytestmark = [pytest.mark.root, pytest.mark.engine]

SECOND_HOST = "host-b.simulated"
PROMPTS = ["hello the expert router", "one two three", "sparse models route tokens"]
MAX_TOKENS = 5
# partition values read as text everywhere (no engine guesses a type from a folder name)
HIVE_TEXT = dict.fromkeys(schema.DATASET_PARTITIONS, pl.String())


SparkSql = Callable[[str], list[tuple[Any, ...]]]


@dataclass
class Fleet:
    dest: Path
    by_host: dict[str, list[Path]]  # host -> the recordings made there
    engine_tokens: dict[str, int]  # model -> tokens its engine generated


def _record(models: dict[str, Path], model: str, out: Path, *extra: str) -> tuple[int, str, int]:
    engine = Engine([str(ENGINES / "llama_engine.py"), str(models[model])])
    try:
        recorder = Recorder(engine.pid, out, *extra)
        truth = engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
        rc, err = recorder.stop(signal.SIGINT)
    finally:
        engine.close()
    return rc, err, sum(len(t["ids"]) for t in truth)


@pytest.fixture(scope="module")
def fleet(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    d = tmp_path_factory.mktemp("fleet")
    dest = d / "dataset"
    host_a = sanitise(platform.node())
    assert host_a != SECOND_HOST

    moe = d / "host-a-moe"
    rc, err, moe_tokens = _record(models, "moe", moe)
    assert rc == 0, err
    dense = d / "host-a-dense"
    rc, err, dense_tokens = _record(models, "dense", dense, "--dataset", str(dest))
    assert rc == 0, err
    assert "collected " + str(dense) in err  # --dataset: collected by the recorder at close

    copy = d / "host-b-moe"
    shutil.copytree(moe, copy)
    meta = json.loads((copy / "meta.json").read_text())
    meta["host"]["hostname"] = SECOND_HOST
    (copy / "meta.json").write_text(json.dumps(meta))

    got = run_cli("collect", str(moe), str(copy), str(dense), str(dest))
    assert got.returncode == 0, got.stderr
    assert "2 collected, 1 already there, 0 refused" in got.stderr
    return Fleet(
        dest=dest,
        by_host={host_a: [moe, dense], SECOND_HOST: [copy]},
        engine_tokens={"moe": moe_tokens, "dense": dense_tokens},
    )


@pytest.fixture(scope="module")
def spark(fleet: Fleet) -> Iterator[SparkSql]:
    """One local SparkSession for the module (its start is most of Spark's time), with a view of
    each table of the dataset; yields a function running a query to its rows."""
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[1]")
        .appName("sparseety-dataset-test")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
        # start-up and compilation dominate such small queries: C1-only JIT, no whole-stage code
        # generation and no adaptive re-planning keep Spark's part of the module short
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1")
        .config("spark.sql.codegen.wholeStage", "false")
        .config("spark.sql.adaptive.enabled", "false")
        .getOrCreate()
    )
    for table in ("routes", "requests", "tokens"):
        session.read.parquet(str(fleet.dest / table)).createOrReplaceTempView(table)
    yield lambda sql: [tuple(r) for r in session.sql(sql).collect()]
    session.stop()


def polars_table(f: Fleet, table: str) -> pl.LazyFrame:
    return pl.scan_parquet(f.dest / table / "**" / "*.parquet", hive_partitioning=True, hive_schema=HIVE_TEXT)


def duck(f: Fleet, sql: str) -> list[tuple[Any, ...]]:
    def source(table: str) -> str:
        files = f"{f.dest / table}/**/*.parquet"
        return f"read_parquet('{files}', hive_partitioning = true, hive_types_autocast = false)"

    rel = duckdb.sql(
        sql.format(routes=source("routes"), requests=source("requests"), tokens=source("tokens"))
    )
    assert rel is not None  # a SELECT always gives a relation
    return rel.fetchall()


def test_the_manifest_lists_the_three_recordings_in_their_partitions(fleet: Fleet) -> None:
    m = json.loads((fleet.dest / MANIFEST).read_text())
    got = sorted((e["host"], e["model"], e["rows"]["tokens"]) for e in m["recordings"])
    want = sorted(
        (host, sparseety_prof.open(r).meta["model"]["name"], sparseety_prof.open(r).tokens().height)
        for host, recs in fleet.by_host.items()
        for r in recs
    )
    assert got == want and {e["engine"] for e in m["recordings"]} == {"llama-cpp-python"}


def test_expert_load_per_layer_and_host_agrees_everywhere(fleet: Fleet, spark: SparkSql) -> None:
    truth: Counter[tuple[str, int, int]] = Counter()
    for host, recs in fleet.by_host.items():
        for r in recs:
            for layer, ids in sparseety_prof.open(r).routes().select("layer", "expert_ids").iter_rows():
                for e in ids or ():
                    truth[(host, layer, e)] += 1
    assert truth and {h for h, _, _ in truth} == set(fleet.by_host)  # both hosts routed tokens

    pol = (
        polars_table(fleet, "routes")
        .select("host", "layer", pl.col("expert_ids").alias("expert"))
        .explode("expert")
        .drop_nulls("expert")
        .group_by("host", "layer", "expert")
        .agg(pl.len())
        .collect()
    )
    by_polars = {(h, la, e): n for h, la, e, n in pol.iter_rows()}
    by_duckdb = {
        (h, la, e): n
        for h, la, e, n in duck(
            fleet,
            "SELECT host, layer, expert, count(*) FROM "
            "(SELECT host, layer, unnest(expert_ids) AS expert FROM {routes}) GROUP BY ALL",
        )
    }
    by_spark = {
        (h, la, e): n
        for h, la, e, n in spark(
            "SELECT host, layer, expert, count(*) FROM routes "
            "LATERAL VIEW explode(expert_ids) x AS expert GROUP BY host, layer, expert",
        )
    }
    assert by_polars == by_duckdb == by_spark == dict(truth)


def test_p99_ttft_per_model_agrees_everywhere(fleet: Fleet, spark: SparkSql) -> None:
    ttfts: dict[str, list[float]] = {}
    for recs in fleet.by_host.values():
        for r in recs:
            rec = sparseety_prof.open(r)
            ttfts.setdefault(rec.meta["model"]["name"], []).extend(rec.requests()["ttft_ms"].drop_nulls())
    # the GGUF names of the test models (sparseety_prof/synthetic)
    assert set(ttfts) == {"sparseety-test-moe", "sparseety-test-dense"}
    assert all(len(v) >= len(PROMPTS) for v in ttfts.values())
    truth = {m: float(np.percentile(v, 99)) for m, v in ttfts.items()}  # linear interpolation

    pol = (
        polars_table(fleet, "requests")
        .group_by("model")
        .agg(pl.col("ttft_ms").quantile(0.99, interpolation="linear"))
        .collect()
    )
    answers = [
        dict(pol.iter_rows()),
        dict(duck(fleet, "SELECT model, quantile_cont(ttft_ms, 0.99) FROM {requests} GROUP BY model")),
        dict(spark("SELECT model, percentile(ttft_ms, 0.99) FROM requests GROUP BY model")),
    ]
    for got in answers:
        assert got.keys() == truth.keys()
        for m in truth:
            assert got[m] == pytest.approx(truth[m], rel=1e-12), (m, got, truth)


def test_token_counts_per_host_agree_everywhere_and_with_the_engines(fleet: Fleet, spark: SparkSql) -> None:
    truth = {
        host: sum(sparseety_prof.open(r).tokens().height for r in recs)
        for host, recs in fleet.by_host.items()
    }
    # what the engines generated: host A ran both models, host B holds a copy of the MoE run
    engines = fleet.engine_tokens
    assert truth == {
        sanitise(platform.node()): engines["moe"] + engines["dense"],
        SECOND_HOST: engines["moe"],
    }
    pol = dict(polars_table(fleet, "tokens").group_by("host").agg(pl.len()).collect().iter_rows())
    by_duck: dict[str, int] = dict(duck(fleet, "SELECT host, count(*) FROM {tokens} GROUP BY host"))
    by_spark: dict[str, int] = dict(spark("SELECT host, count(*) FROM tokens GROUP BY host"))
    assert pol == by_duck == by_spark == truth
