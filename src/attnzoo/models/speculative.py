"""Speculative decoding for :meth:`DecoderLM.generate <attnzoo.DecoderLM.generate>`: cheap drafts
of the next tokens, checked by one forward of the model.

Each round a drafter proposes up to ``k`` next tokens of every row: **prompt lookup** (the
tokens that followed the earliest earlier occurrence of the row's last ``n``-gram, as
transformers' ``prompt_lookup_num_tokens``), an **assistant model** (a smaller
:class:`~attnzoo.DecoderLM` with the same vocabulary, its own tokens, greedy or sampled, as
transformers' ``assistant_model``) or the model's own **multi-token-prediction layers** (one draft
per depth, :mod:`attnzoo.models.mtp`, as transformers' ``use_mtp``). The model then scores ``[last, d_1 .. d_k]`` in one cached forward, keeps
the longest run of drafts it accepts and adds its own next token: every round writes
``1 .. k + 1`` tokens for one forward of the model. Every
:class:`~attnzoo.models.generation.GenerationRules` rule is applied at every position, on the
row's tokens up to it. Greedy: a draft is accepted where it is the model's own choice, so the
tokens are those of greedy decoding. Sampling: an assistant's (or MTP) draft ``d ~ q`` is accepted with
probability ``min(1, p(d) / q(d))`` and otherwise replaced by a draw from ``max(0, p - q)``
(speculative sampling, Leviathan et al. 2023 / Chen et al. 2023); a looked-up draft where the
model's own draw equals it (transformers' way): the tokens are distributed as sampling draws them
(other draws than plain sampling's for the same seed).

A batch keeps, in every round, the drafts that every unfinished row accepts (rows that ended
accept anything); at the first position some row rejects, every row writes its own verdict there
(its accepted draft or the replacement: when sampling, distributed as the model's draw either way). What a rejected draft wrote into a cache is taken back: a cache written by
position (keys, latents) is truncated (:func:`~attnzoo.nn.cache.truncate`); a sliding-window ring
is rewound to the kept tokens (:func:`~attnzoo.nn.cache.rewind`: the slots the dropped tokens
overwrote restored from the round's records); a recurrent state or a convolution window (or a ring
that a round overflowed) is rolled back to a mark taken before the draft (``mark``/``rollback``,
one transaction over the round) and the accepted tokens are fed again with the next round: in the
same forward as its drafts while they are at most ``k + 1`` tokens (no forward of their own; the mark
stays before them, so a rejected round takes them back too), else in a forward of their own first.

Shapes: ``B`` rows, ``N`` prompt tokens, ``L = N + max_new_tokens`` tokens at most, ``V`` tokens
of the vocabulary, ``k`` drafts a round.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from attnzoo._devices import cache_dtype
from attnzoo._validate import check_float, check_int
from attnzoo.models._common import positions_from_mask
from attnzoo.models.generation import GenerationRules, sampling_probs
from attnzoo.models.mtp import head_logits
from attnzoo.nn.cache import rewind, rewindable, truncatable, truncate, unmarked

__all__ = ["Speculation", "check_speculation", "speculative_generate"]


class Verifier(Protocol):
    """What speculative decoding uses of a :class:`~attnzoo.DecoderLM` (declared here, so that this
    module does not import the model that calls it)."""

    vocab_size: int

    def init_cache(self, batch_size: int, max_len: int) -> Any: ...

    def __call__(self, tokens: Tensor, *, cache: Any, positions: Tensor | None, attention_mask: Tensor | None,
                 context: Tensor | None, context_mask: Tensor | None) -> Tensor: ...

    def _last_logits(self, tokens: Tensor, cache: Any, positions: Tensor | None, attention_mask: Tensor | None,
                     context: Tensor | None, context_mask: Tensor | None) -> Tensor: ...


class Speculation(NamedTuple):
    """Checked settings of speculative decoding (:func:`check_speculation`): ``assistant`` (a model)
    or prompt lookup (``assistant is None``); ``tokens``: drafts a round at most; ``confidence``: an
    assistant stops drafting when a row's draft has a lower probability (0: never); ``ngram``: the
    longest ``n``-gram prompt lookup matches; ``context``: the assistant's own ``(context [B, M, C'],
    context_mask [B, M])`` (an encoder-decoder assistant's encoding of the source; ``None``: a
    cross-attention assistant reads the model's context, another none); ``mtp``: the model's
    multi-token-prediction layers draft (:class:`~attnzoo.models.mtp.MultiTokenPredictor`, one
    draft per depth)."""

    assistant: Verifier | None
    tokens: int
    confidence: float
    ngram: int
    context: tuple[Tensor, Tensor | None] | None = None
    mtp: Any = None


def check_speculation(assistant_model: object, num_assistant_tokens: object, assistant_confidence_threshold: object,
                      prompt_lookup_num_tokens: object, max_matching_ngram_size: object, vocab_size: int,
                      owner: str, context: bool = False, mtp: Any = None) -> Speculation | None:
    """The speculative settings of ``generate`` checked (``None``: no speculation): an assistant
    (a model with ``init_cache``, the same ``vocab_size``; with cross-attention only where the model
    runs with a ``context``), prompt lookup or the model's multi-token-prediction layers ``mtp``
    (``use_mtp``), one of them; ``num_assistant_tokens`` / ``prompt_lookup_num_tokens`` ``>= 1``;
    the confidence threshold in ``[0, 1)``; ``max_matching_ngram_size >= 1``."""
    ways = [name for name, given in (("assistant_model", assistant_model is not None),
                                     ("prompt_lookup_num_tokens", prompt_lookup_num_tokens is not None),
                                     ("use_mtp", mtp is not None)) if given]
    if len(ways) > 1:
        raise ValueError(f"{owner}: {' and '.join(ways)} are {len(ways)} ways of drafting; give one of them")
    ngram = check_int(max_matching_ngram_size, "max_matching_ngram_size", owner, minimum=1)
    drafts = check_int(num_assistant_tokens, "num_assistant_tokens", owner, minimum=1)
    threshold = check_float(assistant_confidence_threshold, "assistant_confidence_threshold", owner)
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"{owner}: assistant_confidence_threshold must be in [0, 1), got {threshold}")
    if prompt_lookup_num_tokens is not None:
        return Speculation(None, check_int(prompt_lookup_num_tokens, "prompt_lookup_num_tokens", owner, minimum=1),
                           0.0, ngram)
    if mtp is not None:
        return Speculation(None, mtp.depth, 0.0, ngram, mtp=mtp)
    if assistant_model is None:
        return None
    if not callable(getattr(assistant_model, "init_cache", None)) or not callable(
            getattr(assistant_model, "_last_logits", None)):
        raise TypeError(f"{owner}: assistant_model must be a DecoderLM (a cached decoder with an LM head), got "
                        f"{type(assistant_model).__name__}")
    if getattr(assistant_model, "vocab_size", None) != vocab_size:
        raise ValueError(f"{owner}: assistant_model must share the model's vocabulary (vocab_size={vocab_size}), "
                         f"got vocab_size={getattr(assistant_model, 'vocab_size', None)}")
    if getattr(assistant_model, "cross_attention", False) and not context:
        raise ValueError(f"{owner}: assistant_model has cross-attention but the model runs without a context; "
                         f"give a decoder-only assistant (it drafts from the tokens alone)")
    return Speculation(assistant_model, drafts, threshold, ngram)  # type: ignore[arg-type]


def _check_context_width(assistant: Any, context: Tensor | None, owner: str) -> None:
    """An assistant that reads a context reads its width ``C'`` (its blocks' ``context_dim``):
    ``ValueError`` naming ``assistant_model`` before anything runs, not a block's error mid-way."""
    widths = {w for b in getattr(assistant, "blocks", ()) if isinstance(w := getattr(b, "context_dim", None), int)}
    if context is not None and widths and context.shape[-1] not in widths:
        raise ValueError(f"{owner}: assistant_model reads a context of width {sorted(widths)[0]} (its blocks' "
                         f"context_dim), the model's context is [B, M, {context.shape[-1]}]")


