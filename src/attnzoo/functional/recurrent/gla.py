"""Gated linear attention (Yang et al. 2024, "Gated Linear Attention Transformers with
Hardware-Efficient Training"); with one decay per token it is Mamba-2's SSD / gated retention.

Recurrence (the definition; ``g_t = log_decay_t <= 0``, q scaled by ``scale``)::

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T        # [Dk, Dv]
    o_t = q_t^T S_t                                  # [Dv]

Chunked form. Inside a chunk starting from state ``S``, let ``b_t = g_1 + ... + g_t`` (cumulative
log decay from the chunk start, per key dimension, ``<= 0``). Unrolling the recurrence::

    o_t    = (q_t * exp(b_t))^T S + sum_{s <= t} [sum_d q_td k_sd exp(b_td - b_sd)] v_s
    S_next = diag(exp(b_C)) S + sum_s (k_s * exp(b_C - b_s)) v_s^T

Every exponent is a sum of log decays over a run of tokens, never positive (and summed directly,
see ``_chunked_scan.log_segsum``). The intra-chunk scores
``A[t, s] = sum_d q_td k_sd exp(b_td - b_sd)`` are not a plain matmul (the decay depends on d); they are computed by halving: the block "second half x first half" of a
segment of ``2w`` tokens is a matmul of ``q_t exp(b_t - b_r)`` and ``k_s exp(b_r - b_s)`` with ``r``
the segment's midpoint (``s <= r < t``: both factors are at most 1), for ``w = C/2, C/4, ...``
down to ``sub`` tokens; the ``sub x sub`` blocks left on the diagonal are computed elementwise
(a ``[sub, sub, Dk]`` tensor). With a scalar decay per token the decay factors out
of the sum over d: ``A = (Q K^T) * exp(b_t - b_s)``.

Fast plan (:func:`_plan`, chosen per call from the decays): when every block of
``MATMUL_SUB_CHUNK`` tokens decays by at most ``MATMUL_DIAGONAL_SPAN`` per channel, the halving stops
at those blocks and each is one matmul of ``q_t exp(b_t - b_m)`` and ``k_s exp(b_m - b_s)`` (``m`` its
middle token; one factor may exceed 1 by at most ``exp(span)``), masked to ``s <= t``; the block is
doubled while every block still fits the span, up to the whole chunk, which is then one matmul through
plain autograd ops (:func:`chunk_scores`: at 16k tokens a KDA training step ran 0.8-0.9x the time of
the 16-token blocks). When only some channels are beyond the span, those run through the halving
and the rest through that matmul (:func:`chunk_scores`). Otherwise the exact plan above runs. All
give the definition to float64 rounding (``docs/recurrent.md``).

The halving runs as one operator, ``attnzoo::gla_vector_scores``, whose backward is the same
halving again (a block's ``dq_t = exp(b_t - b_r) (dA k_ref)``, ``dk_s = exp(b_r - b_s) (dA^T q_ref)``;
the diagonal blocks elementwise) and ``dg`` the suffix sum of ``db = q dq - k dk``: in eager mode
autograd then records neither the levels' in-place block writes nor their flips and cumulative sums
(a training step of the arena's grid GLA cell ran 0.84-0.87x the time of autograd through the
halving), and ``torch.compile`` sees one node instead of tracing every level (a 2-layer
``DecoderLM(attention="gla")`` training step compiled in 28-33 s instead of 80-100 s).

A compiled inference graph computes the same scores without a loop, which its generated code runs
faster than the operator (compiled/eager 0.76-0.82 against 0.89-1.06,
``benchmarks/bench_compile.py --cases gla``): the chunk is cut into blocks of
``COMPILED_SUB_CHUNK`` tokens, and every block below the diagonal is one batched matmul of
``q_t exp(b_t - b_r)`` and ``k_s exp(b_r - b_s)`` with ``r`` the last token before the row's block
(both factors at most 1 again; ``b_r - b_s`` is summed as the key's block suffix plus the whole blocks
between, never as a difference). It builds a ``[C / sub, C / sub, sub, Dk]`` tensor of scaled keys,
cheap to generate but slower than the halving in eager mode, where the halving stays.

The quadratic form is one chunk of ``N`` tokens with one sub-block (the ``[N, N, Dk]`` tensor);
the recurrent form is the loop above (what decoding does).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo.functional.recurrent import _chunked_scan as scan
from attnzoo.functional.recurrent._chunked_scan import (
    log_segsum,
    suffix_sum,
    token_prefix_sum,
    token_suffix_sum,
)

__all__ = ["COMPILED_SUB_CHUNK", "MATMUL_DIAGONAL_SPAN", "MATMUL_SUB_CHUNK", "SUB_CHUNK", "chunk_scores", "gated_linear_attention", "run_gla", "vector_scores"]

#: Length of the diagonal blocks the halving of the vector-decay scores stops at (computed elementwise).
SUB_CHUNK = 4
#: Diagonal block length of the fast plan (see :func:`_plan`): the halving stops at blocks of this many
#: tokens and each is one matmul instead of an elementwise ``[sub, sub, Dk]`` tensor.
MATMUL_SUB_CHUNK = 16
#: The fast plan's bound on ``-(total log decay of one diagonal block)`` per channel, by compute dtype: the
#: block's factors ``exp(+-(b_t - b_m))`` stay within ``exp(span)`` (float32 ``exp(20) ~ 5e8``: no overflow,
#: and the products that survive the causal mask are at most ``|q_d k_d|``, so no precision is lost).
MATMUL_DIAGONAL_SPAN = {torch.float32: 20.0, torch.float64: 50.0}
#: Block length of the loop-free vector-decay scores of a compiled graph (smaller blocks make many tiny
#: matmuls: 4 ran the compiled call 2x slower than eager; 8 and 16 ran it at 0.7-0.9x, issue 20).
COMPILED_SUB_CHUNK = 16


def _padded(q: Tensor, k: Tensor, g: Tensor, sub: int) -> tuple[int, int, list[Tensor]]:
    """``(sub, levels, [q, k, g])``: the halving's block length, its number of levels, and the inputs with
    zero tokens appended up to ``sub * 2**levels`` (their rows and columns are cut by the callers)."""
    c = q.shape[-2]
    sub = min(sub, c)
    levels = (-(-c // sub) - 1).bit_length()  # halvings until blocks of sub tokens cover c
    cp = sub * 2**levels
    return sub, levels, [F.pad(t, (0, 0, 0, cp - c)) if cp > c else t for t in (q, k, g)]


def _level_decays(g: Tensor, w: int) -> tuple[Tensor, Tensor]:
    """One halving level (segments of ``2w`` tokens, ``r`` the last token of each first half):
    ``exp(b_t - b_r)`` on the second halves and ``exp(b_r - b_s)`` on the first halves, ``[..., P, w, Dk]``."""
    gh = g.unflatten(-2, (-1, 2, w))  # [..., P, 2, w, Dk]
    return token_prefix_sum(gh[..., 1, :, :]).exp_(), token_suffix_sum(gh[..., 0, :, :]).exp_()


def _level_block(x: Tensor, w: int) -> Tensor:
    """The blocks "second half x first half" of a level, ``[..., cp, cp]`` -> a ``[..., P, w, w]`` view."""
    view = x.unflatten(-1, (-1, 2, w)).unflatten(-4, (-1, 2, w))  # [..., P, 2, w, P, 2, w]
    return torch.diagonal(view, dim1=-6, dim2=-3)[..., 1, :, 0, :, :].movedim(-1, -3)


def _diagonal_blocks(x: Tensor, sub: int) -> Tensor:
    """The ``sub x sub`` blocks on the diagonal, ``[..., cp, cp]`` -> a ``[..., nb, sub, sub]`` view."""
    view = x.unflatten(-1, (-1, sub)).unflatten(-3, (-1, sub))  # [..., nb, sub, nb, sub]
    return torch.diagonal(view, dim1=-4, dim2=-2).movedim(-1, -3)


def _by_block(t: Tensor, sub: int) -> Tensor:
    """``[..., cp, Dk]`` -> ``[..., nb, Dk, sub]`` (the diagonal blocks' tokens last)."""
    return t.unflatten(-2, (-1, sub)).transpose(-1, -2)


def _plan(g: Tensor, sub: int) -> tuple[int, bool]:
    """``(sub, matmul_diagonal)`` for the scores of one call (the same for its backward: it reads g only).

    The fast plan stops the halving at :data:`MATMUL_SUB_CHUNK` tokens and computes each diagonal block
    as one matmul (:func:`_diagonal_factors`); it needs every such block's total log decay per channel to
    be at least ``-MATMUL_DIAGONAL_SPAN`` (checked on the values: weak decays, as trained GLA/KDA layers
    mostly have). Stronger decays, other dtypes, ``sub`` already at least a block (the quadratic form),
    or a chunk shorter than two blocks keep the exact elementwise plan with ``sub``.
    """
    c = g.shape[-2]
    span = MATMUL_DIAGONAL_SPAN.get(g.dtype)
    if span is None or sub >= MATMUL_SUB_CHUNK or c < 2 * MATMUL_SUB_CHUNK or g.numel() == 0:
        return sub, False
    best, w = 0, MATMUL_SUB_CHUNK
    while True:  # blocks of w tokens, doubled while every block's total stays within the span
        totals = F.pad(g, (0, 0, 0, -c % w)).unflatten(-2, (-1, w)).sum(dim=-2)  # [..., nb, Dk]
        if not bool(totals.min() >= -span):
            break
        best = w
        if w >= c:
            break
        w *= 2
    return (best, True) if best else (sub, False)


def _diagonal_factors(g: Tensor, sub: int) -> tuple[Tensor, Tensor]:
    """``(exp(b_t - b_m), exp(b_m - b_t))`` per diagonal block, ``[..., nb, sub, Dk]``, with ``b`` the
    block's inclusive prefix sum of ``g`` and ``m`` its middle token: ``A[t, s] = (q_t e_t) . (k_s f_s)``
    for ``s <= t`` (entries above the diagonal are computed too and masked by the callers)."""
    rel = torch.matmul(_midpoint_sums(sub, g), g.unflatten(-2, (-1, sub)))  # [..., nb, sub, Dk]: b_t - b_m
    return rel.exp(), rel.neg().exp_()


def _midpoint_sums(sub: int, like: Tensor) -> Tensor:
    """``M [sub, sub]`` with ``(M g)_t = b_t - b_m`` summed directly (``m = sub/2 - 1``): ``+g_i`` for
    ``m < i <= t`` below the midpoint's row, ``-g_i`` for ``t < i <= m`` above it."""
    t = torch.arange(sub, device=like.device)
    i, m = t[None, :], sub // 2 - 1
    after, before = (i > m) & (i <= t[:, None]), (i > t[:, None]) & (i <= m)
    return after.to(like.dtype) - before.to(like.dtype)


def _causal_block_mask(sub: int, like: Tensor) -> Tensor:
    """``[sub, sub]`` lower-triangular (diagonal included) mask in ``like``'s dtype and device."""
    return torch.ones(sub, sub, dtype=like.dtype, device=like.device).tril_()


def _vector_scores(q: Tensor, k: Tensor, g: Tensor, sub: int) -> Tensor:
    """``A[t, s] = sum_d q_td k_sd exp(b_td - b_sd)`` for ``s <= t`` (0 above). ``[..., C, Dk]`` -> ``[..., C, C]``.

    Halving: at each level the chunk is a row of segments of ``2w`` tokens; the block "second half
    x first half" of each segment is one matmul of ``q_t exp(b_t - b_r)`` and ``k_s exp(b_r - b_s)``,
    ``r`` the segment's midpoint (prefix and suffix sums inside a half: never positive). The
    ``sub x sub`` blocks on the diagonal are left, computed elementwise (``[sub, sub, Dk]``) or, in the
    fast plan of :func:`_plan`, as one matmul each. ``q`` may carry leading stack dimensions ``[S, ..., C,
    Dk]`` (several query sets against one ``k``, ``g``: the decays are computed once) -> ``[S, ..., C, C]``.
    """
    c = q.shape[-2]
    sub, matmul_diagonal = _plan(g, sub)
    sub, levels, (q, k, g) = _padded(q, k, g, sub)
    cp = q.shape[-2]
    scores = q.new_zeros(*q.shape[:-2], cp, cp)
    for level in range(1, levels + 1):
        w = cp >> level
        a_q, a_k = _level_decays(g, w)
        q_ref = q.unflatten(-2, (-1, 2, w))[..., 1, :, :] * a_q  # [..., P, w, Dk]
        k_ref = k.unflatten(-2, (-1, 2, w))[..., 0, :, :] * a_k
        _level_block(scores, w).copy_(torch.matmul(q_ref, k_ref.transpose(-1, -2)))
    if matmul_diagonal:
        e, f = _diagonal_factors(g, sub)  # [..., nb, sub, Dk]
        qb, kb = q.unflatten(-2, (-1, sub)) * e, k.unflatten(-2, (-1, sub)) * f
        diag = torch.matmul(qb, kb.transpose(-1, -2)).mul_(_causal_block_mask(sub, q))  # [..., nb, t, s]
    else:
        qt, kt = _by_block(q, sub), _by_block(k, sub)  # [..., nb, Dk, sub]
        decay = log_segsum(_by_block(g, sub)).exp_()  # [..., nb, Dk, t, s]
        diag = (qt.unsqueeze(-1) * decay * kt.unsqueeze(-2)).sum(dim=-3)
    _diagonal_blocks(scores, sub).copy_(diag)
    return scores[..., :c, :c]


def _vector_scores_grad(d_scores: Tensor, q: Tensor, k: Tensor, g: Tensor, sub: int) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dg)`` of :func:`_vector_scores` for ``d_scores [..., C, C]`` (read on and
    below the diagonal), by the same halving: a block's ``dq_t = exp(b_t - b_r) * (dA k_ref)`` and
    ``dk_s = exp(b_r - b_s) * (dA^T q_ref)``. Since ``dA[t, s] / db_t = -dA[t, s] / db_s = q_t k_s
    exp(b_t - b_s)`` (per d), ``db = q dq - k dk``, and ``b`` being the prefix sum of ``g``, ``dg`` is
    the suffix sum of ``db`` (inclusive). A stack of queries ``q [S, ..., C, Dk]`` (see
    :func:`_vector_scores`) sums its share of ``dk`` and ``dg`` over ``S``."""
    c = q.shape[-2]
    sub, matmul_diagonal = _plan(g, sub)
    sub, levels, (q, k, g) = _padded(q, k, g, sub)
    cp = q.shape[-2]
    da = F.pad(d_scores, (0, cp - c, 0, cp - c)) if cp > c else d_scores
    dq, dk = torch.zeros_like(q), torch.zeros_like(k)
    for level in range(1, levels + 1):
        w = cp >> level
        a_q, a_k = _level_decays(g, w)
        qh, kh = q.unflatten(-2, (-1, 2, w)), k.unflatten(-2, (-1, 2, w))  # [..., P, 2, w, Dk]
        block = _level_block(da, w)  # [..., P, w (t), w (s)]
        dq.unflatten(-2, (-1, 2, w))[..., 1, :, :].add_(a_q * torch.matmul(block, kh[..., 0, :, :] * a_k))
        dk.unflatten(-2, (-1, 2, w))[..., 0, :, :].add_(a_k * _summed_to(
            torch.matmul(block.transpose(-1, -2), qh[..., 1, :, :] * a_q), q, k))
    _add_diagonal_grads(dq, dk, _diagonal_blocks(da, sub), q, k, g, sub, matmul_diagonal)
    db = _summed_to(q * dq, q, k) - k * dk
    dg = token_suffix_sum(db, inclusive=True)
    return dq[..., :c, :], dk[..., :c, :], dg[..., :c, :]


def _add_diagonal_grads(dq: Tensor, dk: Tensor, d_diag: Tensor, q: Tensor, k: Tensor, g: Tensor, sub: int,
                        matmul_diagonal: bool) -> None:
    """Add the diagonal blocks' share of ``dq, dk [..., cp, Dk]`` for their score gradients
    ``d_diag [..., nb, t, s]``, by the plan the forward used (see :func:`_plan`)."""
    if matmul_diagonal:
        e, f = _diagonal_factors(g, sub)  # [..., nb, sub, Dk]
        d_blk = d_diag * _causal_block_mask(sub, q)
        qb, kb = q.unflatten(-2, (-1, sub)) * e, k.unflatten(-2, (-1, sub)) * f
        dq.unflatten(-2, (-1, sub)).add_(torch.matmul(d_blk, kb).mul_(e))
        dk.unflatten(-2, (-1, sub)).add_(_summed_to(torch.matmul(d_blk.transpose(-1, -2), qb), q, k).mul_(f))
        return
    qt, kt = _by_block(q, sub), _by_block(k, sub)  # [..., nb, Dk, sub]
    weight = log_segsum(_by_block(g, sub)).exp_() * d_diag.unsqueeze(-3)  # [..., nb, Dk, t, s]
    dq.add_((weight * kt.unsqueeze(-2)).sum(dim=-1).transpose(-1, -2).flatten(-3, -2))
    dk.add_(_summed_to((weight * qt.unsqueeze(-1)).sum(dim=-2).transpose(-1, -2).flatten(-3, -2), q, k))


def _summed_to(t: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """``t`` summed over the leading stack dimensions ``q`` has beyond ``k`` (several query sets)."""
    extra = q.dim() - k.dim()
    return t.sum(dim=tuple(range(extra))) if extra > 0 else t


@torch.library.custom_op("attnzoo::gla_vector_scores", mutates_args=())
def vector_scores(q: Tensor, k: Tensor, g: Tensor, sub: int) -> Tensor:
    """:func:`_vector_scores` as one operator with the gradient of :func:`_vector_scores_grad`: eager
    autograd does not record the halving's in-place block writes, and ``torch.compile`` sees one node
    instead of tracing every level (issue 20). ``q, k, g [..., C, Dk]`` (g the log decays) -> ``[..., C, C]``."""
    return _vector_scores(q, k, g, sub).contiguous()


@vector_scores.register_fake
def _vector_scores_fake(q: Tensor, k: Tensor, g: Tensor, sub: int) -> Tensor:
    return q.new_empty(*q.shape[:-1], q.shape[-2])


@torch.library.custom_op("attnzoo::gla_vector_scores_bwd", mutates_args=())
def vector_scores_bwd(d_scores: Tensor, q: Tensor, k: Tensor, g: Tensor, sub: int) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dg)`` of :func:`vector_scores` (:func:`_vector_scores_grad`)."""
    return tuple(t.contiguous() for t in _vector_scores_grad(d_scores, q, k, g, sub))  # type: ignore[return-value]


