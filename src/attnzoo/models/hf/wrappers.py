"""The text decoder inside a multimodal wrapper (``Gemma3ForConditionalGeneration``,
``LlavaForConditionalGeneration``, ``Qwen3_5ForConditionalGeneration``, ...): one mechanism for every
wrapper of :data:`WRAPPERS`.

A wrapper's config holds its text model's config under ``text_config`` (a ``model_type`` attnzoo
converts) and its state dict holds that model under a prefix:

* transformers 5 ``*ForConditionalGeneration``: ``model.language_model.*`` + ``lm_head.weight``;
* saved checkpoints of the wrappers transformers' ``conversion_mapping`` renames as ``llava`` (Gemma 3,
  PaliGemma, Aya Vision, Mistral 3, LLaVA, ...: every release before transformers 5, and what
  transformers 5's ``save_pretrained`` still writes for them), and transformers 5's
  ``Llama4ForConditionalGeneration`` (its language model a ``Llama4ForCausalLM``):
  ``language_model.model.*`` + ``language_model.lm_head.weight``, towers at the top; a base
  ``*Model`` saved so (its ``architectures``) has no head;
* transformers 5 base ``*Model`` (no head): ``language_model.*``.

:func:`text_part` reads such a checkpoint as the text model's own: the text config (the wrapper's
``tie_word_embeddings``, which decides whether its ``lm_head`` is tied, and what the wrapper's head
does differently, :attr:`Wrapper.overrides`) and the language model's keys as ``model.*`` /
``lm_head.weight`` (or the base model's), every other tensor (vision / audio towers, projectors,
multimodal embedders, multi-token-prediction layers, and the language model's own tensors that never act on
text: ERNIE-4.5-VL's vision experts, :attr:`Wrapper.inner`) dropped: :func:`warn_dropped` names them.
The text model's own converter then builds the decoder, so ``from_hf``, ``load_pretrained`` and the
inverse (``to_hf`` / ``save_pretrained(like=)``, which probe the converter) all go through here.

The converted model is the wrapper on text-only input: ids that are not multimodal placeholders
(image / video / audio soft tokens), no ``pixel_values``, no ``token_type_ids`` marking an image
prefix (PaliGemma and Gemma 3 then attend bidirectionally over it). What each wrapper's forward
changes for text is in its row: Gemma 3's head drops the text model's ``final_logit_softcapping``,
Cohere2-Vision's drops ``logit_scale``; Qwen3.5's multimodal RoPE is the 1-D rotation when its three
position streams are equal (text), PaliGemma's 1-based positions change nothing under RoPE.
"""

from __future__ import annotations

import collections
import functools
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from attnzoo.models.hf._state import HFConfig
from attnzoo.models.hf.errors import CheckpointFormatError

__all__ = ["WRAPPERS", "Wrapper", "dropped", "text_part", "warn_dropped"]


@dataclass(frozen=True)
class Wrapper:
    """A multimodal wrapper whose text decoder attnzoo converts.

    Args:
        name: for messages and ``MODEL_TYPES``.
        classes: the transformers classes (``*ForConditionalGeneration``, the base ``*Model``).
        text_types: the text ``model_type`` s verified inside it; the first is the wrapper config
            class's default (a ``text_config`` without ``model_type``).
        tie: the ``tie_word_embeddings`` default of the config that ties the ``lm_head`` (see ``tie_from``).
        tie_keys: the wrapper config's keys for it, the first set wins (LFM2-VL's ``tie_embedding``).
        tie_from: whose ``tie_word_embeddings`` ties the head: ``"wrapper"`` (the wrapper config's, not
            the text config's: most), ``"either"`` (an untied wrapper ties when its text config does,
            ``tie`` where that has none: ``LlavaConfig``), ``"text"`` (the language model is a ``*ForCausalLM`` of the text config:
            Llama 4).
        overrides: text config keys set to what the wrapper computes on text (Gemma 3's head applies
            no final softcap, Cohere2-Vision's no ``logit_scale``; PaliGemma's mask is causal without
            ``token_type_ids`` whatever its text config's ``use_bidirectional_attention``).
        language_model: the name of the language model module in the wrapper.
        saved: ``(pattern, replacement)`` regular expressions renaming a released or saved
            checkpoint's keys to the layouts above, as transformers' ``conversion_mapping`` reads
            them (Ovis2.5's ``llm.*``).
        flat: a released ``config.json`` may hold the text model's keys at its top level, without
            ``text_config`` (Qwen2-VL, Qwen2.5-VL; the config class reads them so).
        inner: the language model's own tensors that never act on text, dropped and named with the
            towers: ``(text config, text-model key) -> a name for the warning``, ``None`` for a key kept
            (ERNIE-4.5-VL's vision experts).
    """

    name: str
    classes: tuple[str, ...]
    text_types: tuple[str, ...]
    tie: bool
    tie_keys: tuple[str, ...] = ("tie_word_embeddings",)
    tie_from: str = "wrapper"
    overrides: Mapping[str, Any] = field(default_factory=dict)
    language_model: str = "language_model"
    saved: tuple[tuple[str, str], ...] = ()
    flat: bool = False
    inner: Callable[[HFConfig, str], str | None] | None = None


