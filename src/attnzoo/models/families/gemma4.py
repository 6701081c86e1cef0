"""Gemma 4 (text) -> :class:`~attnzoo.DecoderLM`: ``Gemma4ForCausalLM`` and ``Gemma4TextModel``
(``model_type="gemma4_text"``). The multimodal ``Gemma4ForConditionalGeneration`` / ``Gemma4Model``
(``model_type="gemma4"``) is not converted.

Line numbers: transformers 5.25, ``models/gemma4/modeling_gemma4.py`` (m.) and
``configuration_gemma4.py`` (c.). What Gemma 4 changes from Gemma 3 (``families/gemma3.py``), and
where each difference lives here:

* **Norms** (``Gemma4RMSNorm``, m. 196-214): ``x / sqrt(mean(x^2) + eps) * weight`` -- the weight
  itself, not Gemma 3's ``1 + weight``, applied in float32 before the one rounding of a
  half-precision input (:class:`~attnzoo.models.families._common.Float32ScaleRMSNorm` for every
  norm of the layers and the model; the q/k norms inside the attention round as LLaMA's do).
  Norms on both sides of both sub-layers as Gemma 3 (``sublayer_norm="both"``, m. 1372-1406).
* **Attention** (``Gemma4TextAttention``, m. 1141-1252; :class:`Gemma4Attention`, a
  :class:`~attnzoo.MultiHeadAttention`): score scale ``1.0`` (m. 1156; no
  ``query_pre_attn_scalar``), per-head q/k RMSNorm (weights) and a per-head value RMSNorm without
  a weight (``v_norm``, m. 1173, 1224). Full layers take their own ``head_dim`` and, with
  ``attention_k_eq_v``, their own KV head count (``per_layer_config``, c. 207-218: by default
  ``global_head_dim`` 512 and ``num_global_key_value_heads``). With ``attention_k_eq_v`` a full
  layer has no ``v_proj``: the values are the keys' projection before ``k_norm`` and RoPE
  (m. 1154, 1216-1224); here its ``qkv_proj`` has rows ``[q; k]`` only.
* **RoPE** (m. 1070-1138): per layer type, ``rope_parameters[type]`` over that type's head width:
  ``default`` (theta 10k on sliding layers; Gemma 4's own default turns the whole head, whatever
  ``partial_rotary_factor`` says, m. 1105-1127) or ``proportional`` (full layers: theta 1M,
  ``partial_rotary_factor`` 0.25; :class:`~attnzoo.models.families.lfm3.ProportionalRotaryEmbedding`).
  Other rope types are refused.
* **KV sharing** (``num_kv_shared_layers``, c. 222-248; m. 1208-1229): the last ``S`` layers
  compute no keys/values; each reuses those of the last earlier layer of its type (after that
  layer's cache update, so with the keys of every cached token). Here the producing layer writes its
  keys/values into a :class:`SharedKV` the reading layers hold, and a reading layer's decode cache is
  a :class:`SharedKVCounter` (it only counts tokens); packed sequences share the packed keys the same
  way. transformers' shortcut of running the reading layers on the last ``logits_to_keep`` tokens
  only (m. 1794-1843) changes no kept output. ``use_double_wide_mlp`` doubles the MLP width of the
  reading layers (m. 1053-1059).
* **Per-layer embeddings (PLE)** (m. 1563-1580, 1705-1784, 1408-1415): a second embedding
  ``embed_tokens_per_layer [Vp, L * P]`` (times ``sqrt(P)``) and the projection of the scaled token
  embeddings (``per_layer_model_projection``, times ``C ** -0.5``, RMSNorm over each layer's ``P``),
  added and times ``2 ** -0.5``; layer ``i`` adds ``norm(proj(act(gate(h)) * ple_i))`` after its
  feed-forward. The model is a :class:`Gemma4LM` (a :class:`~attnzoo.models.loop.LayerLoopLM`)
  whose layer loop computes those inputs once (:class:`PerLayerEmbedding`) and hands each
  :class:`Gemma4Block` its own; the caches, packing and :meth:`~attnzoo.DecoderLM.generate` are
  ``DecoderLM``'s.
* **Layer scalar** (m. 1343, 1417): every layer's output (its whole residual stream) times the
  buffer ``layer_scalar`` (loaded into :class:`Gemma4Block`'s buffer of the same name).
* **MoE** (``enable_moe_block``, m. 1255-1328, 1353-1358, 1391-1403; :class:`Gemma4MoE`): on every layer, the
  dense MLP (``pre_feedforward_layernorm`` -> mlp -> ``post_feedforward_layernorm_1``) plus routed
  experts (``pre_feedforward_layernorm_2`` -> experts -> ``post_feedforward_layernorm_2``) whose
  router reads the *un-normed* residual: an RMSNorm without weight, times ``scale * C ** -0.5``,
  ``proj``, softmax in float32, top-k renormalised to 1, times ``per_expert_scale`` of the chosen
  experts. Experts ``down(act(gate(x)) * up(x))`` with the config's activation (``gate_up_proj``
  rows ``[gate; up]``); the block's ``post_feedforward_layernorm`` then normalises the sum.
* ``Gemma4ClippableLinear`` (m. 167-193) belongs to the vision/audio towers only.

Refused by name: ``use_bidirectional_attention="all"`` (``"vision"`` is causal for text),
``num_kv_shared_layers`` that leaves no layer to compute a type's keys, ``per_layer_config`` keys
other than ``head_dim`` / ``num_key_value_heads`` (or differing within a layer type), rope types
other than ``default`` / ``proportional``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo.blocks import ACTIVATIONS, BlockLayers, RMSNorm, TransformerBlock
from attnzoo.functional.softmax.varlen import attention_varlen
from attnzoo.models._common import LayerCaches
from attnzoo.models.config import DecoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.families.lfm3 import ProportionalRotaryEmbedding
from attnzoo.models.hf._state import HFConfig, Plan
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.models.loop import LayerLoopLM
from attnzoo.models.parts import DecoderParts, ScaledEmbedding, head_for
from attnzoo.nn.attention import MultiHeadAttention, build_softmax
from attnzoo.nn.cache import KVCache, SlidingWindowKVCache, SnapshotCache
from attnzoo.nn.frontier import packed_cu_seqlens, packed_positions
from attnzoo.nn.moe import MixtureOfExperts, Routing
from attnzoo.nn.positional import RotaryEmbedding, resolve_positions

__all__ = ["DEFAULTS", "DISPATCH", "NORMS", "TYPES", "Gemma4Attention", "Gemma4Block", "Gemma4Embedding", "Gemma4LM",
           "Gemma4MoE", "Gemma4RoutedExperts", "KVSharing", "PerLayerEmbedding", "PerLayerInput", "SharedKV",
           "SharedKVCounter", "build_gemma4", "canonical", "convert_gemma4", "layer_rope", "put_attention"]

TYPES = ("sliding_attention", "full_attention")
NORMS = parts.GEMMA_NORMS

#: ``Gemma4TextConfig``'s defaults of the keys read here (c. 147-178), for a ``config.json`` that
#: leaves them out (``layer_types``, ``rope_parameters``, ``per_layer_config``: :func:`canonical`)
DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
    "attention_dropout": 0.0, "sliding_window": 512, "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256, "attention_k_eq_v": False, "num_kv_shared_layers": 0,
    "enable_moe_block": False, "use_double_wide_mlp": False,
}
#: ``__post_init__``'s ``rope_parameters`` (c. 198-203)
DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
#: ``__post_init__``'s ``global_head_dim`` default (c. 205)
GLOBAL_HEAD_DIM = 512


# --------------------------------------------------------------------------- KV sharing
class SharedKV:
    """Where the layers that compute keys/values leave them for the layers that reuse them (one
    slot per layer type): ``slot -> (k [B, Hkv, Nk, D], v [B, Hkv, Nk, D], start, first)``, the
    keys of positions ``first ..`` for queries at ``start ..`` (what the producing layer attended
    to). Not a module: it holds tensors only between a producing and its last reading layer."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[Tensor, Tensor, int, int]] = {}

    def write(self, slot: str, entry: tuple[Tensor, Tensor, int, int]) -> None:
        self.entries[slot] = entry

    def read(self, slot: str, release: bool) -> tuple[Tensor, Tensor, int, int]:
        entry = self.entries.pop(slot, None) if release else self.entries.get(slot)
        if entry is None:
            raise RuntimeError(f"Gemma4Attention: no shared keys/values for {slot!r} layers yet; a layer that "
                               f"reuses keys runs after the layer that computes them, in one model call")
        return entry


