"""Encoder-decoder models: :class:`EncoderDecoder`, assembled from an encoder and a decoder with
cross-attention (what the Hugging Face seq2seq families convert to: T5, BART, Marian, Whisper, ...),
and :class:`Transformer`, the encoder-decoder of "Attention Is All You Need" (Vaswani et al. 2017)
built from a :class:`~attnzoo.models.Seq2SeqConfig`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._validate import check_cu_seqlens, check_int
from attnzoo.blocks import AttentionSpec
from attnzoo.models._common import (
    FromConfig,
    LayerCaches,
    check_padding_mask,
    check_tokens,
)
from attnzoo.models.beam_search import check_search, decoder_beam_search
from attnzoo.models.config import DecoderConfig, EncoderConfig, Seq2SeqConfig
from attnzoo.models.decoder import DecoderLM, head_width
from attnzoo.models.encoder import TransformerEncoder
from attnzoo.models.generation import GenerationRules, check_token_id, fill_token, repeat_rows
from attnzoo.models.parts import DecoderParts, ScaledEmbedding
from attnzoo.models.speculative import Speculation, speculative_generate

__all__ = ["EncoderDecoder", "Transformer"]

#: how the token-id checks word the bound of a target token
_DECODER_VOCAB = "the decoder's vocab_size"


class EncoderDecoder(nn.Module):
    """An encoder-decoder model composed of its two stacks: ``encoder`` reads the source once,
    ``decoder`` (a :class:`~attnzoo.DecoderLM` whose blocks have cross-attention) writes the target
    attending to the encoder's output. A family builder passes the stacks it built from parts
    (T5's relative-bias blocks, BART's offset positions, Whisper's convolutional audio stem)::

        model = EncoderDecoder(TransformerEncoder(config=enc_cfg, parts=enc_parts),
                               DecoderLM(config=dec_cfg, parts=DecoderParts(blocks=cross_blocks)),
                               decoder_start_token_id=0, eos_token_id=1)

    Args:
        encoder: ``encoder(src, attention_mask=src_mask [B, M] | None) -> memory [B, M', C]``: a
            :class:`~attnzoo.TransformerEncoder` over token ids, or any module of that call (an
            audio encoder over features ``[B, F, T]``, whose mask is ``None``).
        decoder: a :class:`~attnzoo.DecoderLM` with cross-attention (its blocks read ``context``).
        decoder_start_token_id: the token :meth:`generate` starts the target with when no
            ``bos_token_id`` / ``decoder_prompt`` is given (T5: the pad id; BART: ``</s>``).
        eos_token_id: the end token :meth:`generate` stops at when it is given none.

    Shapes: ``src [B, M]`` (token ids; or what the encoder takes), ``tgt [B, N]`` -> ``logits [B, N, V]``
    (the decoder's head: hidden states ``[B, N, C]`` for a model without one).
    """

    def __init__(self, encoder: nn.Module, decoder: DecoderLM, *, decoder_start_token_id: int | None = None,
                 eos_token_id: int | None = None) -> None:
        super().__init__()
        owner = type(self).__name__
        if not isinstance(encoder, nn.Module):
            raise TypeError(f"{owner}: encoder must be an nn.Module, got {type(encoder).__name__}")
        if not isinstance(decoder, DecoderLM) or not decoder.cross_attention:
            raise TypeError(f"{owner}: decoder must be a DecoderLM whose blocks have cross-attention, got "
                            f"{type(decoder).__name__}")
        for name, value in (("decoder_start_token_id", decoder_start_token_id), ("eos_token_id", eos_token_id)):
            if value is not None:
                check_token_id(value, name, decoder.vocab_size, owner, of=_DECODER_VOCAB)
        self.encoder = encoder
        self.decoder = decoder
        self.decoder_start_token_id = decoder_start_token_id
        self.eos_token_id = eos_token_id

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """``src [B, M]`` (``src_mask [B, M]`` bool, True = real) -> ``memory [B, M, C]``."""
        return self.encoder(src, attention_mask=src_mask)

    def decode(self, tgt: Tensor, memory: Tensor, *, memory_mask: Tensor | None = None,
               tgt_mask: Tensor | None = None, cache: LayerCaches | None = None) -> Tensor:
        """``tgt [B, N]`` attending causally to itself and fully to ``memory [B, M, C]`` ->
        ``logits [B, N, V]``. ``tgt_mask [B, N]`` (or ``[B, cache.length + N]``) hides padded
        target keys; ``cache`` from :meth:`init_cache` for incremental decoding."""
        return self.decoder(tgt, cache=cache, attention_mask=tgt_mask, context=memory, context_mask=memory_mask)

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> LayerCaches:
        """The decoder's caches (self-attention keys/values, and the memory's projected
        keys/values, computed on the first call)."""
        return self.decoder.init_cache(batch_size, max_len, device=device, dtype=dtype)

    def forward(self, src: Tensor, tgt: Tensor, *, src_mask: Tensor | None = None,
                tgt_mask: Tensor | None = None, src_cu_seqlens: Tensor | None = None,
                tgt_cu_seqlens: Tensor | None = None) -> Tensor:
        """Teacher-forced forward: ``src [B, M]``, ``tgt [B, N]`` (masks ``[B, M]``/``[B, N]`` bool,
        True = real token) -> ``logits [B, N, V]``.

        Packed pairs (flash-attn's varlen layout, no padding): ``src [1, Tm]`` holds ``S`` sources end to
        end, ``tgt [1, Tn]`` their ``S`` targets, ``src_cu_seqlens`` / ``tgt_cu_seqlens`` (int32
        ``[S+1]``, both the same ``S``, ending at ``Tm`` / ``Tn``) the cumulative lengths. Source ``i``
        attends to itself, target ``i`` causally to itself and (cross-attention) to source ``i`` only;
        positions restart at 0 in every sequence of both stacks. Returns ``logits [1, Tn, V]``, equal on
        every token to the padded batch's (masks and caches are not taken with packing; the encoder
        must be a packable :class:`~attnzoo.TransformerEncoder`)."""
        if src_cu_seqlens is not None or tgt_cu_seqlens is not None:
            return self._packed_forward(src, tgt, src_mask, tgt_mask, src_cu_seqlens, tgt_cu_seqlens)
        memory = self.encode(src, src_mask)
        return self.decode(tgt, memory, memory_mask=src_mask, tgt_mask=tgt_mask)

    def _packed_forward(self, src: Tensor, tgt: Tensor, src_mask: object, tgt_mask: object, src_cu_seqlens: object,
                        tgt_cu_seqlens: object, owner: str | None = None,
                        names: tuple[str, str] = ("tgt", "tgt_cu_seqlens")) -> Tensor:
        """:meth:`forward` of packed pairs (``names``: what the target and its lengths are called in
        the caller, e.g. :meth:`loss`'s ``labels``) -> ``logits [1, Tn, V]``."""
        owner = owner or f"{type(self).__name__}.forward"
        tgt_cu_name = names[1]
        src_cu, tgt_cu = self.check_packed_pairs(src, tgt, src_cu_seqlens, tgt_cu_seqlens, owner, names)
        given = [n for n, m in (("src_mask", src_mask), ("tgt_mask", tgt_mask)) if m is not None]
        if given:
            raise ValueError(f"{owner}: packed pairs (src_cu_seqlens, {tgt_cu_name}) take no {' or '.join(given)}: "
                             f"the packed sequences are unpadded, their lengths are the cu_seqlens")
        memory = self.encoder(src, cu_seqlens=src_cu)  # [1, Tm, C]
        return self.decoder(tgt, cu_seqlens=tgt_cu, context=memory, context_cu_seqlens=src_cu)  # [1, Tn, V]

    def check_packed_pairs(self, src: object, tgt: object, src_cu_seqlens: object, tgt_cu_seqlens: object,
                           owner: str, names: tuple[str, str] = ("tgt", "tgt_cu_seqlens")) -> tuple[Tensor, Tensor]:
        """Checks of packed pairs (``ValueError`` / ``TypeError`` naming the argument, what it got and
        what was expected): the encoder takes packed token ids, ``src [1, Tm]`` and the target ``[1, Tn]``
        (its argument names: ``names``) are one row each, both cumulative lengths int32 ``[S+1]`` ending
        at ``Tm`` / ``Tn`` with the same ``S``. Returns ``(src_cu_seqlens, tgt_cu_seqlens)``."""
        tgt_name, tgt_cu_name = names
        if not isinstance(self.encoder, TransformerEncoder):
            raise ValueError(f"{owner}: packed pairs (src_cu_seqlens) need an encoder over token ids that takes "
                             f"packed sequences (a TransformerEncoder); this model's encoder is "
                             f"{type(self.encoder).__name__}, whose input is not packed (Whisper's audio encoder "
                             f"reads fixed-length log-mel features [B, num_mel_bins, 3000]): pad the batch instead")
        for name, cu in (("src_cu_seqlens", src_cu_seqlens), (tgt_cu_name, tgt_cu_seqlens)):
            if cu is None:
                raise ValueError(f"{owner}: packed pairs need both src_cu_seqlens and {tgt_cu_name} (int32 [S+1]); "
                                 f"{name} is None")
        ids = ((src, "src", self.encoder.vocab_size, src_cu_seqlens, "src_cu_seqlens"),
               (tgt, tgt_name, self.decoder.vocab_size, tgt_cu_seqlens, tgt_cu_name))
        out = []
        for tokens, name, vocab, cu, cu_name in ids:
            check_tokens(tokens, vocab, owner, name)
            assert isinstance(tokens, Tensor)  # checked above
            if tokens.shape[0] != 1:
                raise ValueError(f"{owner}: packed {name} must be one row [1, T] (the sequences end to end, their "
                                 f"lengths in {cu_name}), got {name} {tuple(tokens.shape)}")
            out.append(check_cu_seqlens(cu, cu_name, owner, total=tokens.shape[1]).to(tokens.device))
        if out[0].numel() != out[1].numel():
            raise ValueError(f"{owner}: src_cu_seqlens and {tgt_cu_name} must describe the same number S of pairs; "
                             f"got S = {out[0].numel() - 1} sources and S = {out[1].numel() - 1} targets")
        return out[0], out[1]

    def loss(self, src: Tensor, labels: Tensor, *, src_mask: Tensor | None = None,
             decoder_input: Tensor | None = None, ignore_index: int = -100, src_cu_seqlens: Tensor | None = None,
             labels_cu_seqlens: Tensor | None = None) -> Tensor:
        """The teacher-forced training loss of ``labels [B, N]`` (the target tokens; ``ignore_index``
        where no loss is taken, e.g. right padding): the mean cross entropy over the counted labels of
        the logits ``forward(src, decoder_input)``, ``decoder_input [B, N]`` by default
        :meth:`shift_labels` (the labels shifted right behind :attr:`decoder_start_token_id`, as
        transformers' ``model(input_ids, labels=labels).loss`` shifts them). An ignored label feeds the start
        token to the decoder where transformers feeds the pad id: the loss is the same when ignored
        labels are right padding (the decoder is causal). Returns a 0-dim float32 tensor.

        Packed pairs (see :meth:`forward`): ``src [1, Tm]`` with ``src_cu_seqlens``, ``labels [1, Tn]``
        with ``labels_cu_seqlens`` (int32 ``[S+1]``, the same ``S``); each target sequence is shifted on
        its own (:meth:`shift_labels` of the sequences as a right-padded batch: each starts with
        :attr:`decoder_start_token_id`, or the family's rule), ``decoder_input [1, Tn]`` when given.
        The loss, the mean over the counted labels, equals the padded batch's."""
        owner = f"{type(self).__name__}.loss"
        if not isinstance(labels, Tensor) or labels.dim() != 2 or labels.is_floating_point() or labels.shape[1] == 0:
            got = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
            raise ValueError(f"{owner}: labels must be integer token ids [B, N] with N >= 1, got {got}")
        check_int(ignore_index, "ignore_index", owner, minimum=None)
        width = head_width(self.decoder.lm_head)
        if width != self.decoder.vocab_size:
            raise ValueError(f"{owner}: the model has no LM head over its {self.decoder.vocab_size} tokens "
                             f"(its head is {type(self.decoder.lm_head).__name__})")
        counted = labels.ne(ignore_index)
        bad = labels.masked_fill(~counted, 0)
        if bool(((bad < 0) | (bad >= width)).any()):
            raise ValueError(f"{owner}: labels must be token ids in [0, {width}) or ignore_index={ignore_index}")
        packed = src_cu_seqlens is not None or labels_cu_seqlens is not None
        if packed:
            _, labels_cu_seqlens = self.check_packed_pairs(src, labels.masked_fill(~counted, 0), src_cu_seqlens,
                                                           labels_cu_seqlens, owner, ("labels", "labels_cu_seqlens"))
        if decoder_input is None:
            decoder_input = self.shift_labels(labels, counted) if not packed else \
                self._shift_packed(labels, counted, labels_cu_seqlens)
        elif not isinstance(decoder_input, Tensor) or tuple(decoder_input.shape) != tuple(labels.shape):
            got = tuple(decoder_input.shape) if isinstance(decoder_input, Tensor) else type(decoder_input).__name__
            raise ValueError(f"{owner}: decoder_input must have the labels' shape {tuple(labels.shape)}, got {got}")
        if packed:
            logits = self._packed_forward(src, decoder_input, src_mask, None, src_cu_seqlens, labels_cu_seqlens, owner,
                                          ("decoder_input", "labels_cu_seqlens"))  # [1, Tn, V]
        else:
            logits = self(src, decoder_input, src_mask=src_mask)  # [B, N, V]
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, width), labels.reshape(-1),
                                                 ignore_index=ignore_index)

    def shift_labels(self, labels: Tensor, counted: Tensor) -> Tensor:
        """The decoder input :meth:`loss` feeds for ``labels [B, N]`` (``counted [B, N]``: the labels
        a loss is taken of): the labels shifted right behind :attr:`decoder_start_token_id`, the
        uncounted ones replaced by it. A family whose transformers class shifts otherwise overrides
        this (mBART: the row's last label first)."""
        start = self.decoder_start_token_id
        if start is None:
            raise ValueError(f"{type(self).__name__}.loss: the model has no decoder_start_token_id; pass "
                             f"decoder_input [B, N]")
        filled = labels.masked_fill(~counted, start)
        return torch.cat([torch.full_like(labels[:, :1], start), filled[:, :-1]], dim=1)  # [B, N]

    def _shift_packed(self, labels: Tensor, counted: Tensor, cu_seqlens: Tensor) -> Tensor:
        """The decoder input ``[1, T]`` of packed ``labels [1, T]`` (``counted [1, T]``; checked
        ``cu_seqlens [S+1]``): :meth:`shift_labels` of the sequences laid out as a right-padded batch
        ``[S, N_max]`` (padding uncounted), read back at the real tokens."""
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [S]
        width = max(int(lengths.max()), 1)
        real = torch.arange(width, device=labels.device) < lengths.to(labels.device)[:, None]  # [S, N_max]
        rows = labels.new_zeros(real.shape)
        rows[real] = labels[0]
        kept = torch.zeros_like(real)
        kept[real] = counted[0]
        return self.shift_labels(rows, kept)[real][None]  # [1, T]

    def _check_source(self, src: object, owner: str) -> Tensor:
        """``src``: token ids of a :class:`~attnzoo.TransformerEncoder`, else a tensor of ``B >= 1`` rows."""
        if isinstance(self.encoder, TransformerEncoder):
            check_tokens(src, self.encoder.vocab_size, owner, "src")
        elif not isinstance(src, Tensor) or src.dim() < 2:
            got = tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__
            raise ValueError(f"{owner}: src must be a tensor [B, ...] of what the encoder reads, got {got}")
        assert isinstance(src, Tensor)
        if src.shape[0] == 0:
            raise ValueError(f"{owner}: src must hold at least one row [B, ...] with B >= 1, got {tuple(src.shape)}")
        return src

    def _start(self, batch: int, bos_token_id: object, decoder_prompt: object, device: torch.device,
               owner: str) -> Tensor:
        """The target's first tokens ``[B, P]``: ``decoder_prompt``, else one ``bos_token_id`` (default
        :attr:`decoder_start_token_id`) per row."""
        if decoder_prompt is not None:
            if bos_token_id is not None:
                raise ValueError(f"{owner}: give bos_token_id or decoder_prompt, not both")
            prompt = check_tokens(decoder_prompt, self.decoder.vocab_size, owner, "decoder_prompt")
            if prompt.shape[0] != batch:
                raise ValueError(f"{owner}: decoder_prompt must be [B, P] with B = {batch} rows (as src), got "
                                 f"{tuple(prompt.shape)}")
            return prompt.to(device)
        start = self.decoder_start_token_id if bos_token_id is None else bos_token_id
        if start is None:
            raise ValueError(f"{owner}: bos_token_id is required (the model has no decoder_start_token_id)")
        check_int(start, "bos_token_id", owner, minimum=0)
        if start >= self.decoder.vocab_size:
            raise ValueError(f"{owner}: bos_token_id must be < {self.decoder.vocab_size}, got {start}")
        return torch.full((batch, 1), start, dtype=torch.long, device=device)

    @torch.no_grad()
    def generate(self, src: Tensor, max_new_tokens: int, *, bos_token_id: int | None = None,
                 src_mask: Tensor | None = None, eos_token_id: int | Sequence[int] | None = None,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 generator: torch.Generator | None = None, decoder_prompt: Tensor | None = None, num_beams: int = 1,
                 length_penalty: float = 1.0, early_stopping: bool | str = False,
                 forced_bos_token_id: int | None = None, forced_eos_token_id: int | None = None,
                 suppress_tokens: Sequence[int] | None = None, min_new_tokens: int = 0, no_repeat_ngram_size: int = 0,
                 repetition_penalty: float = 1.0, pad_token_id: int | None = None,
                 num_return_sequences: int = 1, min_length: int = 0, min_p: float | None = None,
                 bad_words_ids: Sequence[Sequence[int]] | None = None,
                 assistant_model: EncoderDecoder | DecoderLM | None = None, num_assistant_tokens: int = 20,
                 assistant_confidence_threshold: float = 0.4, prompt_lookup_num_tokens: int | None = None,
                 max_matching_ngram_size: int = 2) -> Tensor:
        """Encode ``src`` once, then decode with the cache from ``decoder_prompt [B, P]`` (e.g.
        Whisper's task tokens) or from one ``bos_token_id`` per row (default
        :attr:`decoder_start_token_id`).

        The sampling settings (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``generator``) are
        those of :meth:`DecoderLM.generate`; ``eos_token_id`` defaults to
        :attr:`eos_token_id` (a row that wrote one then holds ``pad_token_id``; generation stops when
        every row has ended). ``num_beams > 1``: beam search as transformers runs it
        (:mod:`attnzoo.models.beam_search`; ``length_penalty``, ``early_stopping`` ``True`` /
        ``False`` / ``"never"``; not with sampling settings), each row's best hypothesis, filled with
        the end token after it. ``forced_bos_token_id``: the token written after a one-token start
        (a target language: M2M100 / NLLB, mBART-50), ``forced_eos_token_id``: the last of the
        ``max_new_tokens``, both as transformers' processors of those names force them (a forced
        token counts in the length beam search divides by; the end token wins when both fall on one
        step). ``suppress_tokens`` (never generated: opus-mt's ``bad_words_ids=[[pad]]``, Whisper's
        ``suppress_tokens``), ``min_new_tokens`` (no end token before), ``min_length`` (nor before
        the target holds this many tokens, its start tokens counted: bart-large-cnn's 56),
        ``no_repeat_ngram_size`` (bart-large-cnn: 3), ``bad_words_ids``, ``repetition_penalty`` (of the target's tokens so far), ``pad_token_id``
        (what an ended row holds; default the first end token; ``eos_token_id`` may list several)
        and ``num_return_sequences`` as :meth:`DecoderLM.generate`, in beam search too.
        Speculative decoding (greedy or sampled; :mod:`attnzoo.models.speculative`) as :meth:`DecoderLM.generate`:
        ``prompt_lookup_num_tokens`` (drafts from the target's own tokens), or ``assistant_model``
        (drafting ``num_assistant_tokens``, ``assistant_confidence_threshold``): a smaller
        ``EncoderDecoder`` that encodes ``src`` itself (distil-whisper for Whisper), or a decoder
        with cross-attention that reads this model's encoding (a shared encoder). Every
        argument is checked before the source is encoded. Returns ``[B * R, P + T]`` (the start
        tokens first; ``R = num_return_sequences``, rows ``b * R + r``), ``T <= max_new_tokens``.
        """
        owner = f"{type(self).__name__}.generate"
        src = self._check_source(src, owner)
        start = self._start(src.shape[0], bos_token_id, decoder_prompt, src.device, owner)
        new = check_int(max_new_tokens, "max_new_tokens", owner, minimum=0)
        checked, beams, length_penalty, early_stopping, _ = check_search(
            temperature, top_k, top_p, min_p, generator, num_beams, length_penalty, early_stopping,
            num_return_sequences, owner)
        spec = self._speculation((assistant_model, num_assistant_tokens, assistant_confidence_threshold,
                                  prompt_lookup_num_tokens, max_matching_ngram_size), src, start.shape[1], new,
                                 beams, owner)
        forced = tuple(None if t is None else check_token_id(t, name, self.decoder.vocab_size, owner, of=_DECODER_VOCAB)
                       for name, t in (("forced_bos_token_id", forced_bos_token_id),
                                       ("forced_eos_token_id", forced_eos_token_id)))
        eos = self.decoder._check_generate(start.shape[1], new, self.eos_token_id if eos_token_id is None
                                           else eos_token_id, owner=owner)
        rules = GenerationRules.checked(suppress_tokens, min_new_tokens, eos, self.decoder.vocab_size, owner,
                                        no_repeat_ngram_size, repetition_penalty, min_length, start.shape[1],
                                        bad_words_ids)
        clash = [f"{name}={t}" for name, t in zip(("forced_bos_token_id", "forced_eos_token_id"), forced, strict=True)
                 if t is not None and t in rules.suppress]
        if clash:
            raise ValueError(f"{owner}: {' and '.join(clash)} is also in suppress_tokens: a token cannot be both "
                             f"forced and never generated")
        fill = fill_token(pad_token_id, eos, self.decoder.vocab_size, owner)
        if src_mask is not None:
            src_mask = check_padding_mask(src_mask, src.shape[0], src.shape[-1], owner, "src_mask")
        memory = self.encode(src, src_mask)
        if spec is not None and isinstance(assistant_model, EncoderDecoder):  # it reads its own encoding
            spec = spec._replace(context=(assistant_model.encode(src, src_mask), src_mask))
        if beams > 1:
            return decoder_beam_search(self.decoder, start, memory, src_mask, num_beams=beams, max_new_tokens=new,
                                       eos_token_id=eos or None, length_penalty=length_penalty,
                                       early_stopping=early_stopping, forced=forced,  # type: ignore[arg-type]
                                       rules=rules, pad_token_id=pad_token_id,
                                       num_return_sequences=num_return_sequences).tokens
        sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
                    "generator": generator, "num_return_sequences": num_return_sequences}
        return self._sampled(start, new, memory, src_mask, forced, rules, fill, sampling,
                             None if spec is None else (spec, None if checked[0] == 0.0 else checked))

    def _speculation(self, settings: tuple[object, ...], src: Tensor, n: int, new: int, beams: int,
                     owner: str) -> Speculation | None:
        """The speculative ``settings`` of :meth:`generate` checked by the decoder's rules (an
        encoder-decoder assistant: its decoder, and it must read ``src``)."""
        assistant = settings[0]
        if isinstance(assistant, EncoderDecoder):
            assistant._check_source(src, f"{owner} (assistant_model)")
            settings = (assistant.decoder, *settings[1:])
        return self.decoder._speculation((*settings, False), n, new, beams, False, context=True, owner=owner)

    def _sampled(self, start: Tensor, new: int, memory: Tensor, src_mask: Tensor | None,
                 forced: tuple[int | None, int | None], rules: GenerationRules, fill: int | None,
                 sampling: dict[str, Any], spec: tuple[Speculation, tuple[Any, ...] | None] | None = None) -> Tensor:
        """Greedy, sampled or speculative decoding of :meth:`generate` (the decoder's own, with the
        forced tokens written around it): ``start [B, P]``, ``memory [B, M, C]``, ``spec`` the
        speculation and the checked sampling settings (``None``: greedy); returns ``[B * R, P + T]``."""
        bos_forced, eos_forced = forced
        last = eos_forced is not None and new >= 1  # the last token is the forced end token
        least = rules.min_new_tokens
        if bos_forced is not None and start.shape[1] == 1 and new - last >= 1:
            start = torch.cat([start, torch.full_like(start, bos_forced)], dim=1)  # greedy or sampled: written
            new, least = new - 1, max(least - 1, 0)  # the forced token is the first new one
            if bos_forced in rules.eos:  # every row ended with its first token
                return start.repeat_interleave(sampling["num_return_sequences"], dim=0)
        if spec is not None and new - last > 0:
            out = self._speculative(start, new - last, memory, src_mask, rules._replace(min_new_tokens=least), fill,
                                    spec, sampling)
        else:
            out = self.decoder.generate(start, new - last, eos_token_id=rules.eos or None, context=memory,
                                        context_mask=src_mask, suppress_tokens=rules.suppress, min_new_tokens=least,
                                        bad_words_ids=[list(w) for w in rules.bad_words] or None,
                                        no_repeat_ngram_size=rules.no_repeat_ngram_size,
                                        repetition_penalty=rules.repetition_penalty, pad_token_id=fill, **sampling)
        P = start.shape[1]
        ends = torch.tensor(rules.eos, dtype=torch.long, device=out.device)
        done = torch.isin(out[:, P:], ends).any(1)  # [B * R]
        if last and not bool(done.all()) and out.shape[1] == P + new - 1:  # ran to the end
            forced_end = torch.full_like(out[:, 0], eos_forced)  # type: ignore[arg-type]
            col = forced_end if fill is None else torch.where(done, fill, forced_end)  # ended rows keep their fill
            out = torch.cat([out, col[:, None]], dim=1)
        return out


    def _speculative(self, start: Tensor, new: int, memory: Tensor, src_mask: Tensor | None, rules: GenerationRules,
                     fill: int | None, spec: tuple[Speculation, tuple[Any, ...] | None],
                     sampling: dict[str, Any]) -> Tensor:
        """:func:`~attnzoo.models.speculative.speculative_generate` of the decoder, every row (and
        an assistant's own encoding) repeated ``num_return_sequences`` times."""
        R = sampling["num_return_sequences"]
        speculation, checked = spec
        if speculation.context is not None:
            speculation = speculation._replace(context=repeat_rows(R, *speculation.context))
        start, memory, src_mask = repeat_rows(R, start, memory, src_mask)
        return speculative_generate(self.decoder, start, new, None, rules, fill, speculation, memory, src_mask,
                                    f"{type(self).__name__}.generate", checked, sampling["generator"])


