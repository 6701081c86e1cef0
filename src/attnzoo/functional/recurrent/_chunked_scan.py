"""Shared machinery of the decayed recurrent families (retention, GLA, delta rule).

Every family keeps a state ``S [B, H, Dk, Dv]`` and reads it with ``o_t = q_t^T S_t`` (q already
scaled). Split the sequence in chunks of ``C`` tokens. Whatever the family, the state at the end
of a chunk is an affine function of the state at its start, and so is the chunk's output::

    S_next = A S + R                 A: [Dk] (a diagonal decay) or [Dk, Dk]; R: [Dk, Dv]
    O      = O_intra + Q' S          O_intra: [C, Dv]; Q': [C, Dk]

A family supplies ``parts(q, k, v, *gates) -> (O_intra, Q', A, R)`` for a batch of chunks; the
driver :func:`chunked_scan` computes the parts of a group of chunks at once (batched matmuls),
carries ``S`` through the group with one small update per chunk, and writes the outputs. Groups
keep peak memory bounded by :data:`GROUP_BUDGET_BYTES` whatever ``N``. A sequence whose length
is not a multiple of ``C`` is padded at its end with zero tokens (``k = 0``, ``beta = 0``,
``log_decay = 0``), which leave the state unchanged; their outputs are dropped.

Decays are handled in log space (``g = log decay <= 0``). Every exponent is a sum of ``g`` over a
run of tokens inside one chunk (a prefix, a suffix, or a segment ``s < i <= t``: :func:`log_segsum`),
never positive, so strong decays underflow to 0 instead of overflowing; and each sum is taken
directly rather than as a difference of prefix sums, so it keeps its relative precision.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo._validate import (
    check_bool,
    check_choice,
    check_cu_seqlens,
    check_optional_int,
    check_tensor_ranks,
)

__all__ = [
    "DEFAULT_CHUNK",
    "FORMS",
    "GROUP_BUDGET_BYTES",
    "check_gate",
    "check_recurrent_inputs",
    "chunked_scan",
    "compute_dtype",
    "finish",
    "log_segsum",
    "matrix_scan",
    "packed_bounds",
    "resolve_form",
    "run_family",
    "suffix_sum",
    "token_loop",
    "token_prefix_sum",
    "token_suffix_sum",
]

#: Computation forms of the recurrent families.
FORMS = ("auto", "recurrent", "chunked", "quadratic")
#: Default chunk length of the chunked form.
DEFAULT_CHUNK = 64
#: Bytes of per-chunk temporaries held at once by :func:`chunked_scan`.
GROUP_BUDGET_BYTES = 32 * 2**20

#: ``parts(q, k, v, *gates)`` on chunks ``[B, H, m, C, .]`` -> ``(O_intra, Q', A, R)``.
Parts = Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32, float16 and bfloat16 compute in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _eager() -> bool:
    """Value checks (data-dependent) run in eager mode only, not while compiling."""
    return not tracing()


def check_recurrent_inputs(fn: str, q: object, k: object, v: object, scale: object, initial_state: object,
                           return_state: object, form: object, chunk_size: object,
                           cu_seqlens: object = None) -> tuple[float, int, list[int] | None]:
    """Validate the arguments shared by the families; returns ``(scale, chunk, bounds)``.

    ``q, k [B, Hk, N, Dk]``, ``v [B, Hv, N, Dv]`` with ``Hv`` a multiple of ``Hk`` (grouped value
    heads); ``bounds`` is ``cu_seqlens`` as a list (``None`` without packing), and then the states
    are ``[S, Hv, Dk, Dv]``.
    """
    check_tensor_ranks(4, "[B, H, N, D]", q=q, k=k, v=v)
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)  # checked above
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"{fn}: {name} must be float16/bfloat16/float32/float64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: q, k, v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if q.shape != k.shape:
        raise ValueError(f"{fn}: q and k must have the same shape [B, Hk, N, Dk], got q {tuple(q.shape)} "
                         f"and k {tuple(k.shape)}")
    if v.shape[0] != k.shape[0] or v.shape[2] != k.shape[2]:
        raise ValueError(f"{fn}: v must be [B, Hv, N, Dv] with k's batch size B and length N, got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)}")
    if k.shape[1] < 1 or v.shape[1] % k.shape[1]:
        raise ValueError(f"{fn}: v's heads Hv must be a multiple of k's heads Hk >= 1 (grouped value heads), "
                         f"got Hk={k.shape[1]} and Hv={v.shape[1]}")
    if q.shape[2] < 1 or q.shape[3] < 1 or v.shape[3] < 1:
        raise ValueError(f"{fn}: q, k, v need N >= 1 tokens and head dims >= 1, got q {tuple(q.shape)}, "
                         f"v {tuple(v.shape)}")
    b, _, n, dk = q.shape
    bounds = None if cu_seqlens is None else packed_bounds(fn, cu_seqlens, b, n)
    if scale is None:
        scale = dk ** -0.5  # (symbolic under dynamic shapes: no check on it)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{fn}: scale must be a float or None, got {type(scale).__name__}")
    elif not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{fn}: scale must be a finite float > 0 or None, got {scale!r}")
    check_bool(return_state, "return_state", fn)
    check_choice(form, "form", fn, choices=FORMS)
    chunk_size = check_optional_int(chunk_size, "chunk_size", fn) or DEFAULT_CHUNK
    if initial_state is not None:
        lead = "S" if bounds is not None else "B"
        if not isinstance(initial_state, Tensor) or not initial_state.is_floating_point():
            raise TypeError(f"{fn}: initial_state must be a floating-point tensor [{lead}, Hv, Dk, Dv], got "
                            f"{type(initial_state).__name__}")
        want = (b if bounds is None else len(bounds) - 1, v.shape[1], dk, v.shape[3])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"{fn}: initial_state must have shape [{lead}, Hv, Dk, Dv] = {list(want)}, got "
                             f"{tuple(initial_state.shape)}")
        if initial_state.device != q.device:
            raise ValueError(f"{fn}: initial_state is on {initial_state.device} but q is on {q.device}")
    return float(scale), chunk_size, bounds


def packed_bounds(fn: str, cu_seqlens: object, batch: int, n: int) -> list[int]:
    """The bounds of packed sequences (``B == 1``; :func:`attnzoo._validate.check_cu_seqlens` with
    ``total=N``). Sequences of length 0 are allowed (their state passes through unchanged)."""
    if batch != 1:
        raise ValueError(f"{fn}: packed sequences (cu_seqlens) need batch size B == 1, got B = {batch}")
    return [int(c) for c in check_cu_seqlens(cu_seqlens, owner=fn, total=n).tolist()]


def check_gate(fn: str, name: str, x: object, shapes: Sequence[tuple[int, ...]], device: torch.device,
               low: float, high: float, *, open_low: bool = False, open_high: bool = False) -> Tensor:
    """A gate tensor of one of ``shapes`` with values in ``[low, high]`` (ends open as asked)."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        got = f"{type(x).__name__} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"{fn}: {name} must be a floating-point tensor, got {got}")
    if tuple(x.shape) not in [tuple(s) for s in shapes]:
        want = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(f"{fn}: {name} must have shape {want}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{fn}: {name} is on {x.device} but q is on {device}")
    if _eager() and x.numel():
        lo_ok = (x > low) if open_low else (x >= low)
        hi_ok = (x < high) if open_high else (x <= high)
        if not bool((lo_ok & hi_ok).all()):
            bad = x.detach()[~(lo_ok & hi_ok)].flatten()[0].item()
            span = f"{'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
            raise ValueError(f"{fn}: {name} must lie in {span} (finite), got a value {bad}")
    return x


