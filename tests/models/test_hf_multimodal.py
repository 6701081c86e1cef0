"""The text decoder of a multimodal wrapper (``models/hf/wrappers.py``): ``from_hf`` /
``load_pretrained`` / ``to_hf`` of ``*ForConditionalGeneration`` and the base ``*Model`` against
transformers' eager wrapper on text-only input, tiny random configs (the vision tower as small as its
config allows; Gemma 3n's timm tower, which needs ``timm`` and has no tiny config, a one-layer stub:
its weights are dropped either way), every weight perturbed.

Per case: the logits at the real tokens of a left-padded batch and the base model's hidden states,
greedy generation (batch 1 and a left-padded batch 2) token-identical, a ``save_pretrained`` folder
through ``load_pretrained`` (and the same tensors saved in the layout before transformers 5), and
``to_hf`` back into a wrapper of other weights. Then the text-config keys a wrapper's forward
replaces, the wrapper defaults a ``config.json`` may leave out, and the refusals."""

from __future__ import annotations

import functools
import importlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_hf_apertus1p5 as apertus1p5  # noqa: E402
import test_hf_cohere_compass as cohere_compass  # noqa: E402
import test_hf_cosmos3_edge as cosmos3_edge  # noqa: E402
import test_hf_deepseek as deepseek  # noqa: E402
import test_hf_deepseek_ocr2 as deepseek_ocr2  # noqa: E402
import test_hf_dense as dense  # noqa: E402
import test_hf_dense_2 as dense_2  # noqa: E402
import test_hf_dense_3 as dense_3  # noqa: E402
import test_hf_dots3 as dots3  # noqa: E402
import test_hf_ernie_vl as ernie_vl  # noqa: E402
import test_hf_families as lineage  # noqa: E402
import test_hf_gemma3 as gemma3  # noqa: E402
import test_hf_gemma3n as gemma3n  # noqa: E402
import test_hf_gemma4 as gemma4  # noqa: E402
import test_hf_gemma4_unified as gemma4_unified  # noqa: E402
import test_hf_glm_v as glm_v  # noqa: E402
import test_hf_inkling2 as inkling2  # noqa: E402
import test_hf_inkling2_loop as inkling2_loop  # noqa: E402
import test_hf_lfm2 as lfm2  # noqa: E402
import test_hf_lfm3 as lfm3  # noqa: E402
import test_hf_lineage_more as lineage_more  # noqa: E402
import test_hf_llama4 as llama4  # noqa: E402
import test_hf_mistral_large4 as large4  # noqa: E402
import test_hf_molmo2 as molmo2  # noqa: E402
import test_hf_muse as muse  # noqa: E402
import test_hf_nemotron_h as nemotron_h  # noqa: E402
import test_hf_neox as neox  # noqa: E402
import test_hf_qwen3_5 as qwen3_5  # noqa: E402
import test_hf_qwen3_5_moe as qwen3_5_moe  # noqa: E402
import test_hf_qwen4_exp as qwen4_exp  # noqa: E402
import test_hf_qwen_vl as qwen_vl  # noqa: E402
import test_hf_step3p7 as step3p7  # noqa: E402
import test_hf_tencent_vl as tencent_vl  # noqa: E402
from huggingface_hub.errors import StrictDataclassError  # noqa: E402

import attnzoo.models.hf.wrappers as wrappers  # noqa: E402
import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import (  # noqa: E402
    MODEL_TYPES,
    CheckpointFormatError,
    UnsupportedConfigError,
    from_hf,
    load_pretrained,
    to_hf,
)
from attnzoo.models.hf._state import HFConfig  # noqa: E402
from attnzoo.models.hf.wrappers import WRAPPERS  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

#: a one-layer vision tower (SigLIP / CLIP / Pixtral sizes)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
              patch_size=8)
#: a one-block Qwen-VL vision tower
QWEN_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, num_position_embeddings=16,
                   out_hidden_size=checks.SMALL["hidden_size"])


def _siglip() -> Any:
    return T.SiglipVisionConfig(**VISION)


def _gemma3() -> Any:
    """The text model's final softcap 5, which ``Gemma3ForConditionalGeneration``'s head does not apply."""
    return T.Gemma3Config(text_config=gemma3._config(final_logit_softcapping=5.0), vision_config=_siglip(),
                          mm_tokens_per_image=1)


def _gemma3n() -> Any:
    """A one-block audio tower; the vision tower a stub (:func:`_hf`)."""
    audio = T.Gemma3nAudioConfig(hidden_size=16, input_feat_size=8, conf_num_attention_heads=2, conf_num_hidden_layers=1,
                                 sscp_conv_channel_size=[4, 4])
    vision = T.Gemma3nVisionConfig(hidden_size=16)
    return T.Gemma3nConfig(text_config=gemma3n._config(), vision_config=vision, audio_config=audio)


