"""Write the arena report: ``report.md``, ``index.html`` (images inline), ``results.json`` and plots.

Plots need matplotlib (``pip install 'attnzoo[plot]'``); without it the report is written without
images and says so.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from pathlib import Path
from typing import Any

from attnzoo.arena.fairness import plateau_lines
from attnzoo.arena.sections import (
    banner_md,
    long_context_figure,
    long_context_md,
    md_to_html,
    measurement_md,
    verdict_md,
)
from attnzoo.arena.tradeoff import tradeoff_figure
from attnzoo.arena.verdict import lm_seed_stats, mqar_converged

__all__ = ["summary_rows", "summary_text", "write_report"]

_COLUMNS = [
    ("variant", "variant"),
    ("params", "params"),
    ("val_loss", "val loss (nats/char)"),
    ("val_seeds", "val loss over seeds (mean ± std)"),
    ("bpc", "bits/char"),
    ("mqar_acc", "MQAR accuracy"),
    ("train_tps", "train tokens/s"),
    ("decode_tps", "decode tokens/s"),
    ("peak_mib", "peak train memory (MiB)"),
    ("kv_bpt", "KV-cache bytes/token"),
]

HOW_TO_READ = """\
## How to read this

Every variant is the same decoder (same width, depth, heads, training steps, batch, learning-rate
schedule and seed); only the attention layer differs. Each task trains its own set of models.

- **val loss / bits per char** (`lm`): cross entropy of the next character on held-out text (the
  last 10% of every play). Lower is better. Predicting characters by their frequency alone costs
  about 3.3 nats; a loss under 2.0 means the model has learnt words and the verse layout.
- **MQAR accuracy** (`mqar`): the share of queried values recalled exactly from key-value pairs
  seen earlier in the sequence. It tests in-context recall, which exact softmax attention does
  well and fixed-size states (linear, performer, infini) or short windows (sliding) do badly.
  Two plateaus mean "not learnt": chance (1 / number of possible values) and about
  1 / (number of pairs), where the model copies one of the values it has seen without knowing
  which one belongs to the queried key. Softmax models escape the second plateau suddenly after
  enough steps at a high learning rate; the curves show whether a run got there.
- **MQAR accuracy** marked *(not converged)*: the accuracy was still rising over the last
  evaluations, so the run compares budgets rather than mechanisms; read it as a lower bound.
- **train tokens/s**: one training step of the `lm` batch (forward, backward and optimiser).
  **decode tokens/s**: one cached single-token decode step, batch 1, at the largest cache length
  of the measurement pass. Both come from the measurement pass after training (every variant in
  one interleaved loop, medians of repeats), not from the training runs; the report says next to
  them whether the machine was busy. Compare them within a report, not across machines.
- **peak train memory**: see the method line under the table. **KV-cache bytes/token**: the
  decode state after one `seq_len`-token window divided by `seq_len`. Full-attention caches
  (mha) grow with every token; mqa/gqa store fewer heads; a sliding window or a recurrent
  state stops growing, so its per-token cost falls as sequences get longer.
- Small models on a small budget: differences of a few hundredths of a nat are within
  seed-to-seed noise. Re-run with another `--seed` before concluding from them.
