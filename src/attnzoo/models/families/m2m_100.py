"""M2M100 and NLLB-200 (``m2m_100``: ``M2M100ForConditionalGeneration``, ``M2M100Model``; e.g.
facebook/m2m100_418M, facebook/nllb-200-distilled-600M, whose config is this ``model_type``) ->
:class:`~attnzoo.EncoderDecoder`. Line numbers: transformers 5.25's
``models/m2m_100/modeling_m2m_100.py`` (``configuration_m2m_100.py`` for the defaults).

Both stacks are fairseq's pre-norm transformer: ``x + attn(LayerNorm(x))``, (decoder)
``x + cross_attn(LayerNorm(x), memory)``, ``x + fc2(act(fc1(LayerNorm(x))))``, then a final
``layer_norm`` after each stack (333-482, 540, 629); biases on every projection, LayerNorm eps
1e-5 (``nn.LayerNorm``'s default, no config key), ``activation_function`` (relu) through
``ACT2FN``. Per stack: ``encoder_layers`` / ``decoder_layers``, ``*_attention_heads``, ``*_ffn_dim``.

* Token embeddings times ``sqrt(d_model)`` when ``scale_embedding`` (NLLB and M2M100 both; 68-78,
  528, 617). ``tie_word_embeddings`` (default True) ties ``shared``, ``encoder.embed_tokens``,
  ``decoder.embed_tokens`` and ``lm_head`` (716-721, 821); **with it False transformers 5 unties all
  four**: the encoder and decoder read their own ``embed_tokens`` and ``shared`` is unused (read
  neither way here; ``to_hf`` keeps its value, with a warning). No ``final_logits_bias`` (826: ``bias=False``).
* Positions: ``M2M100SinusoidalPositionalEmbedding`` (81-181), a table **computed, not stored**
  (a non-persistent buffer: no state-dict key), rebuilt here from its formula
  (:func:`fairseq_sinusoidal_table`: ``half_dim = d // 2``, frequencies
  ``exp(-k * log(10000) / (half_dim - 1))`` in float32, ``[sin | cos]`` halves, not interleaved,
  an odd width zero-padded, row ``padding_idx`` zero; 101-119). Positions are **counted from the
  token ids**, not from the attention mask (168-181): a token equal to ``pad_token_id`` reads the
  zero row ``padding_idx``, the k-th non-pad token of its row (k from 1) row ``padding_idx + k``; in
  the decoder with a cache, ``padding_idx + past + k`` with ``k`` counted over the new tokens only
  (131, 684). So a left-padded source row's first real token sits where a right-padded one's does;
  a padded target (right-padded labels) numbers its real tokens ``0, 1, ...``; the
  ``decoder_attention_mask`` moves no position. attnzoo's positions are 0-based, ``-1`` for a pad
  (:func:`id_counted_positions`, :class:`FairseqSinusoidalPositions`); the encoder's embedding
  (:class:`IdCountedEmbedding`) and the decoder (:class:`IdCountedDecoderLM`) count them from the
  ids as transformers does, real and pad tokens alike (a generated pad token too).
* Past ``max_position_embeddings`` transformers grows its table on the fly (139-144). attnzoo
  **refuses** a longer source or target with a ``ValueError`` (the model was trained up to that
  length; the decoder's ``max_seq_len`` is ``max_position_embeddings``). The table being a formula,
  a larger ``max_position_embeddings`` in the config loads the same weights and gives exactly
  transformers' extended rows.
* In float16 the encoder layer's output is clamped to ``±(finfo.max - 1000)`` (always, not only
  after an overflow; 382-384; :class:`~attnzoo.models.families._seq2seq.Float16ClampedBlock`); the decoder layer has no clamp.
* The cross-attention reads the source mask (795); the decoder starts from
  ``decoder_start_token_id`` (2, ``</s>``), which :class:`~attnzoo.EncoderDecoder` keeps with
  ``eos_token_id``. ``M2M100Model`` (no ``model.`` prefix) converts with an ``nn.Identity`` head:
  the output is the decoder's last hidden state ``[B, N, C]``.

Not reproduced, as with every converted family (inference): dropout, ``attention_dropout``,
``activation_dropout`` and ``encoder_layerdrop`` / ``decoder_layerdrop`` (LayerDrop skips layers only
in training; 577, 692). Refused by name: a ``pad_token_id`` of ``None`` (transformers cannot number
positions without it), a ``d_model`` below 4 (the table's ``half_dim - 1`` is 0: transformers divides
by zero), a ``d_model`` not divisible by either stack's heads, an ``activation_function`` attnzoo has
no feed-forward for. NLLB-MoE (``nllb-moe``) is another ``model_type``, not converted here.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._seq2seq as shared
from attnzoo._devices import tracing
from attnzoo._validate import check_int
from attnzoo.blocks import BlockConfig, TransformerBlock
from attnzoo.models._common import LayerCaches
from attnzoo.models.config import DecoderConfig, EncoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.encoder import TransformerEncoder
from attnzoo.models.families._common import Dispatch, plan_for
from attnzoo.models.hf._state import HFConfig, float_dtype
from attnzoo.models.parts import DecoderParts, EncoderParts, ScaledEmbedding
from attnzoo.models.seq2seq import EncoderDecoder
from attnzoo.nn.cache import KVCache, SlidingWindowKVCache

__all__ = ["DEFAULTS", "DISPATCH", "FairseqSinusoidalPositions", "IdCountedDecoderLM",
           "IdCountedEmbedding", "build_m2m_100", "convert_m2m_100", "fairseq_sinusoidal_table",
           "id_counted_positions", "packed_id_counted_positions"]

#: each config class's defaults of the keys read here (a ``config.json`` may leave them out)
DEFAULTS: dict[str, dict[str, Any]] = {
    "m2m_100": {"vocab_size": 128112, "max_position_embeddings": 1024, "d_model": 1024, "encoder_layers": 12,
                "encoder_ffn_dim": 4096, "encoder_attention_heads": 16, "decoder_layers": 12,
                "decoder_ffn_dim": 4096, "decoder_attention_heads": 16, "activation_function": "relu",
                "scale_embedding": True, "pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2,
                "tie_word_embeddings": True}}
#: the eps of every LayerNorm (``nn.LayerNorm``'s default: the config has no key for it)
EPS = 1e-5
_Cache = KVCache | SlidingWindowKVCache


# --------------------------------------------------------------------------- positions
def fairseq_sinusoidal_table(rows: int, dim: int, padding_idx: int) -> Tensor:
    """fairseq's / transformers' sinusoidal table (``get_embedding``, ``modeling_m2m_100.py`` 101-119),
    float32 ``[rows, dim]``: row ``p`` is ``[sin(p w_0) .. sin(p w_{h-1}) | cos(p w_0) .. cos(p w_{h-1})]``
    with ``h = dim // 2``, ``w_k = exp(-k log(10000) / (h - 1))`` (Whisper's table,
    :func:`~attnzoo.models.families._seq2seq.split_sinusoids`), a zero column appended for an odd ``dim``, row ``padding_idx`` all zero."""
    owner = "fairseq_sinusoidal_table"
    check_int(rows, "rows", owner)
    check_int(dim, "dim", owner, minimum=4)  # h - 1 >= 1
    check_int(padding_idx, "padding_idx", owner, minimum=0)
    if padding_idx >= rows:
        raise ValueError(f"{owner}: padding_idx must be < rows={rows}, got {padding_idx}")
    table = shared.split_sinusoids(rows, dim - dim % 2)  # [rows, 2h]
    if dim % 2:
        table = torch.cat([table, torch.zeros(rows, 1)], dim=1)
    table[padding_idx] = 0
    return table


def id_counted_positions(tokens: Tensor, padding_idx: int, past: int = 0) -> Tensor:
    """transformers' M2M100 positions from the token ids (``create_position_ids_from_input_ids``,
    168-181), 0-based: ``tokens [B, N]`` -> int64 ``[B, N]``, the k-th non-pad token of a row (k from
    1) at ``past + k - 1``, a pad (``tokens == padding_idx``) at ``-1`` (the table's zero row). With
    a cache ``past`` is its length and k counts the new tokens only, as transformers does."""
    real = tokens.ne(padding_idx).long()
    return (real.cumsum(dim=1) + past) * real - 1


def packed_id_counted_positions(tokens: Tensor, padding_idx: int, cu_seqlens: Tensor) -> Tensor:
    """:func:`id_counted_positions` of packed sequences: ``tokens [1, T]`` holding the sequences of
    ``cu_seqlens [S+1]`` end to end -> int64 ``[1, T]``, each sequence counted from its own start (as
    that sequence alone, right-padded, is counted)."""
    real = tokens.ne(padding_idx).long()  # [1, T]
    before = real.cumsum(dim=1) - real  # [1, T]: the real tokens before each one
    cu = cu_seqlens.long()
    seq = torch.searchsorted(cu[1:], torch.arange(tokens.shape[1], device=tokens.device), right=True)  # [T]
    first = cu[seq].clamp(max=max(tokens.shape[1] - 1, 0))  # [T]: each token's sequence start
    return (before - before[:, first] + real) * real - 1  # [1, T]


class FairseqSinusoidalPositions(nn.Module):
    """The absolute positions of M2M100 / NLLB: ``x + table[positions + padding_idx + 1]`` with the
    table of :func:`fairseq_sinusoidal_table` (``padding_idx + 1 + max_positions`` rows), so position
    ``-1`` (a pad) adds the zero row ``padding_idx``. The table is a non-persistent buffer rebuilt
    from its formula on moves and casts (as transformers computes it in float32, then casts it to the
    model's dtype). It is a :class:`~attnzoo.models.parts.DecoderParts` ``positions`` part.

    Args:
        dim: width ``C`` (``>= 4``).
        max_positions: the positions ``0 .. max_positions - 1`` (``max_position_embeddings``); larger
            raise ``ValueError``.
        padding_idx: the pad token id, whose row is zero.

    Shapes: ``x [B, N, C]``, ``positions [N] | [B, N]`` (in ``[-1, max_positions)``; default
    ``0 .. N-1``) -> ``[B, N, C]``.
    """

    table: Tensor

    def __init__(self, dim: int, max_positions: int, padding_idx: int, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        owner = type(self).__name__
        self.dim = check_int(dim, "dim", owner, minimum=4)
        self.max_positions = check_int(max_positions, "max_positions", owner)
        self.padding_idx = check_int(padding_idx, "padding_idx", owner, minimum=0)
        table = self._build().to(dtype or torch.get_default_dtype())
        self.register_buffer("table", table.to(device), persistent=False)  # [padding_idx + 1 + P, C]

    def _build(self) -> Tensor:
        return fairseq_sinusoidal_table(self.padding_idx + 1 + self.max_positions, self.dim, self.padding_idx)

    def _apply(self, fn: Any, recurse: bool = True) -> FairseqSinusoidalPositions:
        """Moves and casts rebuild the table from its formula (``to_empty`` after a build on the
        meta device leaves a non-persistent buffer uninitialised)."""
        super()._apply(fn, recurse)
        if self.table.device.type != "meta":
            self.table = self._build().to(self.table.device, self.table.dtype)
        return self

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        owner = type(self).__name__
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{owner}: x must be [B, N, C] with C = {self.dim}, got {got}")
        if positions is None:
            if x.shape[1] > self.max_positions:
                raise ValueError(f"{owner}: {x.shape[1]} tokens is longer than the model's {self.max_positions} "
                                 f"positions (max_position_embeddings)")
            positions = torch.arange(x.shape[1], device=x.device)
        elif positions.numel() and not tracing():  # eager only: one read-back
            lo, hi = (int(t) for t in positions.aminmax())
            if lo < -1 or hi >= self.max_positions:
                raise ValueError(f"{owner}: positions must lie in [-1, {self.max_positions}) (-1: a pad; "
                                 f"max_position_embeddings={self.max_positions}), got {lo}..{hi}")
        return x + self.table[positions + (self.padding_idx + 1)].to(x.dtype)  # [B, N, C]

    def extra_repr(self) -> str:
        return f"dim={self.dim}, max_positions={self.max_positions}, padding_idx={self.padding_idx}"


class IdCountedEmbedding(nn.Module):
    """The encoder's input embedding of M2M100 / NLLB (``M2M100Encoder``, 549-566): scaled token
    embeddings plus :class:`FairseqSinusoidalPositions` numbered from the ids
    (:func:`id_counted_positions`) unless given. An :class:`~attnzoo.models.parts.EncoderParts`
    ``embedding``; no token types.

    Weights: ``tok_emb.weight [V, C]`` (a :class:`~attnzoo.models.parts.ScaledEmbedding`).
    Shapes: ``tokens [B, N]``, ``token_type_ids`` ``None``, ``positions [B, N] | None`` (0-based,
    ``-1`` for a pad) -> ``[B, N, C]``.
    """

    def __init__(self, vocab_size: int, dim: int, max_positions: int, *, padding_idx: int, scale: float,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.tok_emb = ScaledEmbedding(vocab_size, dim, scale=scale, **kw)
        self.positions = FairseqSinusoidalPositions(dim, max_positions, padding_idx, **kw)

    @property
    def padding_idx(self) -> int:
        return self.positions.padding_idx

    def forward(self, tokens: Tensor, token_type_ids: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        owner = type(self).__name__
        if token_type_ids is not None:
            raise ValueError(f"{owner}: this embedding has no token types; token_type_ids must be None")
        if positions is None:
            if tokens.shape[-1] > self.positions.max_positions:  # counted from the ids: at most N (no host sync)
                raise ValueError(f"{owner}: {tokens.shape[-1]} tokens is longer than the model's "
                                 f"{self.positions.max_positions} positions (max_position_embeddings)")
            positions = id_counted_positions(tokens, self.padding_idx)  # [B, N]
        return self.positions(self.tok_emb(tokens), positions)  # [B, N, C]

    def packed(self, tokens: Tensor, token_type_ids: Tensor | None, cu_seqlens: Tensor) -> Tensor:
        """Packed sequences ``tokens [1, T]`` of ``cu_seqlens [S+1]`` -> ``[1, T, C]``, each sequence's
        positions counted from its own ids (:func:`packed_id_counted_positions`)."""
        if token_type_ids is not None:
            raise ValueError(f"{type(self).__name__}: this embedding has no token types; token_type_ids must be None")
        return self.positions(self.tok_emb(tokens), packed_id_counted_positions(tokens, self.padding_idx, cu_seqlens))


# --------------------------------------------------------------------------- blocks and decoder
class IdCountedDecoderLM(DecoderLM):
    """A :class:`~attnzoo.DecoderLM` whose absolute positions are counted from the token ids, as
    transformers' M2M100 decoder does (684; :func:`id_counted_positions`): when no ``positions`` are
    given, a token equal to ``padding_idx`` gets ``-1`` (its position part adds nothing: the zero
    row), the others their count of non-pad tokens (after the cache's length), whatever
    ``attention_mask`` says (it hides padded keys only). Its ``positions`` part must take ``-1``
    (:class:`FairseqSinusoidalPositions`). Packed input (``cu_seqlens``) and given ``positions``
    are as in :class:`~attnzoo.DecoderLM`.

    Args: those of :class:`~attnzoo.DecoderLM` (``config``, ``parts``, ``device``, ``dtype``), and
        padding_idx: the pad token id.

    Shapes: ``tokens [B, N]`` -> ``[B, N, V]`` (the head's output).
    """

    def __init__(self, *, config: DecoderConfig, parts: DecoderParts, padding_idx: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(config=config, parts=parts, device=device, dtype=dtype)
        self.padding_idx = check_int(padding_idx, "padding_idx", type(self).__name__, minimum=0)

    def _run(self, tokens: Tensor, cache: LayerCaches | None, given: tuple[Any, Any, Any, Any],
             packed: tuple[Any, Any], *, head: bool) -> Tensor:
        """As :meth:`DecoderLM.forward` / :meth:`DecoderLM.hidden_states`, the default positions
        counted from the ids (packed: per sequence, :meth:`packed_token_positions`)."""
        if (given[0] is None and packed[0] is None and isinstance(tokens, Tensor) and tokens.dim() == 2
                and not tokens.is_floating_point()):
            positions = id_counted_positions(tokens, self.padding_idx, self._cache_length(cache, tokens.shape[0]))
            given = (positions, *given[1:])
        return super()._run(tokens, cache, given, packed, head=head)

    def packed_token_positions(self, tokens: Tensor, cu_seqlens: Tensor) -> Tensor:
        """Packed ``tokens [1, T]``: positions ``[1, T]`` counted from the ids in every sequence
        (:func:`packed_id_counted_positions`; a pad at ``-1``)."""
        return packed_id_counted_positions(tokens, self.padding_idx, cu_seqlens)

    def extra_repr(self) -> str:
        return f"padding_idx={self.padding_idx}"


# --------------------------------------------------------------------------- the model
def _canonical(hf: HFConfig) -> HFConfig:
    """``hf`` with the config class's defaults (:data:`DEFAULTS`), the options that cannot be
    reproduced refused by name."""
    out = hf.with_defaults(DEFAULTS["m2m_100"])
    if hf.raw("pad_token_id") is None and "pad_token_id" in hf.data:
        raise hf.unsupported("pad_token_id=None (transformers numbers M2M100's positions from the pad id)")
    C = out.req("d_model")
    if C < 4:
        raise hf.unsupported(f"d_model={C} (the sinusoidal table divides by d_model // 2 - 1 = 0)")
    for key in ("encoder_attention_heads", "decoder_attention_heads"):
        if C % out.req(key):
            raise hf.unsupported(f"d_model={C} not divisible by {key}={out.raw(key)}")
    out.activation("activation_function", shared.ACTIVATIONS, "relu")
    return out


def _block(hf: HFConfig, stack: str, *, cross: bool) -> BlockConfig:
    """The pre-norm block of one stack (``"encoder"`` / ``"decoder"``): biased attention, LayerNorm
    eps 1e-5, the ``activation_function`` feed-forward of ``{stack}_ffn_dim``."""
    return BlockConfig(hf.req("d_model"), hf.req(f"{stack}_attention_heads"), attention="mha",
                       attention_kwargs={"bias": True}, causal=cross, cross_attention=cross, norm="layer",
                       norm_eps=EPS, norm_first=True, ffn=hf.activation("activation_function", shared.ACTIVATIONS),
                       ffn_hidden=hf.req(f"{stack}_ffn_dim"), bias=True)


def build_m2m_100(hf: HFConfig, *, lm_head: bool = True, device: Any = None, dtype: Any = None) -> EncoderDecoder:
    """The encoder-decoder of an M2M100 / NLLB config (random weights; see the module docstring):
    an encoder of :class:`IdCountedEmbedding` and float16-clamped pre-norm blocks, an
    :class:`IdCountedDecoderLM` with :class:`FairseqSinusoidalPositions` and cross-attention blocks,
    a final LayerNorm after each; the token embeddings shared by both stacks and the LM head under
    ``tie_word_embeddings``. ``lm_head=False``: ``M2M100Model``, whose output is the decoder's last
    hidden state ``[B, N, C]`` (``nn.Identity`` head)."""
    raw, hf = hf, _canonical(hf)
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    V, C, P = hf.req("vocab_size"), hf.req("d_model"), hf.req("max_position_embeddings")
    pad = hf.req("pad_token_id")
    scale = math.sqrt(C) if hf.req("scale_embedding", bool) else 1.0
    tied = hf.req("tie_word_embeddings", bool)
    embedding = IdCountedEmbedding(V, C, P, padding_idx=pad, scale=scale, **kw)
    nn.init.normal_(embedding.tok_emb.weight, 0.0, 0.02)  # transformers' init_std
    enc_blocks = [shared.Float16ClampedBlock(config=_block(hf, "encoder", cross=False), always=True, **kw)
                  for _ in range(hf.req("encoder_layers"))]
    enc_cfg = EncoderConfig(V, C, len(enc_blocks), hf.req("encoder_attention_heads"), max_seq_len=P, pos="none",
                            norm="layer", norm_eps=EPS, norm_first=True, final_norm=True)
    encoder = TransformerEncoder(config=enc_cfg, parts=EncoderParts(embedding=embedding, blocks=enc_blocks), **kw)
    dec_emb = ScaledEmbedding(V, C, scale=scale, **kw)
    nn.init.normal_(dec_emb.weight, 0.0, 0.02)
    if tied:
        dec_emb.weight = embedding.tok_emb.weight
    depth = hf.req("decoder_layers")
    dec_cfg = DecoderConfig(V, C, depth, hf.req("decoder_attention_heads"), max_seq_len=P, pos="sinusoidal",
                            norm="layer", norm_eps=EPS, tie_embeddings=tied and lm_head)
    block = functools.partial(TransformerBlock, config=_block(hf, "decoder", cross=True), **kw)
    parts = DecoderParts(blocks=[block() for _ in range(depth)], embedding=dec_emb,
                         positions=FairseqSinusoidalPositions(C, P, pad, **kw),
                         head=None if lm_head else nn.Identity())
    decoder = IdCountedDecoderLM(config=dec_cfg, parts=parts, padding_idx=pad, **kw)
    start, eos = (shared.config_token(raw.data.get(k, DEFAULTS["m2m_100"][k])) for k in ("decoder_start_token_id",
                                                                                 "eos_token_id"))
    return EncoderDecoder(encoder, decoder, decoder_start_token_id=start, eos_token_id=eos)


def convert_m2m_100(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> EncoderDecoder:
    """Build the model and map every weight: ``M2M100ForConditionalGeneration`` (keys under
    ``model.``, the LM head) or ``M2M100Model`` (no prefix, no head). Tied: the embeddings from
    ``shared.weight`` (or ``encoder.embed_tokens.weight`` where a file keeps only that copy), the other
    copies ignored; untied: each stack's ``embed_tokens`` and ``lm_head.weight``, ``shared`` unused."""
    prefix = "model." if any(k.startswith("model.") for k in sd) else ""
    tied = hf.get("tie_word_embeddings", True, bool)
    model = build_m2m_100(hf, lm_head=bool(prefix), device=device, dtype=dtype or float_dtype(sd))
    plan = plan_for(sd, "", hf.arch)
    p = prefix
    enc_emb, dec_emb = f"{p}encoder.embed_tokens.weight", f"{p}decoder.embed_tokens.weight"
    e = re.escape(p)
    ignore = [f"{e}shared\\.weight"]  # tied: the source of the copies below; untied: unused by transformers
    if tied:  # one matrix: the copies a file holds must agree
        source = shared.tied_source(hf, sd, (f"{p}shared.weight", enc_emb, dec_emb, "lm_head.weight"))
        plan.put("encoder.embedding.tok_emb.weight", source)
        ignore += [f"{e}encoder\\.embed_tokens\\.weight", f"{e}decoder\\.embed_tokens\\.weight", r"lm_head\.weight"]
    else:
        plan.put("encoder.embedding.tok_emb.weight", enc_emb)
        plan.put("decoder.tok_emb.weight", dec_emb)
        if prefix:
            plan.put("decoder.lm_head.weight", "lm_head.weight")
    for i in range(model.encoder.depth):
        shared.put_layer(plan, f"encoder.blocks.{i}.", f"{p}encoder.layers.{i}.", cross=False)
    for i in range(model.decoder.depth):
        shared.put_layer(plan, f"decoder.blocks.{i}.", f"{p}decoder.layers.{i}.", cross=True)
    plan.put_pairs("encoder.", f"{p}encoder.", [("norm", "layer_norm")])
    plan.put_pairs("decoder.", f"{p}decoder.", [("norm", "layer_norm")])
    plan.apply(model, ignore=ignore)
    return model


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {"m2m_100": Dispatch("M2M100", convert_m2m_100, ("M2M100ForConditionalGeneration", "M2M100Model"))}
