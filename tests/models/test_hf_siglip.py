"""SigLIP and SigLIP 2 vision towers (``families/siglip.py``) against transformers' eager models:
features and outputs of ``SiglipVisionModel``, ``SiglipForImageClassification``, ``SiglipModel`` (its
vision tower, ``get_image_features``) and ``Siglip2VisionModel`` (NaFlex, whole images) at the
config's image size and at other (non-square, smaller, larger) sizes with the resized positions, the
options that change the math, folders (also with the config's defaults left out), bf16, ``to_hf``,
the refusals and the :class:`AttentionPoolingHead` part."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

T = pytest.importorskip("transformers")

from transformers.models.siglip2.image_processing_pil_siglip2 import convert_image_to_patches  # noqa: E402

import hf_vision_checks as vc  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.siglip import (  # noqa: E402
    AttentionPoolingHead,
    convert_siglip,
    convert_siglip2_vision,
    convert_siglip_vision,
)
from attnzoo.models.hf._state import HFConfig  # noqa: E402
from attnzoo.models.hf.errors import CheckpointFormatError, UnsupportedConfigError  # noqa: E402
from hf_family_checks import rel  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
         "image_size": 32, "patch_size": 8}
TEXT = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
        "vocab_size": 64, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _vision(**kw: Any) -> Any:
    return T.SiglipVisionConfig(**{**SMALL, **kw})


def _siglip(num_labels: int = 3, **kw: Any) -> Any:
    return T.SiglipConfig(vision_config={**SMALL, **kw}, text_config=TEXT, num_labels=num_labels)


def _siglip2(**kw: Any) -> Any:
    small = {k: v for k, v in SMALL.items() if k != "image_size"}
    return T.Siglip2VisionConfig(**{**small, "num_patches": 16, **kw})


class WholeImages(T.Siglip2VisionModel):
    """``Siglip2VisionModel`` taking whole images ``[B, C, H, W]`` of one size, as attnzoo's forward
    does: patchified by the image processor's ``convert_image_to_patches``, no padding
    (``pixel_attention_mask`` all ones, ``spatial_shapes = (H/P, W/P)``)."""

    def forward(self, pixel_values: torch.Tensor, **kw: Any) -> Any:
        p = self.config.patch_size
        B, _, h, w = pixel_values.shape
        patches = torch.stack([torch.from_numpy(convert_image_to_patches(im.double().numpy(), p)) for im in pixel_values])
        patches = patches.to(pixel_values.dtype)  # numpy has no bfloat16: exact through float64
        return super().forward(pixel_values=patches, pixel_attention_mask=torch.ones(B, patches.shape[1], dtype=torch.long),
                               spatial_shapes=torch.tensor([[h // p, w // p]] * B), **kw)


class TestSiglipVision(vc.VisionChecks):
    config = staticmethod(_vision)
    classes = (T.SiglipVisionModel,)
    other_size = 48  # a larger grid: bicubic positions
    other_kw = {"interpolate_pos_encoding": True}  # noqa: RUF012 (read only)
    cases = (lambda: _vision(hidden_act="gelu", layer_norm_eps=1e-3, num_channels=1),
             lambda: _vision(hidden_act="relu", patch_size=4, num_attention_heads=2))


class TestSiglipClassifier(vc.VisionChecks):
    config = staticmethod(_siglip)
    classes = (T.SiglipForImageClassification,)
    other_size = (16, 40)  # non-square, smaller and larger sides
    other_kw = {"interpolate_pos_encoding": True}  # noqa: RUF012 (read only)
    cases = (lambda: _siglip(vision_use_head=False, hidden_act="gelu"),)

    def test_no_labels_is_the_mean(self) -> None:
        """``num_labels=0``: transformers' classifier is ``nn.Identity`` (logits = the mean of the
        tokens); its ``_init_weights`` fails on it in 5.25, so the classifier is removed after building."""
        hf = vc.hf_vision(_siglip(), T.SiglipForImageClassification)
        hf.classifier = torch.nn.Identity()
        hf.config.num_labels = 0
        assert from_hf(hf).head is None
        vc.check_vision(hf)


class TestSiglip2Vision(vc.VisionChecks):
    config = staticmethod(_siglip2)
    classes = (WholeImages,)
    other_size = (48, 24)  # taller (upsampled) and narrower (antialiased downsampling) than the 4 x 4 table
    cases = (lambda: _siglip2(num_patches=9, hidden_act="gelu", layer_norm_eps=1e-3),)

    def test_more_sizes(self) -> None:
        hf = vc.hf_vision(_siglip2(), WholeImages)
        for size in ((16, 24), (8, 64), (40, 40)):
            vc.check_vision(hf, size)

    def test_each_image_of_a_padded_naflex_batch(self) -> None:
        """A NaFlex batch of two sizes padded to 16 patches: each image converted alone gives
        transformers' real tokens and pooled output."""
        hf = vc.hf_vision(_siglip2(), T.Siglip2VisionModel)
        ours = from_hf(hf)
        images = [vc.pixels((16, 24), batch=1)[0], vc.pixels((32, 32), batch=1, seed=2)[0]]
        patches = [torch.from_numpy(convert_image_to_patches(im.numpy(), 8)) for im in images]
        mask = torch.zeros(2, 16, dtype=torch.long)
        padded = torch.zeros(2, 16, 192)
        for i, p in enumerate(patches):
            padded[i, : len(p)], mask[i, : len(p)] = p, 1
        with torch.no_grad():
            r = hf(pixel_values=padded, pixel_attention_mask=mask, spatial_shapes=torch.tensor([[2, 3], [4, 4]]))
            for i, im in enumerate(images):
                n = len(patches[i])
                assert rel(ours.forward_features(im[None]), r.last_hidden_state[i: i + 1, :n]) <= vc.TOL
                assert rel(ours(im[None]), r.pooler_output[i: i + 1]) <= vc.TOL


