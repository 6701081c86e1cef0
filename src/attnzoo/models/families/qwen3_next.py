"""Qwen3-Next -> :class:`~attnzoo.DecoderLM`: ``Qwen3NextForCausalLM`` and ``Qwen3NextModel``.

``layer_types``: by default three ``linear_attention`` layers per ``full_attention`` layer.

* Linear layers: :class:`QwenGatedDeltaNet` — one projection to ``q, k`` (``Hk`` key heads),
  ``v`` and the output gate ``z`` (``Hv`` value heads, a multiple of ``Hk``: grouped value
  heads), a depthwise causal conv1d (kernel ``linear_conv_kernel_dim``) + SiLU over
  ``[q; k; v]``, L2-normalised q and k, ``beta = sigmoid(b)``, the per-head decay
  ``log a = -exp(A_log) * softplus(a + dt_bias)``, the gated delta rule
  (:func:`attnzoo.delta_rule`, value head ``j`` reading key head ``j // (Hv / Hk)``), then a
  per-head RMSNorm times ``silu(z)`` and ``out_proj``. Padded tokens are zeroed at the input (so
  a left-padded row equals the unpadded one); packed inputs (``cu_seqlens``) keep the conv and
  the state inside each sequence.
* Full layers: :class:`~attnzoo.MultiHeadAttention` with per-head QK RMSNorm, partial rotary
  (``partial_rotary_factor`` of the head width), and an element-wise output gate
  ``sigmoid(gate)`` whose rows transformers interleaves with the query rows per head.
* Feed-forward: a :class:`~attnzoo.nn.moe.MixtureOfExperts` (softmax then top-k,
  ``norm_topk_prob``, a sigmoid-gated shared expert) on the sparse layers
  (``decoder_sparse_step``, not in ``mlp_only_layers``), a dense SwiGLU elsewhere.

Multi-token prediction: a checkpoint folder's ``mtp.*`` (``mtp.fc``, ``mtp.pre_fc_norm_embedding`` /
``mtp.pre_fc_norm_hidden``, ``mtp.layers.0``: a full-attention decoder layer whose feed-forward is layer
0's kind, ``mtp.norm``; the released Qwen3-Next / Qwen3.5 checkpoints hold one) loads as the model's
``mtp`` (:mod:`attnzoo.models.mtp`): ``norm(layer(fc([norm_e(embed(t[j+1])); norm_h(h[j])])))``, as
vLLM's ``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py`` run it (transformers drops these weights).

Norms are Qwen3-Next's ``1 + weight`` RMSNorms (loaded as ``weight + 1``), except the gated
norm of the linear layers (plain ``weight``). The weights of ``in_proj_qkvz`` / ``in_proj_ba``
are grouped per key head in transformers; they are regrouped at load into ``[q; k; v; z]`` /
``[b; a]``.

Half precision, as transformers rounds (``modeling_qwen3_next.py``): the ``1 + weight`` norms scale
in float32 with their weight kept in float32 (126-140,
:class:`~attnzoo.models.families._common.Float32ScaleRMSNorm`), the convolution sums in float32
and rounds once (``F.conv1d``, 320-359), the gated norm multiplies the gate in float32 (66-75).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._devices import cache_dtype
from attnzoo._validate import check_bool, check_int
from attnzoo.functional.recurrent.delta_rule import delta_rule
from attnzoo.masks import Mask
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import moe_from_config, put_moe
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.mtp import MTPLayer, MultiTokenPredictor
from attnzoo.nn.cache import RowsCache

__all__ = ["DISPATCH", "LinearStateCache", "QwenGatedDeltaNet", "build_qwen3_next", "causal_conv", "convert_qwen3_next",
           "put_gated_deltanet", "segment_ids"]


class LinearStateCache(RowsCache):
    """Decode cache of a :class:`QwenGatedDeltaNet`: the last ``K - 1`` conv inputs
    ``conv [B, K-1, conv_dim]`` and the delta-rule state ``state [B, Hv, Dk, Dv]`` (float32).
    Cache protocol: ``length``, ``batch_size``, ``reset()``, ``reorder(index)``, ``mark()`` /
    ``rollback()`` / ``commit()`` (the module replaces both tensors at every call)."""

    _batch_tensors = ("conv", "state")

    def __init__(self, batch_size: int, conv: int, conv_dim: int, heads: int, dk: int, dv: int, *,
                 device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        self.batch_size, self.length = batch_size, 0
        self.conv = torch.zeros(batch_size, conv - 1, conv_dim, device=device, dtype=dtype)
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.state = torch.zeros(batch_size, heads, dk, dv, device=device, dtype=state_dtype)

    def reset(self) -> None:
        self.length = 0
        self.conv = torch.zeros_like(self.conv)  # new tensors: a mark may hold the old ones
        self.state = torch.zeros_like(self.state)


def _real_tokens(mask: Tensor | Mask | None, B: int, N: int, past: int) -> Tensor | None:
    """``[B, N]`` bool, True for the new tokens that are real, from the key-padding mask the block
    passes (``None``: all real)."""
    if mask is None:
        return None
    if isinstance(mask, Mask):
        mask = mask.materialize(B, 1, 1, past + N, q_offset=past + N - 1)  # the last query sees every key
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError("QwenGatedDeltaNet: mask must be a key-padding bool tensor or attnzoo.masks.Mask")
    return mask.expand(B, -1, -1, -1)[:, 0, -1, past:]


def real_keys(mask: Tensor | Mask | None, batch: int, keys: int, device: torch.device) -> Tensor:
    """``[B, keys]`` bool, True for the real keys (every one cached and new) from the key-padding
    mask a block passes; all True without one (the indexed attentions' selection reads it)."""
    real = _real_tokens(mask, batch, keys, 0)
    return torch.ones(batch, keys, dtype=torch.bool, device=device) if real is None else real


def segment_ids(cu_seqlens: Tensor, n: int) -> Tensor:
    """The sequence index ``[T]`` of every token of a packed batch (``cu_seqlens [S+1]``)."""
    return torch.searchsorted(cu_seqlens[1:].long(), torch.arange(n, device=cu_seqlens.device), right=True)


def causal_conv(u: Tensor, weight: Tensor, bias: Tensor | None = None, *, prefix: Tensor | None = None,
                segments: Tensor | None = None) -> Tensor:
    """Depthwise causal conv1d of ``u [B, N, C]`` with ``weight [C, K]`` (column ``K-1`` multiplies
    the current token), after ``prefix [B, K-1, C]`` (the previous inputs; zeros when ``None``).
    With ``segments [N]`` (packed sequences) a tap never reads another sequence's token.
    Returns ``[B, N, C]`` in ``u``'s dtype (no activation): half-precision inputs are summed in
    float32 and rounded once, as ``F.conv1d`` and the ``causal_conv1d`` kernels accumulate (a
    rounding per tap: 1.3-1.6 times transformers' bfloat16 logits error on Qwen3-Next)."""
    B, N, C = u.shape
    K = weight.shape[-1]
    wide = torch.promote_types(u.dtype, torch.float32)
    full = torch.cat([u.new_zeros(B, K - 1, C, dtype=wide) if prefix is None else prefix.to(wide), u.to(wide)],
                     dim=1)  # [B, K-1+N, C]
    out = u.new_zeros(B, N, C, dtype=wide) if bias is None else bias.to(wide).expand(B, N, C).clone()
    for j in range(K):  # tap j reads the token j steps back
        tap = full[:, K - 1 - j: K - 1 - j + N] * weight[:, K - 1 - j].to(wide)
        if segments is not None and j:
            same = torch.zeros(N, dtype=torch.bool, device=u.device)
            same[j:] = segments[j:] == segments[:-j]
            tap = tap * same[None, :, None]
        out = out + tap
    return out.to(u.dtype)


class QwenGatedDeltaNet(nn.Module):
    """Qwen3-Next's gated DeltaNet layer with grouped value heads (see the module docstring).

    Args:
        dim: model width ``C``.
        num_k_heads, num_v_heads: ``Hk`` and ``Hv`` (``Hv % Hk == 0``).
        k_head_dim, v_head_dim: ``Dk``, ``Dv``.
        conv_kernel: the causal conv1d width ``K``.
        norm_eps: epsilon of the gated RMSNorm.
        allow_neg_eigval: ``beta = 2 sigmoid(b)`` in ``[0, 2]`` (OLMo-hybrid), computed exactly as the
            rule with ``sqrt(2) k``, ``sqrt(2) v`` and ``beta / 2`` (the state update is the same).

    Weights: ``in_proj_qkvz [2 Hk Dk + 2 Hv Dv, C]`` (rows ``[q; k; v; z]``), ``in_proj_ba
    [2 Hv, C]`` (rows ``[b; a]``), ``conv_weight [2 Hk Dk + Hv Dv, K]``, ``dt_bias [Hv]``,
    ``A_log [Hv]``, ``norm_weight [Dv]``, ``out_proj [C, Hv Dv]``.
    Shapes: ``x [B, N, C] -> [B, N, C]``.
    """

    def __init__(self, dim: int, num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int,
                 conv_kernel: int = 4, *, norm_eps: float = 1e-6, allow_neg_eigval: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads),
                            ("k_head_dim", k_head_dim), ("v_head_dim", v_head_dim), ("conv_kernel", conv_kernel)):
            check_int(value, name, "QwenGatedDeltaNet")
        if num_v_heads % num_k_heads:
            raise ValueError(f"QwenGatedDeltaNet: num_v_heads ({num_v_heads}) must be a multiple of num_k_heads "
                             f"({num_k_heads})")
        self.dim, self.hk, self.hv, self.dk, self.dv = dim, num_k_heads, num_v_heads, k_head_dim, v_head_dim
        self.conv_kernel, self.norm_eps = conv_kernel, float(norm_eps)
        self.allow_neg_eigval = check_bool(allow_neg_eigval, "allow_neg_eigval", "QwenGatedDeltaNet")
        self.key_dim, self.value_dim = num_k_heads * k_head_dim, num_v_heads * v_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.in_proj_qkvz = nn.Linear(dim, 2 * self.key_dim + 2 * self.value_dim, bias=False, **kw)
        self.in_proj_ba = nn.Linear(dim, 2 * num_v_heads, bias=False, **kw)
        bound = 1.0 / math.sqrt(conv_kernel)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel, **kw).uniform_(-bound, bound))
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads, **kw))
        self.A_log = nn.Parameter(torch.empty(num_v_heads, **kw).uniform_(0.01, 16).log())
        self.norm_weight = nn.Parameter(torch.ones(v_head_dim, **kw))
        self.out_proj = nn.Linear(self.value_dim, dim, bias=False, **kw)

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> LinearStateCache:
        """A :class:`LinearStateCache` (its size does not depend on ``max_len``)."""
        p = self.out_proj.weight
        return LinearStateCache(batch_size, self.conv_kernel, self.conv_dim, self.hv, self.dk, self.dv,
                                device=p.device if device is None else device, dtype=cache_dtype(p, dtype))

    def forward(self, x: Tensor, *, mask: Tensor | Mask | None = None, cache: LinearStateCache | None = None,
                positions: Tensor | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"QwenGatedDeltaNet: x must be [B, N, {self.dim}], got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        if cu_seqlens is not None and (cache is not None or x.shape[0] != 1):
            raise ValueError("QwenGatedDeltaNet: packed input (cu_seqlens) needs x [1, T, C] and no cache")
        B, N, _ = x.shape
        past = 0 if cache is None else cache.length
        real = _real_tokens(mask, B, N, past)
        if real is not None:
            x = x * real[..., None].to(x.dtype)
        q, k, v, z = self.in_proj_qkvz(x).split([self.key_dim, self.key_dim, self.value_dim, self.value_dim], -1)
        b, a = self.in_proj_ba(x).split([self.hv, self.hv], -1)  # [B, N, Hv]
        u = torch.cat([q, k, v], dim=-1)  # [B, N, conv_dim]
        segments = None if cu_seqlens is None else segment_ids(cu_seqlens, N)
        mixed = F.silu(causal_conv(u, self.conv_weight, prefix=None if cache is None else cache.conv,
                                   segments=segments))
        if cache is not None:
            cache.conv = torch.cat([cache.conv, u.to(cache.conv.dtype)], dim=1)[:, -(self.conv_kernel - 1):]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], -1)
        cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        q = q.reshape(B, N, self.hk, self.dk).transpose(1, 2).to(cdt)  # [B, Hk, N, Dk]
        k = k.reshape(B, N, self.hk, self.dk).transpose(1, 2).to(cdt)
        v = v.reshape(B, N, self.hv, self.dv).transpose(1, 2).to(cdt)  # [B, Hv, N, Dv]
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(b.to(cdt)).transpose(1, 2)  # [B, Hv, N]
        if self.allow_neg_eigval:  # beta' = 2 sigmoid(b) in [0, 2]: the same rule with sqrt(2) k, sqrt(2) v, beta'/2
            k, v = k * math.sqrt(2.0), v * math.sqrt(2.0)
        g = (-self.A_log.to(cdt).exp() * F.softplus(a.to(cdt) + self.dt_bias.to(cdt))).transpose(1, 2)
        out, state = delta_rule(q, k, v, beta, log_decay=g, initial_state=None if cache is None else cache.state,
                                return_state=True, cu_seqlens=cu_seqlens)  # [B, Hv, N, Dv]
        if cache is not None:
            cache.state = state.to(cache.state.dtype)  # replaced, not written in place: a mark holds the old one
            cache.length += N
        o = self.gated_norm(out.transpose(1, 2), z.reshape(B, N, self.hv, self.dv))  # [B, N, Hv, Dv]
        return self.out_proj(o.reshape(B, N, self.value_dim))

    def gated_norm(self, o: Tensor, z: Tensor) -> Tensor:
        """The per-head RMSNorm of the rule's output ``o [B, N, Hv, Dv]`` (float32 or float64) times
        ``silu(z)`` (``z [B, N, Hv, Dv]`` in the model's dtype), returned in ``z``'s dtype. As
        transformers' ``Qwen3NextRMSNormGated`` (``modeling_qwen3_next.py`` 66-75): the normalised
        ``o`` cast to the model's dtype times the weight, then the gate multiplied in float32 with
        one rounding after it (a gate rounded to 16 bits first: a second rounding in half precision)."""
        normed = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps)).to(z.dtype) * self.norm_weight
        return (normed * F.silu(z.to(o.dtype))).to(z.dtype)

    def extra_repr(self) -> str:
        return (f"{self.dim}, num_k_heads={self.hk}, num_v_heads={self.hv}, k_head_dim={self.dk}, "
                f"v_head_dim={self.dv}, conv_kernel={self.conv_kernel}")


