"""Make the generated models: one file (make_model), or each preset once with a sidecar that
says what its bytes were made from (ensure_model, make_all).

Same preset + seed + dtype + n_vocab_min + prune => byte-identical file. Needs only numpy and gguf.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from sparseety_prof.synthetic.gguf_file import write_gguf
from sparseety_prof.synthetic.presets import PRESETS, resolve
from sparseety_prof.synthetic.prune import Prune, parse_prune

GENERATOR_VERSION = 1
#: the generator's sources: their hash is part of a sidecar's spec (an edit regenerates the files)
_SOURCES = Path(__file__).resolve().parent


def make_model(
    path: str | os.PathLike[str],
    preset: str,
    *,
    seed: int = 1234,
    dtype: str | None = None,
    n_vocab_min: int | None = None,
    prune: str | float | Prune | None = None,
) -> Path:
    """Write preset ``preset`` to ``path`` (atomically) and return the path.

    ``dtype`` (f32/f16/q8_0/q4_0) and ``n_vocab_min`` default to the preset's; ``prune`` ("2:4",
    "0.5", 0.5 or a Prune; see prune.py) zeroes part of the FFN weights. Deterministic:
    the same arguments give a byte-identical file. A file already at ``path`` with exactly these
    bytes is left as it is (same inode and times): a recorder attaching to an engine on it again
    finds the model's sha256 it remembered (weight_sparsity.model_sha256), as it would in
    production, instead of hashing the file anew on every benchmark run.
    """
    p, dt, nv = resolve(preset, dtype, n_vocab_min)
    pr = parse_prune(prune)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        write_gguf(tmp, p, seed=seed, dtype=dt, n_vocab_min=nv, name=f"sparseety-test-{preset}", prune=pr)
        if not _same_bytes(tmp, out):
            os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _same_bytes(a: Path, b: Path) -> bool:
    """Whether b is a regular file (not a link) holding exactly a's bytes."""
    try:
        if b.is_symlink() or not b.is_file() or a.stat().st_size != b.stat().st_size:
            return False
        with open(a, "rb") as fa, open(b, "rb") as fb:
            while True:
                x, y = fa.read(1 << 20), fb.read(1 << 20)
                if x != y:
                    return False
                if not x:
                    return True
    except OSError:
        return False


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _generator_sha256() -> str:
    h = hashlib.sha256()
    for src in sorted(_SOURCES.glob("*.py")):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()


def model_spec(
    preset: str, *, seed: int = 1234, dtype: str | None = None, prune: str | float | Prune | None = None
) -> dict[str, Any]:
    """What determines a generated file's bytes (recorded in the sidecar next to it)."""
    p, dt, nv = resolve(preset, dtype, None)
    pr = parse_prune(prune)
    return {
        "generator_version": GENERATOR_VERSION,
        "generator_sha256": _generator_sha256(),
        "gguf_version": getattr(gguf, "__version__", None) or _gguf_dist_version(),
        "numpy_version": np.__version__,
        "preset": preset,
        "params": json.loads(json.dumps(asdict(p))),  # as the sidecar reads back (tuples as lists)
        "seed": seed,
        "dtype": dt,
        "n_vocab_min": nv,
        "prune": None if pr is None else str(pr),
    }


def _gguf_dist_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return None


def sidecar_path(model_path: Path) -> Path:
    return model_path.with_name(model_path.name + ".json")


def ensure_model(
    path: Path,
    preset: str,
    *,
    seed: int = 1234,
    dtype: str | None = None,
    prune: str | float | Prune | None = None,
) -> bool:
    """Generate ``path`` unless it exists with matching sidecar spec and content hash.

    Returns True when the file was (re)generated, False when it was up to date.
    """
    spec = model_spec(preset, seed=seed, dtype=dtype, prune=prune)
    side = sidecar_path(path)
    if path.exists() and side.exists():
        try:
            rec = json.loads(side.read_text())
        except (OSError, ValueError):
            rec = None
        if isinstance(rec, dict) and rec.get("spec") == spec and rec.get("sha256") == _file_sha256(path):
            return False
    make_model(path, preset, seed=seed, dtype=dtype, prune=prune)
    rec = {"spec": spec, "sha256": _file_sha256(path), "size": path.stat().st_size}
    side.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
    return True


def make_all(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 1234,
    dtype: str | None = None,
    presets: Sequence[str] | None = None,
    log: Any = None,
    prune: str | float | Prune | None = None,
) -> dict[str, Path]:
    """Write every preset (or ``presets``) as ``out_dir/<preset>.gguf``; returns name -> path."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    names = list(presets) if presets is not None else list(PRESETS)
    result: dict[str, Path] = {}
    for i, name in enumerate(names, 1):
        path = d / f"{name}.gguf"
        t0 = time.perf_counter()
        made = ensure_model(path, name, seed=seed, dtype=dtype, prune=prune)
        dt = time.perf_counter() - t0
        if log is not None:
            what = "wrote" if made else "up to date"
            size_mb = path.stat().st_size / 1e6
            print(f"[{i}/{len(names)}] {name:<13} {what:<10} {path} ({size_mb:.1f} MB, {dt:.2f} s)", file=log)
        result[name] = path
    return result
