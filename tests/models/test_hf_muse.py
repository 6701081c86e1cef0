"""Meta's Muse Glimmer (``muse_glimmer``, its text model ``muse_glimmer_text``) and Muse Spark
(``muse_spark``, ``muse_spark_text``: the MoE sibling) through ``from_hf`` /
``load_pretrained``: a weight-less normed embedding, weight-less QK norms with ``qk_scale_factor``, NoPE
layers by ``layer_rope_theta``, sliding layers, an element-wise output gate, ``1 + w`` norms on both
sides of both sub-layers (``post_norm_eps`` after them), logits times ``output_multiplier`` under a
soft cap; equal to transformers' eager ``MuseGlimmerForConditionalGeneration`` on text. Muse Spark adds
a weight-less norm of the attention output, input-scaled norms, clamped residual gates and a pooled MoE
(dense and sparse layers mixed here). The wrappers' ``to_hf`` and saved folders are in
``test_hf_multimodal.py``'s cases ``muse_glimmer`` and ``muse_spark``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import UnsupportedConfigError, from_hf  # noqa: E402

T = transformers
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*the text decoder of Muse (Glimmer|Spark) is converted")]

#: a one-layer vision tower
VISION = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2)


def _text(**kw: Any) -> dict[str, Any]:
    """5 layers: by default full (NoPE), sliding x3, full (NoPE) (every 4th from the last); a window of 6, a large
    ``qk_scale_factor`` and a small soft cap so both act."""
    return {**checks.SMALL, "num_hidden_layers": 5, "head_dim": 16, "sliding_window": 6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "final_logit_softcapping": 5.0, **kw}


def _glimmer(**kw: Any) -> Any:
    return T.MuseGlimmerConfig(text_config=_text(**kw), vision_config=dict(VISION), out_hidden_size=16,
                               projector_hidden_size=16)


def _glimmer_other() -> Any:
    """Biases on q/k/v/o, one key/value head, every layer full with RoPE, a larger output multiplier."""
    return _glimmer(attention_bias=True, num_key_value_heads=1, layer_types=["full_attention"] * 5,
                    layer_rope_theta=[10000.0] * 5, output_multiplier=0.7, qk_scale_factor=1.5)


def _spark(**kw: Any) -> Any:
    """Muse Spark: :func:`_text` with 4 experts (top 2) at a pooled width of 32, dense layers 0 and 3."""
    text = _text(moe_intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, moe_hidden_size=32,
                 routed_scaling_factor=1.5, mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"], **kw)
    audio = dict(patch_sizes=[2], hidden_sizes=[8], depths=[1], num_hidden_layers=1,
                 out_hidden_size=text["hidden_size"])
    return T.MuseSparkConfig(text_config=text, vision_config=dict(VISION), audio_config=audio, out_hidden_size=16,
                             projector_hidden_size=16)


def _spark_case() -> Any:
    """The ``muse_spark`` case of ``test_hf_multimodal.py`` (whose bound is 1e-5): :func:`_spark` with
    ``qk_scale_factor`` 2 (the default 5.47 sharpens the softmax of unit-norm q, k enough to carry
    float32 rounding to ~1e-5 over five layers: 1.2e-6 at 1.0, 8.7e-6 at 5.47)."""
    return _spark(qk_scale_factor=2.0)


def _spark_other() -> Any:
    """Biases, one key/value head, every layer full with RoPE, a residual gate hot enough to clamp."""
    return _spark(attention_bias=True, num_key_value_heads=1, layer_types=["full_attention"] * 5,
                  layer_rope_theta=[10000.0] * 5, residual_gate_temperature=0.02, output_multiplier=0.7)


@pytest.mark.parametrize("make", [_glimmer, _glimmer_other, _spark, _spark_other])
def test_logits_cached_decode_and_generation_equal_transformers(make: Any) -> None:
    checks.check_logits(make)
    checks.check_cached_decode(make)
    checks.check_generation(make)


def test_the_text_model_alone(tmp_path: Path) -> None:
    """``MuseGlimmerTextModel`` / ``MuseSparkTextModel`` convert as the base decoder; a folder of
    ``model_type`` ``muse_glimmer_text`` / ``muse_spark_text`` (the text model with its head) loads as
    the wrapper's text model."""
    checks.check_text_model_alone(checks.hf_model(_glimmer()), tmp_path / "glimmer", "muse_glimmer_text",
                                  prefix="model.language_model.")
    checks.check_text_model_alone(checks.hf_model(_spark()), tmp_path / "spark", "muse_spark_text",
                                  prefix="model.language_model.")


def test_nope_and_sliding_layers_are_built_as_transformers_builds_them() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = from_hf(checks.hf_model(_glimmer()))
    assert [b.attn.rope is None for b in ours.blocks] == [True, False, False, False, True]
    assert [b.attn.window is None for b in ours.blocks] == [True, False, False, False, True]


@pytest.mark.parametrize(("key", "value", "named"), [
    ("tie_word_embeddings", True, "tie_word_embeddings"),
    ("layer_rope_theta", [0, 5e5, 0, 1e4, 0], "layer_rope_theta"),
    ("layer_rope_theta", [0, 1e4], "layer_rope_theta"),
    ("final_logit_softcapping", None, "final_logit_softcapping"),
    ("layer_types", ["chunked_attention"] * 5, "chunked_attention"),
    ("hidden_activation", "relu", "relu"),
])
def test_refused_by_name(key: str, value: Any, named: str) -> None:
    hf = T.MuseGlimmerTextModel(T.MuseGlimmerTextConfig(**_text()))
    hf.config.__dict__[key] = value
    with pytest.raises(UnsupportedConfigError, match=named):
        from_hf(hf)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hidden_act", "gelu", "gelu"),
    ("mlp_layer_types", ["dense", "moe", "sparse", "dense", "sparse"], "moe"),
    ("tie_word_embeddings", True, "tie_word_embeddings"),
])
def test_spark_refused_by_name(key: str, value: Any, named: str) -> None:
    hf = T.MuseSparkTextModel(_spark().text_config)
    hf.config.__dict__[key] = value
    with pytest.raises(UnsupportedConfigError, match=named):
        from_hf(hf)


@pytest.mark.parametrize("make", [_glimmer, _spark])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    checks.check_packed_equals_each_alone(make)