class _Cached:
    """A model and its cache over the shared token buffer ``[B, L]``: the cache holds the first
    ``cache.length`` tokens; :meth:`feed` gives it the next ones, :meth:`open` / :meth:`close`
    bracket a round whose last tokens may be rejected."""

    def __init__(self, model: Verifier, batch: int, total: int, positions: Tensor | None, mask: Tensor | None,
                 context: tuple[Tensor | None, Tensor | None], owner: str) -> None:
        self.model, self.cache = model, model.init_cache(batch, total)
        self.positions, self.mask, self.context = positions, mask, context
        self.truncatable = truncatable(self.cache)
        refused = [] if self.truncatable else unmarked(self.cache)
        if refused:
            raise TypeError(f"{owner}: speculative decoding takes back rejected drafts, and these caches can "
                            f"neither be truncated nor rolled back: {sorted(set(refused))}")
        self._mark: object = None
        #: the final hidden states ``[B, L, C]`` of every token fed (kept for an MTP drafter), or None
        self.hidden: Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.cache.length)

    def feed(self, tokens: Tensor, end: int, *, every: bool = False) -> Tensor:
        """Give the cache ``tokens[:, length:end]``; the logits after the last of them ``[B, V]``, or
        after each ``[B, end - length, V]`` (``every``)."""
        start = self.length
        pos = None if self.positions is None else self.positions[:, start:end]
        seen = None if self.mask is None else self.mask[:, :end]
        if self.hidden is not None:  # the hidden states kept, the head on the positions asked for
            h = self.model.hidden_states(tokens[:, start:end], cache=self.cache, positions=pos, attention_mask=seen,
                                         context=self.context[0], context_mask=self.context[1])  # [B, n, C]
            self.hidden[:, start:end] = h
            return self.model.lm_head(h) if every else self.model.lm_head(h[:, -1:])[:, -1]
        if every or end - start == 1:  # one position: the head costs nothing to skip
            out = self.model(tokens[:, start:end], cache=self.cache, positions=pos, attention_mask=seen,
                             context=self.context[0], context_mask=self.context[1])
            return out if every else out[:, -1]
        return self.model._last_logits(tokens[:, start:end], self.cache, pos, seen, *self.context)

    def open(self) -> None:
        """Start a round: what is fed from now on may be taken back by :meth:`close`."""
        if not self.truncatable:
            self._mark = self.cache.mark()
            self.cache.in_transaction = True

    def close(self, keep: int) -> None:
        """End the round: the first ``keep`` tokens of the buffer are final; the cache keeps what
        it holds of them (what it holds beyond is dropped: truncated, or rewound where sliding-window
        rings restore the slots the dropped tokens overwrote; a cache rolled back to the round's mark,
        a recurrent state's, feeds the rest again next round)."""
        if self.truncatable:
            truncate(self.cache, min(keep, self.length))
            return
        back = self.length > keep and rewindable(self.cache, keep)  # sliding rings restore their slots
        if back:
            rewind(self.cache, keep)
        self.cache.in_transaction = False
        if self.length <= keep:
            self.cache.commit(self._mark)
        else:
            self.cache.rollback(self._mark)


