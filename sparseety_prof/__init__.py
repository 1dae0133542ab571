"""sparseety-prof: token-level profiler for sparse LLM inference engines."""

__version__ = "0.1.0"

from .recording import Recording, open

__all__ = ["Recording", "__version__", "open"]
