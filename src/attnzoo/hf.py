"""attnzoo inside Hugging Face transformers: ``attn_implementation="attnzoo"``.

``register()`` adds attnzoo to transformers' attention interface (the function every
``*Attention`` module of a model that supports attention backends calls) and to its mask
interface (the function that builds the mask a model hands to that attention function)::

    import attnzoo.hf
    attnzoo.hf.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attnzoo")
    model.set_attn_implementation("attnzoo_tiled")        # or switch a loaded model

Names: ``"attnzoo"`` (``backend="auto"``), ``"attnzoo_tiled"``, ``"attnzoo_sdpa"``,
``"attnzoo_reference"`` (the float64-capable plain math, for checking).

What reaches :func:`attnzoo.attention`:

* masks as structure, not as a dense ``[B, 1, Nq, Nk]`` tensor: the mask interface recognises
  transformers' causal, bidirectional and sliding-window mask functions and returns an
  :class:`HFMask` (``causal``, ``window``, key padding ``[B, Nk]``, query offset); the attention
  function turns it into ``causal=True, window=(W - 1, 0)`` (transformers' ``sliding_window=W``
  lets a query see itself and the ``W - 1`` keys before it) plus a ``[B, 1, 1, Nk]`` key-padding
  mask, so the tiled backend runs its band path. Llama 4's chunked causal masks and the blockwise
  overlay (``causal | blockwise_overlay(ids)``) become :class:`attnzoo.masks.Mask` structure
  (``HFMask.structure``), whose empty tiles the tiled backend skips. Packed sequences (the
  ``position_ids`` restarting at 0 that ``DataCollatorWithFlattening`` makes, over a causal or
  sliding-window mask) keep their sequence ids (``HFMask.segments``) and run through
  :func:`attnzoo.attention_varlen`: each sequence alone, no ``[Nq, Nk]`` mask. Any other mask
  function (user ``or``/``and`` overlays) falls back to transformers' dense bool mask.
* GQA: key/value arrive with ``Hkv`` heads and are passed as they are (no ``repeat_kv``).
* ``scaling``, ``softcap``, ``dropout`` (the model passes 0 at eval), attention sinks
  (``s_aux``, or ``sinks`` per head or per query), T5's relative ``position_bias`` (added to the
  mask). Every other keyword is either known not to change the attention (``position_ids``,
  cache flags, flash-attention's varlen metadata: :data:`NEUTRAL_KEYWORDS`) or refused with a
  ``NotImplementedError`` naming it, never ignored (docs/huggingface.md lists the families).
* Decoding with a ``DynamicCache`` (also its sliding-window layers): queries sit at the cache's
  query offset relative to the first cached key, which is attnzoo's bottom-right default.

Difference from ``eager``: a query row that sees no key at all (a left-padding position)
returns zeros here, where eager averages the values of the masked keys. Only padding positions
have such rows; every real token's output is the same.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnzoo import hf_kernels
from attnzoo import masks as az_masks
from attnzoo.functional.softmax.attention import attention
from attnzoo.functional.softmax.varlen import attention_varlen

#: registered name -> attnzoo backend
BACKEND_BY_NAME: dict[str, str] = {
    "attnzoo": "auto",
    "attnzoo_tiled": "tiled",
    "attnzoo_sdpa": "sdpa",
    "attnzoo_reference": "reference",
}



@dataclass(frozen=True)
class HFMask:
    """A transformers mask kept as structure (what the ``attnzoo*`` mask interface returns).

    Attributes:
        causal: key ``j`` visible to the query at position ``p`` iff ``j <= p``.
        sliding_window: transformers' ``W`` (the query and the ``W - 1`` keys before it), or None.
        padding: bool ``[B, Nk]``, True for real keys; None when no key is padding.
        q_offset: position of the first query relative to the first key of this layer's K/V.
        q_length: ``Nq``; kv_length: ``Nk`` the attention function will receive.
        structure: a position pattern replacing ``causal`` / ``sliding_window`` (chunked,
            blockwise), or None.
        segments: long ``[B, N]`` sequence ids of packed rows (``Nq == Nk == N``, keys and queries
            the same tokens): a query sees only keys of its own sequence; None when not packed.

    ``ndim`` and ``shape`` describe the dense mask it stands for (``[B or 1, 1, Nq, Nk]``), so
    model code that inspects a prepared 4D mask (generation with static caches hands the masks
    built by ``create_masks_for_generate`` back to the model) leaves it alone. Model code that
    works on the mask as a bool tensor (Qwen4-Exp's indexed attention reads ``dtype``, indexes it
    and ANDs its key selection in) gets the dense mask: ``dtype`` is ``torch.bool`` and ``&``,
    ``~`` and indexing act on :meth:`to_dense` (the attention then receives that tensor).
    """

    causal: bool
    sliding_window: int | None
    padding: Tensor | None
    q_offset: int
    q_length: int
    kv_length: int
    structure: az_masks.Mask | None = None
    segments: Tensor | None = None

    ndim = 4
    dtype = torch.bool

    @property
    def device(self) -> torch.device:
        """The device of the padding / segments (the CPU when the mask is pure structure)."""
        held = next((t for t in (self.padding, self.segments) if t is not None), None)
        return torch.device("cpu") if held is None else held.device

    def __and__(self, other: Tensor) -> Tensor:
        return self.to_dense() & other

    def __rand__(self, other: Tensor) -> Tensor:
        return other & self.to_dense()

    def __invert__(self) -> Tensor:
        return ~self.to_dense()

    def __getitem__(self, index: Any) -> Tensor:
        return self.to_dense()[index]

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """A torch function given the mask computes on its dense form (Falcon's ALiBi path turns the
        mask into an additive bias with ``torch.where(mask, 0, min)``)."""
        def dense(x: Any) -> Any:
            if isinstance(x, HFMask):
                return x.to_dense()
            if isinstance(x, (list, tuple)):
                return type(x)(dense(v) for v in x)
            return x

        return func(*dense(args), **{k: dense(v) for k, v in (kwargs or {}).items()})

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B or 1, 1, Nq, Nk)`` of the dense mask this stands for."""
        if self.padding is not None or self.segments is not None:
            batch = (self.padding if self.padding is not None else self.segments).shape[0]
        else:
            batch = max([1] + [leaf.batch or 1 for leaf in self.structure._leaves()] if self.structure else [1])
        return (batch, 1, self.q_length, self.kv_length)

    @property
    def window(self) -> tuple[int, int] | None:
        """The attnzoo ``window=(left, right)`` of ``sliding_window`` (causal)."""
        return None if self.sliding_window is None else (self.sliding_window - 1, 0)

    def to_dense(self) -> Tensor:
        """Bool ``[B or 1, 1, Nq, Nk]`` (True = may attend), for tools that need a tensor."""
        q_length = self.q_length
        dev = next((t.device for t in (self.padding, self.segments) if t is not None), None)
        qp = torch.arange(q_length, device=dev).view(-1, 1) + self.q_offset  # [Nq, 1]
        kp = torch.arange(self.kv_length, device=dev).view(1, -1)  # [1, Nk]
        ok = torch.ones(q_length, self.kv_length, dtype=torch.bool, device=dev)
        if self.causal:
            ok = ok & (kp <= qp)
        if self.sliding_window is not None:
            ok = ok & (kp > qp - self.sliding_window)
        ok = ok[None, None]
        if self.structure is not None:
            ok = ok & self.structure.materialize(self.shape[0], 1, q_length, self.kv_length, q_offset=self.q_offset,
                                                 device=dev)
        if self.padding is not None:
            ok = ok & self.padding[:, None, None, :]
        if self.segments is not None:
            ok = ok & (self.segments[:, None, :, None] == self.segments[:, None, None, :])
        return ok

    def cu_seqlens(self) -> Tensor:
        """int32 ``[S+1]`` boundaries of the packed sequences over the ``B * N`` flattened tokens
        (a sequence never spans two rows), for :func:`attnzoo.attention_varlen`."""
        seg = self.segments
        if seg is None:
            raise ValueError("attnzoo: cu_seqlens() needs a packed mask (segments), got segments=None")
        rows, n = seg.shape
        new = torch.ones(rows, n, dtype=torch.bool, device=seg.device)
        new[:, 1:] = seg[:, 1:] != seg[:, :-1]  # each row starts a sequence
        starts = new.reshape(-1).nonzero().reshape(-1)
        end = torch.tensor([rows * n], device=seg.device)
        return torch.cat([starts, end]).to(torch.int32)