class _Generation:
    """The shared state of one call: the token buffer, the rules, the sampling settings (``None``:
    greedy) and the ended rows."""

    def __init__(self, prompt: Tensor, new: int, mask: Tensor | None, rules: GenerationRules,
                 fill: int | None, sampling: tuple[float, int | None, float | None, float | None] | None,
                 generator: torch.Generator | None) -> None:
        (B, self.n), dev = prompt.shape, prompt.device
        self.tokens = torch.empty(B, self.n + new, dtype=torch.long, device=dev)
        self.tokens[:, :self.n] = prompt
        self.written, self.total = self.n, self.n + new
        self.mask, self.rules, self.fill = mask, rules, fill
        self.sampling, self.generator = sampling, generator
        self.ends = torch.tensor(rules.eos, dtype=torch.long, device=dev)
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)
        #: where each row's real tokens start (left padding before), for prompt lookup
        self.starts = [0] * B if mask is None else (~mask[:, :self.n]).sum(1).tolist()

    def scores(self, logits: Tensor, at: int) -> Tensor:
        """The rules applied to the logits ``[B, V]`` of the token at position ``at`` (after the
        tokens before it): ``[B, V]`` float32."""
        return self.rules.apply(logits.float(), at - self.n, self.tokens[:, :at],
                                None if self.mask is None else self.mask[:, :at])

    def probs(self, scores: Tensor) -> Tensor:
        """The distribution ``[B, V]`` sampling draws from (the sampling settings applied)."""
        return sampling_probs(scores, *self.sampling)  # type: ignore[misc]

    def draw(self, probs: Tensor) -> Tensor:
        """A token ``[B]`` drawn from each row's ``probs [B, V]``."""
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def pick(self, scores: Tensor) -> Tensor:
        """The token ``[B]`` greedy decoding or sampling writes after ``scores``."""
        return scores.argmax(dim=-1) if self.sampling is None else self.draw(self.probs(scores))

    def write(self, token: Tensor) -> None:
        """Write ``token [B]`` at the next position (an ended row holds the fill token)."""
        if self.fill is not None:
            token = torch.where(self.done, torch.full_like(token, self.fill), token)
            self.done = self.done | torch.isin(token, self.ends)
        self.tokens[:, self.written] = token
        self.written += 1

    @property
    def finished(self) -> bool:
        return self.written == self.total or bool(self.done.all())


