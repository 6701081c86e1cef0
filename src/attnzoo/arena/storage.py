"""The arena's files: checkpoints and run records written atomically, read back with suspicion.

A run writes ``checkpoints/<task>-<variant>.pt`` while it trains and ``runs/<task>-<variant>.json``
when it is done. Both are written to a temporary file in the same directory and then renamed over
the old one (``os.replace``), so a crash leaves the old file or the new one, never half of one.
On ``--resume`` a file that cannot be read, or does not hold what a run writes, is *damaged*:
:func:`set_aside` renames it (``NAME.damaged``, ``NAME.damaged-2``, ...) so the run is trained
again, and nothing of it is mixed into the new results. What a run writes is checked, not only
its structure: losses and metrics are numbers, one loss a step, evaluations in step order ending
at the last step, the record's ``final`` equal to its last evaluation, and no NaN/inf in weights,
optimizer state or metrics unless the training losses themselves went non-finite (a run that
diverged, which training again would repeat).
"""

from __future__ import annotations

import json
import math
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


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _same_number(a: object, b: object) -> bool:
    """Equal numbers, NaN equal to NaN (a diverged run's metrics)."""
    if not (_is_number(a) and _is_number(b)):
        return False
    return a == b or (math.isnan(float(a)) and math.isnan(float(b)))  # type: ignore[arg-type]


def _check_curve(losses: object, evals: object, steps: int) -> bool:
    """The training curve a run writes: ``steps`` numeric losses and evaluations (numeric metrics,
    steps increasing up to ``steps``); returns whether the losses went non-finite (diverged).
    :class:`DamagedFile` otherwise, and for a non-finite metric of a run whose losses are finite."""
    if not isinstance(losses, list) or not all(_is_number(x) for x in losses):
        kinds = sorted({type(x).__name__ for x in losses}) if isinstance(losses, list) else type(losses).__name__
        raise DamagedFile(f"has training losses that are not a list of numbers ({kinds})")
    if len(losses) != steps:
        raise DamagedFile(f"holds {len(losses)} training losses for {steps} steps")
    if not isinstance(evals, list) or not all(isinstance(e, dict) for e in evals):
        raise DamagedFile("has evaluations that are not a list of objects")
    marks = [e.get("step") for e in evals]
    if any(isinstance(m, bool) or not isinstance(m, int) for m in marks) or marks != sorted(set(marks)) \
            or (marks and not 0 <= marks[0] <= marks[-1] <= steps):
        raise DamagedFile(f"has evaluations at steps {marks}; expected increasing ints in 0..{steps}")
    bad = [f"{k}={v!r}" for e in evals for k, v in e.items() if k != "step" and not _is_number(v)]
    if bad:
        raise DamagedFile(f"has evaluation metrics that are not numbers ({', '.join(bad[:3])})")
    diverged = not all(math.isfinite(x) for x in losses)
    nonfinite = [f"{k} at step {e['step']}" for e in evals for k, v in e.items()
                 if k != "step" and not math.isfinite(v)]
    if nonfinite and not diverged:
        raise DamagedFile(f"has non-finite metrics ({', '.join(nonfinite[:3])}) although every training loss is finite")
    return diverged


def _nonfinite_tensor(tree: object, prefix: str = "") -> str | None:
    """The name of the first floating tensor holding NaN/inf in a (nested) state dict, else None."""
    if isinstance(tree, torch.Tensor):
        bad = tree.is_floating_point() and not bool(torch.isfinite(tree).all())
        return (prefix or "tensor") if bad else None
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for key, value in items:
        found = _nonfinite_tensor(value, f"{prefix}.{key}" if prefix else str(key))
        if found is not None:
            return found
    return None


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
    diverged = _check_curve(extra["losses"], extra["evals"], step)
    if not isinstance(state["model"], dict) or not isinstance(state["optimizer"], dict):
        raise DamagedFile("has no model or optimizer state")
    for part in ("model", "optimizer"):
        bad = None if diverged else _nonfinite_tensor(state[part])
        if bad is not None:
            raise DamagedFile(f"has non-finite values (NaN/inf) in {part} {bad} although every training loss "
                              f"is finite")
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
    sig = data["signature"]
    steps = sig.get("steps") if isinstance(sig, dict) else None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise DamagedFile(f"has no step count in its signature (got {steps!r})")
    _check_curve(data["train_losses"], data["evals"], steps)
    last = {k: v for k, v in data["evals"][-1].items() if k != "step"}
    if data["evals"][-1]["step"] != steps:
        raise DamagedFile(f"ends its evaluations at step {data['evals'][-1]['step']}, not at the last step {steps}")
    if set(last) != set(data["final"]) or not all(_same_number(data["final"][k], v) for k, v in last.items()):
        raise DamagedFile(f"has final metrics {data['final']} that are not its last evaluation {last}")
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
