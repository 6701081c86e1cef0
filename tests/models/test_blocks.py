"""Blocks: RMSNorm, FeedForward and TransformerBlock against independent references.

Equivalences: RMSNorm vs its float64 formula; FeedForward vs the plain formulas in float64;
TransformerBlock (post- and pre-norm, with and without cross-attention) vs
torch.nn.TransformerEncoderLayer / TransformerDecoderLayer given the same weights; cached
decoding through a block vs the full causal forward.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnzoo as az
from attnzoo.blocks import ACTIVATIONS, BlockConfig, BlockLayers, RMSNorm, default_ffn_hidden

pytestmark = pytest.mark.usefixtures("one_thread")


def _close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    err = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item() + 1e-12
    assert err <= tol * scale, f"{what}: max abs err {err:.3e} (rel {err / scale:.3e}) shapes {tuple(a.shape)}"


# --------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rmsnorm_matches_float64_formula(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = az.RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    norm = norm.to(dtype)
    x = (torch.randn(3, 7, 24) * 3).to(dtype)
    x64, w64 = x.double(), norm.weight.double()
    ref = w64 * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    out = norm(x)
    assert out.dtype == dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    _close(out, ref, tol, f"RMSNorm {dtype}")


def test_rmsnorm_bad_input() -> None:
    norm = az.RMSNorm(8)
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\].*\(2, 4\)"):
        norm(torch.randn(2, 4))
    with pytest.raises(TypeError, match="dim must be an int"):
        az.RMSNorm(8.0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- FeedForward
def _ffn_reference(ffn: az.FeedForward, x: torch.Tensor) -> torch.Tensor:
    """The textbook formulas in float64, from the module's weights."""
    x = x.double()

    def lin(layer: nn.Linear, t: torch.Tensor) -> torch.Tensor:
        return F.linear(t, layer.weight.double(), None if layer.bias is None else layer.bias.double())

    def act(name: str, t: torch.Tensor) -> torch.Tensor:
        if name == "relu":
            return t.clamp(min=0)
        if name == "relu2":
            return t.clamp(min=0) ** 2
        if name in ("gelu", "geglu"):
            return 0.5 * t * (1 + torch.erf(t / math.sqrt(2)))
        if name in ("gelu_tanh", "geglu_tanh"):
            return 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t**3)))
        if name == "quick_gelu":
            return t / (1 + torch.exp(-1.702 * t))
        return t / (1 + torch.exp(-t))  # silu / swiglu

    if ffn.gate_proj is not None:
        h = act(ffn.activation, lin(ffn.gate_proj, x)) * lin(ffn.up_proj, x)
    else:
        h = act(ffn.activation, lin(ffn.up_proj, x))
    return lin(ffn.down_proj, h)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("bias", [True, False])
def test_feedforward_matches_formula(activation: str, bias: bool) -> None:
    torch.manual_seed(1)
    ffn = az.FeedForward(16, 40, activation, bias=bias)
    x = torch.randn(2, 5, 16) * 2
    _close(ffn(x), _ffn_reference(ffn, x), 1e-5, f"FeedForward {activation}")
    assert (ffn.gate_proj is not None) == (activation in ("swiglu", "geglu", "geglu_tanh"))


def test_feedforward_default_hidden() -> None:
    assert az.FeedForward(64).hidden == 256
    h = az.FeedForward(64, activation="swiglu").hidden
    assert h == default_ffn_hidden(64, "swiglu") and h % 8 == 0 and h >= 64 * 8 / 3


def test_feedforward_bad_input() -> None:
    with pytest.raises(ValueError, match="activation must be one of"):
        az.FeedForward(8, activation="tanh")
    with pytest.raises(ValueError, match="hidden must be >= 1"):
        az.FeedForward(8, 0)
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        az.FeedForward(8)(torch.randn(2, 3, 7))


# --------------------------------------------------------------------------- TransformerBlock vs torch
def _copy_mha(ours: nn.Module, theirs: nn.MultiheadAttention) -> None:
    w, b = theirs.in_proj_weight, theirs.in_proj_bias
    C = theirs.embed_dim
    ours.load_qkv(w[:C], w[C:2 * C], w[2 * C:], b[:C], b[C:2 * C], b[2 * C:])
    with torch.no_grad():
        ours.out_proj.weight.copy_(theirs.out_proj.weight)
        ours.out_proj.bias.copy_(theirs.out_proj.bias)


def _copy_linear(dst: nn.Linear, src: nn.Linear) -> None:
    with torch.no_grad():
        dst.weight.copy_(src.weight)
        dst.bias.copy_(src.bias)


def _copy_norm(dst: nn.LayerNorm, src: nn.LayerNorm) -> None:
    with torch.no_grad():
        dst.weight.copy_(src.weight)
        dst.bias.copy_(src.bias)