class _Lookup:
    """Prompt lookup: each row's drafts are the tokens after the earliest earlier occurrence of its
    last ``n``-gram (``n`` from ``ngram`` down to 1, the first that has a continuation)."""

    def __init__(self, ngram: int) -> None:
        self.ngram = ngram

    def _row(self, seq: Tensor, k: int) -> Tensor:
        for n in range(min(self.ngram, seq.numel() - 1), 0, -1):
            hits = (seq.unfold(0, n, 1) == seq[-n:]).all(dim=1).nonzero().flatten()
            for start in (hits + n).tolist():
                if start < seq.numel():
                    return seq[start:start + k]
        return seq[:0]

    def propose(self, gen: _Generation, k: int) -> int:
        """Write up to ``k`` drafts after ``gen.written``; how many (every unfinished row has them)."""
        w = gen.written
        rows = [self._row(gen.tokens[b, gen.starts[b]:w], k) for b in range(gen.tokens.shape[0])]
        live = [r for r, done in zip(rows, gen.done.tolist(), strict=True) if not done]
        k = min((r.numel() for r in live), default=0)
        for b, row in enumerate(rows):
            gen.tokens[b, w:w + k] = row[:k] if row.numel() >= k else gen.tokens[b, w - 1]
        return k

    def judge(self, gen: _Generation, scores: Tensor, j: int) -> tuple[Tensor, Tensor]:
        """Sampling: the token ``[B]`` the model draws at draft ``j``'s position and whether it is
        the draft ``[B]`` (a draft without a distribution of its own is kept where the model's
        draw equals it, as transformers' prompt lookup samples)."""
        token = gen.draw(gen.probs(scores))
        return token, token == gen.tokens[:, gen.written]

    def close(self, keep: int) -> None:
        """Nothing to take back."""


class _Assistant:
    """An assistant model's drafts (greedy or sampled, the same rules and sampling settings
    applied), stopped early when an unfinished row's draft is less likely than ``confidence``."""

    def __init__(self, cached: _Cached, confidence: float) -> None:
        self.cached, self.confidence = cached, confidence
        self.q: list[Tensor] = []  # sampling: the distribution each draft was drawn from, [B, V]

    def propose(self, gen: _Generation, k: int) -> int:
        """Write up to ``k`` drafts after ``gen.written``; how many."""
        w, self.q = gen.written, []
        logits = self.cached.feed(gen.tokens, w)  # the tokens it has not seen, the last one included
        self.cached.open()
        for j in range(k):
            scores = gen.scores(logits, w + j)
            if gen.sampling is None:
                token, probs = scores.argmax(dim=-1), scores.softmax(dim=-1) if self.confidence > 0.0 else None
            else:
                probs = gen.probs(scores)
                token = gen.draw(probs)
                self.q.append(probs)
            gen.tokens[:, w + j] = token
            if j == k - 1:
                return k
            if probs is not None and self.confidence > 0.0:
                p = probs.gather(1, token[:, None]).squeeze(1)  # [B]
                if bool(((p < self.confidence) & ~gen.done).any()):
                    return j + 1
            logits = self.cached.feed(gen.tokens, w + j + 1)
        return k

    def judge(self, gen: _Generation, scores: Tensor, j: int) -> tuple[Tensor, Tensor]:
        """Speculative sampling at draft ``j`` (:func:`_judge`)."""
        return _judge(gen, scores, self.q[j])

    def close(self, keep: int) -> None:
        self.cached.close(keep)


