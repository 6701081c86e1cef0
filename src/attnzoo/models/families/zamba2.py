"""Zamba2 -> :class:`~attnzoo.DecoderLM`: ``Zamba2ForCausalLM`` and ``Zamba2Model`` (Zyphra's
Zamba2-1.2B / 2.7B / 7B).

A stack of Mamba-2 layers (``x + mixer(norm(x))``, the mixer of
:mod:`attnzoo.models.families._mamba`). At the ``"hybrid"`` layers of ``layers_block_type`` a
*shared* transformer block runs first on ``[h | e]``, the layer's input ``h`` beside the token
embeddings ``e`` (width ``2C``), and its output, through the layer's own ``linear``, is added to
``h`` before the mixer's norm (the residual stays ``h``)::

    T  = linear(mlp(ffn_norm(attn(attn_norm([h | e])))))      # no residuals inside
    h' = h + mamba(norm(h + T))

``num_mem_blocks`` such blocks serve the hybrid layers round-robin (hybrid layer ``i`` uses block
``i % num_mem_blocks``): one set of weights, held here by one :class:`SharedTransformer` module that
each of its layers holds (:class:`SharedTransformerUse`), so the parameters are the same tensors
and their gradients add up over the uses. Each use has its own KV cache, its own low-rank adapters
on q/k/v (``use_shared_attention_adapter``) and on the MLP's fused gate/up projection (always), and
rotary positions when ``use_mem_rope``. The attention reads ``2C`` channels with heads of
``2C / H`` and the score scale ``(head_dim / 2) ** -0.5``; its output projection writes ``C``.

transformers ties the shared blocks only with ``tie_word_embeddings=True`` (its tying follows that
flag); untied, every hybrid layer has a block of its own, and so does the converted model.

The model is a :class:`Zamba2LM`, a :class:`~attnzoo.models.loop.LayerLoopLM` whose layer loop
hands every layer the token embeddings ``e`` beside the residual stream ``h``; the caches, packed
sequences (``cu_seqlens``, through the layers whole) and :meth:`~attnzoo.DecoderLM.generate` are
``DecoderLM``'s.

The Mamba-2 mixers as transformers builds them: SiLU convolutions with biases (whatever
``use_conv_bias`` says), the gated norm's epsilon ``1e-5``, and ``dt = softplus(.)`` clamped from
below at ``time_step_min`` (transformers' chunked scan clamps; its one-token decode step does not,
attnzoo clamps in both so that decoding equals the full forward).

Refused by name: ``add_bias_linear=True``, layer types other than ``hybrid`` / ``linear_attention``
(``mamba``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.blocks import ACTIVATIONS, RMSNorm
from attnzoo.models._common import LayerCaches
from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families._mamba import MambaKeys, mamba_factory, put_mamba
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.models.loop import LayerLoopLM
from attnzoo.models.parts import DecoderParts, head_for
from attnzoo.nn.attention import MultiHeadAttention
from attnzoo.nn.cache import CacheList
from attnzoo.nn.mamba2 import Mamba2
from attnzoo.variants import build_attention

__all__ = ["DISPATCH", "AdaptedLinear", "FlooredLinear", "SharedTransformer", "SharedTransformerUse", "Zamba2LM", "Zamba2Layer",
           "build_zamba2", "convert_zamba2", "hybrid_sources", "layer_kinds", "shared_block"]

#: the mixer's sizes under the names of the view :func:`_mamba_view` builds
MAMBA_KEYS = MambaKeys("n_mamba_heads", "mamba_headdim", "mamba_d_state", "mamba_ngroups", "mamba_d_conv",
                       "mamba_expand", "conv_bias", "add_bias_linear", "norm_eps", activation="activation")
#: transformers' layer pattern when ``layers_block_type`` is absent (Zamba2-2.7B's 54 layers)
DEFAULT_LAYERS = (["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"] + ["mamba"] * 3
                  + ["hybrid"] + ["mamba"] * 2)
#: transformers' defaults of the keys read here (a ``config.json`` may leave them out)
DEFAULTS = {"n_mamba_heads": 8, "mamba_d_state": 64, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1,
            "num_attention_heads": 32, "num_mem_blocks": 1, "adapter_rank": 128, "hidden_act": "gelu",
            "rms_norm_eps": 1e-5, "time_step_min": 0.001, "tie_word_embeddings": True}
#: the names a layer type may have (transformers' current and legacy ones)
LAYER_NAMES = {"hybrid": "hybrid", "linear_attention": "mamba", "mamba": "mamba"}


# --------------------------------------------------------------------------- parts
class FlooredLinear(nn.Linear):
    """``max(x W^T + b, floor)``: Mamba-2's ``dt`` projection with the mixer's ``dt_bias`` as its
    bias (the mixer's own is then zero). Since softplus increases, ``softplus(max(u, floor))`` is
    transformers' ``clamp(softplus(u), min=time_step_min)`` for ``floor = log(expm1(time_step_min))``."""

    def __init__(self, in_features: int, out_features: int, floor: float, *, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias=True, device=device, dtype=dtype)
        self.floor = float(floor)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).clamp_min(self.floor)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, floor={self.floor:.6g}"


