"""The arena's verdict: which variant wins what, by how much, computed from one run's numbers.

:func:`verdict` is a pure function of the results dictionary (``results.json``): no variant is
known by name except the baseline ``mha`` that ratios are quoted against when present. It answers
four questions:

- **recall** (MQAR accuracy): the best variant and its margin over the runner-up; runs that had
  not converged are named, since their number is a lower bound of what the mechanism can do;
- **long-context decode memory** (cost functions: cache bytes per layer x depth at the longest
  length): the smallest cache and its factor against the baseline, with its recall next to it;
- **training throughput** (the measurement pass): the fastest and its factor over the runner-up,
  flagged when the machine was busy;
- **quality per parameter** (lm validation loss, mean over seeds where several ran): the best loss
  and its margin, called a tie when the margin is within the seed spread, and the smallest model
  within that spread of the best.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from attnzoo.arena.tradeoff import hybrid_answers

__all__ = ["BASELINE", "lm_seed_stats", "mqar_converged", "verdict"]

BASELINE = "mha"
#: MQAR accuracy at or above this counts as solved (nothing left to rise).
SOLVED = 0.99
#: A rise of more than this over the last evaluations means "still learning" (held-out accuracy
#: wobbles by a point or two on a plateau).
RISING = 0.02
#: Accuracies this close count as a tie.
TIE = 0.01


def mqar_converged(evals: list[dict[str, Any]], window: int = 3) -> bool | None:
    """Whether an MQAR run's accuracy had stopped rising: solved, or no rise of more than 2 points
    over the last ``window`` evaluations. None when there are fewer than ``window`` evaluations."""
    accs = [float(e["accuracy"]) for e in evals if "accuracy" in e]
    if accs and accs[-1] >= SOLVED:
        return True
    if len(accs) < window:
        return None
    tail = accs[-window:]
    return tail[-1] - tail[0] <= RISING


def lm_seed_stats(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per variant: ``{"mean", "std", "n"}`` of the lm validation loss over the seeds that ran
    (``std`` 0 with one seed)."""
    lm = results.get("runs", {}).get("lm", {})
    finals = results.get("seed_runs", {}).get("finals", {})
    out = {}
    for v, r in lm.items():
        losses = [float(f["val_loss"]) for f in finals.get(v, [r["final"]])]
        out[v] = {"mean": statistics.fmean(losses), "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                  "n": float(len(losses))}
    return out


def _ranked(values: dict[str, float], reverse: bool) -> list[tuple[str, float]]:
    finite = [(v, x) for v, x in values.items() if x is not None and math.isfinite(x)]
    return sorted(finite, key=lambda t: t[1], reverse=reverse)


def _human_bytes(n: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n / f:.1f} {unit}"
    return f"{n:.0f} B"


#: What the reproduction of Zoology's Figure 2 found at its reduced budget (docs/arena.md, *Paper presets*,
#: measured 2026-12-06 with ``attnzoo arena --preset zoology-fig2 --jobs 2``); the recall verdict cites it.
REPRODUCTION = ("(docs/arena.md, *Paper presets*: at its reduced budget gated DeltaNet passed 99% at all four points, "
                "widths 64 and 128 on 64 and 128 tokens; attention, at 97% everywhere in the paper, reached 97.5% at "
                "width 128 on 128 tokens and 85% at width 64 on 64 tokens, and had only begun to leave its plateau at "
                "the other two (44%, 12%) when its 3,000 steps ended: at a CPU budget the figure ranks how fast the "
                "mixers learn MQAR as much as what they can recall)")


def _recall(results: dict[str, Any]) -> dict[str, Any] | None:
    runs = results.get("runs", {}).get("mqar", {})
    ranked = _ranked({v: r["final"].get("accuracy") for v, r in runs.items()}, reverse=True)
    if not ranked:
        return None
    (win, acc), rest = ranked[0], ranked[1:]
    ties = [v for v, a in rest if acc - a <= TIE]
    unconverged = [v for v, r in runs.items() if mqar_converged(r.get("evals", [])) is False]
    text = f"**{win}** recalls best ({100 * acc:.1f}%)"
    if ties:
        text += f", tied within 1 point with {', '.join(ties)}"
    elif rest:
        text += f", {100 * (acc - rest[0][1]):.1f} points ahead of {rest[0][0]} ({100 * rest[0][1]:.1f}%)"
    text += "."
    if unconverged:
        text += (f" Not converged (accuracy still rising at the last evaluations, so a lower bound): "
                 f"{', '.join(unconverged)}.")
    text += (" This is a 64-token vocabulary at a CPU budget; the papers' setting (vocabulary 8,192, best of "
             "learning rates, early stop at 0.99) is `attnzoo arena --preset zoology-fig2` " + REPRODUCTION + ".")
    return {"question": "recall (MQAR)", "winner": win, "value": acc, "ties": ties,
            "runner_up": rest[0][0] if rest else None, "margin": acc - rest[0][1] if rest else None,
            "not_converged": unconverged, "text": text}


def _decode_memory(results: dict[str, Any]) -> dict[str, Any] | None:
    lc = results.get("long_context") or {}
    curves = lc.get("curves") or {}
    if not curves:
        return None
    depth = int(lc.get("depth", 1))
    n = max(p["n"] for pts in curves.values() for p in pts)
    at_n = {v: depth * next(p["cache_bytes"] for p in pts if p["n"] == n) for v, pts in curves.items()
            if any(p["n"] == n for p in pts)}
    ranked = _ranked(at_n, reverse=False)
    win, b = ranked[0]
    acc = {v: r["final"].get("accuracy") for v, r in results.get("runs", {}).get("mqar", {}).items()}
    text = f"At {n:,} tokens **{win}** keeps the smallest decode cache ({_human_bytes(b)} for {depth} layer{'s' if depth != 1 else ''})"
    if BASELINE in at_n and win != BASELINE:
        text += f", {at_n[BASELINE] / max(b, 1):,.0f}x less than {BASELINE} ({_human_bytes(at_n[BASELINE])})"
    if acc.get(win) is not None:
        text += f"; its MQAR recall here was {100 * acc[win]:.1f}%"
        if acc.get(BASELINE) is not None and win != BASELINE:
            text += f" against {100 * acc[BASELINE]:.1f}% for {BASELINE}"
    text += " (cost model: bytes of the cache, float32)."
    return {"question": "long-context decode memory", "winner": win, "value": b, "n": n, "bytes": at_n,
            "ratio_vs_baseline": at_n[BASELINE] / max(b, 1) if BASELINE in at_n else None, "text": text}


def _throughput(results: dict[str, Any]) -> dict[str, Any] | None:
    m = results.get("measurements") or {}
    tps = {v: r.get("train_tokens_per_s") for v, r in (m.get("variants") or {}).items()}
    ranked = _ranked(tps, reverse=True)
    if not ranked:
        return None
    (win, x), rest = ranked[0], ranked[1:]
    text = f"**{win}** trains fastest ({x:,.0f} tokens/s"
    text += f", {x / rest[0][1]:.2f}x {rest[0][0]})" if rest else ")"
    if BASELINE in tps and win != BASELINE and tps[BASELINE]:
        text += f" and {x / tps[BASELINE]:.2f}x {BASELINE}"
    text += " at the arena's training length."
    if m.get("busy"):
        text += f" The machine was busy during the measurement ({m.get('why')}): re-run on a quiet machine."
    return {"question": "training throughput", "winner": win, "value": x,
            "factor": x / rest[0][1] if rest else None, "busy": bool(m.get("busy")), "text": text}


def _quality(results: dict[str, Any]) -> dict[str, Any] | None:
    lm = results.get("runs", {}).get("lm", {})
    if not lm:
        return None
    stats = lm_seed_stats(results)
    ranked = _ranked({v: s["mean"] for v, s in stats.items()}, reverse=False)
    (win, loss), rest = ranked[0], ranked[1:]
    multi = [s["std"] for s in stats.values() if s["n"] > 1]
    noise = max(multi) if multi else None
    tied = [v for v, x in rest if noise is not None and x - loss <= 2 * noise]
    params = {v: r.get("params") for v, r in lm.items()}
    text = f"**{win}** reaches the lowest lm validation loss ({loss:.3f}"
    text += f" ± {stats[win]['std']:.3f} over {int(stats[win]['n'])} seeds)" if stats[win]["n"] > 1 else ")"
    if rest and rest[0][1] - loss < 0.0005:
        text += f", level with {rest[0][0]} ({rest[0][1]:.3f})"
    elif rest:
        text += f", {rest[0][1] - loss:.3f} nats ahead of {rest[0][0]}"
    if noise is None:
        text += "; one seed only, so the seed noise is unknown."
    else:
        text += (f"; seed spread (std) up to {noise:.3f} nats, so "
                 + (f"{', '.join(tied)} {'is' if len(tied) == 1 else 'are'} within noise of it" if tied
                    else "the lead is larger than the noise") + ".")
    pool = [win, *tied]
    smallest = min(pool, key=lambda v: params.get(v) or math.inf)
    if smallest != win and params.get(smallest):
        text += (f" Per parameter, **{smallest}** ({params[smallest]:,} parameters against "
                 f"{params[win]:,}) is the better buy.")
    return {"question": "quality per parameter", "winner": win, "value": loss, "noise": noise, "ties": tied,
            "smallest_within_noise": smallest, "text": text}


def verdict(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The verdict of one arena run: a list of answers, each ``{"question", "winner", "value",
    "text", ...}`` (questions without data are left out). See the module docstring."""
    found = (_recall(results), _decode_memory(results), _throughput(results), _quality(results))
    return [v for v in found if v is not None] + hybrid_answers(results)
