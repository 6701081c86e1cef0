"""Jamba (``JambaForCausalLM``) through ``from_hf``: Mamba-1 mixers with weighted RMSNorms on
dt, B and C, NoPE GQA attention layers every ``attn_layer_period``, a softmax-then-top-k mixture
of SwiGLU experts (kept probabilities not renormalised) every ``expert_layer_period``, dense
SwiGLU elsewhere; equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(**kw: Any) -> Any:
    """hidden 64, 4 layers: attention at 1 and 3, experts (4, top-2) at 1 and 3; state 8, inner 128,
    dt rank 4, conv biases."""
    return T.JambaConfig(**{**checks.SMALL, "num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1,
                            "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 4,
                            "num_experts_per_tok": 2, "mamba_d_state": 8, "mamba_expand": 2, "mamba_dt_rank": 4,
                            "rms_norm_eps": 1e-5, **kw})


def _other(**kw: Any) -> Any:
    """hidden 48, 5 layers: attention at 2, experts (3, top-2) at 0 and 3; no conv bias, kernel 3,
    in/out projection biases, dt rank "auto" (3), eps 1e-3 (large enough to matter), tied."""
    return _config(hidden_size=48, num_hidden_layers=5, attn_layer_period=3, attn_layer_offset=2,
                   expert_layer_period=3, expert_layer_offset=0, num_experts=3, mamba_dt_rank="auto",
                   mamba_conv_bias=False, mamba_proj_bias=True, mamba_d_conv=3, rms_norm_eps=1e-3,
                   tie_word_embeddings=True, use_mamba_kernels=False, **kw)


class TestJamba(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_other,)


def test_structure() -> None:
    from attnzoo.blocks import FeedForward, RMSNorm
    from attnzoo.interop import from_hf
    from attnzoo.models.families.mamba1 import Mamba1Mixer
    from attnzoo.nn.moe import MixtureOfExperts

    hf = checks.hf_model(_config())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert [isinstance(b.attn, Mamba1Mixer) for b in ours.blocks] == [True, False, True, False]
    assert [isinstance(b.ffn, MixtureOfExperts) for b in ours.blocks] == [False, True, False, True]
    assert isinstance(ours.blocks[0].ffn, FeedForward)
    assert all(b.attn.rope is None for b in ours.blocks[1::2])  # NoPE
    mixer = ours.blocks[0].attn
    assert mixer.mixer_rms_eps is None and mixer.in_proj.weight.shape == (256, 64)
    for name, width in (("dt_layernorm", 4), ("b_layernorm", 8), ("c_layernorm", 8)):
        norm = getattr(mixer, name)
        assert isinstance(norm, RMSNorm) and norm.weight.shape == (width,) and norm.eps == 1e-5
    torch.testing.assert_close(mixer.dt_layernorm.weight, hf.model.layers[0].mamba.dt_layernorm.weight)
    moe = ours.blocks[1].ffn
    assert (moe.num_experts, moe.top_k, moe.routing, moe.norm_topk_prob) == (4, 2, "softmax_topk", False)
    assert moe.shared_expert is None
    assert not ours.tie_embeddings
    other = from_hf(checks.hf_model(_other()))
    assert [isinstance(b.attn, Mamba1Mixer) for b in other.blocks] == [True, True, False, True, True]
    assert [isinstance(b.ffn, MixtureOfExperts) for b in other.blocks] == [True, False, False, True, False]
    assert other.tie_embeddings and other.blocks[0].attn.conv1d.bias is None
    assert other.blocks[0].attn.dt_rank == 3 and other.blocks[0].attn.in_proj.bias is not None


def test_a_single_expert_is_a_dense_mlp() -> None:
    """``num_experts == 1``: every feed-forward is the dense MLP (modeling 847-851)."""
    from attnzoo.blocks import FeedForward
    from attnzoo.interop import from_hf

    ours = from_hf(checks.hf_model(_config(num_experts=1, num_experts_per_tok=1)))
    assert all(isinstance(b.ffn, FeedForward) for b in ours.blocks)
    checks.check_logits(lambda: _config(num_experts=1, num_experts_per_tok=1), n=12)


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A ``config.json`` that leaves out ``JambaConfig``'s defaults (8 key/value heads, attention
    every 8th layer from 4, experts every 2nd from 1, 16 experts, the ``mamba_*`` sizes, SiLU,
    untied): read as transformers reads it."""
    hf = checks.hf_model(_config(num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                                 attn_layer_period=8, attn_layer_offset=4, num_experts=16, mamba_d_state=16))
    checks.check_folder_without_keys(hf, tmp_path, (
        "num_key_value_heads", "attn_layer_period", "attn_layer_offset", "expert_layer_period", "expert_layer_offset",
        "num_experts", "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_conv_bias", "mamba_proj_bias",
        "hidden_act", "tie_word_embeddings"))


@pytest.mark.parametrize(("key", "value", "named"), [("hidden_act", "gelu", "hidden_act")])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.JambaForCausalLM, _config, key, value, named)


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_config)


def test_packed_training_gradients_equal_each_alone() -> None:
    checks.check_packed_gradients_equal_each_alone(_other)
