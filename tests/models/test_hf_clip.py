"""CLIP (``families/clip.py``) against transformers' eager models: the vision tower (``CLIPVisionModel``,
``CLIPVisionModelWithProjection``, ``CLIPForImageClassification``, ``CLIPModel``'s image features) at the
config's size, at other sizes (square and not: interpolated positions), for every option that changes
the math (activations, epsilon, channels, patch size, classes); the text tower (``CLIPTextModel``,
``CLIPTextModelWithProjection``) on padded batches with its pooled output under both of transformers'
end-of-text rules; folders, ``to_hf``, bfloat16, refusals."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_encoder_checks as ec  # noqa: E402
import hf_vision_checks as vc  # noqa: E402
from attnzoo.interop import UnsupportedConfigError, from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.clip import (  # noqa: E402
    EOSPooler,
    convert_clip,
    convert_clip_text,
    convert_clip_vision,
)
from attnzoo.models.hf._state import HFConfig  # noqa: E402
from hf_family_checks import V, rel  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")
EOS = V - 1  # the non-legacy end-of-text id of the text configs (the largest id: tokenizer-like rows)


def _vision(cls: Any = T.CLIPVisionConfig, **kw: Any) -> Any:
    base = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
            "image_size": 32, "patch_size": 8, "projection_dim": 24}
    return cls(**{**base, **kw})


def _text(cls: Any = T.CLIPTextConfig, **kw: Any) -> Any:
    base = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 16, "projection_dim": 24, "bos_token_id": 0,
            "pad_token_id": ec.PAD, "eos_token_id": 2}
    return cls(**{**base, **kw})


def _clip(num_labels: int = 3, cls: Any = T.CLIPConfig, **vision: Any) -> Any:
    """A ``CLIPConfig`` (``cls``: or MetaCLIP 2's) of the text and vision configs above."""
    text, image = (T.MetaClip2TextConfig, T.MetaClip2VisionConfig) if cls is T.MetaClip2Config else \
        (T.CLIPTextConfig, T.CLIPVisionConfig)
    return cls(text_config=_text(text).to_dict(), vision_config=_vision(image, **vision).to_dict(), projection_dim=20,
               num_labels=num_labels)


def _meta_vision() -> Any:
    return _vision(T.MetaClip2VisionConfig)


def _meta_clip() -> Any:
    return _clip(cls=T.MetaClip2Config)


def _meta_text(**kw: Any) -> Any:
    return _text(T.MetaClip2TextConfig, **kw)


def _chinese_vision() -> Any:
    return _vision(T.ChineseCLIPVisionConfig)


#: one transformers model per ``model_type`` added here, for the ``to_hf`` export sweep (the text tower
#: too: the sweep feeds it token ids)
VISION_SWEEP = {"clip_vision_model": lambda seed: vc.hf_vision(_vision(), T.CLIPVisionModelWithProjection, seed),
                "clip": lambda seed: vc.hf_vision(_clip(), T.CLIPForImageClassification, seed),
                "clip_text_model": lambda seed: ec.hf_encoder(_text(), T.CLIPTextModelWithProjection, seed),
                "metaclip_2_vision_model": lambda seed: vc.hf_vision(_meta_vision(), T.MetaClip2VisionModel, seed),
                "metaclip_2": lambda seed: vc.hf_vision(_meta_clip(), T.MetaClip2ForImageClassification, seed),
                "metaclip_2_text_model": lambda seed: ec.hf_encoder(_meta_text(), T.MetaClip2TextModel, seed),
                "chinese_clip_vision_model": lambda seed: vc.hf_vision(_chinese_vision(), T.ChineseCLIPVisionModel, seed)}
#: the text towers for the encoder sweep
SWEEP = {k: VISION_SWEEP[k] for k in ("clip_text_model", "metaclip_2_text_model")}


class TestCLIPVision(vc.VisionChecks):
    config = staticmethod(_vision)
    classes = (T.CLIPVisionModel, T.CLIPVisionModelWithProjection)
    other_size = 48
    other_kw = {"interpolate_pos_encoding": True}  # noqa: RUF012 (read only)
    cases = (lambda: _vision(hidden_act="gelu"),  # LAION's checkpoints
             lambda: _vision(hidden_act="gelu_pytorch_tanh"), lambda: _vision(layer_norm_eps=1e-2),
             lambda: _vision(num_channels=1), lambda: _vision(patch_size=16, projection_dim=8))

    def test_non_square_and_smaller_images(self) -> None:
        for size in ((16, 64), (24, 40), 16):  # (16, 64): the trained number of patches, another grid
            vc.check_vision(vc.hf_vision(_vision(), T.CLIPVisionModelWithProjection), size,
                            interpolate_pos_encoding=True)


@pytest.mark.filterwarnings("ignore:to_hf.*post_layernorm:UserWarning")  # unused by the classifier: kept
class TestCLIPClassifier(vc.VisionChecks):
    config = staticmethod(_clip)
    classes = (T.CLIPForImageClassification,)
    other_size = 48
    other_kw = {"interpolate_pos_encoding": True}  # noqa: RUF012 (read only)
    cases = (lambda: _clip(num_labels=0),  # an identity classifier: the mean of the patch tokens
             lambda: _clip(hidden_act="gelu", layer_norm_eps=1e-3))


def _image_features(hf: Any, images: torch.Tensor, **kw: Any) -> Any:
    with torch.no_grad():
        return hf.get_image_features(pixel_values=images, **kw)


def _from_clip_model(hf: Any) -> Any:
    with pytest.warns(UserWarning, match=r"text_model\.\* \(\d+ tensors\), text_projection.weight, logit_scale"):
        return from_hf(hf)


def test_clip_model_is_its_projected_vision_tower() -> None:
    hf = vc.hf_vision(_clip(), T.CLIPModel)
    ours = _from_clip_model(hf)
    for size, kw in ((32, {}), (48, {"interpolate_pos_encoding": True})):
        images = vc.pixels(size)
        want = _image_features(hf, images, **kw)  # 5.25: a BaseModelOutputWithPooling, the projection in pooler_output
        with torch.no_grad():
            assert rel(ours(images), want.pooler_output) <= vc.TOL
            assert rel(ours.forward_features(images), want.last_hidden_state) <= vc.TOL


def test_clip_model_folder_and_to_hf(tmp_path: Path) -> None:
    hf = vc.hf_vision(_clip(), T.CLIPModel)
    hf.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="text tower"):
        model = load_pretrained(tmp_path)
    images = vc.pixels()
    with torch.no_grad():
        assert rel(model(images), _image_features(hf, images).pooler_output) <= vc.TOL
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ec.check_to_hf(lambda seed: vc.hf_vision(_clip(), T.CLIPModel, seed))


