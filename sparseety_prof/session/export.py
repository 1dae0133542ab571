"""`sparseety-prof redact SRC -o DST`: a redacted copy of a recording, for sharing.

The copy is written by RecordingWriter, like a recording made with the same flags: new files only
(owner-only modes, created through the open directory, never through a symlink), the levels
applied to every row, and meta.json listing every level the copy has (the source's and the new
ones). With `--redact-text`, what meta.json keeps of the engine's command line, environment and
server settings is redacted again at that level (session/redaction.py), as the recorder would have.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sparseety_prof.session import redaction
from sparseety_prof.store import recording, recording_writer, schema
from sparseety_prof.store.output_dir import sudo_owner


def export_redacted(
    src: Path, dst: Path, *, levels: Iterable[str], layers: Iterable[int] | None = None, redact_text: bool
) -> dict[str, Any]:
    """Write `src` to `dst` with `levels` (on `layers`, or every layer) plus the source's own levels
    applied; returns the new meta. Where the source's levels were limited to some layers, the union
    of both is applied to the union of both layer sets (every layer when either is): the copy may
    lose more than asked, never less, and meta.json describes it exactly."""
    rec = recording.open(src)
    all_levels = set(levels) | set(rec.redaction_levels)
    src_layers = rec.redaction_layers if rec.redaction_levels else None
    if layers is None or (rec.redaction_levels and src_layers is None):
        all_layers = None
    else:
        all_layers = set(layers) | set(src_layers or ())
    text = redact_text or rec.redacted
    meta = {k: v for k, v in rec.meta.items() if k not in recording_writer.WRITER_META_KEYS}
    if text:
        meta = _text_redacted_meta(meta)
    meta["exported_from"] = {"complete": rec.complete, "created_unix_ms": rec.meta.get("created_unix_ms")}
    frames = {t: rec.table(t) for t in schema.TABLES}  # read (and checked) before anything is written
    with recording_writer.RecordingWriter(
        dst, meta, owner=sudo_owner(), redact_text=text, redact=all_levels, redact_layers=all_layers
    ) as writer:
        for table, df in frames.items():
            writer.append(table, df)
        writer.close(complete=rec.complete)
        return writer.meta


def _text_redacted_meta(meta: dict[str, Any]) -> dict[str, Any]:
    out = dict(meta)
    out["redact_text"] = True
    target = out.get("target")
    if isinstance(target, dict) and isinstance(target.get("cmdline"), list):
        argv = [str(a) for a in target["cmdline"]]
        out["target"] = {**target, "cmdline": redaction.command_line(argv, redact_text=True)}
    config = out.get("config")
    if isinstance(config, dict):
        config = dict(config)
        env = config.get("environment")
        if isinstance(env, dict):
            config["environment"] = redaction.environment(
                {str(k): str(v) for k, v in env.items()}, redact_text=True
            )
        server = config.get("server")
        if isinstance(server, dict):
            config["server"] = {
                **server,
                "props": redaction.server_answer(server.get("props"), redact_text=True),
            }
        out["config"] = config
    return out
