"""RoPE scaling: inverse frequencies and attention scaling for long-context rope types.

Rotary embeddings rotate the pair ``(x[i], x[i + dim/2])`` of a head by the angle
``pos * inv_freq[i]`` with ``inv_freq[i] = base ** (-2i / dim)``, ``i = 0 .. dim/2 - 1``. A scaling
scheme changes ``inv_freq`` (and sometimes multiplies cos/sin by an ``attention_scaling``) so a
model trained on ``L`` positions reads longer sequences:

* ``default``: unscaled.
* ``linear`` (position interpolation): ``inv_freq / factor``.
* ``dynamic`` (dynamic NTK): for ``seq_len > max_position_embeddings`` the base grows to
  ``base * (factor * seq_len / L - (factor - 1)) ** (dim / (dim - 2))``; shorter sequences keep it.
* ``yarn`` (Peng et al. 2023): per-frequency blend of interpolation (``inv_freq / factor``) for
  long wavelengths and extrapolation (``inv_freq``) for short ones, with a linear ramp between the
  dimensions that turn ``beta_slow`` and ``beta_fast`` times over ``L`` positions; attention
  scaling ``0.1 * ln(factor) + 1`` (or the ``mscale`` / ``mscale_all_dim`` ratio of DeepSeek).
* ``llama3``: wavelengths shorter than ``L / high_freq_factor`` kept, longer than
  ``L / low_freq_factor`` divided by ``factor``, a smooth interpolation between.
* ``longrope`` (Ding et al. 2024): per-frequency rescale factors, ``short_factor`` while the
  sequence fits in ``original_max_position_embeddings`` and ``long_factor`` past it; attention
  scaling ``sqrt(1 + ln(factor) / ln(L))``.

The parameter names and defaults follow Hugging Face transformers' ``rope_parameters`` /
``rope_scaling`` dicts, so a config can be passed as is (``scaled_inv_freq``); the results equal
transformers' ``ROPE_INIT_FUNCTIONS`` (tested in ``tests/test_rope_scaling.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from attnzoo._validate import check_int, check_number_above, check_positive_float

RopeResult = tuple[Tensor, float]


def _exponents(dim: int, device: torch.device | str | None) -> Tensor:
    """``2i / dim`` for ``i = 0 .. dim/2 - 1`` (float32 ``[dim // 2]``)."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def default_inv_freq(dim: int, base: float, device: torch.device | str | None = None) -> Tensor:
    """Unscaled RoPE inverse frequencies ``base ** (-2i / dim)``, float32 ``[dim // 2]``."""
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 2 or dim % 2:
        raise ValueError(f"rope: dim must be an even int >= 2, got {dim!r}")
    if not isinstance(base, (int, float)) or base <= 1:
        raise ValueError(f"rope: base (rope_theta) must be a number > 1, got {base!r}")
    return 1.0 / (base ** _exponents(dim, device))


def _need(params: Mapping[str, Any], key: str, rope_type: str) -> Any:
    if params.get(key) is None:
        raise ValueError(f"rope_type {rope_type!r} needs {key!r} in the rope parameters, got keys {sorted(params)}")
    return params[key]


def _factor(params: Mapping[str, Any], rope_type: str, max_pos: int | None) -> float:
    """``factor``, or ``max_position_embeddings / original_max_position_embeddings`` when absent."""
    factor = params.get("factor")
    if factor is None:
        orig = _need(params, "original_max_position_embeddings", rope_type)
        if max_pos is None:
            raise ValueError(f"rope_type {rope_type!r} without 'factor' needs max_position_embeddings")
        factor = max_pos / orig
    return float(factor)


def _extension(params: Mapping[str, Any], rope_type: str, max_pos: int | None) -> tuple[float, float, float | None]:
    """What YaRN and LongRoPE both read: the trained length ``original_max_position_embeddings``,
    the ``factor`` (:func:`_factor`) and ``attention_factor`` (``None``: the method's own default)."""
    orig = float(_need(params, "original_max_position_embeddings", rope_type))
    attn = params.get("attention_factor")
    return orig, _factor(params, rope_type, max_pos), None if attn is None else float(attn)


def _linear(dim: int, base: float, p: Mapping[str, Any], max_pos: int | None, seq_len: int | None,
            device: torch.device | str | None) -> RopeResult:
    return default_inv_freq(dim, base, device) / float(_need(p, "factor", "linear")), 1.0


def _dynamic(dim: int, base: float, p: Mapping[str, Any], max_pos: int | None, seq_len: int | None,
             device: torch.device | str | None) -> RopeResult:
    factor = float(_need(p, "factor", "dynamic"))
    if max_pos is None:
        raise ValueError("rope_type 'dynamic' needs max_position_embeddings")
    n = max_pos if seq_len is None else max(int(seq_len), max_pos)
    grown = base * (factor * n / max_pos - (factor - 1)) ** (dim / (dim - 2))
    return default_inv_freq(dim, grown, device), 1.0


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(dim: int, base: float, p: Mapping[str, Any], max_pos: int | None, seq_len: int | None,
          device: torch.device | str | None) -> RopeResult:
    orig, factor, attn = _extension(p, "yarn", max_pos)
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def dim_turning(turns: float) -> float:  # the dimension whose wavelength fits `turns` times in orig
        return dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = dim_turning(beta_fast), dim_turning(beta_slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - lo) / (hi - lo)).clamp(0, 1)
    inv = default_inv_freq(dim, base, device)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate (low frequencies)
    return (inv / factor) * (1 - keep) + inv * keep, float(attn)


def _llama3(dim: int, base: float, p: Mapping[str, Any], max_pos: int | None, seq_len: int | None,
            device: torch.device | str | None) -> RopeResult:
    factor = float(_need(p, "factor", "llama3"))
    low, high = float(_need(p, "low_freq_factor", "llama3")), float(_need(p, "high_freq_factor", "llama3"))
    orig = float(_need(p, "original_max_position_embeddings", "llama3"))
    inv = default_inv_freq(dim, base, device)
    wavelen = 2 * math.pi / inv
    long_wave = wavelen > orig / low
    short_wave = wavelen < orig / high
    scaled = torch.where(long_wave, inv / factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(~short_wave & ~long_wave, blended, scaled), 1.0


def _longrope(dim: int, base: float, p: Mapping[str, Any], max_pos: int | None, seq_len: int | None,
              device: torch.device | str | None) -> RopeResult:
    orig, factor, attn = _extension(p, "longrope", max_pos)
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    key = "long_factor" if seq_len and seq_len > orig else "short_factor"
    ext = torch.tensor(_need(p, key, "longrope"), dtype=torch.float32, device=device)
    if ext.shape != (dim // 2,):
        raise ValueError(f"longrope: {key} must have dim/2 = {dim // 2} entries, got {tuple(ext.shape)}")
    return 1.0 / (ext * base ** _exponents(dim, device)), float(attn)


def _default(dim: int, base: float, p: Mapping[str, Any], max_pos: int | None, seq_len: int | None,
             device: torch.device | str | None) -> RopeResult:
    return default_inv_freq(dim, base, device), 1.0


#: rope_type -> fn(dim, base, params, max_position_embeddings, seq_len, device) -> (inv_freq, scaling)
ROPE_SCALINGS: dict[str, Callable[..., RopeResult]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
    "longrope": _longrope,
}


def rope_inv_freq(
    rope_parameters: Mapping[str, Any],
    dim: int,
    *,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
    device: torch.device | str | None = None,
) -> RopeResult:
    """Inverse frequencies and attention scaling of one RoPE parameter dict.

    Args:
        rope_parameters: ``rope_type`` (default ``"default"``), ``rope_theta`` (base, default
            10000) and the type's keys (``factor``, ``original_max_position_embeddings``,
            ``attention_factor``, ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``,
            ``truncate``, ``low_freq_factor``, ``high_freq_factor``, ``short_factor``,
            ``long_factor``), named as in transformers. ``type`` is read as ``rope_type``.
        dim: rotated dimensions of a head (``head_dim * partial_rotary_factor``), even.
        max_position_embeddings: the model's ``max_position_embeddings`` (``dynamic``; ``yarn``
            and ``longrope`` without ``factor``).
        seq_len: the sequence length being processed (``dynamic`` grows the base past
            ``max_position_embeddings``; ``longrope`` switches to ``long_factor`` past
            ``original_max_position_embeddings``); None = at initialisation.
        device: where to build the tensor.

    Returns:
        ``(inv_freq [dim // 2] float32, attention_scaling)``: angles are ``pos * inv_freq``
        and cos/sin are multiplied by ``attention_scaling``.

    Raises:
        ValueError / TypeError naming the key: a factor, beta, mscale or longrope entry that is
        not a finite positive number, ``rope_theta`` or ``original_max_position_embeddings``
        not above 1, llama3's ``high_freq_factor <= low_freq_factor``, an unknown ``rope_type``.
    """
    if not isinstance(rope_parameters, Mapping):
        raise TypeError(f"rope_parameters must be a mapping, got {type(rope_parameters).__name__}")
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default")) or "default"
    if rope_type not in ROPE_SCALINGS:
        raise ValueError(f"rope_type must be one of {sorted(ROPE_SCALINGS)}, got {rope_type!r}")
    check_rope_parameters(rope_parameters, rope_type)
    base = float(rope_parameters.get("rope_theta") or 10000.0)
    return ROPE_SCALINGS[rope_type](dim, base, rope_parameters, max_position_embeddings, seq_len, device)


#: rope parameters that must be finite positive numbers when present (``factor = 0`` gives infinite
#: frequencies, a negative YaRN factor a log of a negative number)
_POSITIVE_KEYS = ("factor", "attention_factor", "beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor",
                  "mscale", "mscale_all_dim")


def check_rope_parameters(params: Mapping[str, Any], rope_type: str) -> None:
    """Every number of a rope parameter dict in its range, else ``TypeError`` / ``ValueError`` naming
    the key, the value and the range (one check for :func:`rope_inv_freq`, ``from_hf`` and MLA)."""
    owner = f"rope_type {rope_type!r}"
    for key in _POSITIVE_KEYS:
        if params.get(key) is not None:
            check_positive_float(params[key], key, owner)
    if params.get("rope_theta") is not None:
        check_number_above(params["rope_theta"], "rope_theta", lower=1.0, owner=owner)
    if params.get("original_max_position_embeddings") is not None:  # log(L) divides in longrope
        check_number_above(params["original_max_position_embeddings"], "original_max_position_embeddings", lower=1.0, owner=owner)
    low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
    if rope_type == "llama3" and low is not None and high is not None and not float(high) > float(low):
        raise ValueError(f"{owner}: high_freq_factor must be > low_freq_factor, got {high} <= {low}")
    for key in ("short_factor", "long_factor"):
        values = params.get(key)
        if values is None:
            continue
        if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
            raise TypeError(f"{owner}: {key} must be a list of numbers, got {type(values).__name__}")
        for i, value in enumerate(values):
            check_positive_float(value, f"{key}[{i}]", owner)


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def scaled_inv_freq(config: Any, seq_len: int | None = None,
                    device: torch.device | str | None = None) -> RopeResult:
    """``(inv_freq, attention_scaling)`` of a Hugging Face config (object or ``config.json`` dict).

    Reads ``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta`` (4.x),
    ``head_dim`` (or ``hidden_size // num_attention_heads``), ``partial_rotary_factor`` and
    ``max_position_embeddings``. ``seq_len`` as in :func:`rope_inv_freq`.
    """
    params: dict[str, Any] = dict(_get(config, "rope_parameters") or _get(config, "rope_scaling") or {})
    if params.get("rope_theta") is None and _get(config, "rope_theta") is not None:
        params["rope_theta"] = _get(config, "rope_theta")
    head_dim = _get(config, "head_dim")
    if head_dim is None:
        hidden, heads = _get(config, "hidden_size"), _get(config, "num_attention_heads")
        if hidden is None or heads is None:
            raise ValueError("scaled_inv_freq: the config needs head_dim or hidden_size and num_attention_heads")
        head_dim = check_int(hidden, "hidden_size", owner="scaled_inv_freq") // check_int(
            heads, "num_attention_heads", owner="scaled_inv_freq")
    prf = params.get("partial_rotary_factor", _get(config, "partial_rotary_factor") or 1.0)
    return rope_inv_freq(params, int(head_dim * prf), max_position_embeddings=_get(config, "max_position_embeddings"),
                         seq_len=seq_len, device=device)