def _judge(gen: _Generation, scores: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """Speculative sampling of the draft at ``gen.written``, drawn from ``q [B, V]``: the draft
    ``d ~ q`` is kept with probability ``min(1, p(d) / q(d))``, else the token is drawn from
    ``max(0, p - q)`` renormalised, which makes it ``p``-distributed either way. The token ``[B]``
    and whether it is the draft ``[B]``."""
    p = gen.probs(scores)
    draft = gen.tokens[:, gen.written]
    pd, qd = p.gather(1, draft[:, None]).squeeze(1), q.gather(1, draft[:, None]).squeeze(1)
    u = torch.rand(pd.shape, generator=gen.generator, device=pd.device)
    kept = u * qd < pd
    rest = (p - q).clamp_min(0.0)
    rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, p)  # p == q: never needed, but defined
    return torch.where(kept, draft, gen.draw(rest / rest.sum(-1, keepdim=True))), kept


class _Predictor:
    """Drafts from the model's own multi-token-prediction depths (transformers' ``use_mtp``): depth
    ``i`` drafts the token ``i + 1`` ahead, reading the model's final hidden states (kept by the
    target's :class:`_Cached`) or depth ``i - 1``'s outputs, greedy or sampled with the same rules.
    Depth ``i``'s cache holds the rows ``j`` whose tokens (up to ``j + i + 1``) are final: depth 0
    only ever reads final tokens; a deeper depth's rows that read drafts are truncated after
    drafting and run again next round."""

    def __init__(self, model: Any, target: _Cached, gen: _Generation, positions: Tensor | None, owner: str) -> None:
        (B, L), self.model, self.mtp = gen.tokens.shape, model, model.mtp
        weight = next(m.weight for m in self.mtp.modules() if isinstance(m, torch.nn.Linear))
        self.caches = self.mtp.init_cache(B, L, device=weight.device, dtype=cache_dtype(weight, None))
        cut = [c for c in list(self.caches)[1:] if not truncatable(c)]
        if cut:
            raise TypeError(f"{owner}: use_mtp with {self.mtp.depth} depths truncates the rows of depths >= 1 "
                            f"that read drafts, and their caches cannot be truncated: {type(cut[0]).__name__}")
        self.rows = [0] * self.mtp.depth  # the rows each depth's cache holds
        target.hidden = weight.new_zeros(B, L, model.dim)
        self.target, self.mask = target, target.mask
        self.outs = [weight.new_zeros(B, L, model.dim) for _ in range(self.mtp.depth - 1)]  # depths' outputs
        self.pos = torch.arange(L, device=gen.tokens.device).expand(B, L) if positions is None else positions
        self.q: list[Tensor] = []

    def propose(self, gen: _Generation, k: int) -> int:
        """Write up to ``k`` drafts (one per depth) after ``gen.written``; how many."""
        w, self.q = gen.written, []
        F = w - 1  # rows 0 .. F - 1: the model's hidden states there are final
        for i in range(k):
            c, src = self.rows[i], self.target.hidden if i == 0 else self.outs[i - 1]
            out = self.mtp.layers[i](self.model.tok_emb(gen.tokens[:, c + i + 1:F + i + 1]), src[:, c:F],
                                     cache=self.caches[i], positions=self.pos[:, c:F] + i + 1,
                                     key_padding=None if self.mask is None else self.mask[:, :F])  # [B, F - c, C]
            if i < len(self.outs):
                self.outs[i][:, c:F] = out
            scores = gen.scores(head_logits(self.model.lm_head, out[:, -1:])[:, -1], w + i)
            if gen.sampling is None:
                token = scores.argmax(dim=-1)
            else:
                self.q.append(gen.probs(scores))
                token = gen.draw(self.q[-1])
            gen.tokens[:, w + i] = token
            self.rows[i] = max(F - i, 0)  # the rows that read only final tokens
            if i:
                truncate(self.caches[i], self.rows[i])
        return k

    def judge(self, gen: _Generation, scores: Tensor, j: int) -> tuple[Tensor, Tensor]:
        """Speculative sampling at draft ``j`` (:func:`_judge`)."""
        return _judge(gen, scores, self.q[j])

    def close(self, keep: int) -> None:
        """Nothing to take back: the caches hold final rows only."""


