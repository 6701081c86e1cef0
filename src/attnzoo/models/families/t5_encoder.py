"""T5, mT5 and UMT5 encoders (``t5``, ``mt5``, ``umt5``) -> :class:`~attnzoo.TransformerEncoder`: the
text encoders of Flux / SD3 / many diffusion pipelines and of sentence-T5, as ``T5EncoderModel``,
``MT5EncoderModel`` and ``UMT5EncoderModel``. Line numbers: transformers 5.25's
``models/t5/modeling_t5.py`` (mT5's ``modeling_mt5.py`` is the same code; UMT5's
``models/umt5/modeling_umt5.py`` where it differs).

The encoder is the token embedding ``shared`` (no scale, no positions), ``num_layers`` pre-norm
blocks and ``final_layer_norm`` (T5Stack, 644-752):

* RMS norm without mean subtraction or bias, the mean square in float32 (T5LayerNorm, 51-73):
  :class:`~attnzoo.blocks.RMSNorm` rounds as it does in half precision.
* attention without the ``1/sqrt(d)`` scale (folded into the initialisation, 196-198), heads of
  ``d_kv`` channels whatever ``d_model`` is, no biases anywhere, plus a learned relative position
  bias over bidirectional log buckets (``relative_attention_num_buckets``,
  ``relative_attention_max_distance``; 218-280): :class:`RelativePositionBias`. T5 and mT5 compute
  it in the first layer and share it with every layer (652, 740-741); UMT5 gives each layer its own
  (UMT5LayerSelfAttention, 374-381).
* ``feed_forward_proj``: ``"{act}"`` (T5 v1.0: ``relu``) or ``"gated-{act}"`` (T5 v1.1 / mT5 / UMT5:
  ``gated-gelu``, which is ``gelu_new``: tanh-approximated; configuration ``__post_init__``), as
  ``wo(act(wi(x)))`` / ``wo(act(wi_0(x)) * wi_1(x))`` (76-124).
* in float16, the hidden states clamped after each sub-layer (``T5Block``, 471-512): to
  ``±finfo.max`` (no change) unless a value overflowed, then to ``±(finfo.max - 1000)``
  (:class:`ClampedBlock`).

Padding: transformers adds the key-padding mask to the scores of every query, padded queries
included; relative positions are the tokens' indices, so left and right padding are alike for the
real tokens. ``encode()`` (mean over the real tokens) is sentence-T5's pooling.

The seq2seq models with their decoder (``T5ForConditionalGeneration``, ``T5Model``) are converted by
``families/t5.py``, which dispatches the three model types and hands the encoder-only checkpoints
to :func:`convert_t5_encoder` (which refuses the seq2seq ones). Refused by name:
``T5ForQuestionAnswering``, ``T5ForSequenceClassification`` (task heads on the seq2seq model),
``T5ForTokenClassification`` (a per-token head), ``is_decoder=True`` (a causal stack alone),
activations without an attnzoo feed-forward (``gated-relu``, ...), bucket settings whose
log buckets are undefined (fewer than 2 exact buckets, ``max_distance`` not above them).

Half precision: transformers' ``from_pretrained(dtype=torch.float16)`` keeps every ``wo`` in float32
(``_keep_in_fp32_modules``, 542): its residual stream is float32 from the first feed-forward on.
attnzoo converts the model to one dtype (a float16 model runs all in float16, with the clamp);
``model.half()`` in transformers is what it matches.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
from attnzoo._validate import check_bool, check_int
from attnzoo.blocks import BlockCache, BlockLayers, FeedForward, TransformerBlock
from attnzoo.masks import Mask
from attnzoo.models.config import EncoderConfig
from attnzoo.models.encoder import TransformerEncoder
from attnzoo.models.hf._state import HFConfig, float_dtype, load_qkv_into
from attnzoo.models.parts import EncoderParts
from attnzoo.nn.attention import MultiHeadAttention, build_softmax
from attnzoo.nn.cache import KVCache, SlidingWindowKVCache
from attnzoo.nn.frontier import packed_cu_seqlens
from attnzoo.nn.parts import AttentionParts
from attnzoo.nn.positional import resolve_positions

__all__ = ["ACTIVATIONS", "DEFAULTS", "DISPATCH", "ClampedBlock", "RelativeBiasAttention", "RelativePositionBias",
           "build_t5_encoder", "clamp_overflow", "convert_t5_encoder", "feed_forward_activation",
           "relative_position_buckets"]

#: ``feed_forward_proj`` -> :class:`~attnzoo.FeedForward` activation (``gated-gelu`` is ``gelu_new``)
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "silu": "silu", "swish": "silu", "gated-gelu": "geglu_tanh", "gated-gelu_new": "geglu_tanh",
               "gated-gelu_pytorch_tanh": "geglu_tanh", "gated-silu": "swiglu", "gated-swish": "swiglu"}
_COMMON = {"d_kv": 64, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
           "layer_norm_epsilon": 1e-6, "is_decoder": False}
#: each config class's defaults of the keys read here (a ``config.json`` may leave them out)
DEFAULTS: dict[str, dict[str, Any]] = {
    "t5": {**_COMMON, "vocab_size": 32128, "d_model": 512, "d_ff": 2048, "num_layers": 6, "num_heads": 8,
           "feed_forward_proj": "relu"},
    "mt5": {**_COMMON, "vocab_size": 250112, "d_model": 512, "d_ff": 1024, "num_layers": 8, "num_heads": 6,
            "feed_forward_proj": "gated-gelu"},
    "umt5": {**_COMMON, "vocab_size": 250112, "d_model": 512, "d_ff": 1024, "num_layers": 8, "num_heads": 6,
             "feed_forward_proj": "gated-gelu"}}


def relative_position_buckets(relative_position: Tensor, *, num_buckets: int = 32, max_distance: int = 128,
                              bidirectional: bool = True) -> Tensor:
    """The T5 bucket (Raffel et al. 2020; Mesh TensorFlow's ``_relative_position_bucket``) of each
    relative position ``r = key_position - query_position``.

    Bidirectional: half of the ``num_buckets`` for keys before or at the query, half (offset by
    ``num_buckets // 2``) for keys after it, ``n = |r|``; causal: ``n = max(-r, 0)`` (keys after the
    query share bucket 0 with ``r = 0``). With ``b`` the buckets of one side and ``e = b // 2``, the
    distance ``n`` goes to bucket ``n`` when ``n < e`` (exact), else to
    ``min(b - 1, e + floor(log(n / e) / log(max_distance / e) * (b - e)))`` (log-spaced up to
    ``max_distance``, all farther distances in the last bucket); computed in float32 as the
    reference does, so the bucket boundaries match it.

    Args:
        relative_position: int tensor of any shape (``[Nq, Nk]``, ``[B, Nq, Nk]``).
        num_buckets: buckets in all (both sides when ``bidirectional``).
        max_distance: the distance from which every position shares the last bucket; ``> e``.
        bidirectional: keys on both sides (an encoder) or only before the query (causal).

    Returns: int64 tensor of the same shape, values in ``[0, num_buckets)``.
    """
    check_bool(bidirectional, "bidirectional", "relative_position_buckets")
    side = check_int(num_buckets, "num_buckets", "relative_position_buckets") // (2 if bidirectional else 1)
    exact = side // 2
    if exact < 1 or check_int(max_distance, "max_distance", "relative_position_buckets") <= exact:
        raise ValueError(f"relative_position_buckets: needs at least 2 buckets per side and max_distance > "
                         f"{exact} (half of them), got num_buckets={num_buckets}, max_distance={max_distance}, "
                         f"bidirectional={bidirectional}")
    r = relative_position.long()
    if bidirectional:
        offset = (r > 0).long() * side
        n = r.abs()
    else:
        offset = torch.zeros_like(r)
        n = (-r).clamp(min=0)
    far = torch.log(n.clamp(min=exact).float() / exact) / math.log(max_distance / exact) * (side - exact)
    far = (exact + far.long()).clamp(max=side - 1)
    return offset + torch.where(n < exact, n, far)


class RelativePositionBias(nn.Module):
    """T5's learned relative position bias: one scalar per head and bucket of
    :func:`relative_position_buckets`, added to the attention scores,
    ``bias[b, h, i, j] = weight[bucket(k_j - q_i), h]`` for query positions ``q`` and key positions ``k``.

    Args:
        num_buckets, max_distance, bidirectional: the buckets (see :func:`relative_position_buckets`).
        num_heads: heads ``H``.

    Weight: ``weight [num_buckets, H]`` (transformers' ``relative_attention_bias.weight``).
    Shapes: ``forward(query_positions [Nq] | [B, Nq], key_positions [Nk] | [B, Nk])`` -> ``[1, H, Nq, Nk]``
    (``[B, H, Nq, Nk]`` for per-row positions), in the weight's dtype.
    """

    def __init__(self, num_buckets: int, num_heads: int, *, max_distance: int = 128, bidirectional: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_buckets = check_int(num_buckets, "num_buckets", "RelativePositionBias")
        self.num_heads = check_int(num_heads, "num_heads", "RelativePositionBias")
        self.max_distance = check_int(max_distance, "max_distance", "RelativePositionBias")
        self.bidirectional = check_bool(bidirectional, "bidirectional", "RelativePositionBias")
        relative_position_buckets(torch.zeros(1, dtype=torch.long), num_buckets=num_buckets,
                                  max_distance=max_distance, bidirectional=bidirectional)  # the settings' check
        self.weight = nn.Parameter(torch.zeros(num_buckets, num_heads, device=device, dtype=dtype))

    def slots(self, start: int, n: int, *, device: torch.device, dtype: torch.dtype) -> Tensor:
        """The bias ``[1, H, n, start + n]`` of the query slots ``start .. start + n - 1`` against the key
        slots ``0 .. start + n - 1`` (a layer's tokens, after ``start`` cached ones), in ``dtype``.
        Without gradients the last result is kept and returned again while its arguments, the
        weight's version and the inference mode are the same: the layers sharing this module (T5's
        first-layer bias) compute it once per step, as transformers does."""
        key = (start, n, device, dtype, self.weight._version, torch.is_inference_mode_enabled())
        memo = self.__dict__.get("_memo")
        if memo is not None and memo[0] == key:
            return memo[1]
        out = self(torch.arange(start, start + n, device=device), torch.arange(start + n, device=device)).to(dtype)
        self.__dict__["_memo"] = None if torch.is_grad_enabled() else (key, out)
        return out  # [1, H, n, start + n]

    def forward(self, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        rel = key_positions[..., None, :] - query_positions[..., :, None]  # [Nq, Nk] or [B, Nq, Nk]
        buckets = relative_position_buckets(rel, num_buckets=self.num_buckets, max_distance=self.max_distance,
                                            bidirectional=self.bidirectional)
        bias = self.weight[buckets].movedim(-1, -3)  # [.., H, Nq, Nk]
        return bias if bias.dim() == 4 else bias[None]

    def extra_repr(self) -> str:
        return (f"num_buckets={self.num_buckets}, num_heads={self.num_heads}, max_distance={self.max_distance}, "
                f"bidirectional={self.bidirectional}")


def _with_bias(bias: Tensor, mask: Tensor | Mask | None) -> Tensor:
    """``bias [1|B, H, Nq, Nk]`` plus an attention mask (bool True = may attend: -inf elsewhere; float:
    added), broadcast to the mask's batch."""
    if mask is None:
        return bias
    if isinstance(mask, Mask) or not isinstance(mask, Tensor):
        raise TypeError(f"RelativeBiasAttention: mask must be a bool or float tensor (a relative bias is added "
                        f"to it), got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask


class RelativeBiasAttention(MultiHeadAttention):
    """:class:`~attnzoo.MultiHeadAttention` with a :class:`RelativePositionBias` added to its scores:
    ``softmax(scale * q k^T + bias + mask) v`` per head (T5: ``scale=1``, no projection biases).

    The bias module may be shared by several layers (T5: the first layer's, held by every layer; the
    shared weight is one parameter). Positions: the tokens' indices (``cache.length ..`` with a
    cache), or ``positions`` ``[N]`` / ``[B, N]`` given without a cache (queries and keys alike).

    Args:
        relative_bias: the bias module (its ``num_heads`` equal to ``num_heads``).
        the rest: as :class:`~attnzoo.MultiHeadAttention` (self-attention without rope: the bias is
            its positions; packed input, ``cu_seqlens``, with each sequence's own bias).

    Weights: ``qkv_proj``, ``out_proj`` and ``relative_bias.weight [num_buckets, H]``.
    Shapes: ``x [B, N, C] -> [B, N, C]``; ``mask`` broadcastable to ``[B, H, N, Nk]``.
    """

    def __init__(self, dim: int, num_heads: int, *, relative_bias: RelativePositionBias, num_kv_heads: int | None = None,
                 head_dim: int | None = None, bias: bool = True, causal: bool = False,
                 window: int | tuple[int | None, int | None] | None = None, dropout: float = 0.0,
                 backend: str = "auto", parts: AttentionParts | None = None) -> None:
        super().__init__(dim, num_heads, num_kv_heads, head_dim=head_dim, bias=bias, causal=causal, window=window,
                         dropout=dropout, backend=backend, parts=parts)
        if not isinstance(relative_bias, RelativePositionBias) or relative_bias.num_heads != self.num_heads:
            raise ValueError(f"RelativeBiasAttention: relative_bias must be a RelativePositionBias of "
                             f"{self.num_heads} heads, got {relative_bias!r}")
        self.relative_bias = relative_bias

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | Mask | None = None,
                cache: KVCache | SlidingWindowKVCache | None = None, positions: Tensor | None = None,
                return_weights: bool = False, cu_seqlens: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """As :meth:`MultiHeadAttention.forward` (``context`` not taken), the relative bias added to
        ``mask``. Packed sequences (``cu_seqlens``, :meth:`_packed_relative`): the bias of every
        sequence from its own positions."""
        if context is not None:
            raise ValueError("RelativeBiasAttention: no cross-attention (context)")
        if cu_seqlens is not None:
            given = [n for n, v in (("mask", mask), ("cache", cache), ("positions", positions)) if v is not None]
            if given or return_weights:
                raise ValueError(f"RelativeBiasAttention: packed input (cu_seqlens) takes no "
                                 f"{given or ['return_weights']}")
            return self._packed_relative(x, cu_seqlens)
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise ValueError(f"RelativeBiasAttention: x must be [B, N, C], got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        if cache is not None and positions is not None:
            raise ValueError("RelativeBiasAttention: with a cache the positions are the cache's (positions=None)")
        B, N, _ = x.shape
        start = 0 if cache is None else int(cache.length)
        if positions is None:  # the tokens' slots: shared by the layers of one step
            table = self.relative_bias.slots(start, N, device=x.device, dtype=x.dtype)
        else:
            q_pos = resolve_positions(positions, N, start, x.device, batch=B)
            table = self.relative_bias(q_pos, q_pos).to(x.dtype)
        bias = _with_bias(table, mask)
        return super().forward(x, mask=bias, cache=cache, return_weights=return_weights)

    def _packed_relative(self, x: Tensor, cu_seqlens: object) -> Tensor:
        """Packed sequences ``x [1, T, C]`` (int32 ``cu_seqlens [S+1]``) -> ``[1, T, C]``, equal to
        each sequence alone. The bias depends on ``j - i`` only, so the sequences of one length ``n``
        share it: they run as one padded-free batch ``[G, n, C]`` through the unpacked path (one
        ``[H, n, n]`` bias table, the module's backend, dropout as usual), and their outputs go back
        to their packed rows."""
        cu = packed_cu_seqlens(cu_seqlens, x, "RelativeBiasAttention")
        bounds = cu.tolist()
        by_length: dict[int, list[int]] = {}
        for lo, hi in itertools.pairwise(bounds):
            if hi > lo:
                by_length.setdefault(hi - lo, []).append(lo)
        rows, outs = [], []
        for n, starts in by_length.items():
            idx = torch.tensor(starts, device=x.device)[:, None] + torch.arange(n, device=x.device)  # [G, n]
            outs.append(self(x[0, idx]).reshape(idx.numel(), -1))  # [G n, C]
            rows.append(idx.flatten())
        if not outs:  # no tokens
            return self(x)  # [1, 0, C]
        out = torch.cat(outs)  # [T, C] in group order
        return out.new_zeros(out.shape).index_copy(0, torch.cat(rows), out)[None]  # [1, T, C]


def clamp_overflow(x: Tensor) -> Tensor:
    """transformers' float16 guard of T5 (``T5Block``, 471-512): in float16, clamp ``x`` to
    ``±finfo.max`` — or to ``±(finfo.max - 1000)`` when any element is infinite — so that an overflow
    stays finite; other dtypes unchanged. Shapes: any."""
    if x.dtype != torch.float16:
        return x
    top = torch.finfo(torch.float16).max
    limit = torch.where(torch.isinf(x).any(), top - 1000.0, top)  # 0-dim: no host sync
    return torch.clamp(x, -limit, limit)


class ClampedBlock(TransformerBlock):
    """A pre-norm :class:`~attnzoo.TransformerBlock` (self-attention, optional cross-attention, feed-forward)
    whose residual stream goes through :func:`clamp_overflow` after each sub-layer:
    ``x = clamp(x + attn(norm(x)))``, (T5's decoder: ``x = clamp(x + cross_attn(norm(x), context))``),
    ``x = clamp(x + ffn(norm(x)))`` (a no-op outside float16).

    Build it as the block: ``ClampedBlock(C, layers=BlockLayers(attention=..., feed_forward=..., norm=...))``
    (``cross_attention=...`` for a decoder layer; its cache is then a :class:`~attnzoo.blocks.BlockCache`).
    Shapes: ``x [B, N, C] -> [B, N, C]``; ``key_padding [B, Nk]`` bool, True = real token;
    ``context [B, M, C]`` and ``context_mask`` (broadcastable to ``[B, H, N, M]``) with cross-attention.
    """

    #: a packed batch (``cu_seqlens``) is taken: :attr:`~attnzoo.TransformerEncoder.packable` reads it
    takes_packed = True

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Any = None,
                key_padding: Tensor | None = None, context_mask: Any = None, cache: Any = None,
                positions: Tensor | None = None, cu_seqlens: Tensor | None = None,
                context_cu_seqlens: Tensor | None = None) -> Tensor:
        """As :meth:`~attnzoo.TransformerBlock.forward`. Packed sequences (``cu_seqlens``, with
        ``context_cu_seqlens`` for a decoder layer's packed pairs) run in float32 / bfloat16; in float16
        they are refused (``ValueError``): the clamp's limit depends on whether any value of the whole
        batch overflowed, padding included, which a packed batch does not hold."""
        if self.cross_attn is None:
            mask = self._self_only(x, context, context_mask, mask, key_padding)
            context_cu_seqlens = self._check_context(x, context, context_cu_seqlens, cu_seqlens)
        elif not isinstance(context, Tensor):
            raise ValueError("ClampedBlock: this block has cross-attention; pass context [B, M, C]")
        else:
            mask = self._self_mask(mask, key_padding)
            context_cu_seqlens = self._check_context(x, context, context_cu_seqlens, cu_seqlens)
        if not self.norm_first or self.ffn is None or self.ffn_norm is None:
            raise ValueError("ClampedBlock: a pre-norm block with a feed-forward")
        if cu_seqlens is not None and x.dtype == torch.float16:
            raise ValueError("ClampedBlock: packed input (cu_seqlens) is not taken in float16: T5's overflow clamp "
                             "looks at the whole batch (padding included), which packing cannot reproduce; run the "
                             "model in float32 or bfloat16, or pad the batch")
        cross_cache = None
        if isinstance(cache, BlockCache):  # a decoder layer: the context's keys/values cached beside its own
            cross_cache = cache.cross(self.cross_attn, context)
            cache = cache.self_cache
        h = self._mix(self.attn_norm(x), mask, cache, positions, cu_seqlens)
        x = clamp_overflow(x + self.dropout(self.attn_out_norm(h)))
        if self.cross_attn is not None and self.cross_norm is not None:
            h = self._cross(self.cross_norm(x), context, context_mask, cross_cache, (cu_seqlens, context_cu_seqlens))
            x = clamp_overflow(x + self.dropout(h))
        return clamp_overflow(x + self.dropout(self.ffn_out_norm(self.ffn(self.ffn_norm(x)))))


def feed_forward_activation(hf: HFConfig) -> str:
    """The :class:`~attnzoo.FeedForward` activation of ``feed_forward_proj`` (refused by name when
    attnzoo has none)."""
    return hf.activation("feed_forward_proj", ACTIVATIONS, "relu")


def _canonical(hf: HFConfig) -> HFConfig:
    """``hf`` with its config class's defaults (:data:`DEFAULTS`), the options that cannot be
    reproduced refused by name."""
    out = hf.with_defaults(DEFAULTS[hf.raw("model_type", "t5")])
    if out.get("is_decoder", False, bool):
        raise hf.unsupported("is_decoder=True (a causal T5 stack; the encoder is converted)")
    feed_forward_activation(out)
    try:
        RelativePositionBias(out.req("relative_attention_num_buckets"), 1,
                             max_distance=out.req("relative_attention_max_distance"), device="meta")
    except ValueError as exc:
        raise hf.unsupported(f"relative_attention_num_buckets={out.raw('relative_attention_num_buckets')!r} with "
                             f"relative_attention_max_distance={out.raw('relative_attention_max_distance')!r} "
                             f"({exc})") from exc
    return out


def build_t5_encoder(hf: HFConfig, *, per_layer_bias: bool, device: Any = None,
                     dtype: Any = None) -> TransformerEncoder:
    """The encoder of a T5 / mT5 / UMT5 config (random weights; see the module docstring):
    ``per_layer_bias`` gives each layer its own relative bias (UMT5), else the first layer's is
    shared by all."""
    hf = _canonical(hf)
    V, C, H, depth = hf.req("vocab_size"), hf.req("d_model"), hf.req("num_heads"), hf.req("num_layers")
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    bias = functools.partial(RelativePositionBias, hf.req("relative_attention_num_buckets"), H,
                             max_distance=hf.req("relative_attention_max_distance"), **kw)
    shared = bias()

    def attention(i: int) -> nn.Module:
        return build_softmax(RelativeBiasAttention, C, H, head_dim=hf.req("d_kv"), bias=False, causal=False,
                             scale=1.0, relative_bias=bias() if per_layer_bias and i else shared, **kw)

    ffn = functools.partial(FeedForward, C, hf.req("d_ff"), feed_forward_activation(hf), bias=False, **kw)
    norm = parts.rms_norm(C, hf.req("layer_norm_epsilon", float), **kw)
    blocks = [ClampedBlock(C, layers=BlockLayers(attention=functools.partial(attention, i), feed_forward=ffn,
                                                 norm=norm)) for i in range(depth)]
    # the given blocks carry T5's d_kv heads (mT5-small: 512 wide, 6 heads of 64): C % H need not be 0
    cfg = EncoderConfig(V, C, depth, H, pos="none", type_vocab_size=0, norm="rms",
                        norm_eps=hf.req("layer_norm_epsilon", float), norm_first=True)
    return TransformerEncoder(config=cfg, parts=EncoderParts(blocks=blocks), **kw)


def _refuse_heads(hf: HFConfig, sd: dict[str, Tensor]) -> None:
    """Refuse, by name, the checkpoints that are not a bare encoder."""
    if any(k.startswith(("decoder.", "lm_head.", "transformer.decoder.")) for k in sd):
        raise hf.unsupported("the seq2seq model with its decoder (T5ForConditionalGeneration, T5Model, "
                             "T5ForQuestionAnswering, T5ForSequenceClassification; the decoder is not converted): "
                             "load the encoder as T5EncoderModel (or MT5EncoderModel / UMT5EncoderModel), whose "
                             "from_pretrained drops the decoder")
    if any(k.startswith("transformer.") for k in sd):
        raise hf.unsupported("T5ForTokenClassification's per-token classifier: load the encoder as T5EncoderModel")


def convert_t5_encoder(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> TransformerEncoder:
    """Build the encoder and copy every weight (the embedding from ``shared.weight``, or
    ``encoder.embed_tokens.weight`` where a file keeps only that tied copy)."""
    _refuse_heads(hf, sd)
    umt5 = hf.raw("model_type") == "umt5"
    model = build_t5_encoder(hf, per_layer_bias=umt5, device=device, dtype=dtype or float_dtype(sd))
    plan = parts.plan_for(sd, "", hf.arch)
    ignore = []
    if "shared.weight" in sd:
        plan.put("tok_emb.weight", "shared.weight")
        ignore.append(r"encoder\.embed_tokens\.weight")  # tied to shared.weight
    else:
        plan.put("tok_emb.weight", "encoder.embed_tokens.weight")
    plan.src.prefix = "encoder."
    for i in range(model.depth):
        o, a, f = f"blocks.{i}.", f"block.{i}.layer.0.", f"block.{i}.layer.1."
        load_qkv_into(plan, f"{o}attn", tuple(f"{a}SelfAttention.{n}.weight" for n in "qkv"), None, False)
        plan.put_pairs(f"{o}attn.", f"{a}SelfAttention.", [("out_proj", "o")], bias=False)
        if i == 0 or umt5:
            plan.put(f"{o}attn.relative_bias.weight", f"{a}SelfAttention.relative_attention_bias.weight")
        gated = model.blocks[i].ffn.gate_proj is not None
        ffn = [("gate_proj", "wi_0"), ("up_proj", "wi_1")] if gated else [("up_proj", "wi")]
        plan.put_pairs(f"{o}ffn.", f"{f}DenseReluDense.", [*ffn, ("down_proj", "wo")], bias=False)
        plan.put_pairs(o, "", [("attn_norm", f"{a}layer_norm"), ("ffn_norm", f"{f}layer_norm")], bias=False)
    plan.put("norm.weight", "final_layer_norm.weight")
    plan.apply(model, ignore=ignore)
    return model


#: nothing: ``t5``, ``mt5`` and ``umt5`` are dispatched by ``families/t5.py``, which converts the
#: encoder-only checkpoints here (:func:`convert_t5_encoder`) and the seq2seq ones itself
DISPATCH: dict[str, parts.Dispatch] = {}