def _row(name: str, cls: str, text_types: tuple[str, ...], tie: bool, **kw: Any) -> Wrapper:
    """``cls``: the classes' stem (``Gemma3`` -> ``Gemma3ForConditionalGeneration``, ``Gemma3Model``)."""
    return Wrapper(name, (f"{cls}ForConditionalGeneration", f"{cls}Model"), text_types, tie, **kw)


def _ernie_vl_vision_experts(text: HFConfig, key: str) -> str | None:
    """ERNIE-4.5-VL's vision experts, which transformers runs on image / video tokens only: its
    ``mlp.vision_moe.*``, the released layout's ``mlp.gate.weight_1`` and experts from
    ``moe_num_experts`` on (the vision row of ``mlp.moe_statics`` goes with the text row's tensor)."""
    found = _ERNIE_VL_VISION.search(key)
    if found is None or (found[2] is not None and int(found[2]) < text.get("moe_num_experts", 64)):
        return None
    return "vision experts: layers.*.mlp"


#: ERNIE-4.5-VL's vision experts' keys (an expert's index: group 2)
_ERNIE_VL_VISION = re.compile(r"\.mlp\.(vision_moe\.|gate\.weight_1$|experts\.(\d+)\.)")
#: Qwen2-VL's released layout: the text model at ``model.*`` beside the tower at ``visual.*``
_QWEN_VL = ((r"^model\.(?!language_model\.|visual\.)", "model.language_model."),)
#: Cosmos3-Edge's released layout (``conversion_mapping.py`` "cosmos3_edge"): the text model at the top
#: (``layers.*``, ``embed_tokens``, ``norm``) with ``self_attn.to_{q,k,v,out}`` and ``mlp.{up,down}_proj``;
#: its generator tensors (what transformers' ``_keys_to_ignore_on_load_unexpected`` names) moved out of the
#: language model first, so they are dropped with the towers
_COSMOS3_EDGE_GENERATOR = (r"action_modality_embed$|action_proj_(?:in|out)\.|time_embedder\.|proj_(?:in|out)\.|"
                           r"norm_moe_gen\.|layers\.\d+\.(?:input_layernorm_moe_gen|post_attention_layernorm_moe_gen|"
                           r"mlp_moe_gen|self_attn\.(?:add_[qkv]_proj|to_add_out|norm_added_[qk]|k_norm_und_for_gen))\.")
_COSMOS3_EDGE = ((rf"^(?:model\.language_model\.)?(?=(?:{_COSMOS3_EDGE_GENERATOR}))", "generator."),
                 (r"^(embed_tokens|norm|layers)\.", r"model.language_model.\1."),
                 (r"\.self_attn\.to_([qkv])\.", r".self_attn.\1_proj."), (r"\.self_attn\.to_out\.", ".self_attn.o_proj."),
                 (r"\.mlp\.up_proj\.", ".mlp.fc1."), (r"\.mlp\.down_proj\.", ".mlp.fc2."))