def _sparse_layers(hf: HFConfig, depth: int) -> set[int]:
    if hf.get("num_experts", 0) <= 0:
        return set()
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers", [], list))
    return {i for i in range(depth) if i not in dense and (i + 1) % step == 0}


def build_qwen3_next(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                     dtype: Any = None, mtp: int = 0) -> DecoderLM:
    """The decoder of a ``Qwen3NextConfig`` (random weights; see the module docstring), with ``mtp``
    multi-token-prediction layers (full attention, layer 0's feed-forward kind)."""
    parts.unsupported_keys(hf, {"hidden_act": lambda v: v in (None, "silu", "swish"), "attention_bias": lambda v: not v})
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    D, eps, kw = hf.get("head_dim", C // H), hf.get("rms_norm_eps", 1e-6, float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, ("linear_attention", "full_attention"))
    params = parts.rope_params(hf)
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0, float)))
    rope = parts.rotary(hf, params, D, rotary_dim=int(D * partial))
    full = parts.attention_factory(hf, window=None, rope=rope, qk_norm="head", output_gate="element", **kw)
    linear = functools.partial(QwenGatedDeltaNet, C, hf.req("linear_num_key_heads"), hf.req("linear_num_value_heads"),
                               hf.req("linear_key_head_dim"), hf.req("linear_value_head_dim"),
                               hf.get("linear_conv_kernel_dim", 4), norm_eps=eps, **kw)
    sparse, moe = _sparse_layers(hf, depth), functools.partial(moe_from_config, hf, "stacked", **kw)
    dense = parts.gated_mlp(C, hf.req("intermediate_size"), "swiglu", **kw)
    norm = parts.rms_norm(C, eps, **kw)
    blocks = [parts.block(C, linear if kinds[i] == "linear_attention" else full, moe if i in sparse else dense, norm)
              for i in range(depth)]
    predictor = MultiTokenPredictor([MTPLayer(C, parts.block(C, full, moe if 0 in sparse else dense, norm), norm, **kw)
                                     for _ in range(mtp)]) if mtp else None
    model = parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, mtp=predictor, **kw)
    return parts.float32_scale_norms(model, keep_float32=True)