class TestCLIPText(ec.EncoderChecks):
    config = staticmethod(_text)
    half_full_rows = True  # a causal tower: see hf_encoder_checks.check_half
    base = T.CLIPTextModel
    cases = (lambda: _text(hidden_act="gelu"), lambda: _text(layer_norm_eps=1e-2), lambda: _text(eos_token_id=EOS))
    drop = ("hidden_act", "layer_norm_eps", "attention_dropout")

    def test_projection_model_hidden_states_and_to_hf(self) -> None:
        ec.check_hidden(ec.hf_encoder(_text(), T.CLIPTextModelWithProjection))
        ec.check_to_hf(lambda seed: ec.hf_encoder(_text(), T.CLIPTextModelWithProjection, seed))


class TestMetaClip2Text(ec.EncoderChecks):
    config = staticmethod(_meta_text)
    half_full_rows = True
    base = T.MetaClip2TextModel
    drop = ("hidden_act", "layer_norm_eps")


class TestMetaClip2Vision(vc.VisionChecks):
    config = staticmethod(_meta_vision)
    classes = (T.MetaClip2VisionModel, T.MetaClip2VisionModelWithProjection)
    other_size = 48
    other_kw = {"interpolate_pos_encoding": True}  # noqa: RUF012 (read only)


@pytest.mark.filterwarnings("ignore:to_hf.*post_layernorm:UserWarning")
class TestMetaClip2Classifier(vc.VisionChecks):
    config = staticmethod(_meta_clip)
    classes = (T.MetaClip2ForImageClassification,)
    other_size = 48
    other_kw = {"interpolate_pos_encoding": True}  # noqa: RUF012 (read only)


class TestChineseCLIPVision(vc.VisionChecks):
    config = staticmethod(_chinese_vision)
    classes = (T.ChineseCLIPVisionModel,)
    other_size = 48
    other_kw = {"interpolate_pos_encoding": True}  # noqa: RUF012 (read only)