def _randomize(module: nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.5)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_block_equals_torch_encoder_layer(norm_first: bool, activation: str) -> None:
    torch.manual_seed(2)
    C, H, F_ = 32, 4, 48
    ref = nn.TransformerEncoderLayer(C, H, F_, dropout=0.0, activation=activation, batch_first=True,
                                     norm_first=norm_first).eval()
    _randomize(ref)
    blk = az.TransformerBlock(config=az.blocks.BlockConfig(C, H, norm_first=norm_first, ffn=activation, ffn_hidden=F_)).eval()
    _copy_mha(blk.attn, ref.self_attn)
    _copy_linear(blk.ffn.up_proj, ref.linear1)
    _copy_linear(blk.ffn.down_proj, ref.linear2)
    _copy_norm(blk.attn_norm, ref.norm1)
    _copy_norm(blk.ffn_norm, ref.norm2)
    x = torch.randn(3, 9, C)
    lengths = torch.tensor([9, 5, 2])
    real = torch.arange(9)[None, :] < lengths[:, None]  # [B, N] True = real
    with torch.no_grad():
        expected = ref(x, src_key_padding_mask=~real)
        out = blk(x, mask=real[:, None, None, :])
    _close(out[real], expected[real], 1e-5, f"encoder layer norm_first={norm_first}")


@pytest.mark.parametrize("norm_first", [False, True])
def test_cross_attention_block_equals_torch_decoder_layer(norm_first: bool) -> None:
    torch.manual_seed(3)
    C, H, F_ = 32, 4, 48
    ref = nn.TransformerDecoderLayer(C, H, F_, dropout=0.0, activation="relu", batch_first=True,
                                     norm_first=norm_first).eval()
    _randomize(ref)
    blk = az.TransformerBlock(config=az.blocks.BlockConfig(C, H, causal=True, cross_attention=True, norm_first=norm_first,
                                                      ffn="relu", ffn_hidden=F_)).eval()
    _copy_mha(blk.attn, ref.self_attn)
    _copy_mha(blk.cross_attn, ref.multihead_attn)
    _copy_linear(blk.ffn.up_proj, ref.linear1)
    _copy_linear(blk.ffn.down_proj, ref.linear2)
    _copy_norm(blk.attn_norm, ref.norm1)
    _copy_norm(blk.cross_norm, ref.norm2)
    _copy_norm(blk.ffn_norm, ref.norm3)
    x, mem = torch.randn(2, 7, C), torch.randn(2, 5, C)
    mem_real = torch.tensor([[True] * 5, [True, True, True, False, False]])
    causal = nn.Transformer.generate_square_subsequent_mask(7)
    with torch.no_grad():
        expected = ref(x, mem, tgt_mask=causal, memory_key_padding_mask=~mem_real)
        out = blk(x, mem, context_mask=mem_real[:, None, None, :])
    _close(out, expected, 1e-5, f"decoder layer norm_first={norm_first}")


@pytest.mark.parametrize("norm_first", [False, True])
def test_block_cached_decode_equals_full_forward(norm_first: bool) -> None:
    torch.manual_seed(4)
    blk = az.TransformerBlock(config=az.blocks.BlockConfig(32, 4, attention="gqa", attention_kwargs={"num_kv_heads": 2, "rope": True},
                                                      causal=True, cross_attention=True, norm="rms", ffn="swiglu",
                                                      norm_first=norm_first)).eval()
    x, ctx = torch.randn(2, 8, 32), torch.randn(2, 3, 32)
    with torch.no_grad():
        full = blk(x, ctx)
        cache = blk.init_cache(2, 8)
        steps = [blk(x[:, :3], ctx, cache=cache)] + [blk(x[:, t:t + 1], ctx, cache=cache) for t in range(3, 8)]
    _close(torch.cat(steps, dim=1), full, 1e-5, "block decode")


def test_block_mixer_by_name_instance_and_factory() -> None:
    torch.manual_seed(5)
    by_name = az.TransformerBlock(16, 2, attention="mha", causal=True)
    inst = az.MultiHeadAttention(16, 2, causal=True)
    by_inst = az.TransformerBlock(16, 2, attention=inst)
    assert by_inst.attn is inst
    by_factory = az.TransformerBlock(16, 2, attention=lambda d, h: az.MultiHeadAttention(d, h, causal=True))
    by_inst.load_state_dict(by_name.state_dict())
    by_factory.load_state_dict(by_name.state_dict())
    x = torch.randn(2, 5, 16)
    _close(by_inst(x), by_name(x), 1e-6, "instance vs name")
    _close(by_factory(x), by_name(x), 1e-6, "factory vs name")
    sliding = az.TransformerBlock(16, 2, attention="sliding", attention_kwargs={"window": 2}, causal=True)
    assert sliding.attn.window == (2, 2)


def test_block_dropout_only_in_training() -> None:
    torch.manual_seed(6)
    blk = az.TransformerBlock(config=az.blocks.BlockConfig(16, 2, dropout=0.5))
    x = torch.randn(2, 5, 16)
    blk.eval()
    a, b = blk(x), blk(x)
    assert torch.equal(a, b)
    blk.train()
    assert not torch.allclose(blk(x), a)