#: Tencent's released VL layout: the text model at ``model.*``, the tower at ``vit.*`` (the ``hunyuan_vl`` /
#: ``hy_v4_vl`` entries of transformers' ``conversion_mapping``)
_HUNYUAN_VL = ((r"^model\.(?!language_model\.|vit\.|vision_tower\.)", "model.language_model."),)
#: Mistral-Large-4's saved / released top-level names (``tok_embeddings``, ``lerope.alpha``, ``layers``,
#: ``norm``, ``output``, the towers') -> transformers' (the layers' own names are the family's:
#: :func:`attnzoo.models.families.mistral_large4.module_names`)
_MISTRAL_LARGE4 = (
    (r"^vision_encoder\.", "model.vision_tower."), (r"^(pre_mm_projector_norm|patch_merger|vision_language_adapter)\.",
                                                    r"model.multi_modal_projector.\1."),
    (r"^tok_embeddings\.", "model.language_model.embed_tokens."),
    (r"^lerope\.alpha$", "model.language_model.rotary_emb.alpha"), (r"^(layers|norm)\.", r"model.language_model.\1."),
    (r"^output\.", "lm_head."))
#: wrapper ``model_type`` -> its row; see ``tests/models/test_hf_multimodal.py`` for each one's check
WRAPPERS: dict[str, Wrapper] = {
    "gemma3": _row("Gemma 3 (multimodal)", "Gemma3", ("gemma3_text",), True, overrides={"final_logit_softcapping": None}),
    "gemma3n": _row("Gemma 3n (multimodal)", "Gemma3n", ("gemma3n_text",), True),
    "gemma4": _row("Gemma 4 (multimodal)", "Gemma4", ("gemma4_text",), True),
    "gemma4_unified": _row("Gemma 4 unified (multimodal)", "Gemma4Unified", ("gemma4_unified_text",), True),
    "llama4": Wrapper("Llama 4 (multimodal)", ("Llama4ForConditionalGeneration",), ("llama4_text",), False,
                      tie_from="text"),
    "mistral3": _row("Mistral 3 (multimodal)", "Mistral3", ("mistral", "ministral3"), True),
    # the released checkpoints' MTP layer (mtp.* at the top) kept with the text model, which loads it
    "qwen3_5": _row("Qwen3.5 (multimodal)", "Qwen3_5", ("qwen3_5_text",), False,
                    saved=((r"^mtp\.", "model.language_model.mtp."),)),
    "qwen3_5_moe": _row("Qwen3.5-MoE (multimodal)", "Qwen3_5Moe", ("qwen3_5_moe_text",), False,
                        saved=((r"^mtp\.", "model.language_model.mtp."),)),
    # released: the text model at model.* and the tower at visual.* (transformers' older layout); Qwen2-VL's
    # and Qwen2.5-VL's configs also tie through their text_config (transformers' pre-v5 saves)
    "qwen2_vl": _row("Qwen2-VL", "Qwen2VL", ("qwen2_vl_text",), False, saved=_QWEN_VL, flat=True,
                   tie_from="either"),
    "qwen2_5_vl": _row("Qwen2.5-VL", "Qwen2_5_VL", ("qwen2_5_vl_text",), False, saved=_QWEN_VL, flat=True,
                   tie_from="either"),
    "qwen3_vl": _row("Qwen3-VL", "Qwen3VL", ("qwen3_vl_text",), False, saved=_QWEN_VL),
    "qwen3_vl_moe": _row("Qwen3-VL-MoE", "Qwen3VLMoe", ("qwen3_vl_moe_text",), False, saved=_QWEN_VL),
    "glm4v": _row("GLM-4.1V", "Glm4v", ("glm4v_text",), False, tie_from="either"),
    # released: the text model at model.* beside visual.* and the projector mlp_AR.*
    "paddleocr_vl": _row("PaddleOCR-VL", "PaddleOCRVL", ("paddleocr_vl_text",), True, tie_from="either",
                         saved=((r"^model\.(?!language_model\.|visual\.|projector\.)", "model.language_model."),)),
    "glm4v_moe": _row("GLM-4.5V", "Glm4vMoe", ("glm4v_moe_text",), False, tie_from="either"),
    "glm46v": _row("GLM-4.6V", "Glm46V", ("glm4v_text",), False),
    "glmga": _row("GLM-GA", "Glm46V", ("glm4v_text",), False),
    "glm_ocr": _row("GLM-OCR", "GlmOcr", ("glm_ocr_text",), False, tie_from="either"),
    "granite4_vision": _row("Granite-4-Vision", "Granite4Vision", ("granite4_vision_text",), False),
    # released (and what transformers writes): the text model at model.* beside the tower at vit.*; released flat
    # (HunyuanOCR: the text keys at the top of its config.json)
    "hunyuan_vl": _row("HunYuan-VL", "HunYuanVL", ("hunyuan_vl_text",), True, tie_from="either", flat=True,
                       saved=_HUNYUAN_VL),
    "muse_glimmer": _row("Muse Glimmer", "MuseGlimmer", ("muse_glimmer_text",), False),
    "muse_spark": _row("Muse Spark", "MuseSpark", ("muse_spark_text",), False),
    # its language model is model.text_model (released before transformers 5: text_model.model.* and
    # text_model.lm_head, the layout the machinery reads for every wrapper)
    "emu3": _row("Emu3", "Emu3", ("emu3_text_model",), False, language_model="text_model"),
    "qwen4_exp": _row("Qwen4-Exp (multimodal)", "Qwen4Exp", ("qwen4_exp_text",), False),
    "lfm2_vl": _row("LFM2-VL", "Lfm2Vl", ("lfm2",), True, tie_keys=("tie_embedding", "tie_word_embeddings")),
    "llava": _row("LLaVA", "Llava", ("llama", "qwen2"), False, tie_from="either"),
    "paligemma": _row("PaliGemma", "PaliGemma", ("gemma", "gemma2"), True,
                      overrides={"use_bidirectional_attention": False}),
    "aya_vision": _row("Aya Vision", "AyaVision", ("cohere2",), True),
    "cohere2_vision": _row("Cohere2-Vision", "Cohere2Vision", ("cohere2",), True, overrides={"logit_scale": 1.0}),
    "llava_next": _row("LLaVA-NeXT", "LlavaNext", ("llama", "mistral", "qwen2"), False),
    "llava_next_video": _row("LLaVA-NeXT-Video", "LlavaNextVideo", ("llama",), False, tie_from="either"),
    "llava_onevision": _row("LLaVA-OneVision", "LlavaOnevision", ("qwen2",), False, tie_from="either"),
    "vipllava": _row("VipLLaVA", "VipLlava", ("llama",), False),
    "video_llava": _row("Video-LLaVA", "VideoLlava", ("llama",), False),
    "internvl": _row("InternVL", "InternVL", ("qwen2", "qwen3"), True),
    "got_ocr2": _row("GOT-OCR2", "GotOcr2", ("qwen2",), True),
    "pp_chart2table": _row("PP-Chart2Table", "GotOcr2", ("qwen2",), True),
    "ovis2": _row("Ovis2", "Ovis2", ("qwen2",), True),
    "ovis2_5": _row("Ovis2.5", "Ovis2_5", ("qwen3",), False, saved=((r"^llm\.", "language_model."),)),
    "lighton_ocr": _row("LightOnOCR", "LightOnOcr", ("qwen3",), True),
    "qianfan_ocr": _row("Qianfan-OCR", "QianfanOCR", ("qwen3",), False,  # transformers 5 saves encoder.layers
                        saved=((r"^((model\.)?language_model\.(model\.)?)encoder\.layers\.", r"\1layers."),)),
    "deepseek_vl": _row("DeepSeek-VL", "DeepseekVL", ("llama",), True),
    "deepseek_vl_hybrid": _row("DeepSeek-VL hybrid", "DeepseekVLHybrid", ("llama",), True),
    "janus": _row("Janus", "Janus", ("llama",), True),
    "video_llama_3": _row("VideoLLaMA3", "VideoLlama3", ("qwen2",), False, tie_from="either"),
    "exaone4_5": Wrapper("EXAONE 4.5", ("Exaone4_5_ForConditionalGeneration", "Exaone4_5_Model"), ("exaone4",), False),
    "kimi_k25": Wrapper("Kimi K2.5", ("Kimi_K25ForConditionalGeneration", "Kimi_K25Model"), ("deepseek_v3",), True),
    "lfm3_vl": _row("LFM3-VL", "Lfm3Vl", ("lfm3",), True),
    "minicpm_ocr": _row("MiniCPM-OCR", "MiniCPMOcr", ("qwen3_5_text",), True),
    "minicpmv4_6": _row("MiniCPM-V 4.6", "MiniCPMV4_6", ("qwen3_5_text",), False),
    "minicpmv4_7": _row("MiniCPM-V 4.7", "MiniCPMV4_7", ("qwen3_5_text",), False),
    "cohere_compass": _row("Cohere Compass (multimodal)", "CohereCompass", ("cohere_compass_text",), False),
    "fuyu": Wrapper("Fuyu", ("FuyuForCausalLM", "FuyuModel"), ("persimmon",), False),
    "idefics2": _row("Idefics2", "Idefics2", ("mistral",), False, language_model="text_model"),
    "idefics3": _row("Idefics3", "Idefics3", ("llama",), False, language_model="text_model"),
    "smolvlm": _row("SmolVLM", "SmolVLM", ("llama",), False, language_model="text_model"),
    "llava_onevision1_5": _row("LLaVA-OneVision-1.5", "LlavaOnevision15", ("qwen3",), False,
                               saved=((r"^model\.model\.", "model.language_model."),)),
    "fast_vlm": _row("FastVLM", "FastVlm", ("qwen2",), False, tie_from="either"),
    "perception_lm": _row("PerceptionLM", "PerceptionLM", ("llama",), False, tie_from="unset"),
    "hyperclovax_vision_v2": _row("HyperCLOVA X Vision V2", "HyperCLOVAXVisionV2", ("hyperclovax",), True),
    "apertus1p5": _row("Apertus 1.5 (multimodal)", "Apertus1p5", ("apertus1p5_text",), False),
    "dots3_note": _row("dots.3-note (multimodal)", "Dots3Note", ("dots3_note_text",), False,  # text at model.*
                       saved=((r"^model\.(?!language_model\.|vision_tower\.|audio_tower\.)", "model.language_model."),)),
    "nemotron_h_omni": Wrapper("Nemotron-H Omni", ("NemotronH_Omni_Reasoning_V3",), ("nemotron_h",), False,
                               tie_from="text", saved=((r"^language_model\.backbone\.", "language_model.model."),)),
    # the checkpoints' own names (model.llm.*: the text converter reads them) kept under the language model
    "inkling2": _row("Inkling2 (multimodal)", "Inkling2", ("inkling2_text",), False,
                     saved=((r"^model\.llm\.", "model.language_model.llm."),)),
    "inkling2_loop": _row("Inkling2-loop (multimodal)", "Inkling2Loop", ("inkling2_loop_text",), False,
                          saved=((r"^model\.llm\.", "model.language_model.llm."),)),
    # saved and released: the text model at the top (model.layers, ...), the towers outside model.*
    "step3p7": _row("Step-3.7-Flash", "Step3p7", ("step3p5",), False,
                    saved=((r"^model\.(?!language_model\.|vision_model\.|multi_modal_projector\.)",
                            "model.language_model."),)),
    "shieldgemma2": Wrapper("ShieldGemma 2", ("Gemma3ForConditionalGeneration",), ("gemma3_text",), True,
                            tie_from="either", overrides={"final_logit_softcapping": None}),
    # saved and released: the text model at model.* beside the tower and the resampler (a base *Model's at the
    # top: embed_tokens, layers, norm); its vision experts dropped
    "ernie4_5_vl_moe": _row("ERNIE-4.5-VL", "Ernie4_5_VLMoe", ("ernie4_5_vl_moe_text",), True,
                            saved=((r"^model\.(?!language_model\.|vision_tower\.|vision_model\.|resampler_model\.)",
                                    "model.language_model."), (r"^(embed_tokens|layers|norm)\.", r"language_model.\1.")),
                            inner=_ernie_vl_vision_experts),
    # its head is never tied (the class ties no weights, whatever tie_word_embeddings says): no tie key
    "cosmos3_edge": _row("Cosmos3-Edge", "Cosmos3Edge", ("cosmos3_edge_text",), False, saved=_COSMOS3_EDGE,
                         tie_keys=()),
    # its head (vocab_size rows, the embedding has additional_vocab_size more) is never tied: no tie key
    # released and saved by transformers 5: the text model at (model.)transformer.* (blocks.*, ln_f, wte) under
    # its own names, which the text converter reads (``dense._molmo2_names``)
    "molmo2": _row("Molmo2", "Molmo2", ("molmo2_text",), False, tie_keys=(),
                   saved=((r"^(model\.)?transformer\.blocks\.", r"\1language_model.layers."),
                          (r"^(model\.)?transformer\.", r"\1language_model."))),
    # released and saved (conversion_mapping's renames reversed): the text model at model.{embed_tokens,layers,norm}
    # beside model.sam_model / qwen2_model / projector; the base model's at the top
    "deepseek_ocr2": _row("DeepSeek-OCR2", "DeepseekOcr2", ("deepseek_ocr2_text",), False,
                          saved=((r"^model\.(embed_tokens|layers|norm)\.", r"model.language_model.\1."),
                                 (r"^(embed_tokens|layers|norm)\.", r"language_model.\1."))),
    # the released MTP layers (model.mtp_layers.*) are dropped by the text converter, as transformers ignores them
    "hy_v4_vl": _row("HY-V4-VL", "HYV4VL", ("hy_v4_vl_text",), False, saved=_HUNYUAN_VL),
    # saved and released: Mistral's own names (conversion_mapping "mistral_large4" + "mistral_large4_text")
    "mistral_large4": _row("Mistral-Large-4 (multimodal)", "MistralLarge4", ("mistral_large4_text",), False,
                           saved=_MISTRAL_LARGE4),
}