@vector_scores_bwd.register_fake
def _vector_scores_bwd_fake(d_scores: Tensor, q: Tensor, k: Tensor, g: Tensor, sub: int) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), g.new_empty(g.shape)


def _scores_setup(ctx, inputs: tuple, output: Tensor) -> None:  # type: ignore[no-untyped-def]
    q, k, g, ctx.sub = inputs
    ctx.save_for_backward(q, k, g)


def _scores_backward(ctx, d_scores: Tensor) -> tuple:  # type: ignore[no-untyped-def]
    q, k, g = ctx.saved_tensors
    if torch.is_grad_enabled():  # a backward with create_graph=True: the same formulas, differentiable
        return (*_vector_scores_grad(d_scores, q, k, g, ctx.sub), None)
    return (*vector_scores_bwd(d_scores.contiguous(), q, k, g, ctx.sub), None)


vector_scores.register_autograd(_scores_backward, setup_context=_scores_setup)


def chunk_scores(q: Tensor, k: Tensor, g: Tensor, sub: int) -> Tensor:
    """The vector-decay scores of one chunk group, ``q [S?, ..., C, Dk]`` (optionally a stack of query
    sets), ``k, g [..., C, Dk]`` -> ``[S?, ..., C, C]`` (zero above the diagonal).

    The scores are a sum over key channels, so channels can take different plans:

    * every chunk's total log decay per channel within the span (weak decays): the whole chunk is one
      block, one matmul of ``q_t exp(b_t - b_m)`` and ``k_s exp(b_m - b_s)`` through plain autograd
      ops (no halving, no custom operator: the backward is a few matmuls);
    * some channels beyond the span (strong decays, as a freshly initialised Kimi Linear layer has in
      about a fifth of its channels): those channels (the ``K`` with the most negative totals, ``K`` the
      largest count of any chunk, at most half the channels) are gathered and run through
      :func:`vector_scores` (the halving operator, which picks its own plan for them), the others
      through the matmul above, and the two sums added;
    * otherwise, and in a compiled graph, :func:`vector_scores` on all channels."""
    c = q.shape[-2]
    if tracing():  # a compiled graph cannot branch on the decays' values: the operator decides inside
        return vector_scores(q, k, g, sub)
    sub_used, matmul_diagonal = _plan(g, sub)
    if matmul_diagonal and sub_used >= c:
        return _whole_chunk_scores(q, k, g, None)
    exact = _exact_channels(g, sub)
    if exact is None:
        return vector_scores(q, k, g, sub)
    keep = torch.ones(g.shape[:-2] + g.shape[-1:], dtype=g.dtype, device=g.device).scatter_(-1, exact, 0.0)

    def pick(t: Tensor) -> Tensor:  # [S?, ..., C, Dk] -> the exact channels [S?, ..., C, K]
        return torch.gather(t, -1, exact.unsqueeze(-2).expand(*t.shape[:-1], exact.shape[-1]))

    return _whole_chunk_scores(q, k, g, keep.unsqueeze(-2)) + vector_scores(pick(q), pick(k), pick(g), sub)


