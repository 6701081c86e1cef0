"""JetMoE (``jetmoe``) -> :class:`~attnzoo.DecoderLM`: ``JetMoeForCausalLM`` and ``JetMoeModel``.
Line numbers: transformers 5.25's ``models/jetmoe/modeling_jetmoe.py``.

A pre-norm decoder whose two sub-layers are both sparse mixtures:

* The attention is a mixture of attention heads (MoA, 233-305 and 368-443;
  :class:`MixtureOfAttentionHeads`): a router picks each token's top ``k =
  num_experts_per_tok`` of ``num_local_experts`` experts (the ``k`` largest float32 logits, a
  softmax over those; 147-168); expert ``e`` projects the token's queries, ``Hkv =
  num_key_value_heads`` heads of ``kv_channels``, with its ``input_linear[e]``. The ``k * Hkv``
  query heads attend, with RoPE, to the ``Hkv`` key/value heads of one shared ``kv_proj`` (rows
  ``[k; v]``; query head ``s * Hkv + h`` reads key head ``h``, 424-425), and each slot's output goes
  back through its expert's ``output_linear[e]``, weighted by the slot's gate, summed, plus a bias
  ``[C]``. No q/k/v bias; the score scale ``kv_channels ** -0.5``.
* The feed-forward is a MoE (180-230; :class:`JetMoeMoE` on attnzoo's
  :class:`~attnzoo.nn.moe.MixtureOfExperts`): the same routing by its own router, SwiGLU experts of
  ``intermediate_size`` (``input_linear`` rows ``[gate; up]``), plus an output bias ``[C]``.
* The layers' two RMSNorms have transformers' default epsilon 1e-6 whatever the config says
  (452-453); only the final norm takes ``rms_norm_eps`` (564). ``num_attention_heads`` is always
  ``num_key_value_heads * num_experts_per_tok`` (configuration 139). Tied embeddings by default.

Refused by name: an ``activation_function`` other than SiLU (the experts are SwiGLU),
``num_experts_per_tok`` above ``num_local_experts``, rope types attnzoo's rotary does not know.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.functional.softmax.varlen import attention_varlen
from attnzoo.masks import Mask
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.nn.attention import MultiHeadAttention
from attnzoo.nn.cache import KVCache
from attnzoo.nn.frontier import packed_cu_seqlens, packed_positions
from attnzoo.nn.moe import MixtureOfExperts, Routing
from attnzoo.nn.positional import RotaryEmbedding, resolve_positions

__all__ = ["DEFAULTS", "DISPATCH", "JetMoeMoE", "MixtureOfAttentionHeads", "build_jetmoe", "canonical",
           "convert_jetmoe", "top_k_softmax"]

#: ``JetMoeConfig``'s defaults of the keys read here (configuration 115-136) that a ``config.json`` may leave out
DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 16, "kv_channels": 128, "max_position_embeddings": 4096, "activation_function": "silu",
    "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
    "attention_dropout": 0.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
#: the epsilon of every layer's two RMSNorms (``JetMoeRMSNorm(config.hidden_size)``, 452-453)
LAYER_NORM_EPS = 1e-6


def top_k_softmax(logits: Tensor, k: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """JetMoE's routing (147-150): ``(weights [T, k] in dtype, experts [T, k])``: the ``k`` largest
    logits (in at least float32), then a softmax over them."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    top, experts = wide.topk(k, dim=-1)
    return torch.softmax(top, dim=-1).to(dtype), experts


def _by_expert(experts: Tensor) -> list[tuple[int, Tensor, Tensor]]:
    """``(e, tokens, slots)`` for every expert chosen in ``experts [T, k]``."""
    return [(e, *torch.nonzero(experts == e, as_tuple=True)) for e in torch.unique(experts).tolist()]


class JetMoeMoE(MixtureOfExperts):
    """JetMoE's feed-forward: :class:`~attnzoo.nn.moe.MixtureOfExperts` of SwiGLU experts routed by
    :func:`top_k_softmax`, plus an output bias ``out_bias [C]`` (180-230).

    Shapes: ``x [..., C] -> [..., C]``."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(dim, hidden, num_experts, top_k, routing=Routing("topk_softmax"), device=device, dtype=dtype)
        self.out_bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Router of ``x [T, C]``: ``(weights [T, k], experts [T, k] long, logits [T, E])``."""
        logits = self.router(x)
        weights, experts = top_k_softmax(logits, self.top_k, x.dtype)
        return weights, experts, logits

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + self.out_bias


