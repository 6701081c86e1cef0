"""BART, mBART and PLBART (``bart``, ``mbart``, ``plbart``) -> :class:`~attnzoo.EncoderDecoder`:
``BartForConditionalGeneration`` / ``BartModel`` (bart-base/large, bart-large-cnn, distilbart, ...),
``MBartForConditionalGeneration`` / ``MBartModel`` (mbart-large-cc25, mBART-50 translation),
``PLBartForConditionalGeneration`` / ``PLBartModel``, and the three ``*ForSequenceClassification``
(bart-large-mnli zero-shot) as a :class:`Seq2SeqClassifier`. Line numbers: transformers 5.25's
``models/bart/modeling_bart.py`` (B), ``models/mbart/modeling_mbart.py`` (M) and
``models/plbart/modeling_plbart.py`` (P).

Both stacks embed the same way (B 463-549, 552-673):

* the token embedding ``shared`` times ``sqrt(d_model)`` when ``scale_embedding`` (B 100-110, 687-688;
  default ``False`` for BART and mBART, ``True`` for PLBART), one parameter for the encoder, the
  decoder and the LM head (``_tied_weights_keys``, B 678-681, 801-803): a checkpoint holds it as
  ``shared.weight`` and/or its copies ``encoder.embed_tokens.weight`` / ``decoder.embed_tokens.weight``
  / ``lm_head.weight``. With ``tie_word_embeddings=False`` transformers 5.25 ties nothing: the encoder
  reads ``encoder.embed_tokens``, the decoder ``decoder.embed_tokens``, the head ``lm_head`` (four
  parameters; ``shared`` is then unused, left out and kept as it is by ``to_hf``). Its pad row takes
  no gradient (``padding_idx = pad_token_id``), kept here;
* learned positions with an **offset of 2** (``BartLearnedPositionalEmbedding``, B 75-97): the table
  has ``max_position_embeddings + 2`` rows and position ``p`` reads row ``p + 2``. Positions are the
  tokens' indices, ``cache_length + arange(N)`` (B 520, 621-622), never counted from a mask: a
  left-padded row's first real token sits at its slot's position, in both stacks. attnzoo's table
  is rows ``2..`` (``max_position_embeddings`` positions; :class:`OffsetLearnedPositions`); ``to_hf``
  leaves rows 0-1 as they were;
* ``layernorm_embedding`` after the positions (B 523-524, 648-649), then dropout.

Layers: BART and PLBART are **post-norm** (``x = LN(x + attn(x))``, ``x = LN(x + cross(x))``,
``x = LN(x + fc2(act(fc1(x))))``; B 260-391), no final norm; mBART is **pre-norm** with a final
``layer_norm`` on both stacks (M 268-417, 507, 582, 622, 747). Attention: ``q/k/v/out_proj`` with
biases, ``head_dim ** -0.5`` (B 142-257). The stacks may differ: ``encoder_layers`` /
``decoder_layers``, ``encoder_attention_heads`` / ``decoder_attention_heads``, ``encoder_ffn_dim`` /
``decoder_ffn_dim``. ``activation_function``: ``gelu`` (exact), ``relu``, ``gelu_new`` /
``gelu_pytorch_tanh``, ``quick_gelu``, ``silu`` / ``swish``. In float16 the encoder layers clamp their
output (B 304-306: to ``±(finfo.max - 1000)`` only when a value is not finite; mBART M 317-319:
always; :class:`Float16ClampedBlock`). The decoder layers do not.

Heads: ``*ForConditionalGeneration`` adds the buffer ``final_logits_bias [1, V]`` to the tied LM head
(B 809, 934-935): an :class:`~attnzoo.models.parts.LMHead` with ``bias`` (zeros when a file lacks it,
``_keys_to_ignore_on_load_missing``). The bare ``*Model`` returns the decoder's last hidden state
(head ``nn.Identity``). ``*ForSequenceClassification`` (B 965-1087) feeds the decoder
``shift_tokens_right(input_ids)`` (BART: ``decoder_start_token_id`` first, B 59-72; mBART / PLBART:
the row's last non-pad token — the language id — wrapped to the front, M 60-78, P 609-627), reads the
decoder's state at the **last** ``eos_token_id`` of each row (every row must hold as many, B 1038-1049)
and applies ``out_proj(tanh(dense(h)))`` (B 394-415): :meth:`Seq2SeqClassifier.classify`.

``decoder_start_token_id``: BART 2 (``</s>``), mBART / PLBART none by default (mBART-50's config
sets 2; translation forces the target language id after it: ``generate(...,
forced_bos_token_id=lang_id)``). transformers' generation settings (``forced_bos_token_id``,
``forced_eos_token_id``, beams) are not part of the model: pass them to
:meth:`~attnzoo.EncoderDecoder.generate`. The legacy keys of transformers 3 configs
(``normalize_before``, ``add_final_layer_norm``, ``static_position_embeddings``, ``add_bias_logits``,
...) are not read by transformers 5.25 and not here: the ``model_type`` decides the layout.

Refused by name: ``BartForCausalLM`` / ``BartForQuestionAnswering`` (and mBART's / PLBART's: their
weights have no attnzoo head), an ``activation_function`` attnzoo has no feed-forward for, tied
embedding copies whose values differ (transformers then unties them with a warning), a list
``eos_token_id`` under ``*ForSequenceClassification``. ``encoder_layerdrop`` / ``decoder_layerdrop``
(layers skipped at random in training) are not reproduced: attnzoo runs every layer, as
transformers does in eval mode.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor, nn

import attnzoo.models.families._common as parts
import attnzoo.models.families._seq2seq as shared
from attnzoo._validate import check_int
from attnzoo.blocks import BlockLayers, FeedForward, TransformerBlock, make_norm
from attnzoo.models._common import check_padding_mask, check_tokens
from attnzoo.models.config import DecoderConfig, EncoderConfig
from attnzoo.models.decoder import DecoderLM
from attnzoo.models.encoder import FirstTokenClassifier, TransformerEncoder
from attnzoo.models.hf._state import HFConfig, Plan, Source, float_dtype
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.models.parts import DecoderParts, EncoderParts, LMHead, PackedFromZero, ScaledEmbedding
from attnzoo.models.seq2seq import EncoderDecoder
from attnzoo.nn.positional import LearnedPositionalEmbedding
from attnzoo.variants import build_attention

__all__ = ["DEFAULTS", "DISPATCH", "OFFSET", "BartEmbedding", "LastTokenShift", "OffsetLearnedPositions",
           "Seq2SeqClassifier", "build_bart", "convert_bart", "shift_tokens_right"]

#: rows of transformers' position table before position 0 (``BartLearnedPositionalEmbedding.offset``)
OFFSET = 2
_COMMON: dict[str, Any] = {
    "max_position_embeddings": 1024, "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0,
    "activation_function": "gelu", "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0,
    "classifier_dropout": 0.0, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "tie_word_embeddings": True}
_LARGE: dict[str, Any] = {"vocab_size": 50265, "d_model": 1024, "encoder_layers": 12, "decoder_layers": 12,
                          "encoder_attention_heads": 16, "decoder_attention_heads": 16, "encoder_ffn_dim": 4096,
                          "decoder_ffn_dim": 4096}
#: each config class's defaults of the keys read here (``configuration_*.py``; a ``config.json`` may leave them out)
DEFAULTS: dict[str, dict[str, Any]] = {
    "bart": {**_COMMON, **_LARGE, "scale_embedding": False, "decoder_start_token_id": 2},
    "mbart": {**_COMMON, **_LARGE, "scale_embedding": False},
    "plbart": {**_COMMON, "vocab_size": 50005, "d_model": 768, "encoder_layers": 6, "decoder_layers": 6,
               "encoder_attention_heads": 12, "decoder_attention_heads": 12, "encoder_ffn_dim": 3072,
               "decoder_ffn_dim": 3072, "attention_dropout": 0.1, "scale_embedding": True}}
#: the model types whose layers are pre-norm with a final norm on each stack (the others: post-norm, none)
PRE_NORM = frozenset({"mbart"})
_NAMES = {"bart": "BART", "mbart": "mBART", "plbart": "PLBART"}
_STEMS = {"bart": "Bart", "mbart": "MBart", "plbart": "PLBart"}


class OffsetLearnedPositions(nn.Module):
    """BART's learned absolute positions followed by the embedding LayerNorm:
    ``LN(x + table[positions])``, the ``DecoderParts.positions`` of the decoder (and the second half
    of :class:`BartEmbedding`).

    The table holds the ``max_positions`` rows transformers reads (its rows ``2..``, after the
    offset of :data:`OFFSET`); positions are the tokens' indices whatever the attention mask
    (``counts_mask = False``: :class:`~attnzoo.DecoderLM` passes ``cache.length + 0..N-1``).

    Args:
        dim: width ``C``.
        max_positions: rows of the table (``max_position_embeddings``); larger positions raise ``ValueError``.
        eps: the LayerNorm's epsilon (``nn.LayerNorm``'s 1e-5 in transformers).

    Weights: ``table.weight [max_positions, C]``, ``norm.weight`` / ``norm.bias [C]``.
    Shapes: ``x [B, N, C]``, ``positions [N] | [B, N] | None`` (``0..N-1``) -> ``[B, N, C]``.
    """

    counts_mask = False

    def __init__(self, dim: int, max_positions: int, *, eps: float = 1e-5, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.table = LearnedPositionalEmbedding(dim, max_positions, device=device, dtype=dtype)
        self.norm = make_norm("layer", dim, eps, device=device, dtype=dtype)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        return self.norm(self.table(x, positions))  # [B, N, C]


class BartEmbedding(PackedFromZero, nn.Module):
    """The encoder's input embedding, an :class:`~attnzoo.models.EncoderParts` ``embedding``:
    ``LN(tok_emb(tokens) + table[positions])`` (:class:`OffsetLearnedPositions`; the token embedding
    may be the decoder's too).

    Args:
        tok_emb: ``tokens [B, N] -> [B, N, C]`` (a :class:`~attnzoo.models.parts.ScaledEmbedding` for
            ``scale_embedding``).
        positions: the :class:`OffsetLearnedPositions`.

    Shapes: ``tokens [B, N]``, ``token_type_ids`` must be ``None`` (no token types), ``positions [N] |
    [B, N] | None`` (``0..N-1``, also on padded rows) -> ``[B, N, C]``; ``packed(tokens [1, T], None,
    cu_seqlens [S+1]) -> [1, T, C]`` (positions from 0 in every packed sequence).
    """

    def __init__(self, tok_emb: nn.Module, positions: OffsetLearnedPositions) -> None:
        super().__init__()
        if not isinstance(tok_emb, nn.Module):
            raise TypeError(f"BartEmbedding: tok_emb must be an nn.Module, got {type(tok_emb).__name__}")
        if not isinstance(positions, OffsetLearnedPositions):
            raise TypeError(f"BartEmbedding: positions must be an OffsetLearnedPositions, got "
                            f"{type(positions).__name__}")
        self.tok_emb = tok_emb
        self.positions = positions

    def forward(self, tokens: Tensor, token_type_ids: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        if token_type_ids is not None:
            raise ValueError("BartEmbedding: the model has no token types (token_type_ids must be None)")
        return self.positions(self.tok_emb(tokens), positions)  # [B, N, C]


def shift_tokens_right(input_ids: Tensor, pad_token_id: int, decoder_start_token_id: int | None) -> Tensor:
    """The decoder input transformers derives from ``input_ids [B, N]`` (-> ``[B, N]``): every token
    one slot right, the first slot ``decoder_start_token_id`` (BART, B 59-72) or, when it is ``None``,
    the row's last non-pad token (mBART / PLBART: the language id of a right-padded row, M 60-78)."""
    owner = "shift_tokens_right"
    check_int(pad_token_id, "pad_token_id", owner, minimum=0)
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"{owner}: input_ids must be [B, N] with N >= 1, got {got}")
    shifted = input_ids.roll(1, dims=1)
    if decoder_start_token_id is not None:
        first = torch.full_like(input_ids[:, 0], check_int(decoder_start_token_id, "decoder_start_token_id", owner,
                                                           minimum=0))
    else:
        last = (input_ids.ne(pad_token_id).sum(dim=1) - 1).clamp(min=0)  # [B]: the last non-pad of a right-padded row
        first = input_ids.gather(1, last[:, None])[:, 0]
    shifted[:, 0] = first
    return shifted


