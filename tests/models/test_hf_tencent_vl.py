"""The text decoders of Tencent's HunYuan-VL (``hunyuan_vl_text``: HunYuan-V1-Dense's layer, a row of
``families/dense.py``) and HY-V4-VL (``hy_v4_vl_text``: HY-V4's decoder with ``rms_norm_eps`` in its
latent norms, ``families/hy_v4.py``) through their wrappers (``HunYuanVLForConditionalGeneration``,
``HYV4VLForConditionalGeneration``). The wrappers' shared checks run in ``test_hf_multimodal.py``; here:
their multimodal RoPE (HunYuan-VL's over 3 or 4 streams) is the 1-D rotation only on text, HY-V4-VL's
latent-norm epsilon, the released layouts (HunyuanOCR's flat ``config.json`` with its legacy keys and
``xdrope`` RoPE, ``model.*`` beside ``vit.*``; HY-V4-VL's multi-token-prediction layers, dropped) and
the refusals by name."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import test_hf_hy_v4 as hy  # noqa: E402

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.models.hf.errors import UnsupportedConfigError  # noqa: E402

T = transformers
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*the text decoder of (HunYuan-VL|HY-V4-VL) is converted")]

#: a one-block vision tower projecting to the text width
VISION = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1,
              out_hidden_size=checks.SMALL["hidden_size"])
#: HunyuanOCR's RoPE as transformers reads it: ``dynamic`` with a fixed NTK ``alpha``, here 4 streams
#: (position, width, height, image index) of 2 frequency pairs each (head_dim 16)
HUNYUAN_ROPE = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 1e4,
                "mrope_section": [2, 2, 2, 2]}


def _hunyuan_vl(sections: tuple[int, ...] = (2, 2, 2, 2)) -> Any:
    """HunYuan-VL: two HunYuan-V1-Dense layers (post-RoPE QK norms), NTK-alpha RoPE, tied (its default)."""
    rope = {**HUNYUAN_ROPE, "mrope_section": list(sections)}
    text = {**checks.SMALL, "num_hidden_layers": 2, "head_dim": 16, "rope_parameters": rope}
    return T.HunYuanVLConfig(text_config=text, vision_config=VISION)


def _hy_v4_vl() -> Any:
    """HY-V4-VL: HY-V4's test decoder (4 layers, 3 streams, indexed attention, clamped MoE) with
    ``rms_norm_eps`` 1e-2, far from the 1e-6 of HY-V4's latent norms, untied (its default)."""
    text = {**checks.SMALL, **hy._SIZES, "rms_norm_eps": 1e-2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1]}}
    return T.HYV4VLConfig(text_config=text, vision_config=VISION)


@pytest.mark.parametrize("make, streams", [(_hunyuan_vl, 4), (lambda: _hunyuan_vl((2, 3, 3)), 3), (_hy_v4_vl, 3)],
                         ids=["hunyuan_vl_4", "hunyuan_vl_3", "hy_v4_vl"])
def test_the_multimodal_rope_is_the_1d_rope_on_text_only(make: Any, streams: int) -> None:
    checks.check_multimodal_rope_on_text(checks.hf_model(make()), streams=streams)


def test_hy_v4_vl_latent_norms_take_rms_norm_eps() -> None:
    """HY-V4-VL's query / key-value latent norms take ``rms_norm_eps`` where HY-V4's take 1e-6."""
    vl = from_hf(checks.hf_model(_hy_v4_vl()))
    text = from_hf(checks.hf_model(hy._hy(rms_norm_eps=1e-2)))
    assert vl.blocks[0].attn.q_a_norm.eps == vl.blocks[0].attn.kv_a_norm.eps == 1e-2
    assert text.blocks[0].attn.q_a_norm.eps == text.blocks[0].attn.kv_a_norm.eps == 1e-6