def _whole_chunk_scores(q: Tensor, k: Tensor, g: Tensor, keep: Tensor | None) -> Tensor:
    """The scores of one-block chunks by one matmul (see :func:`chunk_scores`), over the channels where
    ``keep [..., 1, Dk]`` is 1 (all without it; the others' exponents are zeroed before ``exp``)."""
    rel = torch.matmul(_midpoint_sums(q.shape[-2], g), g)  # [..., C, Dk]: b_t - b_m, summed directly
    if keep is not None:
        rel, q = rel * keep, q * keep
    k_ref = k * rel.neg().exp()  # k_s exp(b_m - b_s)
    return torch.matmul(q * rel.exp(), k_ref.transpose(-1, -2)).tril_()  # [S?, ..., C, C], s <= t


def _exact_channels(g: Tensor, sub: int) -> Tensor | None:
    """The channels to leave to the halving, ``[..., K]`` (the lowest chunk totals first), when the others
    fit the span as one block and ``K <= Dk / 2``; ``None`` when the split does not apply (see :func:`_plan`'s
    conditions: a dtype with a span, chunks of two blocks or more, not the quadratic form's one block)."""
    c, dk = g.shape[-2:]
    span = MATMUL_DIAGONAL_SPAN.get(g.dtype)
    if span is None or sub >= MATMUL_SUB_CHUNK or c < 2 * MATMUL_SUB_CHUNK or g.numel() == 0:
        return None
    totals = g.sum(dim=-2)  # [..., Dk]: each chunk's total log decay per channel
    count = int((totals < -span).sum(dim=-1).max())
    if count == 0 or count > dk // 2:
        return None
    return torch.argsort(totals, dim=-1)[..., :count]