def test_siglip_model_converts_its_vision_tower(tmp_path: Path) -> None:
    """``SiglipModel``: ``forward`` = ``get_image_features(...).pooler_output`` (a
    ``BaseModelOutputWithPooling`` in 5.25), ``forward_features`` its ``last_hidden_state``; the text
    tower named in a warning; from a folder as well."""
    hf = vc.hf_vision(T.SiglipConfig(vision_config=SMALL, text_config=TEXT), T.SiglipModel)
    images = vc.pixels()
    with pytest.warns(UserWarning, match=r"vision tower.*text_model\.\*, logit_scale, logit_bias"):
        ours = from_hf(hf)
    hf.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="text tower"):
        loaded = load_pretrained(tmp_path)
    with torch.no_grad():
        want = hf.get_image_features(pixel_values=images)
        assert isinstance(want, T.modeling_outputs.BaseModelOutputWithPooling)
        for model in (ours, loaded):
            assert rel(model(images), want.pooler_output) <= vc.TOL
            assert rel(model.forward_features(images), want.last_hidden_state) <= vc.TOL
        embeds = hf(pixel_values=images, input_ids=torch.ones(1, 4, dtype=torch.long)).image_embeds
        assert rel(torch.nn.functional.normalize(ours(images), dim=-1), embeds) <= vc.TOL
    with pytest.warns(UserWarning, match="text tower"):
        vc.check_to_hf(lambda seed: vc.hf_vision(T.SiglipConfig(vision_config=SMALL, text_config=TEXT),
                                                 T.SiglipModel, seed))


@pytest.mark.parametrize("make", [lambda: vc.hf_vision(_vision(vision_use_head=False), T.SiglipVisionModel),
                                  lambda: vc.hf_vision(_siglip2(vision_use_head=False), WholeImages)])
def test_no_pooling_head_features_and_mean(make: Any) -> None:
    """``vision_use_head=False`` (PaliGemma's tower): transformers' ``pooler_output`` is ``None``; the
    features match and ``forward`` is their mean."""
    hf = make()
    ours = from_hf(hf)
    images = vc.pixels((32, 16))
    with torch.no_grad():
        r = hf(pixel_values=images, **({} if isinstance(hf, WholeImages) else {"interpolate_pos_encoding": True}))
        assert r.pooler_output is None
        assert rel(ours.forward_features(images), r.last_hidden_state) <= vc.TOL
        assert rel(ours(images), r.last_hidden_state.mean(1)) <= vc.TOL
    assert not any(n.startswith("head.") for n, _ in ours.named_parameters())


def test_image_size_not_a_multiple_of_the_patch() -> None:
    """so400m-style ``image_size=384, patch_size=14``: the ``"valid"`` convolution reads only the
    first ``27 * 14`` pixels; attnzoo takes the image cropped to them (and refuses the full one)."""
    hf = vc.hf_vision(_vision(image_size=36), T.SiglipVisionModel)
    ours = from_hf(hf)
    images = vc.pixels(36)
    with torch.no_grad():
        want = hf(pixel_values=images)
        assert rel(ours.forward_features(images[..., :32, :32]), want.last_hidden_state) <= vc.TOL
        assert rel(ours(images[..., :32, :32]), want.pooler_output) <= vc.TOL
    with pytest.raises(ValueError, match="not divisible by the patch size"):
        ours(images)