def _gemma4() -> Any:
    vision = T.Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=16)
    return T.Gemma4Config(text_config=gemma4._config(), vision_config=vision, audio_config=None)


def _gemma4_unified() -> Any:
    return T.Gemma4UnifiedConfig(text_config=gemma4_unified._shared())


def _llama4() -> Any:
    """Tied by its text config (the wrapper's says untied): the language model is a ``Llama4ForCausalLM``."""
    vision = T.Llama4VisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                  vision_output_dim=16, image_size=16, patch_size=8, projector_input_dim=16,
                                  projector_output_dim=16)
    return T.Llama4Config(text_config=llama4._config(tie_word_embeddings=True), vision_config=vision)


def _pixtral() -> Any:
    return T.PixtralVisionConfig(**VISION, head_dim=8)


def _mistral3() -> Any:
    """Mistral text (window 8) in the wrapper whose config ties by default where Mistral's does not."""
    return T.Mistral3Config(text_config=lineage.CONFIGS["mistral"](), vision_config=_pixtral())


def _mistral3_ministral3() -> Any:
    """Ministral 3 text (YaRN), untied (Mistral-Small-3.x / Ministral 3 releases)."""
    return T.Mistral3Config(text_config=dense._ministral3(), vision_config=_pixtral(), tie_word_embeddings=False)


def _qwen3_5() -> Any:
    return T.Qwen3_5Config(text_config=qwen3_5._config(), vision_config=dict(QWEN_VISION))


def _qwen3_5_moe() -> Any:
    return T.Qwen3_5MoeConfig(text_config=qwen3_5_moe._config(), vision_config=dict(QWEN_VISION))


def _qwen4_exp() -> Any:
    return T.Qwen4ExpConfig(text_config=qwen4_exp._config(), vision_config=dict(QWEN_VISION))


def _lfm2_vl() -> Any:
    vision = T.Siglip2VisionConfig(**{k: v for k, v in VISION.items() if k != "image_size"}, num_patches=4)
    return T.Lfm2VlConfig(text_config=lfm2._config(), vision_config=vision)


def _llava() -> Any:
    return T.LlavaConfig(text_config=lineage.CONFIGS["llama"](), vision_config=T.CLIPVisionConfig(**VISION))


def _llava_qwen2() -> Any:
    """Qwen2 text (a window on the layers past ``max_window_layers``), tied through the text config."""
    text = lineage.CONFIGS["qwen2"]()
    text.tie_word_embeddings = True
    return T.LlavaConfig(text_config=text, vision_config=T.CLIPVisionConfig(**VISION))


def _paligemma() -> Any:
    return T.PaliGemmaConfig(text_config=lineage.CONFIGS["gemma"](), vision_config=_siglip())


def _paligemma2() -> Any:
    """PaliGemma 2: Gemma 2 text (attention and final softcaps, window 8)."""
    return T.PaliGemmaConfig(text_config=lineage.CONFIGS["gemma2"](), vision_config=_siglip())


def _aya_vision() -> Any:
    """Cohere2 text with logit_scale 0.3, which Aya Vision's head applies."""
    return T.AyaVisionConfig(text_config=dense._cohere2(), vision_config=_siglip())


def _cohere2_vision() -> Any:
    """Cohere2 text with logit_scale 0.3, which Cohere2-Vision's head does not apply."""
    return T.Cohere2VisionConfig(text_config=dense._cohere2(), vision_config=_siglip())


#: the sizes of a one-layer tower: every int of these names in a sub-config other than ``text_config``
TOWER = dict(VISION, depth=1, num_heads=2, num_key_value_heads=2, head_dim=8, out_hidden_size=checks.SMALL["hidden_size"],
             num_position_embeddings=16, projection_dim=16, vision_output_dim=16, projector_input_dim=16,
             projector_output_dim=16, num_layers=1, embed_dim=16, encoder_hidden_size=16, layers=1, width=16)


def _shrunk(config: Any) -> Any:
    """``config`` with every sub-config but ``text_config`` cut to :data:`TOWER`'s sizes (in place)."""
    for key, value in vars(config).items():
        if hasattr(value, "to_dict") and key != "text_config":
            _shrunk(value)
        elif key in TOWER and isinstance(value, int) and not isinstance(value, bool):
            setattr(config, key, TOWER[key])
    if isinstance(getattr(config, "layer_types", None), list) and hasattr(config, "num_hidden_layers") \
            and not hasattr(config, "vocab_size"):
        config.layer_types = config.layer_types[:config.num_hidden_layers]
    return config


