"""Performer attention (FAVOR+): Choromanski et al. 2021, "Rethinking Attention with Performers".

The softmax kernel is an expectation over Gaussian directions ``w ~ N(0, I_D)``::

    exp(x . y) = E_w[ exp(w . x - |x|^2 / 2) * exp(w . y - |y|^2 / 2) ]

so with ``F`` directions ``W [F, D]`` the positive random features
``phi(x) = exp(W x - |x|^2 / 2) / sqrt(F)`` give an unbiased estimate ``phi(x) . phi(y)`` of
``exp(x . y)``, always positive (a well-behaved normaliser). Queries and keys are scaled by
``scale ** 0.5`` first, so ``x_q . x_k = scale * q . k``. The attention itself is linear attention
on these features (:mod:`attnzoo.functional.feature_maps.linear`): quadratic, chunked and recurrent forms, causal
prefix sums by chunks, carried state ``(S [B, H, F, Dv], z [B, H, F])``.

Orthogonal features (the "O" in FAVOR+): the rows of ``W`` are drawn in blocks of ``D`` exactly
orthogonal directions (QR of a Gaussian matrix), each rescaled to the norm of an independent
Gaussian vector, which keeps every row marginally ``N(0, I)`` and lowers the estimator's variance.

Numerical stabiliser: a factor common to every feature of one query cancels in the ratio, so
query features subtract their own maximum exponent. For keys, a factor common to *all* keys
cancels; a bidirectional call without a carried state subtracts the maximum exponent over the
real keys of each ``(batch, head)``. Causal and stateful calls use no data-dependent key shift, so
that outputs at ``t`` never depend on later tokens and states from separate calls add up; there the
key exponent ``w . x - |x|^2/2 = |w|^2/2 - |x - w|^2/2`` is bounded by ``|w|^2 / 2`` (about
``D / 2``), which float32 represents for head dims up to about 128.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

from attnzoo._validate import check_bool, check_int, check_optional_int, check_positive_float
from attnzoo.functional.core.rules import compute_dtype
from attnzoo.functional.feature_maps.linear import (
    State,
    check_form,
    check_inputs,
    check_key_padding,
    check_state,
    feature_attention,
    runs,
)

__all__ = ["draw_performer_projection", "performer_attention", "performer_features"]


def draw_performer_projection(
    num_features: int,
    head_dim: int,
    orthogonal: bool = True,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Random projection ``W [F, D]`` for :func:`performer_attention`.

    Args:
        num_features: ``F >= 1`` random features.
        head_dim: ``D``, the query/key head dimension.
        orthogonal: rows drawn in blocks of ``D`` mutually orthogonal directions, each scaled to
            the norm of an independent ``N(0, I_D)`` sample (FAVOR+); ``False`` = i.i.d. Gaussian rows.
        generator: random source; ``seed`` builds one (``torch.Generator().manual_seed(seed)``);
            with neither, torch's global generator is used.
        seed: reproducible draw (mutually exclusive with ``generator``).
        device, dtype: of the returned tensor (drawn in float64 on the CPU, then converted).

    Returns:
        ``[F, D]`` tensor; each row is marginally ``N(0, I_D)``.
    """
    f = check_int(num_features, "num_features")
    d = check_int(head_dim, "head_dim")
    check_bool(orthogonal, "orthogonal")
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed, not both")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if seed is not None:
        generator = torch.Generator().manual_seed(check_int(seed, "seed", minimum=None))
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if not orthogonal:
        w = torch.randn(f, d, generator=generator, dtype=torch.float64)
    else:
        blocks = []
        for _ in range(-(-f // d)):
            g = torch.randn(d, d, generator=generator, dtype=torch.float64)
            qmat, r = torch.linalg.qr(g)  # columns of qmat are orthonormal
            qmat = qmat * torch.sign(torch.diagonal(r)).unsqueeze(0)  # Haar-distributed
            blocks.append(qmat.T)  # rows orthonormal
        w = torch.cat(blocks, dim=0)[:f]  # [F, D]
        norms = torch.randn(f, d, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
        w = w * norms
    return w.to(device=device, dtype=dtype)


def performer_features(x: Tensor, projection: Tensor, *, is_query: bool, key_padding_mask: Tensor | None = None,
                       stabilize_keys: bool = False, root: float = 1.0) -> Tensor:
    """Positive random features ``exp(W x' - |x'|^2/2 - shift) / sqrt(F)`` with ``x' = root * x``:
    ``[B, H, N, D] -> [B, H, N, F]``.

    ``x`` is in the compute dtype; ``root`` is ``scale ** 0.5`` (folded into ``W``). Query rows
    subtract their own maximum exponent; keys subtract the maximum over real keys per ``(B, H)``
    only when ``stabilize_keys``. Padded keys (``key_padding_mask`` False) get all-zero features.
    """
    f = projection.shape[0]
    w = projection.to(x.dtype) * root  # [F, D]
    logits = torch.matmul(x, w.T)  # [B, H, N, F]
    logits = logits.sub_((x * x).sum(dim=-1, keepdim=True) * (0.5 * root * root) + 0.5 * math.log(f))
    if key_padding_mask is not None:
        logits = logits.masked_fill_(~key_padding_mask[:, None, :, None], float("-inf"))
    if is_query:
        logits = logits.sub_(logits.detach().amax(dim=-1, keepdim=True))
    elif stabilize_keys:
        shift = logits.detach().amax(dim=(-1, -2), keepdim=True)  # [B, H, 1, 1]; -inf if all padded
        logits = logits.sub_(torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift)))
    return logits.exp_()


def performer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    causal: bool = False,
    chunk_size: int | None = None,
    state: State | None = None,
    return_state: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    form: str = "auto",
) -> Tensor | tuple[Tensor, State]:
    """FAVOR+ approximation of softmax attention, linear in sequence length.

    Args:
        q: queries ``[B, H, Nq, D]``.
        k: keys ``[B, H, Nk, D]`` (``Nk == Nq`` when causal).
        v: values ``[B, H, Nk, Dv]``.
        projection: ``W [F, D]`` from :func:`draw_performer_projection` (shared by all heads).
        causal: token ``i`` sees keys ``j <= i`` (chunked prefix sums), plus ``state``.
        chunk_size: chunk length of the chunked causal form (default 64; need not divide N).
        state: ``(S [B, H, F, Dv], z [B, H, F])`` from an earlier call (causal decoding/streaming).
        return_state: also return the state after this call's keys.
        key_padding_mask: bool ``[B, Nk]``, True = real token; padded keys' *features* are zeroed.
        scale: softmax temperature being approximated, default ``1/sqrt(D)``.
        form: ``"auto" | "quadratic" | "chunked" | "recurrent"`` as in
            :func:`attnzoo.linear_attention`.

    Returns:
        ``out [B, H, Nq, Dv]`` in q's dtype, or ``(out, (S, z))`` with ``return_state=True``
        (float32, or float64 for float64 inputs). A query with no real key returns zeros.
    """
    check_inputs(q, k, v, causal)
    if not isinstance(projection, Tensor) or not projection.is_floating_point():
        raise TypeError(f"projection must be a float tensor [F, D], got {type(projection).__name__}")
    d = q.shape[-1]
    if projection.dim() != 2 or projection.shape[1] != d or projection.shape[0] < 1:
        raise ValueError(f"projection must have shape [F, D] with F >= 1 and D = {d}, got {tuple(projection.shape)}")
    if projection.device != q.device:
        raise ValueError(f"projection is on {projection.device} but q is on {q.device}")
    chunk = check_optional_int(chunk_size, "chunk_size")
    form = check_form(form)
    check_bool(return_state, "return_state")
    sc = 1.0 / math.sqrt(d) if scale is None else check_positive_float(scale, "scale")
    b, h, _, _ = q.shape
    cdt = compute_dtype(q.dtype)
    pad = check_key_padding(key_padding_mask, b, k.shape[2], k.device)
    st = check_state(state, b, h, projection.shape[0], v.shape[-1], cdt, q.device)
    root = sc**0.5
    n_q = q.shape[2]
    stabilize = not causal and st is None and not return_state

    def fq_fn(sizes: list[int]) -> Iterator[Tensor]:
        return (performer_features(part.to(cdt), projection, is_query=True, root=root) for part in runs(q, sizes, 2))

    def fk_fn(sizes: list[int]) -> Iterator[Tensor]:
        pads = [None] * len(sizes) if pad is None else runs(pad, sizes, 1)
        return (performer_features(part.to(cdt), projection, is_query=False, key_padding_mask=part_pad,
                                   stabilize_keys=stabilize, root=root)
                for part, part_pad in zip(runs(k, sizes, 2), pads, strict=True))

    out, new_state = feature_attention(fq_fn, fk_fn, v.to(cdt), n_q, projection.shape[0], causal=causal,
                                       form=form, chunk_size=chunk, state=st, eps=0.0)
    out = out.to(q.dtype)
    return (out, new_state) if return_state else out
