"""Shared pieces of the recurrent mixers (RetNet, GLA, DeltaNet, Gated DeltaNet, Mamba-2).

* :class:`RecurrentCache`: the decode cache: the matrix state ``S [B, H, Dk, Dv]`` of the kernel
  plus, for every short convolution, its last ``kernel - 1`` inputs. Constant memory in the number
  of tokens; same protocol as ``attnzoo.nn.cache`` (``length``, ``batch_size``, ``nbytes``,
  ``reset()``, ``mark()``/``rollback()``/``commit()``, ``update``).
* :class:`ShortConv`: a causal depthwise convolution over tokens that continues from a cache.
* :class:`HeadNorm`: a per-head LayerNorm (RetNet's group norm) or RMSNorm (GLA, DeltaNet).
* :class:`RecurrentMixer`: the forward/decode plumbing; a subclass supplies ``_mix``.
* :func:`recurrent_cost`: the closed-form cost every recurrent variant's cost function shares.

Key padding (bool ``[B, N]``, True = real token, or an ``attnzoo.masks.key_padding`` Mask):
a padded token is skipped by the recurrence (no write, no decay) and feeds zeros to the short
convolutions, so a left-padded row computes what the row alone computes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo._devices import tracing
from attnzoo._validate import check_bool, check_int
from attnzoo.functional.recurrent._chunked_scan import compute_dtype
from attnzoo.masks import Mask
from attnzoo.nn.base import AttentionBase
from attnzoo.nn.cache import SnapshotCache
from attnzoo.nn.feature_attention import key_padding_from_mask, refuse_context
from attnzoo.nn.packing import check_packed_call
from attnzoo.nn.spec import Cost, CostShape, VariantConfig, VariantSpec, register

__all__ = ["HeadNorm", "RecurrentCache", "RecurrentMixer", "ShortConv", "recurrent_cost",
           "register_recurrent", "wide"]


def wide(t: Tensor) -> Tensor:
    """Half (float16 / bfloat16) tensors as float32, others unchanged: what the recurrent mixers feed their
    kernels, whose states and outputs would overflow fp16 (issue 33: ``x * 30`` gave NaN)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


