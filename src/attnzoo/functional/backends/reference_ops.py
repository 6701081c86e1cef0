"""The reference backend as two custom operators, for ``torch.compile``.

Traced, the reference (a float64/float32 oracle of plain tensor operations) leaves inductor its
score masking, softmax and casts to generate and, cold, to build as C++ kernels (14-18 s at
``[1, 4, 2048, 32]`` on 2 cores). Behind operators the compiled graph holds one node per direction:

* ``attnzoo::reference_fwd(q, k, v, mask, causal, window_left, window_right, has_window, q_offset,
  scale, softcap, alibi_slopes, keep_probs) -> (out [B, Hq, Nq, Dv], lse [B, Hq, Nq],
  probs [B, Hq, Nq, Nk] or an empty [0])``, the eager :func:`reference_attention`; ``probs`` (in the
  compute dtype) are the weights, kept when they are returned or gradients are needed, as eager
  autograd keeps them;
* ``attnzoo::reference_bwd(d_out, d_lse, d_probs, q, k, v, probs, scale, softcap) -> (dq, dk, dv)``,
  the softmax backward on those probabilities (with a softcap, one matmul recomputes the raw scores
  for its ``tanh``; nothing else of the forward runs again).

Dropout (the backward would need the dropped probabilities) and gradients for a float mask or
ALiBi slopes keep the traced path. ``Mask`` objects are evaluated into a dense mask first.
"""

import torch
from torch import Tensor

from attnzoo.functional.backends.reference import reference_attention
from attnzoo.functional.backends.tiled_ops import dense_mask
from attnzoo.functional.core._request import AttnRequest, build_request
from attnzoo.functional.core.rules import compute_dtype

__all__ = ["reference_bwd", "reference_fwd", "reference_op_attention"]


def _request(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, window_left: int | None,
             window_right: int | None, has_window: bool, q_offset: int, scale: float, softcap: float | None,
             alibi_slopes: Tensor | None, return_weights: bool) -> AttnRequest:
    return build_request(q, k, v, mask=mask, causal=causal,
                         window=(window_left, window_right) if has_window else None, q_offset=q_offset,
                         scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=0.0,
                         return_lse=True, return_weights=return_weights)


