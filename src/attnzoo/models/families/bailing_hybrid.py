"""Bailing-hybrid (Ant Group's Ling / Ring linear hybrids; transformers ``model_type="bailing_hybrid"``)
-> :class:`~attnzoo.DecoderLM`: ``BailingHybridForCausalLM`` and ``BailingHybridModel``.

Kimi Linear's layout (:mod:`.kimi_linear`) with these differences, each reproduced:

* Layer kinds: ``layer_types``, or when absent ``full_attention`` at the last layer of every
  ``layer_group_size`` group (6) and ``linear_attention`` elsewhere; ``mlp_layer_types``, or
  ``dense`` for the first ``first_k_dense_replace`` layers (2, Kimi Linear's 1) then ``sparse``.
* Linear layers: :class:`LingDeltaAttention`, KDA (:class:`~attnzoo.nn.kda.KimiDeltaAttention`:
  short convolutions of ``short_conv_kernel_size``, L2 norm ``x / sqrt(|x|^2 + 1e-6)``, the
  sigmoid-gated RMSNorm of ``rms_norm_eps``) whose forget gate ``f_proj`` and output gate
  ``g_proj`` are full-rank ``[H D, C]`` (Kimi Linear's are rank-``D`` pairs), with the bounded
  decay of ``kda_safe_gate``::

      g = kda_lower_bound * sigmoid(exp(A_log) * (x W_f + dt_bias))     # in [kda_lower_bound, 0]
      g = -exp(A_log) * softplus(x W_f + dt_bias)                       # kda_safe_gate=False (Kimi's)

  ``linear_num_heads`` heads of ``linear_head_dim`` (transformers' copies of
  ``num_attention_heads`` and of ``head_dim`` as given: the config then rewrites ``head_dim`` to
  ``qk_rope_head_dim``).
* Full layers: :class:`GatedLatentAttention`, multi-head latent attention with RoPE (Kimi Linear's
  is NoPE): adjacent channel pairs of the ``qk_rope_head_dim`` channels rotated with
  ``rope_parameters`` (``rope_theta`` 6e6; YaRN and the other fixed-frequency types as
  DeepSeek-V3, with its ``mscale_all_dim`` softmax scale), and a sigmoid output gate per head,
  ``out_h * sigmoid(x W_g)_h`` before ``o_proj`` (``g_proj [H, C]``). ``attention_bias`` puts
  biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` as DeepSeek-V3; the latent
  RMSNorms use transformers' fixed epsilon 1e-6.
* Feed-forward: DeepSeek-V3's MoE (:func:`~._moe.deepseek_moe`: sigmoid scores, the
  correction bias choosing, group-limited routing ``n_group`` / ``topk_group``,
  ``routed_scaling_factor``, ``n_shared_experts`` shared experts) on the ``sparse`` layers, a
  dense SwiGLU on the ``dense`` ones. Per-layer SwiGLU limits (``expert_swiglu_limit_list`` for
  the routed experts, ``share_expert_swiglu_limit_list`` for the shared ones; 0: none) clip after
  the activation, ``min(silu(gate), l) * clamp(up, -l, l)``: the experts'
  ``Experts("limited_swiglu")``, the shared experts' :class:`LimitedSwiGLU`. The dense layers have
  none (transformers builds their MLP without a layer index).
* Head: transformers never ties this family's head to the embeddings (``_tied_weights_keys = {}``):
  ``lm_head.weight`` is read from the checkpoint whatever ``tie_word_embeddings`` says; only a
  checkpoint without it and ``tie_word_embeddings=True`` gets the tied head.
* Multi-token-prediction layers (``num_mtp_layers``: ``layers.{j}`` with ``j >= num_hidden_layers``)
  are not part of the causal LM's forward: their weights are dropped, as transformers drops them.
* Saved folders use Ant's names (``word_embeddings``, ``attention``, ``dense``, the forget gate's
  weights on the layer, ``{q,k,v}_conv1d``, ``gate.expert_bias``, one tensor per expert; transformers
  renames them on load and back on save): both load. A ``config.json`` that leaves out keys reads
  them as :data:`DEFAULTS` (``BailingHybridConfig``'s).

In half precision (``from_hf(dtype=)``, later ``.to()`` / ``.half()`` / ``.bfloat16()``) the MoE
routers' weight and the KDA's ``dt_bias``, ``A_log`` and short convolutions stay float32, as
transformers keeps them (``_keep_in_fp32_modules_strict``, modeling 1022-1028: ``gate.weight``,
``conv1d``, ``dt_bias``, ``A_log``; ``e_score_correction_bias`` is ``score_bias``, float32 always);
the convolutions then convolve and apply SiLU in float32 and round once, as its ``causal_conv1d_fn``.

Refused by name: an activation other than SiLU (it is also the convolutions'),
``num_key_value_heads != num_attention_heads`` (transformers' latent attention cannot run it),
the ``dynamic`` / ``longrope`` rope types and ``partial_rotary_factor``, a negative SwiGLU limit.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.masks import Mask
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import deepseek_moe, put_moe
from attnzoo.models.families.kimi_linear import TYPES, mlp_types, put_kda, put_mla, saved_names
from attnzoo.models.hf._state import HFConfig
from attnzoo.models.hf.deepseek import extra_layer, mla_rope
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.nn.kda import KimiDeltaAttention
from attnzoo.nn.mla import LatentCache, MLAOptions, MLASizes, MultiHeadLatentAttention
from attnzoo.nn.moe import Experts
from attnzoo.nn.parts import OutputGate, placed
from attnzoo.nn.recurrent import wide

__all__ = ["DEFAULTS", "DISPATCH", "GatedLatentAttention", "LimitedSwiGLU", "LingDeltaAttention",
           "build_bailing_hybrid", "canonical", "convert_bailing_hybrid", "layer_kinds", "swiglu_limits"]

#: ``BailingHybridConfig``'s defaults of the keys read here, for a ``config.json`` that leaves them
#: out (the MoE's under the names transformers saves: ``num_experts``, ``num_expert_group``, ...)
DEFAULTS: dict[str, Any] = {
    "vocab_size": 157184, "hidden_size": 2560, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 42, "num_attention_heads": 32, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "model_max_length": 262144, "tie_word_embeddings": False, "attention_bias": False,
    "attention_dropout": 0.0, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "rope_theta": 6_000_000.0, "head_dim": 128, "short_conv_kernel_size": 4,
    "layer_group_size": 6, "kda_safe_gate": True, "kda_lower_bound": -5.0, "first_k_dense_replace": 2,
    "num_experts": 512, "num_experts_per_token": 8, "num_shared_experts": 1, "num_expert_group": 8,
    "topk_group": 4, "routed_scaling_factor": 2.5, "moe_renormalize": True,
}

#: the KDA parameters transformers keeps in float32 (modeling 1022-1028; ``"conv"``: ``conv1d``)
KDA_FLOAT32 = ("dt_bias", "A_log", "conv")

#: Ant's saved names -> transformers' module names (its ``conversion_mapping`` for the family)
_SAVED = ((re.compile(r"^(model\.)?word_embeddings\."), r"\1embed_tokens."),
          (re.compile(r"\.attention\."), ".self_attn."),
          (re.compile(r"\.self_attn\.(f_proj\.weight|dt_bias|A_log)$"), r".self_attn.forget_gate.\1"),
          (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
          (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"))


class LingDeltaAttention(KimiDeltaAttention):
    """KDA as Ling's hybrids have it: full-rank forget and output gates, optionally the bounded decay.

    Args:
        dim: model width ``C``.
        num_heads: heads ``H``.
        head_dim: ``D``.
        conv_size: kernel of the short causal convolutions on q, k, v.
        norm_eps: epsilon of the gated RMSNorm.
        lower_bound: ``kda_lower_bound``: the decay ``lower_bound * sigmoid(exp(A_log) * f)`` in
            ``[lower_bound, 0]`` (transformers' ``kda_safe_gate``); ``None``: Kimi's
            ``-exp(A_log) * softplus(f)``. ``f = x W_f + dt_bias``.
        keep_float32: parameter groups kept in float32 whatever ``dtype`` (of
            :data:`~attnzoo.nn.kda.FLOAT32_GROUPS`; :meth:`~attnzoo.nn.kda.KimiDeltaAttention.keep_in_float32`).
        device, dtype: of the parameters.

    Parameters as :class:`~attnzoo.nn.kda.KimiDeltaAttention` with ``f_proj [H D, C]`` and
    ``g_proj [H D, C]`` instead of the rank-``D`` pairs ``f_a_proj``/``f_b_proj``,
    ``g_a_proj``/``g_b_proj``.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, *, conv_size: int, norm_eps: float,
                 lower_bound: float | None, keep_float32: tuple[str, ...] = (),
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, num_heads, head_dim=head_dim, conv_size=conv_size, norm_eps=norm_eps, qk_norm_eps=1e-6,
                         device=device, dtype=dtype)
        if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))):
            raise ValueError(f"LingDeltaAttention: lower_bound must be a number or None, got {lower_bound!r}")
        self.keep_in_float32(*keep_float32)
        self.lower_bound = None if lower_bound is None else float(lower_bound)
        fk: dict[str, Any] = {"device": device, "dtype": dtype}
        inner = self.num_v_heads * self.head_dim
        del self.f_a_proj, self.f_b_proj, self.g_a_proj, self.g_b_proj  # the full-rank gates replace them
        self.f_proj = nn.Linear(dim, inner, bias=False, **fk)
        self.g_proj = nn.Linear(dim, inner, bias=False, **fk)

    def _log_decay(self, x: Tensor) -> Tensor:
        """``[B, Hv, N, D]``, ``<= 0`` (see the class docstring)."""
        f = self.heads(wide(self.f_proj(x)) + wide(self.dt_bias))  # [B, Hv, N, D]
        rate = wide(self.A_log).exp()[:, None, None]  # [Hv, 1, 1]
        if self.lower_bound is None:
            return -rate * F.softplus(f)
        return self.lower_bound * torch.sigmoid(rate * f)

    def head_output(self, x: Tensor, o: Tensor) -> Tensor:
        """``out_proj(gated_rmsnorm(o, x W_g))``: ``o [B, Hv, N, D] -> [B, N, C]``."""
        y = self.o_norm(o, self.heads(self.g_proj(x)))  # [B, Hv, N, D]
        return self.out_proj(y.to(x.dtype).transpose(1, 2).flatten(2))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lower_bound={self.lower_bound}"