def _per_key_head(w: Tensor, hk: int, sizes: list[int]) -> list[Tensor]:
    """Split rows grouped per key head (``[g0: s0, s1, ...; g1: ...]``) into one block per part."""
    groups = w.reshape(hk, sum(sizes), *w.shape[1:])
    return [p.reshape(-1, *w.shape[1:]) for p in groups.split(sizes, dim=1)]


def put_deltanet_rest(plan: Plan, ours: str, theirs: str, *, norm: str = "norm", out: str = "out_proj") -> None:
    """A :class:`QwenGatedDeltaNet`'s conv, decay, norm and output weights (shared by the layouts;
    ``norm``/``out``: transformers' names of the gated norm and the output projection)."""
    plan.put(f"{ours}conv_weight", f"{theirs}conv1d.weight", lambda w: w[:, 0].contiguous())
    for n in ("dt_bias", "A_log"):
        plan.put(f"{ours}{n}", f"{theirs}{n}")
    plan.put(f"{ours}norm_weight", f"{theirs}{norm}.weight")
    plan.put(f"{ours}out_proj.weight", f"{theirs}{out}.weight")


def put_gated_deltanet(plan: Plan, ours: str, theirs: str, hf: HFConfig) -> None:
    """The weights of a :class:`QwenGatedDeltaNet` at ``ours`` from Qwen3-Next's layer at
    ``theirs`` (``in_proj_qkvz`` / ``in_proj_ba`` grouped per key head, regrouped)."""
    hk, hv = hf.req("linear_num_key_heads"), hf.req("linear_num_value_heads")
    dk, dv, r = hf.req("linear_key_head_dim"), hf.req("linear_value_head_dim"), hv // hk
    plan.put(f"{ours}in_proj_qkvz.weight", f"{theirs}in_proj_qkvz.weight",
             lambda w: torch.cat(_per_key_head(w, hk, [dk, dk, r * dv, r * dv])))
    plan.put(f"{ours}in_proj_ba.weight", f"{theirs}in_proj_ba.weight", lambda w: torch.cat(_per_key_head(w, hk, [r, r])))
    put_deltanet_rest(plan, ours, theirs)


