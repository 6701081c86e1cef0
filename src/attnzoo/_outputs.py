"""Output paths of the tools (``bench --out``, ``check --json``, ``viz --png``, ``arena --out``),
checked before any work starts so that a bad path costs nothing."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["ensure_output_dir", "ensure_output_file"]


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _probe_dir(p: Path, what: str, target: Path) -> None:
    """Prove that directories can be made below ``p`` (the nearest existing ancestor of ``target``)."""
    if not p.is_dir():
        raise ValueError(f"{what} {str(target)!r} cannot be written: {str(p)!r} is not a directory")
    try:
        tempfile.TemporaryDirectory(prefix=".attnzoo-write-test-", dir=p).cleanup()
    except OSError as exc:
        raise ValueError(f"{what} {str(target)!r} cannot be written: {_reason(exc)}") from None


def _nearest_existing(p: Path) -> Path:
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def ensure_output_dir(path: str | os.PathLike[str], what: str) -> Path:
    """Prove that directory ``path`` exists and is writable, or can be created; ``ValueError`` naming
    ``what`` if not. Nothing is left behind: a missing directory is created by whoever writes into it."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is an existing file, not a directory")
    _probe_dir(_nearest_existing(p), what, p)
    return p


def ensure_output_file(path: str | os.PathLike[str], what: str) -> Path:
    """Prove that file ``path`` can be written (an existing file is left as it is, a missing one is
    not created); ``ValueError`` naming ``what`` if not. Its directory may be missing: the writer
    creates it."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is a directory, not a file")
    if not p.parent.is_dir():
        _probe_dir(_nearest_existing(p.parent), what, p)
        return p
    existed = p.exists()
    try:
        with p.open("a"):
            pass
        if not existed:
            p.unlink()
    except OSError as exc:
        raise ValueError(f"{what} {str(p)!r} cannot be written: {_reason(exc)}") from None
    return p