def _tiny(model_type: str, text: Any, **kw: Any) -> Any:
    """The wrapper ``model_type``'s config (its class's defaults) around ``text``, the towers cut small."""
    return _shrunk(T.AutoConfig.for_model(model_type, text_config=text.to_dict(), **kw))


def _llama() -> Any:
    return lineage.CONFIGS["llama"]()


def _qwen2() -> Any:
    return lineage.CONFIGS["qwen2"]()


def _qwen3() -> Any:
    return lineage.CONFIGS["qwen3"]()


def _granite4_vision() -> Any:
    """Granite-4-Vision: Granite's text model with every multiplier away from 1 (its head divides by
    ``logits_scaling``)."""
    text = T.Granite4VisionTextConfig(**{**lineage_more._granite().to_dict(), "model_type": "granite4_vision_text"})
    # its Q-Former projector has vision hidden_size // 64 heads, and needs a deepstack map to be built at all
    vision = {**VISION, "model_type": "clip_vision_model", "hidden_size": 64}
    return T.Granite4VisionConfig(text_config=text.to_dict(), vision_config=vision, deepstack_layer_map=[[-1, 0]],
                                  downsample_rate="1/2", spatial_target_layers=[0, 1, 0, 1], image_seq_length=4,
                                  qformer_config={"intermediate_size": 32, "num_hidden_layers": 1})


def _hunyuan_vl(**rope: Any) -> Any:
    """HunYuan-VL: HunYuan-V1-Dense's text model (QK norms after RoPE) under a 4-axis multimodal RoPE
    (``rope`` added: the NTK-alpha one by default)."""
    text = dense_2._hunyuan(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "alpha": 50.0, "factor": 1.0,
                                             "mrope_section": [2, 2, 2, 2], **rope}).to_dict()
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "out_hidden_size": checks.SMALL["hidden_size"],
              "text_hidden_size": checks.SMALL["hidden_size"]}
    return T.HunYuanVLConfig(text_config={**text, "model_type": "hunyuan_vl_text"}, vision_config=vision)


def _emu3(**kw: Any) -> Any:
    """Emu3: LLaMA with q/k/v/o and MLP biases (``kw``: the text config's), its VQ-VAE cut small (32 channels:
    its GroupNorms take 32 groups)."""
    text = {**checks.SMALL, "num_hidden_layers": 2, "attention_bias": True, "mlp_bias": True, **kw}
    vq = {"embed_dim": 4, "base_channels": 32, "channel_multiplier": [1, 1], "num_res_blocks": 1,
          "attn_resolutions": [], "latent_channels": 4, "codebook_size": 16}
    return T.Emu3Config(text_config=text, vq_config=vq,
                        vocabulary_map={f"<|visual token {i:06d}|>": 100 + i for i in range(16)})


def _llava_next() -> Any:
    return _tiny("llava_next", _llama())


def _llava_next_mistral() -> Any:
    return _tiny("llava_next", lineage.CONFIGS["mistral"]())


def _llava_next_qwen2() -> Any:
    return _tiny("llava_next", _qwen2())


def _llava_next_video() -> Any:
    return _tiny("llava_next_video", _llama())


def _llava_onevision() -> Any:
    return _tiny("llava_onevision", _qwen2())


def _vipllava() -> Any:
    return _tiny("vipllava", _llama())


def _video_llava() -> Any:
    return _tiny("video_llava", _llama())


def _internvl() -> Any:
    return _tiny("internvl", _qwen2())


def _internvl_qwen3() -> Any:
    return _tiny("internvl", _qwen3())


def _got_ocr2() -> Any:
    return _tiny("got_ocr2", _qwen2())


def _pp_chart2table() -> Any:
    return _tiny("pp_chart2table", _qwen2())


def _ovis2() -> Any:
    return _tiny("ovis2", _qwen2())


def _ovis2_5() -> Any:
    return _tiny("ovis2_5", _qwen3())


def _lighton_ocr() -> Any:
    return _tiny("lighton_ocr", _qwen3())


def _qianfan_ocr() -> Any:
    return _tiny("qianfan_ocr", _qwen3())


def _deepseek_vl() -> Any:
    return _tiny("deepseek_vl", _llama())


def _deepseek_vl_hybrid() -> Any:
    return _tiny("deepseek_vl_hybrid", _llama())


def _janus() -> Any:
    return _tiny("janus", _llama())


def _video_llama_3() -> Any:
    return _tiny("video_llama_3", _qwen2())


def _exaone4_5() -> Any:
    return _tiny("exaone4_5", dense._exaone4())


