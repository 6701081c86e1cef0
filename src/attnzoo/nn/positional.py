"""Positional information: absolute tables, rotary embeddings and ALiBi slopes.

* :class:`SinusoidalPositionalEncoding` and :class:`LearnedPositionalEmbedding` add a position
  vector to token embeddings ``[B, N, C]`` (``x + table[positions]``).
* :class:`RotaryEmbedding` rotates queries and keys ``[B, H, N, D]`` by their absolute positions,
  so that the score ``q_m . k_n`` depends only on ``m - n`` (RoFormer);
  :class:`ScaledRotaryEmbedding` adds Hugging Face's RoPE scaling types (``rope_parameters``).
* :func:`alibi_slopes` gives the per-head slopes of ALiBi; :func:`attnzoo.attention` applies the
  bias ``-slope * |q_pos - k_pos|`` itself (``alibi_slopes=``).

Positions are absolute token indices (``docs/conventions.md``). Every ``positions`` argument is an
integer tensor ``[N]`` (shared by the batch) or ``[B, N]`` (one row per sequence, e.g. left-padded
batched generation); when omitted, positions are ``offset .. offset + N - 1``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._devices import tracing
from attnzoo._validate import (
    check_bool,
    check_float,
    check_int,
    check_nonnegative_float,
    check_number_above,
)
from attnzoo.nn.rope_scaling import ROPE_SCALINGS, rope_inv_freq

__all__ = ["LearnedPositionalEmbedding", "RotaryEmbedding", "ScaledRotaryEmbedding", "SinusoidalPositionalEncoding",
           "alibi_slopes"]


# --------------------------------------------------------------------------- helpers
def resolve_positions(
    positions: Tensor | None,
    n: int,
    offset: int,
    device: torch.device,
    *,
    batch: int | None = None,
    name: str = "positions",
) -> Tensor:
    """Validate ``positions`` (int ``[N]`` or ``[B, N]``) or build ``offset .. offset + n - 1``.

    Returns an int64 tensor ``[N]`` or ``[B, N]`` on ``device``. ``batch`` (if given) is the batch
    size a ``[B, N]`` tensor must match. Negative positions are rejected.
    """
    if positions is None:
        off = check_int(offset, "offset", minimum=0)
        return torch.arange(off, off + n, device=device)
    if not isinstance(positions, Tensor):
        raise TypeError(f"{name} must be an int tensor [N] or [B, N], got {type(positions).__name__}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {positions.dtype}")
    if positions.dim() not in (1, 2) or positions.shape[-1] != n:
        raise ValueError(f"{name} must have shape [N] or [B, N] with N = {n} tokens, got "
                         f"{tuple(positions.shape)}")
    if positions.dim() == 2 and batch is not None and positions.shape[0] not in (1, batch):
        raise ValueError(f"{name} has shape {tuple(positions.shape)} but the batch size is {batch} "
                         f"(expected [{batch}, {n}] or [{n}])")
    if positions.numel() and not tracing() and int(positions.min()) < 0:  # eager only: syncs
        raise ValueError(f"{name} must be >= 0, got minimum {int(positions.min())}")
    return positions.to(device=device, dtype=torch.long)


def _require_tensor(positions: object, owner: str | None = None) -> Tensor:
    if not isinstance(positions, Tensor):
        where = f"{owner}: " if owner else ""
        raise TypeError(f"{where}positions must be an int tensor [N] or [B, N], got {type(positions).__name__}")
    return positions


def _check_x(x: object, dim: int, cls: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{cls}: x must be a tensor [B, N, C], got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != dim:
        raise ValueError(f"{cls}: x must have shape [B, N, C] with C = {dim}, got {tuple(x.shape)}")
    return x


# --------------------------------------------------------------------------- sinusoidal
def sinusoidal_table(n: int, dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float64) -> Tensor:
    """The ``[n, dim]`` table ``PE[p, 2i] = sin(p w_i)``, ``PE[p, 2i+1] = cos(p w_i)``,
    ``w_i = base^(-2i / dim)``. An odd ``dim`` keeps the last sine column without its cosine
    (the table of width ``dim + 1`` with its last column dropped). Computed in float64."""
    half = (dim + 1) // 2
    even = 2 * half  # width of the table before truncation
    freqs = torch.exp(-math.log(base) * torch.arange(0, even, 2, dtype=torch.float64) / even)  # [half]
    pos = torch.arange(n, dtype=torch.float64).unsqueeze(1)  # [n, 1]
    ang = pos * freqs  # [n, half]
    table = torch.stack((torch.sin(ang), torch.cos(ang)), dim=-1).reshape(n, even)  # [n, even]
    return table[:, :dim].to(dtype)


def _check_table_range(pos: Tensor, max_len: int, cls: str) -> None:
    if pos.numel() and not tracing() and int(pos.max()) >= max_len:  # eager only: syncs
        raise ValueError(f"{cls}: position {int(pos.max())} is beyond the table (max_len={max_len}, "
                         f"valid positions 0..{max_len - 1}); build it with a larger max_len")


class _PositionTable(nn.Module):
    """An absolute position table ``[max_len, C]`` (:meth:`_table`) added to the tokens it is given."""

    dim: int
    max_len: int

    def _table(self) -> Tensor:
        raise NotImplementedError

    def encoding(self, positions: Tensor) -> Tensor:
        """The table's rows ``[N, C]`` or ``[B, N, C]`` for positions ``[N]`` or ``[B, N]``."""
        table = self._table()
        pos = resolve_positions(_require_tensor(positions), positions.shape[-1], 0, table.device)
        _check_table_range(pos, self.max_len, type(self).__name__)
        return table[pos]

    def forward(self, x: Tensor, positions: Tensor | None = None, *, offset: int = 0) -> Tensor:
        """``x + table[positions]`` (positions default to ``offset .. offset + N - 1``)."""
        _check_x(x, self.dim, type(self).__name__)
        table = self._table()
        pos = resolve_positions(positions, x.shape[1], offset, table.device, batch=x.shape[0])
        _check_table_range(pos, self.max_len, type(self).__name__)
        return x + table[pos].to(x.dtype)


