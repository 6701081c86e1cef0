"""The report of a paper preset: our points beside the paper's, a figure drawn like the paper's,
and where the two agree (``preset.json``, ``figure.png``, ``report.md`` in ``--out``).

Zoology's Figure 2 is accuracy against model width, one panel per sequence length, one line per
mixer; Based's is accuracy against recurrent state size (bytes, log scale), one colour per mixer.
The published points are :data:`attnzoo.arena.presets.PUBLISHED` (read off the figures).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

from attnzoo.arena.presets import PAPER_COUNTERPART, PUBLISHED, Preset
from attnzoo.arena.storage import write_atomic

__all__ = ["AGREE", "compare_to_paper", "write_preset_report"]

#: Our best-of-learning-rates accuracy within this of the paper's counts as agreement.
AGREE = 0.05


def _interp(points: list[tuple[float, float]], x: float) -> float | None:
    """The paper's accuracy at ``x`` (log2 bytes) by linear interpolation of its sorted points;
    None outside their range (no extrapolation)."""
    pts = sorted(points)
    if not pts or x < pts[0][0] - 0.25 or x > pts[-1][0] + 0.25:
        return None
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def compare_to_paper(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per our point that has a published counterpart: ``variant``, ``paper`` (the line),
    where (``seq_len``/``width`` or ``log2_bytes``), ``ours``, ``theirs``, ``diff`` and ``agree``
    (``|diff| <= AGREE``)."""
    name = result["preset"]
    pub, counter = PUBLISHED.get(name, {}), PAPER_COUNTERPART.get(name, {})
    rows = []
    for pt in result["points"]:
        line = counter.get(pt["variant"])
        if line is None or line not in pub:
            continue
        if name == "zoology-fig2":
            n = int(pt["train"].split("/")[0])
            widths = list(pub["widths"])
            if n not in pub[line] or pt["width"] not in widths:
                continue
            theirs = pub[line][n][widths.index(pt["width"])]
            where = f"seq_len {n}, width {pt['width']}"
        else:
            x = math.log2(max(1, pt["state_bytes"]))
            theirs = _interp(pub[line], x)
            if theirs is None:
                continue
            where = f"2^{x:.1f} bytes (width {pt['width']}" + (f", window {pt['window']})" if pt["window"] else ")")
        diff = pt["accuracy"] - theirs
        rows.append({"variant": pt["variant"], "paper": line, "where": where, "ours": pt["accuracy"],
                     "theirs": theirs, "diff": diff, "agree": abs(diff) <= AGREE})
    return rows