def _kimi_k25() -> Any:
    return _tiny("kimi_k25", deepseek._v3())


def _lfm3_vl() -> Any:
    return _tiny("lfm3_vl", lfm3._config())


def _minicpm_ocr() -> Any:
    return _tiny("minicpm_ocr", qwen3_5._config())


def _minicpmv4_6() -> Any:
    return _tiny("minicpmv4_6", qwen3_5._config())


def _minicpmv4_7() -> Any:
    return _tiny("minicpmv4_7", qwen3_5._config())


def _cohere_compass() -> Any:
    return _tiny("cohere_compass", cohere_compass._config())


def _fuyu() -> Any:
    return _tiny("fuyu", neox._persimmon())


def _idefics2() -> Any:
    return _tiny("idefics2", lineage.CONFIGS["mistral"]())


def _idefics3() -> Any:
    return _tiny("idefics3", _llama())


def _smolvlm() -> Any:
    return _tiny("smolvlm", _llama())


def _shieldgemma2() -> Any:
    return _tiny("shieldgemma2", gemma3._config(final_logit_softcapping=5.0), mm_tokens_per_image=1)


def _llava_onevision1_5() -> Any:
    return _tiny("llava_onevision1_5", _qwen3(), vision_config={"out_hidden_size": checks.SMALL["hidden_size"]})


def _fast_vlm() -> Any:
    """The timm tower a stub (:func:`_hf`)."""
    return _tiny("fast_vlm", _qwen2())


def _perception_lm() -> Any:
    """The timm tower a stub (:func:`_hf`)."""
    return _tiny("perception_lm", _llama(), vision_config={"model_args": {"embed_dim": 16}})


def _hyperclovax_vision_v2() -> Any:
    """HyperCLOVA X text with its four multipliers (``logits_scaling`` in the wrapper's head too)."""
    return _tiny("hyperclovax_vision_v2", dense_3._hyperclovax())


def _apertus1p5() -> Any:
    """Image and audio codebooks of 8 at the top of the 128-token vocabulary (ids the text embedding reads)."""
    vision = {"codebook_size": 8, "embed_dim": 32, "latent_channels": 32, "base_channels": 32,
              "channel_multiplier": [1, 1], "num_res_blocks": 1, "attn_resolutions": [], "resolution": 16}
    audio = {"codebook_size": 8, "num_filters": 4, "upsampling_ratios": [2, 2], "hidden_size": 32, "codebook_dim": 32,
             "decoder_hidden_size": 32, "decoder_intermediate_size": 32, "decoder_num_layers": 1,
             "decoder_attention_num_groups": 4, "num_lstm_layers": 1}
    return _tiny("apertus1p5", apertus1p5._apertus1p5(), image_token_offset=112, audio_token_offset=120,
                 vision_config=vision, audio_config=audio)


def _dots3_note() -> Any:
    out = checks.SMALL["hidden_size"]
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "moe_intermediate_size": 16, "mlp_layer_types": ["dense"], "num_local_experts": 2, "adapter_in_dim": 16,
              "adapter_out_dim": out}
    audio = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 2, "head_dim": 8, "downsample_hidden_size": 8, "adapter_input_size": 16,
             "adapter_out_dim": out, "conv_output_size": 32}
    return _tiny("dots3_note", dots3._dots3(), vision_config=vision, audio_config=audio)


def _nemotron_h_omni() -> Any:
    return _tiny("nemotron_h_omni", nemotron_h._config())


def _inkling2() -> Any:
    return _tiny("inkling2", inkling2._config(), vision_config={"text_hidden_size": checks.SMALL["hidden_size"]})


def _inkling2_loop() -> Any:
    return _tiny("inkling2_loop", inkling2_loop._config(),
                 vision_config={"text_hidden_size": checks.SMALL["hidden_size"]})


