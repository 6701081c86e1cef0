"""The arena's verdict, convergence, load detection, long-context crossings and safety checks,
on synthetic results (no training), plus one tiny measurement pass."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from attnzoo.arena import add_arena_arguments
from attnzoo.arena.longctx import crossings, long_context
from attnzoo.arena.progress import Overall, format_duration
from attnzoo.arena.report import summary_rows, summary_text
from attnzoo.arena.runner import resolve_out, setting_differences
from attnzoo.arena.sections import md_to_html
from attnzoo.arena.timing import machine_busy
from attnzoo.arena.verdict import lm_seed_stats, mqar_converged, verdict

pytestmark = pytest.mark.usefixtures("one_thread")


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arena_arguments(p)
    return p.parse_args(list(argv))


def _evals(*accs: float) -> list[dict[str, float]]:
    return [{"step": 100 * i, "accuracy": a, "val_loss": 1.0} for i, a in enumerate(accs)]


def _curve(cache_per_token: float, fwd_exp: float, fixed: float = 0.0) -> list[dict[str, Any]]:
    return [{"n": n, "source": "measured" if n <= 2048 else "model", "forward_s": 1e-9 * n ** fwd_exp,
             "decode_step_s": 1e-6 * (1 + cache_per_token * n / 1e3), "cache_bytes": fixed + cache_per_token * n,
             "activation_bytes": 0.0, "flops": 0.0} for n in (1024, 2048, 4096, 8192)]


def _results(**over: Any) -> dict[str, Any]:
    """A synthetic results dict: three variants with made-up numbers."""
    res: dict[str, Any] = {
        "variants": ["mha", "gqa", "linear"], "seed": 0, "wall_s": 12.0, "quick": False,
        "runs": {
            "lm": {"mha": {"final": {"val_loss": 1.90, "bits_per_char": 2.74}, "params": 1000},
                   "gqa": {"final": {"val_loss": 1.91, "bits_per_char": 2.76}, "params": 800},
                   "linear": {"final": {"val_loss": 2.30, "bits_per_char": 3.3}, "params": 1000}},
            "mqar": {"mha": {"final": {"accuracy": 0.998}, "evals": _evals(0.1, 0.9, 0.998)},
                     "gqa": {"final": {"accuracy": 0.96}, "evals": _evals(0.1, 0.5, 0.96)},
                     "linear": {"final": {"accuracy": 0.30}, "evals": _evals(0.28, 0.30, 0.30)}},
        },
        "seed_runs": {"seeds": [0, 1, 2], "variants": ["mha", "gqa"],
                      "finals": {"mha": [{"val_loss": 1.90}, {"val_loss": 1.94}, {"val_loss": 1.92}],
                                 "gqa": [{"val_loss": 1.91}, {"val_loss": 1.93}, {"val_loss": 1.95}]}},
        "measurements": {"busy": False, "why": "", "cache_lengths": [128],
                         "variants": {"mha": {"train_tokens_per_s": 1000.0, "decode_tokens_per_s": {"128": 50.0}},
                                      "gqa": {"train_tokens_per_s": 1200.0, "decode_tokens_per_s": {"128": 60.0}},
                                      "linear": {"train_tokens_per_s": 900.0,
                                                 "decode_tokens_per_s": {"128": 70.0}}}},
        "long_context": {"depth": 2, "lengths": [1024, 2048, 4096, 8192],
                         "curves": {"mha": _curve(512, 2.0), "gqa": _curve(128, 2.0),
                                    "linear": _curve(0, 1.0, fixed=65536)}},
    }
    res.update(over)
    return res


# --------------------------------------------------------------------------- convergence
@pytest.mark.parametrize(("accs", "want"), [
    ((0.1, 0.5, 0.995), True),  # solved
    ((0.3, 0.31, 0.305), True),  # a plateau
    ((0.1, 0.3, 0.45), False),  # still rising at the end (the under-trained mqa of issue 18)
    ((0.1, 0.2), None),  # too few evaluations to tell
])
def test_mqar_converged(accs: tuple[float, ...], want: bool | None) -> None:
    assert mqar_converged(_evals(*accs)) is want


def test_table_and_bar_chart_round_alike_and_flag_unconverged() -> None:
    from attnzoo.arena.report import _cell, _fmt

    res = _results()
    res["runs"]["mqar"]["gqa"]["final"]["accuracy"] = 0.998
    rows = {r["variant"]: r for r in summary_rows(res)}
    assert _cell(rows["gqa"], "mqar_acc") == "99.8% (not converged)"  # rising 0.5 -> 0.96 -> ...
    assert _fmt(rows["gqa"]["mqar_acc"], "pct") == "99.8%"  # what the bar chart prints
    assert _cell(rows["mha"], "mqar_acc") == "99.8%"
    assert _cell(rows["mha"], "val_seeds") == "1.920 ± 0.020 (3)" and _cell(rows["linear"], "val_seeds") == "1 seed"


def test_speed_columns_come_from_the_measurement_pass_only() -> None:
    res = _results()
    res["runs"]["lm"]["mha"]["train_tokens_per_s"] = 15.0  # a number from training: ignored
    rows = {r["variant"]: r for r in summary_rows(res)}
    assert rows["mha"]["train_tps"] == 1000.0 and rows["mha"]["decode_tps"] == 50.0
    res.pop("measurements")
    assert all(r["train_tps"] is None and r["decode_tps"] is None for r in summary_rows(res))


# --------------------------------------------------------------------------- the verdict
def test_verdict_names_winners_and_margins() -> None:
    res = _results()
    got = {a["question"]: a for a in verdict(res)}
    assert list(got) == ["recall (MQAR)", "long-context decode memory", "training throughput",
                         "quality per parameter"]
    rec = got["recall (MQAR)"]
    assert rec["winner"] == "mha" and rec["runner_up"] == "gqa" and rec["margin"] == pytest.approx(0.038)
    assert rec["not_converged"] == ["gqa"] and "gqa" in rec["text"]
    mem = got["long-context decode memory"]
    # at 8192 tokens: mha 512 B/token x 8192 = 4 MiB per layer vs linear's fixed 64 KiB -> 64x
    assert mem["winner"] == "linear" and mem["n"] == 8192 and mem["ratio_vs_baseline"] == pytest.approx(64.0)
    assert mem["bytes"]["mha"] == 2 * 512 * 8192  # x depth
    thr = got["training throughput"]
    assert thr["winner"] == "gqa" and thr["factor"] == pytest.approx(1.2) and not thr["busy"]
    q = got["quality per parameter"]
    assert q["winner"] == "mha" and q["value"] == pytest.approx(1.92)
    assert q["noise"] == pytest.approx(0.02) and q["ties"] == ["gqa"]
    assert q["smallest_within_noise"] == "gqa" and "better buy" in q["text"]


def test_verdict_flags_a_busy_machine_and_a_clear_lead() -> None:
    res = _results()
    res["measurements"].update(busy=True, why="the load average was 9.0 on 2 cores")
    res["seed_runs"]["finals"]["gqa"] = [{"val_loss": 2.50}, {"val_loss": 2.51}, {"val_loss": 2.52}]
    got = {a["question"]: a for a in verdict(res)}
    assert got["training throughput"]["busy"] and "re-run" in got["training throughput"]["text"]
    q = got["quality per parameter"]
    assert q["ties"] == [] and "larger than the noise" in q["text"]


def test_verdict_handles_missing_parts_and_single_seeds() -> None:
    res = _results(seed_runs={"seeds": [0], "variants": [], "finals": {}})
    for key in ("measurements", "long_context"):
        res.pop(key)
    res["runs"].pop("mqar")
    got = verdict(res)
    assert [a["question"] for a in got] == ["quality per parameter"]
    assert got[0]["noise"] is None and "one seed only" in got[0]["text"]
    assert lm_seed_stats(res)["mha"] == {"mean": 1.90, "std": 0.0, "n": 1.0}
    assert verdict({"runs": {}}) == []


def test_verdict_knows_no_variant_by_name_beyond_the_baseline() -> None:
    res = _results()
    ren = {"mha": "mha", "gqa": "brand_new", "linear": "other_new"}
    for t in ("lm", "mqar"):
        res["runs"][t] = {ren[k]: v for k, v in res["runs"][t].items()}
    res["seed_runs"]["finals"] = {ren[k]: v for k, v in res["seed_runs"]["finals"].items()}
    res["measurements"]["variants"] = {ren[k]: v for k, v in res["measurements"]["variants"].items()}
    res["long_context"]["curves"] = {ren[k]: v for k, v in res["long_context"]["curves"].items()}
    got = {a["question"]: a["winner"] for a in verdict(res)}
    assert got == {"recall (MQAR)": "mha", "long-context decode memory": "other_new",
                   "training throughput": "brand_new", "quality per parameter": "mha"}


def test_summary_text_lists_every_variant_and_the_report() -> None:
    res = _results(quick=True)
    res["verdict"] = verdict(res)
    text = summary_text(res, {"md": Path("r/report.md"), "html": Path("r/index.html")})
    assert "SMOKE TEST" in text and "r/report.md" in text
    for v in res["variants"]:
        assert f"\n{v} " in text
    assert "96.0%*" in text and "not converged" in text


# --------------------------------------------------------------------------- load, crossings, html
def test_machine_busy() -> None:
    quiet = {"cpu_wall_ratio": 0.98, "threads": 1, "cpu_count": 2, "loadavg_before": 1.1, "loadavg_after": 1.3}
    assert machine_busy(quiet) == (False, "")
    busy, why = machine_busy({**quiet, "cpu_wall_ratio": 0.4})
    assert busy and "40%" in why
    busy, why = machine_busy({**quiet, "loadavg_after": 7.5})
    assert busy and "7.5" in why
    assert not machine_busy({**quiet, "threads": 4, "cpu_wall_ratio": 0.5, "cpu_count": 8})[0]
    steady = {f"v{i}": {"spread": {"train_step_s": s, "decode_s@128": 0.3}} for i, s in enumerate((0.05, 0.1, 0.4))}
    assert not machine_busy({**quiet, "variants": steady})[0]  # the median round agreed; decode noise alone is not
    wild = {f"v{i}": {"spread": {"train_step_s": 0.1, "prefill_s": s}} for i, s in enumerate((0.6, 1.2, 2.66))}
    busy, why = machine_busy({**quiet, "variants": wild})  # spreads of 60-266%: never "quiet"
    assert busy and "266%" in why
    busy, why = machine_busy({**quiet, "loadavg_after": 2.4})  # more runnable threads than the 2 cores
    assert busy and "2.4 on 2 cores" in why
    assert not machine_busy({**quiet, "loadavg_after": 2.2})[0]
    unsteady = {f"v{i}": {"spread": {"train_step_s": s}} for i, s in enumerate((0.15, 0.28, 0.4))}
    busy, why = machine_busy({**quiet, "variants": unsteady})
    assert busy and "28%" in why


def test_crossings_find_the_first_cheaper_length() -> None:
    curves = {"mha": _curve(512, 2.0), "gqa": _curve(128, 2.0), "linear": _curve(0, 1.0, fixed=1024 * 1024)}
    got = crossings(curves)
    assert set(got) == {"gqa", "linear"}
    assert got["gqa"]["cache_bytes"] == {"n": 1024, "source": "measured"}
    assert got["linear"]["cache_bytes"] == {"n": 4096, "source": "model"}  # 1 MiB fixed vs 512 B x N
    assert got["linear"]["forward_s"]["n"] == 1024
    assert got["gqa"]["forward_s"] == {"n": None, "source": None}  # never cheaper than mha
    assert crossings({"gqa": curves["gqa"]}) == {}
    noisy = [dict(p) for p in curves["mha"]]
    noisy[0]["forward_s"] /= 2  # one noisy point below mha at the shortest length, above after it
    assert crossings({"mha": curves["mha"], "noisy": noisy})["noisy"]["forward_s"] == {"n": None, "source": None}


def test_long_context_measures_then_models(tmp_path: Path) -> None:
    lc = long_context(["mha", "linear"], 32, 2, 1, None, torch.device("cpu"), quick=True, cap_s=0.0)
    assert lc["lengths"] == [64, 128, 256] and not lc["errors"]
    for pts in lc["curves"].values():
        assert [p["source"] for p in pts] == ["measured", "model", "model"]  # a zero cap: only the first
        assert pts[0]["cache_bytes_measured"] > 0 and all(p["forward_s"] > 0 for p in pts)
    mha = lc["curves"]["mha"]
    assert mha[2]["cache_bytes"] == 4 * mha[0]["cache_bytes"]  # the KV cache grows with N
    assert lc["curves"]["linear"][2]["cache_bytes"] == lc["curves"]["linear"][0]["cache_bytes"]


def test_md_to_html_renders_the_sections_subset() -> None:
    out = md_to_html(["## Verdict", "", "> **Smoke test** (`--quick`)", "- **a**: b", "- c *model*",
                      "| x | y |", "|---|---:|", "| 1 | 2 |", "plain"])
    assert "<h2>Verdict</h2>" in out and '<p class="banner"><b>Smoke test</b> (<code>--quick</code>)' in out
    assert out.count("<ul>") == 1 and "<li>c <i>model</i></li>" in out
    assert "<th>x</th><th>y</th>" in out and "<td>1</td><td>2</td>" in out and "<p>plain</p>" in out


# --------------------------------------------------------------------------- progress and safety
def test_overall_progress_counts_runs_and_estimates_the_rest() -> None:
    now = [0.0]
    buf = io.StringIO()
    o = Overall([1.0, 1.0, 2.0], stream=buf, clock=lambda: now[0])
    assert o.start("lm-mha") == "1/3"
    now[0] = 10.0
    o.finish(trained=True)  # 10 s for weight 1
    o.start("lm-gqa")
    o.finish(trained=False)  # reused: says nothing about speed
    o.start("mqar-mha")
    lines = buf.getvalue().splitlines()
    assert lines[0] == "arena: run 1/3 lm-mha | elapsed 0:00 | ETA estimating"
    assert lines[2] == "arena: run 3/3 mqar-mha | elapsed 0:10 | ETA 0:20"
    assert format_duration(3725) == "1:02:05"
    with pytest.raises(ValueError, match="weights"):
        Overall([])


def test_overall_progress_of_parallel_runs_ignores_reused_ones_in_the_rate() -> None:
    now = [0.0]
    buf = io.StringIO()
    o = Overall([1.0, 1.0, 1.0, 1.0], stream=buf, clock=lambda: now[0])
    o.completed("lm-gqa: reused", 1.0, trained=False)  # instant: must not make the rate look fast
    now[0] = 20.0
    o.completed("lm-mha: val 1.98", 1.0)  # 20 s of wall for the one trained weight
    lines = buf.getvalue().splitlines()
    assert lines[0] == "arena: done 1/4 lm-gqa: reused | elapsed 0:00 | ETA estimating"
    assert lines[1] == "arena: done 2/4 lm-mha: val 1.98 | elapsed 0:20 | ETA 0:40"


def test_setting_differences_names_only_what_changed() -> None:
    old = {"task": "lm", "steps": 200, "width": 128, "seed": 0}
    new = {"task": "lm", "steps": 5, "width": 128, "seed": 0, "world_size": 1}
    assert setting_differences(old, new) == "steps: 200 -> 5, world_size: '<missing>' -> 1"
    assert setting_differences(None, new).startswith("no settings recorded")


def test_quick_refuses_to_overwrite_a_full_report(tmp_path: Path) -> None:
    full = tmp_path / "report"
    full.mkdir()
    (full / "results.json").write_text(json.dumps({"quick": False}))
    with pytest.raises(ValueError, match=r"full arena report.*--force"):
        resolve_out(_args("--quick", "--out", str(full)))
    assert resolve_out(_args("--quick", "--out", str(full), "--force")) == full
    assert resolve_out(_args("--out", str(full))) == full  # a full run may
    (full / "arena-kind.txt").write_text("quick\n")
    assert resolve_out(_args("--quick", "--out", str(full))) == full
    assert str(resolve_out(_args("--quick"))) == "arena-report-quick"
    assert str(resolve_out(_args())) == "arena-report"
