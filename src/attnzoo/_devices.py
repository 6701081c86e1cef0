"""Device argument validation shared by the measuring tools (``check``, ``bench``)."""

from __future__ import annotations

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