#: case -> the wrapper config maker (no arguments); the case's wrapper ``model_type`` is its config's
CASES: dict[str, Callable[[], Any]] = {
    "gemma3": _gemma3, "gemma3n": _gemma3n, "gemma4": _gemma4, "gemma4_unified": _gemma4_unified, "llama4": _llama4,
    "mistral3": _mistral3, "mistral3_ministral3": _mistral3_ministral3, "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe, "qwen4_exp": _qwen4_exp, "lfm2_vl": _lfm2_vl, "llava": _llava,
    "llava_qwen2": _llava_qwen2, "paligemma": _paligemma, "paligemma2": _paligemma2, "aya_vision": _aya_vision,
    "cohere2_vision": _cohere2_vision, "llava_next": _llava_next, "llava_next_mistral": _llava_next_mistral,
    "llava_next_qwen2": _llava_next_qwen2, "llava_next_video": _llava_next_video, "llava_onevision": _llava_onevision,
    "vipllava": _vipllava, "video_llava": _video_llava, "internvl": _internvl, "internvl_qwen3": _internvl_qwen3,
    "got_ocr2": _got_ocr2, "pp_chart2table": _pp_chart2table, "ovis2": _ovis2, "ovis2_5": _ovis2_5,
    "lighton_ocr": _lighton_ocr, "qianfan_ocr": _qianfan_ocr, "deepseek_vl": _deepseek_vl,
    "deepseek_vl_hybrid": _deepseek_vl_hybrid, "janus": _janus, "video_llama_3": _video_llama_3,
    "exaone4_5": _exaone4_5, "kimi_k25": _kimi_k25, "lfm3_vl": _lfm3_vl, "minicpm_ocr": _minicpm_ocr,
    "minicpmv4_6": _minicpmv4_6, "minicpmv4_7": _minicpmv4_7, "cohere_compass": _cohere_compass, "fuyu": _fuyu,
    "idefics2": _idefics2, "idefics3": _idefics3, "smolvlm": _smolvlm, "shieldgemma2": _shieldgemma2,
    "llava_onevision1_5": _llava_onevision1_5, "fast_vlm": _fast_vlm, "perception_lm": _perception_lm,
    "hyperclovax_vision_v2": _hyperclovax_vision_v2, "apertus1p5": _apertus1p5, "dots3_note": _dots3_note,
    "nemotron_h_omni": _nemotron_h_omni, "inkling2": _inkling2, "inkling2_loop": _inkling2_loop,
    "step3p7": step3p7._step, "qwen2_vl": qwen_vl._qwen2_vl, "qwen2_5_vl": qwen_vl._qwen2_5_vl,
    "qwen3_vl": qwen_vl._qwen3_vl, "qwen3_vl_moe": qwen_vl._qwen3_vl_moe, "glm4v": glm_v._glm4v,
    "glm4v_moe": glm_v._glm4v_moe, "glm46v": glm_v._glm46v, "glmga": glm_v._glmga, "paddleocr_vl": qwen_vl._paddleocr_vl,
    "glm_ocr": glm_v._glm_ocr, "granite4_vision": _granite4_vision,
    "hunyuan_vl": _hunyuan_vl, "muse_glimmer": muse._glimmer, "muse_spark": muse._spark_case,
    "ernie4_5_vl_moe": ernie_vl._ernie_vl,
    "cosmos3_edge": cosmos3_edge._cosmos3_edge, "molmo2": molmo2._molmo2,
    "deepseek_ocr2": deepseek_ocr2._deepseek_ocr2,
    "hy_v4_vl": tencent_vl._hy_v4_vl,
    "mistral_large4": large4._large4,
    "emu3": _emu3,
}


class _Stub(torch.nn.Module):
    """A tower transformers builds with timm (Gemma 3n's MobileNet, FastVLM's FastViT, PerceptionLM's
    encoder): ``timm`` is not needed, the tower's weights are dropped either way."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, getattr(config, "hidden_size", None) or 16)


class _AutoWithStub:
    """``AutoModel`` for the modeling modules of :data:`STUBBED`: the stub for a timm config."""

    @staticmethod
    def from_config(config: Any, **kw: Any) -> Any:
        if config.model_type in ("gemma3n_vision", "timm_wrapper"):
            return _Stub(config)
        return T.AutoModel.from_config(config, **kw)


#: the modeling modules that build a timm tower
STUBBED = ("gemma3n", "fast_vlm", "perception_lm")


def _hf(case: str, seed: int = 0, base: bool = False) -> Any:
    """transformers' float32 eager wrapper of ``case`` (``base``: the ``*Model`` class), perturbed."""
    config = CASES[case]()
    auto = T.AutoModel if base else T.AutoModelForImageTextToText
    torch.manual_seed(seed)
    with pytest.MonkeyPatch.context() as mp:
        for name in STUBBED:
            mp.setattr(importlib.import_module(f"transformers.models.{name}.modeling_{name}"), "AutoModel",
                       _AutoWithStub)
        model = auto.from_config(config, attn_implementation="eager")
    return checks.perturbed(model, seed)


def _kinds(case: str) -> tuple[bool, ...]:
    """``(False, True)``: the ``*ForConditionalGeneration`` and the base ``*Model``, where transformers
    maps one to the config (not Llama 4, PP-Chart2Table, ShieldGemma 2)."""
    base = T.models.auto.modeling_auto.MODEL_MAPPING_NAMES.get(CASES[case]().model_type, "")
    return (False, True) if base.endswith("Model") else (False,)


