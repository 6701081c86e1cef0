"""The recall / decode-state trade-off of one arena run (the Zoology and Based trade-off figure).

Every variant and hybrid stack of the ``mqar`` task is one point: its MQAR accuracy against its
decode-state bytes for a long sequence (the long-context cost model's cache bytes at the longest
length, times the depth: for a hybrid the sum over its layers). :func:`hybrid_answers` says, for
every hybrid, what its softmax layers buy in recall and cost in decode memory against the stack
made only of its other layers and against full softmax attention. Pure functions of
``results.json``'s contents.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["hybrid_answers", "tradeoff_figure", "tradeoff_points"]


def _human(n: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n / f:.1f} {unit}"
    return f"{n:.0f} B"


def tradeoff_points(results: dict[str, Any]) -> list[dict[str, Any]]:
    """``[{variant, accuracy, state_bytes, n, converged}]`` for every mqar run with a long-context
    curve (``state_bytes``: cache bytes of the whole stack at the curve's longest length ``n``)."""
    lc = results.get("long_context") or {}
    curves, depth = lc.get("curves") or {}, int(lc.get("depth", 1))
    runs = results.get("runs", {}).get("mqar", {})
    out = []
    for v, r in runs.items():
        pts = curves.get(v)
        if not pts:
            continue
        last = max(pts, key=lambda p: p["n"])
        out.append({"variant": v, "accuracy": float(r["final"]["accuracy"]), "n": int(last["n"]),
                    "state_bytes": depth * float(last["cache_bytes"]), "hybrid": "/" in v})
    return out


def tradeoff_figure(plt: Any, results: dict[str, Any], colors: dict[str, Any]) -> Any:
    """MQAR accuracy against decode-state bytes (log scale), hybrids as squares; None without points."""
    pts = tradeoff_points(results)
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for p in pts:
        ax.scatter(p["state_bytes"], p["accuracy"], s=55, marker="s" if p["hybrid"] else "o",
                   color=colors.get(p["variant"], "grey"), edgecolor="black", zorder=3)
        ax.annotate(p["variant"], (p["state_bytes"], p["accuracy"]), fontsize=7, xytext=(4, 3),
                    textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.05)
    ax.set_xlabel(f"decode-state bytes at {pts[0]['n']:,} tokens (whole stack, cost model, float32)")
    ax.set_ylabel("MQAR accuracy")
    ax.set_title("Recall against decode state (squares: hybrid stacks)", fontsize=10)
    ax.grid(alpha=0.3)
    return fig


def hybrid_answers(results: dict[str, Any]) -> list[dict[str, Any]]:
    """For every hybrid of the run: its recall and decode state against the pure stack of its most
    common layer and against each pure variant of its other layers (those that ran), as verdict
    entries (``question``, ``winner``, ``value``, ``text``)."""
    pts = {p["variant"]: p for p in tradeoff_points(results)}
    lc = results.get("long_context") or {}
    out = []
    for v, p in pts.items():
        if not p["hybrid"]:
            continue
        layers = (lc.get("curves", {}).get(v) or [{}])[-1].get("layers") or v.split("/")
        count = Counter(layers)
        base = count.most_common(1)[0][0]
        others = [n for n in count if n != base]
        text = (f"**{v}** ({', '.join(f'{c} of {len(layers)} layers {n}' for n, c in count.items())}): MQAR "
                f"{100 * p['accuracy']:.1f}% with {_human(p['state_bytes'])} of decode state at {p['n']:,} tokens")
        if base in pts:
            b = pts[base]
            text += (f"; against {base} alone ({100 * b['accuracy']:.1f}%, {_human(b['state_bytes'])}) the "
                     f"{', '.join(others)} layer{'s' if sum(count[n] for n in others) > 1 else ''} buy "
                     f"{100 * (p['accuracy'] - b['accuracy']):+.1f} points of recall for "
                     f"{p['state_bytes'] / max(b['state_bytes'], 1):,.1f}x the state")
        for n in others:
            if n in pts:
                o = pts[n]
                text += (f"; against {n} in every layer ({100 * o['accuracy']:.1f}%, {_human(o['state_bytes'])}) it "
                         f"keeps {o['state_bytes'] and p['state_bytes'] / o['state_bytes']:.2f}x the state and "
                         f"{100 * (p['accuracy'] - o['accuracy']):+.1f} points of recall")
        out.append({"question": f"hybrid {v}", "winner": v, "value": p["accuracy"],
                    "state_bytes": p["state_bytes"], "text": text + "."})
    return out
