"""sparseety-prof: token-level profiler for sparse LLM inference engines."""

import os

# The profiler shares the engine's cores: numerical libraries must not start thread pools, whose
# workers spin between calls (an OpenBLAS pool cost a core's worth of CPU per token; polars'
# pool wakes up for every frame). This has to happen before numpy and polars are first
# imported; a value the user set is kept.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "POLARS_MAX_THREADS"):
    os.environ.setdefault(_var, "1")

__version__ = "0.1.0"

from sparseety_prof.store.recording import Recording, open  # noqa: E402

__all__ = ["Recording", "__version__", "open"]