class SinusoidalPositionalEncoding(_PositionTable):
    """Fixed sine/cosine absolute positions (Vaswani et al.): ``forward(x) = x + PE[positions]``.

    ``PE[p, 2i] = sin(p * base^(-2i/C))`` and ``PE[p, 2i + 1] = cos(p * base^(-2i/C))``. For an
    even width, ``PE(p + d) = A_d PE(p)`` with ``A_d`` block-diagonal 2x2 rotations by ``d * w_i``
    (independent of ``p``). An odd width ``C`` is the width-``C + 1`` table without its last
    column. The table is a non-persistent buffer (not saved in ``state_dict``).

    Args:
        dim: model width ``C``.
        max_len: number of positions in the table; larger positions raise ``ValueError``.
        base: frequency base (10000 in the paper).
        device, dtype: of the table.

    Shapes:
        ``x [B, N, C]``, ``positions [N]`` or ``[B, N]`` -> ``[B, N, C]``.
    """

    pe: Tensor

    def __init__(self, dim: int, max_len: int = 8192, *, base: float = 10000.0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dim = check_int(dim, "dim")
        self.max_len = check_int(max_len, "max_len")
        check_number_above(base, "base", lower=1.0, owner=type(self).__name__)
        self.base = float(base)
        table = sinusoidal_table(self.max_len, self.dim, self.base, dtype or torch.get_default_dtype())
        self.register_buffer("pe", table.to(device), persistent=False)  # [max_len, C]

    def _apply(self, fn: Any, recurse: bool = True) -> SinusoidalPositionalEncoding:
        """Moves and casts rebuild the table from its formula: ``to_empty`` (after a build on the
        meta device) leaves a buffer uninitialised, and a non-persistent one is not in the state
        dict that would refill it."""
        super()._apply(fn, recurse)
        if self.pe.device.type != "meta":
            self.pe = sinusoidal_table(self.max_len, self.dim, self.base, torch.float64).to(self.pe.device,
                                                                                            self.pe.dtype)
        return self

    def _table(self) -> Tensor:
        return self.pe

    def extra_repr(self) -> str:
        return f"dim={self.dim}, max_len={self.max_len}, base={self.base:g}"


# --------------------------------------------------------------------------- learned
class LearnedPositionalEmbedding(_PositionTable):
    """A trained absolute position table (BERT, GPT-2, ViT): ``forward(x) = x + weight[positions]``.

    The parameter ``weight [max_len, C]`` has the layout of Hugging Face's
    ``position_embeddings.weight`` / ``wpe.weight`` (copy it as is).

    Args:
        dim: model width ``C``.
        max_len: number of positions; larger positions raise ``ValueError``.
        init_std: standard deviation of the normal initialisation.
        device, dtype: of the parameter.

    Shapes:
        ``x [B, N, C]``, ``positions [N]`` or ``[B, N]`` -> ``[B, N, C]``.
    """

    def __init__(self, dim: int, max_len: int, *, init_std: float = 0.02,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dim = check_int(dim, "dim")
        self.max_len = check_int(max_len, "max_len")
        self.init_std = check_nonnegative_float(init_std, "init_std", "LearnedPositionalEmbedding")
        self.weight = nn.Parameter(torch.empty(self.max_len, self.dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)

    def _table(self) -> Tensor:
        return self.weight

    def extra_repr(self) -> str:
        return f"dim={self.dim}, max_len={self.max_len}"


# --------------------------------------------------------------------------- rotary
class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE) for queries and keys ``[B, H, N, D]``.

    The first ``rotary_dim`` channels of each head are grouped in pairs, and pair ``i`` is rotated
    by the angle ``p * theta_i`` with ``theta_i = base^(-2i / rotary_dim)``; the other channels
    pass through (partial rotary, GPT-NeoX's ``rotary_pct``). Since rotations compose,
    ``<R(m) q, R(n) k> = <q, R(n - m) k>``: the score depends only on the offset.

    Pairing:
        * split-half (default; GPT-NeoX / LLaMA in Hugging Face): pair ``i`` is channels
          ``(i, i + rotary_dim / 2)``;
        * ``interleaved=True`` (GPT-J, the RoFormer paper, Meta's LLaMA checkpoints): channels
          ``(2i, 2i + 1)``. The two agree once the q/k projection rows of each head are permuted
          by ``[0, 2, 4, ..., 1, 3, 5, ...]`` (interleaved -> split-half).

    Scaling for longer contexts: ``scaling="linear"`` divides positions by ``scaling_factor``
    (position interpolation); ``scaling="ntk"`` keeps positions and raises the base to
    ``base * scaling_factor ** (rotary_dim / (rotary_dim - 2))`` (NTK-aware).

    Angles are computed in float32 (float64 for float64 inputs) from integer positions on every
    call, so there is no table to outgrow and decoding at any offset is exact.

    Args:
        dim: head dimension ``D``.
        base: frequency base (10000 in RoFormer, 500000 in LLaMA 3).
        interleaved: adjacent pairs instead of split halves.
        rotary_dim: number of leading channels rotated (even, ``<= dim``); default ``dim``.
        scaling: ``None | "linear" | "ntk"``.
        scaling_factor: context extension factor ``>= 1`` used by ``scaling``.

    Shapes:
        ``forward(x [B, H, N, D], positions [N] | [B, N] | None, offset=0) -> [B, H, N, D]``.
    """

    def __init__(self, dim: int, *, base: float = 10000.0, interleaved: bool = False,
                 rotary_dim: int | None = None, scaling: str | None = None, scaling_factor: float = 1.0) -> None:
        super().__init__()
        self.dim = check_int(dim, "dim")
        rd = self.dim if rotary_dim is None else check_int(rotary_dim, "rotary_dim")
        if rd > self.dim:
            raise ValueError(f"rotary_dim must be <= dim = {self.dim}, got {rd}")
        if rd % 2:
            which = "dim" if rotary_dim is None else "rotary_dim"
            raise ValueError(f"RotaryEmbedding rotates channel pairs, so {which} must be even, got {rd}")
        self.rotary_dim = rd
        check_number_above(base, "base", lower=1.0, owner=type(self).__name__)
        check_bool(interleaved, "interleaved")
        if scaling not in (None, "linear", "ntk"):
            raise ValueError(f"scaling must be None, 'linear' or 'ntk', got {scaling!r}")
        if check_float(scaling_factor, "scaling_factor", type(self).__name__, expected="a number") < 1 \
                or not math.isfinite(scaling_factor):
            raise ValueError(f"scaling_factor must be a finite number >= 1, got {scaling_factor!r}")
        if scaling == "ntk" and rd <= 2:
            raise ValueError(f"scaling='ntk' needs rotary_dim > 2, got {rd}")
        if scaling is None and scaling_factor != 1:
            raise ValueError(f"scaling_factor={scaling_factor!r} applies only with scaling='linear' or 'ntk' "
                             f"(scaling is None: the factor would be ignored)")
        self.base = float(base)
        self.interleaved = interleaved
        self.scaling = scaling
        self.scaling_factor = float(scaling_factor)
        eff_base = self.base
        if scaling == "ntk":
            eff_base = self.base * self.scaling_factor ** (rd / (rd - 2))
        self.effective_base = eff_base
        # on the CPU even under ``with torch.device("meta")``: a constant, not a parameter to_empty would fill
        self._set_inv_freq(eff_base ** (-torch.arange(0, rd, 2, dtype=torch.float64, device="cpu") / rd))  # [rd/2]

    def _set_inv_freq(self, inv_freq64: Tensor) -> None:
        """Keep the frequencies in float64 (outside the module's buffers, so ``.half()`` never degrades
        them) and in float32 on the CPU from the start: a compiled graph then reads one constant in
        every layer (converting in the first traced layer made its kernels differ from the next
        layers': one more C++ kernel to build, cold)."""
        self._inv_freq64 = inv_freq64
        self._inv_freq32 = inv_freq64.float()
        self._inv_freq_cache: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def inv_freq(self, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
        """Frequencies ``theta_i`` ``[rotary_dim / 2]`` on ``device`` in ``dtype``."""
        key = (torch.device(device), dtype)
        if key[0].type == "cpu" and dtype in (torch.float32, torch.float64):
            return self._inv_freq32 if dtype == torch.float32 else self._inv_freq64
        f = self._inv_freq_cache.get(key)
        if f is None:
            f = self._inv_freq64.to(device=device, dtype=dtype)
            self._inv_freq_cache[key] = f
        return f

    def angles(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Rotation angles ``positions[..., None] * theta`` (after scaling): ``[..., N, rotary_dim / 2]``."""
        _require_tensor(positions, type(self).__name__)
        pos = positions.to(dtype)
        if self.scaling == "linear":
            pos = pos / self.scaling_factor
        return pos.unsqueeze(-1) * self.inv_freq(positions.device, dtype)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """``(cos, sin)`` broadcastable to ``[B, H, N, rotary_dim / 2]``."""
        ang = self.angles(positions, dtype)  # [N, R/2] or [B, N, R/2]
        ang = ang.unsqueeze(0 if ang.dim() == 2 else 1)  # [1, N, R/2] or [B, 1, N, R/2]
        if ang.dim() == 3:
            ang = ang.unsqueeze(0)  # [1, 1, N, R/2]
        return torch.cos(ang), torch.sin(ang)

    def forward(self, x: Tensor, positions: Tensor | None = None, *, offset: int = 0) -> Tensor:
        """Rotate ``x [B, H, N, D]`` by ``positions`` (default ``offset .. offset + N - 1``)."""
        if not isinstance(x, Tensor):
            raise TypeError(f"RotaryEmbedding: x must be a tensor [B, H, N, D], got {type(x).__name__}")
        if x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"RotaryEmbedding: x must have shape [B, H, N, D] with D = {self.dim}, "
                             f"got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"RotaryEmbedding: x must be a float tensor, got {x.dtype}")
        pos = resolve_positions(positions, x.shape[2], offset, x.device, batch=x.shape[0])
        cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = self.cos_sin(pos, cdt)
        return self.rotate(x, cos, sin)

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Apply precomputed ``cos, sin`` (from :meth:`cos_sin`) to ``x [B, H, N, D]``."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"{type(self).__name__}.rotate: x must be [B, H, N, D] with D = {self.dim}, "
                             f"got {tuple(x.shape)}")
        rd = self.rotary_dim
        cdt = cos.dtype
        xr = x[..., :rd] if rd < self.dim else x  # [B, H, N, R]
        if xr.dtype != cdt:
            xr = xr.to(cdt)
        if self.interleaved:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]  # [B, H, N, R/2] each
            out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        else:
            x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        if rd == self.dim:
            return out
        return torch.cat((out, x[..., rd:]), dim=-1)

    def extra_repr(self) -> str:
        s = f"dim={self.dim}, rotary_dim={self.rotary_dim}, base={self.base:g}, interleaved={self.interleaved}"
        if self.scaling is not None:
            s += f", scaling={self.scaling!r}, scaling_factor={self.scaling_factor:g}"
        return s


def interleaved_to_split_half(head_dim: int, rotary_dim: int | None = None) -> Tensor:
    """Channel permutation ``perm [head_dim]`` taking an interleaved-RoPE head to split-half.

    ``split_half_rope(x[..., perm]) == interleaved_rope(x)[..., perm]``: permute the q and k
    projection rows of every head by ``perm`` to move a checkpoint between the two conventions.
    """
    rd = head_dim if rotary_dim is None else rotary_dim
    perm = torch.cat((torch.arange(0, rd, 2), torch.arange(1, rd, 2), torch.arange(rd, head_dim)))
    return perm


# --------------------------------------------------------------------------- alibi
def alibi_slopes(num_heads: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> Tensor:
    """ALiBi head slopes ``[num_heads]`` (Press et al., 2022).

    For ``n`` a power of two the slopes are the geometric sequence ``r, r^2, ..., r^n`` with
    ``r = 2^(-8/n)``. Otherwise, with ``p`` the largest power of two below ``n``, they are the
    ``p`` slopes for ``p`` heads followed by every other slope of the ``2p``-head sequence
    (``r' = 2^(-4/p)``: ``r'^1, r'^3, ...``) until there are ``n`` (the paper's reference code).
    """
    n = check_int(num_heads, "num_heads")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"alibi_slopes: dtype must be a floating torch.dtype, got {dtype!r}")

    def pow2(m: int) -> list[float]:
        start = 2.0 ** (-8.0 / m)
        return [start ** (i + 1) for i in range(m)]

    p = 2 ** math.floor(math.log2(n))
    slopes = pow2(p)
    if p != n:
        slopes += pow2(2 * p)[0::2][: n - p]
    return torch.tensor(slopes, dtype=dtype, device=device)


# --------------------------------------------------------------------------- scaled rotary
class ScaledRotaryEmbedding(RotaryEmbedding):
    """RoPE with a Hugging Face ``rope_parameters`` dict (``rope_type`` ``default``, ``linear``,
    ``dynamic``, ``yarn``, ``llama3`` or ``longrope`` and their keys; see
    :func:`attnzoo.nn.rope_scaling.rope_inv_freq`).

    The inverse frequencies follow the positions of each call, as transformers' rotary module:
    ``dynamic`` grows the base once ``max(positions) + 1`` passes ``max_position_embeddings``;
    ``longrope`` switches to ``long_factor`` past ``original_max_position_embeddings``. cos/sin
    are multiplied by the type's attention scaling (``yarn``, ``longrope``).

    Args:
        dim: head dimension ``D``.
        rope_parameters: the dict (``rope_theta`` is the base).
        max_position_embeddings: the model's trained length (``dynamic``; ``yarn``/``longrope``
            without ``factor``).
        rotary_dim: rotated channels (partial rotary); default ``dim``.

    Shapes: as :class:`RotaryEmbedding`.
    """

    def __init__(self, dim: int, rope_parameters: Mapping[str, Any], *, max_position_embeddings: int | None = None,
                 rotary_dim: int | None = None) -> None:
        params = dict(rope_parameters)
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ROPE_SCALINGS:
            raise ValueError(f"ScaledRotaryEmbedding: rope_type must be one of {sorted(ROPE_SCALINGS)}, "
                             f"got {rope_type!r}")
        super().__init__(dim, base=float(params.get("rope_theta") or 10000.0), rotary_dim=rotary_dim)
        self.rope_type, self.rope_parameters, self.max_position_embeddings = rope_type, params, max_position_embeddings
        inv, self.attention_scaling = self._scaled(None, torch.device("cpu"))
        self._set_inv_freq(inv.double())
        self._scaled_cache: dict[tuple[Any, torch.device], Tensor] = {}

    def _scaled(self, seq_len: int | None, device: torch.device) -> tuple[Tensor, float]:
        return rope_inv_freq(self.rope_parameters, self.rotary_dim, max_position_embeddings=self.max_position_embeddings,
                             seq_len=seq_len, device=device)

    def _key(self, seq_len: int) -> Any:
        """What the frequencies depend on at ``seq_len`` (None: nothing)."""
        if self.rope_type == "dynamic":
            return max(seq_len, self.max_position_embeddings or 0)
        if self.rope_type == "longrope":
            return seq_len > int(self.rope_parameters.get("original_max_position_embeddings") or 0)
        return None

    def varies_between(self, first: int, last: int) -> bool:
        """Whether the frequencies differ between sequences of ``first`` and ``last`` tokens
        (``dynamic`` past ``max_position_embeddings``, ``longrope`` across its original length):
        then a chunk of several new tokens is not rotated as one token at a time would be."""
        return self._key(first) != self._key(last)

    def switches_at(self, length: int) -> bool:
        """Whether a sequence growing to ``length`` tokens moves ``longrope`` from its short to
        its long factors (then the keys already rotated should be rotated again)."""
        if self.rope_type != "longrope":
            return False
        return length == int(self.rope_parameters.get("original_max_position_embeddings") or 0) + 1

    def angles(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        _require_tensor(positions, type(self).__name__)
        seq_len = int(positions.max()) + 1 if positions.numel() else 1
        key = (self._key(seq_len), positions.device)
        inv = self._scaled_cache.get(key)
        if inv is None:
            inv = self._scaled(seq_len if key[0] is not None else None, positions.device)[0]
            if len(self._scaled_cache) > 8:  # dynamic grows one length at a time while decoding
                self._scaled_cache.clear()
            self._scaled_cache[key] = inv
        return positions.to(dtype).unsqueeze(-1) * inv.to(dtype)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        cos, sin = super().cos_sin(positions, dtype)
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos, sin

    def extra_repr(self) -> str:
        return f"dim={self.dim}, rope_type={self.rope_type!r}, base={self.base}"