def _blocked_vector_scores(q: Tensor, k: Tensor, g: Tensor, sub: int) -> Tensor:
    """:func:`_vector_scores` without a loop (what a compiled graph runs). ``[..., C, Dk]`` -> ``[..., C, C]``.

    Blocks of ``sub`` tokens; block ``(i, j)`` below the diagonal is ``q_t exp(b_t - b_r) . k_s exp(b_r -
    b_s)`` with ``r`` the last token of block ``i - 1``: ``b_t - b_r`` is the row block's prefix sum,
    ``b_r - b_s`` the key block's suffix sum plus the sums of the blocks between (``log_segsum`` over
    the block totals, ``-inf`` for ``j >= i``, which zeroes those keys). The diagonal blocks are
    computed elementwise as in :func:`_vector_scores`.
    """
    c = q.shape[-2]
    sub = min(sub, c)
    nb = -(-c // sub)
    cp = nb * sub
    if cp > c:  # zero tokens at the end of the chunk; their rows and columns are cut below
        q, k, g = (F.pad(t, (0, 0, 0, cp - c)) for t in (q, k, g))
    qb, kb, gb = (t.unflatten(-2, (nb, sub)) for t in (q, k, g))  # [..., nb, sub, Dk]
    q_ref = qb * gb.cumsum(dim=-2).exp()  # [..., nb, sub, Dk]
    seg = log_segsum(gb.sum(dim=-2).transpose(-1, -2))  # [..., Dk, nb, nb]: blocks j+1 .. i summed
    between = F.pad(seg, (0, 0, 1, 0), value=float("-inf"))[..., :-1, :]  # row i: blocks j+1 .. i-1
    between = between.movedim(-3, -1).unsqueeze(-2)  # [..., nb_i, nb_j, 1, Dk]
    k_ref = kb.unsqueeze(-4) * (suffix_sum(gb, -2).unsqueeze(-4) + between).exp()  # [..., nb_i, nb_j, sub, Dk]
    cross = torch.matmul(q_ref.unsqueeze(-3), k_ref.transpose(-1, -2))  # [..., nb_i, nb_j, sub, sub]
    qt, kt, gt = (t.transpose(-1, -2) for t in (qb, kb, gb))  # [..., nb, Dk, sub]
    diag = (qt.unsqueeze(-1) * log_segsum(gt).exp() * kt.unsqueeze(-2)).sum(dim=-3)  # [..., nb, t, s]
    eye = torch.eye(nb, dtype=torch.bool, device=q.device)[:, :, None, None]
    blocks = torch.where(eye, diag.unsqueeze(-3), cross)  # [..., nb_i, nb_j, t, s]
    return blocks.transpose(-3, -2).reshape(*blocks.shape[:-4], cp, cp)[..., :c, :c]


def _parts(q: Tensor, k: Tensor, v: Tensor, g: Tensor, *, sub: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Chunk parts ``(O_intra, Q', A, R)`` (see ``_chunked_scan``); g ``[..., C]`` or ``[..., C, Dk]``."""
    if g.dim() == q.dim():  # one decay per key dimension
        b = token_prefix_sum(g)  # [..., C, Dk]: log decay from the chunk start to t
        after = token_suffix_sum(g)  # log decay from t to the chunk end
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, g))
        shape = torch.broadcast_shapes(q.shape, g.shape)
        qx, kx = q.expand(shape), k.expand(shape)  # grouped value heads: this group's tiles only
        if tracing() and sub < q.shape[-2] and not needs_grad:
            scores = _blocked_vector_scores(qx, kx, g, COMPILED_SUB_CHUNK)
        else:
            scores = chunk_scores(qx, kx, g, sub)
    else:  # one decay per token
        b = g.cumsum(dim=-1).unsqueeze(-1)  # [..., C, 1]
        after = suffix_sum(g, -1).unsqueeze(-1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * log_segsum(g).exp_()
    o_intra = torch.matmul(scores, v)  # [..., C, Dv]
    q_state = q * b.exp()  # [..., C, Dk]
    r = torch.matmul((k * after.exp()).transpose(-1, -2), v)  # [..., Dk, Dv]
    a = b[..., -1, :].exp().expand(*r.shape[:-1])  # [..., Dk]
    return o_intra, q_state, a, r


def _recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """The definition, one token at a time (tokens on dim -2; q, k may broadcast against v)."""
    outs = []
    for t in range(v.shape[-2]):
        decay = g[..., t, :].exp().unsqueeze(-1) if g.dim() == v.dim() else g[..., t].exp()[..., None, None]
        s = decay * s + k[..., t, :].unsqueeze(-1) * v[..., t, :].unsqueeze(-2)  # [..., Dk, Dv]
        outs.append(torch.matmul(q[..., t, :].unsqueeze(-2), s).squeeze(-2))  # [..., Dv]
    return torch.stack(outs, dim=-2), s


def _recurrent_shapes(q: Tensor, k: Tensor, v: Tensor, g: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    return s.new_empty(*s.shape[:-2], v.shape[-2], v.shape[-1]), s.new_empty(s.shape)


_recurrent_op = scan.token_loop("gla_recurrent", _recurrent, _recurrent_shapes)


def _forms(scale: float) -> dict[str, scan.Form]:
    """GLA's forms for :func:`attnzoo.functional.recurrent._chunked_scan.run_family` (``s0`` in the compute dtype)."""

    def recurrent(q: Tensor, k: Tensor, v: Tensor, gates: list[Tensor], s0: Tensor, chunk: int,
                  segments: object) -> tuple[Tensor, Tensor]:
        cdt = s0.dtype
        return _recurrent_op(q.to(cdt) * scale, k.to(cdt), v.to(cdt), gates[0].to(cdt), s0)

    def quadratic(q: Tensor, k: Tensor, v: Tensor, gates: list[Tensor], s0: Tensor, chunk: int,
                  segments: object) -> tuple[Tensor, Tensor]:
        n = v.shape[-2]
        return scan.chunked_scan(functools.partial(_parts, sub=n), q, k, v, gates, s0, n, 0, scale)

    def chunked(q: Tensor, k: Tensor, v: Tensor, gates: list[Tensor], s0: Tensor, chunk: int,
                segments: list[tuple[int, int]] | None) -> tuple[Tensor, Tensor]:
        c, dk, dv = min(chunk, v.shape[-2]), k.shape[-1], v.shape[-1]
        vec = c * dk * (3 * min(SUB_CHUNK, c) + 6) if gates[0].dim() == v.dim() else 0  # diagonal blocks, levels
        per_chunk = v[..., 0, 0].numel() * s0.element_size() * (3 * c * c + 4 * c * (dk + dv) + 2 * dk * dv + vec)
        return scan.chunked_scan(functools.partial(_parts, sub=SUB_CHUNK), q, k, v, gates, s0, c, per_chunk, scale,
                                 segments)

    return {"recurrent": recurrent, "chunked": chunked, "quadratic": quadratic}


def run_gla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, *, scale: float, initial_state: Tensor | None,
            form: str, chunk: int, bounds: list[int] | None = None) -> tuple[Tensor, Tensor]:
    """Validated inputs -> ``(out [B, Hv, N, Dv] in the compute dtype, state [B or S, Hv, Dk, Dv])``.

    ``g`` is the log decay, ``[B, Hv, N]`` (scalar per token) or ``[B, Hv, N, Dk]``; ``form`` not "auto";
    ``bounds`` the packed sequences' ``cu_seqlens`` (a list) or ``None``.
    """
    cdt = scan.compute_dtype(q.dtype)
    hv, dk, dv = v.shape[1], q.shape[-1], v.shape[-1]
    states = q.shape[0] if bounds is None else len(bounds) - 1
    s0 = q.new_zeros(states, hv, dk, dv, dtype=cdt) if initial_state is None else initial_state.to(cdt)
    return scan.run_family(_forms(scale), q, k, v, [g], s0, form=form, chunk=chunk, bounds=bounds)


def gated_linear_attention(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, *, scale: float | None = None,
                           initial_state: Tensor | None = None, return_state: bool = False, form: str = "auto",
                           chunk_size: int | None = None,
                           cu_seqlens: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Causal gated linear attention: ``S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T``, ``o_t = scale q_t^T S_t``.

    ``scale``, ``initial_state``, ``return_state`` and ``chunk_size`` mean the same in
    :func:`retention` and :func:`delta_rule`, whose docstrings refer here (``docs/recurrent.md``).

    Args:
        q, k: ``[B, Hk, N, Dk]``; v: ``[B, Hv, N, Dv]`` (one dtype, one device), ``Hv`` a multiple of ``Hk``
            (grouped value heads: value head ``j`` reads key head ``j // (Hv // Hk)``; q and k are never
            expanded in memory).
        log_decay: ``g <= 0``, ``[B, Hv, N, Dk]`` (a decay per key dimension, GLA) or ``[B, Hv, N]`` (one
            decay per token broadcast over Dk: Mamba-2's SSD, gated retention). Finite.
        scale: multiplies q; default ``1/sqrt(Dk)``.
        initial_state: ``S_0 [B, Hv, Dk, Dv]`` (the state after earlier tokens); default zeros.
        return_state: also return ``S_N [B, Hv, Dk, Dv]`` (feed it back as ``initial_state`` to continue).
        form: ``"recurrent"`` (the loop), ``"chunked"``, ``"quadratic"`` (``[N, N, Dk]`` memory) or
            ``"auto"``: recurrent for N = 1; for a per-token decay quadratic for N <= chunk_size,
            chunked beyond; for a per-dimension decay chunked (its quadratic form's ``[N, N, Dk]``
            elementwise tensor ran 10-15x slower forward + backward than the chunked halving at
            N = 64 on 1 thread, ``benchmarks/bench_recurrent.py --forms``).
        chunk_size: chunk length of the chunked form (default 64); any value >= 1.
        cu_seqlens: packed sequences, int32 ``[S+1]`` with ``B == 1``: the tokens ``[cu[i], cu[i+1])``
            form sequence i, run independently from ``initial_state[i]`` (``[S, Hv, Dk, Dv]``, default
            zeros); the returned state is ``[S, Hv, Dk, Dv]``. Empty sequences are allowed. Equal to
            calling each sequence alone (forward and gradients).

    Returns:
        ``out [B, H, N, Dv]`` in q's dtype, or ``(out, state)``; the state is float32 (float64 for
        float64 inputs). Half inputs compute in float32.

    Raises:
        ValueError / TypeError naming the argument: shapes, dtypes, devices, ``log_decay > 0`` or not
        finite (checked in eager mode), bad form or chunk_size.
    """
    fn = "gated_linear_attention"
    scale_f, chunk, bounds = scan.check_recurrent_inputs(fn, q, k, v, scale, initial_state, return_state, form,
                                                         chunk_size, cu_seqlens)
    b, hv, n, _ = v.shape
    dk = q.shape[-1]
    scan.check_gate(fn, "log_decay", log_decay, [(b, hv, n, dk), (b, hv, n)], q.device, float("-inf"), 0.0,
                    open_low=True)
    resolved = scan.resolve_form(form, n, chunk)
    if form == "auto" and resolved == "quadratic" and log_decay.dim() == 4:
        resolved = "chunked"
    out, state = run_gla(q, k, v, log_decay, scale=scale_f, initial_state=initial_state, form=resolved, chunk=chunk,
                         bounds=bounds)
    return scan.finish(out, state, q.dtype, return_state)