def _convert(hf: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dropped towers (tested once below)
        return from_hf(hf)


#: wrappers whose plain forward counts the positions over the padding too, where their ``generate`` counts
#: them over the real tokens, as attnzoo does (HunYuan-VL: its QK norms after RoPE see absolute positions; Mistral-Large-4: its
#: log-position query scales):
#: given the positions ``generate`` gives
PADDED_POSITIONS = {"hunyuan_vl", "mistral_large4"}


def _logits(hf: Any, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    kw = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)} if hf.config.model_type in PADDED_POSITIONS else {}
    with torch.no_grad():
        out = hf(input_ids=x, attention_mask=mask, **kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _maker(case: str) -> Callable[[int], Any]:
    return lambda seed: _hf(case, seed)


#: the ``to_hf`` sweep of ``test_hf_export.py``: wrapper ``model_type`` -> ``seed -> transformers wrapper``
SWEEP: dict[str, Callable[[int], Any]] = {t: _maker(t) for t in WRAPPERS}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_base_hidden_states_equal_the_wrapper(case: str) -> None:
    x, mask = checks.padded(24)
    real = mask.bool()
    for base in _kinds(case):
        hf = _hf(case, base=base)
        assert type(hf).__name__ in WRAPPERS[hf.config.model_type].classes
        ours = _convert(hf)
        assert isinstance(ours.lm_head, torch.nn.Identity) == base
        if not base:  # tied as the wrapper is
            head = next(p for n, p in hf.named_parameters(remove_duplicate=False) if n.endswith("lm_head.weight"))
            embed = hf.get_input_embeddings().weight
            assert ours.tie_embeddings == (head.data_ptr() == embed.data_ptr()), case
        with torch.no_grad():
            got = ours(x, attention_mask=real)
        err = checks.rel(got[real], _logits(hf, x, mask)[real])
        assert err <= 1e-5, f"{case} ({'base' if base else 'logits'}): relative error {err:.2e}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_generation_token_identical(case: str) -> None:
    hf = _hf(case)
    ours = _convert(hf)
    kw = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    x = checks.tokens(7, batch=1)
    assert torch.equal(ours.generate(x, 6), hf.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw))
    x, mask = checks.padded(10, pad=3)
    assert torch.equal(ours.generate(x, 6, attention_mask=mask.bool()), hf.generate(input_ids=x, attention_mask=mask,
                                                                                     **kw))


#: wrappers whose folder transformers 5.25 writes it cannot read back itself (Kimi K2.5: its vision
#: renames reversed onto the text layers, ``blocks`` / ``self_wqkv``; ShieldGemma 2: its prefix
#: change reversed, ``model.language_model.model.*``, reloaded 1.0 relative off): the layout of their
#: releases is tested
UNSAVED = {"kimi_k25", "shieldgemma2"}
#: wrappers whose base ``*Model`` folder transformers writes with the text model's keys under no
#: prefix of their own (dots.3-note: ``layers.*``; LLaVA-OneVision-1.5: ``model.layers.*``, its
#: conditional layout's ``model.model.*`` less one level): not told from the towers, refused
BASE_UNSAVED = {"dots3_note", "llava_onevision1_5"}


