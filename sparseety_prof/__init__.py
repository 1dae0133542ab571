"""sparseety-prof: token-level profiler for sparse LLM inference engines.

Importing the package changes nothing around it (no environment variable, no thread pool) and
imports no polars: `Recording` and `open` are loaded on first use, so that the CLI can size the
thread pools of a recorder (thread_pools.py) before polars starts its own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from sparseety_prof.store.recording import Recording, open

__all__ = ["Recording", "__version__", "open"]


def __getattr__(name: str) -> Any:
    # PEP 562: the reading API, imported when first asked for
    if name in ("Recording", "open"):
        from sparseety_prof.store import recording

        return getattr(recording, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