def resolve_form(form: str, n: int, chunk: int) -> str:
    """``"auto"``: recurrent for one token (decode), quadratic up to one chunk, chunked beyond."""
    if form != "auto":
        return form
    if n == 1:
        return "recurrent"
    return "quadratic" if n <= chunk else "chunked"


def finish(out: Tensor, state: Tensor, dtype: torch.dtype, return_state: bool) -> Tensor | tuple[Tensor, Tensor]:
    """Output back in the input dtype; the state stays in the compute dtype."""
    out = out.to(dtype)
    return (out, state) if return_state else out


def log_segsum(g: Tensor) -> Tensor:
    """``L[..., t, s] = g_{s+1} + ... + g_t`` for ``s <= t`` (0 on the diagonal), ``-inf`` above. ``[..., C]`` -> ``[..., C, C]``.

    ``exp(L)`` is the decay from token s to token t. Each entry is summed directly (a cumulative
    sum of masked copies of g), not taken as a difference of two cumulative sums: all terms are
    ``<= 0``, so the error is relative to the entry itself, while ``b_t - b_s`` of prefix sums loses
    ``|b_t| * eps`` (``e^-320`` decays over a chunk would cost float32 five digits).
    """
    c = g.shape[-1]
    ones = torch.ones(c, c, dtype=torch.bool, device=g.device)
    x = g.unsqueeze(-1).expand(*g.shape, c).masked_fill(~ones.tril(-1), 0.0)  # x[i, s] = g_i for i > s
    return x.cumsum(dim=-2).masked_fill(~ones.tril(), float("-inf"))


