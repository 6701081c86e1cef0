r"""The ``tiled`` backend: flash-style exact attention in plain PyTorch.

Queries are cut into blocks of ``block_q`` rows; for each query block the keys it can see are
visited in chunks (runs of key tiles that the mask's block map does not prove empty). Online
softmax keeps, per query row, the running maximum :math:`m`, normaliser :math:`\ell` and
unnormalised output :math:`o`. For a new chunk with scores :math:`s_j`:

.. math::

    m' = \max(m, \max_j s_j), \quad
    \ell' = e^{m - m'} \ell + \sum_j e^{s_j - m'}, \quad
    o' = e^{m - m'} o + \sum_j e^{s_j - m'} v_j,

and at the end :math:`\text{out} = o / \ell`, :math:`\text{lse} = m + \log \ell`. Only one
``block_q x chunk`` score tile exists at a time, so memory is ``O(N x block)``, not ``O(N^2)``.
When nothing is added to the scaled scores (no softcap, ALiBi or float mask) the forward pass
folds :math:`\log_2 e` into the scale and uses ``exp2`` (the same numbers; ~1.7x faster than
``exp`` in torch on CPU), converting the LSE back to natural log at the end; the backward pass
recomputes :math:`P = 2^{S \log_2 e - \text{lse} \log_2 e}` the same way.

The backward pass (a custom autograd function) recomputes each tile's probabilities from the
saved LSE, :math:`P = e^{S - \text{lse}}`, and accumulates

.. math::

    dV \mathrel{+}= P^\top dO, \quad dS = P \odot (dO\,V^\top - \delta), \quad
    \delta = \text{rowsum}(dO \odot O), \quad dQ \mathrel{+}= dS\,K, \quad dK \mathrel{+}= dS^\top Q

(times the scale, and the softcap derivative :math:`1 - \tanh^2` when a softcap is set), again
one tile at a time. GQA never expands K/V: the ``G = Hq / Hkv`` query heads of a group are folded
into the row dimension, ``[B, Hkv, G * block_q, D]``, and multiply the shared K/V directly.
Half-precision inputs get float32 scores from float32 copies of Q and K (half products rounded
to half precision were off by O(1) for large logits), float32 softmax, statistics, accumulators
and backward; only an inference forward's ``P V`` matmuls run in half precision, unless half matmuls are
measured >= 1.25x slower than float32 ones (never on CUDA; see
:mod:`attnzoo.functional.backends.halfmath`); then every tile runs in float32. Half-precision
probabilities are normalised per chunk before the P V matmul (no float16 overflow, and a row
with one visible key returns its value exactly); float16 inputs whose scores could exceed the
float16 range run in float32.

Layout: :mod:`.plan` (tile sizes as a :class:`TileConfig`, the tile plan and its cache),
:mod:`.scores` (tile and band scores), :mod:`.forward`, :mod:`.flat` (the forward of a sliding window
over every head at once), :mod:`.native` (a compiled C++ forward for float32 inference, opt-in: ``attnzoo native --build``), :mod:`.backward` (also the kernel that ring attention reuses). Tile sizes are an argument (``tiled_attention(r, tiles=...)``) or a
context (:func:`use_tiles`), never module globals.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from attnzoo.functional.backends.halfmath import half_math
from attnzoo.functional.backends.tiled.backward import (
    FP16_SAFE_LIMIT,
    accumulate_grads,
    attention_backward,
)
from attnzoo.functional.backends.tiled.forward import attention_forward
from attnzoo.functional.backends.tiled.native import native_forward
from attnzoo.functional.backends.tiled.plan import (
    DEFAULT_TILES,
    PLAN_CACHE_SIZE,
    Band,
    Chunk,
    TileConfig,
    TilePlan,
    band_plan,
    current_tiles,
    tile_plan,
    use_tiles,
)
from attnzoo.functional.backends.tiled.scores import LOG2E
from attnzoo.functional.core._request import AttnRequest, Capabilities

__all__ = [
    "CAPABILITIES",
    "DEFAULT_TILES",
    "PLAN_CACHE_SIZE",
    "Band",
    "Chunk",
    "TileConfig",
    "TilePlan",
    "accumulate_grads",
    "attention_backward",
    "current_tiles",
    "native_half_matmul",
    "plan_for",
    "tile_plan",
    "tiled_attention",
    "use_tiles",
]

#: What this backend cannot do (feature names of ``AttnRequest.features()``).
CAPABILITIES = Capabilities("tiled", frozenset({"return_weights", "dropout", "float mask gradient", "alibi gradient"}))


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, r: AttnRequest, plan: TilePlan,  # type: ignore[override]
                *captured: Tensor):
        out, lse = attention_forward(r, plan, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.r, ctx.plan, ctx.n_captured = r, plan, len(captured)
        return out, lse

    @staticmethod
    def backward(ctx, d_out: Tensor, d_lse: Tensor | None):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        captured: list[Tensor | None] | None = [None] * ctx.n_captured if ctx.n_captured else None
        v_in = v.to(q.dtype)  # half V beside float32 Q/K (see tiled_attention): the backward runs in float32
        dq, dk, dv = attention_backward(ctx.r, ctx.plan, q, k, v_in, out, lse, d_out.to(q.dtype).contiguous(),
                                        d_lse, captured)
        return dq, dk, dv.to(v.dtype), None, None, *(captured or ())


def native_half_matmul(dtype: torch.dtype, device_type: str) -> bool:
    """Whether tiles of ``dtype`` (float16/bfloat16) inputs are multiplied in ``dtype`` on
    ``device_type``: always on CUDA; on CPU unless measured >= 1.25x slower than float32 (see
    :mod:`attnzoo.functional.backends.halfmath`: timed once per process, never read from CPU flags)."""
    return half_math(dtype, device_type) == dtype


def _fp16_scores_may_overflow(r: AttnRequest) -> bool:
    q_max = r.q.float().norm(dim=-1).amax()
    k_max = r.k.float().norm(dim=-1).amax()
    return bool(q_max * k_max * (r.scale * LOG2E) > FP16_SAFE_LIMIT)  # scores past it (Cauchy-Schwarz) run in float32


def plan_for(r: AttnRequest, block_q: int | None = None, block_k: int | None = None,
             tiles: TileConfig | None = None) -> TilePlan:
    """The plan :func:`tiled_attention` runs ``r`` with (the custom operators of
    :mod:`attnzoo.functional.backends.tiled_ops` recompute it in their backward from the same request)."""
    plan = tile_plan(r, block_q, block_k, tiles)
    if r.score_mod is not None:  # score_mod runs on [B, Hq, bq, bk] tiles: no sliding-window bands
        return dataclasses.replace(plan, bands=())
    return band_plan(r, plan) if block_q is None else plan


def tiled_attention(r: AttnRequest, block_q: int | None = None, block_k: int | None = None,
                    tiles: TileConfig | None = None) -> tuple[Tensor, Tensor | None]:
    """Exact attention by key tiles. Returns ``(out [B, Hq, Nq, Dv], lse [B, Hq, Nq] float32)``;
    ``lse`` is ``None`` for a forward-only request without ``return_lse`` (not computed then).

    Gradients flow to q, k, v and the tensors a ``score_mod`` captures from both outputs (a
    gradient on the LSE is what merging partial results needs); not to float masks or ALiBi slopes (the dispatcher routes requests
    that need those gradients elsewhere).

    ``tiles`` sets the tile sizes (default: :func:`current_tiles`, i.e. :data:`DEFAULT_TILES`
    unless inside :func:`use_tiles`); ``block_q``/``block_k`` pin the block sizes (then sliding
    windows are not re-planned with smaller query blocks)."""
    plan = plan_for(r, block_q, block_k, tiles)
    q, k, v = r.q, r.k, r.v
    half = q.dtype in (torch.float16, torch.bfloat16)
    if half and (not native_half_matmul(q.dtype, q.device.type)
                 or (q.dtype == torch.float16 and _fp16_scores_may_overflow(r))):
        q, k, v = q.float(), k.float(), v.float()  # tile math in float32; memory stays O(N x block)
    elif half:
        # Scores from float32 Q and K (exact products, float32 sums: sdpa's accuracy; half scores of
        # large logits were off by O(1), issue 33). For inference V stays half for the P V matmuls
        # (P normalised first, see forward._p_times_v); for training it is float32 too, since the
        # backward's delta = rowsum(dO * O) would carry the half P V's rounding into dQ and dK.
        # Memory stays O(N x block).
        q, k = q.float(), k.float()
    captured = r.score_mod.captured if r.score_mod is not None else ()
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *captured))
    if training and half:
        v = v.float()
    if (fast := native_forward(r, q, k, v)) is not None:  # the compiled twin (forward and backward), when built
        out, lse = fast[0], fast[1] if r.return_lse or training else None
    elif training:
        out, lse = _TiledAttention.apply(q, k, v, r, plan, *captured)
    else:
        out, lse = attention_forward(r, plan, q, k, v, need_lse=r.return_lse)
    return out.to(r.q.dtype), lse