def _released_hunyuan_ocr(hf: Any, folder: Path) -> None:
    """``hf`` saved as HunyuanOCR is released: the text keys at the top of ``config.json`` under their
    legacy names (``attention_head_dim``, ``org_vocab_size``, ``pad_id``), the RoPE as ``rope_scaling:
    {"type": "xdrope", "xdrope_section": ...}`` beside ``rope_theta``; ``model.*`` and ``vit.*``, no
    ``lm_head`` (tied)."""
    hf.save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    text = data.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type", None)
    for new, old in (("head_dim", "attention_head_dim"), ("vocab_size", "org_vocab_size"), ("pad_token_id", "pad_id")):
        text[old] = text.pop(new)
    data.update(text, rope_theta=rope["rope_theta"],
                rope_scaling={"type": "xdrope", "alpha": rope["alpha"], "factor": 1.0, "beta_fast": 32, "beta_slow": 1,
                              "mscale": 1.0, "mscale_all_dim": 1.0, "xdrope_section": rope["mrope_section"]})
    (folder / "config.json").write_text(json.dumps(data))
    tensors = {}
    for key, value in hf.state_dict().items():
        if key.startswith("model.language_model."):
            tensors["model." + key[len("model.language_model."):]] = value.contiguous().clone()
        elif key.startswith("model.vision_tower."):
            tensors["vit." + key[len("model.vision_tower."):]] = value.contiguous().clone()
    safetensors_torch.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_hunyuan_ocr_released_folder_loads(tmp_path: Path) -> None:
    """HunyuanOCR's released form (:func:`_released_hunyuan_ocr`) loads as the model it was written from,
    tied; the tower at ``vit.*`` is named as dropped."""
    hf = checks.hf_model(_hunyuan_vl())
    _released_hunyuan_ocr(hf, tmp_path)
    with pytest.warns(UserWarning, match=r"HunYuan-VL is converted; \d+ tensors .* dropped: vit\.embeddings\.\* \(3\), vit\.layers\.\*"):
        ours = load_pretrained(tmp_path)
    assert ours.tie_embeddings
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL


def test_hy_v4_vl_released_mtp_layers_are_dropped(tmp_path: Path) -> None:
    """transformers saves HY-V4-VL as released (``model.*`` with the checkpoint's names, ``vit.*``); the
    released multi-token-prediction layers (``model.mtp_layers.*``, which transformers ignores) are
    dropped."""
    hf = checks.hf_model(_hy_v4_vl())
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = safetensors_torch.load_file(str(path))
    assert any(k.startswith("vit.") for k in tensors) and "model.layers.0.self_attn.learnable_sink_param" in tensors
    mtp = {f"model.mtp_layers.0.{k[len('model.layers.1.'):]}": v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.1.")}
    safetensors_torch.save_file({**tensors, **mtp}, str(path), metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = load_pretrained(tmp_path)
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL


def _with_text(config: Any, **text: Any) -> Any:
    for key, value in text.items():
        object.__setattr__(config.text_config, key, value)  # past the strict fields' type checks
    return config


@pytest.mark.parametrize("make, text, match", [
    (_hunyuan_vl, {"rope_parameters": {**HUNYUAN_ROPE, "alpha": -1.0}}, r"rope_parameters alpha=-1\.0 \(supported: a number > 0\)"),
    (_hy_v4_vl, {"swiglu_limit": 0.0}, r"swiglu_limit=0\.0"),
    (_hy_v4_vl, {"q_lora_rank": None}, r"q_lora_rank=None"),
], ids=["hunyuan_vl_alpha", "hy_v4_vl_swiglu_limit", "hy_v4_vl_q_lora_rank"])
def test_what_cannot_be_reproduced_is_refused_by_name(make: Any, text: dict[str, Any], match: str) -> None:
    """The text families' refusals hold inside the wrappers (the config edited after transformers built
    its model, which would not run them)."""
    hf = checks.hf_model(make())
    _with_text(hf.config, **text)
    with pytest.raises(UnsupportedConfigError, match=match):
        from_hf(hf)
