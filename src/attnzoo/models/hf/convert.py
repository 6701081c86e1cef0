"""Entry points: convert a ``transformers`` model, or build one from a checkpoint folder.

Each family module (``bert``, ``gpt2``, ``llama``, ``vit``) turns the Hugging Face config into an
attnzoo config (:class:`~attnzoo.models.DecoderConfig`, ...), builds the model from it and maps
the state dict onto it; this module picks the family.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo.models.hf._state import HFConfig
from attnzoo.models.hf.bert import convert_bert
from attnzoo.models.hf.deepseek import convert_deepseek
from attnzoo.models.hf.gpt2 import convert_gpt2
from attnzoo.models.hf.llama import convert_llama
from attnzoo.models.hf.safetensors import load_state_dict_from_folder, read_json
from attnzoo.models.hf.vit import convert_vit

__all__ = ["MODEL_TYPES", "SUPPORTED_ARCHITECTURES", "from_hf", "load_bert", "load_pretrained", "read_config"]

SUPPORTED_ARCHITECTURES = ("BertModel", "GPT2LMHeadModel", "GPT2Model", "LlamaForCausalLM", "MistralForCausalLM",
                           "ViTModel", "ViTForImageClassification", "DeepseekV3ForCausalLM")
#: ``model_type`` of a folder's ``config.json`` -> the architecture it loads as.
MODEL_TYPES = {"bert": "BERT", "gpt2": "GPT-2", "llama": "LLaMA", "mistral": "Mistral", "vit": "ViT",
               "deepseek_v3": "DeepSeek-V3"}
_ARCH_OF = {"BertModel": "BERT", "GPT2LMHeadModel": "GPT-2", "GPT2Model": "GPT-2", "LlamaForCausalLM": "LLaMA",
            "MistralForCausalLM": "Mistral", "ViTModel": "ViT", "ViTForImageClassification": "ViT",
            "DeepseekV3ForCausalLM": "DeepSeek-V3"}


def _build(name: str, hf: HFConfig, sd: dict[str, Tensor], device: Any, dtype: Any) -> nn.Module:
    """``name``: a class name of :data:`SUPPORTED_ARCHITECTURES` or a ``model_type``."""
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    if name in ("BertModel", "bert"):
        return convert_bert(hf, sd, strict_prefix=name == "BertModel", **kw)
    if name in ("DeepseekV3ForCausalLM", "deepseek_v3"):
        return convert_deepseek(hf, sd, **kw)
    if name in ("GPT2LMHeadModel", "GPT2Model", "gpt2"):
        return convert_gpt2(hf, sd, **kw)
    if name in ("LlamaForCausalLM", "llama", "MistralForCausalLM", "mistral"):
        return convert_llama(hf, sd, sliding=name in ("MistralForCausalLM", "mistral"), **kw)
    classifier = name == "ViTForImageClassification" or (name == "vit" and "classifier.weight" in sd)
    return convert_vit(hf, sd, classifier=classifier, **kw)


def from_hf(hf_model: nn.Module, *, device: torch.device | str | None = None,
            dtype: torch.dtype | None = None) -> nn.Module:
    """Convert a Hugging Face ``transformers`` model into the equivalent attnzoo model.

    ``BertModel`` -> :class:`~attnzoo.TransformerEncoder` (post-norm, with the pooler if present);
    ``GPT2LMHeadModel``/``GPT2Model``, ``LlamaForCausalLM``, ``MistralForCausalLM`` ->
    :class:`~attnzoo.DecoderLM`; ``ViTModel``/``ViTForImageClassification`` ->
    :class:`~attnzoo.VisionTransformer`. The result has the same weights, dtype and device (unless
    given) and the same train/eval mode.

    Raises:
        ValueError: an unknown architecture.
        UnsupportedConfigError: a configuration option attnzoo has no equivalent for.
        CheckpointFormatError: the config lacks a key the conversion needs (or has a wrong type).
        WeightLoadError: the state dict does not match (every missing, unexpected or mis-shaped key).
    """
    if not isinstance(hf_model, nn.Module):
        raise TypeError(f"from_hf: expected a transformers model (nn.Module), got {type(hf_model).__name__}")
    name = type(hf_model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"from_hf: unknown architecture {name!r}; supported: {list(SUPPORTED_ARCHITECTURES)}")
    config = getattr(hf_model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(f"from_hf: {name} has no Hugging Face config")
    hf = HFConfig(config.to_dict(), f"{name}.config", _ARCH_OF[name])
    sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
    first = next(iter(hf_model.parameters()))
    model = _build(name, hf, sd, device if device is not None else first.device,
                   dtype if dtype is not None else first.dtype)
    model.train(hf_model.training)
    return model


def read_config(folder: str | os.PathLike[str]) -> HFConfig:
    """A folder's ``config.json`` as an :class:`~attnzoo.models.hf._state.HFConfig` (its
    messages name the file); invalid JSON or a non-object is a ``CheckpointFormatError``."""
    d = Path(folder)
    if not d.is_dir():
        raise FileNotFoundError(f"not a directory: {str(d)!r}")
    path = d / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {str(d)!r}")
    data = read_json(path, "the model config")
    hf = HFConfig(data, str(path))
    model_type = hf.raw("model_type")
    hf.arch = MODEL_TYPES.get(model_type, "model") if isinstance(model_type, str) else "model"
    return hf


def load_pretrained(folder: str | os.PathLike[str], *, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> nn.Module:
    """Build an attnzoo model from a Hugging Face folder (``config.json`` + weights) without
    ``transformers``: ``model_type`` ``bert``, ``gpt2``, ``llama``, ``mistral`` or ``vit``.
    The model is returned in eval mode. Errors as :func:`from_hf`, plus
    ``CheckpointFormatError`` for a malformed file (named in the message)."""
    hf = read_config(folder)
    model_type = hf.raw("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"load_pretrained: unknown model_type {model_type!r} in {hf.source}; "
                         f"supported: {', '.join(MODEL_TYPES)}")
    sd = load_state_dict_from_folder(folder)
    return _build(model_type, hf, sd, device, dtype).eval()


def load_bert(folder: str | os.PathLike[str], *, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None) -> nn.Module:
    """A BERT-style encoder (:class:`~attnzoo.TransformerEncoder`, eval mode) from a folder with
    ``config.json`` and ``model.safetensors`` (e.g. sentence-transformers' all-MiniLM-L6-v2).
    ``BertFor*`` checkpoints work too (the ``bert.`` prefix is stripped, task heads ignored)."""
    hf = read_config(folder)
    if hf.raw("model_type") != "bert":
        raise ValueError(f"load_bert: {hf.source} has model_type {hf.raw('model_type')!r}, expected 'bert'")
    sd = load_state_dict_from_folder(folder)
    return _build("bert", hf, sd, device, dtype).eval()