def _base(w: Wrapper, hf: HFConfig) -> bool:
    """A base ``*Model`` checkpoint (no head): its config's ``architectures`` name only that class."""
    names = hf.get("architectures", [], list)
    return bool(names) and all(n in w.classes and n.endswith("Model") for n in names)


def _layout(w: Wrapper, sd: Mapping[str, Tensor], hf: HFConfig) -> tuple[tuple[str, str], ...]:
    """``((wrapper prefix, text-model prefix), ...)`` of the state dict's layout."""
    lm = w.language_model
    if any(k.startswith(f"model.{lm}.") for k in sd):  # transformers 5 *ForConditionalGeneration
        return (f"model.{lm}.", "model."), ("lm_head.", "lm_head.")
    if any(k.startswith((f"{lm}.model.", f"{lm}.lm_head.")) for k in sd):  # saved (transformers 5 saves it so too)
        return (f"{lm}.model.", "" if _base(w, hf) else "model."), (f"{lm}.lm_head.", "lm_head.")
    if any(k.startswith(f"{lm}.") for k in sd):  # transformers 5 base *Model: no head
        return ((f"{lm}.", ""),)
    raise CheckpointFormatError(f"{hf.source}: no language model in the {w.name} checkpoint (no key under "
                                f"'model.{lm}.', '{lm}.model.' or '{lm}.')")


