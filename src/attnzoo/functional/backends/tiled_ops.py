"""The tiled backend as two custom operators, for ``torch.compile`` and ``torch.export``.

The tiled backend is a Python loop over query blocks and key chunks whose plan comes from the
mask's block map (data-dependent ``nonzero``). Traced by Dynamo, that loop would be unrolled into
hundreds of graph nodes (long compiles) and break the graph where it reads tensor data. Here it is
hidden behind ``torch.library.custom_op``:

* ``attnzoo::tiled_attention_fwd(q, k, v, mask, causal, window_left, window_right, has_window, q_offset,
  scale, softcap, alibi_slopes, need_lse) -> (out [B, Hq, Nq, Dv], lse [B, Hq, Nq])``
* ``attnzoo::tiled_attention_bwd(d_out, d_lse, q, k, v, out, lse, <same arguments>) -> (dq, dk, dv)``

Both take only tensors and Python scalars, have fake (meta) implementations giving the output
shapes, and ``tiled_fwd``'s autograd formula calls ``tiled_bwd``, so a compiled training step holds
one node per direction. The real implementations rebuild the :class:`AttnRequest` and run the
eager kernels (:func:`attnzoo.functional.backends.tiled.tiled_attention` and its backward), so compiled and
eager results are the same numbers.

A :class:`~attnzoo.masks.Mask` object (a Python predicate) cannot cross the operator boundary: in a
compiled graph it is evaluated into a dense bool tensor first (traceable, but ``O(Nq x Nk)``
memory, unlike the eager tiled path that evaluates it per tile).
"""


import torch
from torch import Tensor

from attnzoo.functional.backends.tiled import (
    attention_backward,
    plan_for,
    tiled_attention,
)
from attnzoo.functional.backends.tiled.native import native_backward
from attnzoo.functional.core._request import AttnRequest, build_request
from attnzoo.functional.core.rules import output_like_v, stored_like_v

__all__ = ["dense_mask", "op_request", "tiled_bwd", "tiled_fwd", "tiled_op_attention", "traceable_visible_fraction"]


def op_request(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
             window_left: int | None, window_right: int | None, has_window: bool, q_offset: int,
             scale: float, softcap: float | None, alibi_slopes: Tensor | None, need_lse: bool = True,
             ) -> AttnRequest:
    return build_request(q, k, v, mask=mask, causal=causal,
                         window=(window_left, window_right) if has_window else None, q_offset=q_offset,
                         scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=0.0,
                         return_lse=need_lse, return_weights=False)


def _acc_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("attnzoo::tiled_attention_fwd", mutates_args=())
def tiled_fwd(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
              window_left: int | None, window_right: int | None, has_window: bool, q_offset: int,
              scale: float, softcap: float | None, alibi_slopes: Tensor | None,
              need_lse: bool = True) -> tuple[Tensor, Tensor]:
    """Tiled attention forward: ``out [B, Hq, Nq, Dv]`` (q's dtype, stored in ``v``'s memory layout when
    their shapes agree) and ``lse [B, Hq, Nq]`` (float32,
    float64 for float64 inputs; an empty ``[0]`` tensor unless ``need_lse``: inference without
    ``return_lse`` skips it). Arguments as :func:`attnzoo.attention`; ``window`` is
    ``(window_left, window_right)`` when ``has_window`` (``None`` = unbounded side)."""
    r = op_request(q, k, v, mask, causal, window_left, window_right, has_window, q_offset, scale, softcap,
                 alibi_slopes, need_lse)
    with torch.no_grad():
        out, lse = tiled_attention(r)
    if lse is None:
        lse = q.new_empty(0, dtype=_acc_dtype(q))
    return stored_like_v(out, q, v), lse.contiguous()


@tiled_fwd.register_fake
def _tiled_fwd_fake(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                    window_left: int | None, window_right: int | None, has_window: bool, q_offset: int,
                    scale: float, softcap: float | None, alibi_slopes: Tensor | None,
                    need_lse: bool = True) -> tuple[Tensor, Tensor]:
    B, Hq, Nq, _ = q.shape
    out = output_like_v(q, v)
    lse = q.new_empty((B, Hq, Nq) if need_lse else (0,), dtype=_acc_dtype(q))
    return out, lse


