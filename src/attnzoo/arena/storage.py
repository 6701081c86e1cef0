"""The arena's files: checkpoints and run records written atomically, read back with suspicion.

A run writes ``checkpoints/<task>-<variant>.pt`` while it trains and ``runs/<task>-<variant>.json``
when it is done. Both are written to a temporary file in the same directory and then renamed over
the old one (``os.replace``), so a crash leaves the old file or the new one, never half of one.
On ``--resume`` a file that cannot be read, or does not hold what a run writes, is *damaged*:
:func:`set_aside` renames it (``NAME.damaged``, ``NAME.damaged-2``, ...) so the run is trained
again, and nothing of it is mixed into the new results.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "RECORD_KEYS",
    "DamagedFile",
    "first_line",
    "load_checkpoint",
    "read_checkpoint",
    "read_run_record",
    "save_checkpoint",
    "set_aside",
    "write_atomic",
]

#: Keys every finished run record holds (what the report and ``results.json`` read).
RECORD_KEYS = ("task", "variant", "signature", "params", "train_losses", "evals", "final")
_CHECKPOINT_KEYS = ("model", "optimizer", "step", "extra")


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else "no message"


class DamagedFile(ValueError):
    """A checkpoint or run record that cannot be read or does not hold what the arena writes."""


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int,
                    extra: dict[str, Any]) -> None:
    """Write ``{model, optimizer, step, extra}`` atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "extra": extra}, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (tensors on the CPU, weights only)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """:func:`load_checkpoint` with the structure checked; :class:`DamagedFile` says what is wrong."""
    try:
        state = load_checkpoint(path)
    except Exception as exc:  # torch.load raises many types for truncated or foreign files
        raise DamagedFile(f"cannot be read ({type(exc).__name__}: {first_line(exc)[:120]})") from None
    if not isinstance(state, dict) or any(k not in state for k in _CHECKPOINT_KEYS):
        raise DamagedFile(f"is not an arena checkpoint (expected keys {list(_CHECKPOINT_KEYS)})")
    extra, step = state["extra"], state["step"]
    if not isinstance(extra, dict) or any(k not in extra for k in ("signature", "losses", "evals")):
        raise DamagedFile("has no signature, losses and evals in its 'extra' entry")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise DamagedFile(f"has step {step!r}; expected an int >= 0")
    if not isinstance(extra["losses"], list) or len(extra["losses"]) != step:
        raise DamagedFile(f"holds {len(extra['losses']) if isinstance(extra['losses'], list) else 'no'} "
                          f"losses for {step} steps")
    if not isinstance(extra["evals"], list) or not all(isinstance(e, dict) and "step" in e for e in extra["evals"]):
        raise DamagedFile("has evaluations without their step")
    if not isinstance(state["model"], dict) or not isinstance(state["optimizer"], dict):
        raise DamagedFile("has no model or optimizer state")
    return state


def read_run_record(path: Path) -> dict[str, Any]:
    """A finished run's record (``runs/*.json``); :class:`DamagedFile` when truncated or incomplete."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DamagedFile(f"cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise DamagedFile(f"holds a JSON {type(data).__name__}, not a run record")
    missing = [k for k in RECORD_KEYS if k not in data]
    if missing:
        raise DamagedFile(f"lacks the result keys {missing}")
    if not isinstance(data["evals"], list) or not data["evals"] or not isinstance(data["final"], dict):
        raise DamagedFile("has no evaluations or final metrics")
    return data


def set_aside(path: Path) -> Path:
    """Rename a damaged ``path`` to ``NAME.damaged`` (``-2``, ``-3``... if taken); returns the new path."""
    target = path.with_name(path.name + ".damaged")
    n = 2
    while target.exists():
        target = path.with_name(f"{path.name}.damaged-{n}")
        n += 1
    os.replace(path, target)
    return target