class LastTokenShift(EncoderDecoder):
    """mBART's / PLBART's :class:`~attnzoo.EncoderDecoder`: :meth:`loss` feeds the decoder the labels
    as transformers' ``MBartForConditionalGeneration`` shifts them — each row's last label (its
    language id) first, then the others (:func:`shift_tokens_right` without a start token), whatever
    ``decoder_start_token_id`` says (generation starts from it). Args: those of
    :class:`~attnzoo.EncoderDecoder`, and ``pad_token_id`` (what uncounted labels become).
    Shapes: as :class:`~attnzoo.EncoderDecoder`."""

    def __init__(self, encoder: nn.Module, decoder: DecoderLM, *, pad_token_id: int,
                 decoder_start_token_id: int | None = None, eos_token_id: int | None = None) -> None:
        super().__init__(encoder, decoder, decoder_start_token_id=decoder_start_token_id, eos_token_id=eos_token_id)
        self.pad_token_id = check_int(pad_token_id, "pad_token_id", "LastTokenShift", minimum=0)

    def shift_labels(self, labels: Tensor, counted: Tensor) -> Tensor:
        """``labels [B, N]`` -> the decoder input ``[B, N]``: uncounted labels as the pad id, the row's
        last non-pad label first."""
        return shift_tokens_right(labels.masked_fill(~counted, self.pad_token_id), self.pad_token_id, None)