# ----------------------------------------------------------------------------- mask side


def _closure_value(fn: Callable, name: str) -> Any:
    return inspect.getclosurevars(fn).nonlocals.get(name)


def _classify(mask_function: Callable) -> tuple[bool, int | None] | None:
    """``(causal, sliding_window)`` of a transformers mask function, None if not recognised."""
    from transformers import masking_utils as mu

    if mask_function is mu.causal_mask_function:
        return True, None
    if mask_function is mu.bidirectional_mask_function:
        return False, None
    and_code = mu.and_masks(mu.causal_mask_function).__code__
    overlay_code = mu.sliding_window_overlay(1).__code__
    if getattr(mask_function, "__code__", None) is not and_code:
        return None
    parts = _closure_value(mask_function, "mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2 or parts[1] is not mu.causal_mask_function:
        return None
    if getattr(parts[0], "__code__", None) is not overlay_code:
        return None
    w = _closure_value(parts[0], "sliding_window")
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        return None
    return True, w


def _structured(mask_function: Callable, kv_offset: int) -> az_masks.Mask | None:
    """transformers' chunked causal mask (``and_masks(chunked_overlay, causal)``) or blockwise
    overlay (``or_masks(causal or sliding-window causal, blockwise_overlay(ids))``) as a Mask over
    attnzoo positions (keys from 0: transformers' index minus ``kv_offset``), None otherwise."""
    from transformers import masking_utils as mu

    code = getattr(mask_function, "__code__", None)
    parts = _closure_value(mask_function, "mask_functions") if code is not None else None
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    if code is mu.and_masks(mu.causal_mask_function).__code__ and parts[1] is mu.causal_mask_function \
            and getattr(parts[0], "__code__", None) is mu.chunked_overlay(1, torch.zeros(1)).__code__:
        size, pad = _closure_value(parts[0], "chunk_size"), _closure_value(parts[0], "left_padding")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or not isinstance(pad, Tensor):
            return None
        return az_masks.causal() & az_masks.chunked(size, start=pad.reshape(-1).long() - kv_offset)
    if code is mu.or_masks(mu.causal_mask_function).__code__ \
            and getattr(parts[1], "__code__", None) is mu.blockwise_overlay(torch.zeros(1, 1)).__code__:
        base, ids = _classify(parts[0]), _closure_value(parts[1], "block_sequence_ids")
        if base is None or not isinstance(ids, Tensor) or ids.dim() != 2:
            return None
        causal, window = base
        pattern = az_masks.causal() if causal else None
        if window is not None:
            w = az_masks.sliding_window(window - 1, 0)
            pattern = w if pattern is None else pattern & w
        blocks = az_masks.blockwise(ids[:, kv_offset:])
        return blocks if pattern is None else pattern | blocks
    return None


def _packed(mask_function: Callable) -> tuple[Callable, Tensor] | None:
    """``(base mask function, sequence ids [B, N])`` of transformers' packed-sequence mask
    (``and_masks(remap_positions_for_packed_sequence(base, position_ids),
    packed_sequence_mask_function(ids))``), None otherwise."""
    from transformers import masking_utils as mu

    if getattr(mask_function, "__code__", None) is not mu.and_masks(mu.causal_mask_function).__code__:
        return None
    parts = _closure_value(mask_function, "mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    remap, same = parts
    ids = _closure_value(same, "packed_sequence_mask") if callable(same) else None
    if getattr(same, "__code__", None) is not mu.packed_sequence_mask_function(torch.zeros(1, 1)).__code__ \
            or getattr(remap, "__code__", None) is not mu.remap_positions_for_packed_sequence(
                mu.causal_mask_function, torch.zeros(1, 1)).__code__ \
            or not isinstance(ids, Tensor) or ids.dim() != 2:
        return None
    base = _closure_value(remap, "mask_function")
    return (base, ids) if callable(base) else None


def _padding(attention_mask: Tensor | None, kv_length: int, kv_offset: int) -> Tensor | None:
    """The layer's slice ``[B, Nk]`` of transformers' 2D padding mask, None if nothing is padded."""
    if attention_mask is None:
        return None
    pad = attention_mask.to(torch.bool)
    missing = kv_offset + kv_length - pad.shape[-1]
    if missing > 0:  # transformers pads the 2D mask with False on the right (static caches)
        pad = torch.nn.functional.pad(pad, (0, missing), value=False)
    pad = pad[:, kv_offset:kv_offset + kv_length]
    return None if bool(pad.all()) else pad


def attnzoo_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | None = None,
    **kwargs: Any,
) -> HFMask | Tensor | None:
    """transformers mask-interface function: the mask as an :class:`HFMask` where possible.

    Args follow ``transformers.masking_utils.sdpa_mask``: the layer sees ``q_length`` queries at
    absolute positions ``q_offset ..`` and ``kv_length`` keys at ``kv_offset ..``;
    ``attention_mask`` is the 2D ``[B, total]`` padding mask (True = real token).

    Returns:
        :class:`HFMask` for causal / bidirectional / sliding-window masks (explicit, so a decoder
        run bidirectionally through ``config.is_causal=False`` is not made causal by its
        modules' ``is_causal``); otherwise transformers' dense bool mask ``[B, 1, Nq, Nk]``.
    """
    from transformers import masking_utils as mu

    if isinstance(attention_mask, HFMask):  # already prepared (static-cache generation)
        return attention_mask
    fn = mu.causal_mask_function if mask_function is None else mask_function
    packed = None if kwargs.get("use_vmap") else _packed(fn)
    kind = None if packed is None else _classify(packed[0])
    if kind is not None and packed is not None and packed[1].shape[-1] == q_length == kv_length \
            and int(q_offset) == int(kv_offset) == 0 and _padding(attention_mask, kv_length, kv_offset) is None:
        causal, window = kind
        return HFMask(causal=causal, sliding_window=window, padding=None, q_offset=0, q_length=int(q_length),
                      kv_length=int(kv_length), segments=packed[1].expand(batch_size, -1).long())
    kind = None if kwargs.get("use_vmap") else _classify(fn)
    structure = None if kind is not None or kwargs.get("use_vmap") else _structured(fn, int(kv_offset))
    if structure is not None:
        return HFMask(causal=False, sliding_window=None, padding=_padding(attention_mask, kv_length, kv_offset),
                      q_offset=int(q_offset) - int(kv_offset), q_length=int(q_length), kv_length=int(kv_length),
                      structure=structure)
    if kind is None:
        kwargs.pop("allow_is_causal_skip", None)
        kwargs.pop("allow_is_bidirectional_skip", None)
        return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                            q_offset=q_offset, kv_offset=kv_offset, mask_function=fn,
                            attention_mask=attention_mask, allow_is_causal_skip=False,
                            allow_is_bidirectional_skip=False, **kwargs)
    causal, window = kind
    pad = _padding(attention_mask, kv_length, kv_offset)
    return HFMask(causal=causal, sliding_window=window, padding=pad,
                  q_offset=int(q_offset) - int(kv_offset), q_length=int(q_length), kv_length=int(kv_length))


