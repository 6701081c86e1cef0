"""The ``sdpa`` backend: torch's fused ``scaled_dot_product_attention`` kernels.

Translations done here:

* bottom-right causal alignment: torch's ``is_causal`` is top-left aligned, so it is used only
  when ``q_offset == 0``; any other alignment, window or mask becomes one dense ``attn_mask``;
* GQA through ``enable_gqa=True`` (K/V are never expanded in memory);
* ALiBi and float masks become an additive float ``attn_mask``;
* half-precision inputs on a CPU whose half matmuls are >= 1.25x slower than float32 ones run in float32
  (measured once per process, ``attnzoo.functional.backends.halfmath``);
* rows with no visible key are given one harmless visible key and their output is zeroed, so
  they return zeros (never NaN) with finite gradients.

Unsupported (a named error, or ``auto`` picks another backend): ``return_lse``,
``return_weights``, ``softcap``, float64, ``score_mod`` (see ``CAPABILITIES``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo.functional.backends.halfmath import half_math
from attnzoo.functional.core._request import AttnRequest, Capabilities
from attnzoo.functional.core.rules import output_like_v, stored_like_v
from attnzoo.masks import visible as visible_rule

#: What this backend cannot do (feature names of ``AttnRequest.features()``).
CAPABILITIES = Capabilities("sdpa", frozenset({"return_lse", "return_weights", "softcap", "float64",
                                                 "score_mod"}))


def dense_mask(r: AttnRequest) -> Tensor | None:
    """The request's masks, causal/window constraints and ALiBi as one SDPA ``attn_mask``
    (bool, or float when there is a bias) broadcastable to ``[B, Hq, Nq, Nk]``; ``None`` if none."""
    allowed = r.allowed(0, r.nq, 0, r.nk)
    bias = r.bias(0, r.nq, 0, r.nk)
    if bias is None:
        return allowed
    bias = bias.to(r.q.dtype)
    if allowed is not None:
        bias = bias.masked_fill(~allowed, float("-inf"))
    return bias


def sdpa_attention(r: AttnRequest) -> Tensor:
    """Attention through ``torch.nn.functional.scaled_dot_product_attention``; ``[B, Hq, Nq, Dv]``."""
    gqa = True if r.group > 1 else False  # noqa: SIM210 (a branch: a plain bool even under dynamic shapes)
    only_causal = (r.causal and r.window is None and r.mask_obj is None and r.mask_tensor is None
                   and r.alibi_slopes is None)
    # Half inputs run through float32 math (converted in and back) where SDPA in the half dtype is
    # measured slower than SDPA through float32 (attnzoo.functional.backends.halfmath, kernel="sdpa").
    math_dtype = half_math(r.q.dtype, r.q.device, kernel="sdpa")
    if math_dtype != r.q.dtype:
        r32 = dataclasses.replace(r, q=r.q.to(math_dtype), k=r.k.to(math_dtype), v=r.v.to(math_dtype))
        return sdpa_attention(r32).to(r.q.dtype)
    if not (r.causal or r.window is not None or r.mask_obj is not None or r.mask_tensor is not None
            or r.alibi_slopes is not None):
        return F.scaled_dot_product_attention(r.q, r.k, r.v, dropout_p=r.dropout_p, scale=r.scale, enable_gqa=gqa)
    if only_causal and r.q_offset == 0:
        if _compiled_cpu_training(r):
            return cpu_flash_attention(r.q, r.k, r.v, None, True, r.scale)
        return F.scaled_dot_product_attention(r.q, r.k, r.v, dropout_p=r.dropout_p, is_causal=True,
                                              scale=r.scale, enable_gqa=gqa)
    if tracing() and _band_sees_own_key(r):
        # one opaque mask operator, no empty row: a compiled graph with no generated kernel
        if _compiled_cpu_training(r):
            return cpu_flash_attention(r.q, r.k, r.v, _band_mask_op(r), False, r.scale)
        return F.scaled_dot_product_attention(r.q, r.k, r.v, attn_mask=_band_mask_op(r), dropout_p=r.dropout_p,
                                              scale=r.scale, enable_gqa=gqa)
    m = dense_mask(r)
    assert m is not None
    visible = m if m.dtype == torch.bool else m > float("-inf")
    row_ok = visible.any(dim=-1, keepdim=True)  # [B|1, H|1, Nq, 1]
    # Compiled: no host sync on the data; the empty-row-safe path below is exact for every mask.
    if not tracing() and bool(row_ok.all()):
        return F.scaled_dot_product_attention(r.q, r.k, r.v, attn_mask=m, dropout_p=r.dropout_p,
                                              scale=r.scale, enable_gqa=gqa)
    # Empty rows: make them see every key (finite math), then zero their output.
    if m.dtype == torch.bool:
        m = m | ~row_ok
    else:
        m = torch.where(row_ok, m, torch.zeros((), dtype=m.dtype, device=m.device))
    out = F.scaled_dot_product_attention(r.q, r.k, r.v, attn_mask=m, dropout_p=r.dropout_p,
                                         scale=r.scale, enable_gqa=gqa)
    return out * row_ok.to(out.dtype)


# --------------------------------------------------------------------------- compiled band masks
def _band_sees_own_key(r: AttnRequest) -> bool:
    """A causal/window-only request (no mask, no ALiBi) in which every query sees its own key (from
    Python ints): no row is empty, so SDPA can take the band mask as it is."""
    if r.mask_obj is not None or r.mask_tensor is not None or r.alibi_slopes is not None:
        return False
    left, right = r.window if r.window is not None else (None, None)
    return (r.q_offset >= 0 and r.q_offset + r.nq <= r.nk and (left is None or left >= 0)
            and (right is None or right >= 0))


def _band_mask_op(r: AttnRequest) -> Tensor:
    left, right = r.window if r.window is not None else (None, None)
    return band_mask(r.nq, r.nk, r.q_offset, r.causal, -1 if left is None else left, -1 if right is None else right,
                     r.q.dtype, r.q.device)


@torch.library.custom_op("attnzoo::band_mask", mutates_args=())
def band_mask(nq: int, nk: int, q_offset: int, causal: bool, left: int, right: int, dtype: torch.dtype,
              device: torch.device) -> Tensor:
    """Additive mask ``[Nq, Nk]`` (0 visible, ``-inf`` hidden, in ``dtype``) of queries at ``q_offset ..``
    under ``causal`` and the window ``(left, right)`` (``-1``: unbounded side), by
    :func:`attnzoo.masks.visible`. An operator, and already additive, so that a compiled graph calls
    it instead of generating (and, cold, building) kernels for the mask and its conversion."""
    q = torch.arange(q_offset, q_offset + nq, device=device).view(-1, 1)
    k = torch.arange(nk, device=device).view(1, -1)
    window = None if left < 0 and right < 0 else (None if left < 0 else left, None if right < 0 else right)
    ok = visible_rule(q, k, causal=causal, window=window).expand(nq, nk)
    return torch.zeros(nq, nk, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))


@band_mask.register_fake
def _band_mask_fake(nq: int, nk: int, q_offset: int, causal: bool, left: int, right: int, dtype: torch.dtype,
                    device: torch.device) -> Tensor:
    return torch.empty(nq, nk, dtype=dtype, device=device)


# --------------------------------------------------------------------------- compiled CPU training
# Compiled, a training call of SDPA is traced into torch's CPU flash forward and backward kernels,
# plus a layout conversion of the log-sum-exp that inductor generates (and, cold, builds: about 7 s
# of C++ compilation on 2 cores). The two operators below call the same two kernels as eager SDPA,
# so the compiled graph holds one opaque node per direction and no generated kernel. Their fakes give
# the kernels' own output layouts, except the forward's output, stored in ``v``'s layout (see
# ``rules.output_like_v``: a module's head merge is then a view). Inductor's on-disk cache keys do
# not cover a fake's strides: an operator whose fake changes gets a new name, so graphs cached by an
# older attnzoo miss instead of failing their stride checks (the forward was ``sdpa_cpu_fwd`` when it
# made every output contiguous, then ``sdpa_cpu_flash_fwd`` when its output kept ``q``'s layout).
def _compiled_cpu_training(r: AttnRequest) -> bool:
    """A compiled CPU training call that torch's CPU flash kernel serves: no dropout, ``D == Dv``."""
    return (tracing() and r.q.device.type == "cpu" and r.dropout_p == 0
            and r.q.shape[-1] == r.v.shape[-1] and torch.is_grad_enabled()
            and any(t.requires_grad for t in (r.q, r.k, r.v)))


