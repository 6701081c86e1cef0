"""LFM3 through ``from_hf``: LFM2's gated short-convolution layers mixed with sliding-window and
full attention layers (per-head QK norms, a per-head sigmoid output gate, a rotary embedding per
kind: ``default`` and ``proportional``), sandwich norms; equal to transformers' eager (see
``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")

#: LFM3's own rope choice, at a base small enough to turn within the test's tokens
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}


def _config(**kw: Any) -> Any:
    """Every option on: conv / sliding / full layers, a window of 6 (shorter than the tests'
    sequences), sandwich norms, the attention gate, conv biases, tied embeddings."""
    return T.Lfm3Config(**{**checks.SMALL, "head_dim": 16, "num_hidden_layers": 6,
                           "layer_types": ["conv", "sliding_attention", "full_attention"] * 2, "sliding_window": 6,
                           "conv_bias": True, "conv_L_cache": 3, "use_sandwich_norm": True,
                           "use_attention_gate": True, "tie_word_embeddings": True, "rope_parameters": ROPE, **kw})


def _plain(**kw: Any) -> Any:
    """Every option off: no sandwich norms, no gate, no conv biases, untied; attention biases,
    kernel 4, eps 1e-6, window 5, a linear-scaled sliding rope and a proportional full rope with
    a quarter of the pairs turning and its frequencies divided by 2."""
    rope = {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "rope_theta": 1000.0, "partial_rotary_factor": 0.25,
                               "factor": 2.0}}
    return T.Lfm3Config(**{**checks.SMALL, "head_dim": 16, "intermediate_size": 80, "num_hidden_layers": 4,
                           "layer_types": ["sliding_attention", "conv", "full_attention", "sliding_attention"],
                           "sliding_window": 5, "conv_bias": False, "conv_L_cache": 4, "use_sandwich_norm": False,
                           "use_attention_gate": False, "tie_word_embeddings": False, "attention_bias": True,
                           "norm_eps": 1e-6, "rope_parameters": rope, **kw})


def _sandwich_without_gate() -> Any:
    return _config(use_attention_gate=False, conv_bias=False, tie_word_embeddings=False)


def _gate_without_sandwich() -> Any:
    return _config(use_sandwich_norm=False)


class TestLfm3(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_plain, _sandwich_without_gate, _gate_without_sandwich)


def test_cached_decode_with_every_option() -> None:
    checks.check_cached_decode(_config)


def test_structure() -> None:
    from attnzoo.interop import from_hf
    from attnzoo.models.families.lfm2 import Lfm2ShortConvMixer
    from attnzoo.models.families.lfm3 import ProportionalRotaryEmbedding
    from attnzoo.nn.attention import MultiHeadAttention
    from attnzoo.nn.positional import RotaryEmbedding, ScaledRotaryEmbedding

    ours = from_hf(checks.hf_model(_config()))
    assert [type(b.attn) for b in ours.blocks] == [Lfm2ShortConvMixer, MultiHeadAttention, MultiHeadAttention] * 2
    conv, sliding, full = ours.blocks[:3]
    assert conv.attn.conv.weight.shape == (64, 1, 3) and conv.attn.conv.bias is not None
    assert sliding.attn.window == (5, 5) and full.attn.window is None  # sliding_window - 1 keys back
    assert type(sliding.attn.rope) is RotaryEmbedding and type(full.attn.rope) is ProportionalRotaryEmbedding
    assert full.attn.rope.turning == 4
    assert sliding.attn.frontier.gate_proj.weight.shape == (4, 64) and sliding.attn.frontier.gate_proj.mode == "head"
    assert sliding.attn.frontier.q_norm_weight.shape == (16,) and sliding.attn.frontier.q_norm.eps == 1e-5
    assert all(isinstance(b.attn_out_norm, torch.nn.Module) and not isinstance(b.attn_out_norm, torch.nn.Identity)
               for b in ours.blocks)
    assert ours.tie_embeddings
    plain = from_hf(checks.hf_model(_plain()))
    assert all(isinstance(b.attn_out_norm, torch.nn.Identity) and isinstance(b.ffn_out_norm, torch.nn.Identity)
               for b in plain.blocks)
    assert plain.blocks[0].attn.frontier.gate_proj is None and plain.blocks[1].attn.conv.bias is None
    assert isinstance(plain.blocks[0].attn.rope, ScaledRotaryEmbedding) and plain.blocks[2].attn.rope.turning == 2
    assert plain.blocks[0].ffn.up_proj.weight.shape == (80, 64) and not plain.tie_embeddings


@pytest.mark.parametrize(("head_dim", "partial", "factor"), [(16, 0.5, 1.0), (16, 0.3, 2.0), (12, 1.0, 1.0),
                                                             (16, 0.0, 1.0), (20, 0.25, 1.0)])
def test_proportional_rope_equals_transformers(head_dim: int, partial: float, factor: float) -> None:
    """The rotation of q by :class:`ProportionalRotaryEmbedding` == transformers' proportional
    frequencies through LFM3's ``apply_rotary_pos_emb``, at positions 0..39 (within 1e-5:
    transformers takes the power in float32, attnzoo in float64)."""
    from attnzoo.models.families.lfm3 import ProportionalRotaryEmbedding

    rope = {"rope_type": "proportional", "rope_theta": 500.0, "partial_rotary_factor": partial, "factor": factor}
    config = _config(head_dim=head_dim, rope_parameters={**ROPE, "full_attention": rope})
    inv_freq, scaling = T.modeling_rope_utils.ROPE_INIT_FUNCTIONS["proportional"](config, layer_type="full_attention")
    assert scaling == 1.0
    ours = ProportionalRotaryEmbedding(head_dim, base=500.0, partial_rotary_factor=partial, factor=factor)
    pos = torch.arange(40)
    emb = torch.cat([pos[:, None].float() * inv_freq] * 2, dim=-1)[None]  # [1, N, D]
    q = torch.randn(2, 3, 40, head_dim, generator=torch.Generator().manual_seed(0))
    ref, _ = T.models.lfm3.modeling_lfm3.apply_rotary_pos_emb(q, q, emb.cos(), emb.sin())
    assert checks.rel(ours(q, pos), ref) <= 1e-5


def test_folder_with_the_defaults_left_out(tmp_path: Path) -> None:
    """A ``config.json`` without the keys whose values are ``Lfm3Config``'s defaults (the default
    layer pattern of 5 layers: conv, conv, full, conv, sliding; the default ropes, window, norms,
    gate, kernel) loads as transformers loads it."""
    config = T.Lfm3Config(**{**checks.SMALL, "head_dim": 16, "num_hidden_layers": 5})
    keys = ("layer_types", "rope_parameters", "sliding_window", "use_sandwich_norm", "use_attention_gate",
            "conv_bias", "conv_L_cache", "norm_eps", "tie_word_embeddings", "attention_bias", "attention_dropout")
    checks.check_folder_without_keys(checks.hf_model(config), tmp_path, keys)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("layer_types", ["conv", "linear_attention", "full_attention"] * 2, "layer type 'linear_attention'"),
    ("rope_parameters", {**ROPE, "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                                       "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5 with rope_type='linear'"),
    ("rope_parameters", {**ROPE, "full_attention": {**ROPE["full_attention"], "partial_rotary_factor": 1.5}},
     r"partial_rotary_factor must be a number in \[0, 1\]"),
    ("sliding_window", None, "sliding_attention layers without a sliding_window"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    """Each of these also fails in transformers' own forward (see the module docstring of
    ``families/lfm3.py``)."""
    checks.check_refused(T.Lfm3ForCausalLM, _config, key, value, named)


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_config)


def test_packed_training_gradients_equal_each_alone() -> None:
    checks.check_packed_gradients_equal_each_alone(_config)
