"""--metrics-port against Debian's real Prometheus server: it scrapes a recorder attached to a
real engine, and PromQL queries through its HTTP API give what the recording written in the
same run holds (exact for counters: the recorder stays attached past the last frame and the
scrapes after it). The request latency histograms are checked on a plain front end and on a
llama-server with one slot and clients at once, against the recording's requests table
(tests/request_latency_oracle.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import ENGINES, Engine, Recorder, free_port, which
from request_latency_oracle import METRICS, want_latencies

import sparseety_prof
from sparseety_prof.session.metrics_sink import PER_EXPERT, series_count
from sparseety_prof.session.request_latency import BUCKETS

SCRAPE_S = 1.0


class Prometheus:
    """Debian's `prometheus` binary (not its systemd service), scraping one target every second,
    with its config and storage in a temporary directory."""

    def __init__(self, tmp: Path, target_port: int) -> None:
        self.port = free_port()
        cfg = tmp / "prometheus.yml"
        cfg.write_text(
            f"global:\n  scrape_interval: {SCRAPE_S:g}s\n  evaluation_interval: {SCRAPE_S:g}s\n"
            "scrape_configs:\n  - job_name: sparseety\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n"
        )
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                which("prometheus"),
                f"--config.file={cfg}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert self.proc.poll() is None, (tmp / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query through the HTTP API: its vector of {"metric": labels, "value": v}."""
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return [{"metric": s["metric"], "value": float(s["value"][1])} for s in body["data"]["result"]]

    def scalar(self, promql: str) -> float | None:
        got = self.query(promql)
        assert len(got) <= 1, got
        return got[0]["value"] if got else None

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


#: one query's answer: each series' labels (job and instance aside) and value
Answer = list[tuple[dict[str, str], float]]


def latency_answers(prom: Prometheus) -> dict[str, dict[str, Answer]]:
    """Per latency metric, the _count, _sum and _bucket series Prometheus holds."""
    skip = ("job", "instance", "__name__")
    return {
        metric: {
            part: [
                ({k: v for k, v in s["metric"].items() if k not in skip}, s["value"])
                for s in prom.query(f"{metric}_{part}")
            ]
            for part in ("count", "sum", "bucket")
        }
        for metric in METRICS.values()
    }


def check_latencies(got: dict[str, dict[str, Answer]], requests: pl.DataFrame, meta: dict[str, Any]) -> None:
    """The latency histograms Prometheus scraped equal those of the requests rows, computed here
    one by one, labelled with the recording's model (its name, else its file's) and engine."""
    model = meta["model"].get("name") or Path(meta["model"]["path"]).name
    labels = {"model": model, "engine": meta["engine"]["name"]}
    want = want_latencies(requests.iter_rows(named=True))
    for name, metric in METRICS.items():
        values = want[name]
        assert got[metric]["count"] == [(labels, float(len(values)))], metric
        ((sum_labels, total),) = got[metric]["sum"]
        assert sum_labels == labels and total == pytest.approx(sum(values), rel=1e-9, abs=1e-12), metric
        buckets: dict[str, float] = {}
        for lab, count in got[metric]["bucket"]:
            le = lab.pop("le")
            assert lab == labels, metric
            buckets[le] = count
        assert len(buckets) == len(BUCKETS[name]) + 1 and buckets["+Inf"] == len(values), metric
        for le, count in buckets.items():
            assert count == sum(v <= float(le) for v in values), (metric, le)


@pytest.fixture
def prometheus_and_port(tmp_path: Path) -> Iterator[tuple[Prometheus, int]]:
    metrics_port = free_port()
    prom = Prometheus(tmp_path, metrics_port)
    yield prom, metrics_port
    prom.close()