def cpu_flash_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float) -> Tensor:
    """``[B, Hq, Nq, D]``: SDPA on CPU through :func:`sdpa_cpu_flash_fwd` (GQA served by the kernel)."""
    return sdpa_cpu_flash_fwd(q, k, v, mask, causal, scale)[0]


@torch.library.custom_op("attnzoo::sdpa_cpu_flash_forward", mutates_args=())
def sdpa_cpu_flash_fwd(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                       scale: float) -> tuple[Tensor, Tensor]:
    """torch's CPU flash attention forward (what eager SDPA runs): ``out [B, Hq, Nq, D]`` stored as
    :func:`~attnzoo.functional.core.rules.output_like_v` says, else as ``q`` (the kernel writes ``q``'s layout;
    a copy only when the two differ, e.g. RoPE wrote ``q`` as ``[B, H, N, D]`` while ``v`` is a
    ``[B, N, H, D]`` view) and ``lse [B, Hq, Nq]`` (float32; float64 for float64 inputs) stored as ``[B, Nq, Hq]`` as the
    kernel returns it. ``mask``: an additive ``[Nq, Nk]`` mask or ``None``."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                          scale=scale)
    return stored_like_v(out, q, v, otherwise_like=q), lse  # D == Dv here


def _bnhd(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An empty tensor of ``t``'s shape ``[B, H, N, *]`` stored as ``[B, N, H, *]``, the layout of the
    kernels' gradients and LSE (as torch's own meta functions for them say)."""
    order = (0, 2, 1, *range(3, t.dim()))
    return torch.empty_permuted(t.shape, order, dtype=dtype or t.dtype, device=t.device)


