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

from attnzoo.models.families import dense, sparse_moe
from attnzoo.models.families.bailing_hybrid import convert_bailing_hybrid
from attnzoo.models.families.bamba import convert_bamba
from attnzoo.models.families.deepseek_v4 import convert_deepseek_v4
from attnzoo.models.families.falcon_h1 import convert_falcon_h1
from attnzoo.models.families.gemma3 import convert_gemma3
from attnzoo.models.families.gemma4 import convert_gemma4
from attnzoo.models.families.glm5_next import convert_glm5_next
from attnzoo.models.families.gpt_oss import convert_gpt_oss
from attnzoo.models.families.granitemoe_swa import convert_granitemoe_swa
from attnzoo.models.families.granitemoehybrid import convert_granitemoehybrid
from attnzoo.models.families.inkling import convert_inkling
from attnzoo.models.families.inkling2 import convert_inkling2, convert_inkling2_loop
from attnzoo.models.families.jamba import convert_jamba
from attnzoo.models.families.kimi_linear import convert_kimi_linear
from attnzoo.models.families.lara_mini import convert_lara_mini
from attnzoo.models.families.lfm2 import convert_lfm2, convert_lfm2_moe
from attnzoo.models.families.lfm3 import convert_lfm3
from attnzoo.models.families.llama4 import convert_llama4
from attnzoo.models.families.mamba1 import convert_falcon_mamba, convert_mamba
from attnzoo.models.families.mamba2 import convert_mamba2
from attnzoo.models.families.minimax import convert_minimax
from attnzoo.models.families.nemotron_h import convert_nemotron_h
from attnzoo.models.families.olmo3 import convert_olmo3
from attnzoo.models.families.olmo_hybrid import convert_olmo_hybrid
from attnzoo.models.families.qwen3_5 import convert_qwen3_5, convert_qwen3_5_moe
from attnzoo.models.families.qwen3_next import convert_qwen3_next
from attnzoo.models.families.qwen4_exp import convert_qwen4_exp
from attnzoo.models.families.recurrent_gemma import convert_recurrent_gemma
from attnzoo.models.families.smollm3 import convert_smollm3
from attnzoo.models.families.zamba2 import convert_zamba2
from attnzoo.models.families.zaya import convert_zaya
from attnzoo.models.hf._state import HFConfig
from attnzoo.models.hf.bert import convert_bert
from attnzoo.models.hf.deepseek import convert_deepseek
from attnzoo.models.hf.gpt2 import convert_gpt2
from attnzoo.models.hf.llama import FAMILIES, convert_llama
from attnzoo.models.hf.safetensors import load_state_dict_from_folder, read_json
from attnzoo.models.hf.vit import convert_vit

__all__ = ["MODEL_TYPES", "SUPPORTED_ARCHITECTURES", "from_hf", "load_bert", "load_pretrained", "read_config"]

SUPPORTED_ARCHITECTURES = ("BertModel", "BertFor*", "GPT2LMHeadModel", "GPT2Model", "LlamaForCausalLM",
                           "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
                           "Gemma2ForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM", "*Model",
                           "*ForSequenceClassification", "ViTModel", "ViTForImageClassification",
                           "DeepseekV3ForCausalLM", "Gemma3ForCausalLM", "Gemma3TextModel", "SmolLM3ForCausalLM",
                           "Olmo3ForCausalLM", "GptOssForCausalLM", "Llama4ForCausalLM",
                           "Llama4TextModel", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM",
                           "OlmoHybridForCausalLM", "KimiLinearForCausalLM", "KimiLinearModel",
                           "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextModel", "BambaForCausalLM", "BambaModel",
                           "GraniteMoeHybridForCausalLM", "GraniteMoeHybridModel", "Mamba2ForCausalLM",
                           "Mamba2Model", "NemotronHForCausalLM", "NemotronHModel",
                           "FalconH1ForCausalLM", "FalconH1Model",
                           "Lfm2ForCausalLM", "Lfm2Model", "MambaForCausalLM", "MambaModel",
                           "FalconMambaForCausalLM", "FalconMambaModel", "Lfm2MoeForCausalLM", "Lfm2MoeModel",
                           "JambaForCausalLM", "JambaModel", "Lfm3ForCausalLM", "Lfm3Model",
                           "LaraMiniForCausalLM", "LaraMiniModel", "GraniteMoeSWAForCausalLM", "GraniteMoeSWAModel",
                           "BailingHybridForCausalLM", "BailingHybridModel", "Glm5NextTextModel",
                           "Glm5NextForConditionalGeneration", "MiniMaxForCausalLM", "MiniMaxModel",
                           "Qwen4ExpForCausalLM", "Qwen4ExpTextModel", "Zamba2ForCausalLM", "Zamba2Model",
                           "RecurrentGemmaForCausalLM", "RecurrentGemmaModel",
                           "ZayaForCausalLM", "ZayaModel",
                           "InklingForCausalLM", "InklingTextModel",
                           "Inkling2ForCausalLM", "Inkling2TextModel",
                           "Inkling2LoopForCausalLM", "Inkling2LoopTextModel",
                           "Gemma4ForCausalLM", "Gemma4TextModel",
                           "DeepseekV4ForCausalLM", "DeepseekV4Model",
                           *(c for family in (sparse_moe, dense) for _, classes in family.ARCHITECTURES.values()
                             for c in classes))