@dataclass
class KVSharing:
    """A layer's part in KV sharing: ``role`` ``"store"`` (computes keys/values and leaves them in
    ``store[slot]``) or ``"reuse"`` (has no key/value projections; reads them); ``release``: the
    last reading layer of the slot, which frees it."""

    store: SharedKV
    slot: str
    role: str
    release: bool = field(default=False)


class SharedKVCounter(SnapshotCache):
    """The decode cache of a layer that reuses another layer's keys: it only counts the tokens
    written (``length``), with the cache protocol (``reset``, ``mark``/``rollback``/``commit``)."""

    _batch_tensors = ()

    def __init__(self, batch_size: int) -> None:
        self._set_sizes(batch_size)


# --------------------------------------------------------------------------- attention
class Gemma4Attention(MultiHeadAttention):
    """Gemma 4's causal attention (m. 1141-1252): q/k RMSNorm per head (the parts'
    ``qk_norm="head"``), a value RMSNorm without weight (eps ``v_norm_eps``), RoPE, scale 1 (the
    parts' ``scale``); ``k_eq_v``: the values are the raw keys (``qkv_proj`` rows ``[q; k]``);
    ``sharing``: a :class:`KVSharing` (a ``"reuse"`` layer's ``qkv_proj`` has the query rows only).

    Shapes: as :class:`~attnzoo.MultiHeadAttention` (``x [B, N, C] -> [B, N, C]``; packed
    ``[1, T, C]`` with ``cu_seqlens``).
    """

    _cache_types = (KVCache, SlidingWindowKVCache, SharedKVCounter)

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None, *,
                 bias: bool = False, window: int | None = None, rope: RotaryEmbedding | None = None,
                 dropout: float = 0.0, parts: Any = None, sharing: KVSharing | None = None, k_eq_v: bool = False,
                 v_norm_eps: float = 1e-6) -> None:
        # the key/value row groups of qkv_proj, read by _make_projections during the base __init__
        self.__dict__["_kv_rows"] = 0 if sharing is not None and sharing.role == "reuse" else 1 if k_eq_v else 2
        super().__init__(dim, num_heads, num_kv_heads, head_dim=head_dim, bias=bias, causal=True, window=window,
                         rope=rope, dropout=dropout, parts=parts)
        self.sharing, self.k_eq_v, self.v_norm_eps = sharing, bool(k_eq_v), float(v_norm_eps)
        if self.reuses:  # no keys of its own: no key norm either (transformers' layer has no k_norm)
            self.frontier._norms = (self.frontier.q_norm, None)
            self.frontier.k_norm_weight = None

    def _make_projections(self, bias: bool, fk: dict[str, Any], kv_dim: int) -> None:
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        self.qkv_proj = nn.Linear(self.dim, (H + self._kv_rows * Hkv) * D, bias=bias, **fk)
        self.out_proj = nn.Linear(H * D, self.dim, bias=bias, **fk)

    @property
    def reuses(self) -> bool:
        """True for a layer that reads another layer's keys/values."""
        return self._kv_rows == 0

    def _new_cache(self, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype) -> Any:
        if self.reuses:
            return SharedKVCounter(batch_size)
        return super()._new_cache(batch_size, max_len, device, dtype)

    def _norm_v(self, v: Tensor) -> Tensor:
        """``v [B, Hkv, N, D]`` over ``D`` without a weight (in float32 for half precision)."""
        if v.dtype in (torch.float32, torch.float64):
            return F.rms_norm(v, (v.shape[-1],), eps=self.v_norm_eps)
        return F.rms_norm(v.float(), (v.shape[-1],), eps=self.v_norm_eps).to(v.dtype)

    def _project_self(self, x: Tensor, positions: Tensor | None, start: int, *,
                      rotate: bool) -> tuple[Tensor, Tensor, Tensor]:
        """``q [B, H, N, D]``, ``k, v [B, Hkv, N, D]`` (q/k normed and rotated, v normed); a reusing
        layer returns its queries only (``k``, ``v`` empty)."""
        B, N, _ = x.shape
        H, Hkv = self.num_heads, self.num_kv_heads
        heads = self.split_heads(self.qkv_proj(x))  # [B, H + rows * Hkv, N, D]
        q = self.frontier.norm_q(heads[:, :H])
        k = heads[:, H:H + Hkv]  # empty on a reusing layer
        v = self._norm_v(k if self.k_eq_v else heads[:, H + Hkv:])
        k = self.frontier.norm_k(k)  # the identity on a reusing layer
        if rotate and self.rope is not None:
            pos = resolve_positions(positions, N, start, x.device, batch=B)
            q, k = self._rotate(q, pos), k if self.reuses else self._rotate(k, pos)
        return q, k, v

    def _self(self, x: Tensor, mask: Any, cache: Any, positions: Tensor | None,
              return_weights: bool) -> tuple[Tensor, Tensor | None]:
        N = x.shape[1]
        if self.reuses:
            assert self.sharing is not None
            k, v, start, first = self.sharing.store.read(self.sharing.slot, self.sharing.release)
            if cache is not None:
                cache.advance(N, x.device)
            q = self._project_self(x, positions, start, rotate=True)[0]
            return self._attend_keys(q, k, v, mask, start, first, return_weights, decoding=cache is not None)
        self._check_self_cache(cache)
        start = 0 if cache is None else cache.length
        q, k, v = self._project_self(x, positions, start, rotate=True)
        if cache is not None:
            k, v, _ = cache.update(k, v)  # the keys the new queries may need, in position order
        first = start + N - k.shape[2]
        if self.sharing is not None:
            self.sharing.store.write(self.sharing.slot, (k, v, start, first))
        return self._attend_keys(q, k, v, mask, start, first, return_weights, decoding=cache is not None)

    def _packed(self, x: Tensor, cu_seqlens: object, context: object, mask: object, cache: object,
                positions: object, return_weights: bool) -> Tensor:
        """Packed self-attention of ``x [1, T, C]`` (``cu_seqlens``): ``[1, H, T, D]`` before the merge;
        a producing layer leaves its packed keys for the reusing ones (``start = first = 0``)."""
        cls = type(self).__name__
        if any(v is not None for v in (context, mask, cache, positions)) or return_weights or \
                (self.training and self.dropout):
            what = "context, mask, cache, positions, return_weights or attention dropout"
            if self.sharing is not None:  # no fallback to one sequence at a time: the shared keys are the row's
                raise ValueError(f"{cls}: a layer sharing keys across layers runs packed sequences whole, with no "
                                 f"{what}")
            raise ValueError(f"{cls}: packed input (cu_seqlens) takes no {what}")
        cu = packed_cu_seqlens(cu_seqlens, x, cls)
        T = x.shape[1]
        pos = packed_positions(cu, T)
        q, k, v = self._project_self(x, pos, 0, rotate=True)
        if self.reuses:
            assert self.sharing is not None
            k, v = self.sharing.store.read(self.sharing.slot, self.sharing.release)[:2]
        elif self.sharing is not None:
            self.sharing.store.write(self.sharing.slot, (k, v, 0, 0))
        out = attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu,
                               causal=True, window=self.window, scale=self.scale, backend=self.backend)  # [T, H, D]
        return out.transpose(0, 1).reshape(1, self.num_heads, T, -1)

    def extra_repr(self) -> str:
        role = "" if self.sharing is None else f", kv {self.sharing.role} {self.sharing.slot!r}"
        return f"{super().extra_repr()}, k_eq_v={self.k_eq_v}{role}"