@sdpa_cpu_flash_fwd.register_fake
def _sdpa_cpu_flash_fwd_fake(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                             scale: float) -> tuple[Tensor, Tensor]:
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return output_like_v(q, v, otherwise_like=q), _bnhd(q[..., 0], dtype=lse_dtype)


@torch.library.custom_op("attnzoo::sdpa_cpu_flash_bwd", mutates_args=())
def sdpa_cpu_flash_bwd(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       mask: Tensor | None, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`sdpa_cpu_flash_fwd`'s output (torch's CPU flash backward, called
    as eager autograd calls it), stored as ``[B, N, H, D]`` as the kernel returns them."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        d_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


@sdpa_cpu_flash_bwd.register_fake
def _sdpa_cpu_flash_bwd_fake(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             mask: Tensor | None, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return _bnhd(q), _bnhd(k), _bnhd(v)


def _sdpa_setup(ctx, inputs: tuple, output: tuple) -> None:  # type: ignore[no-untyped-def]
    q, k, v, mask, causal, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], mask)
    ctx.causal, ctx.scale = causal, scale
    ctx.set_materialize_grads(False)  # the LSE's gradient (never used) arrives as None


def _sdpa_backward(ctx, d_out: Tensor | None, d_lse: Tensor | None) -> tuple:  # type: ignore[no-untyped-def]
    q, k, v, out, lse, mask = ctx.saved_tensors
    if d_out is None:
        return None, None, None, None, None, None
    dq, dk, dv = sdpa_cpu_flash_bwd(d_out, q, k, v, out, lse, mask, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None


sdpa_cpu_flash_fwd.register_autograd(_sdpa_backward, setup_context=_sdpa_setup)