def test_metaclip_2_model_is_its_projected_vision_tower() -> None:
    hf = vc.hf_vision(_meta_clip(), T.MetaClip2Model)
    with pytest.warns(UserWarning, match="text tower"):
        ours = from_hf(hf)
    images = vc.pixels()
    with torch.no_grad():
        assert rel(ours(images), _image_features(hf, images).pooler_output) <= vc.TOL


def _pooled(hf: Any, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        r = hf(input_ids=x, attention_mask=mask)
    return r.text_embeds if hasattr(r, "text_embeds") else r.pooler_output


def _tokenizer_like(eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`hf_encoder_checks.batch` with each row's last real token the end-of-text id (the
    largest id, as CLIP's tokenizer writes it) and the ids before it below it."""
    x, mask = ec.batch()
    x = x.clamp(max=V - 2)
    last = torch.where(mask.bool(), torch.arange(x.shape[1]), -1).amax(dim=1)
    x[torch.arange(x.shape[0]), last] = eos
    return x.masked_fill(mask == 0, ec.PAD), mask


POOLED = [(_text, cls, eos) for cls in (T.CLIPTextModel, T.CLIPTextModelWithProjection) for eos in (2, EOS)] + [
    (_meta_text, cls, eos) for cls in (T.MetaClip2TextModel, T.MetaClip2TextModelWithProjection) for eos in (2, EOS)]


@pytest.mark.parametrize(("make", "cls", "eos"), POOLED)  # CLIP's eos 2: the legacy rule (the largest id)
def test_classify_is_the_pooled_output(make: Any, cls: Any, eos: int) -> None:
    hf = ec.hf_encoder(make(eos_token_id=eos), cls)
    ours = from_hf(hf)
    legacy = eos == 2 and make is _text
    x, mask = _tokenizer_like(V - 1 if legacy else eos)
    with torch.no_grad():
        hidden = ours(x, attention_mask=mask)
        assert rel(ours.classify(hidden, mask), _pooled(hf, x, mask)) <= vc.TOL
        free, _ = ec.batch(seed=3)  # any ids (several or no end-of-text ids): transformers' rule from the ids
        free[0, 2] = free[0, 5] = free[1, 7] = eos
        hidden = ours(free, attention_mask=mask)
        assert rel(ours.classifier(hidden, mask, tokens=free), _pooled(hf, free, mask)) <= vc.TOL


def test_pooler_index_without_a_mask_is_the_last_slot() -> None:
    hidden = torch.randn(2, 5, 4)
    assert EOSPooler(7).index(hidden).tolist() == [4, 4]
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    assert EOSPooler(7).index(hidden, mask).tolist() == [2, 4]


def test_packed_encode_equals_the_padded_forward() -> None:
    ours = from_hf(ec.hf_encoder(_text(), T.CLIPTextModel))
    x, mask = ec.batch()
    mask[1], x[1] = 1, x[2]  # right-padded rows only
    with torch.no_grad():
        assert rel(ours.encode(x, mask, packed=True), ours.encode(x, mask)) <= vc.TOL


@pytest.mark.parametrize(("convert", "data", "what"), [
    (convert_clip_vision, {"hidden_act": "relu6"}, "hidden_act"),
    (convert_clip_vision, {"image_size": [32, 48]}, "image_size"),
    (convert_clip_vision, {"patch_size": [8, 8]}, "patch_size"),
    (convert_clip, {"vision_config": {"hidden_act": "tanh"}}, "hidden_act"),
    (convert_clip_text, {"eos_token_id": [2, 3]}, "eos_token_id"),
    (convert_clip_text, {"hidden_act": "mish"}, "hidden_act"),
])
def test_refused_options(convert: Any, data: dict[str, Any], what: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=what):
        convert(HFConfig(data, "config.json", "CLIP"), {}, device="meta", dtype=None)


def test_build_clip_vision_refuses_an_unknown_head() -> None:
    from attnzoo.models.families.clip import build_clip_vision
    from attnzoo.models.hf._state import HFConfig

    with pytest.raises(ValueError, match="head"):
        build_clip_vision(HFConfig(_clip().vision_config.to_dict(), "test"), head="cls")
