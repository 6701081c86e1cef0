"""Hugging Face interop (re-exported from :mod:`attnzoo.models.hf`, where the code lives).

``from_hf(model)`` converts a ``transformers`` model; ``load_pretrained(folder)`` /
``load_bert(folder)`` build one from a checkpoint folder without ``transformers``;
``read_safetensors``, ``load_state_dict_from_folder`` and ``WordPieceTokenizer`` read the files.
See ``docs/models.md``.
"""

from attnzoo.models.hf import *  # noqa: F403 (the room's public names, listed in its __all__)
from attnzoo.models.hf import __all__  # noqa: F401