"""


def _fmt(value: Any, kind: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if kind == "int":
        return f"{int(value):,}"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "f3":
        return f"{value:.3f}"
    if kind == "f0":
        return f"{value:,.0f}"
    if kind == "f1":
        return f"{value:,.1f}"
    return str(value)


def _pass_speeds(results: dict[str, Any], v: str) -> tuple[float | None, float | None]:
    """Train and decode tokens/s of ``v`` from the measurement pass (decode at the largest cache)."""
    m = (results.get("measurements") or {}).get("variants", {}).get(v)
    if not m:
        return None, None
    dec = m.get("decode_tokens_per_s") or {}
    top = max(dec, key=lambda k: int(k), default=None)
    return m.get("train_tokens_per_s"), (dec[top] if top is not None else None)


def summary_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per variant with the raw numbers of the table (``None`` where not measured).

    Speeds come from the measurement pass only (``results["measurements"]``).
    """
    lm = results["runs"].get("lm", {})
    mq = results["runs"].get("mqar", {})
    seeds = lm_seed_stats(results)
    rows = []
    for v in results["variants"]:
        a, b = lm.get(v), mq.get(v)
        main = a or b or {}
        mem = main.get("memory", {})
        train_tps, decode_tps = _pass_speeds(results, v)
        st = seeds.get(v)
        rows.append({
            "variant": v,
            "params": main.get("params"),
            "val_loss": a["final"]["val_loss"] if a else None,
            "val_seeds": (st["mean"], st["std"], int(st["n"])) if st and st["n"] > 1 else None,
            "bpc": a["final"]["bits_per_char"] if a else None,
            "mqar_acc": b["final"]["accuracy"] if b else None,
            "mqar_converged": mqar_converged(b["evals"]) if b else None,
            "mqar_lr": b.get("best_lr") if b else None,  # --lr-sweep
            "train_tps": train_tps,
            "decode_tps": decode_tps,
            "peak_mib": mem["peak_bytes"] / 2**20 if mem else None,
            "kv_bpt": a.get("state_bytes_per_token") if a else None,
        })
    return rows


def _cell(row: dict[str, Any], key: str) -> str:
    """One table cell; MQAR accuracy carries its convergence, seeds their spread."""
    if key == "val_seeds":
        if row[key] is None:
            return "1 seed"
        mean, std, n = row[key]
        return f"{mean:.3f} ± {std:.3f} ({n})"
    text = _fmt(row[key], _KINDS[key])
    if key == "mqar_acc" and row.get("mqar_converged") is False:
        text += " (not converged)"
    if key == "mqar_acc" and row.get("mqar_lr") is not None:
        text += f" (best lr {row['mqar_lr']:g})"
    return text


_KINDS = {"params": "int", "val_loss": "f3", "bpc": "f3", "mqar_acc": "pct", "train_tps": "f0",
          "decode_tps": "f0", "peak_mib": "f1", "kv_bpt": "f0", "variant": "str"}


