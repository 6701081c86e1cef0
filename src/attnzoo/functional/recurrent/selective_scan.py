"""Mamba's selective scan (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective
State Spaces"), in the layout of ``mamba_ssm``'s ``selective_scan_fn``.

Recurrence (the definition), per inner channel ``i`` with a state ``h [N]``::

    dt_t = softplus(delta_t + delta_bias)        (or delta_t + delta_bias without the softplus)
    h_t  = exp(dt_t A_i) * h_{t-1} + dt_t u_t B_t   # elementwise over N
    y_t  = h_t . C_t + D_i u_t,   times silu(z_t) when z is given

It is :func:`~attnzoo.functional.recurrent.gla.gated_linear_attention` with the inner channels as
value heads of width 1 over one key head of width ``N`` per group of ``B``/``C`` (grouped value
heads: ``q = C``, ``k = B`` are never expanded), ``v = dt u``, the log decay ``dt A`` per key
channel and scale 1 — so it runs chunked, packs sequences by ``cu_seqlens`` and is exact to float64
rounding (``tests/functional/recurrent/test_selective_scan.py`` checks it against the loop above).
The Mamba-1 mixers (:class:`~attnzoo.models.families.mamba1.Mamba1Mixer`: Mamba, FalconMamba,
Jamba) and transformers' Mamba-1 kernel hooks served by :func:`attnzoo.hf.register` run it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo._validate import (
    check_bool,
    check_choice,
    check_cu_seqlens,
    check_float_tensor,
    check_int,
)
from attnzoo.functional.recurrent._chunked_scan import compute_dtype
from attnzoo.functional.recurrent.gla import gated_linear_attention

__all__ = ["FORMS", "SCAN_CHUNK", "selective_scan"]

FORMS = ("auto", "chunked", "recurrent")

#: the chunk length of the scan: value heads of width 1 make the intra-chunk scores the bulk of the
#: work (``[B, I, T, chunk]``). Measured with Mamba's decays (``A = -(1..16)``, ``dt`` log-uniform in
#: ``[1e-3, 0.1]``), ``I`` = 512, 2-core Xeon (AVX-512), forward + backward at T = 2048: chunk 16
#: 2.10 s, 24 2.90 s, 32 0.76 s, 48 1.36 s, 64 1.27 s (2 threads; 1 thread: 3.77 / 1.27 / 2.18 s for
#: 16 / 32 / 64); forward without gradients 0.80 / 0.25 / 0.43 s, the token loop 0.16 s
#: (``benchmarks/bench_selective_scan.py``; the halving plans of the chunked scan favour powers of two)
SCAN_CHUNK = 32
_OWNER = "selective_scan"


def _resolve_form(form: str, *tensors: Tensor | None) -> str:
    """``"auto"``: the token loop when no gradient is asked for (eager), else the chunked scan.

    Forward without gradients (``benchmarks/bench_selective_scan.py``, the 2-core Xeon above, 2
    threads, ``I`` = 512): with Mamba's initial steps (``dt <= 0.1``) the elementwise token loop
    0.038 s against chunk 32 0.060 s at ``T`` = 512 (``T`` = 2048: 0.161 / 0.247 s); with the
    stronger decays of larger steps (``dt <= 1``, the chunked scan's exact plan) 0.035 s against
    0.208 s (chunk 16: 0.197 s): 1.5-6x faster. With gradients, autograd through a loop is not an
    option (transformers' loop: a training step 16x the served chunked scan's, ``bench_hf_hybrid.py
    --family mamba``). A compiled graph takes the chunked scan (a loop of ``T`` steps would unroll).
    """
    if form != "auto":
        return form
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    return "chunked" if needs_grad or tracing() else "recurrent"


def _check_groups(u: Tensor, state: int, B: Tensor, C: Tensor) -> tuple[Tensor, Tensor]:
    """``B``/``C`` ``[B, N, T]`` or ``[B, G, N, T]`` -> key/query heads ``[B, G, T, N]``."""
    b, inner, t = u.shape
    B, C = (x[:, None] if isinstance(x, Tensor) and x.dim() == 3 else x for x in (B, C))
    for name, x in (("B", B), ("C", C)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{_OWNER}: {name} must be a tensor [B, N, T] or [B, G, N, T], got {type(x).__name__}")
        if x.dim() != 4 or x.shape[0] != b or x.shape[-1] != t or x.shape[-2] != state or inner % x.shape[1]:
            raise ValueError(f"{_OWNER}: {name} must be [B, N, T] or [B, G, N, T] with B = {b}, N = {state} "
                             f"(A is [I, N]), T = {t} and G dividing I = {inner} (u is [B, I, T]), "
                             f"got {tuple(x.shape)}")
    if B.shape != C.shape:
        raise ValueError(f"{_OWNER}: B and C must have one shape, got {tuple(B.shape)} and {tuple(C.shape)}")
    return B.transpose(-1, -2), C.transpose(-1, -2)


def _check_per_channel(inner: int, state: int, A: Tensor, D: Tensor | None, delta_bias: Tensor | None) -> None:
    if A.shape != (inner, state):
        raise ValueError(f"{_OWNER}: A must be [I, N] = {[inner, state]}, got {tuple(A.shape)}")
    for name, x in (("D", D), ("delta_bias", delta_bias)):
        if x is not None and (not isinstance(x, Tensor) or x.shape != (inner,)):
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{_OWNER}: {name} must be a tensor [I] = [{inner}] or None, got {shape}")


def _token_loop(x: Tensor, dt: Tensor, A: Tensor, k: Tensor, q: Tensor, s0: Tensor | None) -> tuple[Tensor, Tensor]:
    """The recurrence one token at a time, elementwise (``form="recurrent"`` without packing):
    ``x``, ``dt [B, I, T]``, ``A [I, N]``, ``k = B``, ``q = C [B, G, T, N]``, ``s0 [B, I, N]`` or
    None -> ``(h . C [B, I, T], h_T [B, I, N])``. The channels of a group share its ``B``/``C``
    (a view ``[B, G, I / G, N]``, nothing expanded); 1.5x faster than gated_linear_attention's
    general recurrent form (``I`` = 512, ``T`` = 1024, ``N`` = 16, no gradients; packed input
    takes that form, which restarts at the boundaries)."""
    b, inner, steps = x.shape
    g, n = k.shape[1], A.shape[1]
    shape = (b, g, inner // g, n)
    a = A.reshape(g, inner // g, n)
    h = x.new_zeros(shape) if s0 is None else s0.reshape(shape)
    dtv, dtx = dt.reshape(b, g, inner // g, steps), (dt * x).reshape(b, g, inner // g, steps)
    ys = []
    for t in range(steps):
        h = torch.exp(dtv[..., t, None] * a) * h + dtx[..., t, None] * k[:, :, None, t]
        ys.append((h * q[:, :, None, t]).sum(-1))  # [B, G, I / G]
    return torch.stack(ys, dim=-1).reshape(b, inner, steps), h.reshape(b, inner, n)


def _check_decays(dt: Tensor, A: Tensor) -> None:
    """Every log decay ``dt * A`` finite and ``<= 0`` (eager only: it reads the values)."""
    if tracing():
        return
    if not bool(torch.isfinite(dt).all()) or not bool(torch.isfinite(A).all()):
        raise ValueError(f"{_OWNER}: the steps dt (delta after delta_bias / softplus) and A must be finite")
    lo, hi = float(dt.detach().amin()), float(dt.detach().amax())
    if (lo < 0 and bool((A < 0).any())) or (hi > 0 and bool((A > 0).any())):
        raise ValueError(f"{_OWNER}: the log decays dt * A must be <= 0 (A <= 0 and steps dt >= 0: softplus them "
                         f"with delta_softplus=True, or give a non-negative delta), got dt in [{lo:.4g}, {hi:.4g}] "
                         f"and A in [{float(A.detach().amin()):.4g}, {float(A.detach().amax()):.4g}]")


def _scan(x: Tensor, dt: Tensor, A: Tensor, k: Tensor, q: Tensor, s0: Tensor | None, *, form: str, chunk: int,
          cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    """``h . C [B, I, T]`` and the last states ``[B or S, I, N]``: the token loop (unpacked), else
    :func:`~attnzoo.functional.recurrent.gla.gated_linear_attention` in ``form`` (value heads of width 1)."""
    if form == "recurrent" and cu_seqlens is None:
        return _token_loop(x, dt, A, k, q, s0)
    y, state = gated_linear_attention(q, k, (dt * x)[..., None], dt[..., None] * A[:, None], scale=1.0,
                                      initial_state=None if s0 is None else s0[..., None], return_state=True,
                                      form=form, chunk_size=chunk, cu_seqlens=cu_seqlens)
    return y[..., 0], state[..., 0]


def selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                   z: Tensor | None = None, *, delta_bias: Tensor | None = None, delta_softplus: bool = False,
                   initial_state: Tensor | None = None, return_last_state: bool = False,
                   cu_seqlens: Tensor | None = None, chunk_size: int = SCAN_CHUNK,
                   form: str = "auto") -> Tensor | tuple[Tensor, Tensor]:
    """Mamba's selective scan (see the module docstring for the recurrence).

    Args:
        u: the input ``[B, I, T]`` (``I`` inner channels, ``T`` tokens).
        delta: the step sizes before ``delta_bias`` / softplus, ``[B, I, T]``.
        A: ``[I, N]``, the state matrix (``-exp(A_log)`` in Mamba: negative, a decaying state;
            ``dt A`` must be ``<= 0``).
        B, C: input-dependent ``[B, N, T]``, or ``[B, G, N, T]`` in ``G`` groups (channel ``i``
            reads group ``i // (I / G)``).
        D: the skip ``[I]`` or None. z: the gate ``[B, I, T]`` (``y * silu(z)``) or None.
        delta_bias: ``[I]`` added to ``delta`` or None. delta_softplus: softplus the step sizes.
        initial_state: ``h_0 [B, I, N]`` (``[S, I, N]`` packed); default zeros.
        return_last_state: also return the last state ``[B, I, N]`` (``[S, I, N]`` packed), float32
            (float64 for float64 input).
        cu_seqlens: packed sequences, int32 ``[S+1]`` with ``B == 1``: each sequence starts from its
            own initial state (equal to scanning each alone, forward and gradients).
        chunk_size: the chunk length of the chunked scan (any value >= 1; see :data:`SCAN_CHUNK`).
        form: ``"chunked"``, ``"recurrent"`` (the token loop) or ``"auto"``: the loop when no
            input needs a gradient (or gradients are off), the chunked scan otherwise (measured:
            ``_resolve_form``). Both give the recurrence to float64 rounding.

    Returns:
        ``y [B, I, T]`` in ``u``'s dtype (half inputs compute in float32), or ``(y, last_state)``.

    Raises:
        ValueError / TypeError naming the argument: shapes, dtypes, a positive ``dt A``.
    """
    u = check_float_tensor(u, "u", _OWNER, "[B, I, T]", nonempty=2)
    for name, x in (("delta", delta), ("z", z)):
        if (x is not None or name == "delta") and (not isinstance(x, Tensor) or x.shape != u.shape):
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{_OWNER}: {name} must be a tensor [B, I, T] = {list(u.shape)}, got {shape}")
    A = check_float_tensor(A, "A", _OWNER, "[I, N]")
    _check_per_channel(u.shape[1], A.shape[1], A, D, delta_bias)
    k, q = _check_groups(u, A.shape[1], B, C)
    softplus, last = check_bool(delta_softplus, "delta_softplus", _OWNER), check_bool(return_last_state,
                                                                                     "return_last_state", _OWNER)
    chunk = check_int(chunk_size, "chunk_size", _OWNER)
    resolved = _resolve_form(check_choice(form, "form", _OWNER, choices=FORMS), u, delta, A, B, C, D, z, delta_bias,
                             initial_state)
    rows = u.shape[0]
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, owner=_OWNER, total=u.shape[-1])
        rows = cu_seqlens.numel() - 1
    if initial_state is not None and (not isinstance(initial_state, Tensor)
                                      or initial_state.shape != (rows, *A.shape)):
        shape = tuple(initial_state.shape) if isinstance(initial_state, Tensor) else type(initial_state).__name__
        raise ValueError(f"{_OWNER}: initial_state must be a tensor [B or S, I, N] = {[rows, *A.shape]}, got {shape}")
    cdt = compute_dtype(u.dtype)
    dt = delta.to(cdt) + (0.0 if delta_bias is None else delta_bias.to(cdt)[:, None])
    dt = F.softplus(dt) if softplus else dt  # [B, I, T]
    x = u.to(cdt)
    _check_decays(dt, A.to(cdt))
    y, state = _scan(x, dt, A.to(cdt), k.to(cdt), q.to(cdt), None if initial_state is None else initial_state.to(cdt),
                     form=resolved, chunk=chunk, cu_seqlens=cu_seqlens)
    if D is not None:
        y = y + D.to(cdt)[:, None] * x
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return (y.to(u.dtype), state) if last else y.to(u.dtype)