def put_gated_attention(plan: Plan, ours: str, theirs: str, hf: HFConfig) -> None:
    """Full attention at ``ours`` whose transformers ``q_proj`` rows interleave ``[q_h; gate_h]``
    per head: the query rows go to ``qkv_proj`` (with k and v), the gate rows to the output gate."""
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    D = hf.get("head_dim", C // H)
    qg, k, v = (plan.src.take(f"{theirs}{n}_proj.weight") for n in "qkv")
    if qg is not None and k is not None and v is not None:
        q, gate = _per_key_head(qg, H, [D, D])
        where = f"{plan.src.prefix}{theirs}q_proj.weight"
        plan.put_tensor(f"{ours}.qkv_proj.weight", torch.cat([q, k, v]), f"{where} (query rows) + k_proj + v_proj")
        plan.put_tensor(f"{ours}.frontier.gate_proj.weight", gate, f"{where} (gate rows)")
    plan.put(f"{ours}.out_proj.weight", f"{theirs}o_proj.weight")
    for n in ("q_norm", "k_norm"):
        plan.put(f"{ours}.frontier.{n}_weight", f"{theirs}{n}.weight", parts.plus_one)


def convert_qwen3_next(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any,
                       linear_map: Callable[[Plan, str, str, HFConfig], None] = put_gated_deltanet) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them); ``linear_map`` plans a
    linear layer's weights (Qwen3.5 stores its projections apart)."""
    where = next((p for p in ("mtp.", "model.mtp.") if f"{p}fc.weight" in sd), None)
    mtp = min(parts.mtp_depths(hf, sd, lambda k: f"{where}layers.{k}.input_layernorm.weight"), 1) if where else 0
    build = functools.partial(build_qwen3_next, mtp=mtp)
    model, plan, head_size = parts.start(hf, sd, build, device=device, dtype=dtype)
    kinds = parts.layer_types(hf, model.depth, ("linear_attention", "full_attention"))
    sparse = _sparse_layers(hf, model.depth)
    for i in range(model.depth):
        mixer = "linear_attn." if kinds[i] == "linear_attention" else "self_attn."
        _put_layer(plan, f"blocks.{i}.", f"layers.{i}.", (mixer, i in sparse), hf, linear_map)
    if mtp:  # mtp.* at the top (text checkpoints) or under the model (a wrapper's, re-keyed)
        prefix, plan.src.prefix = plan.src.prefix, "" if where == "mtp." else "model."
        for ours, theirs in (("enorm", "pre_fc_norm_embedding"), ("hnorm", "pre_fc_norm_hidden"), ("post_norm", "norm")):
            plan.put(f"mtp.layers.0.{ours}.weight", f"mtp.{theirs}.weight", parts.plus_one)
        plan.put("mtp.layers.0.eh_proj.weight", "mtp.fc.weight")
        _put_layer(plan, "mtp.layers.0.block.", "mtp.layers.0.", ("self_attn.", 0 in sparse), hf, linear_map)
        plan.src.prefix = prefix
    return parts.finish(plan, model, head_size, norm_transform=parts.plus_one, ignore=[r"(model\.)?mtp\..*"])


def _put_layer(plan: Plan, ours: str, theirs: str, kind: tuple[str, bool], hf: HFConfig,
               linear_map: Callable[[Plan, str, str, HFConfig], None]) -> None:
    """One decoder layer: ``kind`` = (its mixer's name, ``linear_attn.`` or ``self_attn.``; whether its
    feed-forward is the MoE), the two ``1 + w`` norms."""
    if kind[0] == "linear_attn.":
        linear_map(plan, f"{ours}attn.", f"{theirs}linear_attn.", hf)
    else:
        put_gated_attention(plan, f"{ours}attn", f"{theirs}self_attn.", hf)
    if kind[1]:
        shared = hf.get("shared_expert_intermediate_size", 0) > 0
        put_moe(plan, f"{ours}ffn.", f"{theirs}mlp.", "stacked", shared=shared, shared_gate=shared)
    else:
        parts.put_mlp(plan, f"{ours}ffn.", f"{theirs}mlp.")
    for o, t in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
        plan.put(f"{ours}{o}.weight", f"{theirs}{t}.weight", parts.plus_one)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"qwen3_next": parts.Dispatch("Qwen3-Next", convert_qwen3_next, ("Qwen3NextForCausalLM",))}