def _table_md(rows: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(t for _, t in _COLUMNS) + " |"
    sep = "|" + "|".join("---" if k == "variant" else "---:" for k, _ in _COLUMNS) + "|"
    body = ["| " + " | ".join(_cell(r, k) for k, _ in _COLUMNS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def _table_html(rows: list[dict[str, Any]]) -> str:
    head = "".join(f"<th>{html.escape(t)}</th>" for _, t in _COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(r, k))}</td>" for k, _ in _COLUMNS)
                   + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _settings_md(results: dict[str, Any]) -> list[str]:
    lines = []
    for t, s in results["settings"].items():
        extra = f", {s['num_kv_pairs']} key-value pairs, vocabulary {s['vocab_size']}" if t == "mqar" else ""
        window = s["window"] if s["window"] is not None else "registry default"
        lines.append(f"- `{t}`: seq_len {s['seq_len']}, {s['steps']} steps x batch {s['batch']}, width "
                     f"{s['width']}, depth {s['depth']}, {s['heads']} heads, peak lr {s['lr']:g} (warm-up "
                     f"{s['warmup']} steps, cosine to 10%), window {window}, positions {s.get('pos', 'rope')}{extra}")
    env = results["environment"]
    jobs = env.get("train_jobs", 1)
    trained = (f"runs trained in {jobs} worker processes of {_threads(env.get('train_threads'))} each, measured "
               f"with {env['threads']} threads" if jobs > 1 else
               f"{env['threads']} threads x {env['world_size']} process(es)")
    lines.append(f"- seed {results['seed']}; torch {env['torch']} on {env['device']}, {trained}; "
                 f"this invocation took {results['wall_s']:.0f} s wall, "
                 f"{results.get('cpu_s', float('nan')):.0f} s CPU (runs reused with --resume cost nothing here)")
    return lines


def _threads(n: object) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


def _memory_method(results: dict[str, Any]) -> str:
    for runs in results["runs"].values():
        for r in runs.values():
            if "memory" in r:
                return r["memory"]["method"]
    return "not measured"


def _errors(results: dict[str, Any]) -> list[str]:
    out = []
    for t, runs in results["runs"].items():
        for v, r in runs.items():
            for key in ("memory_error", "state_error", "decode_error"):
                if key in r:
                    out.append(f"- {t}/{v} {key.split('_')[0]}: {r[key]}")
    return out


# --------------------------------------------------------------------------- plots
def _plots(results: dict[str, Any], out: Path) -> dict[str, str]:
    """Write the PNGs; returns ``{key: file name}`` (empty when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    colors = {v: plt.get_cmap("tab10")(i % 10) for i, v in enumerate(results["variants"])}
    files: dict[str, str] = {}
    for t in results["runs"]:
        files[f"{t}_curves"] = _save(plt, _curves_figure(plt, results, t, colors), out, f"{t}_curves.png")
    rows = summary_rows(results)
    if "mqar" in results["runs"]:
        files["mqar_accuracy"] = _save(plt, _mqar_figure(plt, results, rows, colors), out, "mqar_accuracy.png")
    fig = _speed_memory_figure(plt, rows, colors)
    if fig is not None:
        files["speed_memory"] = _save(plt, fig, out, "speed_memory.png")
    fig = long_context_figure(plt, results, colors)
    if fig is not None:
        files["long_context"] = _save(plt, fig, out, "long_context.png")
    fig = tradeoff_figure(plt, results, colors)
    if fig is not None:
        files["tradeoff"] = _save(plt, fig, out, "recall_vs_state.png")
    return files


def _save(plt: Any, fig: Any, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name)
    plt.close(fig)
    return name


def _curves_figure(plt: Any, results: dict[str, Any], t: str, colors: dict[str, Any]) -> Any:
    """Validation loss (lm) or accuracy (mqar) against the training step, one line per variant."""
    runs = results["runs"][t]
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    key = "val_loss" if t == "lm" else "accuracy"
    for v in results["variants"]:
        if v in runs:
            ev = runs[v]["evals"]
            ax.plot([e["step"] for e in ev], [e[key] for e in ev], marker="o", ms=3, label=v, color=colors[v])
    ax.set_xlabel("training step")
    if t == "lm" and results.get("unigram_val_loss"):
        ax.axhline(results["unigram_val_loss"], color="gray", ls=":", lw=1)
        ax.text(ax.get_xlim()[1], results["unigram_val_loss"], " unigram", color="gray", fontsize=8,
                va="bottom", ha="right")
        ax.axhline(2.0, color="gray", ls="--", lw=1)
        ax.text(ax.get_xlim()[0], 2.0, " 2.0 nats", color="gray", fontsize=8, va="bottom", ha="left")
    if t == "lm":
        ax.set_ylabel("validation loss (nats/char)")
        ax.set_title("Shakespeare character LM: validation loss")
    else:
        ax.set_ylabel("MQAR accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title("MQAR: held-out accuracy during training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return fig


def _mqar_figure(plt: Any, results: dict[str, Any], rows: list[dict[str, Any]], colors: dict[str, Any]) -> Any:
    """Final MQAR accuracy by variant (bars)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.0), dpi=110)
    shown = [r for r in rows if r["mqar_acc"] is not None]
    names = [r["variant"] for r in shown]
    accs = [r["mqar_acc"] for r in shown]
    bars = ax.bar(names, accs, color=[colors[v] for v in names],
                  hatch=["//" if r["mqar_converged"] is False else "" for r in shown])
    for bar, r in zip(bars, shown, strict=True):  # the table's rounding, so the two agree
        label = _fmt(r["mqar_acc"], "pct") + ("\nnot conv." if r["mqar_converged"] is False else "")
        ax.text(bar.get_x() + bar.get_width() / 2, r["mqar_acc"] + 0.01, label, ha="center", va="bottom",
                fontsize=7)
    ax.axhline(0.9, color="gray", ls="--", lw=1)
    ax.text(len(names) - 0.5, 0.91, "90%", color="gray", fontsize=8, ha="right", va="bottom")
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("accuracy on held-out sequences")
    s = results["settings"]["mqar"]
    ax.set_title(f"MQAR: {s['num_kv_pairs']} key-value pairs, seq_len {s['seq_len']}, width {s['width']}")
    ax.tick_params(axis="x", labelrotation=20)
    return fig


