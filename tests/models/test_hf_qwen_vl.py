"""The text decoders of Qwen2-VL, Qwen2.5-VL and Qwen3-VL (``qwen2_vl_text``, ``qwen2_5_vl_text``,
``qwen3_vl_text``: Qwen2's and Qwen3's layers under a multimodal RoPE) through their wrappers
(``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``,
``Qwen3VLForConditionalGeneration``), Qwen3-VL-MoE's (``qwen3_vl_moe_text``: Qwen3-MoE's, through
``Qwen3VLMoeForConditionalGeneration``) and PaddleOCR-VL's (``paddleocr_vl_text``: ERNIE-4.5's layers
rotating split halves, through ``PaddleOCRVLForConditionalGeneration``). On text the three position streams of the multimodal RoPE are
equal, and every section rotates by the same position: the 1-D RoPE. The wrappers' shared checks
(logits of a left-padded batch, the base model, greedy generation, folders in both layouts,
``to_hf``) run in ``test_hf_multimodal.py``; here: the rotation is the 1-D one only on text, the
sections differ otherwise, and the released configs' ``rope_scaling: {"type": "mrope"}``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402

T = transformers
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*the text decoder of Qwen.*-VL is converted")]

#: a two-layer text model, head_dim 16 (8 frequencies, in sections of 2 / 3 / 3)
TEXT = {**checks.SMALL, "num_hidden_layers": 2, "head_dim": 16}
#: one-block vision towers
VISION = {"qwen2_vl": dict(depth=1, embed_dim=16, hidden_size=checks.SMALL["hidden_size"], num_heads=2, patch_size=4),
          "qwen2_5_vl": dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                             out_hidden_size=checks.SMALL["hidden_size"], fullatt_block_indexes=[0]),
          "qwen3_vl": dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                           num_position_embeddings=16, out_hidden_size=checks.SMALL["hidden_size"],
                           deepstack_visual_indexes=[])}


def _rope(interleaved: bool = False) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3],
            **({"mrope_interleaved": True} if interleaved else {})}


def _qwen2_vl() -> Any:
    """Qwen2-VL around a Qwen2 text model (q/k/v biases), untied."""
    return T.Qwen2VLConfig(text_config={**TEXT, "rope_parameters": _rope()}, vision_config=VISION["qwen2_vl"])


def _qwen2_5_vl() -> Any:
    """Qwen2.5-VL, tied embeddings, one key/value head."""
    return T.Qwen2_5_VLConfig(text_config={**TEXT, "rope_parameters": _rope(), "num_key_value_heads": 1},
                              vision_config=VISION["qwen2_5_vl"], tie_word_embeddings=True)


def _qwen3_vl() -> Any:
    """Qwen3-VL: per-head QK norms, the interleaved sections."""
    return T.Qwen3VLConfig(text_config={**TEXT, "rope_parameters": _rope(interleaved=True)},
                           vision_config=VISION["qwen3_vl"])


def _qwen3_vl_moe(moe_width: int = 24) -> Any:
    """Qwen3-VL-MoE: 4 experts of ``moe_width``, top-2 (always renormalised) on every layer."""
    text = {k: v for k, v in TEXT.items() if k != "intermediate_size"}
    return T.Qwen3VLMoeConfig(text_config={**text, "num_experts": 4, "num_experts_per_tok": 2,
                                           "moe_intermediate_size": moe_width, "rope_parameters": _rope(interleaved=True)},
                              vision_config=VISION["qwen3_vl"])


def _paddleocr_vl() -> Any:
    """PaddleOCR-VL: ERNIE-4.5's text decoder under Qwen2-VL's multimodal RoPE (split halves), tied."""
    return T.PaddleOCRVLConfig(text_config={**TEXT, "rope_parameters": _rope()},
                               vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                  num_attention_heads=2, patch_size=4, image_size=16))


MAKERS = {"qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_5_vl, "qwen3_vl": _qwen3_vl, "qwen3_vl_moe": _qwen3_vl_moe,
          "paddleocr_vl": _paddleocr_vl}


def _both(cls: Any, folder: Path) -> tuple[Any, Any]:
    """transformers' ``cls`` and attnzoo's model of ``folder`` (the towers' warnings silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_pretrained(folder).eval(), load_pretrained(folder)


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_the_multimodal_rope_is_the_1d_rope_on_text_only(kind: str) -> None:
    checks.check_multimodal_rope_on_text(checks.hf_model(MAKERS[kind]()))


def test_released_config_with_the_mrope_type_loads(tmp_path: Path) -> None:
    """Qwen2.5-VL's released ``config.json``: the text keys at the top beside ``vision_config``, the RoPE
    as ``rope_scaling: {"type": "mrope", "mrope_section": [...]}``; transformers reads it, and so do we."""
    hf = checks.hf_model(_qwen2_5_vl())
    hf.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    text = data.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type", None)
    data.update(text, rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]}, rope_theta=rope["rope_theta"])
    (tmp_path / "config.json").write_text(json.dumps(data))
    theirs, ours = _both(T.Qwen2_5_VLForConditionalGeneration, tmp_path)
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(ours(x), theirs(input_ids=x).logits) <= checks.TOL


@pytest.mark.parametrize("moe_width", [24, 32], ids=["C!=2F", "C==2F"])
def test_qwen3_vl_moe_released_experts_are_transposed(tmp_path: Path, moe_width: int) -> None:
    """The released checkpoints store ``gate_up_proj [E, C, 2F]`` and ``down_proj [E, F, C]`` (transformers
    transposes them at load): that folder loads as the model it was written from, whichever tensor tells
    the layout (``C == 2F``: only ``down_proj`` does; transformers then keeps the square ``gate_up_proj``
    untransposed, ``Transpose(check_dims=True)`` compares shapes only, and reads other weights)."""
    from safetensors.torch import load_file, save_file

    hf = checks.hf_model(_qwen3_vl_moe(moe_width))
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    experts = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert experts
    save_file({k: v.transpose(1, 2).contiguous() if k in experts else v for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})
    theirs, ours = _both(T.Qwen3VLMoeForConditionalGeneration, tmp_path)
    x = checks.tokens(10)
    with torch.no_grad():
        want = hf(input_ids=x).logits
        assert checks.rel(ours(x), want) <= checks.TOL
        assert (checks.rel(theirs(input_ids=x).logits, want) <= checks.TOL) == (moe_width != 32)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_a_head_tied_by_the_text_config_alone(tmp_path: Path, kind: str) -> None:
    """Qwen2-VL's and Qwen2.5-VL's configs tie the head when only their ``text_config`` says so (the
    saves before transformers 5): the folder has no ``lm_head.weight`` and loads tied."""
    config = MAKERS[kind]()
    config.tie_word_embeddings = True
    hf = checks.hf_model(config)
    hf.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data.pop("tie_word_embeddings", None)
    data["text_config"]["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(data))
    theirs, ours = _both(type(hf), tmp_path)
    assert ours.tie_embeddings
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(ours(x), theirs(input_ids=x).logits) <= checks.TOL


def test_qwen3_vl_reads_no_window() -> None:
    """Qwen3-VL's attention has no window: a ``sliding_window`` in its text config changes nothing there."""
    config = _qwen3_vl()
    config.text_config.sliding_window, config.text_config.use_sliding_window = 4, True
    hf = checks.hf_model(config)
    x = checks.tokens(16)
    with torch.no_grad():
        assert checks.rel(from_hf(hf)(x), hf(input_ids=x).logits) <= checks.TOL
