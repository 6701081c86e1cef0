"""Output paths of the tools (``bench --out``, ``check --json``, ``viz --png``, ``arena --out``),
checked before any work starts so that a bad path costs nothing."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["ensure_output_dir", "ensure_output_file"]


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def ensure_output_dir(path: str | os.PathLike[str], what: str) -> Path:
    """Create directory ``path`` (with parents) and prove it writable; ``ValueError`` naming ``what`` if not."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is an existing file, not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".attnzoo-write-test-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"{what} {str(p)!r} cannot be written: {_reason(exc)}") from None
    return p


def ensure_output_file(path: str | os.PathLike[str], what: str) -> Path:
    """Prove that file ``path`` can be written (its directory is created); ``ValueError`` naming ``what`` if not.

    An existing file is left as it is; a file created by the probe is removed again.
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is a directory, not a file")
    existed = p.exists()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with p.open("a"):
            pass
        if not existed:
            p.unlink()
    except OSError as exc:
        raise ValueError(f"{what} {str(p)!r} cannot be written: {_reason(exc)}") from None
    return p
