"""Hugging Face interop (re-exported from :mod:`attnzoo.models.hf`, where the code lives).

``from_hf(model)`` converts a ``transformers`` model; ``load_pretrained(folder)`` /
``load_bert(folder)`` build one from a checkpoint folder without ``transformers``;
``read_safetensors``, ``load_state_dict_from_folder`` and ``WordPieceTokenizer`` read the files.
See ``docs/models.md``.
"""

from attnzoo.models.hf import (
    MODEL_TYPES,
    SUPPORTED_ARCHITECTURES,
    CheckpointFormatError,
    UnsupportedConfigError,
    WeightLoadError,
    WordPieceTokenizer,
    from_hf,
    load_bert,
    load_pretrained,
    load_state_dict_from_folder,
    read_safetensors,
)

__all__ = [
    "MODEL_TYPES",
    "SUPPORTED_ARCHITECTURES",
    "CheckpointFormatError",
    "UnsupportedConfigError",
    "WeightLoadError",
    "WordPieceTokenizer",
    "from_hf",
    "load_bert",
    "load_pretrained",
    "load_state_dict_from_folder",
    "read_safetensors",
]
