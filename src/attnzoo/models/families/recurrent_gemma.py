"""RecurrentGemma (``recurrent_gemma``) -> :class:`~attnzoo.DecoderLM`: ``RecurrentGemmaForCausalLM``
and ``RecurrentGemmaModel`` (Google's Griffin: RG-LRU recurrent blocks and local attention).

Line numbers below are transformers 5.25's ``models/recurrent_gemma/modeling_recurrent_gemma.py``
(``modeling``) / ``configuration_recurrent_gemma.py`` (``config``). The layer kinds cycle
``block_types`` (default ``recurrent, recurrent, attention``) to the depth (config 98-102). Every
layer is pre-norm (``RecurrentGemmaDecoderLayer``, modeling 491-529)::

    h   = x + temporal_block(temporal_pre_norm(x))
    out = h + mlp_block(channel_pre_norm(h))

a :class:`~attnzoo.TransformerBlock` (``attn_norm`` / ``ffn_norm``). The norms are Gemma's RMSNorm
``x / rms(x) * (1 + w)`` in float32 (modeling 45-59; loaded as ``w + 1``,
:func:`~attnzoo.models.families._common.plus_one`), eps ``rms_norm_eps``; the final one
``final_norm``. The token embedding is multiplied by ``sqrt(hidden_size)`` *rounded to bfloat16*
(the ``normalizer`` buffer, modeling 623 and 670: ``sqrt(2560) = 50.596`` is ``50.5``), a
:class:`~attnzoo.models.parts.ScaledEmbedding`; the head soft-caps the logits,
``cap * tanh(logits / cap)`` with ``cap = logits_soft_cap`` (modeling 743-745); embeddings tied
by default.

* The MLP (``RecurrentGemmaMlp``, modeling 475-488): ``down(act(gate(x)) * up(x))`` of width
  ``intermediate_size // 2`` with biases on all three, ``act = hidden_activation``
  (``gelu_pytorch_tanh``): a gated :class:`~attnzoo.FeedForward`.
* ``"attention"`` layers (``RecurrentGemmaAttention``, modeling 197-261): causal MQA/GQA over
  ``num_key_value_heads``, ``head_dim`` (``hidden_size // num_attention_heads`` unless the config
  stores one: config 85 is overridden by a stored key), biases on q/k/v only with
  ``attention_bias`` but ALWAYS on ``o_proj`` (modeling 217): a
  :class:`~attnzoo.MultiHeadAttention` whose ``out_proj`` is given a bias when the others have none.
  Local: a key is seen from the ``attention_window_size`` last positions, the query's included
  (``sliding_window``, the mask of modeling 662; a left window of ``attention_window_size - 1``).
  Partial RoPE (modeling 65-155): the first ``int(head_dim * partial_rotary_factor)`` channels of
  each head rotated split-half (default factor 0.5, config 90), ``rope_theta`` (10000).
* ``"recurrent"`` layers (``RecurrentGemmaRecurrentBlock``, modeling 392-461):
  :class:`GriffinRecurrentBlock`, below.

**The RG-LRU** (``RecurrentGemmaRglru``, modeling 281-389). With ``x_t`` the output of
``linear_x`` then a causal depthwise ``conv_1d`` of width ``conv1d_width`` (with bias; zeros before
the start, modeling 403-409 and 455) and ``H = num_attention_heads`` blocks of ``lru_width / H``
channels (block-diagonal gates, modeling 309-316)::

    i_t = sigmoid(x_t W_i + b_i)        r_t = sigmoid(x_t W_r + b_r)        # per block
    log a_t = -8 r_t softplus(Lambda)                     (Lambda = recurrent_param, modeling 319)
    m_t = sqrt(1 - exp(2 log a_t)),  but m_t = 1 where the sequence starts (the reset, modeling 328-329)
    h_t = a_t h_{t-1} + m_t (i_t x_t)                     (float32 accumulation, modeling 342-389)

then ``linear_out(h * act(linear_y(u)))`` (the GELU branch ``y``, modeling 426-427, 459-460). The
elementwise recurrence is :func:`attnzoo.gated_linear_attention` with ``lru_width`` value heads
of width 1 over one key head of width 1 (``q = k = 1``, ``v = m_t i_t x_t``, the per-token log
decay ``log a_t``, scale 1): chunked, with gradients, packing sequences by ``cu_seqlens``. The
block is a :class:`~attnzoo.nn.recurrent.RecurrentMixer`; its decode cache holds ``h`` and the
convolution's last ``conv1d_width - 1`` inputs.

Exactly as transformers:

* the multiplier is ``sqrt(1 - exp(2 log a))`` (not the more accurate ``-expm1``: near ``a = 1``
  the two differ by float32 cancellation, and transformers' is the reference);
* its gradient is transformers' ``SqrtBoundDerivative`` (modeling 264-278): the forward is
  ``sqrt``, the backward ``g / sqrt(max(4 u, 1e-6))``, i.e. ``d sqrt(u) / du`` clipped at 1000
  (it changes gradients only where ``1 - a^2 < 2.5e-7``): :class:`BoundedSqrt`, so training
  gradients equal transformers' there too;
* the gates, ``log a``, the multiplier and the scan run in float32 (the model's dtype when wider;
  transformers computes the gates in the model's dtype and accumulates the scan in float32 even
  in a float64 model, modeling 348: in float32 the two are one computation, in bfloat16
  attnzoo's gates are the more precise, in float64 its scan).

**The reset.** transformers resets the state where ``position_ids == 0`` (``a = 0`` and
``m = 1`` there, modeling 307, 329, 364). Here a sequence starts at the first real token the
state sees (a fresh state: the first token of a row, the first real one of a left-padded row,
each packed sequence's first): ``m = 1`` there and the state is zero before it. That is
transformers' full forward on an unpadded row, and its ``generate`` (positions counted from the
attention mask). Positions that restart at 0 inside a row (transformers' padding-free packing
by ``position_ids``) are not a reset here: pack with ``cu_seqlens``. The state carries, besides
``h``, one flag per row (whether the sequence has started): state ``[B, lru_width + 1, 1, 1]``.

**Padding.** transformers' recurrent blocks see padded tokens as real ones (nothing masks them):
its left-padded row depends on the padding, through the convolution, the state (without
``position_ids`` the reset sits on the first *padded* token) and the attention layers' outputs at
the padded queries (measured: 0.25 relative logits error against the row alone). Here a padded
token feeds zeros to the convolution, neither writes nor decays the state, and is hidden from
attention: a left-padded row computes what the row computes alone (transformers' row alone is
what the tests compare with).

**transformers' cached decode** (measured against its own full forward): one token at a time
with ``position_ids`` given (what ``generate`` does) equals its full forward (3e-7); without
them it does not (``DynamicCache.get_seq_length()`` reads layer 0, a recurrent layer that
stores nothing, so every step sits at position 0: reset, RoPE at 0: 0.35 relative error), and a
chunk of several tokens after a prefill restarts the convolution from zeros (the prefill path,
modeling 444-446: 0.07). attnzoo's cache follows the full forward in every case (a chunk after a
prefill continues the convolution and the state); the attention layers' cache is a sliding
window. A stack of recurrent layers only (``block_types: ["recurrent"]``, Griffin's Hawk) runs
here; transformers' forward raises for it unless ``use_cache=False`` (its mask asks the cache for
an attention layer).

Config keys a ``config.json`` leaves out take ``RecurrentGemmaConfig``'s defaults
(:data:`DEFAULTS`, config 59-90; ``lru_width`` = ``hidden_size``, ``num_key_value_heads`` =
``num_attention_heads``, ``partial_rotary_factor`` 0.5; ``sliding_window`` is an alias of
``attention_window_size``); ``max_position_embeddings`` (the config has none) is 8192, the
sequence length RecurrentGemma was trained on (generate past it with ``extend_context=True``). Refused (by
name): a ``rope_type`` other than ``default`` (transformers raises too), a rotated width
``int(head_dim * partial_rotary_factor)`` that is odd, a ``hidden_activation`` other than GELU
(exact or tanh) / SiLU, a ``block_types`` entry other than ``recurrent`` / ``attention``
(transformers would run any other name as attention), ``lru_width`` not a multiple of
``num_attention_heads`` (transformers' gates reshape by it), a non-positive ``logits_soft_cap``.
Accepted without effect on the function: the initialisation scales (``w_init_variance_scale``,
``final_w_init_variance_scale``), ``attention_dropout`` (dropout in training, as there).
``pad_token_id`` is transformers' ``padding_idx`` of the embedding (no gradient to that row); the
converted embedding has none (its pad row trains).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._validate import check_int
from attnzoo.blocks import ACTIVATIONS
from attnzoo.functional.recurrent.gla import gated_linear_attention
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.nn.recurrent import RecurrentMixer, ShortConv, wide

__all__ = ["DEFAULTS", "DISPATCH", "GATE_SCALE", "RGLRU", "BoundedSqrt", "GriffinRecurrentBlock",
           "build_recurrent_gemma", "canonical", "convert_recurrent_gemma", "layer_kinds", "put_recurrent"]

#: ``RecurrentGemmaConfig``'s defaults of the keys read here (config 59-80), for a ``config.json``
#: that leaves them out; ``max_position_embeddings`` is not one of its keys (see the module docstring)
DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 26, "vocab_size": 256000, "hidden_size": 2560, "intermediate_size": 3 * 2560,
    "num_attention_heads": 10, "attention_window_size": 2048, "conv1d_width": 4, "logits_soft_cap": 30.0,
    "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "block_types": ["recurrent", "recurrent",
                                                                                       "attention"],
    "attention_dropout": 0.0, "attention_bias": False, "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}

#: the constant ``c`` of ``log a_t = -c r_t softplus(Lambda)`` (modeling 319)
GATE_SCALE = 8.0

#: transformers' ``_MAX_SQRT_GRADIENT`` (modeling 41): the bound of ``d sqrt(u) / du``
MAX_SQRT_GRADIENT = 1000.0

#: ``block_types`` entries -> the kinds built here
KINDS = ("recurrent", "attention")

#: the chunk length of the recurrence's kernel (``gated_linear_attention``'s default)
CHUNK_SIZE = 64


class BoundedSqrt(torch.autograd.Function):
    """``sqrt(u)`` whose derivative is bounded by :data:`MAX_SQRT_GRADIENT`: the backward is
    ``g / sqrt(max(4 u, 1 / MAX^2))`` (transformers' ``SqrtBoundDerivative``, modeling 264-278;
    only ``u < 2.5e-7`` changes, where the true derivative passes 1000). Elementwise, any shape."""

    @staticmethod
    def forward(ctx: Any, u: Tensor) -> Tensor:
        ctx.save_for_backward(u)
        return torch.sqrt(u)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (u,) = ctx.saved_tensors
        return grad / torch.sqrt(torch.clamp(4.0 * u, min=1.0 / MAX_SQRT_GRADIENT ** 2))


class RGLRU(nn.Module):
    """The gates of Griffin's Real-Gated Linear Recurrent Unit (transformers' ``RecurrentGemmaRglru``
    without its scan, which :class:`GriffinRecurrentBlock` runs).

    Args:
        width: ``L`` (``lru_width``).
        num_blocks: ``H``, the gates' diagonal blocks (``num_attention_heads``), dividing ``L``.
        device, dtype: of the parameters.

    Weights (transformers' names and layouts): ``recurrent_param [L]`` (``Lambda``),
    ``input_gate_weight``, ``recurrent_gate_weight [H, L/H, L/H]`` (``x_block @ W``),
    ``input_gate_bias``, ``recurrent_gate_bias [H, L/H]``.

    Shapes: ``forward(x [B, N, L]) -> (log_a [B, N, L], i * x [B, N, L])``, computed in ``x``'s
    dtype (the parameters cast to it).
    """

    def __init__(self, width: int, num_blocks: int, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        self.width = check_int(width, "width", owner="RGLRU")
        self.num_blocks = check_int(num_blocks, "num_blocks", owner="RGLRU")
        if self.width % self.num_blocks:
            raise ValueError(f"RGLRU: width ({self.width}) must be a multiple of num_blocks ({self.num_blocks})")
        bw = self.width // self.num_blocks
        scale = bw ** -0.5
        self.recurrent_param = nn.Parameter(torch.empty(self.width, **fk))
        self.input_gate_weight = nn.Parameter(torch.randn(self.num_blocks, bw, bw, **fk) * scale)
        self.input_gate_bias = nn.Parameter(torch.zeros(self.num_blocks, bw, **fk))
        self.recurrent_gate_weight = nn.Parameter(torch.randn(self.num_blocks, bw, bw, **fk) * scale)
        self.recurrent_gate_bias = nn.Parameter(torch.zeros(self.num_blocks, bw, **fk))
        with torch.no_grad():  # Griffin's initialisation: a^c uniform in [0.9^2, 0.999^2] (modeling 580-582)
            u = torch.empty(self.width, device=device).uniform_(0.9 ** 2 + 1e-8, 0.999 ** 2 + 1e-8)
            self.recurrent_param.copy_(torch.log(torch.expm1(-0.5 * torch.log(u))))

    def _gate(self, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        """``sigmoid(x_block @ W_block + b_block)`` per block: ``[B, N, L] -> [B, N, L]``."""
        xb = x.unflatten(-1, (self.num_blocks, -1))  # [B, N, H, L/H]
        return torch.sigmoid(torch.einsum("bnhi,hij->bnhj", xb, weight.to(x.dtype)) + bias.to(x.dtype)).flatten(-2)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        i = self._gate(x, self.input_gate_weight, self.input_gate_bias)
        r = self._gate(x, self.recurrent_gate_weight, self.recurrent_gate_bias)
        log_a = -GATE_SCALE * r * F.softplus(self.recurrent_param.to(x.dtype))  # modeling 319
        return log_a, x * i

    def extra_repr(self) -> str:
        return f"width={self.width}, num_blocks={self.num_blocks}"


class GriffinRecurrentBlock(RecurrentMixer):
    """Griffin's recurrent block (transformers' ``RecurrentGemmaRecurrentBlock``): ``linear_out(
    rg_lru(conv1d(linear_x(u))) * act(linear_y(u)))`` (see the module docstring for the RG-LRU).

    Args:
        dim: model width ``C``.
        width: ``L``, the recurrence's width (``lru_width``).
        num_blocks: the gates' diagonal blocks (``num_attention_heads``), dividing ``L``.
        conv_size: the causal depthwise convolution's width (``conv1d_width``, >= 1).
        activation: the ``y`` branch's activation (a callable, e.g. ``F.gelu``).
        chunk_size: the kernel's chunk length.
        device, dtype: of the parameters.

    Weights: ``linear_x``, ``linear_y [L, C]``, ``out_proj [C, L]`` (transformers' ``linear_out``),
    all with biases; ``conv1d.weight [L, 1, K]`` and ``conv1d.bias [L]`` (``conv_1d``); the gates
    ``rg_lru`` (:class:`RGLRU`).

    The attention protocol of :class:`~attnzoo.nn.recurrent.RecurrentMixer` (``positions`` are not
    read: a sequence starts at the first real token of a fresh state). Key padding: a padded token
    feeds zeros to the convolution and neither writes nor decays the state. Decode cache: the state
    ``[B, L + 1, 1, 1]`` (``h``, then the started flag) and the convolution's last ``K - 1``
    inputs ``"conv1d" [B, L, K - 1]``.
    """

    def __init__(self, dim: int, width: int, num_blocks: int, *, conv_size: int = 4,
                 activation: Callable[[Tensor], Tensor] = F.gelu, chunk_size: int = CHUNK_SIZE,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        owner = "GriffinRecurrentBlock"
        width = check_int(width, "width", owner=owner)
        # one "head" of width L, layout "q_kv": the base makes q_proj [L, C] (linear_y, renamed), kv_proj
        # (unused) and out_proj [C, L] (linear_out; the base's checks read out_proj)
        super().__init__(dim, 1, head_dim=width, bias=True, layout="q_kv", factory=fk)
        self.linear_y = self.q_proj
        del self.q_proj, self.kv_proj
        self.linear_x = nn.Linear(self.dim, width, bias=True, **fk)
        self.width = width
        if not callable(activation):
            raise TypeError(f"{owner}: activation must be callable, got {type(activation).__name__}")
        self.activation = activation
        self.conv_size = check_int(conv_size, "conv_size", owner=owner)
        self.conv1d = ShortConv(width, self.conv_size, True, fk)
        self.rg_lru = RGLRU(width, num_blocks, **fk)
        self.chunk_size = check_int(chunk_size, "chunk_size", owner=owner)
        self.conv_channels = {"conv1d": width}
        self.state_shape = (width + 1, 1, 1)

    def _starts(self, pad: Tensor | None, state: Tensor | None, cu: Tensor | None,
                shape: tuple[int, int], device: torch.device) -> tuple[Tensor, Tensor]:
        """``(first [B, N], started [B])``: the tokens where a sequence starts (the reset) and
        whether each row's sequence has started after these tokens."""
        b, n = shape
        if cu is not None:  # packed: every non-empty sequence starts at its first token
            first = torch.zeros(1, n, dtype=torch.bool, device=device)
            cu = cu.to(device=device, dtype=torch.long)
            first[0, cu[:-1][cu[:-1] < cu[1:]]] = True
            return first, (cu[1:] > cu[:-1])
        real = torch.ones(b, n, dtype=torch.bool, device=device) if pad is None else pad
        count = real.long()
        seen = count.cumsum(1) - count  # real tokens before each one in this call
        fresh = (torch.ones(b, dtype=torch.bool, device=device) if state is None
                 else state[:, self.width, 0, 0] == 0)  # no real token before this call
        return real & (seen == 0) & fresh[:, None], ~fresh | real.any(1)

    def _mix(self, x: Tensor, pad: Tensor | None, state: Tensor | None, conv: Mapping[str, Tensor],
             cu: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        keep = None if pad is None else pad[..., None]  # [B, N, 1]
        y = self.activation(self.linear_y(x))  # [B, N, L], the gelu branch (modeling 426-427)
        xs = self.linear_x(x)
        if keep is not None:  # a padded token feeds zeros to the convolution
            xs = torch.where(keep, xs, xs.new_zeros(()))
        xs, last = self.conv1d(xs, conv.get("conv1d"), cu)  # modeling 429-455
        log_a, v = self.rg_lru(wide(xs))  # [B, N, L] each, float32 or wider
        first, started = self._starts(pad, state, cu, x.shape[:2], x.device)
        multiplier = BoundedSqrt.apply(1 - torch.exp(2 * log_a))  # modeling 321, 328
        v = v * torch.where(first[..., None], torch.ones_like(multiplier), multiplier)  # the reset: 1 (modeling 329)
        if keep is not None:  # a padded token neither writes nor decays the state
            v, log_a = v * keep, log_a * keep
        b, n = x.shape[:2]
        ones = v.new_ones(b, 1, n, 1)  # q = k = 1: one key head of width 1
        h0 = None if state is None else state[:, : self.width].to(v.dtype)
        h, last_h = gated_linear_attention(ones, ones, v.transpose(1, 2)[..., None], log_a.transpose(1, 2),
                                           scale=1.0, initial_state=h0, return_state=True,
                                           chunk_size=self.chunk_size, cu_seqlens=cu)  # [B, L, N, 1]
        out = self.out_proj(h[..., 0].transpose(1, 2).to(x.dtype) * y)  # modeling 459-460
        flag = started.to(last_h.dtype)[:, None, None, None]
        return out, torch.cat([last_h, flag], dim=1), {"conv1d": last}

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, width={self.width}, num_blocks={self.rg_lru.num_blocks}, "
                f"conv_size={self.conv_size}, chunk_size={self.chunk_size}")


def _rope(hf: HFConfig) -> dict[str, Any]:
    """The rope dict as transformers reads it: ``rope_parameters`` (or the legacy top-level
    ``rope_theta`` / ``partial_rotary_factor``), factor 0.5 when absent (config 90)."""
    params = parts.rope_params(hf)
    params.setdefault("partial_rotary_factor", hf.raw("partial_rotary_factor", 0.5))
    return params


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it (:data:`DEFAULTS` where a key is absent, the derived keys of
    config 82-90), its unsupported options refused by name."""
    data = dict(hf.data)
    if data.get("attention_window_size") is None and data.get("sliding_window") is not None:
        data["attention_window_size"] = data["sliding_window"]  # the attribute_map alias (config 57)
    out = HFConfig(data, hf.source, hf.arch).with_defaults(DEFAULTS)
    C, H = out.req("hidden_size"), out.req("num_attention_heads")
    out.data.setdefault("lru_width", C)
    out.data.setdefault("num_key_value_heads", H)
    out.data.setdefault("head_dim", C // H)
    if out.req("lru_width") % H:
        raise out.unsupported(f"lru_width={out.req('lru_width')} not a multiple of num_attention_heads={H} "
                              f"(the RG-LRU's gate blocks)")
    act = out.req("hidden_activation", str)
    if act not in parts.GATED:
        raise out.unsupported(f"hidden_activation={act!r} (supported: {', '.join(map(repr, parts.GATED))})")
    cap = out.req("logits_soft_cap", float)
    if not (math.isfinite(cap) and cap > 0):
        raise out.unsupported(f"logits_soft_cap={cap!r} (a finite cap > 0)")
    rope = _rope(out)
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type != "default":
        raise out.unsupported(f"rope_type={rope_type!r} (RecurrentGemma's rotary embedding is 'default' only)")
    rotated = int(out.req("head_dim") * float(rope["partial_rotary_factor"]))
    if rotated % 2 or not 0 <= rotated <= out.req("head_dim"):
        raise out.unsupported(f"partial_rotary_factor={rope['partial_rotary_factor']!r} (rotates {rotated} of "
                              f"head_dim={out.req('head_dim')} channels; an even count is needed)")
    layer_kinds(out)
    return out


def layer_kinds(hf: HFConfig) -> list[str]:
    """``block_types`` cycled to ``num_hidden_layers`` (config 98-102), each ``recurrent`` or ``attention``."""
    types = hf.req("block_types", list)
    bad = [t for t in types if t not in KINDS]
    if bad or not types:
        raise hf.unsupported(f"block_types={types!r} (each entry 'recurrent' or 'attention')")
    return [types[i % len(types)] for i in range(hf.req("num_hidden_layers"))]


def _attention_with_output_bias(make: Callable[[], nn.Module], factory: dict[str, Any]) -> nn.Module:
    """``make()`` with a biased ``out_proj`` (transformers' ``o_proj`` has a bias whatever
    ``attention_bias`` says, modeling 217)."""
    attn = make()
    out = attn.out_proj
    if out.bias is None:
        attn.out_proj = nn.Linear(out.in_features, out.out_features, bias=True, **factory)
    return attn


def _mixer_factories(hf: HFConfig, kw: dict[str, Any]) -> dict[str, Callable[[], nn.Module]]:
    """The factory of each layer kind's temporal block."""
    C, D = hf.req("hidden_size"), hf.req("head_dim")
    rope = _rope(hf)
    rotated = int(D * float(rope["partial_rotary_factor"]))
    rotary = parts.rotary(hf, rope, D, rotary_dim=rotated) if rotated else None
    attn = parts.attention_factory(hf, window=hf.req("attention_window_size") - 1, rope=rotary, **kw)
    act = ACTIVATIONS[parts.GATED[hf.req("hidden_activation", str)]][0]
    return {"attention": functools.partial(_attention_with_output_bias, attn, kw),
            "recurrent": functools.partial(GriffinRecurrentBlock, C, hf.req("lru_width"), hf.req("num_attention_heads"),
                                           conv_size=hf.req("conv1d_width"), activation=act, **kw)}


def build_recurrent_gemma(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                          dtype: Any = None) -> DecoderLM:
    """The decoder of a ``RecurrentGemmaConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, eps, kw = hf.req("hidden_size"), hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    mixers = _mixer_factories(hf, kw)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size") // 2, parts.GATED[hf.req("hidden_activation", str)],
                          bias=True, **kw)
    norm = parts.rms_norm(C, eps, **kw)
    blocks = [parts.block(C, mixers[kind], ffn, norm) for kind in layer_kinds(hf)]
    scale = float(torch.tensor(C ** 0.5, dtype=torch.bfloat16))  # the bfloat16 normalizer (modeling 623)
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, embed_scale=scale,
                         logit_softcap=hf.req("logits_soft_cap", float), **kw)


def put_recurrent(plan: Plan, ours: str, theirs: str) -> None:
    """A :class:`GriffinRecurrentBlock` at ``ours`` (``"blocks.0.attn."``) from transformers'
    ``RecurrentGemmaRecurrentBlock`` at ``theirs`` (``"layers.0.temporal_block."``)."""
    plan.put_pairs(ours, theirs, [("linear_x", "linear_x"), ("linear_y", "linear_y"), ("out_proj", "linear_out"),
                                  ("conv1d", "conv_1d")], bias=True)
    for name in ("recurrent_param", "input_gate_weight", "input_gate_bias", "recurrent_gate_weight",
                 "recurrent_gate_bias"):
        plan.put(f"{ours}rg_lru.{name}", f"{theirs}rg_lru.{name}")


def convert_recurrent_gemma(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build a RecurrentGemma decoder and copy the weights (the head follows them)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, build_recurrent_gemma, device=device, dtype=dtype)
    bias = hf.req("attention_bias", bool)
    for i, kind in enumerate(layer_kinds(hf)):
        o, h = f"blocks.{i}.", f"layers.{i}.temporal_block."
        if kind == "recurrent":
            put_recurrent(plan, f"{o}attn.", h)
        else:
            parts.put_attention(plan, f"{o}attn", h, bias=bias)
            if not bias:  # o_proj's bias is always there (modeling 217)
                plan.put(f"{o}attn.out_proj.bias", f"{h}o_proj.bias")
        parts.put_mlp(plan, f"{o}ffn.", f"layers.{i}.mlp_block.", bias=True)
        for ours, theirs in (("attn_norm", "temporal_pre_norm"), ("ffn_norm", "channel_pre_norm")):
            plan.put(f"{o}{ours}.weight", f"layers.{i}.{theirs}.weight", parts.plus_one)
    return parts.finish(plan, model, head_size, norm_transform=parts.plus_one, final_norm="final_norm")


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "recurrent_gemma": parts.Dispatch("RecurrentGemma", convert_recurrent_gemma, ("RecurrentGemmaForCausalLM", "RecurrentGemmaModel")),
}