class ExpertLinear(nn.Module):
    """``E`` bias-free linear maps side by side (``weight [E, out, in]``): ``forward(x [T, in], e) -> [T, out]``
    applies expert ``e``'s (JetMoE's ``JetMoeParallelExperts``, 101-139)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features).normal_(0.0, in_features ** -0.5))

    def forward(self, x: Tensor, e: int) -> Tensor:
        return F.linear(x, self.weight[e])

    def extra_repr(self) -> str:
        return f"num_experts={self.weight.shape[0]}, in_features={self.in_features}, out_features={self.out_features}"


class MixtureOfAttentionHeads(MultiHeadAttention):
    """JetMoE's mixture of attention heads (see the module docstring): causal attention of ``k Hkv``
    routed query heads over ``Hkv`` shared key/value heads.

    Args:
        dim: model width ``C``.
        num_kv_heads, head_dim: ``Hkv`` and ``D`` (``kv_channels``).
        num_experts, top_k: ``E`` experts, ``k`` a token.
        rope: the rotary embedding of ``D``.
        dropout: attention dropout (training only).

    Weights: ``router [E, C]``, ``kv_proj [2 Hkv D, C]`` (rows ``[k; v]``), the experts' query and
    output projections ``q_proj.weight [E, Hkv D, C]`` and ``out_proj.weight [E, C, Hkv D]``
    (:class:`ExpertLinear`), ``out_bias [C]``. Query heads in attnzoo's GQA order ``(h, s)``:
    head ``h k + s`` is slot ``s``'s head ``h`` and reads key head ``h``.
    Shapes: ``forward(x [B, N, C]) -> [B, N, C]`` (packed ``[1, T, C]`` with ``cu_seqlens``).
    """

    no_weights_reason = "the output mixes the routed slots' experts"

    def __init__(self, dim: int, num_kv_heads: int, head_dim: int, num_experts: int, top_k: int, *,
                 rope: RotaryEmbedding | None, dropout: float = 0.0) -> None:
        self.__dict__["num_experts"] = int(num_experts)  # read by _make_projections during the base __init__
        super().__init__(dim, top_k * num_kv_heads, num_kv_heads, None, head_dim, False, True, None, rope, dropout)
        self.top_k = int(top_k)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.out_bias = nn.Parameter(torch.zeros(dim))

    def _make_projections(self, bias: bool, fk: dict[str, Any], kv_dim: int) -> None:
        width = self.num_kv_heads * self.head_dim
        E = self.num_experts
        self.q_proj, self.out_proj = ExpertLinear(E, self.dim, width), ExpertLinear(E, width, self.dim)
        self.kv_proj = nn.Linear(self.dim, 2 * width, bias=False, **fk)

    def _empty_call(self, x: Tensor, context: Any, cache: Any, positions: Any, return_weights: Any) -> Any:
        x = self.check_call(x, cache, positions, return_weights)
        return x * 0 + self.out_bias

    def forward(self, x: Tensor, *, mask: Tensor | Mask | None = None,  # type: ignore[override]
                cache: KVCache | None = None, positions: Tensor | None = None, return_weights: bool = False,
                cu_seqlens: Tensor | None = None) -> Tensor:
        """``x [B, N, C]`` (with a cache the new tokens; packed ``[1, T, C]`` with ``cu_seqlens``) -> ``[B, N, C]``;
        ``mask``, ``cache``, ``positions`` as :class:`~attnzoo.MultiHeadAttention`'s."""
        x = self.check_call(x, cache, positions, return_weights, KVCache)
        B, N, C = x.shape
        weights, experts = top_k_softmax(self.router(x.reshape(B * N, C)), self.top_k, x.dtype)  # [T, k]
        if cu_seqlens is not None:
            if cache is not None or mask is not None or positions is not None:
                raise ValueError("MixtureOfAttentionHeads: packed input (cu_seqlens) takes no cache, mask or positions")
            if self.training and self.dropout:
                raise ValueError("MixtureOfAttentionHeads: packed input (cu_seqlens) has no attention dropout")
            cu = packed_cu_seqlens(cu_seqlens, x, type(self).__name__)
            q, k, v = self._project(x, experts, packed_positions(cu, N))
            out = attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu,
                                   causal=True, scale=self.scale, backend=self.backend).transpose(0, 1)[None]
        else:
            self._check_self_cache(cache)
            start = 0 if cache is None else cache.length
            q, k, v = self._project(x, experts, resolve_positions(positions, N, start, x.device, batch=B))
            if cache is not None:
                k, v, _ = cache.update(k, v)
            out = self._attend_keys(q, k, v, mask, start, start + N - k.shape[2], False, decoding=cache is not None)[0]
        return self._reduce(out, weights, experts)

    def _project(self, x: Tensor, experts: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``q [B, Hkv k, N, D]`` (each slot by its expert), ``k, v [B, Hkv, N, D]``, q and k rotated."""
        B, N, C = x.shape
        Hkv, D, k = self.num_kv_heads, self.head_dim, self.top_k
        flat = x.reshape(B * N, C)
        q = flat.new_zeros(B * N, k, Hkv * D)
        for e, token, slot in _by_expert(experts):
            q = q.index_put((token, slot), self.q_proj(flat[token], e))
        q = q.view(B, N, k, Hkv, D).permute(0, 3, 2, 1, 4).reshape(B, Hkv * k, N, D)  # heads (h, s)
        key, value = self.kv_proj(x).chunk(2, dim=-1)
        return self._rotate(q, positions), self._rotate(self.split_heads(key), positions), self.split_heads(value)

    def _reduce(self, out: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """``sum_s weights[:, s] * out_proj[experts[:, s]] out_s + out_bias``; ``out [B, Hkv k, N, D] -> [B, N, C]``."""
        B, _, N, D = out.shape
        Hkv, k = self.num_kv_heads, self.top_k
        slots = out.view(B, Hkv, k, N, D).permute(0, 3, 2, 1, 4).reshape(B * N, k, Hkv * D)
        y = slots.new_zeros(B * N, self.dim)
        for e, token, slot in _by_expert(experts):
            y = y.index_add(0, token, self.out_proj(slots[token, slot], e) * weights[token, slot, None])
        return (y + self.out_bias).view(B, N, self.dim)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_experts={self.num_experts}, top_k={self.top_k}"


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it (:data:`DEFAULTS`; ``num_attention_heads`` =
    ``num_key_value_heads * num_experts_per_tok``, ``head_dim`` = ``kv_channels``), the options
    attnzoo cannot reproduce refused by name."""
    out = hf.with_defaults(DEFAULTS)
    parts.unsupported_keys(out, {"activation_function": lambda v: v in ("silu", "swish"),
                                 "num_experts_per_tok": lambda v: isinstance(v, int) and 1 <= v <= out.req(
                                     "num_local_experts")})
    out.data["num_attention_heads"] = out.req("num_key_value_heads") * out.req("num_experts_per_tok")
    out.data["head_dim"] = out.req("kv_channels")
    return out


def _attention(hf: HFConfig, rope: RotaryEmbedding, device: Any, dtype: Any) -> MixtureOfAttentionHeads:
    module = MixtureOfAttentionHeads(hf.req("hidden_size"), hf.req("num_key_value_heads"), hf.req("kv_channels"),
                                     hf.req("num_local_experts"), hf.req("num_experts_per_tok"), rope=rope,
                                     dropout=hf.req("attention_dropout", float))
    return module.to(device=device, dtype=dtype)


def build_jetmoe(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``JetMoeConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, H, depth, D = parts.dims(hf)
    kw = {"device": device, "dtype": dtype}
    rope = parts.rotary(hf, parts.rope_params(hf), D)
    ffn = functools.partial(JetMoeMoE, C, hf.req("intermediate_size"), hf.req("num_local_experts"),
                            hf.req("num_experts_per_tok"), **kw)
    attention = functools.partial(_attention, hf, rope, device, dtype)
    blocks = [parts.block(C, attention, ffn, parts.rms_norm(C, LAYER_NORM_EPS, **kw)) for _ in range(depth)]
    # the decoder config's head count only describes the given blocks (its dim must divide by it)
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=hf.req("rms_norm_eps", float),
                         heads=H if C % H == 0 else 1, **kw)


def _put_layer(plan: Plan, o: str, h: str) -> None:
    """One layer's MoA (``self_attention.``), MoE (``mlp.``) and norms."""
    moa = f"{h}self_attention.experts."
    plan.put(f"{o}attn.kv_proj.weight", f"{h}self_attention.kv_proj.weight")
    for ours, theirs in (("router.weight", "router.layer.weight"), ("q_proj.weight", "input_linear.weight"),
                         ("out_proj.weight", "output_linear.weight"), ("out_bias", "bias")):
        plan.put(f"{o}attn.{ours}", f"{moa}{theirs}")
    moe = f"{h}mlp."
    plan.put(f"{o}ffn.gate_proj", f"{moe}input_linear.weight", lambda w: w[:, : w.shape[1] // 2])
    plan.put(f"{o}ffn.up_proj", f"{moe}input_linear.weight", lambda w: w[:, w.shape[1] // 2:])
    for ours, theirs in (("router.weight", "router.layer.weight"), ("down_proj", "output_linear.weight"),
                         ("out_bias", "bias")):
        plan.put(f"{o}ffn.{ours}", f"{moe}{theirs}")
    plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)


def convert_jetmoe(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, build_jetmoe, device=device, dtype=dtype)
    for i in range(model.depth):
        _put_layer(plan, f"blocks.{i}.", f"layers.{i}.")
    return parts.finish(plan, model, head_size)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"jetmoe": parts.Dispatch("JetMoE", convert_jetmoe, ("JetMoeForCausalLM", "JetMoeModel"))}