class Transformer(FromConfig, EncoderDecoder):
    """Encoder-decoder transformer (an :class:`EncoderDecoder`): a :class:`TransformerEncoder` reads
    the source, a :class:`DecoderLM` with cross-attention writes the target.

    Defaults follow the paper (and ``torch.nn.Transformer``): post-norm blocks with a final
    LayerNorm after each stack, ReLU feed-forward of width ``4 * dim``, sinusoidal positions,
    token embeddings scaled by ``sqrt(dim)``, dropout 0.1.

    Build it from a :class:`~attnzoo.models.Seq2SeqConfig` (``config=``, ``from_config``; preset
    ``transformer_base``). The constructor's own keywords (the six positionals, ``attention``,
    ``dropout``, ``norm_first``) are shorthands for those fields and override ``config``'s when
    given; every other field goes through ``config=``.

    The config's fields:
        src_vocab_size, tgt_vocab_size: vocabularies.
        dim, num_heads: width ``C`` and heads.
        encoder_depth, decoder_depth: number of blocks of each stack.
        ffn, ffn_hidden, norm, norm_eps, norm_first, dropout, bias: as in :class:`TransformerBlock`.
        pos: ``"sinusoidal" | "learned" | "rope" | "none"`` for both stacks.
        max_seq_len: positions of each stack.
        attention, attention_kwargs: the decoder's self-attention (registry name or factory);
            ``encoder_attention`` the encoder's (default: same name, non-causal).
        tie_embeddings: the decoder's output head shares its token embeddings.

    Shapes: ``src [B, M]``, ``tgt [B, N]`` -> ``logits [B, N, tgt_vocab_size]``.
    """

    config_class = Seq2SeqConfig

    def __init__(self, src_vocab_size: int | None = None, tgt_vocab_size: int | None = None,
                 dim: int | None = None, num_heads: int | None = None, encoder_depth: int | None = None,
                 decoder_depth: int | None = None, *, attention: AttentionSpec | None = None,
                 dropout: float | None = None, norm_first: bool | None = None, config: Seq2SeqConfig | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        given = {"src_vocab_size": src_vocab_size, "tgt_vocab_size": tgt_vocab_size, "dim": dim,
                 "num_heads": num_heads, "encoder_depth": encoder_depth, "decoder_depth": decoder_depth,
                 "attention": attention, "dropout": dropout, "norm_first": norm_first}
        cfg = Seq2SeqConfig.resolve(config, "Transformer", given)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        super().__init__(TransformerEncoder(config=self.encoder_config(cfg), **kw), self.build_decoder(cfg, **kw))
        self.config = cfg

    @staticmethod
    def _common(cfg: Seq2SeqConfig) -> dict[str, Any]:
        return {"dim": cfg.dim, "num_heads": cfg.num_heads, "ffn": cfg.ffn, "ffn_hidden": cfg.ffn_hidden,
                "norm": cfg.norm, "norm_eps": cfg.norm_eps, "max_seq_len": cfg.max_seq_len, "pos": cfg.pos,
                "dropout": cfg.dropout, "bias": cfg.bias}

    @classmethod
    def encoder_config(cls, cfg: Seq2SeqConfig) -> EncoderConfig:
        """The encoder stack: non-causal, no embedding norm, ``encoder_attention`` (default: the
        decoder's attention name)."""
        attention = cfg.attention if cfg.encoder_attention is None else cfg.encoder_attention
        return EncoderConfig(cfg.src_vocab_size, depth=cfg.encoder_depth, attention=attention, embed_norm=False,
                             norm_first=cfg.norm_first, embed_scale=math.sqrt(cfg.dim), final_norm=True,
                             **cls._common(cfg))

    @classmethod
    def decoder_config(cls, cfg: Seq2SeqConfig) -> DecoderConfig:
        """The decoder stack's config (its blocks add cross-attention, see :meth:`build_decoder`)."""
        return DecoderConfig(cfg.tgt_vocab_size, depth=cfg.decoder_depth, attention=cfg.attention,
                             attention_kwargs=cfg.attention_kwargs, tie_embeddings=cfg.tie_embeddings,
                             **cls._common(cfg))

    @classmethod
    def build_decoder(cls, cfg: Seq2SeqConfig, *, device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None) -> DecoderLM:
        """The decoder: blocks with causal self-attention and cross-attention to the encoder's
        output (post-norm unless ``norm_first``), token embeddings scaled by ``sqrt(dim)``, a final
        norm (:meth:`DecoderLM.with_blocks`)."""
        stack = cls.decoder_config(cfg)
        embedding = ScaledEmbedding(stack.vocab_size, stack.dim, scale=math.sqrt(cfg.dim), device=device, dtype=dtype)
        nn.init.normal_(embedding.weight, 0.0, 0.02)
        return DecoderLM.with_blocks(stack, lambda block, _: block.replace(cross_attention=True,
                                                                           norm_first=cfg.norm_first),
                                     parts=DecoderParts(embedding=embedding), device=device, dtype=dtype)