@torch.library.custom_op("attnzoo::reference_fwd", mutates_args=())
def reference_fwd(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, window_left: int | None,
                  window_right: int | None, has_window: bool, q_offset: int, scale: float, softcap: float | None,
                  alibi_slopes: Tensor | None, keep_probs: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The reference's ``out [B, Hq, Nq, Dv]`` (q's dtype), ``lse [B, Hq, Nq]`` and, when ``keep_probs``,
    the probabilities ``[B, Hq, Nq, Nk]`` in the compute dtype (the weights, and what the backward
    reads, as eager autograd saves them); else an empty ``[0]``."""
    r = _request(q, k, v, mask, causal, window_left, window_right, has_window, q_offset, scale, softcap,
                 alibi_slopes, keep_probs)
    with torch.no_grad():
        out, lse, probs = reference_attention(r, weights_in_compute_dtype=True)
    assert lse is not None  # return_lse=True
    return out.contiguous(), lse.contiguous(), (q.new_empty(0) if probs is None else probs.contiguous())


@reference_fwd.register_fake
def _reference_fwd_fake(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                        window_left: int | None, window_right: int | None, has_window: bool, q_offset: int,
                        scale: float, softcap: float | None, alibi_slopes: Tensor | None,
                        keep_probs: bool) -> tuple[Tensor, Tensor, Tensor]:
    b, hq, nq, _ = q.shape
    acc = compute_dtype(q.dtype)
    probs = q.new_empty(b, hq, nq, k.shape[2], dtype=acc) if keep_probs else q.new_empty(0)
    return q.new_empty(b, hq, nq, v.shape[-1]), q.new_empty(b, hq, nq, dtype=acc), probs


@torch.library.custom_op("attnzoo::reference_bwd", mutates_args=())
def reference_bwd(d_out: Tensor | None, d_lse: Tensor | None, d_probs: Tensor | None, q: Tensor, k: Tensor,
                  v: Tensor, probs: Tensor, scale: float, softcap: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`reference_fwd` from its outputs' gradients (``None``: unused), by the
    softmax backward on the saved probabilities ``P``: ``dS = P * (G - rowsum(P * G))`` with
    ``G = dO V^T + dP`` plus ``P * dLSE``, through the softcap's ``tanh``."""
    cdt, group = probs.dtype, q.shape[1] // k.shape[1]
    qc, kc, vc = (t.to(cdt) for t in (q, k, v))
    kx, vx = (t.repeat_interleave(group, dim=1) for t in (kc, vc))  # [B, Hq, Nk, D|Dv]
    g = torch.zeros_like(probs) if d_out is None else torch.matmul(d_out.to(cdt), vx.transpose(-1, -2))
    if d_probs is not None:
        g = g + d_probs.to(cdt)
    ds = probs * (g - (probs * g).sum(dim=-1, keepdim=True))
    if d_lse is not None:
        ds = ds + probs * d_lse.to(cdt).unsqueeze(-1)
    if softcap is not None:
        ds = ds * (1 - torch.tanh(torch.matmul(qc, kx.transpose(-1, -2)) * (scale / softcap)).square())
    dv = torch.zeros_like(vx) if d_out is None else torch.matmul(probs.transpose(-1, -2), d_out.to(cdt))
    dq = torch.matmul(ds, kx) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qc) * scale

    def heads(t: Tensor) -> Tensor:  # [B, Hq, ...] -> [B, Hkv, ...]: the sum over each group
        return t.unflatten(1, (k.shape[1], group)).sum(dim=2) if group > 1 else t

    return dq.to(q.dtype).contiguous(), heads(dk).to(k.dtype).contiguous(), heads(dv).to(v.dtype).contiguous()


@reference_bwd.register_fake
def _reference_bwd_fake(d_out: Tensor | None, d_lse: Tensor | None, d_probs: Tensor | None, q: Tensor, k: Tensor,
                        v: Tensor, probs: Tensor, scale: float, softcap: float | None) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:  # type: ignore[no-untyped-def]
    q, k, v, _mask, _causal, _left, _right, _has, _off, scale, softcap, _alibi, keep_probs = inputs
    if not keep_probs:
        raise ValueError("attnzoo::reference_fwd: gradients need keep_probs=True (the backward reads them)")
    ctx.save_for_backward(q, k, v, output[2])
    ctx.scale, ctx.softcap = scale, softcap
    ctx.set_materialize_grads(False)  # unused outputs' gradients arrive as None


def _backward_formula(ctx, d_out: Tensor | None, d_lse: Tensor | None,  # type: ignore[no-untyped-def]
                      d_probs: Tensor | None) -> tuple:
    q, k, v, probs = ctx.saved_tensors
    dq, dk, dv = reference_bwd(d_out, d_lse, d_probs, q, k, v, probs, ctx.scale, ctx.softcap)
    return (dq, dk, dv) + (None,) * 10


reference_fwd.register_autograd(_backward_formula, setup_context=_setup_context)


def reference_op_attention(r: AttnRequest) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Run a validated request on the reference through the operators (what a compiled graph calls);
    returns ``(out, lse or None, weights or None)`` like :func:`reference_attention`. Dropout and
    gradients for a float mask or ALiBi slopes stay traced."""
    if r.dropout_p > 0 or any(t is not None and t.requires_grad for t in (r.mask_tensor, r.alibi_slopes)):
        return reference_attention(r)
    m = dense_mask(r)
    left, right = r.window if r.window is not None else (None, None)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (r.q, r.k, r.v))
    out, lse, probs = reference_fwd(r.q, r.k, r.v, m, r.causal, left, right, r.window is not None, r.q_offset,
                                    r.scale, r.softcap, r.alibi_slopes, r.return_weights or needs_grad)
    return out, (lse if r.return_lse else None), (probs.to(r.q.dtype) if r.return_weights else None)
