"""Qwen4-Exp (text) through ``from_hf``: hyper-connected streams with gated read/write-back, gated
DeltaNet and indexed (QSA-selected) attention layers, the sparse MoE on every layer and per-layer
n-gram embeddings (PLE); equal to transformers' eager (see ``hf_family_checks``). The indexer's
budget is below the test lengths, so the key selection shapes the logits."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.families.qwen3_next import QwenGatedDeltaNet  # noqa: E402
from attnzoo.models.families.qwen4_exp import IndexedAttention, PerLayerEmbedding  # noqa: E402
from attnzoo.nn.moe import MixtureOfExperts  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")
LINEAR, INDEXED = "linear_attention", "indexed_attention"


def _config(**kw: Any) -> Any:
    small = {k: v for k, v in checks.SMALL.items() if k != "intermediate_size"}  # MoE only: no such key
    return T.Qwen4ExpTextConfig(**{
        **small, "num_hidden_layers": 4, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 24, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "hc_count": 2, "hc_lowrank": 8, "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16,
        "indexer_budget": 4, "indexer_compress_ratio": 2, "layer_types": [LINEAR, INDEXED, LINEAR, INDEXED],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "ple_layer_ids": [1, 3], "ple_embed_dim": 32, "heads_per_ngram": 2, "ngram_vocab_size_base": 50,
        "make_ngram_vocab_size_divisible_by": 8, "split_ngram_parts": 2, **kw})


def _no_ple() -> Any:
    """Three streams, blocks of 4 keys (budget 8), no PLE, top-k weights not renormalised, the
    default layer pattern (every 4th layer indexed)."""
    return _config(hc_count=3, indexer_budget=8, indexer_compress_ratio=4, ple_layer_ids=None, layer_types=None,
                   full_attention_interval=2, norm_topk_prob=False, eos_token_id=None)


def _trigram_ple() -> Any:
    """PLE on the first layer only, 4-grams, a kernel-3 dilated conv; the last layer linear."""
    return _config(ple_layer_ids=[1], ngram_size=4, heads_per_ngram=1, ple_embed_dim=24, ple_conv_kernel_size=3,
                   layer_types=[LINEAR, INDEXED, INDEXED, LINEAR], indexer_n_heads=2)


def _selections(hf: Any, ours: Any, x: torch.Tensor, mask: torch.Tensor) -> tuple[list[Any], list[Any]]:
    """The key-selection masks ``[B, 1, N, N]`` of every indexed layer: transformers' and ours."""
    theirs, mine = [], []
    hooks = [m.register_forward_hook(lambda _m, _i, out: theirs.append(out))
             for m in hf.modules() if type(m).__name__ == "Qwen4ExpTextQSAIndexer"]
    hooks += [b.attn.mixer.indexer.register_forward_hook(lambda _m, _i, out: mine.append(out))
              for b in ours.blocks if isinstance(b.attn.mixer, IndexedAttention)]
    with torch.no_grad():
        hf(input_ids=x, attention_mask=mask)
        ours(x, attention_mask=mask.bool())
    for h in hooks:
        h.remove()
    return theirs, mine


@pytest.mark.parametrize("make", [_config, _no_ple, _trigram_ple])
def test_selection_equals_transformers(make: Any) -> None:
    """Every query of a left-padded batch selects the same keys as transformers' indexer, and the
    budget drops keys (the selection matters). With two index heads (``_trigram_ple``) four queries
    have blocks tied at 0 across the cut: they pick the blocks transformers' ``torch.topk`` picks."""
    hf = checks.hf_model(make())
    ours = from_hf(hf)
    x, mask = checks.padded(30)
    theirs, mine = _selections(hf, ours, x, mask)
    assert len(theirs) == len(mine) == sum(t == INDEXED for t in hf.config.layer_types)
    visible = torch.tril(torch.ones(30, 30, dtype=torch.bool)) & mask.bool()[:, None, :]
    for t, m in zip(theirs, mine, strict=True):
        assert torch.equal(t[:, 0], m[:, 0]), "selection differs from transformers'"
        assert int(m.sum()) < 0.6 * int(visible.sum()), "the budget should drop keys"


def test_eos_inside_the_sequence_restarts_the_ngrams() -> None:
    """Documents joined by ``eos``: the n-gram history stops at each ``eos`` (as transformers')."""
    hf = checks.hf_model(_trigram_ple())
    x = checks.tokens(24)
    x[:, [6, 7, 15]] = hf.config.eos_token_id
    with torch.no_grad():
        assert checks.rel(from_hf(hf)(x), hf(input_ids=x).logits) <= checks.TOL


def test_layer_structure() -> None:
    ours = from_hf(checks.hf_model(_config()))
    assert [isinstance(b.attn.mixer, QwenGatedDeltaNet) for b in ours.blocks] == [True, False, True, False]
    assert [isinstance(b.attn.ple, PerLayerEmbedding) for b in ours.blocks] == [True, False, True, False]
    assert all(isinstance(b.ffn.ffn, MixtureOfExperts) and b.ffn.ffn.norm_topk_prob for b in ours.blocks)


def test_layer_pattern_without_layer_types() -> None:
    ours = from_hf(checks.hf_model(_no_ple()))
    assert [isinstance(b.attn.mixer, IndexedAttention) for b in ours.blocks] == [False, True, False, True]
    assert not ours.blocks[0].ffn.ffn.norm_topk_prob


@pytest.mark.parametrize(("key", "value", "named"), [
    ("output_gate_type", "sigmoid", "output_gate_type='sigmoid'"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("attention_bias", True, "attention_bias=True"),
    ("indexer_budget", 5, "indexer_budget=5"),
])
def test_unsupported_options_are_named(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.Qwen4ExpForCausalLM, _config, key, value, named)


def test_packed_sequences_equal_each_alone() -> None:
    """Packed input runs every mixer (PLE included) one sequence at a time: equal to each alone.
    (transformers' eager model has no packed path for these layers.)"""
    checks.check_packed_equals_each_alone(_config)


def test_packed_gradients_equal_each_alone() -> None:
    """``checks.check_packed_gradients_equal_each_alone`` where the indexers' weights get no gradient:
    their selection is a boolean mask (in transformers too), so only the other weights are compared."""
    ours = from_hf(checks.hf_model(_config())).double().train()
    lengths = (6, 9, 3)
    seqs = [checks.tokens(n, batch=1, seed=20 + i) for i, n in enumerate(lengths)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    names, params = zip(*ours.named_parameters(), strict=True)

    def grads(logits: list[torch.Tensor]) -> tuple[Any, ...]:
        loss = sum(F.cross_entropy(lg[0, :-1], s[0, 1:], reduction="sum") for lg, s in zip(logits, seqs, strict=True))
        return torch.autograd.grad(loss, params, allow_unused=True)

    packed = ours(torch.cat(seqs, dim=1), cu_seqlens=cu)
    got = grads([packed[:, int(a):int(b)] for a, b in itertools.pairwise(cu)])
    want = grads([ours(s) for s in seqs])
    assert {n for n, g in zip(names, want, strict=True) if g is None} == {n for n in names if ".indexer." in n}
    assert max(checks.rel(g, w) for g, w in zip(got, want, strict=True) if w is not None and w.abs().max() > 0) <= 1e-9


def test_cached_decode_with_ple_equals_full_forward() -> None:
    checks.check_cached_decode(_config, n=22, prefill=3)


class TestQwen4Exp(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_trigram_ple, _no_ple)
