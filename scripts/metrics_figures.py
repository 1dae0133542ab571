"""The Prometheus figures of docs/fleet.md: the series --metrics-port exposes per model size and the CPU
one scrape of them costs, and what the metrics sink's take() costs the consumer per token on a
real recording.

    .venv/bin/python scripts/metrics_figures.py series
    sudo .venv/bin/python scripts/metrics_figures.py take [REC] [--tokens-per-frame N...] [--repeat N]

`take` feeds the recording's tokens, steps, routes and requests rows to a PrometheusSink (bound
on a free local port, never scraped) in frames of about N tokens' rows, as the recorder does
every flush interval, and times the take() calls alone, in CPU time of the calling thread (what
the consumer pays; on a busy machine wall time also counts the waits for a core): the median
over --repeat passes. Without REC it first records the tests' MoE model (sparseety_prof/synthetic)
generating 12 prompts of 48 tokens, as root (the recorder attaches eBPF uprobes).
"""

from __future__ import annotations

import argparse
import itertools
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
from prometheus_client import generate_latest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sparseety_prof  # noqa: E402
from sparseety_prof.session.metrics_sink import AGGREGATE, PER_EXPERT, PrometheusSink, series_count  # noqa: E402

#: (model, layers, MoE layers, experts per MoE layer), from each model's published config
MODELS: tuple[tuple[str, int, int, int], ...] = (
    ("tests' MoE model (sparseety_prof/synthetic)", 4, 4, 8),
    ("Mixtral 8x7B", 32, 32, 8),
    ("gpt-oss-120b", 36, 36, 128),
    ("Qwen3-30B-A3B", 48, 48, 128),
    ("DeepSeek-V3 / R1", 61, 58, 256),
    ("Qwen3-235B-A22B", 94, 94, 128),
)


def scrape_cpu_ms(n_layers: int, n_moe: int, n_expert: int, experts: str, repeat: int = 5) -> float:
    """CPU time (ms) of one scrape of an endpoint for this model: the families built and
    formatted as prometheus_client's server does (generate_latest), median of `repeat`."""
    sink = PrometheusSink("127.0.0.1", 0, experts=experts)
    try:
        sink.open(
            {
                "layers": {"moe": list(range(n_layers - n_moe, n_layers)), "ffn": list(range(n_layers))},
                "capture": {"routes": True, "activations": True},
                "model": {"hyperparameters": {"expert_count": n_expert}},
            }
        )
        spent = []
        for _ in range(repeat):
            t0 = time.thread_time_ns()
            generate_latest(sink.registry)
            spent.append(time.thread_time_ns() - t0)
    finally:
        sink.stop()
    return statistics.median(spent) / 1e6


def series_table() -> str:
    lines = [
        "| model | layers (MoE) x experts | series, per-expert | CPU per scrape "
        "| series, aggregate | CPU per scrape |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, layers, moe, experts in MODELS:
        cells = [
            f"{series_count(moe, experts, layers, mode)} | {scrape_cpu_ms(layers, moe, experts, mode):.0f} ms"
            for mode in (PER_EXPERT, AGGREGATE)
        ]
        lines.append(f"| {name} | {layers} ({moe}) x {experts} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def _frames(rec: sparseety_prof.Recording, tokens_per_frame: int) -> list[list[tuple[str, pl.DataFrame]]]:
    """The recording cut at step boundaries into frames of about `tokens_per_frame` tokens."""
    tokens, steps, routes = rec.tokens().sort("step_id"), rec.steps(), rec.routes()
    cuts = tokens["step_id"].gather_every(tokens_per_frame).to_list()[1:]
    bounds = [None, *cuts, None]
    out = []
    for lo, hi in itertools.pairwise(bounds):

        def part(df: pl.DataFrame, lo: int | None = lo, hi: int | None = hi) -> pl.DataFrame:
            keep = pl.lit(True)
            if lo is not None:
                keep = keep & (pl.col("step_id") >= lo)
            if hi is not None:
                keep = keep & (pl.col("step_id") < hi)
            return df.filter(keep)

        out.append([("tokens", part(tokens)), ("steps", part(steps)), ("routes", part(routes))])
    out[-1].append(("requests", rec.requests()))
    return out


def take_cost(path: Path, tokens_per_frame: int, repeat: int) -> str:
    rec = sparseety_prof.open(path)
    frames = _frames(rec, tokens_per_frame)
    n_tokens, n_routes = rec.tokens().height, rec.routes().height
    passes = []
    for _ in range(repeat):
        sink = PrometheusSink("127.0.0.1", 0)
        try:
            sink.open(rec.meta)
            spent = 0
            for frame in frames:
                for table, df in frame:
                    t0 = time.thread_time_ns()
                    sink.take(table, df)
                    spent += time.thread_time_ns() - t0
            passes.append(spent)
        finally:
            sink.stop()
    ns = statistics.median(passes)
    layers = rec.meta["layers"]
    n_moe, n_ffn = len(layers["moe"]), len(layers["ffn"])
    what = f"{n_tokens} tokens, {n_routes} routes rows ({n_moe} MoE of {n_ffn} FFN layers)"
    cost = (
        f"{ns / 1e6:.2f} ms in all, {ns / n_tokens / 1e3:.1f} us per token, "
        f"{ns / n_routes / 1e3:.2f} us per routes row, {ns / len(frames) / 1e3:.0f} us per frame"
    )
    framing = f"{len(frames)} frames of ~{tokens_per_frame} tokens"
    return f"{path}: {what}, {framing}; take() median of {repeat}: {cost}"


def record_sample(out: Path) -> Path:
    """A recording of the tests' MoE model on the tests' llama-cpp-python engine (needs root)."""
    sys.path.insert(0, str(ROOT / "tests"))  # the engine helpers live there
    from conftest import ENGINES, Engine, Recorder

    from sparseety_prof.synthetic import make_model

    model = make_model(out / "moe.gguf", "moe")
    engine = Engine([str(ENGINES / "llama_engine.py"), str(model)])
    try:
        recorder = Recorder(engine.pid, out / "rec")
        prompts = ["the expert router of a sparse model", "one two three four five", "hello there"] * 4
        engine.generate(prompts, max_tokens=48)
        rc, err = recorder.stop(signal.SIGINT)
        if rc != 0:
            raise SystemExit(f"the recorder failed ({rc}): {err}")
    finally:
        engine.close()
    return out / "rec"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("series", help="series per model size (markdown table)")
    t = sub.add_parser("take", help="take() cost per token on a recording")
    t.add_argument("recording", type=Path, nargs="?", help="default: record the tests' MoE model first")
    t.add_argument("--tokens-per-frame", type=int, nargs="+", default=[20, 100, 500])
    t.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    if args.what == "series":
        print(series_table())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            rec = args.recording or record_sample(Path(tmp))
            for n in args.tokens_per_frame:
                print(take_cost(rec, n, args.repeat))


if __name__ == "__main__":
    main()
