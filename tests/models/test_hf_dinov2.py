"""DINOv2 and DINOv2 with registers (``families/dinov2.py``) against transformers' eager models:
features and outputs of the base and classifier classes at the config's image size and at other
(non-square, smaller, larger) sizes with the interpolated positions, the options that change the
math, folders (also with the config's defaults left out), bf16, ``to_hf``, the refusals, and the
:class:`LayerScale` part."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

T = pytest.importorskip("transformers")

import hf_vision_checks as vc  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.dinov2 import (  # noqa: E402
    DEFAULTS,
    LayerScale,
    PatchRope,
    build_dinov2,
    build_dinov3,
    swiglu_hidden,
)
from attnzoo.models.hf._state import HFConfig  # noqa: E402
from attnzoo.models.hf.errors import UnsupportedConfigError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 32, "patch_size": 8,
         "layerscale_value": 0.5}


def _dinov2(**kw: Any) -> Any:
    return T.Dinov2Config(**{**SMALL, **kw})


def _registers(**kw: Any) -> Any:
    return T.Dinov2WithRegistersConfig(**{**SMALL, "num_register_tokens": 3, **kw})


class TestDinov2(vc.VisionChecks):
    config = staticmethod(_dinov2)
    classes = (T.Dinov2Model, T.Dinov2ForImageClassification)
    other_size = (16, 40)  # non-square, another patch count: the positions are resized
    cases = (lambda: _dinov2(qkv_bias=False, use_mask_token=False),
             lambda: _dinov2(use_swiglu_ffn=True, mlp_ratio=3),
             lambda: _dinov2(hidden_act="gelu_pytorch_tanh", mlp_ratio=2, layer_norm_eps=1e-3),
             lambda: _dinov2(head_dim=16, num_channels=1, image_size=[16, 16], patch_size=[4, 4]),
             lambda: _dinov2(num_labels=0))


def _dinov3(**kw: Any) -> Any:
    small = {k: v for k, v in SMALL.items() if k != "num_attention_heads"}
    return T.DINOv3ViTConfig(**{**small, "num_attention_heads": 2, "intermediate_size": 48, "num_register_tokens": 4,
                                **kw})


class TestDinov3ViT(vc.VisionChecks):
    config = staticmethod(_dinov3)
    classes = (T.DINOv3ViTModel,)
    other_size = (16, 40)  # RoPE on the patch grid of any size
    cases = (lambda: _dinov3(num_register_tokens=0, rope_theta=1000.0, layer_norm_eps=1e-3),
             lambda: _dinov3(use_gated_mlp=True, hidden_act="silu", key_bias=True, proj_bias=False),
             lambda: _dinov3(query_bias=False, value_bias=False, proj_bias=False, mlp_bias=False, hidden_act="relu"),
             lambda: _dinov3(num_attention_heads=4, num_channels=1, patch_size=4))


class TestDinov2WithRegisters(vc.VisionChecks):
    config = staticmethod(_registers)
    classes = (T.Dinov2WithRegistersModel, T.Dinov2WithRegistersForImageClassification)
    other_size = (24, 48)
    cases = (lambda: _registers(num_register_tokens=0, qkv_bias=False),
             lambda: _registers(use_swiglu_ffn=True, hidden_act="relu"))


#: model_type -> a maker of the transformers model (the ``to_hf`` export sweep)
VISION_SWEEP = {"dinov2": lambda seed: vc.hf_vision(_dinov2(), T.Dinov2Model, seed),
                "dinov2_with_registers": lambda seed: vc.hf_vision(_registers(), T.Dinov2WithRegistersModel, seed),
                "dinov3_vit": lambda seed: vc.hf_vision(_dinov3(), T.DINOv3ViTModel, seed)}


@pytest.mark.parametrize("size", [16, 48, (40, 8), (32, 48)])
@pytest.mark.parametrize("make, base", [(_dinov2, T.Dinov2Model), (_registers, T.Dinov2WithRegistersModel),
                                        (_dinov3, T.DINOv3ViTModel)])
def test_positions_at_other_sizes(make: Any, base: Any, size: Any) -> None:
    """Shrunk (antialiased with registers), enlarged and far-from-square grids."""
    vc.check_vision(vc.hf_vision(make(), base), size)


def test_same_patch_count_non_square_image() -> None:
    """16 patches as 2x8 (transformers' table-as-is test looks at the count and the pixel sides)."""
    for make, cls in ((_dinov2, T.Dinov2ForImageClassification),
                      (_registers, T.Dinov2WithRegistersForImageClassification)):
        vc.check_vision(vc.hf_vision(make(num_labels=3), cls), (16, 64))


def test_folder_with_defaults_left_out(tmp_path: Path) -> None:
    """A ``config.json`` without the keys at their config class's default loads as transformers reads it."""
    for i, (cfg, cls) in enumerate(((_dinov2(), T.Dinov2Model),
                                    (_registers(num_register_tokens=4, use_swiglu_ffn=True),
                                     T.Dinov2WithRegistersModel), (_dinov3(num_register_tokens=0), T.DINOv3ViTModel))):
        hf = vc.hf_vision(cfg, cls)
        folder = tmp_path / str(i)
        hf.save_pretrained(folder)
        data = json.loads((folder / "config.json").read_text())
        dropped = [k for k, v in DEFAULTS[data["model_type"]].items() if data.get(k) == v]
        assert len(dropped) >= 8, dropped
        for key in dropped:
            del data[key]
        (folder / "config.json").write_text(json.dumps(data))
        images = vc.pixels()
        with torch.no_grad():
            assert vc.rel(load_pretrained(folder)(images), vc.hf_outputs(hf, images)[1]) <= vc.TOL


@pytest.mark.parametrize(("dim", "ratio"), [(32, 3), (1024, 4), (30, 4), (40, 3)])
def test_swiglu_width_rule(dim: int, ratio: int) -> None:
    """The width rule equals transformers' own SwiGLU MLP (which rounds up to a multiple of 8)."""
    from transformers.models.dinov2.modeling_dinov2 import Dinov2SwiGLUFFN

    cfg = T.Dinov2Config(hidden_size=dim, mlp_ratio=ratio, num_attention_heads=2)
    theirs = Dinov2SwiGLUFFN(cfg)
    widths = {m.out_features for m in theirs.modules() if isinstance(m, torch.nn.Linear) and m.out_features != dim}
    assert widths == {swiglu_hidden(dim, ratio)}


@pytest.mark.parametrize("change, what", [
    ({"image_size": [32, 48]}, "non-square position grid"),
    ({"patch_size": [8, 4]}, "non-square position grid"),
    ({"image_size": 36}, "not a multiple of patch_size"),
    ({"hidden_act": "quick_gelu"}, "hidden_act"),
    ({"architectures": ["Dinov2Backbone"]}, "Backbone"),
])
def test_refusals(change: dict[str, Any], what: str) -> None:
    hf = HFConfig({**_dinov2().to_dict(), **change}, "test", "DINOv2")
    with pytest.raises(UnsupportedConfigError, match=what):
        build_dinov2(hf)


@pytest.mark.parametrize("change, what", [
    ({"num_attention_heads": 4, "hidden_size": 24}, "multiple of 4"),
    ({"use_gated_mlp": True, "hidden_act": "relu"}, "hidden_act"),
    ({"architectures": ["DINOv3ViTBackbone"]}, "Backbone"),
])
def test_dinov3_refusals(change: dict[str, Any], what: str) -> None:
    hf = HFConfig({**_dinov3().to_dict(), **change}, "test", "DINOv3-ViT")
    with pytest.raises(UnsupportedConfigError, match=what):
        build_dinov3(hf)


def test_patch_rope_codes() -> None:
    """Prefix tokens are not rotated; a patch's angles follow its centre in [-1, 1] on each axis."""
    rope = PatchRope(8, base=100.0)
    codes = PatchRope.codes(2, 2, 3)
    cos, sin = rope.cos_sin(codes)
    assert cos.shape == (1, 1, 8, 4) and torch.equal(cos[0, 0, :2], torch.ones(2, 4))
    assert torch.equal(sin[0, 0, :2], torch.zeros(2, 4))
    y, x = 2 * (1 + 0.5) / 2 - 1, 2 * (2 + 0.5) / 3 - 1  # the last patch: row 1, column 2
    want = 2 * torch.pi * torch.tensor([y, y, x, x]) * torch.tensor([1.0, 0.1, 1.0, 0.1])
    torch.testing.assert_close(sin[0, 0, -1], torch.sin(want))
    with pytest.raises(ValueError, match="multiple of 4"):
        PatchRope(6, base=100.0)


def test_layer_scale_part() -> None:
    ls = LayerScale(4, 0.1)
    x = torch.randn(2, 3, 4)
    assert torch.equal(ls(x), x * 0.1)
    assert [n for n, _ in ls.named_parameters()] == ["gamma"]
    with pytest.raises(TypeError):
        LayerScale(2.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [_dinov2, _registers])
def test_resized_positions_in_bfloat16_as_transformers(make: Any) -> None:
    """The resize runs in float32 and is cast back: bf16 positions equal transformers' bit for bit."""
    base = T.Dinov2Model if make is _dinov2 else T.Dinov2WithRegistersModel
    hf = vc.hf_vision(make(), base).to(torch.bfloat16)
    ours = from_hf(hf)
    for h, w in ((16, 40), (48, 48), (8, 16)):
        tokens = torch.zeros(1, 1 + (h // 8) * (w // 8), 32, dtype=torch.bfloat16)
        with torch.no_grad():
            want = hf.embeddings.interpolate_pos_encoding(tokens, h, w)
        assert torch.equal(ours.embedding.positions(h // 8, w // 8), want.reshape(1, -1, 32))
