"""Llama-4 (text) -> :class:`~attnzoo.DecoderLM`: ``Llama4ForCausalLM`` and ``Llama4TextModel``
(``model_type="llama4_text"``).

Per layer (``no_rope_layers``, ``layer_types``, ``moe_layers``):

* RoPE layers (``no_rope_layers[i] == 1``): chunked attention (a query sees the keys of its own
  chunk of ``attention_chunk_size`` positions only, causally), RoPE, then the L2 QK-norm
  (``q / rms(q)`` without a weight, ``use_qk_norm``).
* NoPE layers (every fourth by default): full causal attention without positions, the queries
  scaled by the attention temperature ``1 + attn_scale * log(1 + floor((t + 1) / floor_scale))``
  (``attn_temperature_tuning``), ``t`` the token's index in the sequence (its cache slot: left
  padding counts, as in transformers).
* The feed-forward: a :class:`~attnzoo.nn.moe.MixtureOfExperts` (sigmoid of the top-k router
  logits scaling the expert *inputs*, plus an ungated shared expert) on the ``moe_layers``, a
  dense SwiGLU of ``intermediate_size_mlp`` on the others.

transformers applies RoPE to adjacent channel pairs (complex multiplication); the q/k rows of
every head are permuted at load (``[0, 2, 4, ..., 1, 3, 5, ...]``) so attnzoo's split-half rotary
(every scaled rope type) rotates the same pairs; the L2 norm and the scores do not see the order.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._devices import cache_dtype
from attnzoo._validate import check_int
from attnzoo.functional.softmax.attention import attention
from attnzoo.masks import Mask
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import moe_from_config, put_moe
from attnzoo.models.hf._state import HFConfig
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.nn.cache import KVCache

__all__ = ["DISPATCH", "Llama4Attention", "build_llama4", "convert_llama4"]


class PositionedKVCache(KVCache):
    """A :class:`KVCache` that also keeps each cached token's position ``[B, max_len]`` (the
    chunk a key belongs to follows its position, not its slot, under left padding)."""

    _batch_tensors = ("k", "v", "positions")

    def __init__(self, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(batch_size, max_len, num_kv_heads, head_dim, device=device, dtype=dtype)
        self.positions = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)


class Llama4Attention(nn.Module):
    """Llama-4's causal attention of one layer (see the module docstring).

    Args:
        dim: model width ``C``; ``num_heads``/``num_kv_heads``/``head_dim``: ``H``, ``Hkv``, ``D``.
        bias: biases on the four projections.
        rope: the layer's rotary embedding (split-half), or ``None`` (a NoPE layer).
        chunk_size: a query sees keys whose position is in its own chunk of this many
            positions (``None``: all earlier keys).
        l2_norm_eps: L2-normalise q and k over ``D`` after RoPE with this epsilon (``None``: off).
        temperature: ``(floor_scale, attn_scale)`` of the query temperature, or ``None``.
        dropout: attention-weight dropout in training.

    Weights: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``.
    Shapes: ``x [B, N, C] -> [B, N, C]``; ``positions [N]`` or ``[B, N]``.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *, bias: bool = False,
                 rope: nn.Module | None = None, chunk_size: int | None = None, l2_norm_eps: float | None = None,
                 temperature: tuple[float, float] | None = None, dropout: float = 0.0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        owner = "Llama4Attention"
        for name, value in (("dim", dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("chunk_size", 1 if chunk_size is None else chunk_size)):
            check_int(value, name, owner)
        if num_heads % num_kv_heads:
            raise ValueError(f"{owner}: num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.dim, self.num_heads, self.num_kv_heads, self.head_dim = dim, num_heads, num_kv_heads, head_dim
        self.rope, self.chunk_size, self.l2_norm_eps = rope, chunk_size, l2_norm_eps
        self.temperature, self.dropout = temperature, float(dropout)
        kw: dict[str, Any] = {"bias": bias, "device": device, "dtype": dtype}
        self.q_proj = nn.Linear(dim, num_heads * head_dim, **kw)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, **kw)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, **kw)

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> PositionedKVCache:
        p = self.q_proj.weight
        return PositionedKVCache(batch_size, max_len, self.num_kv_heads, self.head_dim,
                                 device=p.device if device is None else device, dtype=cache_dtype(p, dtype))

    def _l2(self, t: Tensor) -> Tensor:
        assert self.l2_norm_eps is not None
        t32 = t.float()
        return (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + self.l2_norm_eps)).type_as(t)

    def _allowed(self, mask: Tensor | Mask | None, q_pos: Tensor, k_pos: Tensor, past: int) -> Tensor | None:
        """The chunk pattern ``[B, 1, N, Nk]`` (by position) and the caller's mask, as one bool tensor."""
        B, N, Nk = q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]
        allowed = None
        if self.chunk_size is not None:
            allowed = (q_pos[:, None, :, None] // self.chunk_size) == (k_pos[:, None, None, :] // self.chunk_size)
        if isinstance(mask, Mask):
            mask = mask.materialize(B, 1, N, Nk, q_offset=past, device=q_pos.device)
        if mask is None:
            return allowed
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"Llama4Attention: mask must be a bool tensor or an attnzoo.masks.Mask, got "
                            f"{mask.dtype if isinstance(mask, Tensor) else type(mask).__name__}")
        return mask if allowed is None else allowed & mask

    def forward(self, x: Tensor, *, mask: Tensor | Mask | None = None, cache: PositionedKVCache | None = None,
                positions: Tensor | None = None) -> Tensor:
        """Packed input (``cu_seqlens``) runs one sequence at a time in the block (``nn.packing``)."""
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"Llama4Attention: x must be [B, N, {self.dim}], got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        B, N, _ = x.shape
        past = 0 if cache is None else cache.length
        index = torch.arange(past, past + N, device=x.device)  # [N] slots
        pos = (index if positions is None else positions).expand(B, N)  # [B, N]
        q = self.q_proj(x).view(B, N, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, N, D]
        k = self.k_proj(x).view(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, N, D]
        v = self.v_proj(x).view(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.rope is not None:
            q, k = self.rope(q, pos), self.rope(k, pos)
        if self.l2_norm_eps is not None:
            q, k = self._l2(q), self._l2(k)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scales = torch.log1p(torch.floor((index.float() + 1.0) / floor_scale)) * attn_scale + 1.0  # [N]
            q = (q * scales[:, None]).to(q.dtype)
        k_pos = pos
        if cache is not None:
            k, v, _ = cache.update(k, v)
            cache.positions[:, past:past + N] = pos
            k_pos = cache.positions[:, : past + N]
        allowed = self._allowed(mask, pos, k_pos, past)
        out = attention(q, k, v, mask=allowed, causal=True, scale=self.head_dim ** -0.5,
                        dropout_p=self.dropout if self.training else 0.0)  # [B, H, N, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim))

    def extra_repr(self) -> str:
        return (f"{self.dim}, {self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"rope={self.rope is not None}, chunk_size={self.chunk_size}, l2_norm={self.l2_norm_eps is not None}, "
                f"temperature={self.temperature}")


def _per_layer(hf: HFConfig, key: str, depth: int, default: list[Any]) -> list[Any]:
    values = hf.get(key, default, list)
    if len(values) != depth:
        raise CheckpointFormatError(f"{hf.source}: {key} has {len(values)} entries for {depth} layers")
    return values


def _moe_layers(hf: HFConfig, depth: int) -> set[int]:
    step = hf.get("interleave_moe_layer_step", 1)
    return set(hf.get("moe_layers", list(range(step - 1, depth, step)), list))


def build_llama4(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``Llama4TextConfig`` (random weights; see the module docstring)."""
    parts.unsupported_keys(hf, {"pretraining_tp": lambda v: v in (None, 1)})
    C, H, depth = hf.req("hidden_size"), hf.req("num_attention_heads"), hf.req("num_hidden_layers")
    D, eps = hf.get("head_dim", C // H), hf.get("rms_norm_eps", 1e-5, float)
    if hf.get("hidden_act", "silu", str) not in ("silu", "swish"):
        raise hf.unsupported(f"hidden_act={hf.raw('hidden_act')!r}")
    kinds = parts.layer_types(hf, depth, ("chunked_attention", "full_attention"))
    use_rope = _per_layer(hf, "no_rope_layers", depth, [int((i + 1) % 4 != 0) for i in range(depth)])
    moe = _moe_layers(hf, depth)
    rope = parts.rotary(hf, parts.rope_params(hf), D)
    chunk = hf.get("attention_chunk_size", None)
    if "chunked_attention" in kinds and chunk is None:
        raise hf.unsupported("chunked_attention layers without an attention_chunk_size")
    temperature = (hf.get("floor_scale", 8192.0, float), hf.get("attn_scale", 0.1, float)) \
        if hf.get("attn_temperature_tuning", False, bool) else None
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    qk = hf.get("use_qk_norm", False, bool)

    def attention(i: int) -> Llama4Attention:
        r = bool(use_rope[i])
        return Llama4Attention(C, H, hf.get("num_key_value_heads", H), D, bias=hf.get("attention_bias", False, bool),
                               rope=rope if r else None, chunk_size=chunk if kinds[i] == "chunked_attention" else None,
                               l2_norm_eps=eps if qk and r else None, temperature=None if r else temperature,
                               dropout=hf.get("attention_dropout", 0.0, float), **kw)

    dense = parts.gated_mlp(C, hf.get("intermediate_size_mlp", hf.req("intermediate_size")), "swiglu", **kw)
    sparse = functools.partial(moe_from_config, hf, "transposed", **kw)
    blocks = [parts.block(C, functools.partial(attention, i), sparse if i in moe else dense, parts.rms_norm(C, eps, **kw))
              for i in range(depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def _split_half_rows(head_dim: int) -> Any:
    """Permute each head's rows from adjacent pairs to split halves (``[0, 2, ..., 1, 3, ...]``)."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])

    def permute(w: Tensor) -> Tensor:
        rows = w.shape[0]
        return w.reshape(rows // head_dim, head_dim, *w.shape[1:])[:, order].reshape(w.shape)

    return permute


def convert_llama4(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (q/k rows permuted, see the module docstring)."""
    model, plan, head_size = parts.start(hf, sd, build_llama4, device=device, dtype=dtype)
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    permute = _split_half_rows(hf.get("head_dim", C // H))
    bias, moe = hf.get("attention_bias", False, bool), _moe_layers(hf, model.depth)
    for i in range(model.depth):
        o, h = f"blocks.{i}.", f"layers.{i}."
        for n in "qkvo":
            rotated = permute if n in "qk" else None
            plan.put(f"{o}attn.{n}_proj.weight", f"{h}self_attn.{n}_proj.weight", rotated)
            if bias:
                plan.put(f"{o}attn.{n}_proj.bias", f"{h}self_attn.{n}_proj.bias", rotated)
        if i in moe:
            put_moe(plan, f"{o}ffn.", f"{h}feed_forward.", "transposed", shared=True)
        else:
            parts.put_mlp(plan, f"{o}ffn.", f"{h}feed_forward.")
        plan.put_pairs(o, h, [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")],
                       bias=False)
    return parts.finish(plan, model, head_size)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"llama4_text": parts.Dispatch("Llama-4", convert_llama4, ("Llama4ForCausalLM", "Llama4TextModel"))}