class RecurrentCache(SnapshotCache):
    """Decode cache of a recurrent mixer: ``state [B, H, Dk, Dv]`` and the short convolutions' inputs.

    ``state`` is float32 (float64 for float64 modules); ``conv[name] [B, channels, kernel - 1]``
    holds the last ``kernel - 1`` inputs of convolution ``name`` in the module's dtype. Memory is
    ``B * (H * Dk * Dv * 4 + sum(channels * (kernel - 1)) * itemsize)`` bytes whatever the length
    (``max_len`` only bounds the number of tokens).
    """

    snapshot = ("length", "state", "conv")
    _batch_tensors = ("state", "conv")

    def __init__(self, batch_size: int, max_len: int, state_shape: tuple[int, int, int],
                 conv_shapes: Mapping[str, tuple[int, int]], *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self._set_sizes(batch_size, max_len=max_len)
        self.state_shape = tuple(state_shape)
        self._conv_shapes = dict(conv_shapes)
        self._device, self._dtype = device, dtype
        self.state, self.conv = self._zeros()

    def _zeros(self) -> tuple[Tensor, dict[str, Tensor]]:
        b, dev = self._batch_size, self._device
        state = torch.zeros(b, *self.state_shape, device=dev, dtype=compute_dtype(self._dtype))
        conv = {k: torch.zeros(b, c, w, device=dev, dtype=self._dtype) for k, (c, w) in self._conv_shapes.items()}
        return state, conv

    @property
    def nbytes(self) -> int:
        """Bytes held (independent of ``length``)."""
        return self.state.nbytes + sum(t.nbytes for t in self.conv.values())

    def reset(self) -> None:
        """Forget every token."""
        self.length = 0
        self.state, self.conv = self._zeros()

    def update(self, state: Tensor, conv: Mapping[str, Tensor], n: int) -> tuple[Tensor, Tensor]:
        """Store the state and convolution inputs after ``n`` more tokens; return ``(state, positions [n])``."""
        n = check_int(n, "n", minimum=0)
        if tuple(state.shape) != tuple(self.state.shape) or set(conv) != set(self.conv):
            raise ValueError(f"RecurrentCache.update: expected state {tuple(self.state.shape)} and convolutions "
                             f"{sorted(self.conv)}, got {tuple(state.shape)} and {sorted(conv)}")
        if self.length + n > self.max_len:
            raise ValueError(f"RecurrentCache overflow: {self.length} tokens + {n} new > max_len={self.max_len}")
        self.state = state.to(self.state.dtype)
        self.conv = {k: t.to(self._dtype) for k, t in conv.items()}
        return self.state, self.advance(n, self.state.device)

    def __repr__(self) -> str:
        return (f"RecurrentCache(batch_size={self.batch_size}, state={list(self.state_shape)}, "
                f"conv={ {k: list(v) for k, v in self._conv_shapes.items()} }, length={self.length})")


class ShortConv(nn.Module):
    """Causal depthwise convolution over tokens: ``y_t = sum_j w[:, j] x_{t - kernel + 1 + j} (+ b)``.

    ``forward(x [B, N, Ch], prev [B, Ch, kernel - 1] | None) -> (y [B, N, Ch], last [B, Ch, kernel - 1])``:
    ``prev`` are the inputs before ``x`` (zeros at the sequence start), ``last`` the inputs to keep.
    """

    def __init__(self, channels: int, kernel: int, bias: bool, factory: dict[str, Any]) -> None:
        super().__init__()
        self.channels, self.kernel = check_int(channels, "channels"), check_int(kernel, "conv_size")
        self.weight = nn.Parameter(torch.empty(self.channels, 1, self.kernel, **factory))
        self.bias = nn.Parameter(torch.zeros(self.channels, **factory)) if bias else None
        nn.init.uniform_(self.weight, -self.kernel ** -0.5, self.kernel ** -0.5)

    def forward(self, x: Tensor, prev: Tensor | None = None,
                cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """With ``cu_seqlens`` (int32 ``[S+1]``, ``x [1, T, Ch]``): every packed sequence restarts from its
        own ``prev[i]`` (``[S, Ch, kernel - 1]``, default zeros) and ``last`` is ``[S, Ch, kernel - 1]``."""
        if cu_seqlens is not None:
            return self._packed(x, prev, cu_seqlens)
        b, n, ch = x.shape
        if prev is None:
            prev = x.new_zeros(b, ch, self.kernel - 1)
        if n == 0:  # no new inputs: nothing out, the previous inputs kept
            return x, prev.to(x.dtype)
        seq = torch.cat((prev.to(x.dtype), x.transpose(1, 2)), dim=2)  # [B, Ch, kernel - 1 + N]
        y = F.conv1d(seq, self.weight, self.bias, groups=ch)  # [B, Ch, N]
        return y.transpose(1, 2), seq[:, :, seq.shape[2] - (self.kernel - 1):]

    def _packed(self, x: Tensor, prev: Tensor | None, cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
        """One convolution over the stream with each sequence's ``kernel - 1`` previous inputs (``prev[i]``
        or zeros) inserted before it, so no window reaches into another sequence."""
        w = self.kernel - 1
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
        s, ch = cu.numel() - 1, x.shape[2]
        if prev is None:
            prev = x.new_zeros(s, ch, w)
        if tuple(prev.shape) != (s, ch, w):
            raise ValueError(f"ShortConv: prev must be [S, Ch, kernel - 1] = {[s, ch, w]} with cu_seqlens, got "
                             f"{tuple(prev.shape)}")
        seq_of = torch.searchsorted(cu[1:], torch.arange(x.shape[1], device=x.device), right=True)  # [T]
        slot = torch.arange(x.shape[1], device=x.device) + (seq_of + 1) * w  # each token's place in the stream
        gap = (cu[:-1, None] + torch.arange(s, device=x.device)[:, None] * w
               + torch.arange(w, device=x.device)).flatten()  # [S * w]: the inserted inputs
        stream = x.new_zeros(ch, x.shape[1] + s * w)
        stream = stream.index_copy(1, gap, prev.to(x.dtype).transpose(0, 1).flatten(1))
        stream = stream.index_copy(1, slot, x[0].transpose(0, 1))  # [Ch, T + S w]
        y = F.conv1d(stream.unsqueeze(0), self.weight, self.bias, groups=ch)  # [1, Ch, T + (S - 1) w]
        y = y[0].index_select(1, slot - w).transpose(0, 1).unsqueeze(0)  # [1, T, Ch]
        ends = cu[1:] + (torch.arange(s, device=x.device) + 1) * w  # one past each sequence in the stream
        last = stream[:, (ends[:, None] - w + torch.arange(w, device=x.device)).flatten()]  # [Ch, S * w]
        return y, last.view(ch, s, w).transpose(0, 1)


def _may_overflow(o: Tensor) -> bool:
    """Whether some entry of ``o`` may square past float range (``|o| >= 2^56``): always when
    traced or off the CPU (no host read there), else one ``aminmax`` read back."""
    if tracing() or o.device.type != "cpu":
        return True
    if not o.numel():
        return False
    lo, hi = torch.aminmax(o.detach())
    return max(-float(lo), float(hi)) >= 2.0 ** 56


class HeadNorm(nn.Module):
    """Normalise each head of ``o [B, H, N, D]`` over ``D``: LayerNorm (``kind="layer"``, RetNet's
    group norm) or RMSNorm (``"rms"``), with a learned scale ``[H, D]`` (and bias for LayerNorm)."""

    def __init__(self, num_heads: int, head_dim: int, kind: str, eps: float, factory: dict[str, Any]) -> None:
        super().__init__()
        if kind not in ("layer", "rms"):
            raise ValueError(f"HeadNorm: kind must be 'layer' or 'rms', got {kind!r}")
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim, **factory))
        self.bias = nn.Parameter(torch.zeros(num_heads, head_dim, **factory)) if kind == "layer" else None

    def forward(self, o: Tensor) -> Tensor:
        """Normalised in ``o``'s dtype or float32, whichever is wider (the parameters are cast to it).

        Rows whose largest entry passes ``2^56`` are first divided by a power of two that brings it
        below (exact; ``eps`` is then negligible either way): float32 squares overflow from
        ``|o| ~ 1.8e19``, which Mamba-2's output reaches for inputs ~1e4, and the norm gave zeros.
        Eager on the CPU one ``aminmax`` decides whether any row needs it (other rows are
        normalised bit for bit as without the guard); traced or on an accelerator the division
        always runs (no host read)."""
        o = o if o.dtype == torch.float64 else o.float()
        if _may_overflow(o):
            _, exp = torch.frexp(o.detach().abs().amax(-1, keepdim=True))
            o = o / torch.exp2((exp - 56).clamp_min(0).to(o.dtype))  # [..., 1]: 1 for ordinary rows
        if self.kind == "layer":
            o = F.layer_norm(o, o.shape[-1:], eps=self.eps)
        else:
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        o = o * self.weight[:, None, :].to(o.dtype)
        return o if self.bias is None else o + self.bias[:, None, :].to(o.dtype)


class RecurrentMixer(AttentionBase):
    """Forward and cached decoding of a recurrent mixer; subclasses implement :meth:`_mix`.

    ``_mix(x, pad, state, conv, cu) -> (y [B, N, C], state [B, H, Dk, Dv], conv)`` runs the new tokens
    from ``state`` (``None`` = zeros) and the convolutions' previous inputs ``conv`` (``{}`` = zeros);
    ``cu`` (int32 ``[S+1]`` or ``None``) are packed sequences' boundaries, passed to the kernel and the
    short convolutions.

    Half precision: the kernels compute in float32 and :meth:`head_output` normalises their float32
    output before casting back, so fp16 states and outputs never overflow (issue 33).
    """

    no_weights_reason = "a recurrence has no attention matrix"

    #: ``(H, Dk, Dv)`` of the state and ``{name: channels}`` of the short convolutions (set by subclasses)
    state_shape: tuple[int, int, int]
    conv_channels: dict[str, int]
    conv_size: int

    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> RecurrentCache:
        """A :class:`RecurrentCache` (state + short-convolution inputs; its size does not grow)."""
        return super().init_cache(batch_size, max_len, device=device, dtype=dtype)  # type: ignore[no-any-return]

    def _new_cache(self, batch_size: int, max_len: int, device: torch.device | str,
                   dtype: torch.dtype) -> RecurrentCache:
        convs = {k: (c, self.conv_size - 1) for k, c in self.conv_channels.items()}
        return RecurrentCache(batch_size, max_len, self.state_shape, convs, device=device, dtype=dtype)

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | Mask | None = None,
                cache: RecurrentCache | None = None, positions: Tensor | None = None,
                return_weights: bool = False, cu_seqlens: Tensor | None = None) -> Tensor:
        """Causal mixing of ``x [B, N, C]`` -> ``[B, N, C]``.

        Args:
            x: tokens; with a cache only the NEW ones (positions ``cache.length ..``).
            context: must be ``None`` (no cross-attention).
            mask: key padding: bool ``[B, N]`` (``[B, cache.length + N]`` with a cache), True = real
                token, or ``attnzoo.masks.key_padding(...)``; padded tokens are skipped.
            cache: a :class:`RecurrentCache` from :meth:`init_cache`, updated in place (unchanged
                when the call raises).
            positions: validated, unused (position comes from the recurrence).
            return_weights: must be False (there is no attention matrix).
            cu_seqlens: packed sequences: ``x [1, T, C]`` holds ``S`` sequences end to end, int32
                ``[S+1]`` cumulative lengths; the state and the short convolutions restart at every
                boundary (each sequence computes what it computes alone). No cache, mask or positions.
        """
        cls = type(self).__name__
        refuse_context(cls, context, "a recurrent mixer is causal self-attention over one stream")
        x = self.check_call(x, cache, positions, return_weights, RecurrentCache)
        if cu_seqlens is not None:
            cu = check_packed_call(cls, x, cu_seqlens, cache=cache, mask=mask, positions=positions)
            return self._mix(x, None, None, {}, cu)[0]
        if cache is not None and (tuple(cache.state_shape) != tuple(self.state_shape)
                                  or set(cache.conv) != set(self.conv_channels)):
            raise ValueError(f"{cls}: the cache holds a state {list(cache.state_shape)} and convolutions "
                             f"{sorted(cache.conv)}, this module needs {list(self.state_shape)} and "
                             f"{sorted(self.conv_channels)}; use module.init_cache()")
        b, n, _ = x.shape
        pad = key_padding_from_mask(cls, mask, b, n, n + (cache.length if cache is not None else 0), x.device)
        if cache is None:
            return self._mix(x, pad, None, {})[0]
        if cache.length + n > cache.max_len:
            raise ValueError(f"{cls}: the cache holds {cache.length} tokens of max_len={cache.max_len}; "
                             f"{n} more do not fit")

        def run() -> Tensor:
            y, state, conv = self._mix(x, pad, cache.state, cache.conv)
            cache.update(state, conv, n)
            return y

        return self.guarded(cache, run)

    def _mix(self, x: Tensor, pad: Tensor | None, state: Tensor | None, conv: Mapping[str, Tensor],
             cu: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    # helpers for subclasses -------------------------------------------------
    def head_output(self, x: Tensor, o: Tensor) -> Tensor:
        """``out_proj(silu(x W_g) * norm(o))`` (no gate without ``g_proj``): ``o [B, H, N, D] -> [B, N, C]``.

        ``o`` may be float32 for a half module (the kernel's output): the norm runs in float32 and
        the result is cast to x's dtype before the gate."""
        y = self.norm(o).to(x.dtype).transpose(1, 2).flatten(2)  # [B, N, H * D]
        gate = getattr(self, "g_proj", None)
        return self.out_proj(y if gate is None else F.silu(gate(x)) * y)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, conv_size={self.conv_size}, "
                f"output_gate={getattr(self, 'output_gate', None)}, chunk_size={getattr(self, 'chunk_size', None)}")

    def short_conv(self, name: str, t: Tensor, pad: Tensor | None, conv: Mapping[str, Tensor],
                   out: dict[str, Tensor], *, silu: bool = True, cu: Tensor | None = None) -> Tensor:
        """``t [B, N, Ch]`` through convolution ``name`` (padded tokens feed zeros; ``cu``: packed
        sequences, each from zeros), then SiLU (``silu=False``: SiLU only after a convolution); the
        inputs to keep go to ``out[name]``."""
        if pad is not None:
            t = t * pad[..., None].to(t.dtype)
        if self.conv_size == 0:
            return F.silu(t) if silu else t
        y, out[name] = getattr(self, f"{name}_conv")(t, conv.get(name), cu)
        return F.silu(y)

    def set_value_heads(self, num_v_heads: int | None, width: int, bias: bool, fk: dict[str, Any]) -> int:
        """Grouped value heads: ``num_v_heads`` (default ``num_heads``, a multiple of it) value heads of
        ``width`` channels; replaces ``v_proj`` and ``out_proj`` when they differ from the key heads'."""
        cls = type(self).__name__
        hv = self.num_heads if num_v_heads is None else check_int(num_v_heads, "num_v_heads", owner=cls)
        if hv % self.num_heads:
            raise ValueError(f"{cls}: num_v_heads ({hv}) must be a multiple of num_heads ({self.num_heads}): "
                             f"value head j reads key head j // (num_v_heads // num_heads)")
        self.num_v_heads = hv
        if hv != self.num_heads or width != self.head_dim:
            self.v_proj = nn.Linear(self.dim, hv * width, bias=bias, **fk)
            self.out_proj = nn.Linear(hv * width, self.dim, bias=bias, **fk)
        return hv

    def set_gate_and_chunk(self, output_gate: object, chunk_size: object) -> None:
        """``self.output_gate`` (a bool) and ``self.chunk_size`` (an int >= 1), checked in that order."""
        self.output_gate = check_bool(output_gate, "output_gate", type(self).__name__)
        self.chunk_size = check_int(chunk_size, "chunk_size")

    def gate_norm_convs(self, conv_size: int, bias: bool, fk: dict[str, Any]) -> None:
        """The ``D x D``-state mixers' parts after :meth:`set_value_heads` (``Hv = num_v_heads``): the output
        gate ``g_proj [C, Hv D]`` when ``self.output_gate``, a per-value-head RMS :class:`HeadNorm`, the
        q/k/v short convolutions (no bias) and ``state_shape = (Hv, D, D)``."""
        hv, d = self.num_v_heads, self.head_dim
        inner, v_inner = self.num_heads * d, hv * d
        self.g_proj = nn.Linear(self.dim, v_inner, bias=bias, **fk) if self.output_gate else None
        self.norm = HeadNorm(hv, d, "rms", 1e-5, fk)
        self.make_convs({"q": inner, "k": inner, "v": v_inner}, conv_size, False, fk)
        self.state_shape = (hv, d, d)

    def make_convs(self, channels: dict[str, int], conv_size: int, bias: bool, factory: dict[str, Any]) -> None:
        """Create ``ShortConv`` ``{name}_conv`` for every entry of ``channels`` (none when ``conv_size == 0``)."""
        self.conv_size = check_int(conv_size, "conv_size", minimum=0, owner=type(self).__name__)
        self.conv_channels = dict(channels) if self.conv_size else {}
        for name, ch in self.conv_channels.items():
            setattr(self, f"{name}_conv", ShortConv(ch, self.conv_size, bias, factory))

    def heads(self, t: Tensor, width: int | None = None) -> Tensor:
        """``[B, N, H' * D] -> [B, H', N, D]`` (``D = width`` or ``head_dim``; ``H'`` from t's width)."""
        b, n = t.shape[:2]
        d = width or self.head_dim
        return t.reshape(b, n, t.shape[-1] // d, d).transpose(1, 2)


def _build_causal(cls: type[nn.Module], name: str, dim: int, num_heads: int, *, causal: bool = True,
                  **kw: Any) -> nn.Module:
    if causal is not True:
        raise ValueError(f"{name}: {cls.__name__} is causal by construction (causal=False is not supported)")
    return cls(dim, num_heads, **kw)


def register_recurrent(name: str, cls: type[nn.Module], cost: Callable[[VariantConfig, CostShape], Cost],
                       decoding: str, order: int, check: Mapping[str, Any] | None = None) -> VariantSpec:
    """Register a recurrent mixer ``cls`` (causal only, ``chunk_size`` its one cost-model option)."""
    return register(VariantSpec(
        name, "recurrent", False, "O(N C^2 + N c C)", "O(N c) chunked", decoding,
        functools.partial(_build_causal, cls, name), cost, defaults={"chunk_size": 64}, options=("chunk_size",),
        causal_modes=(True,), check=check or {"chunk_size": 8}, masks="causal, key padding", order=order,
        positions="own", backends=False))


def recurrent_cost(cfg: VariantConfig, shape: CostShape, *, in_width: int, inner: int, dk: int, dv: int,
                   conv_channels: int, conv_size: int, kernel: str, extra_params: int = 0,
                   key_heads: int | None = None) -> Cost:
    """Closed-form cost of a recurrent mixer.

    Args:
        in_width: outputs of every input projection together (``q, k, v, gates, ...``).
        inner: ``H * Dv`` (the output projection's input width).
        dk, dv: state dims per head; conv_channels, conv_size: the short convolutions.
        kernel: ``"scalar"`` (a decay per token: retention, Mamba-2), ``"vector"`` (GLA) or ``"delta"``.
        extra_params: parameters beyond the projections and convolutions (norms, decays).
        key_heads: heads of q and k (default ``num_heads``): with grouped value heads and one decay per
            token the intra-chunk scores ``Q K^T`` are computed once per key head.

    The kernel runs quadratic (one chunk) up to ``chunk_size`` tokens, chunked beyond; per head and
    token a chunk of ``c`` tokens costs ``2 c (Dk + Dv)`` for the intra-chunk scores and their
    product with V, ``4 Dk Dv`` for reading and updating the state; the delta rule adds the
    ``K K^T`` Gram matrix, the triangular solve and the ``W S`` correction.
    """
    B, N, C, e, acc = shape.batch, shape.seq_len, cfg.dim, shape.elem_bytes, shape.acc_bytes
    H = cfg.num_heads
    c = min(cfg.chunk_size or 64, N)
    params = C * in_width + inner * C + conv_channels * conv_size + extra_params
    flops_proj = 2 * B * N * C * in_width + 2 * B * N * inner * C + 2 * B * N * conv_channels * conv_size
    per_tok = 2 * c * dv + 4 * dk * dv  # the modules always read and return the state
    if kernel == "delta":
        per_tok += 2 * c * dk + c * (dk + dv) + 2 * c * dk + 2 * dk * dk + 2 * dk * dv
    hk = H if key_heads is None or kernel != "scalar" else key_heads
    flops_attn = B * H * N * per_tok + B * hk * N * 2 * c * dk  # + the scores Q K^T
    state = B * H * dk * dv * acc
    conv_bytes = B * conv_channels * (conv_size - 1) * e if conv_size else 0
    act = B * N * (C + in_width + 2 * inner) * e + B * H * N * (2 * c + dk + dv) * acc
    return Cost(backend="chunked" if c < N else "quadratic", flops_projections=flops_proj, flops_attention=flops_attn,
                flops_useful=flops_attn, flops_backward=2 * flops_proj + 2 * flops_attn,
                bytes_moved=2 * B * N * C * e + params * e + 2 * B * N * (in_width + inner) * e
                + 2 * state * max(1, N // c),
                activation_bytes=act, kv_cache_bytes_per_token=0, kv_cache_bytes=state + conv_bytes,
                kv_cache_max_tokens=None, params=params, visible_pairs=N * (N + 1) // 2)