def _figure(result: dict[str, Any], p: Preset, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    pub = PUBLISHED.get(p.name, {})
    points = result["points"]
    variants = list(dict.fromkeys(pt["variant"] for pt in points))
    cmap = plt.get_cmap("tab10")
    if p.name == "zoology-fig2":
        lens = sorted({int(pt["train"].split("/")[0]) for pt in points})
        fig, axes = plt.subplots(1, len(lens), figsize=(max(4.0 * len(lens), 6.4), 4.0), dpi=110, squeeze=False)
        for ax, n in zip(axes[0], lens, strict=True):
            for j, (line, by_len) in enumerate((k, v) for k, v in pub.items() if k != "widths"):
                if n in by_len:
                    ax.plot(pub["widths"], by_len[n], ls="--", lw=1, color=cmap((j + 5) % 10), alpha=0.7,
                            label=f"paper: {line}")
            for i, v in enumerate(variants):
                pts = sorted((pt for pt in points if pt["variant"] == v and int(pt["train"].split("/")[0]) == n),
                             key=lambda pt: pt["width"])
                if pts:
                    ax.plot([pt["width"] for pt in pts], [pt["accuracy"] for pt in pts], marker="o", lw=2,
                            color=cmap(i % 10), label=f"ours: {v}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(set(pub.get("widths", ())) | {pt["width"] for pt in points}))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_ylim(-0.02, 1.02)
            ax.set_title(f"Sequence length {n}", fontsize=10)
            ax.set_xlabel("model dimension")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("MQAR accuracy (best of learning rates)")
        axes[0][-1].legend(fontsize=6, loc="lower right")
    else:
        fig, ax0 = plt.subplots(figsize=(6.4, 4.4), dpi=110)
        for j, (line, pts) in enumerate(pub.items()):
            ax0.scatter([2 ** x for x, _ in pts], [y for _, y in pts], marker="x", s=18, color=cmap((j + 5) % 10),
                        alpha=0.6, label=f"paper: {line}")
        for i, v in enumerate(variants):
            pts = [pt for pt in points if pt["variant"] == v]
            ax0.scatter([pt["state_bytes"] for pt in pts], [pt["accuracy"] for pt in pts], s=40, color=cmap(i % 10),
                        edgecolor="black", label=f"ours: {v}")
        ax0.set_xscale("log", base=2)
        ax0.set_ylim(-0.02, 1.02)
        ax0.set_xlabel("decode state after one test sequence (bytes)")
        ax0.set_ylabel("MQAR accuracy (best of learning rates)")
        ax0.grid(alpha=0.3)
        ax0.legend(fontsize=6, ncol=2)
        axes = [[ax0]]
    fig.suptitle(f"{p.paper}\nours ({result['size']} budget, solid) and the paper's points (dashed / x)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _budget_lines(p: Preset, result: dict[str, Any]) -> list[str]:
    train = ", ".join(f"{c.seq_len} tokens / {c.pairs} pairs x {c.examples:,}" for c in p.train)
    test = ", ".join(f"{c.seq_len}/{c.pairs} x {c.examples:,}" for c in p.test)
    lines = [f"- Budget: **{result['size']}**" + (" (the paper's settings)" if p.size == "full" else
                                                    " (reduced from the paper's; see below)"),
             f"- Training data: {train}" + (" (one mixture for every model)" if p.mixture else " (one model per length)"),
             f"- Test data: {test}; vocabulary {p.vocab:,}; query gaps power law a = {p.power_a}; "
             f"random non-query tokens: {p.random_non_queries}",
             f"- Models: {p.depth} layers, {p.heads} head(s), no MLP, widths {list(p.widths)}; batch "
             f"{dict(p.batch)}; AdamW weight decay {p.weight_decay}, cosine over {p.max_epochs} epochs; learning "
             f"rates {[float(f'{x:.3g}') for x in p.lrs]} (best of, per point; tried from the largest down, the "
             f"rest skipped once one passes the threshold); early stop once the test accuracy exceeds {p.threshold}",
             f"- Settings from `{p.source}`; {len(result['runs'])} runs, {result['wall_s']:.0f} s wall on "
             f"{result['jobs']} worker(s) ({result['reused']} reused with --resume, "
             f"{len(result.get('skipped', []))} skipped after a larger learning rate passed {p.threshold})"]
    if p.notes:
        lines.append("- Deviations from the paper: " + "; ".join(p.notes) + ".")
    return lines


def _agreement_text(rows: list[dict[str, Any]], result: dict[str, Any]) -> list[str]:
    if not rows:
        return ["No point of ours has a published counterpart at this budget."]
    agree = [r for r in rows if r["agree"]]
    text = [f"{len(agree)} of {len(rows)} comparable points agree with the paper within {100 * AGREE:.0f} points."]
    for r in rows:
        verb = "agrees" if r["agree"] else ("above" if r["diff"] > 0 else "below")
        text.append(f"- {r['variant']} vs paper {r['paper']} at {r['where']}: ours {100 * r['ours']:.1f}%, paper "
                    f"{100 * r['theirs']:.0f}% ({verb}, {100 * r['diff']:+.1f} points)")
    return text


def _trend_text(result: dict[str, Any]) -> list[str]:
    """Zoology's claims, checked on our fixed-state points: recall rises with width and falls with length."""
    pts = [pt for pt in result["points"] if "/" in pt["train"]]
    out = []
    for v in sorted({pt["variant"] for pt in pts}):
        mine = {(int(pt["train"].split("/")[0]), pt["width"]): pt["accuracy"] for pt in pts if pt["variant"] == v}
        widths = sorted({w for _, w in mine})
        lens = sorted(n for n in {n for n, _ in mine} if (n, widths[0]) in mine and (n, widths[-1]) in mine)
        if len(widths) > 1 and lens:
            rises = all(mine.get((n, widths[-1]), 0) >= mine.get((n, widths[0]), 0) - 0.02 for n in lens)
            out.append(f"- {v}: width {widths[0]} -> {widths[-1]}: " + ", ".join(
                f"{100 * mine.get((n, widths[0]), float('nan')):.0f}% -> {100 * mine.get((n, widths[-1]), float('nan')):.0f}%"
                f" at {n} tokens" for n in lens) + (" (rises or holds, as in the paper)" if rises else " (falls)"))
    return out


def write_preset_report(result: dict[str, Any], p: Preset, out: Path) -> Path:
    """``report.md`` (and ``figure.png`` with matplotlib) for a preset's ``result``; returns the report's path."""
    has_png = _figure(result, p, out / "figure.png")
    rows = compare_to_paper(result)
    result["comparison"] = rows
    lines = [f"# attnzoo arena --preset {p.name}: {p.paper}", ""]
    if result["size"] == "quick":
        lines += ["> **Smoke test** (`--quick`): tiny models, vocabulary 256, two epochs; the numbers mean nothing.", ""]
    if result.get("partial"):
        lines += [f"> **Partial**: {len(result['runs'])} of the sweep's {result['of_runs']} runs finished; points "
                  "with fewer learning rates than the sweep are a lower bound of its best-of.", ""]
    lines += [*_budget_lines(p, result), ""]
    if has_png:
        lines += ["![ours beside the paper's points](figure.png)", ""]
    lines += ["## Against the paper", "", *_agreement_text(rows, result), ""]
    trend = _trend_text(result)
    if trend:
        lines += ["Recall against width (Zoology: it rises with width and falls with sequence length for "
                  "fixed-state mixers, while attention stays near 100%):", "", *trend, ""]
    lines += ["## Points (best of the learning rates)", "",
              "| variant | width | window | train | accuracy | per test segment | best lr | every lr | epochs | "
              "early stop | state bytes | params |", "|---|---:|---:|---|---:|---|---:|---|---:|---|---:|---:|"]
    for pt in result["points"]:
        segs = ", ".join(f"{k}: {100 * a:.0f}%" for k, a in pt["by_segment"].items())
        every = ", ".join(f"{k}: {100 * a:.0f}%" for k, a in pt["lrs"].items())
        lines.append(f"| {pt['variant']} | {pt['width']} | {pt['window'] or '-'} | {pt['train']} | "
                     f"{100 * pt['accuracy']:.1f}%{' (lr at the sweep edge)' if pt['at_lr_edge'] else ''} | {segs} | "
                     f"{pt['best_lr']:.2e} | {every} | {pt['epochs']} | {'yes' if pt['stopped_early'] else 'no'} | "
                     f"{pt['state_bytes']:,} | {pt['params']:,} |")
    path = out / "report.md"
    write_atomic(path, "\n".join(lines) + "\n")
    return path
