"""DiffLlama (``diffllama``) -> :class:`~attnzoo.DecoderLM`: ``DiffLlamaForCausalLM`` and
``DiffLlamaModel``. Line numbers: transformers 5.25's ``models/diffllama/modeling_diffllama.py``.

LLaMA's pre-norm layer (RMSNorm, SwiGLU MLP without biases; 323-362) whose attention is the DIFF
Transformer's (188-306), attnzoo's :class:`~attnzoo.nn.differential.DifferentialAttention` with
transformers' head layout and group norm:

* ``H`` query heads of ``head_dim`` ``d`` and ``Hkv`` key/value heads (``Hkv`` even; 224-229) make
  ``H / 2`` differential heads: head pair ``i`` runs the two maps of q heads ``i`` and ``i + H / 2``
  against key heads ``j = i // (H / Hkv)`` and ``j + Hkv / 2``, both times over the ``2d``-wide
  value ``[v_j | v_{j + Hkv / 2}]`` (the two value halves tiled, 260-261, then the output heads
  chunked in two, 290). attnzoo orders its heads (head, map): the q/k/v projection rows are
  permuted on loading (:func:`pair_rows`), ``o_proj`` is loaded as it is.
* ``lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init`` with the dot products in float32
  (291-297), ``lambda_init = 0.8 - 0.6 exp(-0.3 layer_idx)`` (183-184; attnzoo's
  :func:`~attnzoo.nn.differential.lambda_init`).
* The group norm: an RMSNorm over each head's ``2d`` channels *without* a weight and with the
  config's ``rms_norm_eps`` (236; attnzoo's module has a learned ``subln_weight`` and epsilon
  1e-5: :class:`DiffLlamaAttention` drops the one and takes the other), times ``1 - lambda_init``.
* RoPE on the ``d`` channels of every q/k head (``rope_parameters``; scaled types through
  attnzoo's rotary), scores scaled by ``d ** -0.5``; ``attention_bias`` on q/k/v/o.

Refused by name: ``attention_dropout`` > 0 and an odd ``num_key_value_heads`` (transformers refuses
both too, 218-229), a ``hidden_act`` without a gated attnzoo MLP, ``pretraining_tp`` other than 1,
a ``partial_rotary_factor`` other than 1 on a scaled rope type, rope types attnzoo does not know.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.nn.differential import DifferentialAttention

__all__ = ["DEFAULTS", "DISPATCH", "DiffLlamaAttention", "build_diffllama", "canonical", "convert_diffllama",
           "pair_rows"]

#: ``DiffLlamaConfig``'s defaults of the keys read here (configuration 116-137) that a ``config.json`` may leave out
DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "attention_bias": False, "attention_dropout": 0.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


class DiffLlamaAttention(DifferentialAttention):
    """:class:`~attnzoo.nn.differential.DifferentialAttention` whose per-head group norm has no
    weight and the epsilon ``norm_eps`` (transformers' ``nn.RMSNorm(2 * head_dim, eps=rms_norm_eps,
    elementwise_affine=False)``), and whose ``lambda`` takes its dot products in float32.

    Args:
        dim, num_heads, num_kv_heads, head_dim, layer_index, rope, bias, device, dtype: as
            :class:`DifferentialAttention` (``num_heads``: differential heads, half the checkpoint's
            query heads).
        norm_eps: the group norm's epsilon.

    Shapes: ``[B, N, C] -> [B, N, C]``."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *, layer_index: int,
                 rope: nn.Module | None, bias: bool, norm_eps: float, device: Any = None, dtype: Any = None) -> None:
        super().__init__(dim, num_heads, num_kv_heads, head_dim, layer_index, True, rope, bias,
                         device=device, dtype=dtype)
        del self.subln_weight
        self.register_parameter("subln_weight", None)
        self.norm_eps = float(norm_eps)

    def lambda_(self) -> Tensor:
        """``exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init``, each exponential in (at least)
        float32 then in the parameters' dtype (a 0-d tensor)."""
        def term(q: Tensor, k: Tensor) -> Tensor:
            return torch.exp(torch.sum(q * k, dtype=torch.promote_types(q.dtype, torch.float32))).to(q.dtype)

        return term(self.lambda_q1, self.lambda_k1) - term(self.lambda_q2, self.lambda_k2) + self.lambda_init

    def _combine(self, o1: Tensor, o2: Tensor) -> Tensor:
        """``out_proj`` of ``(1 - lambda_init) RMSNorm(o1 - lambda o2)`` per head; ``o [B, H, N, 2d]``."""
        heads = F.rms_norm(o1 - self.lambda_().to(o1.dtype) * o2, (o1.shape[-1],), None, self.norm_eps)
        return self.merge_heads(heads * (1.0 - self.lambda_init))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", norm_eps={self.norm_eps}"


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it (:data:`DEFAULTS`; ``num_key_value_heads`` defaults to the
    query heads, ``head_dim`` to ``hidden_size // num_attention_heads``), the options attnzoo
    cannot reproduce refused by name."""
    out = hf.with_defaults(DEFAULTS)
    H = out.req("num_attention_heads")
    out.data.setdefault("num_key_value_heads", H)
    out.data.setdefault("head_dim", out.req("hidden_size") // H)
    parts.unsupported_keys(out, {
        "attention_dropout": lambda v: not v, "pretraining_tp": lambda v: v in (None, 1),
        "num_key_value_heads": lambda v: isinstance(v, int) and v % 2 == 0 and H % v == 0})
    params = parts.rope_params(out)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type != "default" and params.get("partial_rotary_factor", 1.0) != 1.0:
        raise hf.unsupported(f"partial_rotary_factor={params['partial_rotary_factor']!r} with rope_type={rope_type!r}")
    return out


def build_diffllama(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                    dtype: Any = None) -> DecoderLM:
    """The decoder of a ``DiffLlamaConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, H, depth, D = parts.dims(hf)
    eps, kw = hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    rope = parts.rotary(hf, parts.rope_params(hf), D)
    ffn = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    attention = functools.partial(DiffLlamaAttention, C, H // 2, hf.req("num_key_value_heads") // 2, D, rope=rope,
                                  bias=hf.req("attention_bias", bool), norm_eps=eps, **kw)
    blocks = [parts.block(C, functools.partial(attention, layer_index=i), ffn, parts.rms_norm(C, eps, **kw))
              for i in range(depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def pair_rows(t: Tensor, head_dim: int) -> Tensor:
    """transformers' q/k/v projection rows (or biases), heads ``[map 0 heads; map 1 heads]``, in
    attnzoo's order ``(head, map)``: ``[2 * G * d, ...] -> [G, 2, d, ...]`` flattened back."""
    return t.unflatten(0, (2, -1, head_dim)).transpose(0, 1).flatten(0, 2)


def _put_attention(plan: Plan, ours: str, theirs: str, *, bias: bool, head_dim: int) -> None:
    """q/k/v (rows paired), ``o_proj`` and the four lambda vectors of one layer."""
    pair = functools.partial(pair_rows, head_dim=head_dim)
    for n in "qkv":
        plan.put(f"{ours}{n}_proj.weight", f"{theirs}{n}_proj.weight", pair)
        if bias:
            plan.put(f"{ours}{n}_proj.bias", f"{theirs}{n}_proj.bias", pair)
    plan.put_pairs(ours, theirs, [("out_proj", "o_proj")], bias=bias)
    for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        plan.put(f"{ours}{n}", f"{theirs}{n}")


def convert_diffllama(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them)."""
    hf = canonical(hf)
    model, plan, head_size = parts.start(hf, sd, build_diffllama, device=device, dtype=dtype)
    bias, D = hf.req("attention_bias", bool), hf.req("head_dim")
    for i in range(model.depth):
        o, h = f"blocks.{i}.", f"layers.{i}."
        _put_attention(plan, f"{o}attn.", f"{h}self_attn.", bias=bias, head_dim=D)
        parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
        plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    return parts.finish(plan, model, head_size)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"diffllama": parts.Dispatch("DiffLlama", convert_diffllama, ("DiffLlamaForCausalLM", "DiffLlamaModel"))}