# --------------------------------------------------------------------------- embeddings and layers
def _times(t: Tensor, scale: float) -> Tensor:
    """``t`` times ``scale`` rounded to ``t``'s dtype first (transformers' ``embed_scale.to(dtype)``)."""
    return t * torch.tensor(scale, dtype=t.dtype, device=t.device)


class Gemma4Embedding(ScaledEmbedding):
    """The token embedding times ``sqrt(C)``, the scale rounded to the weight's dtype first as
    transformers does (``Gemma4TextScaledWordEmbedding``, m. 1421-1433). Weight ``[V, C]``.

    Shapes: ``tokens [B, N] -> [B, N, C]``."""

    def forward(self, tokens: Tensor) -> Tensor:
        return _times(super(ScaledEmbedding, self).forward(tokens), self.scale)  # [B, N, C]


class PerLayerEmbedding(nn.Module):
    """The per-layer inputs of PLE (m. 1705-1784) from the token ids and their scaled embeddings
    ``e``: ``(norm(proj(e) * C ** -0.5) + embed(tokens) * sqrt(P)) * 2 ** -0.5``, one ``[P]`` vector
    per layer (``norm`` over each layer's ``P``). Weights: ``embed [Vp, L P]``, ``proj [L P, C]``,
    ``norm [P]``.

    Shapes: ``tokens [B, N]``, ``e [B, N, C]`` -> ``[B, N, L, P]``.
    """

    def __init__(self, vocab_size: int, dim: int, layers: int, width: int, eps: float, *, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        self.dim, self.layers, self.width = dim, layers, width
        self.embed = nn.Embedding(vocab_size, layers * width, device=device, dtype=dtype)
        self.proj = nn.Linear(dim, layers * width, bias=False, device=device, dtype=dtype)
        self.norm = RMSNorm(width, eps, device=device, dtype=dtype)

    def forward(self, tokens: Tensor, e: Tensor) -> Tensor:
        B, N = tokens.shape
        ids = _times(self.embed(tokens), self.width ** 0.5).view(B, N, self.layers, self.width)
        proj = self.norm((self.proj(e) * self.dim ** -0.5).view(B, N, self.layers, self.width))
        return (proj + ids) * 2.0 ** -0.5  # [B, N, L, P]


class PerLayerInput(nn.Module):
    """One layer's PLE update (m. 1408-1415): ``h, p [.., P] -> norm(proj(act(gate(h)) * p))`` ``[.., C]``.
    Weights: ``gate [P, C]``, ``proj [C, P]``, ``norm [C]``."""

    def __init__(self, dim: int, width: int, activation: Callable[[Tensor], Tensor], eps: float, *,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.width, self.act = width, activation
        self.gate = nn.Linear(dim, width, bias=False, device=device, dtype=dtype)
        self.proj = nn.Linear(width, dim, bias=False, device=device, dtype=dtype)
        self.norm = RMSNorm(dim, eps, device=device, dtype=dtype)

    def forward(self, h: Tensor, p: Tensor) -> Tensor:
        return self.norm(self.proj(self.act(self.gate(h)) * p))


class Gemma4Block(TransformerBlock):
    """One Gemma 4 layer (m. 1361-1418): the pre/post-normed attention and feed-forward of a
    :class:`TransformerBlock`, then (with PLE) ``per_layer``'s update from this layer's input
    ``p``, then everything times the buffer ``layer_scalar``.

    Shapes: ``x [B, N, C]``, ``per_layer_input [B, N, P]`` -> ``[B, N, C]``."""

    def __init__(self, dim: int, layers: BlockLayers, *, per_layer: PerLayerInput | None, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(dim, layers=layers)
        self.per_layer = per_layer
        self.register_buffer("layer_scalar", torch.ones(1, device=device, dtype=dtype))

    def forward(self, x: Tensor, per_layer_input: Tensor | None = None, *,  # type: ignore[override]
                key_padding: Tensor | None = None, cache: Any = None, positions: Tensor | None = None,
                cu_seqlens: Tensor | None = None) -> Tensor:
        """The arguments as :meth:`TransformerBlock.forward` (no context, no extra mask)."""
        h = super().forward(x, key_padding=key_padding, cache=cache, positions=positions, cu_seqlens=cu_seqlens)
        if self.per_layer is not None:
            if per_layer_input is None:
                raise ValueError("Gemma4Block: this layer has per-layer inputs (PLE); pass per_layer_input [B, N, P]")
            h = h + self.per_layer(h, per_layer_input)
        return h * self.layer_scalar


class Gemma4LM(LayerLoopLM):
    """The Gemma 4 decoder: a :class:`~attnzoo.models.loop.LayerLoopLM` of :class:`Gemma4Block`
    layers whose loop computes the per-layer inputs (``per_layer``, a :class:`PerLayerEmbedding`,
    or ``None`` without PLE) once from the token ids and the embeddings and hands layer ``i`` its
    own; packed input runs through the layers whole."""

    packs = True

    def __init__(self, *, per_layer: PerLayerEmbedding | None, config: DecoderConfig, parts: DecoderParts,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(config=config, parts=parts, device=device, dtype=dtype)
        self.per_layer = per_layer

    def run_layers(self, x: Tensor, *, tokens: Tensor, key_padding: Tensor | None, positions: Tensor | None,
                   past: int, cache: LayerCaches | None, cu_seqlens: Tensor | None = None) -> Tensor:
        """``x`` the scaled embeddings ``[B, N, C]``; returns the stream after the last layer."""
        positions = self.rotary_positions(positions, key_padding, past, x.shape[1], x.device, cu_seqlens)
        ple = None if self.per_layer is None else self.per_layer(tokens, x)  # [B, N, L, P]
        h = x
        for i, block in enumerate(self.blocks):
            h = block(h, None if ple is None else ple[:, :, i], key_padding=key_padding,
                      cache=None if cache is None else cache[i], positions=positions, cu_seqlens=cu_seqlens)
        return h


# --------------------------------------------------------------------------- MoE
class Gemma4RoutedExperts(MixtureOfExperts):
    """Gemma 4's routed experts (m. 1255-1328): :class:`~attnzoo.nn.moe.MixtureOfExperts`'s experts
    (``gate_proj``/``up_proj [E, F, C]``, ``down_proj [E, C, F]``) with the activation ``act``, routed
    from another input than the experts': ``route(r)`` = RMSNorm without weight of ``r``, times
    ``scale * C ** -0.5``, ``router``, softmax (float32), top-k renormalised, times
    ``per_expert_scale`` of the chosen experts. Weights: also ``scale [C]``, ``per_expert_scale [E]``.

    Shapes: ``forward(x [T, C], r [T, C]) -> [T, C]``.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *,
                 activation: Callable[[Tensor], Tensor], eps: float, device: Any = None, dtype: Any = None) -> None:
        super().__init__(dim, hidden, num_experts, top_k, routing=Routing("softmax_topk", norm_topk_prob=True),
                         device=device, dtype=dtype)
        self.act, self.eps = activation, float(eps)
        self.scale = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts, device=device, dtype=dtype))

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(weights [T, k] float32, experts [T, k], logits [T, E])`` of the routing input ``x [T, C]``."""
        wide = torch.promote_types(x.dtype, torch.float32)
        n = F.rms_norm(x.to(wide), (self.dim,), eps=self.eps).to(x.dtype)
        logits = self.router(n * self.scale * self.dim ** -0.5)  # [T, E]
        weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=wide), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts, logits

    def expert(self, e: int, x: Tensor) -> Tensor:
        assert self.gate_proj is not None
        h = self.act(F.linear(x, self.gate_proj[e])) * F.linear(x, self.up_proj[e])  # [T, F]
        return F.linear(h, self.down_proj[e])  # [T, C]

    def forward(self, x: Tensor, r: Tensor | None = None) -> Tensor:  # type: ignore[override]
        weights, experts, _ = self.route(x if r is None else r)  # [T, k]
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            token, slot = torch.nonzero(experts == e, as_tuple=True)
            out.index_add_(0, token, (self.expert(e, x[token]) * weights[token, slot, None]).to(out.dtype))
        return out


class Gemma4MoE(nn.Module):
    """A layer's feed-forward with ``enable_moe_block`` (m. 1387-1403), on the un-normed residual
    ``x [B, N, C]`` (the block's ``ffn_norm`` is the identity):
    ``mlp_out_norm(mlp(mlp_norm(x))) + experts_out_norm(experts(experts_norm(x), routed from x))``."""

    def __init__(self, mlp: nn.Module, experts: Gemma4RoutedExperts, norm: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.mlp, self.experts = mlp, experts
        self.mlp_norm, self.mlp_out_norm = norm(), norm()
        self.experts_norm, self.experts_out_norm = norm(), norm()

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [T, C]
        routed = self.experts_out_norm(self.experts(self.experts_norm(flat), flat)).view(x.shape)
        return self.mlp_out_norm(self.mlp(self.mlp_norm(x))) + routed


# --------------------------------------------------------------------------- the config
def canonical(hf: HFConfig) -> HFConfig:
    """``hf`` as transformers reads a ``Gemma4TextConfig``: :data:`DEFAULTS` where absent,
    ``layer_types`` (5 sliding : 1 full, the last layer forced to full), ``rope_parameters`` and
    ``per_layer_config`` as ``__post_init__`` sets them (c. 180-220)."""
    out = hf.with_defaults(DEFAULTS)
    depth = out.req("num_hidden_layers")
    kinds = out.get("layer_types", None, list)
    if kinds is None:
        kinds = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(depth)]
    kinds = list(kinds)
    if kinds:
        kinds[-1] = "full_attention"
    out.data["layer_types"] = kinds
    if out.get("rope_parameters", None, dict) is None:
        out.data["rope_parameters"] = {k: dict(v) for k, v in DEFAULT_ROPE.items()}
    if out.get("per_layer_config", None, dict) is None:
        over: dict[str, Any] = {"head_dim": out.get("global_head_dim", GLOBAL_HEAD_DIM)}
        if out.req("attention_k_eq_v", bool) and out.has("num_global_key_value_heads"):
            over["num_key_value_heads"] = out.req("num_global_key_value_heads")
        out.data["per_layer_config"] = {i: dict(over) for i, k in enumerate(kinds) if k == "full_attention"}
    return out


def layer_sizes(hf: HFConfig, kinds: list[str]) -> list[tuple[int, int]]:
    """``(head_dim, num_key_value_heads)`` of every layer (``per_layer_config`` over the config's)."""
    base = (hf.req("head_dim"), hf.req("num_key_value_heads"))
    sizes = [base] * len(kinds)
    for key, over in hf.req("per_layer_config", dict).items():
        if not str(key).isdigit() or int(key) >= len(kinds) or not isinstance(over, dict):
            raise hf.unsupported(f"per_layer_config[{key!r}] (a layer index < {len(kinds)} -> dict expected)")
        extra = sorted(set(over) - {"head_dim", "num_key_value_heads"})
        if extra:
            raise hf.unsupported(f"per_layer_config[{key}] keys {extra} (only head_dim, num_key_value_heads)")
        sizes[int(key)] = (int(over.get("head_dim", base[0])), int(over.get("num_key_value_heads", base[1])))
    for t in set(kinds):
        if len({s for s, k in zip(sizes, kinds, strict=True) if k == t}) > 1:
            raise hf.unsupported(f"per_layer_config giving {t} layers different sizes")
    return sizes


def sharing_roles(hf: HFConfig, kinds: list[str]) -> list[tuple[str | None, bool]]:
    """``(role, release)`` per layer (c. 222-248): the last ``num_kv_shared_layers`` layers
    ``"reuse"``; the last earlier layer of each type ``"store"``; ``release`` on the last reader."""
    depth, shared = len(kinds), hf.req("num_kv_shared_layers")
    if shared == 0:
        return [(None, False)] * depth
    first = depth - shared
    if shared < 0 or not set(kinds[first:]) <= set(kinds[:max(first, 0)]):
        raise hf.unsupported(f"num_kv_shared_layers={shared} (of {depth} layers: a reusing layer's type "
                             f"{sorted(set(kinds[max(first, 0):]) - set(kinds[:max(first, 0)]))} has no earlier "
                             f"layer computing its keys)")
    roles: list[tuple[str | None, bool]] = [(None, False)] * first + [("reuse", False)] * shared
    for t in set(kinds[first:]):
        roles[max(i for i in range(first) if kinds[i] == t)] = ("store", False)
        roles[max(i for i in range(first, depth) if kinds[i] == t)] = ("reuse", True)
    return roles


def layer_rope(hf: HFConfig, layer_type: str, head_dim: int) -> nn.Module:
    """The rotary embedding of the ``layer_type`` layers (m. 1070-1138): ``default`` (theta only,
    over the whole head) or ``proportional``."""
    params = parts.rope_params(hf, layer_type)
    rope_type = params.get("rope_type", "default") or "default"
    if rope_type == "default":
        return RotaryEmbedding(head_dim, base=float(params["rope_theta"]))
    if rope_type != "proportional":
        raise hf.unsupported(f"rope_parameters[{layer_type!r}] rope_type={rope_type!r} (supported: 'default', "
                             f"'proportional')")
    factor, partial = params.get("factor", 1.0), params.get("partial_rotary_factor", 1.0)
    try:
        return ProportionalRotaryEmbedding(head_dim, base=float(params["rope_theta"]),
                                           partial_rotary_factor=1.0 if partial is None else partial,
                                           factor=1.0 if factor is None else factor)
    except ValueError as exc:
        raise hf.unsupported(f"rope_parameters[{layer_type!r}] of rope_type='proportional': {exc}") from exc


def _check(hf: HFConfig) -> None:
    bidirectional = hf.raw("use_bidirectional_attention")
    if bidirectional not in (None, "vision"):
        raise hf.unsupported(f"use_bidirectional_attention={bidirectional!r} (a bidirectional text model; "
                             f"'vision' is causal for text and supported)")
    if hf.req("enable_moe_block", bool):
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            hf.req(key)


def _attention(hf: HFConfig, kind: str, size: tuple[int, int], sharing: KVSharing | None,
               kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """A factory of one layer's :class:`Gemma4Attention`."""
    D, Hkv = size
    window = hf.req("sliding_window") - 1 if kind == "sliding_attention" else None
    return functools.partial(
        build_softmax, Gemma4Attention, hf.req("hidden_size"), hf.req("num_attention_heads"), num_kv_heads=Hkv,
        head_dim=D, bias=hf.req("attention_bias", bool), window=window, rope=layer_rope(hf, kind, D),
        dropout=hf.get("attention_dropout", 0.0, float), qk_norm="head", qk_norm_eps=hf.req("rms_norm_eps", float),
        scale=1.0, sharing=sharing, k_eq_v=hf.req("attention_k_eq_v", bool) and kind == "full_attention",
        v_norm_eps=hf.req("rms_norm_eps", float), **kw)


def _feed_forward(hf: HFConfig, act: str, wide: bool, kw: dict[str, Any]) -> Callable[[], nn.Module]:
    """A factory of one layer's feed-forward: the gated MLP (twice as wide on a reusing layer with
    ``use_double_wide_mlp``), with ``enable_moe_block`` inside a :class:`Gemma4MoE`."""
    C, eps = hf.req("hidden_size"), hf.req("rms_norm_eps", float)
    mlp = parts.gated_mlp(C, hf.req("intermediate_size") * (2 if wide else 1), act, **kw)
    if not hf.req("enable_moe_block", bool):
        return mlp
    experts = functools.partial(Gemma4RoutedExperts, C, hf.req("moe_intermediate_size"), hf.req("num_experts"),
                                hf.req("top_k_experts"), activation=ACTIVATIONS[act][0], eps=eps, **kw)
    return lambda: Gemma4MoE(mlp(), experts(), parts.rms_norm(C, eps, **kw))


def build_gemma4(hf: HFConfig, *, head_size: int | None = None, device: Any = None, dtype: Any = None) -> DecoderLM:
    """The decoder of a ``Gemma4TextConfig`` (random weights; see the module docstring)."""
    hf = canonical(hf)
    _check(hf)
    V, C, depth = hf.req("vocab_size"), hf.req("hidden_size"), hf.req("num_hidden_layers")
    eps, kw = hf.req("rms_norm_eps", float), {"device": device, "dtype": dtype}
    kinds = parts.layer_types(hf, depth, TYPES)
    sizes, roles = layer_sizes(hf, kinds), sharing_roles(hf, kinds)
    act = hf.activation("hidden_activation", parts.GATED, "gelu_pytorch_tanh")
    P = hf.req("hidden_size_per_layer_input") if hf.raw("hidden_size_per_layer_input") else 0
    store = SharedKV()
    blocks = []
    for kind, size, (role, release) in zip(kinds, sizes, roles, strict=True):
        sharing = None if role is None else KVSharing(store, kind, role, release)
        wide = role == "reuse" and hf.req("use_double_wide_mlp", bool)
        layers = BlockLayers(attention=_attention(hf, kind, size, sharing, kw), norm=parts.rms_norm(C, eps, **kw),
                             feed_forward=_feed_forward(hf, act, wide, kw), sublayer_norm="both")
        ple = PerLayerInput(C, P, ACTIVATIONS[act][0], eps, **kw) if P else None
        block = Gemma4Block(C, layers, per_layer=ple, **kw)
        if hf.req("enable_moe_block", bool):
            block.ffn_norm = nn.Identity()  # the MoE normalises its two inputs itself
        blocks.append(block)
    per_layer = PerLayerEmbedding(hf.req("vocab_size_per_layer_input"), C, depth, P, eps, **kw) if P else None
    cfg = DecoderConfig(V, C, depth, hf.req("num_attention_heads"), pos="rope", norm="rms", norm_eps=eps,
                        tie_embeddings=hf.req("tie_word_embeddings", bool), max_seq_len=parts.max_positions(hf))
    head = head_for(C, V, head_size, softcap=hf.get("final_logit_softcapping", None, float), **kw)
    model = Gemma4LM(per_layer=per_layer, config=cfg, parts=DecoderParts(
        blocks=blocks, embedding=Gemma4Embedding(V, C, scale=C ** 0.5, **kw), norm=RMSNorm(C, eps, **kw), head=head),
        **kw)
    return parts.float32_scale_norms(model)  # Gemma4RMSNorm applies its weight in float32 (m. 210-214)


# --------------------------------------------------------------------------- the weights
def put_attention(plan: Plan, ours: str, theirs: str, attn: Gemma4Attention) -> None:
    """``qkv_proj`` rows ``[q; k; v]`` (``[q; k]`` with ``k_eq_v``, ``q`` on a reusing layer), ``out_proj``,
    the q/k norm weights (``v_norm`` has none)."""
    names = ["q"] if attn.reuses else ["q", "k"] if attn.k_eq_v else ["q", "k", "v"]
    plan.put_cat(f"{ours}qkv_proj.weight", [f"{theirs}{n}_proj.weight" for n in names])
    if attn.qkv_proj.bias is not None:
        plan.put_cat(f"{ours}qkv_proj.bias", [f"{theirs}{n}_proj.bias" for n in names])
    plan.put_pairs(ours, theirs, [("out_proj", "o_proj")], bias=attn.out_proj.bias is not None)
    plan.put(f"{ours}frontier.q_norm_weight", f"{theirs}q_norm.weight")
    if attn.frontier.k_norm_weight is not None:
        plan.put(f"{ours}frontier.k_norm_weight", f"{theirs}k_norm.weight")


def _put_moe(plan: Plan, ours: str, theirs: str, hidden: int) -> None:
    """The dense MLP, its norms, the router and the experts of a :class:`Gemma4MoE` at ``ours``."""
    parts.put_mlp(plan, f"{ours}mlp.", f"{theirs}mlp.")
    for name, key in (("mlp_norm", "pre_feedforward_layernorm"), ("mlp_out_norm", "post_feedforward_layernorm_1"),
                      ("experts_norm", "pre_feedforward_layernorm_2"),
                      ("experts_out_norm", "post_feedforward_layernorm_2")):
        plan.put(f"{ours}{name}.weight", f"{theirs}{key}.weight")
    e, r = f"{ours}experts.", f"{theirs}router."
    plan.put(f"{e}router.weight", f"{r}proj.weight")
    plan.put(f"{e}scale", f"{r}scale")
    plan.put(f"{e}per_expert_scale", f"{r}per_expert_scale")
    plan.put(f"{e}gate_proj", f"{theirs}experts.gate_up_proj", lambda t: t[:, :hidden])
    plan.put(f"{e}up_proj", f"{theirs}experts.gate_up_proj", lambda t: t[:, hidden:])
    plan.put(f"{e}down_proj", f"{theirs}experts.down_proj")


def _put_layer(plan: Plan, block: Gemma4Block, i: int) -> None:
    o, h = f"blocks.{i}.", f"layers.{i}."
    assert isinstance(block.attn, Gemma4Attention)
    put_attention(plan, f"{o}attn.", f"{h}self_attn.", block.attn)
    if isinstance(block.ffn, Gemma4MoE):
        _put_moe(plan, f"{o}ffn.", h, block.ffn.experts.hidden)
        norms = [n for n in NORMS if n[0] != "ffn_norm"]
    else:
        parts.put_mlp(plan, f"{o}ffn.", f"{h}mlp.")
        norms = NORMS
    plan.put_pairs(o, h, norms, bias=False)
    plan.put(f"{o}layer_scalar", f"{h}layer_scalar")
    if block.per_layer is not None:
        plan.put_pairs(f"{o}per_layer.", h, [("gate", "per_layer_input_gate"), ("proj", "per_layer_projection"),
                                             ("norm", "post_per_layer_input_norm")], bias=False)


def convert_gemma4(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> DecoderLM:
    """Build the decoder and copy the weights (the head follows them). A reusing layer's
    ``k_proj``/``v_proj``/``k_norm`` in a checkpoint are ignored, as transformers ignores them."""
    model, plan, head_size = parts.start(hf, sd, build_gemma4, device=device, dtype=dtype)
    ignore = [r"(model\.)?embed_tokens(_per_layer)?\.embed_scale"]
    for i, block in enumerate(model.blocks):
        if not isinstance(block, Gemma4Block):
            raise CheckpointFormatError(f"{hf.source}: layer {i} is not a Gemma 4 layer")
        _put_layer(plan, block, i)
        if block.attn.reuses:
            ignore.append(rf"(model\.)?layers\.{i}\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.\w+")
    if isinstance(model, Gemma4LM) and model.per_layer is not None:
        plan.put("per_layer.embed.weight", "embed_tokens_per_layer.weight")
        plan.put("per_layer.proj.weight", "per_layer_model_projection.weight")
        plan.put("per_layer.norm.weight", "per_layer_projection_norm.weight")
    return parts.finish(plan, model, head_size, ignore=ignore)


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"gemma4_text": parts.Dispatch("Gemma 4", convert_gemma4, ("Gemma4ForCausalLM", "Gemma4TextModel"))}
