"""Muse Glimmer's text decoder (``muse_glimmer_text``, ``families/muse.py``) through its wrapper
(``MuseGlimmerForConditionalGeneration``). The wrapper's shared checks (logits and base hidden states on a
left-padded batch, greedy generation, folders, ``to_hf``) run in ``test_hf_multimodal.py``; here: the parts
the family composes (NoPE layers, the scale and the head's multiplier, the post norms' epsilon), cached
decoding, and the refusals."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.hf.errors import UnsupportedConfigError  # noqa: E402

T = transformers
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*the text decoder of Muse .* is converted")]

VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
              out_hidden_size=16)


def _text(**kw: Any) -> dict[str, Any]:
    """Five layers (full + NoPE on layers 0 and 4, sliding with a 4-token window between), head_dim 16,
    every scale away from its default."""
    return {**checks.SMALL, "num_hidden_layers": 5, "head_dim": 16, "sliding_window": 4, "qk_scale_factor": 2.5,
            "output_multiplier": 0.7, "final_logit_softcapping": 3.0, "post_norm_eps": 1e-6, **kw}


def _glimmer(**kw: Any) -> Any:
    """Muse Glimmer around :func:`_text` (``kw`` added to the text config)."""
    return T.MuseGlimmerConfig(text_config=_text(**kw), vision_config=VISION, out_hidden_size=16,
                               projector_hidden_size=16)


def _converted(config: Any) -> tuple[Any, Any]:
    hf = checks.hf_model(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf, from_hf(hf)


def test_the_default_layers_are_full_and_nope_every_fourth_from_the_last() -> None:
    hf, ours = _converted(_glimmer())
    assert hf.config.text_config.layer_types == ["full_attention", *["sliding_attention"] * 3, "full_attention"]
    assert [b.attn.rope is None for b in ours.blocks] == [True, False, False, False, True]
    assert [b.attn.window and b.attn.window[0] for b in ours.blocks] == [None, 3, 3, 3, None]
    assert [b.attn_out_norm.eps for b in ours.blocks] == [1e-6] * 5


@pytest.mark.parametrize("kw", [{}, {"attention_bias": True, "tie_word_embeddings": True},
                                {"layer_types": ["sliding_attention"] * 5, "layer_rope_theta": [1e4] * 5},
                                {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}],
                         ids=["default", "biases-tied", "all-sliding-rotated", "linear-rope"])
def test_logits_and_cached_decoding_equal_transformers(kw: dict[str, Any]) -> None:
    hf, ours = _converted(_glimmer(**kw))
    x, mask = checks.padded(20, pad=3)
    real = mask.bool()
    with torch.no_grad():
        want = hf(input_ids=x, attention_mask=mask).logits
        assert checks.rel(ours(x, attention_mask=real)[real], want[real]) <= 1e-5
    checks.check_cached_decode(lambda: _glimmer(**kw))


def test_the_head_multiplier_and_softcap_apply_only_with_a_head() -> None:
    """The base model's hidden states are the final norm's (the multiplier is folded into it only
    where a head follows)."""
    config = _glimmer()
    torch.manual_seed(0)
    base = checks.perturbed(T.AutoModel.from_config(config, attn_implementation="eager").eval(), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = from_hf(base)
    x = checks.tokens(10, batch=2)
    with torch.no_grad():
        assert checks.rel(ours.hidden_states(x), base(input_ids=x).last_hidden_state) <= 1e-5


@pytest.mark.parametrize(("kw", "match"), [
    ({"layer_rope_theta": [0, 5e5, 1e4, 1e4, 0]}, r"layer_rope_theta=.*global rope_theta 10000"),
    ({"layer_rope_theta": [0, 1e4]}, r"layer_rope_theta=.*5 entries"),
    ({"layer_types": ["chunked_attention"] * 5}, r"'chunked_attention'"),
])
def test_what_attnzoo_cannot_reproduce_is_refused_by_name(kw: dict[str, Any], match: str) -> None:
    hf = checks.hf_model(_glimmer())
    for key, value in kw.items():
        setattr(hf.config.text_config, key, value)
    with pytest.raises(UnsupportedConfigError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from_hf(hf)
