"""The text decoder of DeepSeek-OCR2 (``deepseek_ocr2_text``, in ``families/deepseek.py``: DeepSeek-V2's
layers with LLaMA's grouped-query attention in place of the latent one, split-half RoPE, DeepSeek-V2's
softmax MoE on the ``sparse`` layers of ``mlp_layer_types``) through its wrapper
(``DeepseekOcr2ForConditionalGeneration``). The wrapper's shared checks (logits of a left-padded batch, the
base model, greedy generation, folders in both layouts, ``to_hf``) run in ``test_hf_multimodal.py`` with
:func:`_deepseek_ocr2`; here: group-limited routing with biases, the released layout (the text model at
``model.*``, one tensor per expert), ``head_dim`` derived whatever the config says, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import UnsupportedConfigError, from_hf, load_pretrained  # noqa: E402

T = transformers
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*the text decoder of DeepSeek-OCR2 is converted")]

#: a two-layer SAM encoder and a one-layer Qwen2 encoder (the smallest the tower builds)
VISION = dict(sam_config=dict(hidden_size=16, output_channels=8, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=16, window_size=2, global_attn_indexes=[1],
                              downsample_channels=[8, 16]),
              encoder_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=2, vocab_size=8))


def _text(**kw: Any) -> dict[str, Any]:
    """Three layers (dense, sparse, sparse), GQA 4 / 2, 4 experts top-2 and a shared expert."""
    return {**checks.SMALL, "num_hidden_layers": 3, "moe_intermediate_size": 24, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "n_shared_experts": 1, "routed_scaling_factor": 1.5,
            "mlp_layer_types": ["dense", "sparse", "sparse"], **kw}


def _deepseek_ocr2(**kw: Any) -> Any:
    return T.DeepseekOcr2Config(text_config=_text(**kw), vision_config=VISION)


def _rel(ours: Any, hf: Any) -> float:
    x, mask = checks.padded(16, pad=3)
    real = mask.bool()
    with torch.no_grad():
        return checks.rel(ours(x, attention_mask=real)[real], hf(input_ids=x, attention_mask=mask).logits[real])


def test_group_limited_routing_with_attention_and_mlp_biases() -> None:
    hf = checks.hf_model(_deepseek_ocr2(topk_method="group_limited_greedy", n_group=2, topk_group=1,
                                        attention_bias=True, mlp_bias=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 500.0}))
    assert hf.model.language_model.layers[0].self_attn.o_proj.bias is not None
    assert _rel(from_hf(hf), hf) <= checks.TOL


def _released(folder: Path) -> None:
    """``folder``'s checkpoint as released: the text model at ``model.embed_tokens`` / ``model.layers`` /
    ``model.norm``, one tensor per expert (``experts.{j}.gate_proj`` ...)."""
    from safetensors.torch import load_file, save_file

    out = {}
    for key, value in load_file(str(folder / "model.safetensors")).items():
        key = key.replace("model.language_model.", "model.")
        if key.endswith("experts.gate_up_proj"):
            for j, w in enumerate(value):
                gate, up = w.chunk(2, dim=0)
                out[key.replace("gate_up_proj", f"{j}.gate_proj.weight")] = gate.clone()
                out[key.replace("gate_up_proj", f"{j}.up_proj.weight")] = up.clone()
        elif key.endswith("experts.down_proj"):
            for j, w in enumerate(value):
                out[key.replace("down_proj", f"{j}.down_proj.weight")] = w.clone()
        else:
            out[key] = value
    save_file(out, str(folder / "model.safetensors"))


def test_the_released_layout_loads(tmp_path: Path) -> None:
    hf = checks.hf_model(_deepseek_ocr2())
    hf.save_pretrained(tmp_path)
    _released(tmp_path)
    assert _rel(load_pretrained(tmp_path), hf) <= checks.TOL


def _folder_with(tmp_path: Path, **text: Any) -> Path:
    """A saved folder whose ``text_config`` has ``text`` set (a key set to ``None`` removed)."""
    hf = checks.hf_model(_deepseek_ocr2())
    hf.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["text_config"].update(text)
    data["text_config"] = {k: v for k, v in data["text_config"].items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(data))
    return tmp_path


def test_head_dim_is_hidden_over_heads_whatever_the_config_says(tmp_path: Path) -> None:
    """``DeepseekOcr2TextConfig`` overwrites ``head_dim``: a ``config.json`` saying 8 loads as 16."""
    folder = _folder_with(tmp_path, head_dim=8)
    hf = T.AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").eval()
    assert hf.config.text_config.head_dim == 16
    ours = load_pretrained(folder)
    assert ours.blocks[0].attn.head_dim == 16
    assert _rel(ours, hf) <= checks.TOL


@pytest.mark.parametrize(("text", "named"), [
    ({"mlp_layer_types": None}, r"mlp_layer_types=None .*'dense' / 'sparse'"),
    ({"mlp_layer_types": ["dense", "sparse"]}, r"mlp_layer_types=\['dense', 'sparse'\]"),
    ({"topk_method": "noaux_tc"}, r"topk_method"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     r"partial_rotary_factor=0.5"),
    ({"num_attention_heads": 3, "num_key_value_heads": 3}, r"hidden_size=64 with num_attention_heads=3"),
])
def test_refused_by_name(tmp_path: Path, text: dict[str, Any], named: str) -> None:
    folder = _folder_with(tmp_path, **text)
    with pytest.raises(UnsupportedConfigError, match=named):
        load_pretrained(folder)