def _legacy(folder: Path, hf: Any, out: Path) -> None:
    """``folder``'s checkpoint in the layout before transformers 5 (``language_model.model.*``,
    ``language_model.lm_head.weight``, the towers at the top), tied head left out."""
    from safetensors.torch import save_file

    renamed = {}
    for key, value in hf.state_dict().items():
        if key.startswith("model.language_model."):
            key = "language_model.model." + key[len("model.language_model."):]
        elif key == "lm_head.weight":
            if getattr(hf.config, "tie_word_embeddings", False):
                continue
            key = "language_model.lm_head.weight"
        elif key.startswith("model."):
            key = key[len("model."):]
        renamed[key] = value.contiguous().clone()
    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    save_file(renamed, str(out / "model.safetensors"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_folder_through_load_pretrained(case: str, tmp_path: Path) -> None:
    """The folder transformers writes (for the wrappers it maps as LLaVA, the layout before
    transformers 5), the other layout, and the base ``*Model``'s folder (no head)."""
    x, mask = checks.padded(16, pad=3)
    real = mask.bool()
    for base in _kinds(case):
        hf = _hf(case, base=base)
        new, old = tmp_path / f"new{base}", tmp_path / f"old{base}"
        hf.save_pretrained(new)
        folders = [] if case in UNSAVED else [new]
        if base and case in BASE_UNSAVED:
            with pytest.raises(CheckpointFormatError, match="no language model"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                load_pretrained(new)
            continue
        lm = WRAPPERS[hf.config.model_type].language_model
        if not base and case != "llama4" and lm == "language_model":  # Llama 4's is the older one already
            _legacy(new, hf, old)
            folders.append(old)
        for folder in folders:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ours = load_pretrained(folder)
            assert isinstance(ours.lm_head, torch.nn.Identity) == base
            with torch.no_grad():
                err = checks.rel(ours(x, attention_mask=real)[real], _logits(hf, x, mask)[real])
            assert err <= 1e-5, f"{case} ({folder.name}): relative error {err:.2e}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_to_hf_writes_the_text_decoder_back(case: str) -> None:
    source, target = _hf(case, seed=1), _hf(case, seed=2)
    lm = WRAPPERS[target.config.model_type].language_model
    towers = {k: v.clone() for k, v in target.state_dict().items() if lm not in k and k != "lm_head.weight"}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert to_hf(_convert(source), target) is target
    assert bool(towers) == any("keep their values" in str(w.message) for w in seen)
    x, mask = checks.padded(16, pad=3)
    real = mask.bool()
    assert checks.rel(_logits(target, x, mask)[real], _logits(source, x, mask)[real]) <= 1e-5
    assert all(torch.equal(target.state_dict()[k], v) for k, v in towers.items())  # the towers as they were


def test_every_wrapper_is_a_model_type_and_tested() -> None:
    assert set(WRAPPERS) <= set(MODEL_TYPES)
    assert {CASES[c]().model_type for c in CASES} == set(WRAPPERS)


def test_the_dropped_towers_are_named_in_a_warning() -> None:
    with pytest.warns(UserWarning, match=r"model\.vision_tower\.\* \(\d+\), model\.multi_modal_projector\.\*"):
        from_hf(_hf("llava"))


@pytest.mark.parametrize("model_type", sorted(WRAPPERS))
def test_each_row_has_its_config_class_defaults(model_type: str) -> None:
    """A ``config.json`` may leave out the wrapper's tie and its text model's ``model_type``: the
    row's defaults are the config class's."""
    config = T.AutoConfig.for_model(model_type)
    w = WRAPPERS[model_type]
    assert config.get_text_config().model_type == w.text_types[0]
    tie = config.get_text_config() if w.tie_from == "text" else config
    assert bool(getattr(tie, "tie_word_embeddings", False)) == w.tie  # Inkling2's config has none: untied


@functools.cache
def _first_case(model_type: str) -> str:
    """The first case of a wrapper ``model_type``."""
    return next(c for c in CASES if CASES[c]().model_type == model_type)


@pytest.mark.parametrize("model_type", sorted(WRAPPERS))
@pytest.mark.parametrize(("by_wrapper", "by_text"), [(False, True), (True, False)])
def test_the_head_is_tied_as_the_wrapper_config_class_decides(model_type: str, by_wrapper: bool,
                                                              by_text: bool) -> None:
    """The wrapper's and its text config's ``tie_word_embeddings`` disagreeing: attnzoo ties as the config
    class does (several forward a text config's tie to the wrapper, the pre-v5 saves' place for it)."""
    case = _first_case(model_type)
    made = CASES[case]()
    data = {**made.to_dict(), "tie_word_embeddings": by_wrapper}
    text = data["text_config"] = {**data["text_config"], "tie_word_embeddings": by_text}
    cls = type(made)
    towers = {k: ({x: y for x, y in v.items() if x != "layer_types"} if isinstance(v, dict) and k != "text_config"
                  else v) for k, v in data.items()}  # a shrunk tower's layer_types rebuilt for its depth
    try:  # the class's own reading of the two (its __post_init__)
        config = cls.from_dict(towers)
    except (ValueError, StrictDataclassError):  # a shrunk tower the class validates otherwise: the text alone
        try:
            config = cls(text_config=text, tie_word_embeddings=by_wrapper)
        except (ValueError, StrictDataclassError):  # Apertus 1.5's audio tokenizer: its config class forwards nothing, set both
            config = CASES[case]()
            config.tie_word_embeddings, config.text_config.tie_word_embeddings = by_wrapper, by_text
    w = WRAPPERS[model_type]
    want = config.get_text_config() if w.tie_from == "text" else config
    hf = HFConfig({"text_config": text, "tie_word_embeddings": by_wrapper}, "config.json", "test")
    # Cosmos3-Edge's and Molmo2's classes tie nothing whatever the config says (their rows read no tie key;
    # their logits tests check the head is separate)
    tied = bool(getattr(want, "tie_word_embeddings", False)) and bool(w.tie_keys)
    assert wrappers._tied(w, hf, text) == tied


def test_a_folder_without_the_wrapper_defaults_reads_them(tmp_path: Path) -> None:
    """Mistral 3 ties by default where its Mistral text model does not; LLaVA ties when its text
    config does; LFM2-VL's legacy ``tie_embedding`` wins."""
    for case, drop, extra in (("mistral3", ("tie_word_embeddings",), {}), ("llava_qwen2", ("tie_word_embeddings",), {}),
                              ("lfm2_vl", (), {"tie_embedding": True, "tie_word_embeddings": False})):
        hf = _hf(case)
        folder = tmp_path / case
        hf.save_pretrained(folder)
        data = json.loads((folder / "config.json").read_text())
        for key in drop:
            data.pop(key, None)
        data["text_config"].pop("model_type" if case == "mistral3" else "architectures", None)
        data.update(extra)
        (folder / "config.json").write_text(json.dumps(data))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = load_pretrained(folder)
        assert ours.tie_embeddings, case
        x, mask = checks.padded(12, pad=3)
        real = mask.bool()
        with torch.no_grad():
            assert checks.rel(ours(x, attention_mask=real)[real], _logits(hf, x, mask)[real]) <= 1e-5, case


def test_a_text_model_not_verified_in_the_wrapper_is_refused_by_name() -> None:
    config = T.LlavaConfig(text_config=lineage.CONFIGS["gemma2"](), vision_config=T.CLIPVisionConfig(**VISION))
    torch.manual_seed(0)
    hf = T.LlavaForConditionalGeneration(config).eval()
    with pytest.raises(UnsupportedConfigError, match=r"'gemma2' text model in llava .*\['llama', 'qwen2'\]"):
        _convert(hf)


def test_a_checkpoint_without_its_language_model_or_text_config_is_refused(tmp_path: Path) -> None:
    hf = _hf("llava")
    hf.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in data.items() if k != "text_config"}))
    with pytest.raises(CheckpointFormatError, match="missing key 'text_config'"):
        load_pretrained(tmp_path)
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(data))
    save_file({k: v.contiguous() for k, v in hf.state_dict().items() if "language_model" not in k},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match="no language model in the LLaVA checkpoint"):
        load_pretrained(tmp_path)