class GatedLatentAttention(MultiHeadLatentAttention):
    """Multi-head latent attention with a sigmoid output gate per head (Ling's full layers):
    each head's output times ``sigmoid(x W_g)_h`` (``g_proj``, an
    :class:`~attnzoo.nn.parts.OutputGate` of mode ``"head"``) before ``out_proj``, in every form
    (materialised, absorbed, packed).

    Args:
        dim: model width ``C``.
        num_heads: heads ``H``.
        sizes: the latent and head sizes.
        bias: biases on ``q_a_proj``, ``kv_a_proj`` and ``out_proj``.
        options: the RoPE base, interleave and scaling, the latent norms' epsilon, dropout.

    Build under ``with torch.device(...)`` for the device (or through :func:`gated_latent_attention`).
    """

    def __init__(self, dim: int, num_heads: int, sizes: MLASizes, *, bias: bool, options: MLAOptions) -> None:
        super().__init__(dim, num_heads, kv_lora_rank=sizes.kv_lora_rank, qk_nope_head_dim=sizes.qk_nope_head_dim,
                         qk_rope_head_dim=sizes.qk_rope_head_dim, v_head_dim=sizes.v_head_dim,
                         q_lora_rank=sizes.q_lora_rank, bias=bias, rope=True, options=options)
        self.g_proj = OutputGate(dim, num_heads, sizes.v_head_dim, "head")

    def _attention(self, x: Tensor, mask: Tensor | Mask | None, cache: LatentCache | None, positions: Tensor | None,
                   return_weights: bool) -> tuple[Tensor, Tensor | None]:
        out, weights = super()._attention(x, mask, cache, positions, return_weights)  # [B, H, N, dv]
        return self.g_proj.gate(out, x), weights

    def _packed(self, x: Tensor, cu_seqlens: Tensor) -> Tensor:
        return self.g_proj.gate(super()._packed(x, cu_seqlens), x)  # [1, H, T, dv]