def _rekey(w: Wrapper, sd: Mapping[str, Tensor], hf: HFConfig,
           text: HFConfig) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``(the text model's state dict, the wrapper's keys dropped -> the module named for them)``
    (the same tensors; ``text``: the text config, for :attr:`Wrapper.inner`)."""
    renamed = {functools.reduce(lambda k, r: re.sub(r[0], r[1], k), w.saved, key): key for key in sd}
    layout = _layout(w, renamed, hf)
    out: dict[str, Tensor] = {}
    rest: dict[str, str] = {}
    for key, original in renamed.items():
        theirs = next(((p, q) for p, q in layout if key.startswith(p)), None)
        mine = None if theirs is None else theirs[1] + key[len(theirs[0]):]
        inner = None if mine is None or w.inner is None else w.inner(text, mine)
        if mine is None or inner is not None:
            rest[original] = inner or ".".join(original.split(".")[:2])
        else:
            out[mine] = sd[original]
    return out, rest


def _tied(w: Wrapper, hf: HFConfig, text: Mapping[str, Any]) -> bool:
    """Whether the wrapper's ``lm_head`` is its embedding (:attr:`Wrapper.tie_from`)."""
    by_text = w.tie if text.get("tie_word_embeddings") is None else bool(text["tie_word_embeddings"])
    by_wrapper = next((hf.get(k, None, bool) for k in w.tie_keys if hf.has(k)), None)
    if w.tie_from == "text" or (w.tie_from == "unset" and by_wrapper is None):
        return by_text
    tie = w.tie if by_wrapper is None else by_wrapper
    return tie or (w.tie_from == "either" and by_text)