def _speed_memory_figure(plt: Any, rows: list[dict[str, Any]], colors: dict[str, Any]) -> Any:
    """Training and decoding speed against memory (None when nothing was measured)."""
    pts_train = [(r["variant"], r["peak_mib"], r["train_tps"]) for r in rows
                 if r["peak_mib"] is not None and r["train_tps"] is not None]
    pts_dec = [(r["variant"], r["kv_bpt"], r["decode_tps"]) for r in rows
               if r["kv_bpt"] is not None and r["decode_tps"] is not None]
    if not (pts_train or pts_dec):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), dpi=110)
    for ax, pts, xl, yl, title in (
        (axes[0], pts_train, "peak training memory (MiB)", "training tokens/s", "Training"),
        (axes[1], pts_dec, "KV-cache / state bytes per token", "decode tokens/s (batch 1)", "Decoding"),
    ):
        for v, x, y in pts:
            ax.scatter([x], [y], color=colors[v], s=40, zorder=3)
            ax.annotate(v, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.set_title(f"{title}: speed against memory (up-left is better)")
        ax.title.set_fontsize(10)
        ax.grid(alpha=0.3)
        ax.margins(0.15)
    return fig


# --------------------------------------------------------------------------- writers
_CAPTIONS = {
    "lm_curves": "Validation loss during training (lm)",
    "mqar_curves": "MQAR accuracy during training",
    "mqar_accuracy": "MQAR accuracy by variant",
    "speed_memory": "Speed (measurement pass) against memory",
    "long_context": "Long-context cost against mha",
    "tradeoff": "MQAR recall against decode-state bytes (the Zoology / Based trade-off)",
}


def _inline(text: str) -> str:
    """The little Markdown the report uses (``**bold**``, backticks) as HTML."""
    out = html.escape(" ".join(text.split()))
    out = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", out)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", out)


def _samples(results: dict[str, Any]) -> list[tuple[str, str]]:
    lm = results["runs"].get("lm", {})
    out = []
    for v in results["variants"]:
        if v in lm and "sample" in lm[v]:
            out.append((f"{v} (greedy)", lm[v]["sample"]))
            if "sample_t08" in lm[v]:
                out.append((f"{v} (sampled, temperature 0.8, seeded)", lm[v]["sample_t08"]))
    return out


def write_report(results: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write ``results.json``, the plots, ``report.md`` and ``index.html`` into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    images = _plots(results, out)
    md_path = out / "report.md"
    md_path.write_text(_report_md(results, images))
    html_path = out / "index.html"
    html_path.write_text(_report_html(results, images, out))
    return {"md": md_path, "html": html_path, "json": out / "results.json"}


def _report_md(results: dict[str, Any], images: dict[str, str]) -> str:
    errors = _errors(results)
    md = ["# attnzoo arena report", "", *banner_md(results),
          "One small decoder per attention variant, trained with identical settings; generated by "
          "`attnzoo arena`. Raw numbers: `results.json`.", "", _table_md(summary_rows(results)), "",
          _speed_note(results), "", "Settings:", "", *_settings_md(results), ""]
    if errors:
        md += ["Measurements that failed:", "", *errors, ""]
    plateau = plateau_lines(results)
    if plateau:
        md += ["Did every run reach its plateau? (mqar: adaptive budget, see docs/arena.md)", "", *plateau, ""]
    md += [*verdict_md(results), *measurement_md(results),
           *long_context_md(results, images.get("long_context")), "## Plots", ""]
    if images:
        md += [f"![{_CAPTIONS[k]}]({f})\n" for k, f in images.items() if k != "long_context"]
    else:
        md += ["(no plots: install matplotlib with `pip install 'attnzoo[plot]'`)", ""]
    samples = _samples(results)
    if samples:
        md += ["## Samples (lm)", "", "Prompt: `" + json.dumps(results.get("prompt", ""))[1:-1] + "`", ""]
        for v, text in samples:
            md += [f"**{v}**", "", "```text", text, "```", ""]
    md += [HOW_TO_READ]
    return "\n".join(md)


def _report_html(results: dict[str, Any], images: dict[str, str], out: Path) -> str:
    errors, samples, settings = _errors(results), _samples(results), _settings_md(results)
    figs = []
    for k, f in images.items():
        data = base64.b64encode((out / f).read_bytes()).decode("ascii")
        figs.append(f'<figure><img alt="{html.escape(_CAPTIONS[k])}" src="data:image/png;base64,{data}">'
                    f"<figcaption>{html.escape(_CAPTIONS[k])}</figcaption></figure>")
    figs = [f for f in figs if "Long-context" not in f]
    sections = md_to_html([*verdict_md(results), *measurement_md(results),
                           *long_context_md(results, images.get("long_context"))], images, out)
    sample_html = "".join(f"<h3>{html.escape(v)}</h3><pre>{html.escape(t)}</pre>" for v, t in samples)
    intro, *items = HOW_TO_READ.split("\n", 2)[2].split("\n- ")
    how_html = f"<p>{_inline(intro)}</p><ul>" + "".join(f"<li>{_inline(i)}</li>" for i in items) + "</ul>"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>attnzoo arena report</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }}
