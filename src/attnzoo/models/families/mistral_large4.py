"""Mistral-Large-4 text (``mistral_large4_text``) -> :class:`~attnzoo.DecoderLM`: the language model of
``MistralLarge4ForConditionalGeneration`` (its Pixtral tower and projector are out of scope; the wrapper
row ``mistral_large4`` of :mod:`attnzoo.models.hf.wrappers`) and ``MistralLarge4TextModel``. Line numbers:
transformers 5.25's ``models/mistral_large4/modeling_mistral_large4.py`` (``configuration_...`` where it
says so).

Every layer is pre-norm (``input_layernorm``, ``post_attention_layernorm``) around:

* Attention (``MistralLarge4TextAttention``, 319-484): DeepSeek's latent attention without a query
  LoRA (``q_proj``), interleaved RoPE on the ``qk_rope_head_dim`` channels, the softmax scale of
  ``yarn_apply_mscale``; every query (all channels, after RoPE) times a learned per-head factor of its
  position, ``scale_h * log(p + 1) + bias_h`` (``MistralLarge4TextSoftmaxScaling``, 132-146:
  :class:`LogPositionScale`); the keys a DSA indexer selects (:class:`HiddenQueryTopK`).
* The indexer (``MistralLarge4TextIndexer``, 191-297): GLM-MoE-DSA's lightning indexer (interleaved
  RoPE) whose queries come from the hidden states, ``wq_b(LayerNorm(x))`` (``q_input_norm``, eps
  1e-6), each index head times its own :class:`LogPositionScale`.
* LeRoPE (``MistralLarge4TextRotaryEmbedding``, 77-129): the (YaRN) inverse frequencies times
  ``exp(alpha)``, ``alpha`` a learned ``[qk_rope_head_dim / 2]`` tensor of the model
  (``rotary_emb.alpha``), kept by every attention as its ``rope_alpha`` buffer.
* The feed-forward by ``mlp_layer_types`` (default: ``first_k_dense_replace`` dense layers, then MoE):
  a SwiGLU MLP, or Mistral-4's grouped softmax MoE (top-2 group scores, renormalised, times
  ``routed_scaling_factor``; router float32) plus ``n_shared_experts`` shared experts
  (:class:`~attnzoo.models.families.deepseek.SoftmaxGroupMoE`).
* The logits of ``MistralLarge4ForConditionalGeneration`` are soft-capped,
  ``30 tanh(z / 30)`` (``final_logit_softcapping``, 1097-1100).

NoPE layers (a ``0`` in ``no_rope_layers``; the default config makes every 4th layer one; 322-336):
no RoPE channels (``qk_rope_head_dim`` 0, ``qk_nope_head_dim + qk_rope_head_dim`` nope ones, a
``kv_lora_rank``-wide ``kv_a_proj_with_mqa``), an indexer that rotates nothing, the softmax scale of
the RoPE layers (YaRN's ``mscale_all_dim`` included).

``"shared"`` indexer layers (``indexer_types`` / ``index_topk_pattern`` / ``index_topk_freq``; 765-777):
no indexer, the keys the last full layer selected in the same forward
(:class:`MistralLarge4SharedAttention`, through the model's :class:`SelectionBox`).

Refused by name (attnzoo has no module for it yet): KV sharing (``kv_source_layers`` other than each
layer its own: a layer attending an earlier layer's latent cache), and the ``layer_types`` other than
``indexed_attention``. The checkpoint's ``mtp_dspark.*`` draft head,
which transformers does not load, is dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.blocks import FeedForward
from attnzoo.masks import Mask
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._moe import put_moe
from attnzoo.models.families.deepseek import (
    IndexedLatentAttention,
    LightningTopK,
    ScaledQueries,
    SoftmaxGroupMoE,
    SoftmaxRouting,
)
from attnzoo.models.families.kimi_linear import put_mla
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.deepseek import mla_rope
from attnzoo.nn.mla import LatentCache, MLAOptions, MLASizes, MultiHeadLatentAttention
from attnzoo.nn.parts import placed

__all__ = ["DISPATCH", "HiddenQueryTopK", "LogPositionScale", "MistralLarge4Attention", "MistralLarge4SharedAttention",
           "SelectionBox", "build_mistral_large4", "canonical", "convert_mistral_large4", "module_names"]


class LogPositionScale(nn.Module):
    """Per-head factors ``scale_h * log(p + 1) + bias_h`` of positions ``p`` (transformers'
    ``MistralLarge4TextSoftmaxScaling``; ``scale`` 0 and ``bias`` 1 until loaded: no scaling).

    Args:
        heads: ``H``.

    Shapes: ``forward(pos [N] or [B, N]) -> [1 | B, N, H]`` (float32).
    """

    def __init__(self, heads: int, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(heads, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.ones(heads, device=device, dtype=dtype))

    def forward(self, pos: Tensor) -> Tensor:
        log = torch.log((pos + 1).float())
        log = log[None] if log.dim() == 1 else log  # [1 | B, N]
        return self.scale.float() * log[..., None] + self.bias.float()


class HiddenQueryTopK(LightningTopK):
    """GLM-MoE-DSA's :class:`~attnzoo.models.families.deepseek.LightningTopK` (interleaved RoPE) with
    queries from the hidden states: ``q = RoPE(wq_b(LayerNorm(x)) * LogPositionScale(p))``
    (``MistralLarge4TextIndexer``, 191-297; ``q_input_norm`` eps 1e-6, ``wq_b [H Di, C]``).

    Args:
        dim: ``C``. heads, head_dim, topk: ``index_n_heads``, ``index_head_dim``, ``index_topk``.
    """

    def __init__(self, dim: int, *, heads: int, head_dim: int, topk: int, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(dim, dim, heads=heads, head_dim=head_dim, topk=topk, interleaved=True, device=device,
                         dtype=dtype)
        self.q_input_norm = nn.LayerNorm(dim, eps=1e-6, device=device, dtype=dtype)
        self.softmax_scaling = LogPositionScale(heads, device=device, dtype=dtype)

    def queries(self, x: Tensor, pos: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """The rotated index queries ``[B, N, H, Di]`` of ``x [B, N, C]`` at positions ``pos``."""
        B, N, _ = x.shape
        q = self.wq_b(self.q_input_norm(x)).view(B, N, self.heads, self.head_dim)
        return self.rotated(q * self.softmax_scaling(pos).to(q.dtype)[..., None], rope)


class SelectionBox:
    """The keys the last full indexer layer selected (``[B, 1, N, M]`` bool, with causality and
    padding), for the ``"shared"`` indexer layers after it in the same forward (transformers'
    ``prev_topk_indices``, modeling 765-777)."""

    def __init__(self) -> None:
        self.allowed: Tensor | None = None


class MistralLarge4Attention(ScaledQueries, IndexedLatentAttention):
    """Mistral-Large-4's attention (see the module docstring): an
    :class:`~attnzoo.models.families.deepseek.IndexedLatentAttention` without a query LoRA whose
    queries are scaled per head by :class:`LogPositionScale` (``softmax_scaling``), whose indexer is a
    :class:`HiddenQueryTopK`, and whose RoPE frequencies are times ``exp(rope_alpha)`` (LeRoPE).

    Args: as :class:`~attnzoo.models.families.deepseek.IndexedLatentAttention` (``indexer`` a
    :class:`HiddenQueryTopK`); ``box``: where the selection is left for the shared layers after it
    (:class:`MistralLarge4SharedAttention`). Shapes: ``forward(x [B, N, C], *, mask, cache, positions)
    -> [B, N, C]``.
    """

    needs_q_lora = False

    def __init__(self, dim: int, num_heads: int, sizes: MLASizes, *, bias: bool, options: MLAOptions,
                 indexer: HiddenQueryTopK, box: SelectionBox) -> None:
        rope = sizes.qk_rope_head_dim > 0
        own = options if rope else dataclasses.replace(options, rope_base=None, rope_scaling=None)
        super().__init__(dim, num_heads, sizes, bias=bias, options=own, indexer=indexer, rope=rope)
        self.box = box
        self.softmax_scale = self._scale(options)  # a NoPE layer's too: YaRN's mscale_all_dim, as transformers
        self.softmax_scaling = LogPositionScale(num_heads)
        self.register_buffer("rope_alpha", torch.zeros(sizes.qk_rope_head_dim // 2), persistent=rope)
        if self._scaled is None and self.rope is not None:
            self._scaled = (self.rope.inv_freq(torch.device("cpu")), 1.0)

    def _scale_of(self, pos: Tensor) -> Tensor:
        return self.softmax_scaling(pos).transpose(1, 2).unsqueeze(-1)  # [1 | B, H, N, 1]

    def _cos_sin(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self._scaled is None:  # a NoPE layer: no channels to rotate (the indexer's neither)
            empty = torch.zeros(*pos.shape, 0, device=pos.device, dtype=dtype)
            return (empty[None, None] if pos.dim() == 1 else empty[:, None],) * 2  # type: ignore[return-value]
        plain = self._scaled
        inv = plain[0].to(pos.device, torch.float32) * self.rope_alpha.float().exp()  # as transformers, 117-120
        self._scaled = (inv, plain[1])
        try:
            return super()._cos_sin(pos, dtype)
        finally:
            self._scaled = plain

    def _select(self, x: Tensor, pos: Tensor, rope: tuple[Tensor, Tensor], keys: Tensor, visible: Tensor) -> Tensor:
        indexer: HiddenQueryTopK = self.indexer  # type: ignore[assignment]
        self.box.allowed = indexer.select(x, indexer.queries(x, pos, rope), keys, visible)
        return self.box.allowed


class MistralLarge4SharedAttention(MistralLarge4Attention):
    """A ``"shared"`` indexer layer's attention (``indexer_types``): no indexer of its own, the keys
    the last full layer selected in this forward (its :class:`SelectionBox`); the cache is the latent
    alone. Args as :class:`MistralLarge4Attention` (``indexer`` only sizes the check, then dropped)."""

    def __init__(self, dim: int, num_heads: int, sizes: MLASizes, *, bias: bool, options: MLAOptions,
                 indexer: HiddenQueryTopK, box: SelectionBox) -> None:
        super().__init__(dim, num_heads, sizes, bias=bias, options=options, indexer=indexer, box=box)
        self.indexer = None  # type: ignore[assignment]

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> LatentCache:  # type: ignore[override]
        """The latent cache (no index keys)."""
        return MultiHeadLatentAttention.init_cache(self, batch_size, max_len, device=device, dtype=dtype)

    def forward(self, x: Tensor, context: Tensor | None = None, *,  # type: ignore[override]
                mask: Tensor | Mask | None = None, cache: LatentCache | None = None,
                positions: Tensor | None = None) -> Tensor:
        if context is not None:
            raise ValueError("MistralLarge4SharedAttention: no cross-attention (context)")
        allowed = self.box.allowed
        if allowed is None or allowed.shape[-2] != x.shape[1]:
            raise ValueError("MistralLarge4SharedAttention: a shared indexer layer needs the selection of a full "
                             "indexer layer before it in the same forward")
        kw: dict[str, Any] = {} if positions is None else {"positions": positions}
        return MultiHeadLatentAttention.forward(self, x, mask=allowed, cache=cache, **kw)  # type: ignore[return-value]


def _attention_factory(hf: HFConfig, rope: bool, shared: bool, box: SelectionBox,
                       kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """The factory of a layer's :class:`MistralLarge4Attention` (``rope=False``: a NoPE layer, its
    ``qk_rope_head_dim`` channels nope ones, transformers' 333-336; ``shared``: a
    :class:`MistralLarge4SharedAttention`)."""
    base, scaling = mla_rope(hf)
    dn, dr = hf.req("qk_nope_head_dim"), hf.req("qk_rope_head_dim")
    sizes = MLASizes(kv_lora_rank=hf.req("kv_lora_rank"), qk_nope_head_dim=dn if rope else dn + dr,
                     qk_rope_head_dim=dr if rope else 0, v_head_dim=hf.req("v_head_dim"), q_lora_rank=None)
    opts: dict[str, Any] = {"rope_base": base, "rope_interleave": True, "norm_eps": hf.get("rms_norm_eps", 1e-5, float),
                            "dropout": hf.get("attention_dropout", 0.0, float)}
    if scaling is not None:
        opts.update(rope_scaling=scaling, max_position_embeddings=parts.max_positions(hf))
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    index = {"heads": hf.req("index_n_heads"), "head_dim": hf.req("index_head_dim"), "topk": hf.req("index_topk")}
    device, dtype = kw["device"], kw["dtype"]

    def make() -> nn.Module:
        with contextlib.nullcontext() if device is None else torch.device(device):
            cls = MistralLarge4SharedAttention if shared else MistralLarge4Attention
            module = cls(C, H, sizes, bias=hf.get("attention_bias", False, bool), options=MLAOptions(**opts),
                         indexer=HiddenQueryTopK(C, **index), box=box)
        # transformers keeps the rotary embedding (LeRoPE's alpha too) and, in float16, weights_proj float32
        half = dtype == torch.float16 and module.indexer is not None
        keep = (module.rope, *([module.indexer.weights_proj] if half else []))
        placed(module, dtype, keep=keep)
        module.rope_alpha.data = module.rope_alpha.data.float()
        return module
    return make


def _moe_factory(hf: HFConfig, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """The factory of a MoE layer (router kept float32, as transformers' ``_keep_in_fp32_modules_strict``)."""
    C, F_ = hf.req("hidden_size"), hf.req("moe_intermediate_size")
    n_shared = hf.get("n_shared_experts", 0) or 0
    routing = SoftmaxRouting(hf.get("routed_scaling_factor", 1.0, float), hf.get("n_group", 1) or 1,
                             hf.get("topk_group", 1) or 1, "top2", True, True)

    def make() -> nn.Module:
        shared = FeedForward(C, F_ * n_shared, activation="swiglu", bias=False, **kw) if n_shared else None
        moe = SoftmaxGroupMoE(C, F_, hf.req("n_routed_experts"), hf.req("num_experts_per_tok"), routing=routing,
                              shared_expert=shared, **kw)
        return moe.keep_router_in_float32()
    return make


def _refuse(hf: HFConfig, key: str, got: Any, supported: str) -> None:
    """Refuse ``key`` (it got ``got``; ``supported``: what attnzoo reproduces)."""
    raise hf.unsupported(f"{key}={got!r} (supported: {supported})")


def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` checked against what attnzoo reproduces (see the module docstring), with the per-layer
    lists filled as ``MistralLarge4TextConfig.__post_init__`` fills them (configuration 152-190)."""
    depth = hf.req("num_hidden_layers")
    data = dict(hf.data)
    if data.get("rope_parameters") is None and data.get("rope_scaling") is None:
        data["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2048.0,
                                   "original_max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "attention_factor": 1.0}
    interval = data.get("no_rope_layer_interval", 4)
    nope = data.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(depth)]
    if len(nope) < depth or any(v not in (0, 1) for v in nope):
        _refuse(hf, "no_rope_layers", nope, f"at least {depth} entries, each 1 (RoPE) or 0 (NoPE)")
    data["no_rope_layers"] = [int(v) for v in nope[:depth]]
    sources = data.get("kv_source_layers") or list(range(depth))
    if list(sources) != list(range(depth)):
        _refuse(hf, "kv_source_layers", sources, "KV sharing: each layer its own source, list(range(depth))")
    types = data.get("indexer_types")
    if types is None and data.get("index_topk_pattern") is not None:
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in data["index_topk_pattern"]]
    if types is None:
        freq, offset = max(data.get("index_topk_freq", 1), 1), data.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(depth)]
    if len(types) < depth or any(t not in ("full", "shared") for t in types) or types[0] != "full":
        _refuse(hf, "indexer_types", types, f"{depth} entries of 'full' / 'shared', the first 'full'")
    data["indexer_types"] = list(types[:depth])
    kinds = data.get("layer_types") or ["indexed_attention"] * depth
    if any(k != "indexed_attention" for k in kinds):
        _refuse(hf, "layer_types", kinds, "every layer 'indexed_attention'")
    if data.get("mlp_layer_types") is None:
        dense = min(data.get("first_k_dense_replace", 1), depth)
        data["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (depth - dense)
    return HFConfig(data, hf.source, hf.arch)


def build_mistral_large4(hf: HFConfig, *, head_size: int | None = None, device: Any = None,
                         dtype: Any = None) -> DecoderLM:
    """The decoder of a ``MistralLarge4TextConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    C, eps = hf.req("hidden_size"), hf.get("rms_norm_eps", 1e-5, float)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    box = SelectionBox()  # one per model: the full layers write it, the shared ones after them read it
    attentions = {(rope, shared): _attention_factory(hf, bool(rope), shared, box, kw) for rope in (0, 1)
                  for shared in (False, True)}
    norm = parts.rms_norm(C, eps, **kw)
    dense = parts.gated_mlp(C, hf.req("intermediate_size"), hf.activation("hidden_act", {"silu": "swiglu"}, "silu"),
                            bias=False, **kw)
    moe = _moe_factory(hf, kw)
    blocks = [parts.block(C, attentions[rope, kind == "shared"], moe if m == "sparse" else dense, norm)
              for m, rope, kind in zip(hf.req("mlp_layer_types", list), hf.req("no_rope_layers", list),
                                       hf.req("indexer_types", list), strict=True)]
    cap = hf.get("final_logit_softcapping", 30.0, float)
    return parts.decoder(hf, blocks, head_size=head_size, norm_eps=eps, logit_softcap=None if not cap else float(cap),
                         **kw)


def _put_layer(plan: Plan, ours: str, theirs: str, hf: HFConfig, sparse: bool, alpha: Tensor | None,
               rope: bool, indexed: bool) -> None:
    """A decoder layer: the latent attention, its scaling, LeRoPE's alpha (a ``rope`` layer), the
    indexer (an ``indexed`` layer), the feed-forward."""
    a, t = f"{ours}attn.", f"{theirs}self_attn."
    put_mla(plan, a, t, hf)
    plan.put(f"{a}softmax_scaling.bias", f"{t}softmax_scaling.bias")
    plan.put(f"{a}softmax_scaling.scale", f"{t}softmax_scaling.scale")
    if alpha is not None and rope:
        plan.put_tensor(f"{a}rope_alpha", alpha.float(), f"{plan.src.prefix}rotary_emb.alpha")
    for name in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight",
                 "q_input_norm.weight", "q_input_norm.bias", "softmax_scaling.scale", "softmax_scaling.bias"):
        if indexed:
            plan.put(f"{a}indexer.{name}", f"{t}indexer.{name}")
    if sparse:
        put_moe(plan, f"{ours}ffn.", f"{theirs}mlp.", "stacked")
        if hf.get("n_shared_experts", 0):
            parts.put_mlp(plan, f"{ours}ffn.shared_expert.", f"{theirs}mlp.shared_experts.")
    else:
        parts.put_mlp(plan, f"{ours}ffn.", f"{theirs}mlp.")
    plan.put_pairs(ours, theirs, parts.PRE_NORMS, bias=False)


#: the layers' saved / released names (Mistral's) -> transformers' (conversion_mapping
#: ``"mistral_large4_text"`` and the ``wo`` of ``"mistral_large4"``), in order
_SAVED = ((r"\.attention\.", ".self_attn."), (r"\.wq\.", ".q_proj."), (r"\.wo\.", ".o_proj."),
          (r"\.wkv_a_with_mqa\.", ".kv_a_proj_with_mqa."), (r"\.wkv_b\.", ".kv_b_proj."),
          (r"\.kv_a_norm\.", ".kv_a_layernorm."), (r"\.attention_norm\.", ".input_layernorm."),
          (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.ssmax_scaling\.s$", ".softmax_scaling.scale"),
          (r"\.ssmax_scaling\.b$", ".softmax_scaling.bias"),
          (r"(layers\.\d+)\.(gate|experts|shared_experts)\.", r"\1.mlp.\2."), (r"\.feed_forward\.", ".mlp."),
          (r"(mlp\.(?:shared_experts\.|experts\.\d+\.)?)w1\.", r"\1gate_proj."),
          (r"(mlp\.(?:shared_experts\.|experts\.\d+\.)?)w2\.", r"\1down_proj."),
          (r"(mlp\.(?:shared_experts\.|experts\.\d+\.)?)w3\.", r"\1up_proj."))


def module_names(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """``sd`` with a saved or released checkpoint's layer names (``layers.{i}.attention.wq``,
    ``feed_forward.w1``, ``experts.{e}.w1``, ``ssmax_scaling.s``, ...: what ``save_pretrained``
    writes) as transformers' module names; transformers' own names pass unchanged."""
    if not any(re.search(r"layers\.\d+\.(attention|feed_forward|attention_norm)\.", k) for k in sd):
        return sd
    out = {}
    for key, t in sd.items():
        for pattern, repl in _SAVED:
            key = re.sub(pattern, repl, key)
        out[key] = t
    return out


def convert_mistral_large4(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them; ``mtp_dspark.*`` dropped)."""
    hf, sd = canonical(hf), module_names(sd)
    model, plan, head_size = parts.start(hf, sd, build_mistral_large4, device=device, dtype=dtype)
    alpha = plan.src.take("rotary_emb.alpha")
    for i, (kind, rope, index) in enumerate(zip(hf.req("mlp_layer_types", list), hf.req("no_rope_layers", list),
                                                hf.req("indexer_types", list), strict=True)):
        _put_layer(plan, f"blocks.{i}.", f"layers.{i}.", hf, kind == "sparse", alpha, bool(rope), index == "full")
    unused = [r"(model\.)?mtp_dspark\..*"]
    if not hf.get("n_shared_experts", 0):
        unused.append(r"(model\.)?layers\.\d+\.mlp\.shared_experts\..*")
    return parts.finish(plan, model, head_size, ignore=unused)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"mistral_large4_text": parts.Dispatch("Mistral-Large-4", convert_mistral_large4,
                                                  ("MistralLarge4TextModel",))}
