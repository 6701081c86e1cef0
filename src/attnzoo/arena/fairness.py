"""Fair budgets for the arena's runs: early stopping, adaptive steps up to a cap, a learning-rate sweep.

A fixed budget compares how fast variants learn, not what they can do: at the old default MQA had
reached 45% MQAR, still rising, while GQA was at 99.9%. So an ``mqar`` run schedules its cosine
over ``max_steps`` (the cap) and stops at an evaluation once

- it is solved (accuracy >= :data:`~attnzoo.arena.verdict.SOLVED`, the papers' 0.99), or
- it has trained its nominal ``steps`` and has converged (no rise of more than
  :data:`~attnzoo.arena.verdict.RISING` over the last three evaluations: a plateau), unless it is
  exact attention over every token (its plateau is 100%: it trains on to the cap);

a run still rising goes on up to the cap, and the report says by how much it was still rising
there (:func:`plateau_lines`). ``--lr-sweep`` trains every ``mqar`` variant at
:data:`LR_SWEEP` peak learning rates and keeps the best (recurrent models learn MQAR only in a
narrow learning-rate window; Zoology sweeps four per cell).
"""

from __future__ import annotations

from typing import Any

from attnzoo.arena.grid import sees_every_token
from attnzoo.arena.verdict import RISING, SOLVED, mqar_converged

__all__ = ["LR_SWEEP", "StopRun", "best_lr_record", "plateau_lines", "should_stop", "sweep_lrs"]

#: Peak learning rates of ``--lr-sweep`` (a factor ~3 apart, from the ``mqar`` default 1e-3 up).
LR_SWEEP = (1e-3, 3e-3, 1e-2)


class StopRun(Exception):
    """Raised from a training callback to end a run early (caught by the arena's run)."""


def should_stop(evals: list[dict[str, Any]], step: int, nominal: int, cap: int, exact: bool = False) -> bool:
    """Whether an ``mqar`` run may stop after the evaluation at ``step``: solved, or past its
    ``nominal`` steps and converged (a plateau over the last three evaluations). Never before the
    cap when ``nominal >= cap`` except when solved. ``exact``: the variant sees every earlier token
    (its plateau is 100%), so only solving it stops the run before the cap."""
    accs = [e["accuracy"] for e in evals if "accuracy" in e]
    if not accs:
        return False
    if accs[-1] >= SOLVED:
        return True
    return not exact and nominal < cap and step >= nominal and mqar_converged(evals) is True


def sweep_lrs(base: float) -> tuple[float, ...]:
    """The learning rates of ``--lr-sweep``: :data:`LR_SWEEP` (``base`` added when not in it), sorted."""
    return tuple(sorted({*LR_SWEEP, float(base)}))


def best_lr_record(records: dict[float, dict[str, Any]]) -> dict[str, Any]:
    """The record with the best final accuracy (ties: the smaller learning rate), with
    ``lr_sweep`` (``{lr: accuracy}``) and ``best_lr`` added."""
    lrs = sorted(records)
    best = max(lrs, key=lambda lr: records[lr]["final"]["accuracy"])
    return {**records[best], "best_lr": best,
            "lr_sweep": {f"{lr:g}": records[lr]["final"]["accuracy"] for lr in lrs}}


def _rise(evals: list[dict[str, Any]], key: str, window: int = 3) -> float | None:
    vals = [float(e[key]) for e in evals if key in e]
    if len(vals) < 2:
        return None
    tail = vals[-window:]
    return tail[-1] - tail[0]


def plateau_lines(results: dict[str, Any]) -> list[str]:
    """One bullet per run that did not reach its plateau, saying by how much it was still moving
    over its last evaluations (``mqar``: accuracy points; ``lm``: nats of validation loss); a
    closing line when every ``mqar`` run converged or was solved."""
    out = []
    for v, r in results.get("runs", {}).get("mqar", {}).items():
        evals = r.get("evals", [])
        rise = _rise(evals, "accuracy")
        if mqar_converged(evals) is False and rise is not None:
            out.append(f"- mqar/{v}: still rising at its last step ({evals[-1]['step']}): "
                       f"{100 * rise:+.1f} points over the last evaluations (a lower bound of its plateau)")
    mq = results.get("runs", {}).get("mqar", {})
    s = (results.get("settings") or {}).get("mqar")
    for v, r in mq.items():  # exact attention over every token can recall every pair: its plateau is 100%
        acc = float(r["final"]["accuracy"])
        if s and acc < SOLVED and sees_every_token(v, s["width"], s["heads"], s["seq_len"], s["window"] or s["seq_len"]):
            out.append(f"- mqar/{v}: {100 * acc:.1f}% at step {r['evals'][-1]['step']}, "
                       f"{100 * (1 - acc):.1f} points below its plateau (every query sees every pair, so 100% is "
                       f"reachable: a smaller peak learning rate (--lr-sweep) or a larger batch gets there, see "
                       f"docs/arena.md); the budget, not the mechanism, set this number")
    if mq and not out:
        out.append(f"- mqar: every variant was solved (>= {100 * SOLVED:.0f}%) or flat within {100 * RISING:.0f} "
                   f"points over its last three evaluations (its plateau at this width)")
    for v, r in results.get("runs", {}).get("lm", {}).items():
        evals = r.get("evals", [])
        drop = _rise(evals, "val_loss", window=2)
        if drop is not None and drop < -0.01:
            out.append(f"- lm/{v}: validation loss still falling ({drop:+.3f} nats over the last evaluation "
                       f"interval, ending at step {evals[-1]['step']}): not at its plateau")
    return out