def test_block_bad_input() -> None:
    with pytest.raises(ValueError, match=r"dim \(30\) must be divisible by num_heads \(4\)"):
        az.TransformerBlock(30, 4)
    with pytest.raises(ValueError, match="norm must be one of"):
        az.TransformerBlock(16, 2, norm="batch")
    with pytest.raises(ValueError, match="unknown attention 'nope'"):
        az.TransformerBlock(16, 2, attention="nope")
    with pytest.raises(ValueError, match="attention_kwargs"):
        az.TransformerBlock(16, 2, attention=az.MultiHeadAttention(16, 2), attention_kwargs={"window": 3})
    with pytest.raises(TypeError, match=r"factory must return an nn\.Module"):
        az.TransformerBlock(16, 2, attention=lambda d, h: 3)
    blk = az.TransformerBlock(16, 2)
    with pytest.raises(ValueError, match=r"\[B, N, C\] with C=16, got \(2, 5, 8\)"):
        blk(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="no cross-attention"):
        blk(torch.randn(2, 5, 16), torch.randn(2, 3, 16))
    cross = az.TransformerBlock(config=az.blocks.BlockConfig(16, 2, cross_attention=True, context_dim=8))
    with pytest.raises(ValueError, match="pass context"):
        cross(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match=r"context must have shape \[B, N, C\] with C=8"):
        cross(torch.randn(2, 5, 16), torch.randn(2, 3, 16))


def test_block_from_layer_factories_equals_keyword_block() -> None:
    torch.manual_seed(7)
    by_kw = az.TransformerBlock(16, 2, attention="mha", causal=True, norm="rms", ffn="swiglu").eval()
    layers = BlockLayers(attention=lambda: az.MultiHeadAttention(16, 2, causal=True),
                         feed_forward=lambda: az.FeedForward(16, activation="swiglu"),
                         norm=lambda: RMSNorm(16, eps=1e-5))
    by_layers = az.TransformerBlock(16, layers=layers).eval()
    by_layers.load_state_dict(by_kw.state_dict())
    by_cfg = az.TransformerBlock(config=BlockConfig(16, 2, causal=True, norm="rms", ffn="swiglu")).eval()
    by_cfg.load_state_dict(by_kw.state_dict())
    assert by_cfg.config == by_kw.config and by_layers.config is None
    x = torch.randn(2, 5, 16)
    _close(by_layers(x), by_kw(x), 1e-6, "factories vs keywords")
    _close(by_cfg(x), by_kw(x), 1e-6, "config vs keywords")
    with pytest.raises(TypeError, match="heads"):
        az.TransformerBlock(16, 2, heads=3)
    with pytest.raises(TypeError, match="cannot be combined"):
        az.TransformerBlock(16, layers=layers, norm="rms")
    with pytest.raises(TypeError, match=r"feed_forward factory must return an nn\.Module"):
        az.TransformerBlock(16, layers=dataclasses.replace(layers, feed_forward=lambda: None))


@pytest.mark.parametrize(("norm_first", "sublayer_norm"), [(True, "input"), (True, "output"), (False, "input")])
def test_mixer_only_block_is_the_mixer_sublayer_alone(norm_first: bool, sublayer_norm: str) -> None:
    """``feed_forward=None``: no feed-forward sub-layer and no norm for it (Mamba-2's layers); the
    output is the mixer sub-layer of the same block with a feed-forward, as that block computes it
    before its feed-forward (pre-norm, output norm, post-norm)."""
    torch.manual_seed(3)
    mixer = lambda: az.MultiHeadAttention(16, 2, causal=True)  # noqa: E731
    norm = lambda: RMSNorm(16, eps=1e-5)  # noqa: E731
    alone = az.TransformerBlock(16, layers=BlockLayers(attention=mixer, feed_forward=None, norm=norm,
                                                        norm_first=norm_first, sublayer_norm=sublayer_norm)).eval()
    assert alone.ffn is None and alone.ffn_norm is None
    assert not any(name.startswith(("ffn.", "ffn_norm.", "ffn_out_norm.")) for name in alone.state_dict())
    x = torch.randn(2, 7, 16)
    attn_norm, attn_out_norm = alone.attn_norm, alone.attn_out_norm
    if norm_first:
        expected = x + attn_out_norm(alone.attn(attn_norm(x)))
    else:
        expected = attn_norm(x + alone.attn(x))
    _close(alone(x), expected, 1e-6, "mixer-only block")
    cache = alone.init_cache(2, 7)
    steps = torch.cat([alone(x[:, :4], cache=cache), alone(x[:, 4:5], cache=cache), alone(x[:, 5:], cache=cache)], 1)
    _close(steps, alone(x), 1e-5, "mixer-only decode")
