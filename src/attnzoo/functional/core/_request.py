"""Validation and normalisation of an attention call, shared by every backend.

``AttnRequest`` is the one place where the arguments of :func:`attnzoo.attention` are checked and
turned into a canonical form. Backends receive a request and never re-validate. The semantics
(positions, alignment, windows, empty rows) are those of ``docs/conventions.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import overload

import torch
from torch import Tensor

from attnzoo._devices import tracing
from attnzoo._validate import (
    Window,
    check_bool,
    check_int,
    check_positive_float,
    check_probability,
    check_tensor_ranks,
    normalize_window,
)
from attnzoo.functional.core.rules import alibi_bias, compute_dtype
from attnzoo.functional.core.score_mod import ScoreMod, check_score_mod, score_indices
from attnzoo.masks import Mask, sliding_window
from attnzoo.masks import causal as causal_mask

__all__ = ["AttnRequest", "Capabilities", "Window", "build_request", "check_qkv", "combine_structure",
           "normalize_window"]

_UNSET = object()  # "not computed yet" for AttnRequest.structure

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_qkv(q: object, k: object, v: object) -> None:
    """Rank, batch, heads, head-dim, length, dtype and device agreement of q, k, v."""
    check_tensor_ranks(4, "[B, H, N, D]", q=q, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert isinstance(t, Tensor)  # checked above; for mypy
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16/bfloat16/float32/float64, got {t.dtype}")
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)  # for mypy
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {_shape(q)}, k {_shape(k)}, v {_shape(v)} (expected equal B)")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same number of heads, got k {_shape(k)} and v {_shape(v)}")
    for name, t, dim, letter in (("q", q, 1, "Hq"), ("k", k, 1, "Hkv"), ("q", q, 3, "D"), ("v", v, 3, "Dv")):
        if t.shape[dim] == 0:
            raise ValueError(f"{name} has {letter} = 0 (shape {_shape(t)}); expected {letter} >= 1")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads must be a multiple of key/value heads (Hq % Hkv == 0), "
                         f"got Hq={q.shape[1]} and Hkv={k.shape[1]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head dims of q and k differ: q {_shape(q)} vs k {_shape(k)} (expected equal D)")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same length, got k {_shape(k)} and v {_shape(v)} (expected equal Nk)")


class _Size:
    """A size of ``q`` or ``k`` (layout ``[B, H, N, D]``) read as an attribute of the request."""

    def __init__(self, tensor: str, dim: int, doc: str) -> None:
        self.tensor, self.dim, self.__doc__ = tensor, dim, doc

    @overload
    def __get__(self, request: None, owner: type) -> _Size: ...
    @overload
    def __get__(self, request: AttnRequest, owner: type) -> int: ...

    def __get__(self, request: AttnRequest | None, owner: type) -> _Size | int:
        return self if request is None else getattr(request, self.tensor).shape[self.dim]


def combine_structure(causal: bool, window: Window | None, mask_obj: Mask | None = None) -> Mask | None:
    """The position predicate of ``causal``, ``window`` and a ``Mask`` object together (``None``: no constraint)."""
    parts: list[Mask] = []
    if causal:
        parts.append(causal_mask())
    if window is not None:
        parts.append(sliding_window(*window))
    if mask_obj is not None:
        parts.append(mask_obj)
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out = out & p
    return out


@dataclass(frozen=True)
class AttnRequest:
    """A validated attention call. Shapes: q ``[B,Hq,Nq,D]``, k ``[B,Hkv,Nk,D]``, v ``[B,Hkv,Nk,Dv]``."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask_tensor: Tensor | None  # rank-4 bool/float, broadcastable to [B, Hq, Nq, Nk]
    mask_obj: Mask | None
    causal: bool
    window: Window | None
    q_offset: int
    scale: float
    softcap: float | None
    alibi_slopes: Tensor | None  # [Hq] float32
    dropout_p: float
    return_lse: bool
    return_weights: bool
    #: the user's ``score_mod`` and the tensors it captures that need gradients (``score_mod.py``)
    score_mod: ScoreMod | None = None

    # ---------------------------------------------------------------- shapes
    batch = _Size("q", 0, "``B``")
    hq = _Size("q", 1, "``Hq``, query heads")
    hkv = _Size("k", 1, "``Hkv``, key/value heads")
    nq = _Size("q", 2, "``Nq``, queries")
    nk = _Size("k", 2, "``Nk``, keys")

    @property
    def group(self) -> int:
        """``Hq // Hkv``: query heads per key/value head."""
        return self.hq // self.hkv

    @property
    def float_mask(self) -> Tensor | None:
        m = self.mask_tensor
        return m if m is not None and m.dtype != torch.bool else None

    @property
    def bool_mask(self) -> Tensor | None:
        m = self.mask_tensor
        return m if m is not None and m.dtype == torch.bool else None

    @property
    def structure(self) -> Mask | None:
        """Causal, window and Mask-object constraints combined into one position predicate.

        Memoised in the instance without a lock (``functools.cached_property`` takes an RLock on
        Python < 3.12, which ``torch.compile`` cannot trace: a graph break per access)."""
        memo = self.__dict__.get("_structure", _UNSET)
        if memo is _UNSET:
            memo = self._build_structure()
            object.__setattr__(self, "_structure", memo)
        return memo

    def _build_structure(self) -> Mask | None:
        return combine_structure(self.causal, self.window, self.mask_obj)

    def features(self) -> set[str]:
        """Names of the non-trivial features this request uses (for backend capability checks)."""
        f: set[str] = set()
        if self.return_weights:
            f.add("return_weights")
        if self.return_lse:
            f.add("return_lse")
        if self.softcap is not None:
            f.add("softcap")
        if self.alibi_slopes is not None:
            f.add("alibi_slopes")
            if self.alibi_slopes.requires_grad:
                f.add("alibi gradient")
        if self.dropout_p > 0:
            f.add("dropout")
        if self.float_mask is not None:
            f.add("float mask")
            if self.float_mask.requires_grad:
                f.add("float mask gradient")
        if self.bool_mask is not None:
            f.add("bool mask")
        if self.mask_obj is not None:
            f.add("Mask object")
        if self.window is not None:
            f.add("window")
        if self.causal:
            f.add("causal")
        if self.group > 1:
            f.add("gqa")
        if self.v.shape[-1] != self.q.shape[-1]:
            f.add("Dv != D")
        if self.q.dtype == torch.float64:
            f.add("float64")
        if self.score_mod is not None:
            f.add("score_mod")
        return f

    # --------------------------------------------------------- tile helpers
    def allowed(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> Tensor | None:
        """Bool visibility of query rows ``q_lo:q_hi`` x keys ``k_lo:k_hi``, broadcastable to
        ``[B, Hq, q_hi-q_lo, k_hi-k_lo]``; ``None`` when everything is visible."""
        out: Tensor | None = None
        s = self.structure
        if s is not None:
            out = s.evaluate(self.batch, self.hq, self.q_offset, q_lo, q_hi, k_lo, k_hi,
                             device=self.q.device, expand=False)
        bm = self.bool_mask
        if bm is not None:
            tile = _slice_mask(bm, q_lo, q_hi, k_lo, k_hi)
            out = tile if out is None else out & tile
        return out

    def modify(self, s: Tensor, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> Tensor:
        """Scores ``[B, Hq, q_hi-q_lo, k_hi-k_lo]`` through the user's ``score_mod`` (or unchanged), at
        absolute positions: queries ``q_offset + q_lo ..``, keys ``k_lo ..``."""
        if self.score_mod is None:
            return s
        return self.score_mod.fn(s, *self.score_index(q_lo, q_hi, k_lo, k_hi))

    def score_index(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``score_mod``'s ``(b, h, q_idx, kv_idx)`` for query rows ``q_lo:q_hi`` x keys ``k_lo:k_hi``."""
        return score_indices(self.batch, self.hq, self.q_offset + q_lo, self.q_offset + q_hi, k_lo, k_hi,
                             self.q.device)

    def bias(self, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> Tensor | None:
        """Additive bias (float mask + ALiBi) for a tile in the compute dtype, or ``None``."""
        out: Tensor | None = None
        fm = self.float_mask
        if fm is not None:
            out = _slice_mask(fm, q_lo, q_hi, k_lo, k_hi).to(compute_dtype(self.q.dtype))
        if self.alibi_slopes is not None:
            dev = self.q.device
            qp = torch.arange(self.q_offset + q_lo, self.q_offset + q_hi, device=dev).view(-1, 1)
            kp = torch.arange(k_lo, k_hi, device=dev).view(1, -1)
            ab = alibi_bias(self.alibi_slopes.view(1, -1, 1, 1), qp, kp)  # [1, Hq, bq, bk]
            out = ab if out is None else out + ab
        return out


def _slice_mask(m: Tensor, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> Tensor:
    rows = slice(q_lo, q_hi) if m.shape[2] > 1 else slice(None)
    cols = slice(k_lo, k_hi) if m.shape[3] > 1 else slice(None)
    return m[:, :, rows, cols]


def _check_mask(mask: object, q: Tensor, nk: int) -> tuple[Tensor | None, Mask | None]:
    """``mask`` as ``(rank-4 tensor, None)``, ``(None, Mask)`` or ``(None, None)``."""
    B, Hq, Nq = q.shape[:3]
    if mask is None:
        return None, None
    if isinstance(mask, Mask):
        for leaf in mask._leaves():
            if leaf.batch is not None and leaf.batch not in (1, B):
                raise ValueError(f"mask {leaf.name} was built for batch size {leaf.batch}, but q has batch {B}")
        return None, mask
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be None, a bool/float tensor or an attnzoo.masks.Mask, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"mask must be bool (True = attend) or float (additive bias), got dtype {mask.dtype}")
    if mask.dim() > 4 or mask.dim() < 2:
        raise ValueError(f"mask must have rank 2 to 4 and broadcast to [B, Hq, Nq, Nk] = "
                         f"{[B, Hq, Nq, nk]}, got shape {_shape(mask)}")
    m4 = mask.reshape((1,) * (4 - mask.dim()) + _shape(mask))
    for got, want, letter in zip(m4.shape, (B, Hq, Nq, nk), ["B", "H", "Nq", "Nk"], strict=True):
        if got not in (1, want):
            raise ValueError(f"mask of shape {_shape(mask)} does not broadcast to [B, Hq, Nq, Nk] = "
                             f"{[B, Hq, Nq, nk]} (dimension {letter}: got {got}, expected 1 or {want})")
    if m4.device != q.device:
        raise ValueError(f"mask is on {m4.device} but q is on {q.device}")
    if m4.is_floating_point() and m4.numel() and not tracing():
        top = float(m4.detach().amax())  # one reduction; NaN propagates through it
        if not top < math.inf:  # NaN or +inf: backends disagreed (zeros on one, NaN on another)
            raise ValueError(f"mask: a float mask is an additive bias and must not hold NaN or +inf (got max "
                             f"{top}); hide a key with -inf or a bool mask")
    return m4, None


def _check_slopes(alibi_slopes: object, q: Tensor) -> Tensor | None:
    """ALiBi slopes ``[Hq]`` in the compute dtype on q's device, or ``None``."""
    if alibi_slopes is None:
        return None
    hq = q.shape[1]
    if not isinstance(alibi_slopes, Tensor):
        raise TypeError(f"alibi_slopes must be a tensor [Hq], got {type(alibi_slopes).__name__}")
    if not alibi_slopes.is_floating_point():
        raise TypeError(f"alibi_slopes must be a floating-point tensor [Hq], got dtype {alibi_slopes.dtype}")
    if _shape(alibi_slopes) != (hq,):
        raise ValueError(f"alibi_slopes must have shape [Hq] = [{hq}], got {_shape(alibi_slopes)}")
    if not tracing() and not bool(torch.isfinite(alibi_slopes).all()):
        raise ValueError(f"alibi_slopes must be finite, got {alibi_slopes.tolist()}")
    return alibi_slopes.to(device=q.device, dtype=compute_dtype(q.dtype))


def build_request(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | Mask | None,
    causal: bool,
    window: object,
    q_offset: int | None,
    scale: float | None,
    softcap: float | None,
    alibi_slopes: Tensor | None,
    dropout_p: float,
    return_lse: bool,
    return_weights: bool,
    score_mod: object = None,
) -> AttnRequest:
    """Validate every argument of :func:`attnzoo.attention` and build an :class:`AttnRequest`."""
    check_qkv(q, k, v)
    nq, nk = q.shape[2], k.shape[2]
    check_bool(causal, "causal")
    win = normalize_window(window)
    off = nk - nq if q_offset is None else check_int(q_offset, "q_offset", minimum=None)
    mask_tensor, mask_obj = _check_mask(mask, q, nk)
    sc = 1.0 / math.sqrt(q.shape[3]) if scale is None else check_positive_float(scale, "scale")
    cap = None if softcap is None else check_positive_float(softcap, "softcap")
    slopes = _check_slopes(alibi_slopes, q)
    p = check_probability(dropout_p, "dropout_p")
    check_bool(return_lse, "return_lse")
    check_bool(return_weights, "return_weights")
    mod = check_score_mod(score_mod, q, nk, off)
    return AttnRequest(q=q, k=k, v=v, mask_tensor=mask_tensor, mask_obj=mask_obj, causal=causal, window=win,
                       q_offset=off, scale=sc, softcap=cap, alibi_slopes=slopes, dropout_p=p,
                       return_lse=return_lse, return_weights=return_weights, score_mod=mod)


def _always(device: torch.device) -> bool:
    return True


def _nothing_more(r: AttnRequest) -> set[str]:
    return set()


@dataclass(frozen=True)
class Capabilities:
    """What a backend module declares about itself (``attention.py`` collects them).

    ``unsupported``: feature names of :meth:`AttnRequest.features` it cannot serve;
    ``available(device)``: whether it runs on ``device`` in this environment;
    ``more_missing(r)``: request-dependent limits beyond the feature names (dtype, alignment)."""

    name: str
    unsupported: frozenset[str]
    available: Callable[[torch.device], bool] = field(default=_always)
    more_missing: Callable[[AttnRequest], set[str]] = field(default=_nothing_more)

    def missing(self, r: AttnRequest) -> set[str]:
        """Names of the features of ``r`` this backend lacks (empty: it can serve ``r``)."""
        return (r.features() & self.unsupported) | self.more_missing(r)
