"""Deterministic random-weight GGUF models that llama.cpp loads and runs, with a working SPM
tokenizer: the model of the demo (scripts/demo.py) and of the tests. Needs only numpy and gguf.

    from sparseety_prof.synthetic import make_model, PRESETS
    make_model("models/moe.gguf", "moe")
    make_model("models/moe-q4.gguf", "moe", dtype="q4_0", prune="2:4")

    python -m sparseety_prof.synthetic OUT.gguf --preset moe    # or --all DIR

The presets (presets.py), the tokenizer (vocab.py), pruning (prune.py), the file's contents
(gguf_file.py), and making files once with a sidecar of their spec (models.py).
"""

from sparseety_prof.synthetic.models import (
    GENERATOR_VERSION,
    ensure_model,
    make_all,
    make_model,
    model_spec,
    sidecar_path,
)
from sparseety_prof.synthetic.presets import DTYPES, PRESETS, Preset, swa_layers
from sparseety_prof.synthetic.prune import Prune, parse_prune, prune_array
from sparseety_prof.synthetic.vocab import (
    BOS_ID,
    BYTE_TOKEN_IDS,
    EOS_ID,
    SPACE,
    UNK_ID,
    WORDS,
    Vocab,
    build_vocab,
)

__all__ = [
    "BOS_ID",
    "BYTE_TOKEN_IDS",
    "DTYPES",
    "EOS_ID",
    "GENERATOR_VERSION",
    "PRESETS",
    "SPACE",
    "UNK_ID",
    "WORDS",
    "Preset",
    "Prune",
    "Vocab",
    "build_vocab",
    "ensure_model",
    "make_all",
    "make_model",
    "model_spec",
    "parse_prune",
    "prune_array",
    "sidecar_path",
    "swa_layers",
]