def suffix_sum(g: Tensor, dim: int) -> Tensor:
    """``sum_{i > t} g_i`` along ``dim`` (exclusive suffix sum, 0 at the last token), summed directly."""
    incl = g.flip(dim).cumsum(dim).flip(dim)
    return torch.cat([incl.narrow(dim, 1, g.shape[dim] - 1), torch.zeros_like(g.narrow(dim, 0, 1))], dim=dim)


def token_prefix_sum(g: Tensor) -> Tensor:
    """``sum_{i <= t} g_i`` over the tokens of ``[..., C, Dk]`` (inclusive), as one matmul with a
    lower-triangular matrix of ones: each entry a direct sum of its terms, and on CPU several times
    faster than ``cumsum`` along a non-last dimension."""
    c = g.shape[-2]
    return torch.matmul(torch.ones(c, c, dtype=g.dtype, device=g.device).tril_(), g)


def token_suffix_sum(g: Tensor, *, inclusive: bool = False) -> Tensor:
    """``sum_{i > t} g_i`` (``i >= t`` with ``inclusive``) over the tokens of ``[..., C, Dk]``, as
    :func:`token_prefix_sum` does (one matmul; the same values as :func:`suffix_sum` along ``-2``)."""
    c = g.shape[-2]
    return torch.matmul(torch.ones(c, c, dtype=g.dtype, device=g.device).triu_(0 if inclusive else 1), g)