#: ``model_type`` -> (architecture name, converter) of the families built per layer in
#: :mod:`attnzoo.models.families` (each owns its weight map).
BUILDERS: dict[str, tuple[str, Callable[..., nn.Module]]] = {
    "gemma3_text": ("Gemma3", convert_gemma3), "smollm3": ("SmolLM3", convert_smollm3),
    "olmo3": ("OLMo3", convert_olmo3), "gpt_oss": ("gpt-oss", convert_gpt_oss),
    "llama4_text": ("Llama-4", convert_llama4), "qwen3_next": ("Qwen3-Next", convert_qwen3_next),
    "qwen3_5_text": ("Qwen3.5", convert_qwen3_5), "olmo_hybrid": ("OLMo-hybrid", convert_olmo_hybrid),
    "kimi_linear": ("Kimi Linear", convert_kimi_linear), "qwen3_5_moe_text": ("Qwen3.5-MoE", convert_qwen3_5_moe),
    "bamba": ("Bamba", convert_bamba), "granitemoehybrid": ("Granite 4.0-H", convert_granitemoehybrid),
    "mamba2": ("Mamba-2", convert_mamba2), "nemotron_h": ("Nemotron-H", convert_nemotron_h),
    "falcon_h1": ("Falcon-H1", convert_falcon_h1), "lfm2": ("LFM2", convert_lfm2),
    "mamba": ("Mamba", convert_mamba), "falcon_mamba": ("FalconMamba", convert_falcon_mamba),
    "lfm2_moe": ("LFM2-MoE", convert_lfm2_moe), "jamba": ("Jamba", convert_jamba),
    "lfm3": ("LFM3", convert_lfm3),
    "lara_mini": ("Lara-mini", convert_lara_mini),
    "granitemoe_swa": ("GraniteMoe-SWA", convert_granitemoe_swa),
    "bailing_hybrid": ("Bailing-hybrid", convert_bailing_hybrid),
    "qwen4_exp_text": ("Qwen4-Exp", convert_qwen4_exp),
    "glm5_next_text": ("GLM-5-Next", convert_glm5_next), "glm5_next": ("GLM-5-Next", convert_glm5_next),
    "minimax": ("MiniMax", convert_minimax),
    "zamba2": ("Zamba2", convert_zamba2),
    "recurrent_gemma": ("RecurrentGemma", convert_recurrent_gemma),
    "zaya": ("Zaya", convert_zaya),
    "inkling_text": ("Inkling", convert_inkling),
    "inkling2_text": ("Inkling2", convert_inkling2),
    "inkling2_loop_text": ("Inkling2-loop", convert_inkling2_loop),
    "gemma4_text": ("Gemma 4", convert_gemma4),
    "deepseek_v4": ("DeepSeek-V4", convert_deepseek_v4),
    **{t: (name, sparse_moe.convert_sparse_moe) for t, (name, _) in sparse_moe.ARCHITECTURES.items()},
    **{t: (name, dense.convert_dense) for t, (name, _) in dense.ARCHITECTURES.items()},
}
#: ``model_type`` of a config -> the architecture it loads as.
MODEL_TYPES = {"bert": "BERT", "gpt2": "GPT-2", "vit": "ViT", "deepseek_v3": "DeepSeek-V3",
               **{k: f.arch for k, f in FAMILIES.items()}, **{k: arch for k, (arch, _) in BUILDERS.items()}}


def _build(model_type: str, hf: HFConfig, sd: dict[str, Tensor], device: Any, dtype: Any,
           strict_prefix: bool = False) -> nn.Module:
    """``model_type``: a key of :data:`MODEL_TYPES`; the weights pick the head."""
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    if model_type == "bert":
        return convert_bert(hf, sd, strict_prefix=strict_prefix, **kw)
    if model_type in BUILDERS:
        return BUILDERS[model_type][1](hf, sd, **kw)
    if model_type == "deepseek_v3":
        return convert_deepseek(hf, sd, **kw)
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
    :class:`~attnzoo.VisionTransformer`. The result has the same weights, dtype and device
    (unless given) and the same train/eval mode.

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