# ------------------------------------------------------------------------ attention side


def _mask_arguments(module: torch.nn.Module, key: Tensor, attention_mask: Any,
                    kwargs: dict[str, Any]) -> dict[str, Any]:
    """``mask``, ``causal``, ``window``, ``q_offset`` for az.attention from what the model passed."""
    nk = key.shape[2]
    if isinstance(attention_mask, HFMask):
        if attention_mask.kv_length != nk:
            raise ValueError(f"attnzoo: the mask was built for {attention_mask.kv_length} keys but the "
                             f"attention received {nk} (key shape {tuple(key.shape)})")
        pad = attention_mask.padding
        if attention_mask.segments is not None:  # packed, not served by attention_varlen here: dense
            return {"mask": attention_mask.to_dense(), "causal": False, "window": None, "q_offset": None}
        if attention_mask.structure is not None:  # chunked / blockwise: the Mask, AND the key padding
            m = attention_mask.structure
            return {"mask": m if pad is None else m & az_masks.key_padding(pad), "causal": False, "window": None,
                    "q_offset": attention_mask.q_offset}
        return {"mask": None if pad is None else pad[:, None, None, :],  # [B, 1, 1, Nk]
                "causal": attention_mask.causal, "window": attention_mask.window,
                "q_offset": attention_mask.q_offset}
    if isinstance(attention_mask, Tensor):
        if attention_mask.dim() != 4:
            raise ValueError(f"attnzoo: attention_mask must be 4D [B, 1, Nq, Nk], got shape "
                             f"{tuple(attention_mask.shape)}")
        return {"mask": attention_mask[..., :nk], "causal": False, "window": None, "q_offset": None}
    if attention_mask is not None:
        raise TypeError(f"attnzoo: unsupported attention_mask of type {type(attention_mask).__name__}")
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    w = kwargs.get("sliding_window")
    window = (int(w) - 1, 0) if causal and w is not None else None
    return {"mask": None, "causal": causal, "window": window, "q_offset": None}