def test_transformers_4_prefix_and_defaults_left_out(tmp_path: Path) -> None:
    """A ``SiglipVisionModel`` folder of transformers 4 (``vision_model.`` prefix) with the config's
    defaults left out of ``config.json`` loads."""
    hf = vc.hf_vision(_vision(), T.SiglipVisionModel)
    sd = {f"vision_model.{k}": v for k, v in hf.state_dict().items()}
    data = {"model_type": "siglip_vision_model", **{k: v for k, v in SMALL.items() if k != "hidden_size"},
            "hidden_size": 32}
    ours = convert_siglip_vision(HFConfig(data, "config.json", "SigLIP vision"), sd, device=None, dtype=None)
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items()
                                if k not in ("hidden_act", "layer_norm_eps", "vision_use_head", "num_channels")}))
    images = vc.pixels()
    with torch.no_grad():
        want = hf(pixel_values=images).pooler_output
        assert rel(ours(images), want) <= vc.TOL
        assert rel(load_pretrained(tmp_path)(images), want) <= vc.TOL


def test_refusals() -> None:
    with pytest.raises(UnsupportedConfigError, match="hidden_act='quick_gelu'"):
        from_hf(vc.hf_vision(_vision(hidden_act="quick_gelu"), T.SiglipVisionModel))
    with pytest.raises(UnsupportedConfigError, match="num_attention_heads=5"):
        convert_siglip_vision(HFConfig({**SMALL, "num_attention_heads": 5}, "c", "SigLIP vision"), {},
                              device=None, dtype=None)
    with pytest.raises(UnsupportedConfigError, match="num_patches=15"):
        from_hf(vc.hf_vision(_siglip2(num_patches=15), T.Siglip2VisionModel))
    with pytest.raises(UnsupportedConfigError, match=r"patch_size=\[8, 8\]"):
        convert_siglip2_vision(HFConfig({**SMALL, "patch_size": [8, 8]}, "c", "SigLIP2 vision"), {},
                               device=None, dtype=None)
    with pytest.raises(CheckpointFormatError, match="vision_config"):
        convert_siglip(HFConfig({"model_type": "siglip"}, "c", "SigLIP"), {}, device=None, dtype=None)


def test_attention_pooling_head_is_torch_multihead_attention_pooling() -> None:
    """:class:`AttentionPoolingHead` = ``nn.MultiheadAttention(probe, x, x)`` + LayerNorm/MLP residual,
    padded keys ignored as ``key_padding_mask``; a width the heads do not divide is refused."""
    torch.manual_seed(0)
    C, H = 16, 4
    mlp = torch.nn.Sequential(torch.nn.Linear(C, 24), torch.nn.GELU(), torch.nn.Linear(24, C))
    head = AttentionPoolingHead(C, H, mlp=mlp, norm=torch.nn.LayerNorm(C))
    ref = torch.nn.MultiheadAttention(C, H, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([head.attn.q_proj.weight, head.attn.kv_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([head.attn.q_proj.bias, head.attn.kv_proj.bias]).normal_())
        head.attn.q_proj.bias.copy_(ref.in_proj_bias[:C])
        head.attn.kv_proj.bias.copy_(ref.in_proj_bias[C:])
        ref.out_proj.load_state_dict(head.attn.out_proj.state_dict())
        x = torch.randn(3, 7, C)
        keep = torch.ones(3, 7, dtype=torch.bool)
        keep[1, 4:] = False
        h = ref(head.probe.expand(3, -1, -1), x, x, key_padding_mask=~keep)[0]
        want = (h + mlp(head.norm(h)))[:, 0]
        assert head(x, keep).shape == (3, C)
        assert rel(head(x, keep), want) <= 1e-5
        assert rel(head(x[1:2, :4]), want[1:2]) <= 1e-5
    with pytest.raises(ValueError, match="divisible"):
        AttentionPoolingHead(10, 4, mlp=mlp, norm=torch.nn.LayerNorm(10))
    with pytest.raises(ValueError, match=r"\[B, T, 16\]"):
        head(torch.randn(2, 16))


#: model_type -> a maker of the transformers model (the ``to_hf`` export sweep)
VISION_SWEEP = {"siglip_vision_model": lambda seed: vc.hf_vision(_vision(), T.SiglipVisionModel, seed),
                "siglip": lambda seed: vc.hf_vision(_siglip(), T.SiglipForImageClassification, seed),
                "siglip2_vision_model": lambda seed: vc.hf_vision(_siglip2(), WholeImages, seed)}
