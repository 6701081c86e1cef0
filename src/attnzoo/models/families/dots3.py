"""dots.3-note text (``dots3_note_text``) -> :class:`~attnzoo.DecoderLM`: ``Dots3NoteForCausalLM`` and
``Dots3NoteTextModel``, the language model of ``Dots3NoteForConditionalGeneration`` (its vision and audio
encoders are out of scope). Line numbers: transformers 5.25's ``models/dots3_note/modeling_dots3_note.py``.

A DeepSeek-V3.2 stack (``modular_dots3_note.py`` 245-706: DeepSeek-V3's latent attention, V3.2's MoE
and decoder layer, GLM-MoE-DSA's indexer) with per-layer attention shapes. Every layer is pre-norm
(``input_layernorm``, ``post_attention_layernorm``; LLaMA RMSNorms of ``rms_norm_eps``) around:

* Latent attention (``Dots3NoteTextAttention``, 443-614; :class:`DotsLatentAttention`,
  :class:`DotsIndexedAttention`) of the layer's own shape: ``per_layer_config`` overrides heads, ranks
  and head widths of single layers (transformers' heterogeneous configs; by default the sliding layers
  take the ``swa_*`` shapes, configuration 313-329), always a ``q_lora_rank``, RoPE on adjacent pairs of
  the ``qk_rope_head_dim`` channels with the rope of the layer's kind (``rope_parameters[kind]``, the
  sliding layers' theta ``swa_rope_theta``), the score scale ``(qk_nope + qk_rope) ** -0.5`` whatever the
  rope type (501). What dots adds to DeepSeek's: the normalised query latent times
  ``sqrt(hidden / q_lora_rank)`` and the key latent times ``sqrt(hidden / kv_lora_rank)`` (504-505, 545, 552: folded
  into ``q_a_layernorm`` / ``kv_a_layernorm``'s weights, which the indexer's query input shares), an
  RMSNorm on the shared RoPE key before its rotation (``k_rope_only_layernorm``, 556:
  :class:`KRopeNormedLinear`), and a per-head sigmoid gate ``g_proj(x)`` on the heads' outputs before
  ``o_proj`` (609-610).
* The layer kinds (``layer_types``): ``sliding_attention`` sees the last ``sliding_window`` keys
  (``kv > q - sliding_window``), ``indexed_attention`` the ``index_topk`` keys a GLM-MoE-DSA lightning
  indexer selects (192-282, interleaved RoPE; :class:`~attnzoo.models.families.deepseek.LightningTopK`
  under :class:`~attnzoo.models.families.deepseek.IndexedLatentAttention`), ``full_attention`` every key.
  By default full or indexed on layers 0, 1 and every ``i % 4 == 1``, sliding elsewhere.
* Feed-forward: on the ``sparse`` layers of ``mlp_layer_types`` (default: from ``first_k_dense_replace``
  = 1 and ``moe_layer_freq`` = 1) DeepSeek-V3's MoE (301-403: float32 router, sigmoid scores, the
  correction bias choosing among the ``topk_group`` best groups, ``norm_topk_prob``,
  ``routed_scaling_factor``) whose shared experts are one SwiGLU of ``shared_experts_intermediate_size *
  n_shared_experts``; on the ``dense`` ones a SwiGLU of ``intermediate_size``.

Config files: the released keys are read as ``Dots3NoteTextConfig.__post_init__`` reads them
(``use_dsa``, ``use_sliding_window``, ``first_k_dense_replace``, ``moe_layer_freq``,
``sliding_window_size``, ``moe_shared_expert_intermediate_size``, ``swa_*``, ``rope_theta`` /
``swa_rope_theta``); ``per_layer_config`` keys are layer indices (zero-padded strings in a saved file).
Layers past ``num_hidden_layers`` and ``model.mtp.*`` (multi-token prediction) are dropped, as
transformers drops them. Packed sequences: the full layers pack, the sliding and indexed ones run each
sequence alone.

Refused by name: a null ``q_lora_rank``, ``num_key_value_heads != num_attention_heads``, ``index_head_dim <
qk_rope_head_dim``, fewer than one shared expert, expert groups that do not divide the experts (each
group >= 2), a ``topk_group`` outside ``[1, n_group]``, an activation other than SiLU with experts,
``per_layer_config`` entries other than the attention's shapes (transformers reads every other
attribute globally), layers of one kind with different shapes (its rotary is one per kind), the
``dynamic`` / ``longrope`` rope types, layer kinds other than these three, ``pretraining_tp != 1``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
import attnzoo.models.families.deepseek as deepseek
from attnzoo.blocks import FeedForward
from attnzoo.masks import Mask
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import deepseek_moe, put_moe
from attnzoo.models.families.kimi_linear import put_mla
from attnzoo.models.families.qwen3_next import real_keys
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.deepseek import extra_layer
from attnzoo.nn.mla import MLAOptions, MLASizes, MultiHeadLatentAttention
from attnzoo.nn.parts import placed

__all__ = ["DEFAULTS", "DISPATCH", "DotsIndexedAttention", "DotsLatentAttention", "KRopeNormedLinear",
           "build_dots3", "canonical", "convert_dots3", "layer_views"]

TYPES = ("full_attention", "sliding_attention", "indexed_attention")
#: ``Dots3NoteTextConfig``'s defaults of the keys read here (configuration 230-275)
DEFAULTS: dict[str, Any] = {
    "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 13824, "moe_intermediate_size": 1536,
    "num_hidden_layers": 46, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": 1024,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 524288,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
    "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64, "head_dim": 256,
    "shared_experts_intermediate_size": 1536}
#: the sliding layers' shapes when the file has no ``per_layer_config`` (``swa_*`` keys; configuration 313-324)
SWA_DEFAULTS: dict[str, int] = {"num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1024,
                                "kv_lora_rank": 1024, "head_dim": 256, "qk_nope_head_dim": 192, "v_head_dim": 128}
#: the attributes a layer's ``per_layer_config`` may set (those only its attention and indexer read)
PER_LAYER = frozenset({"num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "head_dim",
                       "qk_nope_head_dim", "v_head_dim", "qk_rope_head_dim", "attention_bias", "attention_dropout",
                       "index_topk", "index_head_dim", "index_n_heads"})


# --------------------------------------------------------------------------- attention
class KRopeNormedLinear(nn.Linear):
    """MLA's ``kv_a_proj`` (``[r + dr, C]``) whose trailing ``dr`` outputs, the shared RoPE key, go
    through an RMSNorm (dots' ``k_rope_only_layernorm``, 556; before the rotation).

    Weights: ``weight [r + dr, C]`` (``bias``), ``k_rope_norm.weight [dr]``. Shapes: ``[..., C] -> [..., r + dr]``."""

    def __init__(self, dim: int, rank: int, rope_dim: int, *, bias: bool, eps: float, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(dim, rank + rope_dim, bias=bias, device=device, dtype=dtype)
        self.rank = rank
        self.k_rope_norm = nn.RMSNorm(rope_dim, eps=eps, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        c_kv, k_pe = super().forward(x).split((self.rank, self.out_features - self.rank), dim=-1)
        return torch.cat((c_kv, self.k_rope_norm(k_pe)), dim=-1)


class _DotsParts:
    """dots' additions to a :class:`~attnzoo.nn.mla.MultiHeadLatentAttention` (a mixin): the RoPE
    key's norm (``kv_a_proj`` a :class:`KRopeNormedLinear`) and the per-head output gate ``g_proj [H, C]``:
    the heads' outputs times ``sigmoid(g_proj(x))`` before ``out_proj``."""

    sizes: MLASizes
    kv_a_proj: nn.Linear
    num_heads: int

    def _add_dots_parts(self, eps: float) -> None:
        old = self.kv_a_proj
        kw: dict[str, Any] = {"device": old.weight.device, "dtype": old.weight.dtype}
        self.kv_a_proj = KRopeNormedLinear(old.in_features, self.sizes.kv_lora_rank, self.sizes.qk_rope_head_dim,
                                           bias=old.bias is not None, eps=eps, **kw)
        self.g_proj = nn.Linear(old.in_features, self.num_heads, bias=False, **kw)
        self._gate: Tensor | None = None  # [B, N, H]: from _queries to merge_heads of one call

    def _queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The queries (the base class's); the output gate of ``x`` kept for :meth:`merge_heads`."""
        self._gate = self.g_proj(x)
        return super()._queries(x)  # type: ignore[misc, no-any-return]

    def merge_heads(self, out: Tensor) -> Tensor:
        """``out [B, H, N, dv]`` times ``sigmoid(gate)`` per head -> ``out_proj`` -> ``[B, N, C]``."""
        gate, self._gate = self._gate, None
        if gate is None:
            raise RuntimeError(f"{type(self).__name__}: merge_heads before the queries of the same call")
        return super().merge_heads(out * torch.sigmoid(gate).transpose(1, 2).unsqueeze(-1))  # type: ignore[misc, no-any-return]


class DotsLatentAttention(_DotsParts, MultiHeadLatentAttention):
    """dots' full or sliding latent attention (see the module docstring): MLA with the RoPE key's norm,
    the per-head output gate and, with ``window``, each query seeing the last ``window`` keys (itself
    included; the key padding of ``mask`` kept). Packed input with a window runs one sequence at a time.

    Args: ``dim``, ``num_heads``, ``sizes``, ``bias``, ``options`` as :class:`IndexedLatentAttention`'s
    (``options.norm_eps`` the norms' epsilon); ``window``: ``sliding_window`` or ``None``.
    Shapes: ``x [B, N, C] -> [B, N, C]``. Build under ``with torch.device(...)``."""

    def __init__(self, dim: int, num_heads: int, sizes: MLASizes, *, bias: bool, options: MLAOptions,
                 window: int | None = None) -> None:
        super().__init__(dim, num_heads, kv_lora_rank=sizes.kv_lora_rank, qk_nope_head_dim=sizes.qk_nope_head_dim,
                         qk_rope_head_dim=sizes.qk_rope_head_dim, v_head_dim=sizes.v_head_dim,
                         q_lora_rank=sizes.q_lora_rank, bias=bias, rope=True, options=options)
        self._add_dots_parts(options.norm_eps)
        self.window = window

    def forward(self, x: Tensor, context: Tensor | None = None, *,  # type: ignore[override]
                mask: Tensor | Mask | None = None, cache: Any = None, positions: Tensor | None = None,
                return_weights: bool = False, cu_seqlens: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """As :meth:`MultiHeadLatentAttention.forward`; with a window, ``mask`` is a key padding."""
        if self.window is None or context is not None:
            return super().forward(x, context, mask=mask, cache=cache, positions=positions,
                                   return_weights=return_weights, cu_seqlens=cu_seqlens)
        if cu_seqlens is not None:
            raise ValueError(f"{type(self).__name__}: packed input (cu_seqlens) runs one sequence at a time "
                             f"(the sliding window)")
        B, N = x.shape[0], x.shape[1]
        start = 0 if cache is None else cache.length
        keys, queries = torch.arange(start + N, device=x.device), torch.arange(start, start + N, device=x.device)
        near = keys > queries[:, None] - self.window  # [N, M]
        window = real_keys(mask, B, start + N, x.device)[:, None, None] & near  # [B, 1, N, M]
        return super().forward(x, mask=window, cache=cache, positions=positions, return_weights=return_weights)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}"


class DotsIndexedAttention(_DotsParts, deepseek.IndexedLatentAttention):
    """dots' indexed latent attention: DeepSeek-V3.2's (:class:`IndexedLatentAttention`, GLM-MoE-DSA's
    interleaved indexer) with the RoPE key's norm and the per-head output gate. Args and shapes as the
    base class's (``options.norm_eps`` the norms' epsilon)."""

    def __init__(self, dim: int, num_heads: int, sizes: MLASizes, *, bias: bool, options: MLAOptions,
                 indexer: deepseek.LightningTopK) -> None:
        super().__init__(dim, num_heads, sizes, bias=bias, options=options, indexer=indexer)
        self._add_dots_parts(options.norm_eps)


def latent_attention(dim: int, num_heads: int, sizes: MLASizes, *, bias: bool, options: MLAOptions,
                     window: int | None, device: Any = None, dtype: Any = None) -> DotsLatentAttention:
    """A :class:`DotsLatentAttention` on ``device`` in ``dtype`` (its rotary embedding kept in its own)."""
    with contextlib.nullcontext() if device is None else torch.device(device):
        module = DotsLatentAttention(dim, num_heads, sizes, bias=bias, options=options, window=window)
    placed(module, dtype, keep=(module.rope,))
    return module


# --------------------------------------------------------------------------- config
def _legacy_kinds(hf: HFConfig, data: dict[str, Any]) -> list[str]:
    """``layer_types`` as ``__post_init__`` derives and renames them (configuration 281, 299-312)."""
    depth = int(data["num_hidden_layers"])
    use_dsa = data.get("use_dsa", None if "per_layer_config" in data else True)
    kinds = data.get("layer_types")
    if kinds is None:
        full = "full_attention" if use_dsa is False else "indexed_attention"
        sliding = data.get("use_sliding_window", True)
        kinds = [full if not sliding or i < 2 or i % 4 == 1 else "sliding_attention" for i in range(depth)]
    old, new = ("full_attention", "indexed_attention") if use_dsa else ("indexed_attention", "full_attention")
    return [new if use_dsa is not None and k == old else k for k in kinds]


def _legacy_mlp(data: dict[str, Any]) -> list[str]:
    """``mlp_layer_types`` from ``first_k_dense_replace`` / ``moe_layer_freq`` (configuration 278-290)."""
    if data.get("mlp_layer_types") is not None:
        return list(data["mlp_layer_types"])
    first, freq = data.get("first_k_dense_replace", 1), data.get("moe_layer_freq", 1)
    return ["sparse" if i >= first and (bool(freq[i]) if isinstance(freq, (list, tuple)) else i % freq == 0)
            else "dense" for i in range(int(data["num_hidden_layers"]))]


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as ``Dots3NoteTextConfig`` reads it: :data:`DEFAULTS`, the legacy keys (module docstring),
    the sliding layers' ``swa_*`` shapes as ``per_layer_config`` when the file has none."""
    if "q_lora_rank" in hf.data and hf.data["q_lora_rank"] is None:  # not the default: a full query projection
        raise hf.unsupported("q_lora_rank=None (dots' latent attention needs the query bottleneck)")
    data = dict(hf.with_defaults(DEFAULTS).data)
    if data.get("moe_shared_expert_intermediate_size") is not None:
        data["shared_experts_intermediate_size"] = data["moe_shared_expert_intermediate_size"]
    if data.get("sliding_window") is None:
        data["sliding_window"] = data.get("sliding_window_size", 512)
    if data.get("num_local_experts") is not None and hf.raw("n_routed_experts") is None:
        data["n_routed_experts"] = data["num_local_experts"]
    data["layer_types"], data["mlp_layer_types"] = _legacy_kinds(hf, data), _legacy_mlp(data)
    if data.get("per_layer_config") is None:
        swa = {k: data.get(f"swa_{k}", v) for k, v in SWA_DEFAULTS.items()}
        swa["qk_rope_head_dim"] = data.get("swa_qk_rope_head_dim", swa["head_dim"] - swa["qk_nope_head_dim"])
        data["per_layer_config"] = {i: dict(swa) for i, k in enumerate(data["layer_types"]) if k == TYPES[1]}
    return HFConfig(data, hf.source, hf.arch)


def layer_views(hf: HFConfig, kinds: list[str]) -> list[HFConfig]:
    """Each layer's config: the global one with its ``per_layer_config`` entry over it (checked)."""
    overrides: dict[int, dict[str, Any]] = {}
    for key, entry in hf.req("per_layer_config", dict).items():
        if not str(key).isdigit() or not isinstance(entry, dict):
            raise hf.unsupported(f"per_layer_config[{key!r}]={entry!r} (supported: layer index -> attributes)")
        if set(entry) - PER_LAYER:
            raise hf.unsupported(f"per_layer_config[{key!r}] sets {sorted(set(entry) - PER_LAYER)} (supported: the "
                                 f"attention's {sorted(PER_LAYER)})")
        overrides[int(key)] = entry
    firsts = {k: overrides.get(kinds.index(k), {}) for k in set(kinds)}
    for i, kind in enumerate(kinds):
        if overrides.get(i, {}) != firsts[kind]:
            raise hf.unsupported(f"per_layer_config: layer {i} ({kind}) is shaped unlike the first {kind} layer "
                                 f"(one rotary embedding per layer kind)")
    return [HFConfig({**hf.data, **overrides.get(i, {})}, hf.source, hf.arch) for i in range(len(kinds))]


def _check(hf: HFConfig, view: HFConfig, kind: str) -> None:
    """The refusals of one layer's attention (module docstring)."""
    if view.raw("q_lora_rank") is None:
        raise hf.unsupported("q_lora_rank=None (dots' latent attention needs the query bottleneck)")
    if view.req("num_key_value_heads") != view.req("num_attention_heads"):
        raise hf.unsupported(f"num_key_value_heads={view.req('num_key_value_heads')} != num_attention_heads="
                             f"{view.req('num_attention_heads')} (every head reads the one latent)")
    if kind == TYPES[2] and view.req("index_head_dim") < view.req("qk_rope_head_dim"):
        raise hf.unsupported(f"index_head_dim={view.req('index_head_dim')} < qk_rope_head_dim")


def _rope(hf: HFConfig, kind: str) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling params or None)`` of a layer kind (configuration 334-356)."""
    params = hf.raw("rope_parameters") or hf.raw("rope_scaling")
    if params is None:
        sliding = kind == TYPES[1]
        params = {"rope_type": "default", "rope_theta": hf.get("swa_rope_theta", 50000.0, float) if sliding
                  else hf.get("rope_theta", 8e7, float)}
    elif any(isinstance(v, dict) for v in params.values()):
        params = params.get(kind) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type in ("dynamic", "longrope"):
        raise hf.unsupported(f"rope_type={rope_type!r} for {kind} (it changes the frequencies with the length)")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 8e7, float)))
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return theta, None if rope_type == "default" else scaling


def _attention(hf: HFConfig, view: HFConfig, kind: str, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """The factory of one layer's attention (its own shapes, its kind's rope)."""
    _check(hf, view, kind)
    sizes = MLASizes(**{k: view.req(k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                  "v_head_dim", "q_lora_rank")})
    theta, scaling = _rope(hf, kind)
    options = MLAOptions(rope_base=theta, rope_interleave=True, rope_scaling=scaling,
                         max_position_embeddings=parts.max_positions(hf), norm_eps=hf.req("rms_norm_eps", float),
                         scale=sizes.qk_head_dim ** -0.5, dropout=view.get("attention_dropout", 0.0, float))
    C, H, bias = hf.req("hidden_size"), view.req("num_attention_heads"), view.get("attention_bias", False, bool)
    if kind == TYPES[2]:
        indexer = {"heads": view.req("index_n_heads"), "head_dim": view.req("index_head_dim"),
                   "topk": view.req("index_topk"), "interleaved": True}
        return functools.partial(deepseek.indexed_attention, C, H, sizes, bias=bias, options=options, indexer=indexer,
                                 cls=DotsIndexedAttention, **kw)
    window = hf.req("sliding_window") if kind == TYPES[1] else None
    return functools.partial(latent_attention, C, H, sizes, bias=bias, options=options, window=window, **kw)


def _moe(hf: HFConfig, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """DeepSeek-V3's MoE with dots' shared experts (``shared_experts_intermediate_size * n_shared_experts``)."""
    E, groups, best = hf.req("n_routed_experts"), hf.req("n_group"), hf.req("topk_group")
    if hf.get("hidden_act", "silu", str) not in ("silu", "swish"):
        raise hf.unsupported(f"hidden_act={hf.raw('hidden_act')!r} in the experts (supported: 'silu')")
    if hf.req("n_shared_experts") < 1:
        raise hf.unsupported(f"n_shared_experts={hf.req('n_shared_experts')} (dots has at least one)")
    if E % groups or E // groups < 2 or not 1 <= best <= groups:
        raise hf.unsupported(f"n_group={groups}, topk_group={best} with n_routed_experts={E} (groups of >= 2 experts, "
                             f"1 <= topk_group <= n_group)")
    width = hf.req("shared_experts_intermediate_size") * hf.req("n_shared_experts")
    shared = functools.partial(FeedForward, hidden=width, activation="swiglu", bias=False, **kw)
    return functools.partial(deepseek_moe, hf, shared_expert=lambda dim, _: shared(dim), keep_router_float32=True,
                             **kw)


def build_dots3(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``Dots3NoteTextConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, _, depth, _ = parts.dims(hf)
    eps, kw = hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES)
    mlp = parts.layer_types(hf, depth, ("dense", "sparse"), key="mlp_layer_types")
    dense = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", parts.GATED, "silu"), **kw)
    moe = _moe(hf, kw) if "sparse" in mlp else dense
    blocks = [parts.block(C, _attention(hf, view, kind, kw), moe if m == "sparse" else dense,
                          parts.rms_norm(C, eps, **kw))
              for view, kind, m in zip(layer_views(hf, kinds), kinds, mlp, strict=True)]
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, **kw)


# --------------------------------------------------------------------------- weights
def _put_layer(plan: Plan, hf: HFConfig, view: HFConfig, i: int) -> None:
    """Layer ``i``: the norms, the latent attention (the LoRA scales folded into the latent norms), its
    RoPE key's norm, output gate and indexer, then the dense MLP or the MoE."""
    o, h = f"blocks.{i}.", f"layers.{i}."
    a, t = f"{o}attn.", f"{h}self_attn."
    plan.put_pairs(o, h, parts.PRE_NORMS, bias=False)
    put_mla(plan, a, t, view)
    C = hf.req("hidden_size")
    deepseek.scale_planned(plan, f"{a}q_a_norm.weight", math.sqrt(C / view.req("q_lora_rank")), "q_lora_scale")
    deepseek.scale_planned(plan, f"{a}kv_a_norm.weight", math.sqrt(C / view.req("kv_lora_rank")), "kv_lora_scale")
    plan.put(f"{a}kv_a_proj.k_rope_norm.weight", f"{t}k_rope_only_layernorm.weight")
    plan.put(f"{a}g_proj.weight", f"{t}g_proj.weight")
    if hf.req("layer_types", list)[i] == TYPES[2]:
        for name in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"):
            plan.put(f"{a}indexer.{name}", f"{t}indexer.{name}")
    if hf.req("mlp_layer_types", list)[i] == "dense":
        parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
    else:
        put_moe(plan, f"{o}ffn.", f"{h}mlp.", "deepseek")


def convert_dots3(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them; layers past ``num_hidden_layers``
    and ``mtp`` dropped)."""
    hf = canonical(hf)
    depth, prefix = hf.req("num_hidden_layers"), parts.head_size_of(hf, sd)[0]
    sd = {k: v for k, v in sd.items() if not extra_layer(k, prefix, depth)}
    model, plan, head_size = parts.start(hf, sd, build_dots3, device=device, dtype=dtype)
    for i, view in enumerate(layer_views(hf, hf.req("layer_types", list))):
        _put_layer(plan, hf, view, i)
    return parts.finish(plan, model, head_size, ignore=[r"(model\.)?mtp\..*"])


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"dots3_note_text": parts.Dispatch("dots.3-note", convert_dots3, ("Dots3NoteForCausalLM",
                                                                             "Dots3NoteTextModel"))}
