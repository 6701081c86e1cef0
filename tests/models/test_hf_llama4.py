"""Llama-4 (text) through ``from_hf``: chunked attention (by position, under left padding too),
NoPE layers with the attention temperature, the L2 QK-norm, interleaved RoPE served by permuted
q/k rows, MoE layers (sigmoid routing on the inputs + shared expert) interleaved with dense
ones; equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import CheckpointFormatError, from_hf  # noqa: E402
from attnzoo.models.families.llama4 import Llama4Attention  # noqa: E402
from attnzoo.nn.moe import MixtureOfExperts  # noqa: E402

T = transformers


def _config(**kw: Any) -> Any:
    small = {**checks.SMALL, "intermediate_size": 32, "intermediate_size_mlp": 96}
    return T.Llama4TextConfig(**{**small, "num_hidden_layers": 4, "head_dim": 16, "num_local_experts": 4,
                                 "num_experts_per_tok": 1, "attention_chunk_size": 8, "floor_scale": 4,
                                 "attn_scale": 0.5, "rope_theta": 5000.0, **kw})


CASES = {
    "moe_every_layer": _config,
    "interleaved_dense_llama3_rope": lambda: _config(
        interleave_moe_layer_step=2, moe_layers=None, num_experts_per_tok=2, attention_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5000.0, "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}


def test_layer_structure() -> None:
    ours = from_hf(checks.hf_model(CASES["interleaved_dense_llama3_rope"]()))
    attn = [b.attn for b in ours.blocks]
    assert all(isinstance(a, Llama4Attention) for a in attn)
    assert [a.chunk_size for a in attn] == [8, 8, 8, None]
    assert [a.rope is None for a in attn] == [False, False, False, True]
    assert [a.temperature is not None for a in attn] == [False, False, False, True]
    assert [isinstance(b.ffn, MixtureOfExperts) for b in ours.blocks] == [False, True, False, True]


def test_chunks_follow_positions() -> None:
    """A query at position p sees exactly the earlier keys of its chunk [8 * (p // 8), p]."""
    a = Llama4Attention(16, 2, 1, 8, chunk_size=4)
    pos = torch.arange(10)[None]
    allowed = a._allowed(None, pos, pos, 0)[0, 0] & torch.ones(10, 10, dtype=torch.bool).tril()
    for p in range(10):
        assert allowed[p].nonzero().flatten().tolist() == list(range(4 * (p // 4), p + 1))


def test_malformed_no_rope_layers_is_named() -> None:
    hf = T.Llama4ForCausalLM(_config())
    hf.config.no_rope_layers = [1]
    with pytest.raises(CheckpointFormatError, match="no_rope_layers has 1 entries for 4 layers"):
        from_hf(hf)


def test_packed_sequences_equal_each_alone() -> None:
    ours = from_hf(checks.hf_model(_config()))
    seqs = [checks.tokens(n, batch=1, seed=30 + n) for n in (9, 4, 12)]
    cu = torch.tensor([0, 9, 13, 25], dtype=torch.int32)
    with torch.no_grad():
        packed = ours(torch.cat(seqs, dim=1), cu_seqlens=cu)
        alone = torch.cat([ours(s) for s in seqs], dim=1)
    assert checks.rel(packed, alone) <= 1e-5


class TestLlama4(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (CASES["interleaved_dense_llama3_rope"],)