class AdaptedLinear(nn.Module):
    """``base(x) + adapter(x)``: a linear layer (shared by several uses) plus this use's own
    low-rank adapter (LoRA with no scale). ``adapter`` may be an ``nn.ModuleList`` of adapters whose
    outputs are concatenated (the fused ``[q; k; v]`` rows)."""

    def __init__(self, base: nn.Linear, adapter: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.adapter = adapter

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(self.adapter, nn.ModuleList):
            delta = torch.cat([a(x) for a in self.adapter], dim=-1)
        else:
            delta = self.adapter(x)
        return self.base(x) + delta


class SharedTransformer(nn.Module):
    """The weights of one Zamba2 shared transformer block, stored once and held by every layer that
    uses it: ``attn_norm`` (over ``[h | e]``, ``2C``), ``qkv_proj`` (``2C -> (H + 2 Hkv) D``, rows
    ``[q; k; v]``), ``out_proj`` (``H D -> C``), ``ffn_norm`` (``C``), ``gate_up_proj`` (``C -> 2F``,
    rows ``[gate; up]``), ``down_proj`` (``F -> C``) and the MLP's activation ``act``."""

    def __init__(self, attn_norm: nn.Module, qkv_proj: nn.Linear, out_proj: nn.Linear, ffn_norm: nn.Module,
                 gate_up_proj: nn.Linear, down_proj: nn.Linear, act: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.attn_norm, self.qkv_proj, self.out_proj = attn_norm, qkv_proj, out_proj
        self.ffn_norm, self.gate_up_proj, self.down_proj = ffn_norm, gate_up_proj, down_proj
        self.act = act


class SharedTransformerUse(nn.Module):
    """One layer's use of a :class:`SharedTransformer` ``block``: ``[h | e] [B, N, 2C] -> T [B, N, C]``::

        y = ffn_norm(attn(attn_norm(x)));   [g | u] = gate_up(y);   T = linear(down_proj(act(g) * u))

    ``attn`` is this use's attention (a causal :class:`MultiHeadAttention` over ``2C`` whose
    ``qkv_proj`` is the block's, or an :class:`AdaptedLinear` around it, and whose ``out_proj`` is
    the block's; its own rotary embedding and KV cache), ``gate_up`` the block's ``gate_up_proj``
    with this use's adapter, ``linear`` the layer's own ``[C, C]`` projection."""

    def __init__(self, block: SharedTransformer, attn: MultiHeadAttention, gate_up: AdaptedLinear,
                 linear: nn.Linear) -> None:
        super().__init__()
        self.block = block  # first: the shared weights are named after the block in the state dict
        self.attn, self.gate_up, self.linear = attn, gate_up, linear

    def forward(self, x: Tensor, *, key_padding: Tensor | None = None, cache: Any = None,
                positions: Tensor | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
        """``x = [h | e]`` (``[B, N, 2C]``; with a cache the new tokens, with ``cu_seqlens`` packed
        ``[1, T, 2C]``); ``key_padding [B, Nk]`` bool, True for real tokens. Returns ``[B, N, C]``."""
        kw: dict[str, Any] = {}
        if key_padding is not None:
            kw["mask"] = key_padding[:, None, None, :]  # [B, 1, 1, Nk]
        for name, value in (("cache", cache), ("positions", positions), ("cu_seqlens", cu_seqlens)):
            if value is not None:
                kw[name] = value
        b = self.block
        y = b.ffn_norm(self.attn(b.attn_norm(x), **kw))  # [B, N, C]
        gate, up = self.gate_up(y).chunk(2, dim=-1)  # [B, N, F] each
        return self.linear(b.down_proj(b.act(gate) * up))  # [B, N, C]


class Zamba2Layer(nn.Module):
    """One Zamba2 layer on the residual stream ``h [B, N, C]`` beside the token embeddings ``e``:
    ``h' = h + attn(attn_norm(u))`` with ``u = h`` (a Mamba-2 layer) or ``u = h + shared([h | e])``
    (a hybrid layer). ``attn`` is the Mamba-2 mixer (the name every attnzoo block gives its mixer),
    ``shared`` a :class:`SharedTransformerUse` or ``None``.

    Decode cache: the mixer's, or for a hybrid layer a :class:`~attnzoo.nn.cache.CacheList` of the
    shared attention's KV cache and the mixer's."""

    def __init__(self, attn_norm: nn.Module, attn: Mamba2, shared: SharedTransformerUse | None = None) -> None:
        super().__init__()
        self.shared = shared
        self.attn_norm, self.attn = attn_norm, attn
        self.dim = attn.dim

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> Any:
        """The mixer's cache, with the shared attention's KV cache first in a hybrid layer."""
        mixer = self.attn.init_cache(batch_size, max_len, device=device, dtype=dtype)
        if self.shared is None:
            return mixer
        return CacheList([self.shared.attn.init_cache(batch_size, max_len, device=device, dtype=dtype), mixer])

    def forward(self, h: Tensor, *, embeddings: Tensor, key_padding: Tensor | None = None, cache: Any = None,
                positions: Tensor | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
        """``h``, ``embeddings`` ``[B, N, C]`` (with a cache the new tokens; with ``cu_seqlens``
        packed ``[1, T, C]``) -> ``h' [B, N, C]``; ``key_padding [B, Nk]`` bool (True = real token),
        ``positions`` of the shared attention's rotary."""
        if not isinstance(h, Tensor) or h.dim() != 3 or h.shape[-1] != self.dim or h.shape != embeddings.shape:
            got = tuple(h.shape) if isinstance(h, Tensor) else type(h).__name__
            raise ValueError(f"Zamba2Layer: h must be [B, N, {self.dim}] like embeddings "
                             f"{tuple(embeddings.shape)}, got {got}")
        u, mixer_cache = h, cache
        if self.shared is not None:
            attn_cache, mixer_cache = (None, None) if cache is None else (cache[0], cache[1])
            u = h + self.shared(torch.cat([h, embeddings], dim=-1), key_padding=key_padding, cache=attn_cache,
                                positions=positions, cu_seqlens=cu_seqlens)
        kw: dict[str, Any] = {}
        for name, value in (("mask", key_padding), ("cache", mixer_cache), ("cu_seqlens", cu_seqlens)):
            if value is not None:
                kw[name] = value
        return h + self.attn(self.attn_norm(u), **kw)  # [B, N, C]


class Zamba2LM(LayerLoopLM):
    """The Zamba2 decoder: a :class:`~attnzoo.models.loop.LayerLoopLM` of :class:`Zamba2Layer`
    layers, each given the token embeddings beside the stream; packed input runs whole."""

    packs = True

    def run_layers(self, x: Tensor, *, tokens: Tensor, key_padding: Tensor | None, positions: Tensor | None,
                   past: int, cache: LayerCaches | None, cu_seqlens: Tensor | None = None) -> Tensor:
        """``x`` the embeddings ``e [B, N, C]``, also the stream's start; returns the stream."""
        positions = self.rotary_positions(positions, key_padding, past, x.shape[1], x.device, cu_seqlens)
        h = x
        for i, layer in enumerate(self.blocks):
            h = layer(h, embeddings=x, key_padding=key_padding, cache=None if cache is None else cache[i],
                      positions=positions, cu_seqlens=cu_seqlens)
        return h


# --------------------------------------------------------------------------- the config
def layer_kinds(hf: HFConfig, depth: int) -> list[str]:
    """``"hybrid"`` or ``"mamba"`` per layer, from ``layers_block_type`` (``layer_types``; absent:
    transformers' default pattern)."""
    listed = hf.first(("layers_block_type", "layer_types"), None, list)
    listed = DEFAULT_LAYERS if listed is None else listed
    if len(listed) != depth:
        raise CheckpointFormatError(f"{hf.source}: layers_block_type has {len(listed)} entries for {depth} layers")
    unknown = sorted({str(t) for t in listed} - set(LAYER_NAMES))
    if unknown:
        raise hf.unsupported(f"layers_block_type entries {unknown} (supported: {sorted(LAYER_NAMES)})")
    return [LAYER_NAMES[t] for t in listed]


def _mamba_view(hf: HFConfig) -> HFConfig:
    """The mixer's settings as transformers builds them (SiLU, convolution biases, norm epsilon
    ``1e-5``, the head width ``expand * C / heads``), under :data:`MAMBA_KEYS`' names."""
    keys = ("hidden_size", "n_mamba_heads", "mamba_d_state", "mamba_ngroups", "mamba_d_conv", "mamba_expand")
    data = {k: hf.raw(k) for k in keys if hf.has(k)}
    data.update(conv_bias=True, add_bias_linear=hf.get("add_bias_linear", False, bool), norm_eps=1e-5,
                activation="silu")
    return HFConfig(data, hf.source, hf.arch)


def _mixer_factory(hf: HFConfig, *, device: Any, dtype: Any) -> Callable[[], Mamba2]:
    """Each layer's :class:`Mamba2`, its ``dt_proj`` a :class:`FlooredLinear` at ``time_step_min``."""
    make = mamba_factory(_mamba_view(hf), MAMBA_KEYS, device=device, dtype=dtype)
    lo = hf.get("time_step_min", 0.001, float)
    floor = math.log(math.expm1(lo)) if lo > 0 else -math.inf
    return functools.partial(_floored, make, floor, device=device, dtype=dtype)


def _floored(make: Callable[[], Mamba2], floor: float, *, device: Any, dtype: Any) -> Mamba2:
    mixer = make()
    heads = mixer.num_heads
    mixer.dt_proj = FlooredLinear(mixer.dim, heads, floor, device=device, dtype=dtype)
    del mixer.dt_bias  # now dt_proj's bias; a zero constant keeps the mixer's arithmetic
    mixer.register_buffer("dt_bias", torch.zeros(heads, device=device, dtype=dtype), persistent=False)
    return mixer


def _sizes(hf: HFConfig) -> dict[str, int]:
    """The shared block's sizes as transformers derives them (``head_dim = 2C / H`` whatever the
    config stores)."""
    C, H = hf.req("hidden_size"), hf.req("num_attention_heads")
    return {"C": C, "H": H, "Hkv": hf.get("num_key_value_heads", H), "D": 2 * C // H,
            "F": hf.get("intermediate_size", 4 * C), "r": hf.req("adapter_rank")}


def shared_block(hf: HFConfig, s: dict[str, int], kw: dict[str, Any]) -> SharedTransformer:
    """A :class:`SharedTransformer` of random weights."""
    eps = hf.get("rms_norm_eps", 1e-5, float)
    act = ACTIVATIONS[hf.activation("hidden_act", parts.GATED, "gelu")][0]
    C, H, Hkv, D, Fw = s["C"], s["H"], s["Hkv"], s["D"], s["F"]
    return SharedTransformer(RMSNorm(2 * C, eps, **kw), nn.Linear(2 * C, (H + 2 * Hkv) * D, bias=False, **kw),
                             nn.Linear(H * D, C, bias=False, **kw), RMSNorm(C, eps, **kw),
                             nn.Linear(C, 2 * Fw, bias=False, **kw), nn.Linear(Fw, C, bias=False, **kw), act)


def _adapter(width_in: int, rank: int, width_out: int, kw: dict[str, Any]) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width_in, rank, bias=False, **kw), nn.Linear(rank, width_out, bias=False, **kw))


def _use(hf: HFConfig, block: SharedTransformer, rope: nn.Module | None, s: dict[str, int],
         kw: dict[str, Any]) -> SharedTransformerUse:
    """One use of ``block``: its attention (the block's projections, adapters where the config
    has them), its MLP adapter and its output ``linear``."""
    C, D, r = s["C"], s["D"], s["r"]
    attn = cast(MultiHeadAttention, build_attention(
        "mha", 2 * C, s["H"], num_kv_heads=s["Hkv"], head_dim=D, bias=False, causal=True, rope=rope,
        dropout=hf.get("attention_dropout", 0.0, float), scale=(D / 2) ** -0.5, **kw))
    attn.qkv_proj = block.qkv_proj
    if hf.get("use_shared_attention_adapter", False, bool):
        widths = (s["H"] * D, s["Hkv"] * D, s["Hkv"] * D)
        attn.qkv_proj = AdaptedLinear(block.qkv_proj, nn.ModuleList([_adapter(2 * C, r, w, kw) for w in widths]))
    attn.out_proj = block.out_proj  # H D -> C: the attention reads [h | e] and writes the stream's width
    gate_up = AdaptedLinear(block.gate_up_proj, _adapter(C, r, 2 * s["F"], kw))
    return SharedTransformerUse(block, attn, gate_up, nn.Linear(C, C, bias=False, **kw))


def _shared_uses(hf: HFConfig, count: int, kw: dict[str, Any]) -> list[SharedTransformerUse]:
    """The ``count`` hybrid layers' uses: block ``i % num_mem_blocks`` for use ``i`` when the
    config ties them (``tie_word_embeddings``, as transformers), else a block per use."""
    s = _sizes(hf)
    mem = hf.get("num_mem_blocks", 1)
    if mem < 1:
        raise CheckpointFormatError(f"{hf.source}: num_mem_blocks must be >= 1, got {mem}")
    rope = parts.rotary(hf, parts.rope_params(hf), s["D"]) if hf.get("use_mem_rope", False, bool) else None
    tied = hf.get("tie_word_embeddings", True, bool)
    blocks = [shared_block(hf, s, kw) for _ in range(min(mem, count) if tied else count)]
    return [_use(hf, blocks[i % len(blocks)], rope, s, kw) for i in range(count)]


def build_zamba2(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``Zamba2Config`` (random weights; see the module docstring)."""
    hf = hf.with_defaults(DEFAULTS)
    parts.unsupported_keys(hf, {"add_bias_linear": lambda v: not v})
    V, C, depth = hf.req("vocab_size"), hf.req("hidden_size"), hf.req("num_hidden_layers")
    eps, kw = hf.get("rms_norm_eps", 1e-5, float), {"device": device, "dtype": dtype}
    kinds = layer_kinds(hf, depth)
    mixer = _mixer_factory(hf, **kw)
    uses = iter(_shared_uses(hf, kinds.count("hybrid"), kw))
    blocks = [Zamba2Layer(RMSNorm(C, eps, **kw), mixer(), next(uses) if k == "hybrid" else None) for k in kinds]
    cfg = DecoderConfig(V, C, depth, hf.req("num_attention_heads"), pos="rope", norm="rms", norm_eps=eps,
                        tie_embeddings=hf.get("tie_word_embeddings", True, bool), max_seq_len=parts.max_positions(hf))
    return Zamba2LM(config=cfg, parts=DecoderParts(blocks=blocks, norm=RMSNorm(C, eps, **kw),
                                                   head=head_for(C, V, head_size, **kw)), **kw)


# --------------------------------------------------------------------------- the weights
def _put_shared(plan: Plan, ours: str, theirs: str) -> None:
    """A :class:`SharedTransformer` at ``ours`` from transformers' ``shared_transformer`` at ``theirs``."""
    plan.put_cat(f"{ours}qkv_proj.weight", [f"{theirs}self_attn.{n}_proj.weight" for n in "qkv"])
    plan.put_pairs(ours, theirs, [("attn_norm", "input_layernorm"), ("ffn_norm", "pre_ff_layernorm"),
                                  ("out_proj", "self_attn.o_proj"), ("gate_up_proj", "feed_forward.gate_up_proj"),
                                  ("down_proj", "feed_forward.down_proj")], bias=False)


def _put_use(plan: Plan, ours: str, theirs: str, use: SharedTransformerUse, slot: int) -> None:
    """This use's adapters (slot ``slot`` of the block's adapter lists at ``theirs``)."""
    if isinstance(use.attn.qkv_proj, AdaptedLinear):
        for j, n in enumerate("qkv"):
            for k in (0, 1):
                plan.put(f"{ours}attn.qkv_proj.adapter.{j}.{k}.weight",
                         f"{theirs}self_attn.linear_{n}_adapter_list.{slot}.{k}.weight")
    for k in (0, 1):
        plan.put(f"{ours}gate_up.adapter.{k}.weight", f"{theirs}feed_forward.gate_up_proj_adapter_list.{slot}.{k}.weight")


def _put_floored_mamba(plan: Plan, ours: str, theirs: str, mixer: Mamba2) -> None:
    """The mixer (:func:`put_mamba`), its ``dt_bias`` into the :class:`FlooredLinear`'s bias."""
    put_mamba(plan, ours, theirs, mixer)
    plan.values[f"{ours}dt_proj.bias"] = plan.values.pop(f"{ours}dt_bias")


def _claim_copies(plan: Plan, layer: int, source: int, slot: int) -> None:
    """Mark as read the checkpoint's keys of ``layers.{layer}.shared_transformer`` that transformers
    never reads: the tied copies of layer ``source``'s block (each must equal its source) and,
    in an untied block, the adapter slots of the other layers."""
    src, head = plan.src, f"layers.{layer}.shared_transformer."
    for key in [k for k in src.sd if k.startswith(src.prefix + head)]:
        rest = key[len(src.prefix + head):]
        if source != layer:
            twin = f"{src.prefix}layers.{source}.shared_transformer.{rest}"
            if twin not in src.sd or not torch.equal(src.sd[key], src.sd[twin]):
                raise CheckpointFormatError(f"{key} differs from {twin}, the block it is tied to "
                                            f"(tie_word_embeddings=True ties the shared blocks)")
            src.used.add(key)
        elif "_adapter_list." in rest and int(rest.split("_adapter_list.")[1].split(".")[0]) != slot:
            src.used.add(key)


def hybrid_sources(model: DecoderLM) -> list[tuple[int, int, int]]:
    """``(layer, source layer, slot)`` per hybrid layer: the first layer holding its block."""
    first: dict[int, int] = {}
    out = []
    for i, block in enumerate(cast(Sequence[Zamba2Layer], model.blocks)):
        if block.shared is not None:
            source = first.setdefault(id(block.shared.block), i)
            out.append((i, source, len(out)))
    return out


def convert_zamba2(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them)."""
    hf = hf.with_defaults(DEFAULTS)
    model, plan, head_size = parts.start(hf, sd, build_zamba2, device=device, dtype=dtype)
    blocks = cast(Sequence[Zamba2Layer], model.blocks)
    for i, block in enumerate(blocks):
        o, h = f"blocks.{i}.", f"layers.{i}." if block.shared is None else f"layers.{i}.mamba_decoder."
        _put_floored_mamba(plan, f"{o}attn.", f"{h}mamba.", block.attn)
        plan.put(f"{o}attn_norm.weight", f"{h}input_layernorm.weight")
    for i, source, slot in hybrid_sources(model):
        use = cast(SharedTransformerUse, blocks[i].shared)
        theirs = f"layers.{source}.shared_transformer."
        if source == i:
            _put_shared(plan, f"blocks.{i}.shared.block.", theirs)
        _put_use(plan, f"blocks.{i}.shared.", theirs, use, slot)
        plan.put(f"blocks.{i}.shared.linear.weight", f"layers.{i}.linear.weight")
        _claim_copies(plan, i, source, slot)
    return parts.finish(plan, model, head_size, final_norm="final_layernorm")


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"zamba2": parts.Dispatch("Zamba2", convert_zamba2, ("Zamba2ForCausalLM", "Zamba2Model"))}
