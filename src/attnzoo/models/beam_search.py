"""Beam search, as transformers runs it (``GenerationMixin._beam_search`` of transformers 5.25 and its
helpers in ``generation/utils.py``), for any model that gives next-token logits row by row.

``B`` source rows, ``K = num_beams`` beams each (flattened rows ``b * K + k``), ``V`` tokens, ``P``
start tokens, ``L = P + max_new_tokens``. Each step:

1. ``log_softmax`` (in float32) of the ``[B * K, V]`` logits, plus each beam's running score
   (the sum of its tokens' log-probabilities; at the first step beam 0 has score 0 and the others
   ``-1e9``, so that they do not repeat it);
2. the best ``2K`` of the ``K * V`` continuations of each row (``torch.topk``);
3. a continuation *hits a stopping criterion* when its token is ``eos_token_id`` or the sequence
   reaches ``L`` tokens. The best ``K`` that do not hit one are the next running beams (the
   model's caches are reordered to them: :meth:`~attnzoo.nn.cache.KVCache.reorder`);
4. those among the first ``K`` of the ``2K`` that hit one become finished hypotheses with score
   ``sum_logprobs / generated_length ** length_penalty`` (``generated_length`` counts the new
   tokens, the end token included, not the ``P`` start tokens); each row keeps its best ``K``;
5. a row is done when it holds ``K`` finished hypotheses and (``early_stopping``):

   * ``True``: at once (no more hypotheses are added to it);
   * ``False``: when the best running beam's score divided by ``(current length - P) **
     length_penalty`` is below the worst finished score (a heuristic: with ``length_penalty > 0``
     a longer hypothesis may still have scored better);
   * ``"never"``: as ``False``, but with ``length_penalty > 0`` the bound divides by ``(L - P) **
     length_penalty`` (exact: no hypothesis that could still win is dropped).

   The search stops when every row is done or ``L`` tokens are reached. The result is each row's
   best hypothesis, every row cut to the longest of them and filled after its end token with
   ``eos_token_id`` (transformers fills with the pad id when the model has a non-zero one).

The arithmetic (float32 scores, the ``-1e9`` penalties, the ``topk`` calls and the order of the
candidates) is transformers', so the tokens are the same, ties included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from attnzoo._validate import check_finite_float, check_int
from attnzoo.models._common import check_left_padding, positions_from_mask
from attnzoo.models.generation import (
    GenerationRules,
    check_end_tokens,
    check_sampling,
    check_token_id,
)

__all__ = ["BeamSearchOutput", "CachedDecoder", "beam_search", "check_beam_settings", "check_returns", "check_search",
           "decoder_beam_search", "refuse_sampling"]

#: what transformers adds to a score to rule a beam or a hypothesis out
_NEG = -1.0e9
#: the bound :func:`beam_search` checks its end tokens with (its callers check them against their vocabulary)
_ANY_VOCAB = 2 ** 62


class CachedDecoder(Protocol):
    """What :func:`decoder_beam_search` uses of a :class:`~attnzoo.DecoderLM` (declared here, so
    that this module does not import the model that calls it)."""

    vocab_size: int

    def init_cache(self, batch_size: int, max_len: int) -> Any: ...

    def _decode_step(self, tokens: Tensor, cache: Any, positions: Tensor | None, attention_mask: Tensor | None,
                     context: Tensor | None, context_mask: Tensor | None) -> Tensor: ...

    def _last_logits(self, tokens: Tensor, cache: Any, positions: Tensor | None, attention_mask: Tensor | None,
                     context: Tensor | None, context_mask: Tensor | None) -> Tensor: ...


class BeamSearchOutput(NamedTuple):
    """The result of :func:`beam_search`.

    Attributes:
        tokens: ``[B * R, P + T]`` long: each row's ``R = num_return_sequences`` best hypotheses
            (best first; row ``b * R + r``) after its ``P`` start tokens, ``T <= max_new_tokens``
            (the longest of them), filled after a hypothesis' end token with ``pad_token_id``
            (see :func:`beam_search`).
        scores: ``[B * R]`` float32: each hypothesis' score, ``sum_logprobs / T_b ** length_penalty``
            (``T_b`` its own generated length) — transformers' ``sequences_scores``.
        lengths: ``[B * R]`` long: ``T_b``, each hypothesis' generated tokens (end token included).
    """

    tokens: Tensor
    scores: Tensor
    lengths: Tensor


def check_beam_settings(num_beams: object, length_penalty: object, early_stopping: object,
                        owner: str) -> tuple[int, float, bool | str]:
    """``num_beams`` an int ``>= 1``; ``length_penalty`` a finite float (ints accepted);
    ``early_stopping`` ``True``, ``False`` or ``"never"``. ``TypeError`` / ``ValueError`` naming
    the argument; returns ``(num_beams, length_penalty, early_stopping)``."""
    k = check_int(num_beams, "num_beams", owner, minimum=1)
    lp = check_finite_float(length_penalty, "length_penalty", owner)
    assert lp is not None
    if isinstance(early_stopping, str):
        if early_stopping != "never":
            raise ValueError(f"{owner}: early_stopping must be True, False or 'never', got {early_stopping!r}")
    elif not isinstance(early_stopping, bool):
        raise TypeError(f"{owner}: early_stopping must be True, False or 'never', got "
                        f"{type(early_stopping).__name__} ({early_stopping!r})")
    return k, lp, early_stopping


def refuse_sampling(temperature: float, top_k: int | None, top_p: float | None,
                    generator: torch.Generator | None, owner: str, min_p: float | None = None) -> None:
    """Beam search is deterministic: ``ValueError`` naming the sampling settings given with
    ``num_beams > 1`` (``temperature != 0``, ``top_k``, ``top_p``, ``min_p``, ``generator``)."""
    given = [name for name, on in (("temperature", temperature != 0.0), ("top_k", top_k is not None),
                                   ("top_p", top_p is not None), ("min_p", min_p is not None),
                                   ("generator", generator is not None)) if on]
    if given:
        raise ValueError(f"{owner}: num_beams > 1 is deterministic beam search; sampling with beams is not "
                         f"supported, so {', '.join(given)} must be left at their defaults (temperature=0.0, "
                         f"top_k/top_p/min_p/generator None)")


def check_search(temperature: object, top_k: object, top_p: object, min_p: object, generator: object,
                 num_beams: object, length_penalty: object, early_stopping: object, num_return_sequences: object,
                 owner: str) -> tuple[tuple[Any, ...], int, float, bool | str, int]:
    """``generate``'s sampling and search settings, checked together (:func:`check_sampling`,
    :func:`check_beam_settings`, no sampling with beams, :func:`check_returns`): ``(sampling,
    num_beams, length_penalty, early_stopping, num_return_sequences)``."""
    sampling = check_sampling(temperature, top_k, top_p, generator, owner, min_p)
    beams, lp, stop = check_beam_settings(num_beams, length_penalty, early_stopping, owner)
    if beams > 1:
        refuse_sampling(temperature, top_k, top_p, generator, owner, min_p)  # type: ignore[arg-type]
    return sampling, beams, lp, stop, check_returns(num_return_sequences, beams, owner, temperature=sampling[0])


def _gather(t: Tensor, beams: Tensor) -> Tensor:
    """``t [B, K, ...]`` at ``beams [B, K']`` along dim 1 -> ``[B, K', ...]`` (transformers' ``_gather_beams``)."""
    while beams.dim() < t.dim():
        beams = beams.unsqueeze(-1)
    return torch.take_along_dim(t, beams, dim=1)


def _check_start(start: object, owner: str) -> None:
    """``start``: integer ids ``[B, P]``, ``B, P >= 1``."""
    if not isinstance(start, Tensor) or start.dim() != 2 or start.is_floating_point() or start.shape[0] == 0 \
            or start.shape[1] == 0:
        got = tuple(start.shape) if isinstance(start, Tensor) else type(start).__name__
        raise ValueError(f"{owner}: start must be integer token ids [B, P] with B, P >= 1, got {got}")


def _initial(start: Tensor, K: int, L: int, fill: int) -> tuple[Tensor, ...]:
    """The search's state before the first step: ``running [B, K, L]`` (the start tokens, then
    ``fill``), ``running_scores [B, K]`` (0 for beam 0, ``-1e9`` for the others), and the
    finished hypotheses — none yet: ``sequences [B, K, L]``, ``scores [B, K]`` at ``-1e9``,
    ``lengths [B, K]``, ``finished [B, K]`` all False."""
    (B, P), dev = start.shape, start.device
    running = torch.full((B, K, L), fill, dtype=torch.long, device=dev)
    running[:, :, :P] = start.long()[:, None]
    running_scores = torch.zeros(B, K, dtype=torch.float32, device=dev)
    running_scores[:, 1:] = _NEG
    return (running, running_scores, running.clone(), torch.full((B, K), _NEG, dtype=torch.float32, device=dev),
            torch.zeros(B, K, dtype=torch.long, device=dev), torch.zeros(B, K, dtype=torch.bool, device=dev))


def _forced_at(forced: tuple[int | None, int | None], cur: int, L: int) -> int | None:
    """The token forced after ``cur`` of ``L`` tokens: the end token at the last step (transformers
    applies its forced-EOS processor after the forced-BOS one), the BOS token after one token."""
    bos, eos = forced
    if eos is not None and cur == L - 1:
        return eos
    return bos if cur == 1 else None


def _continuations(logits: Tensor, running_scores: Tensor, keep: int, forced: int | None,
                   rules: GenerationRules, written: int, history: Tensor,
                   counted: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The best ``keep`` continuations of each row by summed float32 log-probability: ``logits
    [B * K, V]``, ``running_scores [B, K]`` -> ``(scores, beam, token)``, each ``[B, keep]``.
    ``rules`` (suppressed tokens, an end token forbidden before ``min_new_tokens``, repeated n-grams
    of ``history [B * K, t]``, the repetition penalty of its tokens where ``counted [B * K, t]``)
    apply to the log-probabilities after ``written`` new tokens; ``forced``: this step's token is forced
    (log-probability 0, every other ``-inf``: transformers' ``ForcedBOSTokenLogitsProcessor`` /
    ``ForcedEOSTokenLogitsProcessor``, which run after the others)."""
    B, K = running_scores.shape
    log_probs = rules.apply(torch.log_softmax(logits.to(torch.float32), dim=-1), written, history,
                            counted)  # [B * K, V]
    V = log_probs.shape[-1]
    if forced is not None:
        log_probs = torch.full_like(log_probs, float("-inf"))
        log_probs[:, forced] = 0.0
    log_probs = (log_probs.view(B, K, V) + running_scores[:, :, None]).reshape(B, K * V)  # [B, K * V]
    scores, cand = torch.topk(log_probs, k=keep)  # [B, keep]
    return scores, cand // V, cand % V


def _merge_finished(held: tuple[Tensor, Tensor, Tensor, Tensor], new: tuple[Tensor, Tensor, Tensor],
                    generated: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each row's best ``K`` finished hypotheses among those it held (``sequences [B, K, L]``,
    ``scores [B, K]``, ``lengths [B, K]``, ``finished [B, K]``) and this step's candidates
    (``sequences [B, 2K, L]``, length-penalised ``scores [B, 2K]`` — ``-1e9`` where not finishing —,
    ``finishing [B, 2K]``), all of ``generated`` tokens."""
    sequences, scores, lengths, finished = held
    cand_seqs, penalised, just = new
    merged = torch.topk(torch.cat((scores, penalised), dim=1), k=scores.shape[1])[1]  # [B, K]
    return (_gather(torch.cat((sequences, cand_seqs), dim=1), merged),
            _gather(torch.cat((scores, penalised), dim=1), merged),
            _gather(torch.cat((lengths, torch.full_like(penalised, generated, dtype=lengths.dtype)), dim=1), merged),
            _gather(torch.cat((finished, just), dim=1), merged))


def _can_improve(running_scores: Tensor, scores: Tensor, finished: Tensor, divisor: float) -> Tensor:
    """``[B, 1]``: whether a row's best running beam (``running_scores [B, K]``, its sum divided by
    ``divisor``) beats its worst finished hypothesis (``scores [B, K]`` where ``finished``)."""
    best_running = running_scores[:, :1] / divisor  # [B, 1]
    worst_finished = torch.where(finished, torch.min(scores, dim=1, keepdim=True)[0], _NEG)  # [B, K]
    return torch.any(best_running > worst_finished, dim=-1, keepdim=True)


def _finish(held: tuple[Tensor, Tensor, Tensor, Tensor], cand: tuple[Tensor, Tensor, Tensor], top_k_mask: Tensor,
            generated: int, length_penalty: float, early_stopping: bool | str,
            improvable: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Step 4: the candidates (``cand_seqs [B, 2K, L]``, ``cand_scores [B, 2K]``, ``hits [B, 2K]``)
    among the first ``K`` that hit a stopping criterion join the finished hypotheses ``held``, with
    their summed log-probabilities divided by ``generated ** length_penalty`` — unless their row is
    done (``improvable [B, 1]`` False) or already full with ``early_stopping=True``."""
    cand_seqs, cand_scores, hits = cand
    just = hits & top_k_mask[None, :]
    penalised = cand_scores / (generated ** length_penalty)
    full = torch.all(held[3], dim=-1, keepdim=True) & (early_stopping is True)
    penalised += full.to(torch.float32) * _NEG
    penalised += (~improvable).to(torch.float32) * _NEG
    penalised += (~just) * _NEG
    return _merge_finished(held, (cand_seqs, penalised, just), generated)


def _returned(held: tuple[Tensor, Tensor, Tensor, Tensor], P: int, R: int) -> BeamSearchOutput:
    """Each row's ``R`` best finished hypotheses (``held``'s are sorted best first), flattened to
    ``B * R`` rows and cut to the longest of them."""
    sequences, scores, lengths, _ = held
    B = sequences.shape[0]
    lengths = lengths[:, :R].reshape(B * R)
    T = int(lengths.max())
    return BeamSearchOutput(sequences[:, :R, :P + T].reshape(B * R, P + T), scores[:, :R].reshape(B * R), lengths)


def beam_search(step: Callable[[Tensor], Tensor], start: Tensor, *, num_beams: int, max_new_tokens: int,
                eos_token_id: int | Sequence[int] | None, length_penalty: float = 1.0,
                early_stopping: bool | str = False, reorder: Callable[[Tensor], None] | None = None,
                forced: tuple[int | None, int | None] = (None, None), rules: GenerationRules | None = None,
                pad_token_id: int | None = None, num_return_sequences: int = 1,
                counted: Tensor | None = None) -> BeamSearchOutput:
    """Beam search from ``start [B, P]`` (see the module docstring for the rules).

    Args:
        step: ``tokens [B * K, P + t] -> logits [B * K, V]`` after each row's last token (row
            ``b * K + k``: beam ``k`` of row ``b``; a cached model feeds only the new token).
        start: ``[B, P]`` long, the start tokens of every row (each row's ``K`` beams start alike).
        num_beams: ``K >= 1``.
        max_new_tokens: ``T_max >= 0``; with ``0`` the start tokens are returned.
        eos_token_id: the end token, or several (a hypothesis ends at any of them; each step keeps
            ``max(2, 1 + n_end) * K`` candidates, as transformers); ``None``: every hypothesis runs
            to ``max_new_tokens``. The caller checks them against its vocabulary.
        length_penalty: the exponent of the generated length that divides a finished hypothesis'
            summed log-probabilities (``> 0`` favours longer ones).
        early_stopping: ``True``, ``False`` or ``"never"``: when a row is done.
        reorder: ``index [B * K] -> None``, called before every step but the first with the flat row
            (``b * K + k``) each new beam continues: reorder the model's caches to it.
        forced: ``(bos, eos)`` forced as transformers' ``forced_bos_token_id`` / ``forced_eos_token_id``
            (:func:`_forced_at`: log-probability 0, every other token ``-inf``); ``None``: not forced.
        rules: :class:`~attnzoo.models.generation.GenerationRules` (suppressed tokens, ``min_new_tokens``,
            ``no_repeat_ngram_size``, ``repetition_penalty``).
        pad_token_id: what follows a hypothesis' end token: ``pad_token_id`` unless it is ``None``
            or ``0``, else the first end token (transformers' beam search; ``-1`` without end token).
        num_return_sequences: ``R``, ``1 <= R <= K``: each row's ``R`` best hypotheses.
        counted: ``[B, P]`` bool, the start tokens the repetition penalty counts (``False`` on left
            padding); ``None``: all.

    Returns: :class:`BeamSearchOutput` ``(tokens [B * R, P + T], scores [B * R], lengths [B * R])``.
    """
    owner = "beam_search"
    K, length_penalty, early_stopping = check_beam_settings(num_beams, length_penalty, early_stopping, owner)
    new = check_int(max_new_tokens, "max_new_tokens", owner, minimum=0)
    R = check_returns(num_return_sequences, K, owner)
    _check_start(start, owner)
    eos = check_end_tokens(eos_token_id, _ANY_VOCAB, owner)
    _check_tokens_and_rows(pad_token_id, forced, counted, start, owner)
    (B, P), dev = start.shape, start.device
    if new == 0:
        tokens = start.long().repeat_interleave(R, dim=0)
        return BeamSearchOutput(tokens, torch.zeros(B * R, device=dev), torch.zeros(B * R, dtype=torch.long, device=dev))
    L, rules = P + new, rules or GenerationRules()
    keep = max(2, 1 + len(eos)) * K  # transformers: room for a running beam after every end token
    top_k_mask = torch.cat((torch.ones(K, dtype=torch.bool), torch.zeros(keep - K, dtype=torch.bool))).to(dev)
    ends = torch.tensor(eos, dtype=torch.long, device=dev)
    running, running_scores, *finished = _initial(start, K, L, (pad_token_id or eos[0]) if eos else -1)
    held = tuple(finished)
    rows_counted = None if counted is None else torch.cat(  # [B * K, L]
        (counted.bool(), torch.ones(B, new, dtype=torch.bool, device=dev)), dim=1).repeat_interleave(K, dim=0)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=dev)  # [B, 1] a row is not done
    row_offset = torch.arange(B, device=dev).view(B, 1) * K  # [B, 1]
    cur = P
    logits = step(running.view(B * K, L)[:, :cur])
    _check_vocabulary(logits.shape[-1], eos, forced, owner)
    while True:
        # 1-2. the best max(2, 1 + n_end) * K continuations of every row, by summed log-probability
        cand_scores, cand_beam, cand_tokens = _continuations(
            logits, running_scores, keep, _forced_at(forced, cur, L), rules, cur - P, running.view(B * K, L)[:, :cur],
            None if rows_counted is None else rows_counted[:, :cur])  # [B, keep] each
        cand_seqs = _gather(running, cand_beam)  # [B, keep, L]
        cand_seqs[:, :, cur] = cand_tokens
        # 3. stopping criteria, and the next running beams
        hits = torch.isin(cand_tokens, ends) | (cur + 1 >= L)  # [B, keep]
        open_scores = cand_scores + hits.to(torch.float32) * _NEG
        nxt = torch.topk(open_scores, k=K)[1]  # [B, K]
        running, running_scores = _gather(cand_seqs, nxt), _gather(open_scores, nxt)
        source_rows = _gather(cand_beam + row_offset, nxt)  # [B, K] the flat rows they continue
        # 4. finished hypotheses: the first K candidates that hit a criterion, length-penalised
        held = _finish(held, (cand_seqs, cand_scores, hits), top_k_mask, cur + 1 - P, length_penalty,
                       early_stopping, improvable)
        cur += 1
        # 5. which rows can still improve, and whether to go on
        best_length = L - P if early_stopping == "never" and length_penalty > 0.0 else cur - P
        improvable = improvable & _can_improve(running_scores, held[1], held[3], best_length ** length_penalty)
        go_on = (torch.any(improvable) & ~(torch.all(held[3]) & (early_stopping is True)) & ~torch.all(hits))
        if not bool(go_on):
            break
        if reorder is not None:
            reorder(source_rows.reshape(B * K))
        logits = step(running.reshape(B * K, L)[:, :cur])
    return _returned(held, P, R)  # type: ignore[arg-type]


def _check_tokens_and_rows(pad_token_id: object, forced: tuple[object, object], counted: object, start: Tensor,
                           owner: str) -> None:
    """``pad_token_id`` and the ``forced`` tokens ``None`` or ids ``>= 0``; ``counted`` ``None`` or
    a tensor of ``start``'s shape ``[B, P]``."""
    if pad_token_id is not None:
        check_int(pad_token_id, "pad_token_id", owner, minimum=0)
    if not isinstance(forced, tuple) or len(forced) != 2:
        raise TypeError(f"{owner}: forced must be a pair (bos, eos) of token ids or None, got {forced!r}")
    for name, token in zip(("forced_bos_token_id", "forced_eos_token_id"), forced, strict=True):
        if token is not None:
            check_int(token, name, owner, minimum=0)
    if counted is not None and (not isinstance(counted, Tensor) or counted.shape != start.shape):
        got = tuple(counted.shape) if isinstance(counted, Tensor) else type(counted).__name__
        raise ValueError(f"{owner}: counted must be a bool tensor of start's shape {tuple(start.shape)}, got {got}")


def _check_vocabulary(V: int, eos: tuple[int, ...], forced: tuple[int | None, int | None], owner: str) -> None:
    """The end and forced tokens below the ``V`` tokens the first step scored."""
    named = [("eos_token_id", t) for t in eos] + [(n, t) for n, t in zip(
        ("forced_bos_token_id", "forced_eos_token_id"), forced, strict=True) if t is not None]
    for name, token in named:
        if token >= V:
            raise ValueError(f"{owner}: {name} must be < the {V} tokens step scores, got {token}")


def check_returns(num_return_sequences: object, num_beams: int, owner: str, *, temperature: float = 0.0) -> int:
    """``num_return_sequences``: an int in ``[1, num_beams]`` with beam search (each row's best
    hypotheses); without, more than one only when sampling (``temperature > 0``: independent
    samples; greedy decoding has one result per row, as transformers refuses)."""
    returns = check_int(num_return_sequences, "num_return_sequences", owner, minimum=1)
    if num_beams > 1 and returns > num_beams:
        raise ValueError(f"{owner}: num_return_sequences must be <= num_beams={num_beams} (beam search returns "
                         f"each row's best hypotheses), got {returns}")
    if num_beams == 1 and returns > 1 and temperature == 0.0:
        raise ValueError(f"{owner}: greedy decoding gives one sequence per row, so num_return_sequences={returns} "
                         f"needs sampling (temperature > 0) or beam search (num_beams >= {returns})")
    return returns


@torch.no_grad()
def decoder_beam_search(decoder: CachedDecoder, start: Tensor, context: Tensor | None = None,
                        context_mask: Tensor | None = None, *, num_beams: int, max_new_tokens: int,
                        eos_token_id: int | Sequence[int] | None, length_penalty: float = 1.0,
                        early_stopping: bool | str = False, forced: tuple[int | None, int | None] = (None, None),
                        rules: GenerationRules | None = None, pad_token_id: int | None = None,
                        num_return_sequences: int = 1, attention_mask: Tensor | None = None) -> BeamSearchOutput:
    """:func:`beam_search` with a :class:`~attnzoo.DecoderLM` and its caches (what ``generate``
    runs for ``num_beams > 1``): the caches are built for ``B * K`` rows and ``P + max_new_tokens``
    tokens and reordered at every step (``TypeError`` naming the caches that cannot be).
    ``start [B, P]``: the prompt (or a cross-attention decoder's start tokens); ``attention_mask
    [B, P]`` bool: its left padding (positions count the real tokens, as ``generate``); ``context
    [B, M, C]`` (an encoded source) and ``context_mask [B, M]`` for a cross-attention decoder,
    repeated to ``B * K`` rows. The other arguments are :func:`beam_search`'s; returns
    :class:`BeamSearchOutput`."""
    owner = "decoder_beam_search"
    K = check_int(num_beams, "num_beams", owner, minimum=1)
    new = check_int(max_new_tokens, "max_new_tokens", owner, minimum=0)
    _check_start(start, owner)
    check_end_tokens(eos_token_id, decoder.vocab_size, owner)
    B = start.shape[0]
    if context is not None and (not isinstance(context, Tensor) or context.dim() != 3 or context.shape[0] != B):
        got = tuple(context.shape) if isinstance(context, Tensor) else type(context).__name__
        raise ValueError(f"{owner}: context must be the encoded source [B, M, C] with B = {B} rows, got {got}")
    if pad_token_id is not None:
        check_token_id(pad_token_id, "pad_token_id", decoder.vocab_size, owner)
    if attention_mask is not None:
        attention_mask = check_left_padding(attention_mask, start, 0, owner)  # [B, P]
    settings = {"num_beams": K, "eos_token_id": eos_token_id, "length_penalty": length_penalty,
                "early_stopping": early_stopping, "forced": forced, "rules": rules, "pad_token_id": pad_token_id,
                "num_return_sequences": num_return_sequences, "counted": attention_mask}
    if new == 0:
        return beam_search(lambda t: t, start, max_new_tokens=0, **settings)
    step, reorder = _cached_steps(decoder, start, K, new, context, context_mask, attention_mask)
    return beam_search(step, start, max_new_tokens=new, reorder=reorder, **settings)


def _cached_steps(decoder: CachedDecoder, start: Tensor, K: int, new: int, context: Tensor | None,
                  context_mask: Tensor | None,
                  attention_mask: Tensor | None) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], None]]:
    """The ``step`` and ``reorder`` of :func:`beam_search` for ``decoder``: its caches for ``B * K``
    rows (``TypeError`` naming those that cannot be reordered), the start tokens fed at once, then
    one token a step at the next position of each row."""
    B, P = start.shape
    cache = decoder.init_cache(B * K, P + new)
    if not cache.reorderable:  # the cross-attention caches are built on the first step (KVCache: reorderable)
        cache.reorder(torch.arange(B * K, device=start.device))  # raises TypeError naming them
    memory = None if context is None else context.repeat_interleave(K, dim=0)  # [B * K, M, C]
    mask = None if context_mask is None else context_mask.repeat_interleave(K, dim=0)  # [B * K, M]
    rows = None if attention_mask is None else torch.cat(  # [B * K, P + new]: the prompt's padding, then real
        (attention_mask.bool(), torch.ones(B, new, dtype=torch.bool, device=start.device)), 1).repeat_interleave(K, 0)
    positions = None if rows is None else positions_from_mask(rows[:, :P])  # [B * K, P]

    def step(tokens: Tensor) -> Tensor:  # [B * K, P + t] -> [B * K, V]
        t = tokens.shape[1]
        seen = None if rows is None else rows[:, :t]
        if cache.length == 0:  # the start tokens, at once
            return decoder._last_logits(tokens, cache, positions, seen, memory, mask)
        at = None if positions is None else positions[:, -1:] + (t - P)  # [B * K, 1]
        return decoder._decode_step(tokens, cache, at, seen, memory, mask)

    return step, cache.reorder
