"""Doge (``doge``) -> :class:`~attnzoo.DecoderLM`: ``DogeForCausalLM`` and ``DogeModel``. Line
numbers: transformers 5.25's ``models/doge/modeling_doge.py``.

A pre-norm decoder (RMSNorm) with:

* Dynamic mask attention (236-358; :class:`DynamicMaskAttention` on
  :class:`~attnzoo.MultiHeadAttention`): GQA with per-head q/k RMSNorms before RoPE, plus a score
  bias per key and key/value head computed from the values of every key held (after the cache
  update): ``exp(A * softplus(dt_proj(v)))`` (``A [Hkv]``, ``dt_proj [Hkv, Hkv D]``; 291-295).
  Masked keys (causal, padding, ``sliding_window``) get the dtype's most negative number instead
  of their bias (327-336), and past ``keep_window_size`` keys each query keeps only the
  ``keep_window_size`` of largest bias (337-341). A query with every key masked (a left-padding
  row) thus averages the values of *all* the keys held, as transformers' eager does.
* Per-channel residual weights: ``x = input_residual * x + attn(norm(x))``, then
  ``x = post_attention_residual * x + mlp(norm(x))`` (433-473; :class:`ScaledResidualBlock`).
* The feed-forward: a gated MLP (``mlp_bias``), or with ``is_moe`` the cross-domain MoE (375-424;
  :class:`CDMoE`): that MLP as a shared expert plus ``num_experts`` one-neuron experts
  (``down_embed``, ``up_embed`` rows) picked by product keys: ``2 * sqrt(num_experts)`` router
  logits, all sums of an "x" and a "y" score, the ``num_experts_per_tok`` best, softmax-weighted.
  transformers splits the logits with ``view(2, B * N, K)`` (399): token ``t``'s x/y scores are
  the logits of the flattened tokens ``t // 2`` and ``(B N + t) // 2``, so a token is routed by
  other tokens of the same call (later ones, other rows, padding) — kept, its comment says, for the
  released checkpoints. attnzoo follows it call by call: the full forward and ``generate`` (prefill,
  then ``B`` tokens a step) equal transformers', but a cached decode differs from the full forward
  in both libraries, and packed sequences run the MoE one sequence at a time (each as alone).

Refused by name: a ``hidden_act`` without a gated attnzoo MLP, ``pretraining_tp`` other than 1,
rope types attnzoo's rotary does not know, masks other than boolean ones.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.blocks import BlockLayers, FeedForward, TransformerBlock
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.nn.attention import MultiHeadAttention
from attnzoo.nn.packing import REFUSAL
from attnzoo.nn.parts import parts_from_settings
from attnzoo.nn.positional import RotaryEmbedding

__all__ = ["DEFAULTS", "DISPATCH", "CDMoE", "DynamicMaskAttention", "ScaledResidualBlock", "build_doge", "canonical",
           "convert_doge"]

#: ``DogeConfig``'s defaults of the keys read here (configuration 120-146) that a ``config.json`` may leave out
DEFAULTS: dict[str, Any] = {
    "hidden_dropout": 0.0, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "max_position_embeddings": 2048, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
    "keep_window_size": 2048, "is_moe": False, "num_experts": 16384, "num_experts_per_tok": 64,
    "norm_topk_prob": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
#: attnzoo's gated activations -> the elementwise function of the one-neuron experts
ACTIVATIONS = {"swiglu": F.silu, "geglu": F.gelu, "geglu_tanh": functools.partial(F.gelu, approximate="tanh")}


class DynamicMaskAttention(MultiHeadAttention):
    """Doge's dynamic mask attention (see the module docstring): causal GQA with per-head QK norms
    (``parts``), RoPE, an optional left ``window``, and a per-key score bias from the values.

    Args:
        dim, num_heads, num_kv_heads, head_dim, bias, window, rope, dropout, parts: as
            :class:`~attnzoo.MultiHeadAttention` (``bias`` also on ``dt_proj``).
        keep_window_size: past this many keys held, each query keeps the ones of largest bias.

    Weights: those of :class:`~attnzoo.MultiHeadAttention`, ``A [Hkv]``, ``dt_proj [Hkv, Hkv D]``.
    Shapes: ``x [B, N, C] -> [B, N, C]``; ``mask``: a boolean ``[B, 1, 1, Nk]`` key padding (``Nk``:
    every token written, then the new ones). Packed input runs one sequence at a time.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *, bias: bool,
                 window: int | None, rope: RotaryEmbedding | None, dropout: float, parts: Any,
                 keep_window_size: int) -> None:
        super().__init__(dim, num_heads, num_kv_heads, None, head_dim, bias, True, window, rope, dropout, parts=parts)
        self.keep_window_size = int(keep_window_size)
        self.A = nn.Parameter(torch.zeros(num_kv_heads))
        self.dt_proj = nn.Linear(num_kv_heads * head_dim, num_kv_heads, bias=bias)

    def _packed(self, *args: Any) -> Tensor:
        raise ValueError(f"DynamicMaskAttention: {REFUSAL} runs one sequence at a time (the bias masks by position)")

    def _self(self, x: Tensor, mask: Tensor | Any, cache: Any, positions: Tensor | None,
              return_weights: bool) -> tuple[Tensor, Tensor | None]:
        self._check_self_cache(cache)
        N = x.shape[1]
        start = 0 if cache is None else cache.length
        q, k, v = self._project_self(x, positions, start, rotate=True)
        if cache is not None:
            k, v, _ = cache.update(k, v)
        first = start + N - k.shape[2]  # the position of the first key held
        bias = self._dynamic_mask(v, mask, start, first, N)
        return self._core(q, k, v, mask=bias, causal=False, window=None, q_offset=start - first, alibi=None,
                          return_weights=return_weights, key_start=first)

    def _dynamic_mask(self, v: Tensor, mask: Tensor | Any, start: int, first: int, N: int) -> Tensor:
        """The additive mask ``[B, H, N, L]`` of queries at ``start ..`` over the ``L`` keys at ``first ..``
        held (``v [B, Hkv, L, D]``): each visible key's bias, the most negative number elsewhere."""
        B, Hkv, L, D = v.shape
        dt = self.dt_proj(v.transpose(1, 2).reshape(B, L, Hkv * D))  # [B, L, Hkv]
        dt = torch.exp(self.A * F.softplus(dt)).transpose(1, 2)  # [B, Hkv, L]
        q_pos = torch.arange(start, start + N, device=v.device)[:, None]
        k_pos = torch.arange(first, first + L, device=v.device)[None, :]
        see = k_pos <= q_pos  # [N, L]
        if self.window is not None and self.window[0] is not None:
            see = see & (q_pos - k_pos <= self.window[0])
        see = see[None, None]  # [1, 1, N, L]
        if mask is not None:
            if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
                raise TypeError("DynamicMaskAttention: mask must be a boolean key padding [B, 1, 1 or N, Nk]")
            see = see & mask[..., first:first + L]
        neg = torch.finfo(dt.dtype).min
        bias = dt[:, :, None, :].masked_fill(~see, neg)  # [B, Hkv, N, L]
        if self.keep_window_size < L:
            chosen = torch.topk(bias, self.keep_window_size, dim=-1, sorted=False).indices
            keep = torch.zeros_like(bias, dtype=torch.bool).scatter(-1, chosen, True)
            bias = bias.masked_fill(~keep, neg)
        return bias.repeat_interleave(self.num_heads // Hkv, dim=1)  # [B, H, N, L]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, keep_window_size={self.keep_window_size}"


class CDMoE(nn.Module):
    """Doge's cross-domain MoE (see the module docstring): a gated MLP ``shared`` plus one-neuron
    experts ``act(down_embed[e] . x) * w_e * up_embed[e]`` over the ``top_k`` product-key picks.

    Args:
        dim, hidden: ``C`` and the shared MLP's width.
        num_experts, top_k: ``E`` (``K = floor(sqrt(E))`` keys a side) and the picks a token.
        activation: the gated activation (``"swiglu"``, ``"geglu"``, ``"geglu_tanh"``).
        bias: biases in the shared MLP.
        norm_topk_prob: divide the softmax weights by their sum.

    Weights: ``shared`` (:class:`~attnzoo.FeedForward`), ``router_gate [2K, C]``, ``down_embed``,
    ``up_embed [E, C]``. Shapes: ``x [B, N, C] -> [B, N, C]`` (packed ``[1, T, C]`` with
    ``cu_seqlens``: each sequence alone).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, activation: str, bias: bool,
                 norm_topk_prob: bool, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.num_experts, self.top_k, self.num_keys = num_experts, top_k, math.isqrt(num_experts)
        self.norm_topk_prob, self.activation = bool(norm_topk_prob), activation
        self.shared = FeedForward(dim, hidden, activation, bias=bias, **kw)
        self.router_gate = nn.Linear(dim, 2 * self.num_keys, bias=False, **kw)
        self.down_embed = nn.Parameter(torch.randn(num_experts, dim, **kw))
        self.up_embed = nn.Parameter(torch.randn(num_experts, dim, **kw))

    def forward(self, x: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
        if cu_seqlens is not None:
            bounds = [int(c) for c in cu_seqlens.tolist()]
            return torch.cat([self._mix(x[:, a:b]) for a, b in itertools.pairwise(bounds)], dim=1)
        return self._mix(x)

    def _mix(self, x: Tensor) -> Tensor:
        """One call's tokens ``x [B, N, C]``, routed as transformers routes them (399-412)."""
        B, N, C = x.shape
        T, K = B * N, self.num_keys
        logits = self.router_gate(x).view(2, T, K)  # transformers' split: across the flattened tokens
        (sx, sy), (ix, iy) = logits.topk(K, dim=-1)  # [T, K] each
        scores = (sx[..., :, None] + sy[..., None, :]).flatten(-2)  # [T, K * K]
        indices = (ix[..., :, None] * K + iy[..., None, :]).flatten(-2)
        top, where = scores.topk(self.top_k, dim=-1)  # [T, k]
        experts = indices.gather(-1, where)
        weights = torch.softmax(top, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = x.reshape(T, C, 1)
        act = ACTIVATIONS[self.activation](torch.matmul(self.down_embed[experts], flat).view(T, -1)) * weights
        routed = torch.matmul(act.view(T, 1, -1), self.up_embed[experts]).view(B, N, C)
        return self.shared(x) + routed

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}, num_keys={self.num_keys}"


class ScaledResidualBlock(TransformerBlock):
    """A pre-norm :class:`~attnzoo.TransformerBlock` whose residuals are weighted per channel:
    ``x = attn_residual * x + attn(attn_norm(x))``, ``x = ffn_residual * x + ffn(ffn_norm(x))``
    (Doge's ``input_residual`` / ``post_attention_residual``). Shapes: ``x [B, N, C] -> [B, N, C]``."""

    def __init__(self, dim: int, layers: BlockLayers, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__(dim, layers=layers)
        self.attn_residual = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.ffn_residual = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Any = None,  # type: ignore[override]
                key_padding: Tensor | None = None, context_mask: Any = None, cache: Any = None,
                positions: Tensor | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
        """The arguments as :meth:`TransformerBlock.forward` (no context)."""
        if context is not None or context_mask is not None:
            raise ValueError("ScaledResidualBlock: this block has no cross-attention (context given)")
        if key_padding is not None:
            mask = self._self_mask(mask, key_padding)
        assert self.ffn is not None and self.ffn_norm is not None  # built with a feed-forward
        x = self.attn_residual * x + self.dropout(self._mix(self.attn_norm(x), mask, cache, positions, cu_seqlens))
        h = self.ffn_norm(x)
        y = self.ffn(h, cu_seqlens) if cu_seqlens is not None and isinstance(self.ffn, CDMoE) else self.ffn(h)
        return self.ffn_residual * x + self.dropout(y)


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it (:data:`DEFAULTS`; ``num_key_value_heads`` defaults to the
    query heads), the options attnzoo cannot reproduce refused by name."""
    out = hf.with_defaults(DEFAULTS)
    out.data.setdefault("num_key_value_heads", out.req("num_attention_heads"))
    out.activation("hidden_act", parts.GATED, "silu")
    return out


def _attention(hf: HFConfig, rope: RotaryEmbedding, device: Any, dtype: Any) -> DynamicMaskAttention:
    C, H, _, D = parts.dims(hf)
    Hkv, eps = hf.req("num_key_value_heads"), hf.req("rms_norm_eps", float)
    window = hf.get("sliding_window", None)
    module = DynamicMaskAttention(
        C, H, Hkv, D, bias=hf.req("attention_bias", bool), window=None if window is None else window - 1, rope=rope,
        dropout=hf.req("attention_dropout", float), keep_window_size=hf.req("keep_window_size"),
        parts=parts_from_settings(C, H, Hkv, D, qk_norm="head", qk_norm_eps=eps))
    return module.to(device=device, dtype=dtype)


def build_doge(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``DogeConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, _, depth, D = parts.dims(hf)
    eps, kw = hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    act, F_ = hf.activation("hidden_act", parts.GATED, "silu"), hf.req("intermediate_size")
    if hf.req("is_moe", bool):
        ffn = functools.partial(CDMoE, C, F_, hf.req("num_experts"), hf.req("num_experts_per_tok"), activation=act,
                                bias=hf.req("mlp_bias", bool), norm_topk_prob=hf.req("norm_topk_prob", bool), **kw)
    else:
        ffn = parts.gated_mlp(C, F_, act, bias=hf.req("mlp_bias", bool), **kw)
    attention = functools.partial(_attention, hf, parts.rotary(hf, parts.rope_params(hf), D), device, dtype)
    layers = BlockLayers(attention=attention, feed_forward=ffn, norm=parts.rms_norm(C, eps, **kw),
                         dropout=hf.req("hidden_dropout", float))
    blocks = [ScaledResidualBlock(C, layers, **kw) for _ in range(depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def _put_layer(plan: Plan, o: str, h: str, hf: HFConfig) -> None:
    """One layer's attention (with ``A``, ``dt_proj``), feed-forward, norms and residual weights."""
    bias, mlp_bias = hf.req("attention_bias", bool), hf.req("mlp_bias", bool)
    parts.put_attention(plan, f"{o}attn", f"{h}self_attn.", bias=bias, qk_norm=True)
    plan.put(f"{o}attn.A", f"{h}self_attn.A")
    plan.put_pairs(f"{o}attn.", f"{h}self_attn.", [("dt_proj", "dt_proj")], bias=bias)
    if hf.req("is_moe", bool):
        parts.put_mlp(plan, f"{o}ffn.shared.", f"{h}mlp.", bias=mlp_bias)
        plan.put(f"{o}ffn.router_gate.weight", f"{h}mlp.router_gate.weight")
        for n in ("down_embed", "up_embed"):
            plan.put(f"{o}ffn.{n}", f"{h}mlp.{n}.weight")
    else:
        parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.", bias=mlp_bias)
    plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    plan.put(f"{o}attn_residual", f"{h}input_residual")
    plan.put(f"{o}ffn_residual", f"{h}post_attention_residual")


def convert_doge(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, build_doge, device=device, dtype=dtype)
    for i in range(model.depth):
        _put_layer(plan, f"blocks.{i}.", f"layers.{i}.", hf)
    return parts.finish(plan, model, head_size)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"doge": parts.Dispatch("Doge", convert_doge, ("DogeForCausalLM", "DogeModel"))}
