"""The text decoders of GLM-4.1V (``glm4v_text``: GLM-4's layer, interleaved partial RoPE, a row of
``families/dense.py``) and GLM-4.5V (``glm4v_moe_text``: GLM-4.5's MoE layer, split-half partial RoPE,
a row of ``families/sparse_moe.py``) through their wrappers (``Glm4vForConditionalGeneration``,
``Glm4vMoeForConditionalGeneration``). The wrappers' shared checks run in ``test_hf_multimodal.py``;
here: their multimodal RoPE is the 1-D rotation only on text (equal position streams), and GLM-4.1V's
default rotates the whole head where GLM-4's rotates half."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402

T = transformers
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*the text decoder of GLM-(4.*V|OCR|GA) is converted")]

VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
              out_hidden_size=checks.SMALL["hidden_size"], image_size=16)


def _text(partial: float | None = 0.5, **kw: Any) -> dict[str, Any]:
    """Two layers, head_dim 16; the RoPE over ``partial`` of each head (``None``: the config's default)
    in sections of 1 / 1 / 2 frequency pairs."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 1, 2]}
    if partial is not None:
        rope["partial_rotary_factor"] = partial
    else:
        rope["mrope_section"] = [2, 3, 3]
    return {**checks.SMALL, "num_hidden_layers": 2, "head_dim": 16, "rope_parameters": rope, **kw}


def _glm4v() -> Any:
    """GLM-4.1V: the config's default rotates the whole head (interleaved pairs)."""
    return T.Glm4vConfig(text_config=_text(None), vision_config=VISION)


def _glm4v_moe() -> Any:
    """GLM-4.5V: half the head rotated, 4 experts top-2 after one dense layer, a shared expert."""
    return T.Glm4vMoeConfig(text_config=_text(0.5, moe_intermediate_size=24, n_routed_experts=4,
                                               num_experts_per_tok=2), vision_config=VISION)


def _glm46v() -> Any:
    """GLM-4.6V: GLM-4.1V's text decoder in its own wrapper."""
    return T.Glm46VConfig(text_config=_text(0.5), vision_config=VISION)


def _glmga() -> Any:
    """GLM-GA: the same wrapper classes, its own config."""
    return T.AutoConfig.for_model("glmga", text_config=_text(0.5), vision_config=VISION)


def _glm_ocr() -> Any:
    """GLM-OCR: GLM-4.1V's text decoder without q/k/v biases, the whole head rotated."""
    return T.GlmOcrConfig(text_config=_text(None), vision_config=VISION)


MAKERS = {"glm4v": _glm4v, "glm4v_moe": _glm4v_moe, "glm46v": _glm46v, "glmga": _glmga, "glm_ocr": _glm_ocr}


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_the_multimodal_rope_is_the_1d_rope_on_text_only(kind: str) -> None:
    checks.check_multimodal_rope_on_text(checks.hf_model(MAKERS[kind]()))


def test_glm4v_rotates_the_whole_head_by_default_and_half_when_told() -> None:
    whole = from_hf(checks.hf_model(_glm4v()))
    half = from_hf(checks.hf_model(T.Glm4vConfig(text_config=_text(0.5), vision_config=VISION)))
    assert (whole.blocks[0].attn.rope.rotary_dim, half.blocks[0].attn.rope.rotary_dim) == (16, 8)
    assert whole.blocks[0].attn.rope.interleaved and half.blocks[0].attn.rope.interleaved
    moe = from_hf(checks.hf_model(_glm4v_moe()))
    assert moe.blocks[0].attn.rope.rotary_dim == 8 and not moe.blocks[0].attn.rope.interleaved


def test_glm_ocr_has_no_qkv_biases_whatever_attention_bias_says() -> None:
    hf = checks.hf_model(T.GlmOcrConfig(text_config=_text(None, attention_bias=True), vision_config=VISION))
    assert hf.model.language_model.layers[0].self_attn.q_proj.bias is None
    ours = from_hf(hf)
    assert ours.blocks[0].attn.qkv_proj.bias is None
    checks.check_multimodal_rope_on_text(hf)


def test_glm_ocr_folder_drops_the_released_mtp_layer(tmp_path: Path) -> None:
    """The release holds an MTP layer at ``layers.{num_hidden_layers}`` that transformers does not load
    (``_keys_to_ignore_on_load_unexpected``): a folder with it loads, the layer dropped."""
    from safetensors.torch import load_file, save_file

    hf = checks.hf_model(_glm_ocr())
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    sd = load_file(str(path))
    depth = hf.config.text_config.num_hidden_layers
    extra = {k.replace(".layers.1.", f".layers.{depth}."): v.clone() for k, v in sd.items()
             if k.startswith("model.language_model.layers.1.")}
    save_file({**sd, **extra}, str(path), metadata={"format": "pt"})
    ours = load_pretrained(tmp_path)
    assert ours.depth == depth
    x = torch.randint(0, hf.config.text_config.vocab_size, (2, 9))
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= 1e-5