@torch.library.custom_op("attnzoo::tiled_attention_bwd", mutates_args=())
def tiled_bwd(d_out: Tensor, d_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
              lse: Tensor, mask: Tensor | None, causal: bool, window_left: int | None,
              window_right: int | None, has_window: bool, q_offset: int, scale: float,
              softcap: float | None, alibi_slopes: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`tiled_fwd` from those of its outputs (tile by tile,
    probabilities recomputed from ``lse``)."""
    r = op_request(q, k, v, mask, causal, window_left, window_right, has_window, q_offset, scale, softcap,
                 alibi_slopes)
    plan = plan_for(r)
    qc, kc, vc, oc = q, k, v, out
    if q.dtype in (torch.float16, torch.bfloat16):
        qc, kc, vc, oc = q.float(), k.float(), v.float(), out.float()  # as the eager path computes
    with torch.no_grad():
        fast = native_backward(r, qc, kc, vc, oc, lse, d_out, d_lse)  # the compiled kernel, when built
        dq, dk, dv = fast if fast is not None else attention_backward(r, plan, qc, kc, vc, oc, lse,
                                                                      d_out.to(qc.dtype).contiguous(), d_lse)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


@tiled_bwd.register_fake
def _tiled_bwd_fake(d_out: Tensor, d_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                    lse: Tensor, mask: Tensor | None, causal: bool, window_left: int | None,
                    window_right: int | None, has_window: bool, q_offset: int, scale: float,
                    softcap: float | None, alibi_slopes: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    # contiguous, as the real kernel returns them (q/k/v may be strided views, e.g. [B, N, H, D] transposed)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_SCALAR_ARGS = ("causal", "window_left", "window_right", "has_window", "q_offset", "scale", "softcap")


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:  # type: ignore[no-untyped-def]
    q, k, v, mask, *scalars, alibi_slopes, need_lse = inputs
    if not need_lse:
        raise ValueError("attnzoo::tiled_attention_fwd: gradients need need_lse=True (the backward reads the LSE)")
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask, alibi_slopes)
    ctx.scalars = dict(zip(_SCALAR_ARGS, scalars, strict=True))
    # an unused LSE (the usual case) arrives as None, not as a zeros tensor: a compiled backward then
    # builds no kernel for it (cold, that kernel's C++ build cost about 7 s)
    ctx.set_materialize_grads(False)


def _backward_formula(ctx, d_out: Tensor | None, d_lse: Tensor | None) -> tuple:  # type: ignore[no-untyped-def]
    q, k, v, out, lse, mask, alibi_slopes = ctx.saved_tensors
    s = ctx.scalars
    if d_out is None:  # only the LSE was used
        d_out = torch.zeros_like(out)
    dq, dk, dv = tiled_bwd(d_out, d_lse, q, k, v, out, lse, mask, s["causal"], s["window_left"],
                           s["window_right"], s["has_window"], s["q_offset"], s["scale"], s["softcap"],
                           alibi_slopes)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


tiled_fwd.register_autograd(_backward_formula, setup_context=_setup_context)


def dense_mask(r: AttnRequest) -> Tensor | None:
    """The request's mask tensor with its ``Mask`` object evaluated in (bool, or float with ``-inf``)."""
    m = r.mask_tensor
    if r.mask_obj is None:
        return m
    allowed = r.mask_obj.evaluate(r.batch, r.hq, r.q_offset, 0, r.nq, 0, r.nk, device=r.q.device, expand=False)
    if m is None:
        return allowed
    if m.dtype == torch.bool:
        return m & allowed
    return m.masked_fill(~allowed, float("-inf"))


def tiled_op_attention(r: AttnRequest) -> tuple[Tensor, Tensor | None]:
    """Run a validated request on the tiled backend through the custom operators (what a compiled
    graph calls). Returns ``(out, lse or None)`` like :func:`~attnzoo.functional.backends.tiled.tiled_attention`."""
    left, right = r.window if r.window is not None else (None, None)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (r.q, r.k, r.v))
    out, lse = tiled_fwd(r.q, r.k, r.v, dense_mask(r), r.causal, left, right, r.window is not None,
                         r.q_offset, r.scale, r.softcap, r.alibi_slopes, r.return_lse or needs_grad)
    return out, (lse if r.return_lse else None)


def traceable_visible_fraction(r: AttnRequest, block: int = 128) -> float:
    """Estimate, from sizes only (no tensor data, no plan), the fraction of ``block x block``
    tiles the tiled backend visits: what the ``auto`` policy reads while compiling. Exact plans
    need the mask's block map; this closed form counts, per query block, the key tiles its causal
    or window span overlaps. A ``Mask`` object counts as dense (its pattern is unknown)."""
    if r.mask_obj is not None:
        return 1.0
    left, right = r.window if r.window is not None else (None, None)
    if r.causal:
        right = 0 if right is None else min(right, 0)
    if left is None or right is None:
        return 1.0 if not r.causal else 0.75  # unbounded on one side: at least half the tiles
    span = block + left + right + block  # keys seen by one query block, plus a partial tile
    return min(1.0, span / max(1, r.nk))
