"""Record the three sanity models of `audit` and print what it measures on them (the figures
of docs/privacy.md): per model and redaction level, the best signal left and its token recovery.

    sudo .venv/bin/python scripts/audit_sanity.py [--out DIR] [--train N] [--held-out N] [--json]

Needs root (the recorder attaches eBPF uprobes), like the engine tests. Generates the models
(sparseety_prof/synthetic: token_routed, context_routed, smallthinker), records N training prompts
and N held-out prompts of the same 60 words for each (tests/audit_runs.py; the defaults are the
tests'), and runs `audit HELD --train TRAIN` on each. Takes about 30 s per model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the model generator and the recording helper live there
from audit_runs import MODELS, prompts, record_model  # noqa: E402

from sparseety_prof.views.audit.attack import AuditResult, audit  # noqa: E402


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def table(results: dict[str, AuditResult]) -> str:
    head = (
        "| model | rows (tokens seen in training) | chance top-1 | redaction | best signal left | "
        "top-1 | top-5 | bits (shuffled) |\n|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for model, r in results.items():
        for lv in r.levels:
            layers = "" if lv.layers is None else " --redact-layers " + ",".join(map(str, lv.layers))
            name = "none" if not lv.levels else "`--redact " + ",".join(lv.levels) + layers + "`"
            b = lv.best
            lines.append(
                f"| {model} | {r.rows} ({_pct(r.coverage)}) | {_pct(r.chance.top1)} | {name} | "
                f"{lv.best_signal or '(none)'} | {_pct(b.top1)} | {_pct(b.top5)} | "
                f"{b.bits:.2f} ({b.bits_shuffled:.2f}) |"
            )
    return head + "\n".join(lines)


def signals(results: dict[str, AuditResult]) -> str:
    """Nothing redacted: each signal's recovery over all layers and from its leakiest layer."""
    head = "| model | signal | top-1, all layers | leakiest layer | its top-1 |\n|---|---|---|---|---|\n"
    lines = []
    for model, r in results.items():
        for s in r.levels[0].signals:
            layers = [(k, v) for k, v in s.layers.items() if v.rows]
            best = max(layers, key=lambda kv: kv[1].top1, default=None)
            where = ("—", "—") if best is None else (str(best[0]), _pct(best[1].top1))
            lines.append(f"| {model} | {s.signal} | {_pct(s.all_layers.top1)} | {where[0]} | {where[1]} |")
    return head + "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "recordings" / time.strftime("audit-%Y%m%d-%H%M%S"))
    ap.add_argument("--train", type=int, default=6, help="training prompts per model (default 6)")
    ap.add_argument("--held-out", type=int, default=3, help="held-out prompts per model (default 3)")
    ap.add_argument("--json", action="store_true", help="print the audit results as JSON")
    a = ap.parse_args()
    results: dict[str, AuditResult] = {}
    for preset, flags in MODELS.items():
        d = a.out / preset
        d.mkdir(parents=True, exist_ok=False)
        print(f"[audit] recording {preset} {' '.join(flags)} in {d}", file=sys.stderr, flush=True)
        rec = record_model(
            d, preset, flags, train=prompts(a.train, seed=1), held_out=prompts(a.held_out, seed=2)
        )
        results[preset] = audit(rec.held, [rec.train])
    if a.json:
        print(json.dumps({k: asdict(v) for k, v in results.items()}, indent=2, default=str))
    else:
        print(table(results) + "\n\n" + signals(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