@pytest.mark.root
@pytest.mark.engine
def test_prometheus_queries_give_what_the_recording_holds(
    llama_engine: Engine, prometheus_and_port: tuple[Prometheus, int], tmp_path: Path
) -> None:
    prom, port = prometheus_and_port
    rec_dir = tmp_path / "rec"
    recorder = Recorder(llama_engine.pid, rec_dir, "--metrics-port", str(port), "--flush-interval", "0.5")
    truth = llama_engine.generate(["hello the expert router", "one two three four"], max_tokens=8)
    n_tokens = sum(len(t["ids"]) for t in truth)

    # the last frame leaves within a flush interval; then two more scrapes see it
    deadline = time.monotonic() + 60
    while prom.scalar('sparseety_tokens_total{job="sparseety"}') != n_tokens:
        assert time.monotonic() < deadline, prom.query("sparseety_tokens_total")
        time.sleep(0.5)
    time.sleep(3 * SCRAPE_S)
    selections = prom.query("sparseety_expert_selections_total")
    per_layer = prom.query("sum by (layer) (sparseety_expert_selections_total)")
    rows = prom.query("sparseety_moe_rows_total")
    steps = prom.scalar("sum(sparseety_step_seconds_count)")
    sparsity_rows = prom.query("sparseety_activation_zero_ratio_count")
    nll_sum = prom.scalar("sparseety_token_nll_sum")
    series = prom.scalar('count({__name__=~"sparseety_.+"})')
    rss = prom.scalar("sparseety_profiler_resident_memory_bytes")
    cpu = prom.scalar("sparseety_profiler_cpu_seconds_total")
    losses = prom.query("sparseety_losses_total")
    requests = prom.scalar("sparseety_requests_total")
    latencies = latency_answers(prom)
    rc, err = recorder.stop(signal.SIGINT)
    assert rc == 0, err

    rec = sparseety_prof.open(rec_dir)
    tokens, routes = rec.tokens(), rec.routes()
    assert tokens.height == n_tokens
    # expert selections per (layer, expert): the routes rows counted here in Python
    want: Counter[tuple[str, str]] = Counter()
    for layer, ids in routes.select("layer", "expert_ids").drop_nulls().iter_rows():
        want.update((str(layer), str(e)) for e in ids)
    assert want, "the MoE model recorded no routing"
    moe, ffn = rec.meta["layers"]["moe"], rec.meta["layers"]["ffn"]
    n_expert = rec.meta["model"]["hyperparameters"]["expert_count"]
    assert {(s["metric"]["layer"], s["metric"]["expert"]): s["value"] for s in selections} == {
        (str(layer), str(e)): float(want[(str(layer), str(e))]) for layer in moe for e in range(n_expert)
    }
    by_layer = (
        routes.drop_nulls("expert_ids").group_by("layer").agg(pl.len(), pl.col("expert_ids").list.len().sum())
    )
    assert {s["metric"]["layer"]: s["value"] for s in per_layer} == {
        str(layer): float(n) for layer, _, n in by_layer.iter_rows()
    }
    assert {s["metric"]["layer"]: s["value"] for s in rows} == {
        str(layer): float(n) for layer, n, _ in by_layer.iter_rows()
    }
    assert steps == rec.steps().height
    # a request is counted when it ends: those the detach ended came after the last scrape
    reqs = rec.requests()
    assert requests == reqs.filter(pl.col("end_reason").fill_null("") != "detached").height
    assert {s["metric"]["layer"]: s["value"] for s in sparsity_rows} == {
        str(layer): float(routes.filter(pl.col("layer") == layer)["act_zero_ratio"].count()) for layer in ffn
    }
    assert nll_sum == pytest.approx(-float(tokens["log_prob"].sum()), rel=1e-9)
    assert series == series_count(len(moe), n_expert, len(ffn), PER_EXPERT)
    assert rss is not None and rss > 10 << 20 and cpu is not None and cpu > 0
    assert {s["metric"]["kind"]: s["value"] for s in losses} == {
        k: float(rec.meta["losses"][k]) for k in ("kernel_drops", "seq_gaps", "logits_incomplete")
    }
    account = rec.meta["sinks"]["prometheus"]
    assert account["series"] == series and account["scrapes"] >= 3
    ended = reqs.filter(pl.col("end_reason").fill_null("") != "detached")
    check_latencies(latencies, ended, rec.meta)


def post_completion(url: str, prompt: str, n: int) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    req = urllib.request.Request(
        url + "/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(json.loads(r.read()))


@pytest.mark.root
@pytest.mark.engine
def test_prometheus_gives_the_servers_request_latencies(
    models: dict[str, Path], prometheus_and_port: tuple[Prometheus, int], tmp_path: Path
) -> None:
    """llama-server with one slot and three clients at once (a request that comes while another
    runs waits for the slot: its queue time); every request ends (the slot is released) before
    the last scrape, so each latency histogram holds every row of the recording's requests
    table, queue time included (the server reports when it read each request)."""
    prom, port = prometheus_and_port
    server = Engine(
        [str(ENGINES / "server_engine.py"), str(models["moe"]), "--port", str(free_port()), "--parallel", "1"]
    )
    try:
        rec_dir = tmp_path / "rec"
        recorder = Recorder(server.pid, rec_dir, "--metrics-port", str(port), "--flush-interval", "0.5")
        prompts = ["hello the expert router", "one two three four", "sparse token layer gate"]
        errors: list[BaseException] = []

        def client(prompt: str) -> None:
            try:
                post_completion(server.ready["url"], prompt, 6)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        deadline = time.monotonic() + 60
        while prom.scalar('sparseety_requests_total{job="sparseety"}') != len(prompts):
            assert time.monotonic() < deadline, prom.query("sparseety_requests_total")
            time.sleep(0.5)
        time.sleep(3 * SCRAPE_S)
        latencies = latency_answers(prom)
        rc, err = recorder.stop(signal.SIGINT)
        assert rc == 0, err
    finally:
        server.close()
    rec = sparseety_prof.open(rec_dir)
    reqs = rec.requests()
    assert reqs.height == len(prompts) and reqs["end_reason"].to_list() == ["released"] * len(prompts)
    assert reqs["t_received_ns"].null_count() == 0 and not reqs["partial"].any()
    check_latencies(latencies, reqs, rec.meta)
    # every latency holds the three requests: no histogram is compared empty
    assert {metric: got["count"][0][1] for metric, got in latencies.items()} == dict.fromkeys(
        METRICS.values(), 3.0
    )
