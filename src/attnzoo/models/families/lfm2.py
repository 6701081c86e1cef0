"""LFM2 (``lfm2``) -> :class:`~attnzoo.DecoderLM`: ``Lfm2ForCausalLM`` and ``Lfm2Model``.

Liquid AI's LFM2 (transformers ``models/lfm2``; line numbers below are ``modeling_lfm2.py`` /
``configuration_lfm2.py`` of transformers 5.25). Every layer is pre-norm (modeling 418-461):
``x + mixer(operator_norm(x))``, then ``x + feed_forward(ffn_norm(x))``; the mixer is chosen by
``layer_types`` (``"conv"`` or ``"full_attention"``; config 81-88: from ``full_attn_idxs`` when
absent, every layer attention when both are):

* ``"conv"``: :class:`Lfm2ShortConvMixer` (modeling 370-415): ``in_proj`` ``C -> 3C`` chunked
  into ``B, C, x``; ``B * x`` through a causal depthwise conv1d of kernel ``conv_L_cache`` with
  NO activation; ``C * conv``, then ``out_proj``. ``conv_bias`` puts a bias on all three. At a
  padded token transformers zeroes the mixer's *input* (``apply_mask_to_padding_states`` before
  ``in_proj``, modeling 261-270, 405), so with ``conv_bias`` a padded token feeds
  ``b_B * b_x`` (not zeros) to the convolution; this is reproduced as is.
* ``"full_attention"``: causal GQA (modeling 201-258) with per-head RMSNorm of q and k over
  ``head_dim`` (``q_layernorm``/``k_layernorm``, eps ``norm_eps``, before RoPE), RoPE on the whole
  head, no biases, output ``out_proj``.
* Feed-forward (modeling 111-128): SwiGLU ``w2(silu(w1 x) * w3 x)`` (w1 gate, w3 up, w2 down);
  with ``block_auto_adjust_ff_dim`` the width is ``int(2 * intermediate_size / 3)``, then (unless
  ``block_ffn_dim_multiplier`` is ``None``) times the multiplier and rounded up to a multiple of
  ``block_multiple_of`` (:func:`ff_dim`).
* Plain ``weight * x`` RMSNorms (modeling 44-62), eps ``norm_eps``; final norm
  ``embedding_norm``; tied embeddings by default.

Config keys are read as transformers reads them (:func:`canonical`): the legacy ``block_ff_dim``
and ``tie_embedding`` override ``intermediate_size`` / ``tie_word_embeddings`` (config 90-91), and
keys a ``config.json`` leaves out take ``Lfm2Config``'s defaults (:data:`DEFAULTS`, config 58-79).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

import attnzoo.models.families._common as parts
from attnzoo._validate import check_int
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.nn.recurrent import RecurrentMixer, ShortConv

__all__ = ["DEFAULTS", "Lfm2ShortConvMixer", "build_lfm2", "canonical", "convert_lfm2", "ff_dim"]

TYPES = ("conv", "full_attention")

#: ``Lfm2Config``'s defaults of the keys read here (config 58-79; ``rope_theta``: ``default_theta``,
#: config 56), for a ``config.json`` that leaves them out
DEFAULTS: dict[str, Any] = {
    "vocab_size": 65536, "hidden_size": 2560, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 128_000, "norm_eps": 1e-5,
    "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "conv_bias": False, "conv_L_cache": 3,
    "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True,
}


class Lfm2ShortConvMixer(RecurrentMixer):
    """LFM2's gated short-convolution mixer (transformers' ``Lfm2ShortConv``).

    ``y = out_proj(C * conv(B * x))`` with ``[B | C | x] = in_proj(h)``, ``conv`` a causal
    depthwise convolution of kernel ``conv_size`` over tokens (no activation).

    Args:
        dim: model width ``C``.
        conv_size: the kernel (``conv_L_cache``), >= 1.
        bias: biases on ``in_proj``, the convolution and ``out_proj`` (``conv_bias``).
        device, dtype: of the parameters.

    Weights: ``in_proj [3C, C]`` (rows ``[B; C; x]``), ``conv.weight [C, 1, K]``
    (:class:`~attnzoo.nn.recurrent.ShortConv`: ``nn.Conv1d``'s layout), ``out_proj [C, C]``.

    The attention protocol of :class:`~attnzoo.nn.recurrent.RecurrentMixer`: ``forward(x, *,
    mask=, cache=, positions=, cu_seqlens=)``. Key padding zeroes the padded tokens of the input
    (before ``in_proj``, as transformers does: with ``bias`` those tokens feed the convolution
    ``b_B * b_x``, without it zeros, and a left-padded row then equals the row alone); packed
    sequences (``cu_seqlens``) each restart the convolution from zeros.

    Decode cache: a :class:`~attnzoo.nn.recurrent.RecurrentCache` whose convolution entry
    ``"conv" [B, C, K - 1]`` (the last inputs ``B * x``) is the whole memory of the layer. The
    mixer has no recurrent state, but the cache protocol carries one (the cache is built from
    ``state_shape`` and :meth:`RecurrentCache.update` checks the state's shape), so
    ``state_shape`` is the smallest one, ``(1, 1, 1)`` (4 bytes a row), passed through unchanged.
    """

    def __init__(self, dim: int, conv_size: int = 3, *, bias: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        dim = check_int(dim, "dim", owner="Lfm2ShortConvMixer")
        # one "head" of width dim, layout "qkv": the base makes qkv_proj [3C, C] and out_proj [C, C]
        # (the base's checks read out_proj); qkv_proj is LFM2's in_proj, renamed
        super().__init__(dim, 1, head_dim=dim, bias=bias, layout="qkv", factory=fk)
        self.in_proj = self.qkv_proj
        del self.qkv_proj
        self.conv_bias = bias
        self.conv_size = check_int(conv_size, "conv_size", owner="Lfm2ShortConvMixer")
        self.conv = ShortConv(dim, self.conv_size, bias, fk)
        self.conv_channels = {"conv": dim}
        self.state_shape = (1, 1, 1)

    def _mix(self, x: Tensor, pad: Tensor | None, state: Tensor | None, conv: Mapping[str, Tensor],
             cu: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        if pad is not None:  # transformers zeroes the input of a padded token (modeling 405); where: a NaN stays out
            x = torch.where(pad[..., None], x, x.new_zeros(()))
        b, c, h = self.in_proj(x).chunk(3, dim=-1)  # [B, N, C] each (modeling 406-407)
        y, last = self.conv(b * h, conv.get("conv"), cu)  # no activation (modeling 410)
        if state is None:
            state = x.new_zeros(x.shape[0], *self.state_shape)
        return self.out_proj(c * y), state, {"conv": last}

    def extra_repr(self) -> str:
        return f"dim={self.dim}, conv_size={self.conv_size}, bias={self.conv_bias}"


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it: :data:`DEFAULTS` where a key is absent, the legacy keys
    ``block_ff_dim`` / ``tie_embedding`` folded in (config 90-91), ``layer_types`` set (from
    ``full_attn_idxs``, else every layer attention; config 81-88), and the attention's options the
    modeling fixes made explicit (no biases, no dropout: modeling 213-216, 252)."""
    data = {**DEFAULTS, **{k: v for k, v in hf.data.items() if v is not None}}
    if "block_ffn_dim_multiplier" in hf.data and hf.data["block_ffn_dim_multiplier"] is None:
        data["block_ffn_dim_multiplier"] = None  # None skips the multiplier and the rounding (modeling 118)
    if hf.data.get("block_ff_dim") is not None:
        data["intermediate_size"] = hf.data["block_ff_dim"]
    if hf.data.get("tie_embedding") is not None:
        data["tie_word_embeddings"] = hf.data["tie_embedding"]
    out = HFConfig(data, hf.source, hf.arch)
    if out.get("layer_types", None, list) is None:
        depth = out.req("num_hidden_layers")
        idxs = out.get("full_attn_idxs", list(range(depth)), list)
        out.data["layer_types"] = ["full_attention" if i in idxs else "conv" for i in range(depth)]
    out.data.update(attention_bias=False, attention_dropout=0.0)
    return out


def ff_dim(hf: HFConfig) -> int:
    """The SwiGLU width of ``Lfm2MLP`` (modeling 114-122)."""
    width = hf.req("intermediate_size")
    if not hf.get("block_auto_adjust_ff_dim", True, bool):
        return int(width)
    width = int(2 * width / 3)
    if hf.raw("block_ffn_dim_multiplier") is None:
        return width
    multiple = hf.req("block_multiple_of")
    if multiple < 1:
        raise CheckpointFormatError(f"{hf.source}: key 'block_multiple_of' must be >= 1, got {multiple!r}")
    width = int(hf.req("block_ffn_dim_multiplier", float) * width)
    width = multiple * ((width + multiple - 1) // multiple)
    if width < 1:
        raise CheckpointFormatError(f"{hf.source}: the feed-forward width is {width} (intermediate_size "
                                    f"{hf.req('intermediate_size')}, block_ffn_dim_multiplier "
                                    f"{hf.raw('block_ffn_dim_multiplier')})")
    return width


def build_lfm2(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of an ``Lfm2Config`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    eps, kw = hf.req("norm_eps", float), {"device": device, "dtype": dtype}
    D = hf.get("head_dim", C // H)
    kinds = parts.layer_types(hf, depth, TYPES)
    K = hf.req("conv_L_cache")
    if K < 1:
        raise CheckpointFormatError(f"{hf.source}: key 'conv_L_cache' must be >= 1, got {K!r}")
    rope = parts.rotary(hf, parts.rope_params(hf), D)
    # the QK-norm's epsilon is norm_eps (modeling 217-218), not rms_norm_eps (attention_factory's)
    attention = functools.partial(parts.attention_factory(hf, window=None, rope=rope, qk_norm="head", **kw),
                                  qk_norm_eps=eps)
    conv = functools.partial(Lfm2ShortConvMixer, C, K, bias=hf.req("conv_bias", bool), **kw)
    ffn, norm = parts.gated_mlp(C, ff_dim(hf), "swiglu", **kw), parts.rms_norm(C, eps, **kw)
    blocks = [parts.block(C, conv if k == "conv" else attention, ffn, norm) for k in kinds]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def put_short_conv(plan: Plan, ours: str, theirs: str, *, bias: bool) -> None:
    """A :class:`Lfm2ShortConvMixer` at ``ours`` from transformers' ``Lfm2ShortConv`` at ``theirs``."""
    plan.put_pairs(ours, theirs, [("in_proj", "in_proj"), ("conv", "conv"), ("out_proj", "out_proj")], bias=bias)


def put_lfm2_attention(plan: Plan, ours: str, theirs: str) -> None:
    """``Lfm2Attention``: q/k/v into ``qkv_proj`` (rows ``[q; k; v]``), ``out_proj`` (not ``o_proj``),
    ``q_layernorm``/``k_layernorm`` into the per-head QK-norm."""
    plan.put_cat(f"{ours}qkv_proj.weight", [f"{theirs}{n}_proj.weight" for n in "qkv"])
    plan.put(f"{ours}out_proj.weight", f"{theirs}out_proj.weight")
    for n in ("q", "k"):
        plan.put(f"{ours}frontier.{n}_norm_weight", f"{theirs}{n}_layernorm.weight")


def convert_lfm2(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, build_lfm2, device=device, dtype=dtype)
    kinds = parts.layer_types(hf, model.depth, TYPES)
    bias = hf.req("conv_bias", bool)
    for i, kind in enumerate(kinds):
        o, h = f"blocks.{i}.", f"layers.{i}."
        if kind == "conv":
            put_short_conv(plan, f"{o}attn.", f"{h}conv.", bias=bias)
        else:
            put_lfm2_attention(plan, f"{o}attn.", f"{h}self_attn.")
        plan.put_pairs(f"{o}ffn.", f"{h}feed_forward.", [("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")],
                       bias=False)
        plan.put_pairs(o, h, [("attn_norm", "operator_norm"), ("ffn_norm", "ffn_norm")], bias=False)
    return parts.finish(plan, model, head_size, final_norm="embedding_norm")
