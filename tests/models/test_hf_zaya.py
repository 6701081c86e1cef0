"""Zaya (``ZayaForCausalLM``) through ``from_hf``: compressed convolutional attention (q/k through two
causal convolutions plus residual paths, half the values delayed by a token, an L2 QK norm with a
learned key scale, partial RoPE per layer kind, sliding layers), an MLP router whose state passes
from layer to layer with a skip expert and balancing biases, residual scaling around both
sub-layers; equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

HY, SL = "hybrid", "hybrid_sliding"


def _config(**kw: Any) -> Any:
    """3 layers full / sliding (window 5) / full, head_dim 16, GQA 4 / 2, 4 experts, router width 16,
    the default convolutions (2 and 2 taps), partial rope (0.5) and tied embeddings."""
    base = {k: v for k, v in checks.SMALL.items() if k != "intermediate_size"}
    return T.ZayaConfig(**{**base, "num_hidden_layers": 3, "layer_types": [HY, SL, HY], "sliding_window": 5,
                           "head_dim": 16, "moe_intermediate_size": 48, "num_experts": 4, "router_hidden_size": 16,
                           **kw})


def _other(**kw: Any) -> Any:
    """4 layers sliding first (window 4), head_dim 24 (!= hidden / heads), one KV head (groups of 4),
    convolutions of 3 and 1 taps, q/k/v/o biases, an LM head bias, untied, eps 1e-3, SiLU as
    ``swish``, other rope thetas and factors (the whole head on the full layers, a quarter on the
    sliding ones), 3 experts, router width 8."""
    rope = {HY: {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 1.0},
            SL: {"rope_type": "default", "rope_theta": 50.0, "partial_rotary_factor": 0.25}}
    return _config(**{"num_hidden_layers": 4, "layer_types": [SL, HY, SL, SL], "sliding_window": 4, "head_dim": 24,
                      "num_key_value_heads": 1, "cca_time0": 3, "cca_time1": 1, "attention_bias": True,
                      "lm_head_bias": True, "tie_word_embeddings": False, "rms_norm_eps": 1e-3, "hidden_act": "swish",
                      "rope_parameters": rope, "num_experts": 3, "router_hidden_size": 8, "moe_intermediate_size": 40,
                      **kw})


def _mha(**kw: Any) -> Any:
    """MHA (4 KV heads: no groups), head_dim 8, convolutions of 1 and 3 taps, 5 experts, all layers
    full, a linearly scaled rope on them."""
    rope = {HY: {"rope_type": "linear", "factor": 2.0, "rope_theta": 3000.0, "partial_rotary_factor": 0.5}}
    return _config(**{"layer_types": [HY, HY, HY], "sliding_window": None, "num_key_value_heads": 4, "head_dim": 8,
                      "cca_time0": 1, "cca_time1": 3, "num_experts": 5, "router_hidden_size": 12,
                      "rope_parameters": rope, **kw})


class TestZaya(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_mha, _other)


def test_structure() -> None:
    from attnzoo.models.families.zaya import (
        CCAAttention,
        StreamNorm,
        ZayaEmbedding,
        ZayaLayer,
        ZayaLM,
        ZayaMoE,
        ZayaRouter,
    )
    from attnzoo.nn.cache import CacheList

    hf = checks.hf_model(_other())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert all(isinstance(b, ZayaLayer) and isinstance(b.attn, CCAAttention) and isinstance(b.ffn, ZayaMoE)
               for b in ours.blocks)
    assert isinstance(ours, ZayaLM) and ours.packs
    assert isinstance(ours.tok_emb, ZayaEmbedding) and isinstance(ours.norm, StreamNorm) and not ours.tie_embeddings
    assert ours.lm_head.bias is not None
    attn = ours.blocks[0].attn
    assert attn.qkv_proj.weight.shape == ((4 + 2) * 24, 64) and attn.qkv_proj.bias is not None
    assert (attn.taps, attn.pad, attn.window[0]) == ((3, 1), 2, 3)  # sliding_window - 1 keys before the query
    assert ours.blocks[1].attn.window is None
    assert (attn.rope.rotary_dim, attn.rope.base) == (6, 50.0)
    assert (ours.blocks[1].attn.rope.rotary_dim, ours.blocks[1].attn.rope.base) == (24, 1000.0)
    assert ours.blocks[0].ffn.router.router_states_scale is None  # EDA from the second layer on
    assert all(isinstance(b.ffn.router, ZayaRouter) and b.ffn.router.router_states_scale is not None
               for b in ours.blocks[1:])
    h, state = ours.blocks[0](ours.tok_emb(checks.tokens(3)))  # a layer hands its router state to the next
    assert h.shape == (2, 3, 64) and state.shape == (2, 3, 8)
    cache = ours.init_cache(2, 10)
    assert isinstance(cache[0], CacheList) and cache[0][1].conv.shape == (2, (4 + 1) * 24, 2)
    tied = from_hf(checks.hf_model(_config()))
    assert tied.tie_embeddings and tied.lm_head.weight is tied.tok_emb.weight


def test_routing_with_balancing_biases_and_the_skip_expert() -> None:
    """The checkpoint's balancing biases pick and the unbiased probability weighs, as transformers.
    A random router sends every token of a layer to one expert; biases of minus each layer's mean
    probabilities spread the tokens over every expert and the skip class (a zero output)."""
    hf = checks.hf_model(_config())
    x, mask = checks.padded(24)
    with torch.no_grad():
        logits = hf(input_ids=x, attention_mask=mask, output_router_logits=True).router_logits
        for layer, layer_logits in zip(hf.model.layers, logits, strict=True):
            layer.mlp.gate.balancing_biases.copy_(-torch.softmax(layer_logits, dim=-1).mean(0))
    ours = from_hf(hf)
    chosen: dict[int, torch.Tensor] = {}
    ours_logits: dict[int, torch.Tensor] = {}
    for i, block in enumerate(ours.blocks):
        block.ffn.router.register_forward_hook(lambda m, a, out, i=i: chosen.__setitem__(i, out[1]))
        block.ffn.router.out_proj.register_forward_hook(lambda m, a, out, i=i: ours_logits.__setitem__(i, out))
    with torch.no_grad():
        out = hf(input_ids=x, attention_mask=mask, output_router_logits=True)
        got = ours(x, attention_mask=mask.bool())
    real = mask.bool()
    assert checks.rel(got[real], out.logits[real]) <= checks.TOL
    for i, theirs in enumerate(out.router_logits):  # the router MLP itself, tighter than the logits show
        assert checks.rel(ours_logits[i][real.flatten()], theirs[real.flatten()]) <= 1e-5
    counts = torch.stack([torch.bincount(chosen[i], minlength=5) for i in range(3)])  # [layers, E + 1]
    assert bool((counts.sum(0) > 0).all()) and bool((counts[:, :4].count_nonzero(dim=1) >= 3).all())
    for block, layer in zip(ours.blocks, hf.model.layers, strict=True):
        torch.testing.assert_close(block.ffn.router.balancing_biases, layer.mlp.gate.balancing_biases)


def test_cached_decode_from_a_prefill_shorter_than_the_convolution_and_in_chunks() -> None:
    """Convolutions of 3 and 3 taps (4 inputs kept): a prefill of 2 tokens, then chunks of 3, 1 and 5
    tokens and single tokens, equal the full forward (transformers' own cached decode too)."""
    make = lambda: _config(cca_time0=3, cca_time1=3)  # noqa: E731
    hf = checks.hf_model(make())
    ours = from_hf(hf)
    x = checks.tokens(16)
    with torch.no_grad():
        full = ours(x)
        cache = ours.init_cache(2, 16)
        steps = [ours(x[:, a:b], cache=cache) for a, b in ((0, 2), (2, 5), (5, 6), (6, 11), (11, 12), (12, 16))]
        assert checks.rel(torch.cat(steps, dim=1), full) <= checks.TOL
        assert checks.rel(full, hf(input_ids=x).logits) <= checks.TOL
        out = hf(input_ids=x[:, :2], use_cache=True)
        theirs = [out.logits]
        for t in range(2, 16):
            out = hf(input_ids=x[:, t:t + 1], cache=out.cache, use_cache=True)
            theirs.append(out.logits)
        assert checks.rel(torch.cat(theirs, dim=1), full) <= checks.TOL


def test_one_tap_convolutions_equal_transformers_without_its_cache() -> None:
    """``cca_time0 = cca_time1 = 1`` (no convolution state): transformers' cache then fails (it keeps
    zero inputs and cannot copy into them), so its forward is compared with ``use_cache=False``;
    attnzoo also decodes it."""
    hf = checks.hf_model(_config(cca_time0=1, cca_time1=1))
    ours = from_hf(hf)
    x, mask = checks.padded(20)
    with torch.no_grad():
        ref = hf(input_ids=x, attention_mask=mask, use_cache=False).logits
        got = ours(x, attention_mask=mask.bool())
        full = ours(x)
        cache = ours.init_cache(2, 20)
        steps = [ours(x[:, :6], cache=cache)] + [ours(x[:, t:t + 1], cache=cache) for t in range(6, 20)]
    real = mask.bool()
    assert checks.rel(got[real], ref[real]) <= checks.TOL
    assert checks.rel(torch.cat(steps, dim=1), full) <= checks.TOL


def test_half_casts_keep_the_balancing_biases_and_the_stream_in_float32() -> None:
    ours = from_hf(checks.hf_model(_config())).to(torch.bfloat16)
    assert ours.blocks[0].ffn.router.balancing_biases.dtype == torch.float32
    assert ours.tok_emb(checks.tokens(4)).dtype == torch.float32
    assert torch.isfinite(ours(checks.tokens(12)).float()).all()


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A ``config.json`` that leaves out ``ZayaConfig``'s defaults (all layers ``hybrid``, the default
    ``rope_parameters``, ``head_dim`` 128, router width 256, 16 experts top-1, 2 + 2 taps, SiLU,
    eps 1e-5, tied, no biases): read as transformers reads it."""
    hf = checks.hf_model(_config(num_hidden_layers=2, layer_types=None, sliding_window=None, head_dim=128,
                                 router_hidden_size=256, num_experts=16, moe_intermediate_size=16))
    checks.check_folder_without_keys(hf, tmp_path, (
        "layer_types", "rope_parameters", "head_dim", "router_hidden_size", "num_experts", "num_experts_per_tok",
        "cca_time0", "cca_time1", "hidden_act", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
        "lm_head_bias", "attention_dropout", "num_key_value_heads"))


@pytest.mark.parametrize(("key", "value", "named"), [
    ("num_experts_per_tok", 2, "num_experts_per_tok"),
    ("hidden_act", "gelu", "hidden_act"),
    ("layer_types", [HY, "full_attention", HY], "full_attention"),
    ("sliding_window", None, "sliding_window"),
    ("rope_parameters", {HY: {"rope_type": "default", "rope_theta": 1e4},
                         SL: {"rope_type": "mystery", "factor": 2.0, "rope_theta": 1e4}}, "rope_type='mystery'"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.ZayaForCausalLM, _config, key, value, named)


@pytest.mark.parametrize("check", [checks.check_packed_equals_each_alone,
                                   checks.check_packed_gradients_equal_each_alone])
def test_packed_sequences_and_their_gradients_equal_each_alone(check: Any) -> None:
    """Packed sequences (``cu_seqlens``): the convolutions, the delayed values and RoPE restart in
    every sequence; the logits, and the float64 training gradients, equal each sequence alone
    (transformers' Zaya does not restart its convolutions at packed boundaries: ours alone are
    compared)."""
    check(_other)