def _text_config(model_type: str, w: Wrapper, hf: HFConfig) -> HFConfig:
    """The text model's config as its converter reads it (see :class:`Wrapper`)."""
    if w.flat and not hf.has("text_config"):  # the released flat form: the text keys beside vision_config
        text = {k: v for k, v in hf.data.items() if k not in ("vision_config", "model_type")}
    else:
        text = dict(hf.req("text_config", dict))
    text_type = text.get("model_type") or w.text_types[0]
    if text_type not in w.text_types:
        raise hf.unsupported(f"a {text_type!r} text model in {model_type} (the text models verified in it: "
                             f"{list(w.text_types)})")
    tie = _tied(w, hf, text)
    for key in ("architectures", "tie_embedding"):  # the head follows the weights; the tie is the wrapper's
        text.pop(key, None)
    text.update(model_type=text_type, tie_word_embeddings=tie, **w.overrides)
    return HFConfig(text, f"{hf.source} (text_config)", hf.arch)


def text_part(model_type: str, hf: HFConfig, sd: Mapping[str, Tensor]) -> tuple[str, HFConfig, dict[str, Tensor]]:
    """``(text model_type, text config, text state dict)`` of a wrapper checkpoint (``model_type`` a
    key of :data:`WRAPPERS`; see the module docstring). ``sd`` is left as it is.

    Raises:
        UnsupportedConfigError: a text model not verified in this wrapper.
        CheckpointFormatError: no ``text_config``, or no language model in ``sd``.
    """
    w = WRAPPERS[model_type]
    text = _text_config(model_type, w, hf)
    out, _ = _rekey(w, sd, hf, text)
    return str(text.raw("model_type")), text, out


def dropped(model_type: str, hf: HFConfig, sd: Mapping[str, Tensor]) -> list[str]:
    """The keys of a wrapper checkpoint the text decoder has no use for (towers, projectors, ...)."""
    return list(_groups(model_type, hf, sd))


def _groups(model_type: str, hf: HFConfig, sd: Mapping[str, Tensor]) -> dict[str, str]:
    """The dropped keys -> the module the warning names them by."""
    w = WRAPPERS[model_type]
    return _rekey(w, sd, hf, _text_config(model_type, w, hf))[1]


def warn_dropped(what: str, model_type: str, hf: HFConfig, sd: Mapping[str, Tensor]) -> None:
    """Warn, naming them by module (``model.vision_tower``: 12 tensors), of the tensors :func:`text_part` drops."""
    rest = _groups(model_type, hf, sd)
    if rest:
        groups = collections.Counter(rest.values())
        listed = ", ".join(f"{g}.* ({n})" for g, n in groups.items())
        warnings.warn(f"{what}: the text decoder of {WRAPPERS[model_type].name} is converted; {len(rest)} tensors of "
                      f"the other modules have no attnzoo counterpart and are dropped: {listed}", stacklevel=3)
