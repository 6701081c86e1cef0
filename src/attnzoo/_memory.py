"""How much memory is free: the size guards of ``attnzoo bench`` and ``attnzoo viz`` read it."""

from __future__ import annotations

import os

import torch

__all__ = ["available_memory_bytes", "format_bytes", "refuse_if_too_big"]


def available_memory_bytes(device: torch.device | str = "cpu") -> int | None:
    """Bytes that can still be allocated on ``device``, or ``None`` when it cannot be told.

    CPU: ``MemAvailable`` of ``/proc/meminfo`` (Linux), else free pages from ``os.sysconf``.
    CUDA: the free bytes of ``torch.cuda.mem_get_info``.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at or above 1 (``"3.2 GiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


def refuse_if_too_big(needed: float, what: str, device: torch.device | str = "cpu") -> None:
    """``ValueError`` when ``needed`` bytes (an estimate for ``what``) exceed the free memory."""
    free = available_memory_bytes(device)
    if free is not None and needed > free:
        raise ValueError(f"{what} needs about {format_bytes(needed)} of memory but only {format_bytes(free)} "
                         f"is available on {torch.device(device)}; use smaller sizes")