def gated_latent_attention(dim: int, num_heads: int, sizes: MLASizes, *, bias: bool, options: MLAOptions,
                           device: Any = None, dtype: Any = None) -> GatedLatentAttention:
    """A :class:`GatedLatentAttention` on ``device`` in ``dtype`` (its rotary embedding kept in its own)."""
    with contextlib.nullcontext() if device is None else torch.device(device):
        module = GatedLatentAttention(dim, num_heads, sizes, bias=bias, options=options)
    placed(module, dtype, keep=(module.rope,))
    return module


class LimitedSwiGLU(nn.Module):
    """A SwiGLU clipped after the activation (Ling's shared experts with a SwiGLU limit):
    ``down(min(silu(gate(x)), limit) * clamp(up(x), -limit, limit))``, no biases.

    Args:
        dim: model width ``C``.
        hidden: hidden width ``F``.
        limit: the clip (``> 0``).
        device, dtype: of the parameters.

    Weights: ``gate_proj``, ``up_proj [F, C]``, ``down_proj [C, F]``. Shapes: ``[..., C] -> [..., C]``.
    """

    def __init__(self, dim: int, hidden: int, limit: float, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
            raise ValueError(f"LimitedSwiGLU: limit must be a number > 0, got {limit!r}")
        self.limit = float(limit)
        kw: dict[str, Any] = {"bias": False, "device": device, "dtype": dtype}
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden, **kw), nn.Linear(dim, hidden, **kw)
        self.down_proj = nn.Linear(hidden, dim, **kw)

    def forward(self, x: Tensor) -> Tensor:
        g = F.silu(self.gate_proj(x)).clamp(max=self.limit)  # [..., F]
        return self.down_proj(g * self.up_proj(x).clamp(-self.limit, self.limit))  # [..., C]

    def extra_repr(self) -> str:
        return f"limit={self.limit}"


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads it: :data:`DEFAULTS` where a key is absent; refuses what has no
    equivalent (see the module docstring)."""
    hf = hf.with_defaults(DEFAULTS)
    parts.unsupported_keys(hf, {"hidden_act": lambda v: v in ("silu", "swish"),
                                "num_key_value_heads": lambda v: v in (None, hf.req("num_attention_heads"))})
    return hf


def layer_kinds(hf: HFConfig, depth: int) -> list[str]:
    """``layer_types``, or ``full_attention`` at the last layer of every ``layer_group_size`` group."""
    if hf.has("layer_types"):
        return parts.layer_types(hf, depth, TYPES)
    group = hf.get("layer_group_size", 6)
    if group < 1:
        raise CheckpointFormatError(f"{hf.source}: layer_group_size must be >= 1, got {group}")
    return ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(depth)]


def swiglu_limits(hf: HFConfig, keys: tuple[str, ...], depth: int) -> list[float]:
    """The per-layer SwiGLU limits under the first of ``keys`` that is set (0: none; absent: none)."""
    limits = hf.first(keys, None, list)
    if limits is None:
        return [0.0] * depth
    if len(limits) != depth or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in limits):
        raise CheckpointFormatError(f"{hf.source}: {keys[0]} must hold one number per layer ({depth}), got {limits!r}")
    if any(v < 0 for v in limits):
        raise hf.unsupported(f"{keys[0]}={limits!r} (a negative limit)")
    return [float(v) for v in limits]


def _latent_attention(hf: HFConfig, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """The factory of a full layer's :class:`GatedLatentAttention`."""
    base, scaling = mla_rope(hf)
    opts: dict[str, Any] = {"rope_base": base, "rope_interleave": True, "norm_eps": 1e-6,
                            "dropout": hf.get("attention_dropout", 0.0, float)}
    if scaling is not None:
        opts.update(rope_scaling=scaling, max_position_embeddings=parts.max_positions(hf))
    sizes = MLASizes(kv_lora_rank=hf.req("kv_lora_rank"), qk_nope_head_dim=hf.req("qk_nope_head_dim"),
                     qk_rope_head_dim=hf.req("qk_rope_head_dim"), v_head_dim=hf.req("v_head_dim"),
                     q_lora_rank=hf.get("q_lora_rank", None))
    return functools.partial(gated_latent_attention, hf.req("hidden_size"), hf.req("num_attention_heads"), sizes,
                             bias=hf.get("attention_bias", False, bool), options=MLAOptions(**opts), **kw)