#: Keywords the attention function serves (what transformers' own ``sdpa`` serves, plus softcap and
#: sinks): they change the attention and reach :func:`attnzoo.attention`.
SERVED_KEYWORDS: frozenset[str] = frozenset({
    "softcap", "s_aux", "sinks", "position_bias", "sliding_window", "is_causal", "output_attentions"})

#: Keywords that models forward to every attention function but that do not change the attention
#: of the query/key/value/mask it receives (transformers' ``sdpa`` ignores them too): positions
#: already applied by RoPE, cache and output flags, and flash-attention's varlen metadata (packed
#: sequences reach attnzoo as the mask transformers builds from ``position_ids``: an
#: :class:`HFMask` with ``segments``, run through :func:`attnzoo.attention_varlen`).
NEUTRAL_KEYWORDS: frozenset[str] = frozenset({
    "position_ids", "cache_position", "use_cache", "past_key_values", "past_key_value", "cache",
    "output_hidden_states", "output_router_logits", "return_dict", "num_items_in_batch",
    "encoder_hidden_states", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
    "seq_idx", "deterministic", "layer_idx", "token_type_ids"})


def _check_keywords(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse, by name, every keyword this function would otherwise have to ignore."""
    unknown = sorted(k for k, v in kwargs.items()
                     if k not in SERVED_KEYWORDS and k not in NEUTRAL_KEYWORDS and v is not None)
    if unknown:
        raise NotImplementedError(
            f"attnzoo: {type(module).__name__} passed {', '.join(map(repr, unknown))} to the attention "
            f"function, which attnzoo does not serve (it would be ignored and the result wrong); "
            f"served: {', '.join(sorted(SERVED_KEYWORDS))}. Use attn_implementation='eager' or 'sdpa' "
            f"for this model")


def _with_bias(extra: dict[str, Any], bias: Tensor) -> None:
    """Add the float ``bias`` (``position_bias``, broadcastable to ``[B, Hq, Nq, Nk]``) to the mask.

    A bool mask becomes ``bias`` with ``-inf`` where it hides a key; a float mask is added to it
    (transformers' ``sdpa`` and ``eager`` add ``position_bias`` to the mask the same way)."""
    if not isinstance(bias, Tensor) or not bias.is_floating_point() or bias.dim() != 4:
        raise TypeError(f"attnzoo: position_bias must be a float tensor [B or 1, H, Nq, Nk], got "
                        f"{type(bias).__name__}{tuple(bias.shape) if isinstance(bias, Tensor) else ''}")
    m = extra["mask"]
    if m is None:
        extra["mask"] = bias
    elif m.dtype == torch.bool:
        extra["mask"] = bias.masked_fill(~m, float("-inf"))
    else:
        extra["mask"] = bias + m


def _query_sinks(sinks: Any, query: Tensor) -> Tensor | None:
    """Per-query sink logits ``[B, Hq, Nq]`` from ``sinks=`` (``[B, Hq, Nq]`` or ``[B, Hq, Nq, 1]``),
    or None when ``sinks`` is per head ``[Hq]`` (served by ``attention(..., sinks=)`` directly)."""
    B, Hq, Nq = query.shape[:3]
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
        raise TypeError(f"attnzoo: sinks must be a float tensor [Hq] or [B, Hq, Nq, 1], got "
                        f"{type(sinks).__name__}")
    if sinks.dim() == 1:
        return None
    z = sinks.squeeze(-1) if sinks.dim() == 4 and sinks.shape[-1] == 1 else sinks
    if z.dim() != 3 or any(g not in (1, w) for g, w in zip(z.shape, (B, Hq, Nq), strict=True)):
        raise ValueError(f"attnzoo: sinks must have shape [Hq] or [B, Hq, Nq, 1] = [{B}, {Hq}, {Nq}, 1], "
                         f"got {tuple(sinks.shape)}")
    return z


def attnzoo_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: HFMask | Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    backend: str = "auto",
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """transformers attention-interface function running :func:`attnzoo.attention`.

    Args:
        module: the calling ``*Attention`` module (``is_causal`` is read when no mask is given).
        query: ``[B, Hq, Nq, D]``; key ``[B, Hkv, Nk, D]``; value ``[B, Hkv, Nk, Dv]``.
        attention_mask: an :class:`HFMask`, a bool/float ``[B, 1, Nq, Nk]`` tensor, or None.
        scaling: score scale (default ``1/sqrt(D)``); dropout: attention dropout probability.
        backend: the attnzoo backend.
        kwargs: served (:data:`SERVED_KEYWORDS`): ``softcap``; ``position_bias`` (a float
            ``[B or 1, H, Nq, Nk]`` added to the scores: T5's relative bias); ``s_aux`` / ``sinks``
            (sink logits ``[Hq]``, or per query ``[B, Hq, Nq, 1]``); ``sliding_window`` and
            ``is_causal`` (used only without a mask); ``output_attentions``. Keywords in
            :data:`NEUTRAL_KEYWORDS` do not change the attention. Any other keyword with a value
            is refused (``NotImplementedError`` naming it), never ignored.

    Returns:
        ``(out [B, Nq, Hq, Dv], weights [B, Hq, Nq, Nk] or None)``.
    """
    _check_keywords(module, kwargs)
    if isinstance(attention_mask, HFMask) and attention_mask.segments is not None:
        packed = _packed_forward(query, key, value, attention_mask, scaling, dropout, backend, kwargs)
        if packed is not None:
            return packed, None
    extra: dict[str, Any] = _mask_arguments(module, key, attention_mask, kwargs)
    if kwargs.get("position_bias") is not None:
        _with_bias(extra, kwargs["position_bias"])
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    per_query = None if sinks is None else _query_sinks(sinks, query)
    if sinks is not None and per_query is None:
        extra["sinks"] = sinks
    want_weights = bool(kwargs.get("output_attentions"))
    name = "reference" if want_weights else backend
    if per_query is not None and name == "sdpa":
        raise NotImplementedError("attnzoo: per-query sinks need the attention's log-sum-exp, which "
                                  "torch SDPA does not return; use attn_implementation='attnzoo'")
    result = attention(query, key, value, scale=scaling, softcap=kwargs.get("softcap"),
                       dropout_p=float(dropout or 0.0), return_weights=want_weights,
                       return_lse=per_query is not None, backend=name, **extra)
    parts = list(result) if isinstance(result, tuple) else [result]
    out, weights = parts[0], (parts[-1] if want_weights else None)
    if per_query is not None:  # softmax over the visible scores and one sink logit per query row
        lse = parts[1]
        kept = torch.exp(lse - torch.logaddexp(lse, per_query.to(lse.dtype))).unsqueeze(-1)
        out = (out.to(kept.dtype) * kept).to(out.dtype)  # [B, Hq, Nq, Dv]
        weights = None if weights is None else weights * kept.to(weights.dtype)
    return out.transpose(1, 2).contiguous(), weights  # [B, Nq, Hq, Dv]


def _packed_forward(query: Tensor, key: Tensor, value: Tensor, mask: HFMask, scaling: float | None,
                    dropout: float, backend: str, kwargs: dict[str, Any]) -> Tensor | None:
    """Packed rows through :func:`attnzoo.attention_varlen` (``[B, Nq, Hq, Dv]``), or None when the
    call asks for what the packed path does not serve (weights, dropout, a position bias, per-query
    sinks, a key length other than the mask's): the caller then uses the dense mask."""
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    if kwargs.get("output_attentions") or float(dropout or 0.0) != 0.0 or kwargs.get("position_bias") is not None \
            or (sinks is not None and (not isinstance(sinks, Tensor) or sinks.dim() != 1)) \
            or key.shape[2] != mask.kv_length or query.shape[2] != mask.q_length:
        return None
    B, Hq, N, _ = query.shape
    cu = mask.cu_seqlens().to(query.device)
    flat = [t.transpose(1, 2).reshape(B * N, t.shape[1], t.shape[-1]) for t in (query, key, value)]  # [T, H, D]
    out = attention_varlen(*flat, cu, cu, causal=mask.causal, window=mask.window, softcap=kwargs.get("softcap"),
                           scale=scaling, sinks=sinks, backend=backend)
    return out.reshape(B, N, Hq, value.shape[-1])  # [B, Nq, Hq, Dv]


def _forward_for(backend: str) -> Callable[..., tuple[Tensor, Tensor | None]]:
    def forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: HFMask | Tensor | None, scaling: float | None = None,
                dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        return attnzoo_attention_forward(module, query, key, value, attention_mask, scaling,
                                         dropout, backend=backend, **kwargs)

    forward.__name__ = f"attnzoo_{backend}_attention_forward"
    return forward


_FORWARDS = {name: _forward_for(backend) for name, backend in BACKEND_BY_NAME.items()}


def register() -> tuple[str, ...]:
    """Register attnzoo with transformers' attention and mask interfaces (idempotent).

    Returns:
        the registered names: ``"attnzoo"`` (auto backend), ``"attnzoo_tiled"``,
        ``"attnzoo_sdpa"``, ``"attnzoo_reference"``.

    Raises:
        ImportError: transformers is not installed, or too old to have an attention interface.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("attnzoo.hf.register() needs transformers >= 4.56 "
                          "(pip install transformers)") from e
    for name, fn in _FORWARDS.items():
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, attnzoo_mask)
    hf_kernels.install()  # the linear-attention kernel hooks of the hybrid models (attnzoo.hf_kernels)
    return tuple(_FORWARDS)
