"""Device and dtype helpers: device argument validation shared by the measuring tools (``check``,
``bench``), the one ``is_compiling`` question, and buffers and parameters kept in float32 through half casts."""

from __future__ import annotations

from typing import Any

import torch


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``; ``ValueError`` for a malformed name or CUDA without CUDA."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch.cuda.is_available() is False")
    return dev


def tracing() -> bool:
    """Whether the code runs inside a graph being compiled (``torch.compile`` / ``torch.export``).

    The one place attnzoo asks: eager code may read tensor values (a check that syncs, a plan built
    from a mask's data, a timed choice); a traced graph decides from shapes only.
    """
    return torch.compiler.is_compiling()


def restore_float32(module: torch.nn.Module, name: str, before: torch.Tensor | None) -> None:
    """After ``module._apply`` (``.to``, ``.half()``, ...): a buffer that must stay float32 (or
    float64) and was just cast to 16 bits is put back from its value ``before`` the cast, on the
    new device, in float32. Nothing changes for moves that keep the dtype or on the meta device."""
    now = getattr(module, name)
    if (before is None or now is None or now.dtype not in (torch.float16, torch.bfloat16)
            or before.dtype not in (torch.float32, torch.float64) or before.device.type == "meta"):
        return
    setattr(module, name, before.to(device=now.device, dtype=torch.float32))


def float32_snapshot(module: torch.nn.Module, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The data of ``module``'s parameters ``names`` (dotted paths: ``"q_conv.weight"``), taken just
    before ``module._apply``, for :func:`restore_float32_params` to put back after it."""
    return {name: module.get_parameter(name).data for name in names}


def restore_float32_params(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    """After ``module._apply`` (``.to``, ``.half()``, ...): each parameter of ``before`` (from
    :func:`float32_snapshot`) that was float32 (or float64) and was just cast to 16 bits gets its
    value ``before`` the cast back, on the new device, in float32 (the same ``nn.Parameter``,
    its ``.grad`` widened too). Nothing changes for moves that keep the dtype or on the meta device."""
    for name, old in before.items():
        now = module.get_parameter(name)
        if (now.dtype not in (torch.float16, torch.bfloat16) or old.dtype not in (torch.float32, torch.float64)
                or old.device.type == "meta"):
            continue
        now.data = old.to(device=now.device, dtype=torch.float32)
        if now.grad is not None:
            now.grad = now.grad.float()


#: device types torch.autocast knows (asking about another, e.g. "meta", raises inside torch)
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla")


def cache_dtype(param: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of a decode cache: ``dtype`` when given, else what the keys will be: the autocast
    dtype when ``torch.autocast`` is on for the parameters' device type and they are float32 (its
    matmuls then return that dtype), else the parameters' dtype."""
    if dtype is not None:
        return dtype
    kind = param.device.type
    if param.dtype == torch.float32 and kind in _AUTOCAST_DEVICES and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return param.dtype


class KeepsFloat32:
    """A module mixin (``class M(KeepsFloat32, nn.Module)``): the parameters named in
    ``float32_params`` (dotted paths) stay float32 through half-precision casts (``.half()``,
    ``.to(torch.bfloat16)``, ``from_hf(dtype=)``), as transformers' ``_keep_in_fp32_modules``;
    other moves (device, float64) apply as usual."""

    float32_params: tuple[str, ...] = ()

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        kept = float32_snapshot(self, self.float32_params)  # type: ignore[arg-type]
        super()._apply(fn, recurse)  # type: ignore[misc]
        restore_float32_params(self, kept)  # type: ignore[arg-type]
        return self
