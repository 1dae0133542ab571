"""What the recording's journal costs the consumer, measured without the engine: the drains of a
real run (kept by `scripts/replay_drains.py capture`) are correlated again, and their rows handed
to the recorder's own RowOutlet and RecordingWriter (session/row_outlet.py) with each journal:

- `none`: no journal (`--no-journal`): rows framed and written at flushes only;
- `framed`: the journal as rows framed after each drain (SPJ1 records), as the recorder writes it
  when a policy holds rows or a redaction changes them;
- `gathered`: the journal as rows gathered, unframed (SPJ2, store/gathered_codec.py), the
  default.

    sudo .venv/bin/python scripts/replay_drains.py capture -o /tmp/drains.pkl --seconds 20
    .venv/bin/python scripts/bench_outlet.py /tmp/drains.pkl [--repeat 5] [--modes none framed gathered]

Each drain comes `drain_s` apart on a simulated clock (the captured run's pace), so the journal's
records and the flushes (`--flush-interval`'s default) come as they did live; the modes are
replayed in turn, `--repeat` times, and the least CPU of each is printed: the process's CPU time
(Polars's threads included) spent in the outlet (adding rows, the journal, flushes, the close),
per recorded token. The correlation is the same work in every mode and is left out.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("POLARS_MAX_THREADS", "1")  # as in the recorder
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ("none", "framed", "gathered")


def _outlet(meta: dict[str, Any], out: Path, mode: str) -> Any:
    from sparseety_prof.session.collector import FlushTimedCollector
    from sparseety_prof.session.options import FLUSH_INTERVAL_S, FSYNC_INTERVAL_S
    from sparseety_prof.session.policy import RecordingPolicy
    from sparseety_prof.session.row_outlet import RowOutlet
    from sparseety_prof.session.sinks import SinkFanout
    from sparseety_prof.session.stage_cpu import StageCpu
    from sparseety_prof.store.aggregates import Aggregator
    from sparseety_prof.store.recording import list_layers
    from sparseety_prof.store.recording_writer import RecordingWriter

    class FramedJournalWriter(RecordingWriter):
        """A writer whose rows the journal takes framed (as when a redaction changes them)."""

        @property
        def stores_as_given(self) -> bool:
            return False

    kind = FramedJournalWriter if mode == "framed" else RecordingWriter
    writer = kind(out, meta, fsync_interval=None if mode == "none" else FSYNC_INTERVAL_S)
    aggregates = Aggregator(list_layers(meta), grace_s=max(10.0, 2 * FLUSH_INTERVAL_S))
    sinks = SinkFanout([], meta, redact_text=False, redact=frozenset(), redact_layers=None, log=print)
    outlet = RowOutlet(
        writer,
        RecordingPolicy(("full",)),
        aggregates,
        sinks,
        stages=StageCpu(),
        collector=FlushTimedCollector(),
        log=print,
    )
    return outlet, writer


def replay_once(
    kept: dict[str, Any], texts: Any, out: Path, mode: str, flush_s: float | None = None
) -> tuple[float, int]:
    """The outlet's CPU seconds over the kept drains, and the token rows made (flushes every
    `flush_s` of the simulated clock; None: `--flush-interval`'s default)."""
    from sparseety_prof.capture.events import decode_groups
    from sparseety_prof.correlate.correlator import Correlator
    from sparseety_prof.correlate.serving import ServingTracker
    from sparseety_prof.session.options import FLUSH_INTERVAL_S
    from sparseety_prof.store.buffers import FlushSchedule

    sys.path.insert(0, str(ROOT / "scripts"))
    from replay_drains import captured_drain_s

    drain_s = captured_drain_s(kept)
    kw = dict(kept["correlator"])
    serving = ServingTracker(kw["pid"]) if kw.pop("serving") else None
    corr = Correlator(**kw, texts=texts, serving=serving)
    outlet, writer = _outlet(kept["meta"], out, mode)
    flush = FlushSchedule(FLUSH_INTERVAL_S if flush_s is None else flush_s)
    t0 = time.monotonic()
    flush._next = t0 + flush.period  # on the simulated clock
    cpu = 0.0
    tokens = 0
    drains = kept["drains"]
    for k, groups in enumerate(drains):
        final = k == len(drains) - 1
        corr.feed(decode_groups(groups, kept["logits_chunk"]))
        tables = corr.take_tables(final=final)
        apart = corr.take_apart()
        tokens += len(tables["tokens"]["step_id"])
        p = time.process_time()
        outlet.add_apart(apart)
        for table, cols in tables.items():
            outlet.add(table, cols, final=final)
        outlet.keep_durable(flush, t0 + k * drain_s, in_pieces=False)
        cpu += time.process_time() - p
    p = time.process_time()
    outlet.close_rows()
    writer.close()
    cpu += time.process_time() - p
    return cpu, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drains", type=Path, help="a file of `scripts/replay_drains.py capture`")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument(
        "--flush-intervals",
        nargs="+",
        type=float,
        metavar="S",
        help="replay each mode with each of these flush intervals (default: --flush-interval's default)",
    )
    a = ap.parse_args()
    from sparseety_prof.capture.gguf_info import Vocab
    from sparseety_prof.synthetic import make_model

    with a.drains.open("rb") as f:
        kept = pickle.load(f)
    texts = Vocab.from_gguf(make_model(ROOT / "models" / "bench.gguf", "bench")).texts
    from sparseety_prof.session.options import FLUSH_INTERVAL_S

    variants = [(mode, s) for s in (a.flush_intervals or [FLUSH_INTERVAL_S]) for mode in a.modes]
    best = dict.fromkeys(variants, float("inf"))
    tokens = 0
    for _ in range(a.repeat):
        for mode, flush_s in variants:  # in turn: drift hits every variant alike
            with tempfile.TemporaryDirectory(prefix="sparseety-outlet-") as tmp:
                cpu, tokens = replay_once(kept, texts, Path(tmp) / "rec", mode, flush_s)
            best[mode, flush_s] = min(best[mode, flush_s], cpu)
    n = max(tokens, 1)
    print(f"{len(kept['drains'])} drains, {tokens} tokens ({tokens / len(kept['drains']):.0f} per drain)")
    print(f"| journal | flush interval | outlet CPU per token (least of {a.repeat}) |")
    print("| --- | --- | --- |")
    for mode, flush_s in variants:
        print(f"| {mode} | {flush_s:g} s | {best[mode, flush_s] / n * 1e6:.1f} µs |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