class Seq2SeqClassifier(EncoderDecoder):
    """``*ForSequenceClassification`` of the BART family: an :class:`~attnzoo.EncoderDecoder` whose
    decoder returns hidden states (head ``nn.Identity``) and a classification head read at the last
    end token of each row.

    :meth:`classify` is transformers' forward: the decoder input is :func:`shift_tokens_right` of
    the source, the decoder state at the last ``eos_token_id`` of each source row goes through
    ``out_proj(tanh(dense(h)))`` (a :class:`~attnzoo.models.encoder.FirstTokenClassifier` over that one
    state). ``forward(src, tgt)`` is the bare model's (hidden states ``[B, N, C]``).

    Args:
        encoder, decoder: as :class:`~attnzoo.EncoderDecoder` (the decoder without an LM head).
        head: the :class:`~attnzoo.models.encoder.FirstTokenClassifier` (``dense``, ``out_proj``).
        eos_token_id: the end token whose last occurrence is read.
        pad_token_id: the pad id (:func:`shift_tokens_right`).
        decoder_start_token_id: BART's first decoder token; ``None``: the row's last non-pad token (mBART).

    Shapes: ``classify(src [B, M], src_mask [B, M] | None) -> [B, L]``.
    """

    def __init__(self, encoder: nn.Module, decoder: DecoderLM, head: FirstTokenClassifier, *, eos_token_id: int,
                 pad_token_id: int, decoder_start_token_id: int | None = None) -> None:
        super().__init__(encoder, decoder, decoder_start_token_id=decoder_start_token_id, eos_token_id=eos_token_id)
        if not isinstance(head, FirstTokenClassifier):
            raise TypeError(f"Seq2SeqClassifier: head must be a FirstTokenClassifier, got {type(head).__name__}")
        self.classification_head = head
        self.pad_token_id = check_int(pad_token_id, "pad_token_id", "Seq2SeqClassifier", minimum=0)

    def classify(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """Class logits ``[B, L]`` of ``src [B, M]`` (``src_mask [B, M]`` bool, True = real): every row
        must hold the end token, all rows as many times (``ValueError`` otherwise, as transformers)."""
        owner = "Seq2SeqClassifier.classify"
        check_tokens(src, self.decoder.vocab_size, owner, "src")
        if src_mask is not None:
            src_mask = check_padding_mask(src_mask, src.shape[0], src.shape[1], owner, "src_mask")
        assert self.eos_token_id is not None
        eos = src.eq(self.eos_token_id)  # [B, M]
        counts = eos.sum(dim=1)
        if bool((counts == 0).any()) or bool((counts != counts[0]).any()):
            raise ValueError(f"{owner}: every row of src must hold the end token {self.eos_token_id}, all rows as "
                             f"many times; got counts {counts.tolist()}")
        tgt = shift_tokens_right(src, self.pad_token_id, self.decoder_start_token_id)
        hidden = self(src, tgt, src_mask=src_mask)  # [B, M, C]
        slots = torch.arange(src.shape[1], device=src.device).expand_as(src)
        last = torch.where(eos, slots, -1).amax(dim=1)  # [B]
        picked = hidden[torch.arange(src.shape[0], device=src.device), last]  # [B, C]
        return self.classification_head(picked[:, None])  # [B, L]


def _read(hf: HFConfig) -> HFConfig:
    """``hf`` with its config class's defaults, the options without an attnzoo equivalent refused."""
    model_type = hf.raw("model_type", "bart")
    out = hf.with_defaults(DEFAULTS[model_type])
    out.activation("activation_function", shared.ACTIVATIONS)
    if out.get("is_decoder", False, bool):
        raise hf.unsupported("is_decoder=True (the decoder alone, *ForCausalLM)")
    return out


def _stack(hf: HFConfig, side: str, *, cross: bool, pre: bool, device: Any, dtype: Any) -> list[nn.Module]:
    """The ``{side}_layers`` blocks of one stack (``side``: ``"encoder"`` / ``"decoder"``)."""
    C, H = hf.req("d_model"), hf.req(f"{side}_attention_heads")
    if C % H:
        raise CheckpointFormatError(f"{hf.source}: d_model={C} is not divisible by {side}_attention_heads={H}")
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    p_attn, p_act = hf.get("attention_dropout", 0.0, float), hf.get("activation_dropout", 0.0, float)
    attention = functools.partial(build_attention, "mha", C, H, causal=cross, bias=True, dropout=p_attn, **kw)
    ffn = functools.partial(FeedForward, C, hf.req(f"{side}_ffn_dim"), hf.activation("activation_function", shared.ACTIVATIONS),
                            bias=True, dropout=p_act, **kw)
    norm = functools.partial(make_norm, "layer", C, 1e-5, **kw)
    layers = BlockLayers(attention=attention, feed_forward=ffn, norm=norm, norm_first=pre,
                         dropout=hf.get("dropout", 0.1, float),
                         cross_attention=functools.partial(build_attention, "mha", C, H, kv_dim=C, causal=False, bias=True,
                                                           dropout=p_attn, **kw) if cross else None)
    if cross:
        return [TransformerBlock(C, layers=layers) for _ in range(hf.req("decoder_layers"))]
    always = hf.raw("model_type") in PRE_NORM
    return [shared.Float16ClampedBlock(C, layers=layers, always=always) for _ in range(hf.req("encoder_layers"))]


def _embedding(hf: HFConfig, pad: int | None, **kw: Any) -> nn.Embedding:
    V, C = hf.req("vocab_size"), hf.req("d_model")
    emb = ScaledEmbedding(V, C, scale=math.sqrt(C), **kw) if hf.get("scale_embedding", False, bool) \
        else nn.Embedding(V, C, **kw)
    if pad is not None and 0 <= pad < V:
        emb.padding_idx = pad  # no gradient into the pad row, as transformers' padding_idx
    return emb


def build_bart(hf: HFConfig, *, head: str = "lm", num_labels: int = 0, device: Any = None,
               dtype: Any = None) -> EncoderDecoder:
    """The model of a ``bart`` / ``mbart`` / ``plbart`` config (random weights; see the module
    docstring). ``head``: ``"lm"`` the LM head with its ``final_logits_bias`` (``*ForConditionalGeneration``),
    ``"none"`` the decoder's hidden states (``*Model``), ``"classifier"`` a :class:`Seq2SeqClassifier`
    of ``num_labels`` classes (``*ForSequenceClassification``). The token embedding is one module
    shared by both stacks (and tied to the LM head) unless ``tie_word_embeddings`` is false."""
    if head not in ("lm", "none", "classifier"):
        raise ValueError(f"build_bart: head must be 'lm', 'none' or 'classifier', got {head!r}")
    hf = _read(hf)
    pre = hf.raw("model_type") in PRE_NORM
    V, C, P = hf.req("vocab_size"), hf.req("d_model"), hf.req("max_position_embeddings")
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    tied = hf.get("tie_word_embeddings", True, bool)
    pad = hf.get("pad_token_id", None)
    enc_tok = _embedding(hf, pad, **kw)
    dec_tok = enc_tok if tied else _embedding(hf, pad, **kw)
    p_drop = hf.get("dropout", 0.1, float)

    def final() -> nn.Module:
        return make_norm("layer", C, 1e-5, **kw) if pre else nn.Identity()

    enc_cfg = EncoderConfig(V, C, hf.req("encoder_layers"), hf.req("encoder_attention_heads"), pos="none",
                            max_seq_len=P, type_vocab_size=0, norm="layer", norm_first=pre, dropout=p_drop)
    encoder = TransformerEncoder(config=enc_cfg, parts=EncoderParts(
        embedding=BartEmbedding(enc_tok, OffsetLearnedPositions(C, P, **kw)),
        blocks=_stack(hf, "encoder", cross=False, pre=pre, **kw), norm=final()), **kw)
    dec_cfg = DecoderConfig(V, C, hf.req("decoder_layers"), hf.req("decoder_attention_heads"), pos="learned",
                            max_seq_len=P, norm="layer", tie_embeddings=tied and head == "lm", dropout=p_drop)
    lm = LMHead(C, V, bias=True, **kw) if head == "lm" else nn.Identity()
    decoder = DecoderLM(config=dec_cfg, parts=DecoderParts(
        blocks=_stack(hf, "decoder", cross=True, pre=pre, **kw), embedding=dec_tok, norm=final(), head=lm,
        positions=OffsetLearnedPositions(C, P, **kw)), **kw)
    if head == "lm" and isinstance(lm, LMHead) and lm.bias is not None:
        with torch.no_grad():
            lm.bias.zero_()
    start, eos = hf.get("decoder_start_token_id", None), hf.raw("eos_token_id")
    if head == "classifier":
        if not isinstance(eos, int) or isinstance(eos, bool):
            raise hf.unsupported(f"eos_token_id={eos!r} under *ForSequenceClassification (one end token is read)")
        classifier = FirstTokenClassifier(C, check_int(num_labels, "num_labels", "build_bart"),
                                          dropout=hf.get("classifier_dropout", 0.0, float), **kw)
        # mBART / PLBART's classifiers shift with their own rule (the row's last token first) whatever
        # decoder_start_token_id says (mBART-50 sets it to 2); BART's puts the start token first
        return Seq2SeqClassifier(encoder, decoder, classifier, eos_token_id=eos, pad_token_id=hf.req("pad_token_id"),
                                 decoder_start_token_id=start if hf.raw("model_type", "bart") == "bart" else None)
    if hf.raw("model_type", "bart") != "bart":  # mBART / PLBART: their own label shift (loss)
        return LastTokenShift(encoder, decoder, pad_token_id=hf.req("pad_token_id"), decoder_start_token_id=start,
                              eos_token_id=shared.config_token(eos))
    return EncoderDecoder(encoder, decoder, decoder_start_token_id=start, eos_token_id=shared.config_token(eos))


def _refuse_heads(hf: HFConfig, sd: dict[str, Tensor], stem: str) -> None:
    """Refuse, by name, the checkpoints of the heads not converted here."""
    if any(k.startswith("qa_outputs.") for k in sd):
        raise hf.unsupported(f"{stem}ForQuestionAnswering's span head (qa_outputs)")
    if not any(".encoder." in f".{k}" for k in sd):
        raise hf.unsupported(f"the decoder alone ({stem}ForCausalLM): attnzoo converts the encoder-decoder")


def _put_embeddings(plan: Plan, hf: HFConfig, sd: dict[str, Tensor], model: EncoderDecoder, tied: bool,
                    prefix: str) -> list[str]:
    """The token embedding(s): one tensor (``shared`` or, where a file keeps only them, a tied copy)
    when tied, else each stack's own. Returns the checkpoint keys to ignore (the tied copies)."""
    copies = [f"{prefix}shared.weight", f"{prefix}encoder.embed_tokens.weight", f"{prefix}decoder.embed_tokens.weight"]
    enc_name = "encoder.embedding.tok_emb.weight"
    plan.src.prefix = ""
    if not tied:
        plan.put(enc_name, copies[1])
        plan.put("decoder.tok_emb.weight", copies[2])
        return [copies[0].replace(".", r"\.")]  # unused by transformers' forward (kept by to_hf)
    source = shared.tied_source(hf, sd, (*copies, "lm_head.weight"))
    plan.put(enc_name, source)
    return [k.replace(".", r"\.") for k in (*copies, "lm_head.weight") if k != source]


def convert_bart(hf: HFConfig, sd: dict[str, Tensor], *, device: Any, dtype: Any) -> EncoderDecoder:
    """Build the model and copy every weight; the head follows the weights (``model.`` prefix with
    ``classification_head.*``: a :class:`Seq2SeqClassifier`; ``model.`` otherwise: the LM head;
    no prefix: the bare model)."""
    model_type = hf.raw("model_type", "bart")
    _refuse_heads(hf, sd, _STEMS.get(model_type, "Bart"))
    prefix = "model." if any(k.startswith("model.") for k in sd) else ""
    labels = sd.get("classification_head.out_proj.weight")
    head = "classifier" if labels is not None else "lm" if prefix else "none"
    model = build_bart(hf, head=head, num_labels=0 if labels is None else int(labels.shape[0]), device=device,
                       dtype=dtype or float_dtype(sd))
    read = _read(hf)
    tied = read.get("tie_word_embeddings", True, bool)
    plan = Plan(Source(sd, prefix), hf.arch)
    ignore = _put_embeddings(plan, hf, sd, model, tied, prefix)
    ignore.append(r"(model\.)?(encoder|decoder)\.version")  # transformers' _keys_to_ignore_on_load_unexpected
    plan.src.prefix = prefix
    pre = model_type in PRE_NORM
    for side, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
        table = "encoder.embedding.positions" if side == "encoder" else "decoder.pos_emb"
        plan.put(f"{table}.table.weight", f"{side}.embed_positions.weight", lambda t: t[OFFSET:])
        plan.put_pairs(f"{table}.", f"{side}.", [("norm", "layernorm_embedding")])
        for i in range(len(stack.blocks)):
            shared.put_layer(plan, f"{side}.blocks.{i}.", f"{side}.layers.{i}.", cross=side == "decoder")
        if pre:
            plan.put_pairs(f"{side}.", f"{side}.", [("norm", "layer_norm")])
    plan.src.prefix = ""
    if head == "lm":
        if not tied:
            plan.put("decoder.lm_head.weight", "lm_head.weight")
        if "final_logits_bias" in sd:
            plan.put("decoder.lm_head.bias", "final_logits_bias", lambda t: t.reshape(-1))
        else:  # transformers' _keys_to_ignore_on_load_missing: zeros
            ref = model.decoder.lm_head.bias
            plan.put_tensor("decoder.lm_head.bias", torch.zeros(ref.shape, dtype=ref.dtype), "zeros (no final_logits_bias)")
    elif head == "classifier":
        plan.put_pairs("classification_head.", "classification_head.", [("dense", "dense"), ("out_proj", "out_proj")])
    else:
        ignore.append(r"final_logits_bias")
    plan.apply(model, ignore=ignore)
    return model


def _classes(stem: str) -> tuple[str, ...]:
    return tuple(f"{stem}{h}" for h in ("ForConditionalGeneration", "Model", "ForSequenceClassification"))


#: what ``models/hf/convert.py`` dispatches here, by ``model_type``
DISPATCH = {t: parts.Dispatch(_NAMES[t], convert_bart, _classes(_STEMS[t])) for t in ("bart", "mbart", "plbart")}