def _moe(hf: HFConfig, limit: float, shared_limit: float, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """The factory of a ``sparse`` layer's MoE with its SwiGLU limits (0: none)."""
    experts = Experts("limited_swiglu", swiglu_limit=limit) if limit else None
    shared = functools.partial(LimitedSwiGLU, limit=shared_limit, **kw) if shared_limit else None
    return functools.partial(deepseek_moe, hf, experts=experts, shared_expert=shared, keep_router_float32=True, **kw)


def build_bailing_hybrid(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                         dtype: Any = None) -> DecoderLM:
    """The decoder of a ``BailingHybridConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, depth, eps = hf.req("hidden_size"), hf.req("num_hidden_layers"), hf.get("rms_norm_eps", 1e-6, float)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    kinds, mlps = layer_kinds(hf, depth), mlp_types(hf, depth)
    limits = swiglu_limits(hf, ("expert_swiglu_limit_list", "swiglu_limits"), depth)
    shared = swiglu_limits(hf, ("share_expert_swiglu_limit_list", "swiglu_limits_shared"), depth)
    safe = hf.get("kda_safe_gate", True, bool)
    linear = functools.partial(LingDeltaAttention, C, hf.first(("linear_num_heads", "num_attention_heads"), None),
                               hf.first(("linear_head_dim", "head_dim"), None),
                               conv_size=hf.first(("linear_conv_kernel_dim", "short_conv_kernel_size"), 4),
                               norm_eps=eps, lower_bound=hf.get("kda_lower_bound", -5.0, float) if safe else None,
                               keep_float32=KDA_FLOAT32, **kw)
    full, norm = _latent_attention(hf, kw), parts.rms_norm(C, eps, **kw)
    dense = parts.gated_mlp(C, hf.req("intermediate_size"), "swiglu", **kw)
    blocks = [parts.block(C, linear if kinds[i] == "linear_attention" else full,
                          _moe(hf, limits[i], shared[i], kw) if mlps[i] == "sparse" else dense, norm)
              for i in range(depth)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


def convert_bailing_hybrid(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build a Bailing-hybrid decoder and copy the weights (the head follows them; saved-folder names
    too; multi-token-prediction layers dropped)."""
    hf, sd = canonical(hf), saved_names(sd, _SAVED)
    depth, prefix = hf.req("num_hidden_layers"), parts.head_size_of(hf, sd)[0]
    sd = {k: v for k, v in sd.items() if not extra_layer(k, prefix, depth)}  # the MTP layers
    tied = hf.get("tie_word_embeddings", False, bool) and "lm_head.weight" not in sd
    hf = HFConfig({**hf.data, "tie_word_embeddings": tied}, hf.source, hf.arch)
    model, plan, head_size = parts.start(hf, sd, build_bailing_hybrid, device=device, dtype=dtype)
    kinds, mlps = layer_kinds(hf, depth), mlp_types(hf, depth)
    for i in range(depth):
        o, h = f"blocks.{i}.", f"layers.{i}."
        if kinds[i] == "linear_attention":
            put_kda(plan, f"{o}attn.", f"{h}self_attn.", forget=("f_proj",), output_gate=("g_proj",))
        else:
            put_mla(plan, f"{o}attn.", f"{h}self_attn.", hf)
            plan.put(f"{o}attn.g_proj.weight", f"{h}self_attn.g_proj.weight")
        if mlps[i] == "sparse":
            put_moe(plan, f"{o}ffn.", f"{h}mlp.", "deepseek")
        else:
            parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
        plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    return parts.finish(plan, model, head_size)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {
    "bailing_hybrid": parts.Dispatch("Bailing-hybrid", convert_bailing_hybrid, ("BailingHybridForCausalLM", "BailingHybridModel")),
}
