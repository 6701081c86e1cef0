"""Entry points: convert a ``transformers`` model, or build one from a checkpoint folder.

Each family module (``bert``, ``gpt2``, ``llama``, ``vit``) turns the Hugging Face config into an
attnzoo config (:class:`~attnzoo.models.DecoderConfig`, ...), builds the model from it and maps
the state dict onto it; this module picks the family.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families.apertus1p5 as apertus1p5
import attnzoo.models.families.bailing_hybrid as bailing_hybrid
import attnzoo.models.families.bamba as bamba
import attnzoo.models.families.bart as bart
import attnzoo.models.families.beam as beam
import attnzoo.models.families.bert_kin as bert_kin
import attnzoo.models.families.classic as classic
import attnzoo.models.families.clip as clip
import attnzoo.models.families.cohere_compass as cohere_compass
import attnzoo.models.families.cwm as cwm
import attnzoo.models.families.deberta as deberta
import attnzoo.models.families.deepseek as deepseek
import attnzoo.models.families.deepseek_v4 as deepseek_v4
import attnzoo.models.families.dense as dense
import attnzoo.models.families.diffllama as diffllama
import attnzoo.models.families.dinov2 as dinov2
import attnzoo.models.families.doge as doge
import attnzoo.models.families.dory as dory
import attnzoo.models.families.dots3 as dots3
import attnzoo.models.families.falcon_h1 as falcon_h1
import attnzoo.models.families.gemma3 as gemma3
import attnzoo.models.families.gemma3n as gemma3n
import attnzoo.models.families.gemma4 as gemma4
import attnzoo.models.families.glm5_next as glm5_next
import attnzoo.models.families.gpt_oss as gpt_oss
import attnzoo.models.families.granitemoe_swa as granitemoe_swa
import attnzoo.models.families.granitemoehybrid as granitemoehybrid
import attnzoo.models.families.hrm as hrm
import attnzoo.models.families.hy_v4 as hy_v4
import attnzoo.models.families.inkling as inkling
import attnzoo.models.families.inkling2 as inkling2
import attnzoo.models.families.jamba as jamba
import attnzoo.models.families.jetmoe as jetmoe
import attnzoo.models.families.kimi_linear as kimi_linear
import attnzoo.models.families.laguna as laguna
import attnzoo.models.families.lara_mini as lara_mini
import attnzoo.models.families.lfm2 as lfm2
import attnzoo.models.families.lfm3 as lfm3
import attnzoo.models.families.llama4 as llama4
import attnzoo.models.families.m2m_100 as m2m_100
import attnzoo.models.families.mamba1 as mamba1
import attnzoo.models.families.mamba2 as mamba2
import attnzoo.models.families.marian as marian
import attnzoo.models.families.mimo_v2_flash as mimo_v2_flash
import attnzoo.models.families.minimax as minimax
import attnzoo.models.families.minimax_m3 as minimax_m3
import attnzoo.models.families.mistral_large4 as mistral_large4
import attnzoo.models.families.modernbert as modernbert
import attnzoo.models.families.mpnet as mpnet
import attnzoo.models.families.muse as muse
import attnzoo.models.families.nemotron_h as nemotron_h
import attnzoo.models.families.neox as neox
import attnzoo.models.families.olmo3 as olmo3
import attnzoo.models.families.olmo_hybrid as olmo_hybrid
import attnzoo.models.families.qwen3_5 as qwen3_5
import attnzoo.models.families.qwen3_next as qwen3_next
import attnzoo.models.families.qwen4_exp as qwen4_exp
import attnzoo.models.families.recurrent_gemma as recurrent_gemma
import attnzoo.models.families.roberta as roberta
import attnzoo.models.families.rope_bert as rope_bert
import attnzoo.models.families.rwkv as rwkv
import attnzoo.models.families.siglip as siglip
import attnzoo.models.families.smollm3 as smollm3
import attnzoo.models.families.sparse_moe as sparse_moe
import attnzoo.models.families.step3p7 as step3p7
import attnzoo.models.families.t5 as t5
import attnzoo.models.families.t5_encoder as t5_encoder
import attnzoo.models.families.whisper as whisper
import attnzoo.models.families.xlstm as xlstm
import attnzoo.models.families.zamba as zamba
import attnzoo.models.families.zamba2 as zamba2
import attnzoo.models.families.zaya as zaya
from attnzoo.models.hf._state import HFConfig
from attnzoo.models.hf.bert import convert_bert
from attnzoo.models.hf.gpt2 import convert_gpt2
from attnzoo.models.hf.llama import FAMILIES, convert_llama
from attnzoo.models.hf.safetensors import load_state_dict_from_folder, read_json
from attnzoo.models.hf.vit import convert_vit
from attnzoo.models.hf.wrappers import WRAPPERS, text_part, warn_dropped

__all__ = ["MODEL_TYPES", "SUPPORTED_ARCHITECTURES", "from_hf", "load_bert", "load_pretrained", "read_config"]

#: the family modules (``models/families/``), in the order ``MODEL_TYPES`` lists them
FAMILY_MODULES = (gemma3, smollm3, olmo3, gpt_oss, llama4, qwen3_next, qwen3_5, olmo_hybrid, kimi_linear, bamba,
                  granitemoehybrid, mamba2, nemotron_h, falcon_h1, lfm2, mamba1, jamba, lfm3, lara_mini,
                  granitemoe_swa, bailing_hybrid, qwen4_exp, glm5_next, minimax, zamba2, recurrent_gemma, zaya,
                  inkling, inkling2, gemma4, deepseek_v4, deepseek, sparse_moe, dense, mimo_v2_flash, laguna,
                  cwm, neox, classic, beam, hy_v4, doge, hrm, diffllama, jetmoe, cohere_compass, gemma3n,
                  zamba, rwkv, xlstm, apertus1p5, dots3, minimax_m3, step3p7, muse, mistral_large4, dory, roberta, bert_kin, modernbert, deberta,
                  mpnet, t5_encoder, rope_bert, dinov2, siglip, clip, t5, bart, marian, m2m_100, whisper)
SUPPORTED_ARCHITECTURES = ("BertModel", "BertFor*", "GPT2LMHeadModel", "GPT2Model", "LlamaForCausalLM",
                           "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
                           "Gemma2ForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM", "*Model",
                           "*ForSequenceClassification", "ViTModel", "ViTForImageClassification",
                           *(c for m in FAMILY_MODULES for d in m.DISPATCH.values() for c in d.classes),
                           *(c for w in WRAPPERS.values() for c in w.classes))
#: ``model_type`` -> (architecture name, converter) of the families built per layer in
#: :mod:`attnzoo.models.families`: each family module declares its own ``DISPATCH`` (name, converter,
#: transformers classes), so adding one touches its module, its test and the tuple below.
BUILDERS: dict[str, tuple[str, Callable[..., nn.Module]]] = {
    t: (d.name, d.convert) for m in FAMILY_MODULES for t, d in m.DISPATCH.items()}
#: ``model_type`` of a config -> the architecture it loads as; the multimodal wrappers of
#: :data:`~attnzoo.models.hf.wrappers.WRAPPERS` load as their text decoder.
MODEL_TYPES = {"bert": "BERT", "gpt2": "GPT-2", "vit": "ViT",
               **{k: f.arch for k, f in FAMILIES.items()}, **{k: arch for k, (arch, _) in BUILDERS.items()},
               **{k: w.name for k, w in WRAPPERS.items()}}


def _build(model_type: str, hf: HFConfig, sd: dict[str, Tensor], device: Any, dtype: Any,
           strict_prefix: bool = False) -> nn.Module:
    """``model_type``: a key of :data:`MODEL_TYPES`; the weights pick the head. A multimodal
    wrapper is read as its text model first (:func:`~attnzoo.models.hf.wrappers.text_part`)."""
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    if model_type in WRAPPERS:
        model_type, hf, sd = text_part(model_type, hf, sd)
    if model_type == "bert":
        return convert_bert(hf, sd, strict_prefix=strict_prefix, **kw)
    if model_type in BUILDERS:
        return BUILDERS[model_type][1](hf, sd, **kw)
    if model_type == "gpt2":
        return convert_gpt2(hf, sd, **kw)
    if model_type in FAMILIES:
        return convert_llama(hf, sd, family=model_type, **kw)
    return convert_vit(hf, sd, classifier="classifier.weight" in sd, **kw)


def from_hf(hf_model: nn.Module, *, device: torch.device | str | None = None,
            dtype: torch.dtype | None = None) -> nn.Module:
    """Convert a Hugging Face ``transformers`` model into the equivalent attnzoo model.

    The family is the config's ``model_type`` (so subclasses and every head class of a family
    work), the head follows the weights: ``bert`` -> :class:`~attnzoo.TransformerEncoder`
    (post-norm, with the pooler if present; ``BertFor*`` task heads are ignored, listed in a
    warning); ``gpt2``, ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gemma``, ``gemma2``,
    ``phi3``, ``olmo2`` -> :class:`~attnzoo.DecoderLM` (``*ForCausalLM``: the LM head; ``*Model``:
    no head, the output is the final hidden states; ``*ForSequenceClassification``: the ``score``
    head per token, transformers reads it at the last non-padding token); ``vit`` ->
    :class:`~attnzoo.VisionTransformer`. A multimodal wrapper (``Gemma3ForConditionalGeneration``,
    ``LlavaForConditionalGeneration``, ... :data:`~attnzoo.models.hf.wrappers.WRAPPERS`) converts as
    its text decoder, its towers dropped with a warning. The result has the same weights, dtype and
    device (unless given) and the same train/eval mode.

    Raises:
        ValueError: an unknown architecture.
        UnsupportedConfigError: a configuration option attnzoo has no equivalent for.
        CheckpointFormatError: the config lacks a key the conversion needs (or has a wrong type).
        WeightLoadError: the state dict does not match (every missing, unexpected or mis-shaped key).
    """
    if not isinstance(hf_model, nn.Module):
        raise TypeError(f"from_hf: expected a transformers model (nn.Module), got {type(hf_model).__name__}")
    name = type(hf_model).__name__
    config = getattr(hf_model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"from_hf: unknown architecture {name!r} (model_type {model_type!r}); supported: "
                         f"{list(SUPPORTED_ARCHITECTURES)} of model types {list(MODEL_TYPES)}")
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(f"from_hf: {name} has no Hugging Face config")
    hf = HFConfig(config.to_dict(), f"{name}.config", MODEL_TYPES[model_type])
    sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
    if model_type in WRAPPERS:
        warn_dropped(f"from_hf({name})", model_type, hf, sd)
    first = next(iter(hf_model.parameters()))
    model = _build(model_type, hf, sd, device if device is not None else first.device,
                   dtype if dtype is not None else first.dtype, strict_prefix=name == "BertModel")
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
    ``transformers``: any ``model_type`` of :data:`MODEL_TYPES`, any head class (see :func:`from_hf`).
    The model is returned in eval mode. Errors as :func:`from_hf`, plus
    ``CheckpointFormatError`` for a malformed file (named in the message)."""
    hf = read_config(folder)
    model_type = hf.raw("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"load_pretrained: unknown model_type {model_type!r} in {hf.source}; "
                         f"supported: {', '.join(MODEL_TYPES)}")
    sd = load_state_dict_from_folder(folder)
    if model_type in WRAPPERS:
        warn_dropped(f"load_pretrained({str(folder)!r})", model_type, hf, sd)
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
