"""Generation's per-step pieces, shared by :meth:`DecoderLM.generate <attnzoo.DecoderLM.generate>`,
:meth:`EncoderDecoder.generate <attnzoo.EncoderDecoder.generate>` and
:mod:`attnzoo.models.beam_search`: the sampling settings and :func:`sample_next_token`, the end
tokens (:func:`check_end_tokens`: one id or several, as Llama 3's and Qwen's generation configs
list them), the fill of ended rows (:func:`fill_token`) and :class:`GenerationRules`, the logit
rules transformers' processors of the same names apply.

Shapes: ``R`` rows (``B``, or ``B * K`` in beam search), ``V`` tokens, ``T`` tokens so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo._validate import (
    check_float,
    check_float_tensor,
    check_int,
    check_nonnegative_float,
    check_optional_int,
    check_positive_float,
)

__all__ = ["GenerationRules", "check_end_tokens", "check_sampling", "check_token_id", "fill_token",
           "sample_next_token"]


def check_sampling(temperature: object, top_k: object, top_p: object, generator: object,
                   owner: str, min_p: object = None) -> tuple[float, int | None, float | None, float | None]:
    """The sampling settings of :func:`sample_next_token` and ``generate`` (one check for both):
    ``temperature`` a finite float ``>= 0``, ``top_k`` ``None`` or an int ``>= 1`` (above the
    vocabulary it keeps every token), ``top_p`` ``None`` or a float in ``(0, 1]``, ``min_p``
    ``None`` or a float in ``[0, 1]``, ``generator`` ``None`` or a ``torch.Generator``. Returns
    ``(temperature, top_k, top_p, min_p)``."""
    t = check_nonnegative_float(temperature, "temperature", owner)
    k = check_optional_int(top_k, "top_k", owner, minimum=1)
    p = None
    if top_p is not None:
        p = check_float(top_p, "top_p", owner, expected="a float in (0, 1] or None")
        if not 0.0 < p <= 1.0:
            raise ValueError(f"{owner}: top_p must be a float in (0, 1], got {top_p!r}")
    m = None
    if min_p is not None:
        m = check_float(min_p, "min_p", owner, expected="a float in [0, 1] or None")
        if not 0.0 <= m <= 1.0:
            raise ValueError(f"{owner}: min_p must be a float in [0, 1], got {min_p!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{owner}: generator must be a torch.Generator or None, got {type(generator).__name__} "
                        f"({generator!r})")
    return t, k, p, m


def _check_logits(logits: object, owner: str) -> Tensor:
    """``logits`` a floating tensor ``[B, V]`` (``V >= 1``) with no NaN or ``+inf`` and a logit above
    ``-inf`` in every row (eager only: reading the values syncs)."""
    logits = check_float_tensor(logits, "logits", owner, "[B, V]", nonempty=1)
    if logits.numel() and not tracing():  # one read-back for the three value checks
        nan, posinf, hidden = (int(c) for c in torch.stack([torch.isnan(logits).sum(), torch.isposinf(logits).sum(),
                                                            torch.isneginf(logits).all(dim=-1).sum()]).tolist())
        if nan or posinf:
            raise ValueError(f"{owner}: logits must not hold NaN or +inf, got {nan} NaN and {posinf} +inf")
        if hidden:
            rows = torch.isneginf(logits).all(dim=-1).nonzero().flatten().tolist()
            raise ValueError(f"{owner}: logits rows {rows} are all -inf: no token to pick")
    return logits


def sample_next_token(logits: Tensor, *, temperature: float = 0.0, top_k: int | None = None,
                      top_p: float | None = None, generator: torch.Generator | None = None,
                      min_p: float | None = None) -> Tensor:
    """Pick the next token from ``logits [B, V]`` (floating point, no NaN, a logit above ``-inf``
    in every row).

    ``temperature == 0`` is greedy (argmax; ``top_k``/``top_p`` are then irrelevant). Otherwise
    the logits are divided by ``temperature`` (a finite float ``> 0``), restricted to the
    ``top_k`` largest (an int ``>= 1``; every token when ``top_k >= V``) and to the smallest set
    of tokens whose probability reaches ``top_p`` (in ``(0, 1]``; nucleus; the most likely token
    is always kept), then to the tokens at least ``min_p`` times as likely as the most likely one
    (in ``[0, 1]``; transformers' ``min_p``, applied after ``top_p``), and sampled with
    ``generator``. Returns ``[B]`` long. Bad arguments raise ``TypeError``/``ValueError`` naming
    them.
    """
    owner = "sample_next_token"
    temperature, top_k, top_p, min_p = check_sampling(temperature, top_k, top_p, generator, owner, min_p)
    return _sample(_check_logits(logits, owner), temperature, top_k, top_p, min_p, generator)


def check_end_tokens(eos_token_id: object, vocab_size: int, owner: str, name: str = "eos_token_id") -> tuple[int, ...]:
    """``eos_token_id``: ``None`` (no end token), one token id, or a non-empty sequence of them
    (transformers' ``eos_token_id`` list: generation of a row ends at any of them), each in
    ``[0, vocab_size)``. Returns the ids as a tuple (empty for ``None``); ``TypeError`` /
    ``ValueError`` naming ``name`` otherwise."""
    if eos_token_id is None:
        return ()
    if isinstance(eos_token_id, (str, bytes, Tensor)) or not isinstance(eos_token_id, (int, Sequence)):
        raise TypeError(f"{owner}: {name} must be a token id, a sequence of token ids or None, got "
                        f"{type(eos_token_id).__name__} ({eos_token_id!r})")
    ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    if not ids:
        raise ValueError(f"{owner}: {name} must name at least one token (or be None), got {eos_token_id!r}")
    return tuple(dict.fromkeys(check_token_id(t, name, vocab_size, owner) for t in ids))


def check_token_id(token: object, name: str, vocab_size: int, owner: str, of: str = "vocab_size") -> int:
    """``token`` a token id in ``[0, vocab_size)`` (``TypeError`` / ``ValueError`` naming ``name``;
    ``of`` words the bound, e.g. "the decoder's vocab_size")."""
    if check_int(token, name, owner, minimum=0) >= vocab_size:
        raise ValueError(f"{owner}: {name} must be < {of}={vocab_size}, got {token}")
    return token  # type: ignore[return-value]


def fill_token(pad_token_id: object, eos: tuple[int, ...], vocab_size: int, owner: str) -> int | None:
    """What a row holds after its end token: ``pad_token_id`` (an id in ``[0, vocab_size)``), by
    default the first end token (transformers' default pad); ``None`` when there is no end token
    (rows never end) and no pad."""
    if pad_token_id is None:
        return eos[0] if eos else None
    return check_token_id(pad_token_id, "pad_token_id", vocab_size, owner)


class GenerationRules(NamedTuple):
    """Logit rules of generation, as transformers' processors of those names apply them (on the
    logits before greedy / sampled picks, on the log-probabilities in beam search), in
    transformers' order: ``repetition_penalty`` ``p``: the score ``s`` of every token the row
    already holds (its start tokens included, its padding not) becomes ``s * p`` where ``s < 0``
    and ``s / p`` otherwise; ``no_repeat_ngram_size`` ``n``: no token that would repeat an
    ``n``-gram of the row's tokens so far (padding included, as transformers); every end token
    ``eos`` forbidden while fewer than ``min_new_tokens`` new tokens are written; ``suppress``,
    the token ids never generated; ``bad_words``, token sequences of two or more never completed
    (the last token of one is forbidden after the others: transformers' ``bad_words_ids``)."""

    suppress: tuple[int, ...] = ()
    min_new_tokens: int = 0
    eos: tuple[int, ...] = ()
    no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.0
    bad_words: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def checked(cls, suppress_tokens: object, min_new_tokens: object, eos: tuple[int, ...], vocab_size: int,
                owner: str, no_repeat_ngram_size: object = 0, repetition_penalty: object = 1.0,
                min_length: object = 0, start: int = 0, bad_words_ids: object = None) -> GenerationRules:
        """The rules of ``generate``'s arguments, each checked (``TypeError`` / ``ValueError`` naming
        it); ``eos``: the end tokens of :func:`check_end_tokens`. ``min_length`` counts the
        ``start`` tokens too (transformers' ``MinLengthLogitsProcessor``: the prompt, padding
        included, or a decoder's start tokens), so it is held as ``min_length - start`` new tokens.
        ``bad_words_ids``: sequences of token ids; a one-token one joins ``suppress`` (but an end
        token, which transformers drops from them), the longer ones are ``bad_words``."""
        tokens = _token_ids(suppress_tokens, "suppress_tokens", vocab_size, owner)
        words = [] if bad_words_ids is None else _bad_words(bad_words_ids, vocab_size, owner)
        tokens += tuple(w[0] for w in words if len(w) == 1 and w[0] not in eos)
        least = max(check_int(min_new_tokens, "min_new_tokens", owner, minimum=0),
                    check_int(min_length, "min_length", owner, minimum=0) - start)
        return cls(tokens, least, eos, check_int(no_repeat_ngram_size, "no_repeat_ngram_size", owner, minimum=0),
                   check_positive_float(repetition_penalty, "repetition_penalty", owner),
                   tuple(w for w in words if len(w) > 1))

    def apply(self, scores: Tensor, written: int, tokens: Tensor | None = None,
              counted: Tensor | None = None) -> Tensor:
        """``scores [R, V]`` for the next token after ``written`` new tokens, the rules applied (a
        copy when any applies). ``tokens [R, T]``: each row's tokens so far (for
        ``repetition_penalty`` and ``no_repeat_ngram_size``); ``counted [R, T]`` bool: those the
        repetition penalty looks at (``None``: all; left padding is not counted)."""
        out = scores
        if self.repetition_penalty != 1.0 and tokens is not None:
            out = _penalise_repeats(out, tokens, counted, self.repetition_penalty)
        banned = list(self.suppress)
        if written < self.min_new_tokens:
            banned.extend(self.eos)
        repeats = None if not self.no_repeat_ngram_size or tokens is None else _repeated_ngrams(
            tokens, self.no_repeat_ngram_size, scores.shape[-1])
        if self.bad_words and tokens is not None:
            completing = _completing_bad_words(tokens, self.bad_words, scores.shape[-1])
            repeats = completing if repeats is None else repeats | completing
        if not banned and repeats is None:
            return out
        out = out.clone() if out is scores else out
        out[:, banned] = float("-inf")
        return out if repeats is None else out.masked_fill(repeats, float("-inf"))


def _token_ids(value: object, name: str, vocab_size: int, owner: str) -> tuple[int, ...]:
    """``None`` or a sequence of token ids in ``[0, vocab_size)`` (``TypeError`` / ``ValueError``
    naming ``name``) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Tensor)) or not isinstance(value, Sequence):
        raise TypeError(f"{owner}: {name} must be a sequence of token ids, got {type(value).__name__}")
    return tuple(check_token_id(t, name, vocab_size, owner) for t in value)


def _bad_words(value: object, vocab_size: int, owner: str) -> list[tuple[int, ...]]:
    """``bad_words_ids``: a sequence of non-empty sequences of token ids."""
    if isinstance(value, (str, bytes, Tensor)) or not isinstance(value, Sequence):
        raise TypeError(f"{owner}: bad_words_ids must be a sequence of token id sequences, got {type(value).__name__}")
    words = [_token_ids(w, "bad_words_ids", vocab_size, owner) for w in value]
    if any(not w for w in words):
        raise ValueError(f"{owner}: bad_words_ids must not hold an empty sequence, got {value!r}")
    return words


def _completing_bad_words(tokens: Tensor, words: tuple[tuple[int, ...], ...], vocab: int) -> Tensor:
    """``[R, V]`` bool: the last token of every word of ``words`` whose other tokens end ``tokens
    [R, T]`` (transformers' ``NoBadWordsLogitsProcessor``, its multi-token words)."""
    R, T = tokens.shape
    out = torch.zeros(R, vocab, dtype=torch.bool, device=tokens.device)
    for word in words:
        prefix = word[:-1]
        if len(prefix) <= T:
            ends = (tokens[:, T - len(prefix):] == torch.tensor(prefix, device=tokens.device)).all(dim=1)  # [R]
            out[:, word[-1]] |= ends
    return out


def _penalise_repeats(scores: Tensor, tokens: Tensor, counted: Tensor | None, penalty: float) -> Tensor:
    """``scores [R, V]`` with transformers' ``RepetitionPenaltyLogitsProcessor`` applied for the
    tokens ``tokens [R, T]`` holds where ``counted [R, T]`` (``None``: all of them)."""
    R, V = scores.shape
    ids = tokens.clamp(0, V) if counted is None else tokens.clamp(0, V).masked_fill(~counted, V)  # [R, T]
    seen = torch.zeros(R, V + 1, dtype=torch.bool, device=scores.device).scatter_(1, ids, True)[:, :V]  # [R, V]
    return torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


def _repeated_ngrams(tokens: Tensor, n: int, vocab: int) -> Tensor | None:
    """``[R, V]`` bool: the tokens that would complete, after ``tokens [R, T]``, an ``n``-gram the
    row already holds (transformers' ``NoRepeatNGramLogitsProcessor``); ``None`` while the row holds
    no ``n``-gram (``T < n``)."""
    R, T = tokens.shape
    if n > T:
        return None
    windows = tokens.unfold(1, n, 1)  # [R, T - n + 1, n]: every n-gram of the row
    prefix = tokens[:, T - (n - 1):]  # [R, n - 1]: what the next token would follow
    match = (windows[:, :, : n - 1] == prefix[:, None, :]).all(dim=-1)  # [R, W]
    out = torch.zeros(R, vocab, dtype=torch.int32, device=tokens.device)
    out.scatter_reduce_(1, windows[:, :, n - 1].clamp(0, vocab - 1), match.to(torch.int32), reduce="amax")
    return out.bool()  # [R, V]: any matching n-gram bans its last token


def repeat_rows(times: int, *tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """Each tensor's rows repeated ``times`` times in place (rows ``b * times + r``; ``None`` kept):
    the inputs of ``num_return_sequences`` samples of every row."""
    return tuple(t if t is None or times == 1 else t.repeat_interleave(times, dim=0) for t in tensors)


def _sample(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None, min_p: float | None,
            generator: torch.Generator | None) -> Tensor:
    """:func:`sample_next_token` on checked arguments (``generate`` checks its settings once, not at
    every step)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sampling_probs(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None,
                   min_p: float | None) -> Tensor:
    """The distribution ``[R, V]`` (float32) sampling draws from after ``logits [R, V]``: the
    temperature, ``top_k``, ``top_p`` and ``min_p`` applied (checked settings, ``temperature > 0``)."""
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature  # <= 0: no overflow at a tiny temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass strictly before each token
        drop_sorted = before >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p:  # transformers' MinPLogitsWarper, after top_p: below min_p times the top probability
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits.softmax(dim=-1)
