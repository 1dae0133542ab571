"""Recordings of the sanity models for `audit`, shared by tests/test_audit_engine.py and
scripts/audit_sanity.py (which prints the figures docs/privacy.md quotes): one engine process per model
(tests/engines/llama_engine.py), `sparseety-prof record` attached once per set of prompts."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from conftest import ENGINES, Engine, Recorder

from sparseety_prof.synthetic import WORDS, make_model

#: the sanity models and the recorder flags each is audited with
MODELS: dict[str, list[str]] = {
    "token_routed": [],
    "context_routed": [],
    "smallthinker": ["--capture-masks"],
}


def prompts(n: int, seed: int, words: int = 30) -> list[str]:
    """`n` prompts of `words` words drawn from the generated vocabulary's first 60 words."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS[:60], words)) for _ in range(n)]


TRAIN, HELD_OUT = prompts(6, seed=1), prompts(3, seed=2)


@dataclass
class Recorded:
    train: Path
    held: Path
    extra: dict[str, Path]


def record_model(
    tmp: Path,
    preset: str,
    rec_args: list[str],
    extra: dict[str, list[str]] | None = None,
    *,
    train: list[str] = TRAIN,
    held_out: list[str] = HELD_OUT,
) -> Recorded:
    """Training and held-out recordings of `preset` under `tmp` (and one held-out recording per
    `extra` entry, with those recorder flags), from one engine process, 2 tokens per prompt."""
    model = make_model(tmp / f"{preset}.gguf", preset)
    runs = {"train": (train, rec_args), "held": (held_out, rec_args)}
    runs.update({name: (held_out, args) for name, args in (extra or {}).items()})
    e = Engine([str(ENGINES / "llama_engine.py"), str(model)])
    try:
        for name, (ps, args) in runs.items():
            rec = Recorder(e.pid, tmp / name, *args)
            e.generate(ps, max_tokens=2)
            rc, err = rec.stop(signal.SIGINT)
            if rc != 0:
                raise RuntimeError(f"recorder exited with {rc}: {err}")
    finally:
        e.close()
    return Recorded(tmp / "train", tmp / "held", {name: tmp / name for name in extra or {}})