def _group_chunks(per_chunk_bytes: int, n_chunks: int) -> int:
    return max(1, min(n_chunks, GROUP_BUDGET_BYTES // max(1, per_chunk_bytes)))


def chunked_scan(parts: Parts, q: Tensor, k: Tensor, v: Tensor, gates: Sequence[Tensor], s0: Tensor,
                 chunk: int, per_chunk_bytes: int, scale: float,
                 segments: Sequence[tuple[int, int]] | None = None) -> tuple[Tensor, Tensor]:
    """Run ``parts`` chunk by chunk and carry the state. Returns ``(out [*L, N, Dv], S_end)``.

    Args:
        parts: the family's chunk function (see the module docstring).
        q, k: ``[*Lk, N, Dk]``; v ``[*L, N, Dv]`` (``Lk`` broadcasts to ``L``: grouped value heads run
            as ``q, k [B, Hk, 1, N, Dk]`` against ``v [B, Hk, G, N, Dv]``, never expanded), in any
            float dtype: each group of chunks is cast to the compute dtype (and q scaled) when it is
            used, so no full-length copy is made.
        gates: per-token tensors ``[*L, N]`` or ``[*L, N, Dk]`` (zero is the neutral value).
        s0: the state before the first token ``[*L, Dk, Dv]``, in the compute dtype; with ``segments``
            one state per sequence ``[S, *L[1:], Dk, Dv]``.
        chunk: ``C``; ``chunk >= N`` runs one chunk of exactly ``N`` tokens (no padding).
        per_chunk_bytes: the family's estimate of one chunk's temporaries (sizes the groups).
        scale: multiplies q.
        segments: packed sequences (``L[0] == 1``), ``(first chunk, number of chunks)`` each, in order:
            the state restarts from ``s0[i]`` at sequence i's first chunk; ``S_end`` is then the states
            after each sequence ``[S, *L[1:], Dk, Dv]`` (a sequence without chunks keeps ``s0[i]``).
    """
    n, dv = v.shape[-2:]
    lead, tdim = v.shape[:-2], v.dim() - 2
    chunk = min(chunk, n)
    compiling = tracing() and segments is None
    carry = _Carry(s0, segments)
    step = _group_chunks(per_chunk_bytes, -(-n // chunk)) * chunk
    # compiled: one group, always padded, so that nothing loops or branches on the length
    groups = [(0, n)] if compiling else [(lo, min(n, lo + step)) for lo in range(0, n, step)]
    # Training: split the inputs once and concatenate the outputs once, so that the backward is one
    # split and one cat. Per-group slices and in-place writes into `out` would each make autograd
    # build a full-length gradient per group (quadratic in N: 16k tokens spent half their backward
    # filling zeros).
    recorded = _recorded(q, k, v, s0, *gates)
    out = v.new_empty(*lead, n, dv, dtype=s0.dtype) if not recorded else v.new_empty(0)
    sizes = [hi - lo for lo, hi in groups]
    inputs = (q, k, v, *gates)
    pieces = [inputs] if len(sizes) == 1 else list(zip(*(t.split(sizes, dim=tdim) for t in inputs), strict=True))
    outs: list[Tensor] = []
    for (lo, hi), piece in zip(groups, pieces, strict=True):
        m = -(-(hi - lo) // chunk)
        pad = m * chunk - (hi - lo)
        xs = [t.to(s0.dtype) for t in piece]  # tokens on dim tdim
        xs[0] = xs[0] * scale
        if compiling or pad:  # zero tokens at the end: no key, no write, no decay (pad unread when compiling)
            xs = [F.pad(t, (0, 0, 0, pad)) if t.dim() == v.dim() else F.pad(t, (0, pad)) for t in xs]
        xs = [t.unflatten(tdim, (m, chunk)) for t in xs]  # [*L, m, C(, D)]
        o_intra, q_state, a, r = parts(*xs)
        full = a.dim() == r.dim()  # a [..., m, Dk, Dk] (delta rule) or diagonal [..., m, Dk]
        if compiling:
            flat_a = a.expand(*r.shape[:-1], *a.shape[r.dim() - 1:]).flatten(0, len(lead) - 1).unsqueeze(0)
            flat_r, flat_s = r.flatten(0, len(lead) - 1).unsqueeze(0), carry.s.flatten(0, len(lead) - 1).unsqueeze(0)
            if full:  # a full [Dk, Dk] map (delta rule): one operator, not a loop of length m
                starts, s_end = matrix_scan(flat_a, flat_r, flat_s)
            else:
                starts, s_end = _diagonal_starts(flat_a, flat_r, flat_s)
            starts, carry.s = starts.squeeze(0).unflatten(0, lead), s_end.squeeze(0).unflatten(0, lead)
        else:
            starts = carry.run(a, r, lo // chunk)
        o = o_intra + torch.matmul(q_state, starts)  # [*L, m, C, Dv]
        o = o.flatten(tdim, tdim + 1).narrow(tdim, 0, hi - lo)
        if recorded:
            outs.append(o)
        else:  # inference: written in place, no second full-length copy
            out.narrow(tdim, lo, hi - lo).copy_(o)
    if recorded:
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=tdim)
    return out, carry.end()


class _Carry:
    """The state carried from chunk to chunk (with restarts at packed sequences' first chunks)."""

    def __init__(self, s0: Tensor, segments: Sequence[tuple[int, int]] | None) -> None:
        self.segments = segments
        if segments is None:
            self.s = s0
            return
        self.s0 = s0
        self.first = {c0: i for i, (c0, m) in enumerate(segments) if m}
        self.last = {c0 + m - 1: i for i, (c0, m) in enumerate(segments) if m}
        self.finals: list[Tensor] = [s0[i:i + 1] for i in range(len(segments))]
        self.s = s0[:1]

    def run(self, a: Tensor, r: Tensor, j0: int) -> Tensor:
        """States at the starts of chunks ``j0 .. j0 + m - 1`` (``a, r`` their maps), carrying ``self.s``."""
        if self.segments is None:
            starts, self.s = _loop_starts(a, r, self.s)
            return starts
        starts = []
        full = a.dim() == r.dim()
        for i, (a_i, r_i) in enumerate(_per_chunk(a, r)):
            j = j0 + i
            if j in self.first:
                self.s = self.s0[self.first[j]:self.first[j] + 1]
            starts.append(self.s)
            self.s = _step(a_i, r_i, self.s, full)
            if j in self.last:
                self.finals[self.last[j]] = self.s
        return torch.stack(starts, dim=r.dim() - 3)

    def end(self) -> Tensor:
        return self.s if self.segments is None else torch.cat(self.finals, dim=0)


def _step(a: Tensor, r: Tensor, s: Tensor, full: bool) -> Tensor:
    """``A S + R`` for one chunk: ``a [..., Dk]`` (diagonal) or ``[..., Dk, Dk]``."""
    if not full:
        return torch.addcmul(r, a.unsqueeze(-1), s)
    shape = torch.broadcast_shapes(r.shape, s.shape)
    a, r, s = a.expand(*shape[:-1], a.shape[-1]), r.expand(shape), s.expand(shape)
    return torch.baddbmm(r.reshape(-1, *shape[-2:]), a.reshape(-1, *a.shape[-2:]),
                         s.reshape(-1, *shape[-2:])).view(shape)


def _loop_starts(a: Tensor, r: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """States at the start of each chunk ``[..., m, Dk, Dv]`` and after the last one, one chunk at a
    time: ``S_{i+1} = A_i S_i + R_i`` with ``A`` diagonal ``[..., m, Dk]`` or ``[..., m, Dk, Dk]``
    (chunks on dim -3 of ``r``; ``[B, H, m, ...]`` as the compiled operators use)."""
    starts = []
    full = a.dim() == r.dim()
    for a_i, r_i in _per_chunk(a, r):
        starts.append(s)
        s = _step(a_i, r_i, s, full)
    return torch.stack(starts, dim=r.dim() - 3), s


def _per_chunk(a: Tensor, r: Tensor) -> zip[tuple[Tensor, Tensor]]:
    """``(A_i, R_i)`` of every chunk (chunks on dim -3 of ``r``), by one ``unbind`` each: its backward is
    one stack, where a ``select`` per chunk made autograd zero-fill the whole group once per chunk
    (quadratic in the chunks of a group: 11% of a 16k gated delta rule training step)."""
    return zip(a.unbind(a.dim() - (3 if a.dim() == r.dim() else 2)), r.unbind(r.dim() - 3), strict=True)


def _diagonal_starts(a: Tensor, r: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_loop_starts` for a diagonal decay without a loop over the chunks (what a compiled graph
    runs, so that its size does not depend on the length): with ``R' = [S_0, R_0 .. R_{m-2}]`` and
    log decays ``g' = [0, log A_0 .. log A_{m-2}]``, ``S_i = sum_{j <= i} exp(g'_{j+1} + .. + g'_i) R'_j``
    (:func:`log_segsum` over the chunks, ``[B, H, Dk, m, m]``: ``O(m^2 Dk Dv)``, small beside the
    chunks' own work). A decay that underflowed to 0 enters as the log of the smallest normal number."""
    la = torch.log(a.clamp_min(torch.finfo(a.dtype).tiny)).expand(r.shape[:-1])  # [B, H, m, Dk], <= 0
    la = torch.cat([torch.zeros_like(la[:, :, :1]), la[:, :, :-1]], dim=2)
    rp = torch.cat([s.unsqueeze(2), r[:, :, :-1]], dim=2)  # [B, H, m, Dk, Dv]
    weights = log_segsum(la.transpose(-1, -2)).exp()  # [B, H, Dk, m (i), m (j)]
    starts = torch.einsum("bhkij,bhjkv->bhikv", weights, rp)
    return starts, torch.addcmul(r[:, :, -1], a[:, :, -1].unsqueeze(-1), starts[:, :, -1])


# --------------------------------------------------------------------------- compiled matrix scan
@torch.library.custom_op("attnzoo::matrix_scan", mutates_args=())
def matrix_scan(a: Tensor, r: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_loop_starts` for full maps ``A [B, H, m, Dk, Dk]`` as one operator: the states at the
    chunk starts ``[B, H, m, Dk, Dv]`` and after the last chunk ``[B, H, Dk, Dv]``. Traced, the loop
    over the ``m`` chunks would make the graph's size (and so a recompile) depend on the length."""
    starts, end = _loop_starts(a, r, s)
    return starts.contiguous(), end.contiguous()


@matrix_scan.register_fake
def _matrix_scan_fake(a: Tensor, r: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    return r.new_empty(r.shape), s.new_empty(s.shape)


@torch.library.custom_op("attnzoo::matrix_scan_bwd", mutates_args=())
def matrix_scan_bwd(d_starts: Tensor | None, d_end: Tensor | None, a: Tensor, starts: Tensor,
                    end: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dA, dR, dS_0)`` of :func:`matrix_scan`, by the reverse scan: with ``G_m = dS_end``
    and ``G_i = A_i^T G_{i+1} + d starts_i``, ``dR_i = G_{i+1}``, ``dA_i = G_{i+1} S_i^T``, ``dS_0 = G_0``."""
    g = torch.zeros_like(end) if d_end is None else d_end.to(end.dtype)
    da, dr = torch.empty_like(a), torch.empty_like(starts)
    for i in reversed(range(a.shape[2])):
        dr[:, :, i] = g
        da[:, :, i] = torch.matmul(g, starts[:, :, i].transpose(-1, -2))
        g = torch.matmul(a[:, :, i].transpose(-1, -2), g)
        if d_starts is not None:
            g = g + d_starts[:, :, i]
    return da, dr, g.contiguous()


@matrix_scan_bwd.register_fake
def _matrix_scan_bwd_fake(d_starts: Tensor | None, d_end: Tensor | None, a: Tensor, starts: Tensor,
                          end: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return a.new_empty(a.shape), starts.new_empty(starts.shape), end.new_empty(end.shape)


def _scan_setup(ctx, inputs: tuple, output: tuple) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(inputs[0], *output)
    ctx.set_materialize_grads(False)


def _scan_backward(ctx, d_starts: Tensor | None, d_end: Tensor | None) -> tuple:  # type: ignore[no-untyped-def]
    a, starts, end = ctx.saved_tensors
    return matrix_scan_bwd(d_starts, d_end, a, starts, end)


matrix_scan.register_autograd(_scan_backward, setup_context=_scan_setup)


# --------------------------------------------------------------------------- token loops
#: ``loop(*tensors) -> outputs``: a kernel's token-by-token recurrence (its ``form="recurrent"``).
Loop = Callable[..., tuple[Tensor, ...]]


def token_loop(name: str, loop: Loop, shapes: Loop) -> Loop:
    """``loop`` as one operator, ``attnzoo::<name>``, for ``torch.compile`` (first tensor ``[..., N, .]``).

    Traced, a Python loop over the tokens unrolls into a graph whose size (and compile time) grows
    with N and that is rebuilt for every length. The operator runs ``loop`` eagerly instead: one
    node for any N, so ``dynamic=True`` compiles it once. ``shapes(*tensors)`` gives empty outputs
    of the right shapes and dtypes (the fake). Its gradient, ``attnzoo::<name>_bwd``, runs the
    loop again under ``torch.func.vjp`` (the recurrent form is the definition, not a fast path:
    exactness over speed). Returns ``f(*tensors) -> outputs``: the operator while
    compiling (for N > 1: a single decoding token stays in the traced graph), ``loop`` itself in
    eager mode.
    """

    @torch.library.custom_op(f"attnzoo::{name}", mutates_args=())
    def op(tensors: list[Tensor]) -> list[Tensor]:
        with torch.no_grad():
            outs = loop(*tensors)
        # an operator's outputs may not alias its inputs (a state returned untouched is copied)
        return [o.clone() if any(o is t for t in tensors) else o for o in outs]

    @op.register_fake
    def _op_fake(tensors: list[Tensor]) -> list[Tensor]:
        return list(shapes(*tensors))

    @torch.library.custom_op(f"attnzoo::{name}_bwd", mutates_args=())
    def op_bwd(tensors: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
        # torch.func.vjp: an operator's body runs below the autograd dispatch key, where tensors
        # cannot record a graph; functorch's transform does not need one
        floats = [i for i, t in enumerate(tensors) if t.is_floating_point()]

        def of_floats(*xs: Tensor) -> tuple[Tensor, ...]:
            args = list(tensors)
            for i, x in zip(floats, xs, strict=True):
                args[i] = x
            return tuple(loop(*args))

        _, vjp = torch.func.vjp(of_floats, *(tensors[i] for i in floats))
        got = dict(zip(floats, vjp(tuple(grads)), strict=True))
        return [got[i] if i in got else torch.zeros_like(t) for i, t in enumerate(tensors)]

    @op_bwd.register_fake
    def _op_bwd_fake(tensors: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
        return [torch.empty_like(t) for t in tensors]

    def setup(ctx, inputs: tuple, output: list[Tensor]) -> None:  # type: ignore[no-untyped-def]
        ctx.save_for_backward(*inputs[0])

    def backward(ctx, grads: list[Tensor]) -> tuple:  # type: ignore[no-untyped-def]
        return (op_bwd(list(ctx.saved_tensors), list(grads)),)

    op.register_autograd(backward, setup_context=setup)

    def call(*tensors: Tensor) -> tuple[Tensor, ...]:
        if tracing() and tensors[0].shape[-2] != 1:  # [..., N, .]: one token stays traced
            return tuple(op(list(tensors)))
        return loop(*tensors)  # eager: the loop itself, under autograd

    return call


# --------------------------------------------------------------------------- grouped heads, packing
#: Device types on which packed sequences in the chunked form are padded to whole chunks and run as one
#: call (``chunked_scan(segments=...)``); elsewhere each sequence runs alone (inputs split once). On CPU
#: the per-sequence calls won every measured case (issue 34, 1 thread, 16k tokens, ``/tmp`` scripts
#: timing both in alternation on the 2-core Xeon): inference 1.0x vs padded 1.06-1.29x, forward +
#: backward with 16 / 256 / 1024 / 4096 sequences padded 1.03-1.24 / 1.02-1.24 / 1.06-1.85 / 4.5x the
#: per-sequence time (padding to the chunk and a Python step per chunk). One call per sequence is a
#: kernel launch each on a GPU, where packing is the usual choice (fla); unmeasured here.
PACK_CHUNKS_ON: frozenset[str] = frozenset({"cuda"})


def _recorded(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


#: ``form(q, k, v, gates, s0, chunk, segments) -> (out, S)`` on grouped views (q already scaled for
#: the loop; see :func:`run_family`): one of a family's computation forms.
Form = Callable[..., tuple[Tensor, Tensor]]


def run_family(forms: Mapping[str, Form], q: Tensor, k: Tensor, v: Tensor, gates: Sequence[Tensor], s0: Tensor,
               *, form: str, chunk: int, bounds: list[int] | None) -> tuple[Tensor, Tensor]:
    """Run a family's ``forms[form]`` ("recurrent" | "quadratic" | "chunked"), with grouped value heads
    and packed sequences. Returns ``(out [B, Hv, N, Dv], state [B or S, Hv, Dk, Dv])`` in the compute dtype.

    Grouped value heads: ``q, k [B, Hk, N, Dk]`` become the views ``[B, Hk, 1, N, Dk]`` and ``v``, the
    gates and the state ``[B, Hk, G, ...]`` (``G = Hv / Hk``): value head ``j = h G + i`` reads key head
    ``h = j // G``, and ``q, k`` broadcast over ``G`` without a copy.

    Packed sequences (``bounds = cu_seqlens``, ``B == 1``): each sequence runs alone (the inputs split
    once, the outputs concatenated once), except the chunked form on the devices of
    :data:`PACK_CHUNKS_ON`, which pads every sequence with zero tokens (no write, no decay) to a
    multiple of the chunk, runs all chunks at once and restarts the carried state at each sequence's
    first chunk (``chunked_scan(segments=...)``): the work of one call on ``T + S C`` tokens.
    """
    hk, hv = k.shape[1], v.shape[1]
    grp = (hk, hv // hk)
    q5, k5 = q.unsqueeze(2), k.unsqueeze(2)  # [B, Hk, 1, N, Dk]
    v5, s5 = v.unflatten(1, grp), s0.unflatten(1, grp)  # [B, Hk, G, N, Dv], [B or S, Hk, G, Dk, Dv]
    g5 = [g.unflatten(1, grp) for g in gates]  # [B, Hk, G, N(, Dk)]
    run = forms[form]
    if bounds is None:
        out, state = run(q5, k5, v5, g5, s5, chunk, None)
    elif form != "chunked" or v.device.type not in PACK_CHUNKS_ON:
        # one sequence at a time: the definition for the loop, one chunk each for the quadratic form,
        # and the chunked form where that measured faster than padding (see PACK_CHUNKS_ON)
        lengths = [hi - lo for lo, hi in itertools.pairwise(bounds)]
        pieces = zip(*(t.split(lengths, dim=3) for t in (q5, k5, v5, *g5)), strict=True)  # one split: linear backward
        outs, states = [], []
        for i, (n, part) in enumerate(zip(lengths, pieces, strict=True)):
            if n == 0:
                states.append(s5[i:i + 1])
                continue
            o, s = run(*part[:3], list(part[3:]), s5[i:i + 1], chunk, None)
            outs.append(o)
            states.append(s)
        out, state = torch.cat(outs, dim=3), torch.cat(states, dim=0)
    else:
        lengths = [hi - lo for lo, hi in itertools.pairwise(bounds)]
        c = min(chunk, max(lengths))
        blocks = [-(-n // c) for n in lengths]  # chunks per sequence
        firsts = [sum(blocks[:i]) for i in range(len(blocks))]
        pads = [m * c - n for n, m in zip(lengths, blocks, strict=True)]

        def pack(t: Tensor) -> Tensor:
            """Each sequence followed by its zero tokens, in one copy (contiguous pieces, no scatter)."""
            pieces = []
            for piece, pad in zip(t.split(lengths, dim=3), pads, strict=True):
                pieces.append(piece)
                if pad:
                    pieces.append(t.new_zeros(*t.shape[:3], pad, *t.shape[4:]))
            return torch.cat(pieces, dim=3)

        o, state = run(*(pack(t) for t in (q5, k5, v5)), [pack(g) for g in g5], s5, c,
                       list(zip(firsts, blocks, strict=False)))
        out = torch.cat([piece.narrow(3, 0, n) for piece, n in zip(o.split([m * c for m in blocks], dim=3), lengths,
                                                                   strict=True)], dim=3)
    return out.flatten(1, 2), state.flatten(1, 2)
