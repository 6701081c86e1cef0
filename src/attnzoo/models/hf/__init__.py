"""Hugging Face interop: convert ``transformers`` models, load checkpoint folders, tokenize.

* :func:`from_hf` converts a ``transformers`` model instance (``BertModel``, ``GPT2LMHeadModel`` /
  ``GPT2Model``, ``LlamaForCausalLM``, ``MistralForCausalLM``, ``ViTModel``,
  ``ViTForImageClassification``) into the equivalent attnzoo model with the same weights.
* :func:`load_pretrained` / :func:`load_bert` build the model straight from a folder holding
  ``config.json`` and ``model.safetensors`` (or sharded safetensors, or ``pytorch_model.bin``);
  ``transformers`` is not needed, and ``safetensors`` is used (memory-mapped) when installed,
  else :func:`read_safetensors` parses the file with torch only.
* :func:`to_hf` / :func:`save_pretrained` go the other way: an attnzoo model's weights written
  back into a ``transformers`` model, or a checkpoint folder, of the layout it was converted from.
* :func:`generation_settings` reads a checkpoint's ``generation_config.json`` as the keywords of
  ``generate`` (end tokens, beams, penalties, sampling), refusing by name what it cannot reproduce.
* :class:`WordPieceTokenizer` reads a BERT ``vocab.txt``.

Each family converter (``bert``, ``gpt2``, ``llama``, ``vit``) builds the attnzoo config
(``DecoderConfig``, ...) from the Hugging Face one, then maps the weights; ``attnzoo.interop``
re-exports this package. Errors: :class:`UnsupportedConfigError` (an option attnzoo has no
equivalent for), :class:`CheckpointFormatError` (a malformed file or config, named),
:class:`WeightLoadError` (a state dict that does not fit).
"""

from attnzoo.models.hf.convert import (
    MODEL_TYPES,
    SUPPORTED_ARCHITECTURES,
    from_hf,
    load_bert,
    load_pretrained,
)
from attnzoo.models.hf.errors import CheckpointFormatError, UnsupportedConfigError, WeightLoadError
from attnzoo.models.hf.generation_config import generation_settings
from attnzoo.models.hf.safetensors import load_state_dict_from_folder, read_safetensors
from attnzoo.models.hf.save import ExportError, hf_config, save_pretrained, to_hf
from attnzoo.models.hf.tokenizer import WordPieceTokenizer

__all__ = ["MODEL_TYPES", "SUPPORTED_ARCHITECTURES", "CheckpointFormatError", "ExportError", "UnsupportedConfigError",
           "WeightLoadError", "WordPieceTokenizer", "from_hf", "generation_settings", "hf_config", "load_bert",
           "load_pretrained",
           "load_state_dict_from_folder", "read_safetensors", "save_pretrained", "to_hf"]
