"""The recorder's thread pools: one thread each for the numerical libraries and polars.

The recorder shares the engine's cores, and these libraries start pools whose workers spin or
wake between calls (docs/overhead.md measures what they cost). They read their variables once,
when first imported, so this runs in the recorder's process before numpy or polars is imported:
cli.main does it before it imports a command. Importing the package does not (a notebook that
imports sparseety_prof keeps its own settings); a program that embeds the Recorder calls
limit_thread_pools() itself, first. A value the user set is kept.

Standard library only, and nothing imported here may import numpy or polars.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["THREAD_POOL_VARS", "limit_thread_pools"]

#: OpenBLAS, OpenMP (and libraries built on it), MKL, polars
THREAD_POOL_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "POLARS_MAX_THREADS")


def limit_thread_pools(environ: MutableMapping[str, str] = os.environ) -> None:
    """One thread per pool, unless the user chose otherwise."""
    for var in THREAD_POOL_VARS:
        environ.setdefault(var, "1")
