"""Report sections of the arena: smoke-test banner, measurement pass, verdict, long-context costs.

Each section is written as a little Markdown (headings, paragraphs, bullets, tables, images) and
:func:`md_to_html` turns exactly that subset into HTML for ``index.html``.
"""

from __future__ import annotations

import html
import math
import re
from pathlib import Path
from typing import Any

__all__ = [
    "banner_md",
    "long_context_figure",
    "long_context_md",
    "md_to_html",
    "measurement_md",
    "verdict_md",
]

QUICK_BANNER = ("> **Smoke test** (`--quick`): tiny models on a tiny budget, to check that the pipeline runs. "
                "The numbers say nothing about the variants; run `attnzoo arena` for a real report.")


def banner_md(results: dict[str, Any]) -> list[str]:
    """The smoke-test banner of a ``--quick`` report (nothing otherwise)."""
    return [QUICK_BANNER, ""] if results.get("quick") else []


def _busy_line(m: dict[str, Any]) -> str:
    load = [x for x in (m.get("loadavg_before"), m.get("loadavg_after")) if x is not None]
    facts = (f"CPU time / wall time {m.get('cpu_wall_ratio', float('nan')):.2f} with {m.get('threads')} thread(s) on "
             f"{m.get('cpu_count')} cores" + (f", load average {max(load):.1f}" if load else ""))
    if m.get("busy"):
        return (f"**The machine was busy during the measurement** ({m.get('why')}; {facts}): the speeds below "
                "are depressed by other programs. Re-run on a quiet machine before comparing them (on a shared "
                "machine `--threads 1` also helps: OpenMP threads that wait for each other made training 9x "
                "slower in one such run).")
    return f"The machine was quiet during the measurement ({facts})."


def measurement_md(results: dict[str, Any]) -> list[str]:
    """The measurement pass: how it ran, the load, and per-variant medians."""
    m = results.get("measurements")
    if not m:
        return []
    lengths = m.get("cache_lengths", [])
    lines = ["## Speed (measurement pass)", "",
             f"Measured after training, every variant in one interleaved loop of {m.get('repeats')} rounds "
             f"(train step on the `{m.get('task', 'lm')}` batch, prefill of one sequence, single-token decode "
             f"with {', '.join(map(str, lengths))} tokens cached); each number is the median over the rounds. "
             f"The table's speed columns come from here.", "", _busy_line(m), "",
             "| variant | train tokens/s | prefill tokens/s | " +
             " | ".join(f"decode tokens/s @ {n}" for n in lengths) + " | spread (max-min)/median |",
             "|---|" + "---:|" * (3 + len(lengths))]
    for v, r in m.get("variants", {}).items():
        dec = r.get("decode_tokens_per_s", {})
        spread = max(r.get("spread", {}).values(), default=float("nan"))
        lines.append(f"| {v} | {r['train_tokens_per_s']:,.0f} | {r['prefill_tokens_per_s']:,.0f} | " +
                     " | ".join(f"{dec.get(n, dec.get(str(n), float('nan'))):,.0f}" for n in lengths) +
                     f" | {spread:.0%} |")
    for v, e in m.get("errors", {}).items():
        lines.append(f"\n- {v}: not timed ({e})")
    return [*lines, ""]


def verdict_md(results: dict[str, Any]) -> list[str]:
    """The verdict (computed by :func:`attnzoo.arena.verdict.verdict`) as bullets."""
    answers = results.get("verdict") or []
    if not answers:
        return []
    lines = ["## Verdict", "", "Computed from this run's numbers (small models, short budgets: read it as a "
             "statement about this setting, not a universal ranking).", ""]
    lines += [f"- **{a['question']}**: {a['text']}" for a in answers]
    seeds = results.get("seed_runs") or {}
    if len(seeds.get("seeds", [])) > 1:
        who = "every variant" if seeds.get("all_variants") else (
            f"only the {len(seeds.get('variants', []))} best variants by lm loss at seed {results.get('seed')} "
            f"({', '.join(seeds.get('variants', []))}), to keep the run short; the others ran one seed")
        lines.append(f"- Seeds: the lm task ran with seeds {seeds['seeds']} for {who}.")
    return [*lines, ""]


def _si(x: float, unit: str) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    if unit == "s":
        return f"{x * 1e3:,.2f} ms" if x < 1 else f"{x:,.2f} s"
    for u, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= f:
            return f"{x / f:,.1f} {u}"
    return f"{x:,.0f} B"


def _crossing_text(c: dict[str, Any] | None) -> str:
    if not c:
        return "n/a"
    if c["n"] is None:
        return "never"
    return f"{c['n']:,} ({c['source']})"