def _check_folder(hf: Any, folder: Path) -> Any:
    """``load_pretrained(folder)`` (warnings silenced) equals the wrapper ``hf`` on a left-padded batch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = load_pretrained(folder)
    x, mask = checks.padded(12, pad=3)
    real = mask.bool()
    with torch.no_grad():
        assert checks.rel(ours(x, attention_mask=real)[real], _logits(hf, x, mask)[real]) <= 1e-5
    return ours


def test_hunyuan_vl_reads_its_released_config_forms(tmp_path: Path) -> None:
    """HunYuan-VL's released ``config.json``: ``rope_type`` ``"xdrope"`` (read as ``"dynamic"``), the sections
    as ``xdrope_section``, ``attention_head_dim`` for ``head_dim``."""
    hf = _hf("hunyuan_vl")
    hf.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    text = data["text_config"]
    rope = text.pop("rope_parameters")
    text["rope_parameters"] = {"type": "xdrope", "rope_theta": rope["rope_theta"], "alpha": rope["alpha"],
                               "factor": 1.0, "xdrope_section": rope["mrope_section"]}
    text["attention_head_dim"] = text.pop("head_dim")
    (tmp_path / "config.json").write_text(json.dumps(data))
    _check_folder(hf, tmp_path)


def test_emu3_text_model_in_its_older_layout_and_alone(tmp_path: Path) -> None:
    """Emu3's releases before transformers 5 hold ``text_model.model.*`` and ``text_model.lm_head``; its text
    model alone is ``Emu3ForCausalLM`` (LLaMA whose layers also drop out their outputs in training)."""
    from safetensors.torch import save_file

    hf = _hf("emu3")
    renamed = {("text_model.model." + k[len("model.text_model."):] if k.startswith("model.text_model.") else
                "text_model.lm_head.weight" if k == "lm_head.weight" else k[len("model."):]): v.contiguous().clone()
               for k, v in hf.state_dict().items()}
    hf.config.save_pretrained(tmp_path)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    _check_folder(hf, tmp_path)
    x, mask = checks.padded(12, pad=3)
    real = mask.bool()
    torch.manual_seed(0)
    causal = checks.perturbed(T.Emu3ForCausalLM(T.Emu3TextConfig(**CASES["emu3"]().text_config.to_dict())).eval(), 0)
    alone = _convert(causal)
    assert alone.blocks[0].dropout.p == causal.config.attention_dropout
    with torch.no_grad():
        assert checks.rel(alone(x, attention_mask=real)[real], causal(input_ids=x, attention_mask=mask).logits[real]) <= 1e-5