def _verify(gen: _Generation, drafter: _Lookup | _Assistant | _Predictor, logits: Tensor, k: int) -> None:
    """Write the tokens of one round from the model's logits ``[B, k + 1, V]`` at the positions of
    the ``k`` drafts and after them: the drafts while every unfinished row keeps them, then the
    model's own token (greedy: its choice; sampling: the judged draft or its replacement)."""
    w = gen.written
    for j in range(k + 1):
        scores = gen.scores(logits[:, j], w + j)
        if j == k:
            token, kept = gen.pick(scores), None
        elif gen.sampling is None:
            token = scores.argmax(dim=-1)
            kept = token == gen.tokens[:, w + j]
        else:
            token, kept = drafter.judge(gen, scores, j)
        all_kept = kept is not None and not bool((~kept & ~gen.done).any())
        gen.write(token)  # the draft itself where every unfinished row keeps it
        if not all_kept or gen.finished:
            return


@torch.no_grad()
def speculative_generate(model: Verifier, prompt: Tensor, new: int, mask: Tensor | None, rules: GenerationRules,
                         fill: int | None, spec: Speculation, context: Tensor | None = None,
                         context_mask: Tensor | None = None, owner: str = "DecoderLM.generate",
                         sampling: tuple[float, int | None, float | None, float | None] | None = None,
                         generator: torch.Generator | None = None) -> Tensor:
    """Greedy decoding (``sampling`` ``None``) or sampling (``(temperature, top_k, top_p, min_p)``,
    drawn with ``generator``) of ``model`` sped up by drafts, on checked arguments: ``prompt [B, N]``,
    ``new`` tokens at most, ``mask [B, N + new]`` (the prompt's left padding, then real; ``None``:
    no padding), ``fill`` the token of ended rows, ``context [B, M, C]`` / ``context_mask [B, M]``
    of a cross-attention model. Returns ``[B, N + T]``: the tokens greedy decoding gives, or tokens
    distributed as sampling draws them (not the same draws)."""
    B, n = prompt.shape
    gen = _Generation(prompt, new, mask, rules, fill, sampling, generator)
    positions = None if mask is None else positions_from_mask(mask)  # [B, L]
    target = _Cached(model, B, gen.total, positions, mask, (context, context_mask), owner)
    drafter: _Lookup | _Assistant | _Predictor = _Lookup(spec.ngram)
    if spec.mtp is not None:
        drafter = _Predictor(model, target, gen, positions, owner)
    elif spec.assistant is not None:
        own = spec.context or ((context, context_mask) if getattr(spec.assistant, "cross_attention", False)
                               else (None, None))
        _check_context_width(spec.assistant, own[0], owner)
        drafter = _Assistant(_Cached(spec.assistant, B, gen.total, positions, mask, own, owner), spec.confidence)
    gen.write(gen.pick(gen.scores(target.feed(gen.tokens, n), n)))  # the prompt at once
    while not gen.finished:
        w = gen.written
        k = drafter.propose(gen, min(spec.tokens, gen.total - w - 1))
        if w - 1 - target.length > k + 1:  # a rolled-back cache's backlog: fed and kept first when long,
            target.feed(gen.tokens, w - 1)  # else with this round's drafts in one forward
        target.open()
        _verify(gen, drafter, target.feed(gen.tokens, w + k, every=True)[:, -(k + 1):], k)  # [B, k + 1, V]
        target.close(gen.written - 1)  # the newest token is the next round's first input
        drafter.close(gen.written - 1)
    return gen.tokens[:, :gen.written]