table {{ border-collapse: collapse; font-size: 14px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
th {{ background: #f3f3f3; }}
img {{ max-width: 100%; }}
pre {{ background: #f7f7f7; padding: 8px; white-space: pre-wrap; }}
.banner {{ background: #fff3cd; border: 1px solid #e0c060; padding: 8px 12px; }}
</style></head><body>
<h1>attnzoo arena report</h1>
{md_to_html(banner_md(results))}
<p>One small decoder per attention variant, trained with identical settings; raw numbers in
<code>results.json</code>.</p>
{_table_html(summary_rows(results))}
{md_to_html([_speed_note(results)])}
<ul>{"".join(f"<li>{_inline(s[2:])}</li>" for s in settings)}</ul>
{"<ul>" + "".join(f"<li>{html.escape(e[2:])}</li>" for e in errors) + "</ul>" if errors else ""}
{sections}
<h2>Plots</h2>
{"".join(figs) or "<p>(no plots: install matplotlib)</p>"}
{"<h2>Samples (lm)</h2>" + sample_html if samples else ""}
<h2>How to read this</h2>
{how_html}
</body></html>
"""


def _speed_note(results: dict[str, Any]) -> str:
    m = results.get("measurements")
    method = f"Peak train memory method: {_memory_method(results)}."
    if not m:
        return method + " No measurement pass ran (`--no-measure`), so the speed columns are empty."
    note = (" Speed columns: the measurement pass after training (see *Speed*), every variant timed in one "
            "interleaved loop.")
    if m.get("busy"):
        note += (f" **The machine was busy during that pass ({m.get('why')}); the speeds are unreliable: re-run "
                 "on a quiet machine.**")
    return method + note


def summary_text(results: dict[str, Any], paths: dict[str, Path]) -> str:
    """The closing summary for stdout: one line per variant, the verdict, and where the report is."""
    rows = summary_rows(results)
    head = f"{'variant':<14} {'val loss':>9} {'MQAR acc':>9} {'train tok/s':>12} {'decode tok/s':>13}"
    lines = ["", "arena summary" + (" (SMOKE TEST: --quick)" if results.get("quick") else ""), head]
    for r in rows:
        acc = _fmt(r["mqar_acc"], "pct") + ("*" if r["mqar_converged"] is False else "")
        lines.append(f"{r['variant']:<14} {_fmt(r['val_loss'], 'f3'):>9} {acc:>9} {_fmt(r['train_tps'], 'f0'):>12} "
                     f"{_fmt(r['decode_tps'], 'f0'):>13}")
    if any(r["mqar_converged"] is False for r in rows):
        lines.append("* not converged: MQAR accuracy still rising at the end")
    m = results.get("measurements") or {}
    if m.get("busy"):
        lines.append(f"warning: the machine was busy during the speed measurement ({m.get('why')}); re-run")
    lines += [f"- {a['question']}: {a['text'].replace('**', '')}" for a in results.get("verdict", [])]
    lines.append(f"{len(results['variants'])} variants in {results['wall_s']:.0f} s; report: {paths['md']} "
                 f"(open {paths['html']} in a browser)")
    return "\n".join(lines)
