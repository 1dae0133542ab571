"""One watch rule of a `--preset`, with where it was read: shared by presets.py and the presets
derived from an engine's own kernels (llamacpp_kernels.py)."""

from __future__ import annotations

from dataclasses import dataclass

from sparseety_prof.gpu import watch_rules


@dataclass(frozen=True)
class Source:
    repo: str
    path: str
    commit: str  # the revision read: a commit of the code index, or a llama.cpp build number


@dataclass(frozen=True)
class PresetRule:
    entry: str  # pattern:arg:dtype:rule, as --watch takes it
    source: Source
    example: str  # a mangled name of the kernel the rule is for
    layout: tuple[str, ...]  # its arguments: p, i32 (any 4-byte scalar), i64, b

    def rule(self) -> watch_rules.WatchRule:
        return watch_rules.parse(self.entry)[0]
