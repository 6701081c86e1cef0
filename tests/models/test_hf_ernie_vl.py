"""The text decoder of ERNIE-4.5-VL (``ernie4_5_vl_moe_text``, a row of ``families/sparse_moe.py``: ERNIE-4.5-MoE's
layer, adjacent-pair RoPE, the text experts of its modality-routed MoE) through its wrapper
(``Ernie4_5_VLMoeForConditionalGeneration``). The wrapper's shared checks (logits, base model, greedy, folders,
``to_hf``) run in ``test_hf_multimodal.py``; here: the multimodal RoPE is the 1-D rotation only on text, the
vision experts are dropped by name and change nothing on text, the released layout (``conversion_mapping.py``:
gate transposed, the correction biases of both modalities in one ``[2, E]`` tensor, experts ``0 .. 2E-1``
text then vision) and a ``config.json`` without ``mlp_layer_types`` load, and the refusals."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safe_open = pytest.importorskip("safetensors").safe_open

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.models.hf.errors import UnsupportedConfigError  # noqa: E402

T = transformers
pytestmark = [pytest.mark.usefixtures("one_thread")]
DROPPED = "ignore:.*the text decoder of ERNIE-4.5-VL is converted"


def _ernie_vl(**text: Any) -> Any:
    """Three layers (the first dense), head_dim 16 in RoPE sections of 2 / 2 / 4 pairs, 4 text and 4
    vision experts (widths 24 / 16) top-2, one shared expert; tied as the config's default."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2, 4]}
    cfg = {**checks.SMALL, "num_hidden_layers": 3, "rope_parameters": rope, "moe_intermediate_size": [24, 16],
           "moe_k": 2, "moe_num_experts": 4, "moe_num_shared_experts": 1, **text}
    return T.Ernie4_5_VLMoeConfig(text_config=cfg, vision_config=dict(depth=1, hidden_size=16, intermediate_size=32,
                                                                      num_heads=2, patch_size=4))


def _hf(seed: int = 0) -> Any:
    """The wrapper, every weight perturbed (the correction biases, parameters here, too)."""
    return checks.hf_model(_ernie_vl(), seed=seed)


def _logits_rel(ours: Any, hf: Any) -> float:
    x = checks.tokens(16)
    with torch.no_grad():
        return checks.rel(ours(x), hf(input_ids=x).logits)


@pytest.mark.filterwarnings(DROPPED)
def test_the_multimodal_rope_is_the_1d_rope_on_text_only() -> None:
    checks.check_multimodal_rope_on_text(_hf())


def test_the_text_experts_and_their_correction_bias_route_and_the_vision_experts_are_named() -> None:
    hf = _hf()
    with pytest.warns(UserWarning, match=r"vision experts: layers\.\*\.mlp\.\* \(8\), model\.vision_tower\.\*"):
        ours = from_hf(hf)
    assert _logits_rel(ours, hf) <= 1e-5
    moe = ours.blocks[1].ffn
    text = hf.model.language_model.layers[1].mlp.text_moe
    assert (moe.num_experts, moe.top_k, moe.norm_min) == (4, 2, 1e-12)
    assert torch.equal(moe.score_bias, text.gate.moe_statics.e_score_correction_bias.reshape(-1))
    assert not hasattr(ours.blocks[0].ffn, "router")  # the first layer dense, as mlp_layer_types says
    with torch.no_grad():  # the vision experts do not act on text
        for name, p in hf.named_parameters():
            if ".vision_moe." in name:
                p.add_(1.0)
    assert _logits_rel(ours, hf) <= 1e-5


@pytest.mark.filterwarnings(DROPPED)
def test_the_released_layout_loads_its_text_half(tmp_path: Path) -> None:
    """transformers' save_pretrained writes the released names (its conversion_mapping reversed)."""
    hf = _hf()
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert tuple(f.get_slice("model.layers.1.mlp.gate.weight").get_shape()) == (64, 4)  # [C, E]
        assert tuple(f.get_slice("model.layers.1.mlp.moe_statics.e_score_correction_bias").get_shape()) == (2, 4)
    assert {"model.layers.1.mlp.gate.weight_1", "model.layers.1.mlp.experts.7.up_proj.weight"} <= keys
    with pytest.warns(UserWarning, match=r"vision experts: layers\.\*\.mlp\.\* \(26\)"):
        ours = load_pretrained(tmp_path)
    assert _logits_rel(ours, hf) <= 1e-5


@pytest.mark.filterwarnings(DROPPED)
def test_a_config_without_mlp_layer_types_has_the_first_layer_dense(tmp_path: Path) -> None:
    hf = _hf()
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    del data["text_config"]["mlp_layer_types"]
    path.write_text(json.dumps(data))
    again = T.AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    assert again.config.text_config.mlp_layer_types == ["dense", "sparse", "sparse"]
    assert _logits_rel(load_pretrained(tmp_path), again) <= 1e-5


@pytest.mark.parametrize(("key", "value", "named"), [
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}, "mrope_section"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2, 3]}, "mrope_section"),
    ("moe_intermediate_size", [24], "moe_intermediate_size"),
    ("use_bias", True, "use_bias"),
])
def test_refused_by_name(key: str, value: Any, named: str) -> None:
    hf = _hf()
    setattr(hf.config.text_config, key, value)
    with pytest.raises(UnsupportedConfigError, match=named), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from_hf(hf)


def test_the_text_model_alone_converts_and_names_its_vision_experts() -> None:
    text_model = _hf().model.language_model
    with pytest.warns(UserWarning, match="8 tensors of vision experts"):
        ours = from_hf(text_model)
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(ours.hidden_states(x), text_model(input_ids=x).last_hidden_state) <= 1e-5