def long_context_md(results: dict[str, Any], image: str | None) -> list[str]:
    """Per variant: one layer's forward and decode cost at the shortest and longest lengths, and
    where it drops below the baseline (``mha``)."""
    lc = results.get("long_context")
    if not lc or not lc.get("curves"):
        return []
    lo, hi = lc["lengths"][0], lc["lengths"][-1]
    lines = ["## Long-context cost", "",
             f"One attention layer (width {lc['width']}, {lc['heads']} heads, batch 1, float32) from {lo:,} to "
             f"{hi:,} tokens. Measured while a case is predicted to take under {lc['cap_s']:g} s; beyond, "
             "from the cost model (the variant's cost function: forward time scaled by FLOPs, decode-step time "
             "by the bytes a step reads), marked *model*. Memory columns are the cost function's exact "
             "formulas. 'beats mha from N' is the first length at which the variant is cheaper than mha.", "",
             f"| variant | forward @ {lo:,} | forward @ {hi:,} | decode step @ {hi:,} | activations @ {hi:,} | "
             f"cache @ {hi:,} | beats mha from N: forward | decode step | cache |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    cross = lc.get("crossings", {})
    for v, pts in lc["curves"].items():
        a, b = pts[0], pts[-1]
        tag = "" if b["source"] == "measured" else " *model*"
        c = cross.get(v, {})
        lines.append(f"| {v} | {_si(a['forward_s'], 's')} | {_si(b['forward_s'], 's')}{tag} | "
                     f"{_si(b['decode_step_s'], 's')}{tag} | {_si(b['activation_bytes'], 'B')} | "
                     f"{_si(b['cache_bytes'], 'B')} | " +
                     (" | ".join(_crossing_text(c.get(q)) for q in ("forward_s", "decode_step_s", "cache_bytes"))
                      if v in cross else "baseline | baseline | baseline") + " |")
    for v, e in lc.get("errors", {}).items():
        lines.append(f"\n- {v}: no long-context numbers ({e})")
    if image:
        lines += ["", f"![Long-context cost against mha]({image})"]
    return [*lines, ""]


def long_context_figure(plt: Any, results: dict[str, Any], colors: dict[str, Any]) -> Any:
    """Forward time, decode-step time and cache bytes against N (log-log); measured solid, model
    dashed. None when there is nothing to draw."""
    lc = results.get("long_context") or {}
    curves = lc.get("curves") or {}
    if not curves:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), dpi=110)
    for ax, key, label in ((axes[0], "forward_s", "forward time (s)"), (axes[1], "decode_step_s", "decode step (s)"),
                           (axes[2], "cache_bytes", "decode cache (bytes)")):
        for v, pts in curves.items():
            exact = key == "cache_bytes"  # the cost function's formula at every length: one solid line
            meas = [p for p in pts if exact or p["source"] == "measured"]
            model = [] if exact else [p for p in pts if p["source"] == "model"]
            if meas and model:
                model = [meas[-1], *model]  # join the two pieces
            style = {"color": colors.get(v), "lw": 2.2 if v == "mha" else 1.3}
            ax.plot([p["n"] for p in meas], [p[key] for p in meas], marker="o", ms=3, label=v, **style)
            ax.plot([p["n"] for p in model], [p[key] for p in model], ls="--", **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_title("Forward (one layer)", fontsize=10)
    axes[1].set_title("Decode one token", fontsize=10)
    axes[2].set_title("Decode cache (cost function, exact)", fontsize=10)
    axes[2].legend(fontsize=7, ncol=2)
    fig.suptitle("Where the efficient variants cross mha (solid: measured, dashed: cost model)", fontsize=11)
    return fig


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def _inline(text: str) -> str:
    out = html.escape(text)
    out = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", out)
    out = re.sub(r"(?<![*\w])\*(\S.*?)\*", r"<i>\1</i>", out)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", out)


def md_to_html(lines: list[str], images: dict[str, str] | None = None, out: Path | None = None) -> str:
    """The Markdown subset of the sections (``##``, ``>``, ``-``, tables, ``![..](file)``) as HTML;
    images are inlined as data URIs from ``out`` when given."""
    import base64

    parts: list[str] = []
    table: list[str] = []

    def flush() -> None:
        if table:
            head, body = _cells(table[0]), [_cells(r) for r in table[2:]]
            parts.append("<table><thead><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr></thead><tbody>"
                         + "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in body)
                         + "</tbody></table>")
            table.clear()

    for raw in "\n".join(lines).split("\n"):
        line = raw.rstrip()
        if line.startswith("|"):
            table.append(line)
            continue
        flush()
        img = re.fullmatch(r"!\[(.*?)\]\((.*?)\)", line)
        if img and out is not None and (out / img.group(2)).is_file():
            data = base64.b64encode((out / img.group(2)).read_bytes()).decode("ascii")
            parts.append(f'<figure><img alt="{html.escape(img.group(1))}" src="data:image/png;base64,{data}">'
                         f"<figcaption>{html.escape(img.group(1))}</figcaption></figure>")
        elif line.startswith("## "):
            parts.append(f"<h2>{_inline(line[3:])}</h2>")
        elif line.startswith("> "):
            parts.append(f'<p class="banner">{_inline(line[2:])}</p>')
        elif line.startswith("- "):
            parts.append(f"<ul><li>{_inline(line[2:])}</li></ul>")
        elif line:
            parts.append(f"<p>{_inline(line)}</p>")
    flush()
    return "\n".join(parts).replace("</ul>\n<ul>", "\n")
