"""Paper presets of the arena (zoology-fig2, based-fig2), fair budgets, --lr-sweep and hybrid stacks."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attnzoo.arena import presets, run_arena, settings_for, sweep
from attnzoo.arena import runner as arena_runner
from attnzoo.arena.fairness import best_lr_record, plateau_lines, should_stop, sweep_lrs
from attnzoo.arena.hybrid import check_entry, entry_kwargs, stack_cache_bytes
from attnzoo.arena.paper_report import _interp, compare_to_paper
from attnzoo.arena.tasks import IGNORE, batch_generator
from attnzoo.arena.tradeoff import hybrid_answers, tradeoff_points
from attnzoo.cli import build_parser
from attnzoo.cost import estimate

pytestmark = pytest.mark.usefixtures("one_thread")


def _args(*argv: str) -> argparse.Namespace:
    """``attnzoo arena ARGV`` as the command line parses it."""
    return build_parser().parse_args(["arena", *argv])


# --------------------------------------------------------------------------- the papers' settings
def test_zoology_preset_is_the_papers_configuration() -> None:
    """HazyResearch/zoology@d88d6f5, zoology/experiments/paper_configs/iclr24_zoology_figure2/configs.py:
    VOCAB_SIZE = 8_192; (input_seq_len, num_kv_pairs) in (64, 4), (128, 8), (256, 16), (512, 64) (the last
    commented out there, drawn in Fig. 2); batch 512 / 256 at 256 tokens / 128 at 512; 100_000 train and
    3_000 test examples; d_model 64, 128, 256, 512; lr np.logspace(-4, -2, 4); n_layers 2; num_heads 1;
    max_epochs 64; zoology/config.py: early_stopping_threshold 0.99, weight_decay 0.1; power_a 0.01,
    random_non_queries False."""
    p = presets.PRESETS["zoology-fig2"]
    assert p.vocab == 8192
    assert [(c.seq_len, c.pairs, c.examples) for c in p.train] == [(64, 4, 100_000), (128, 8, 100_000),
                                                                   (256, 16, 100_000), (512, 64, 100_000)]
    assert [(c.seq_len, c.pairs, c.examples) for c in p.test] == [(64, 4, 3000), (128, 8, 3000), (256, 16, 3000),
                                                                  (512, 64, 3000)]
    assert [p.batch_for(n) for n in (64, 128, 256, 512)] == [512, 512, 256, 128]
    assert p.widths == (64, 128, 256, 512)
    assert p.lrs == pytest.approx((1e-4, 4.6416e-4, 2.1544e-3, 1e-2), rel=1e-4)
    assert (p.depth, p.heads, p.max_epochs, p.threshold, p.weight_decay) == (2, 1, 64, 0.99, 0.1)
    assert (p.power_a, p.random_non_queries, p.mixture, p.evals_per_epoch) == (0.01, False, False, 1)


def test_based_preset_is_the_papers_configuration() -> None:
    """HazyResearch/zoology@d88d6f5, zoology/experiments/paper_configs/arxiv24_based_figure2/configs.py:
    train (64, 4) x 100_000, (128, 8), (256, 16), (256, 32), (256, 64) x 20_000; test (64, 4), (64, 8),
    (64, 16), (128, 32), (256, 64), (512, 128), (1024, 256) x 1_000; batch_size 256; lr
    np.logspace(-3, -1.5, 4); max_epochs 32; n_layers 2; MQARConfig defaults: power_a 0.01,
    random_non_queries True; based d_model 48, 64, 128."""
    p = presets.PRESETS["based-fig2"]
    assert [(c.seq_len, c.pairs, c.examples) for c in p.train] == [(64, 4, 100_000), (128, 8, 20_000),
                                                                   (256, 16, 20_000), (256, 32, 20_000),
                                                                   (256, 64, 20_000)]
    assert [(c.seq_len, c.pairs) for c in p.test] == [(64, 4), (64, 8), (64, 16), (128, 32), (256, 64), (512, 128),
                                                      (1024, 256)]
    assert all(c.examples == 1000 for c in p.test)
    assert p.batch_for(64) == p.batch_for(256) == 256
    assert p.lrs == pytest.approx((1e-3, 3.1623e-3, 1e-2, 3.1623e-2), rel=1e-4)
    assert (p.max_epochs, p.depth, p.vocab, p.power_a, p.random_non_queries, p.mixture) == (32, 2, 8192, 0.01,
                                                                                             True, True)
    assert p.widths == (48, 64, 128)


def test_lr_grid_is_logspace() -> None:
    assert presets.lr_grid(-4, -2, 4) == pytest.approx([10 ** (-4 + 2 * i / 3) for i in range(4)])
    assert presets.lr_grid(-3, -3, 1) == (1e-3,)


def test_reduced_budget_states_its_cuts_and_keeps_the_data_semantics() -> None:
    full = presets.PRESETS["zoology-fig2"]
    r = presets.budget(full, "reduced")
    assert r.size == "reduced" and r.notes
    assert [(c.seq_len, c.pairs) for c in r.train] == [(64, 4), (128, 8)]  # fewer lengths
    assert r.widths == (64, 128) and r.lrs == presets.REDUCED_LRS == (1e-3, 1e-2)
    for name in presets.PRESETS:  # inside each paper's learning-rate range, and on Based's grid
        paper = presets.PRESETS[name]
        assert min(paper.lrs) <= min(r.lrs) and max(r.lrs) <= max(paper.lrs) + 1e-12
        assert presets.budget(paper, "reduced").lrs == r.lrs
    assert set(r.lrs) <= {round(x, 12) for x in presets.PRESETS["based-fig2"].lrs}
    assert sum(c.examples for c in r.train) == 2 * 192_000 and r.max_epochs == 1 and r.evals_per_epoch == 8
    assert (r.vocab, r.power_a, r.threshold, r.random_non_queries) == (8192, 0.01, 0.99, False)
    assert presets.budget(full, "full") is full
    with pytest.raises(ValueError, match="size"):
        presets.budget(full, "medium")


def test_published_points_are_complete() -> None:
    z = presets.PUBLISHED["zoology-fig2"]
    for line in ("Attention", "Hyena", "RWKV", "H3", "BaseConv"):
        assert sorted(z[line]) == [64, 128, 256, 512]
        assert all(len(v) == 4 and all(0 <= a <= 1 for a in v) for v in z[line].values())
    assert all(0 <= a <= 1 and 10 < x < 23 for pts in presets.PUBLISHED["based-fig2"].values() for x, a in pts)


# --------------------------------------------------------------------------- the data generator
def _reference_sequence(keys: list[int], values: list[int], gaps: list[int], seq_len: int) -> tuple[list[int], list[int]]:
    """Zoology's layout written as a token loop: pairs, then key i at slot gaps[i] of the query region."""
    x = [0] * seq_len
    y = [IGNORE] * seq_len
    ctx = 2 * len(keys)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        x[2 * i], x[2 * i + 1] = k, v
    for k, v, g in zip(keys, values, gaps, strict=True):
        x[ctx + 2 * g] = k
        y[ctx + 2 * g] = v
    return x, y


def test_paper_mqar_layout_equals_the_token_loop_reference() -> None:
    N, K, V = 64, 4, 512
    x, y = presets.paper_mqar(300, N, K, V, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (300, N)
    for row in range(300):
        xs, ys = x[row].tolist(), y[row].tolist()
        keys, values = xs[0:2 * K:2], xs[1:2 * K:2]
        gaps = [(xs.index(k, 2 * K) - 2 * K) // 2 for k in keys]  # where each key is queried
        assert (xs, ys) == _reference_sequence(keys, values, gaps, N)


def test_paper_mqar_statistics() -> None:
    N, K, V, B = 128, 8, 1024, 2000
    x, y = presets.paper_mqar(B, N, K, V, torch.Generator().manual_seed(1))
    keys, values = x[:, 0:2 * K:2], x[:, 1:2 * K:2]
    # keys distinct from 1 .. V/2 - 1, values distinct from V/2 .. V - 1 (multiquery_ar's key/value choices)
    assert int(keys.min()) >= 1 and int(keys.max()) <= V // 2 - 1
    assert int(values.min()) >= V // 2 and int(values.max()) <= V - 1
    assert all(len(set(r)) == K for r in keys.tolist()) and all(len(set(r)) == K for r in values.tolist())
    scored = y != IGNORE
    assert scored.sum(1).eq(K).all()  # every key queried exactly once
    pos = scored.nonzero()[:, 1].view(B, K)
    assert ((pos - 2 * K) % 2 == 0).all() and (pos >= 2 * K).all()  # in the query region, at a slot's first token
    # no query before its key: every query sits after the whole context, so after its key (and value)
    for b in range(0, B, 97):
        for p in pos[b].tolist():
            k = int(x[b, p])
            key_at = x[b, :2 * K].tolist().index(k)
            assert key_at < p and int(y[b, p]) == int(x[b, key_at + 1])
    # the query gaps follow the power law p(g) ~ g^(a - 1), a = 0.01: mostly right after the context
    gaps = ((pos - 2 * K) // 2).flatten().double()
    space = (N - 2 * K) // 2
    uniform_mean = (space - 1) / 2
    assert float(gaps.mean()) < 0.6 * uniform_mean  # measured 0.52 x for seed 1
    first = ((pos - 2 * K) // 2 == 0).any(1).double().mean()  # slot 0 queried: 8/56 = 14% if uniform
    assert float(first) > 0.5
    # everything else is the filler 0 (random_non_queries=False)
    filler = torch.ones_like(x, dtype=torch.bool)
    filler[:, :2 * K] = False
    filler.scatter_(1, pos, False)
    assert (x[filler] == 0).all()


def test_random_non_queries_replace_only_the_filler() -> None:
    g0, g1 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a, ya = presets.paper_mqar(64, 64, 4, 256, g0)
    b, yb = presets.paper_mqar(64, 64, 4, 256, g1, random_non_queries=True)
    assert torch.equal(ya, yb)
    assert torch.equal(a[a != 0], b[a != 0])
    assert float((b[a == 0] != 0).double().mean()) > 0.9


def test_paper_mqar_rejects_impossible_settings() -> None:
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="seq_len"):
        presets.paper_mqar(2, 63, 4, 256, g)
    with pytest.raises(ValueError, match="vocab"):
        presets.paper_mqar(2, 64, 4, 64, g)


def test_pool_batches_are_a_pure_function_of_seed_and_step_and_reshuffle_per_epoch() -> None:
    task = presets.PaperMQAR((presets.MQARCell(32, 2, 40),), (presets.MQARCell(32, 2, 8),), vocab_size=64, seed=5)
    assert task.steps_per_epoch(16) == 2
    x0, _ = task.batch(0, 16, 5)
    assert torch.equal(x0, task.batch(0, 16, 5)[0])
    seen = torch.cat([task.batch(s, 16, 5)[0] for s in range(2)])  # epoch 0: 32 distinct pool rows
    assert len({tuple(r) for r in seen.tolist()}) == 32
    assert not torch.equal(task.batch(2, 16, 5)[0], x0)  # epoch 1 is another order
    # train and test are different draws (distinct streams)
    assert not torch.equal(task.train_x[:8], task.tests[0][1])


def test_mixture_pads_shorter_segments_with_ignored_targets() -> None:
    task = presets.PaperMQAR((presets.MQARCell(32, 2, 8), presets.MQARCell(64, 4, 8)), (presets.MQARCell(32, 2, 4),), vocab_size=128)
    assert task.train_x.shape == (16, 64)
    assert (task.train_y[:8, 32:] == IGNORE).all() and (task.train_x[:8, 32:] == 0).all()


# --------------------------------------------------------------------------- runs, sweep, early stop
def _tiny_preset(**over: object) -> object:
    return replace(presets.budget(presets.PRESETS["zoology-fig2"], "quick"), **over)


def test_cosine_epoch_lr_matches_torch_scheduler() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5, eta_min=0.0)
    for epoch in range(5):
        assert sweep.cosine_epoch_lr(0.01, epoch, 5) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12)
        opt.step()
        sched.step()


def test_early_stop_at_the_threshold_and_full_budget_otherwise() -> None:
    p = _tiny_preset(threshold=-1.0)  # every evaluation exceeds it: stop after the first
    spec = sweep.RunSpec(p.name, p.size, "mha", 16, "64/4", 1e-2)
    r = sweep.train_run(p, spec)
    assert r["stopped_early"] and len(r["evals"]) == 1 and r["steps"] == r["steps_per_epoch"]
    p = _tiny_preset(threshold=1.5)  # unreachable: every epoch runs
    r = sweep.train_run(p, spec)
    assert not r["stopped_early"] and len(r["evals"]) == p.max_epochs
    assert r["steps"] == p.max_epochs * r["steps_per_epoch"]
    again = sweep.train_run(p, spec)
    assert again["evals"] == r["evals"]  # deterministic
    assert r["state_bytes"] > 0 and math.isfinite(r["final"]["val_loss"])


def test_scored_head_equals_the_full_logits_loss() -> None:
    p = _tiny_preset()
    model = sweep.preset_model("mha", 16, 2, 1, p.vocab, 64, 0)
    x, y = presets.paper_mqar(4, 64, 4, p.vocab, torch.Generator().manual_seed(0))
    hidden = model(x)  # [B, N, C]
    full = hidden @ model.tok_emb.weight.t()  # [B, N, V]
    ref = torch.nn.functional.cross_entropy(full.flatten(0, 1).double(), y.flatten(), ignore_index=IGNORE)
    logits, scored = presets.scored_logits(model, x, y)
    got = torch.nn.functional.cross_entropy(logits.double(), y[scored])
    assert float(got.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    assert all(isinstance(b.ffn, torch.nn.Identity) for b in model.blocks)  # Zoology: no MLP


def test_best_of_takes_the_maximum_over_learning_rates() -> None:
    def rec(lr: float, acc: float) -> dict[str, object]:
        spec = {"variant": "mha", "width": 64, "train": "64/4", "window": None, "lr": lr}
        return {"spec": spec, "final": {"accuracy": acc, "by_segment": {"64/4": acc}}, "stopped_early": acc > 0.99,
                "evals": [{"epoch": 1}], "state_bytes": 10, "state_seq_len": 64, "params": 5}

    pts = sweep.best_of([rec(1e-3, 0.4), rec(1e-2, 0.9), rec(3e-3, 0.9)])
    assert len(pts) == 1 and pts[0]["accuracy"] == 0.9 and pts[0]["best_lr"] == 3e-3  # tie: smaller lr
    assert not pts[0]["at_lr_edge"]
    assert sweep.best_of([rec(1e-3, 0.1), rec(1e-2, 0.9)])[0]["at_lr_edge"]


def _fake_record(spec: sweep.RunSpec, accuracy: float) -> dict[str, object]:
    return {"spec": {**spec.__dict__}, "key": spec.key, "final": {"accuracy": accuracy, "by_segment": {}},
            "stopped_early": accuracy > 0.99, "evals": [{"epoch": 1}], "state_bytes": 1}


def test_sweep_points_order_the_learning_rates_from_the_largest() -> None:
    p = presets.budget(presets.PRESETS["zoology-fig2"], "reduced")
    specs = sweep.preset_runs(p)
    points = sweep.sweep_points(specs)
    assert len(points) == len(p.variants) * len(p.train) * len(p.widths)
    assert sorted(i for pt in points for i in pt) == list(range(len(specs)))
    for pt in points:
        assert len({specs[i].point for i in pt}) == 1
        assert [specs[i].lr for i in pt] == sorted(p.lrs, reverse=True)


def test_point_cost_puts_the_longest_widest_point_first() -> None:
    """run_preset trains points costliest first (the longest run starts at once under --jobs)."""
    p = presets.budget(presets.PRESETS["zoology-fig2"], "reduced")
    specs = sweep.preset_runs(p)
    costs = {(s.width, s.train): sweep.point_cost(p, s) for s in specs}
    longest, widest = max(int(t.split("/")[0]) for _, t in costs), max(w for w, _ in costs)
    top = max(costs, key=costs.__getitem__)
    assert top == (widest, next(t for _, t in costs if int(t.split("/")[0]) == longest))
    assert costs[(64, "64/4")] < costs[(64, "128/8")] < costs[(128, "128/8")]
    b = presets.budget(presets.PRESETS["based-fig2"], "reduced")
    assert all(sweep.point_cost(b, s) > 0 for s in sweep.preset_runs(b))  # the mixture has a cost too


def test_run_point_skips_smaller_rates_once_one_passes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    p = presets.budget(presets.PRESETS["zoology-fig2"], "reduced")
    specs = [sweep.RunSpec(p.name, p.size, "mha", 64, "64/4", lr) for lr in (1e-2, 3e-3, 1e-3)]
    trained: list[float] = []

    def fake(p_: object, spec: sweep.RunSpec, device: str, out: str) -> dict[str, object]:
        trained.append(spec.lr)
        return _fake_record(spec, {1e-2: 0.3, 3e-3: 0.995, 1e-3: 0.999}[spec.lr])

    monkeypatch.setattr(sweep, "_run_in_worker", fake)
    recs = sweep.run_point(p, specs, [None, None, None], "cpu", str(tmp_path))
    assert trained == [1e-2, 3e-3] and recs[2] is None  # 1e-3 skipped: 3e-3 passed 0.99
    assert [r["final"]["accuracy"] for r in recs if r] == [0.3, 0.995]
    trained.clear()  # --resume: a reused record that passed stops the point without training
    recs = sweep.run_point(p, specs, [_fake_record(specs[0], 0.995), None, None], "cpu", str(tmp_path))
    assert trained == [] and recs[1] is None and recs[2] is None
    recs = sweep.run_point(p, specs, [_fake_record(specs[0], 0.2), None, None], "cpu", str(tmp_path))
    assert trained == [3e-3] and recs[0]["final"]["accuracy"] == 0.2  # type: ignore[index]


def test_preset_runs_cover_the_sweep() -> None:
    p = presets.budget(presets.PRESETS["zoology-fig2"], "reduced")
    runs = sweep.preset_runs(p)
    assert len(runs) == len(p.variants) * len(p.train) * len(p.widths) * len(p.lrs)
    assert len({r.key for r in runs}) == len(runs)
    b = presets.budget(presets.PRESETS["based-fig2"], "reduced")
    sliding = [r for r in sweep.preset_runs(b, ["sliding"])]
    assert {r.window for r in sliding} == {8, 32} and {r.train for r in sliding} == {"mixture"}


def test_run_preset_quick_resume_reuses_every_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "z"
    argv = ["--preset", "zoology-fig2", "--quick", "--variants", "mha", "--jobs", "1", "--progress", "none",
            "--out", str(out)]
    assert run_arena(_args(*argv)) == 0
    first = json.loads((out / "preset.json").read_text())
    assert first["reused"] == 0 and len(first["runs"]) == 2 and (out / "report.md").is_file()
    assert run_arena(_args(*argv, "--resume")) == 0
    second = json.loads((out / "preset.json").read_text())
    assert second["reused"] == 2 and second["points"] == first["points"]
    assert "## Against the paper" in (out / "report.md").read_text()


def test_comparison_with_the_paper() -> None:
    pt = {"variant": "mha", "width": 64, "train": "64/4", "accuracy": 0.95, "state_bytes": 2**19, "window": None}
    rows = compare_to_paper({"preset": "zoology-fig2", "points": [pt]})
    assert rows == [{"variant": "mha", "paper": "Attention", "where": "seq_len 64, width 64", "ours": 0.95,
                     "theirs": 0.97, "diff": pytest.approx(-0.02), "agree": True}]
    rows = compare_to_paper({"preset": "based-fig2", "points": [{**pt, "variant": "linear", "state_bytes": 2**14}]})
    assert rows[0]["paper"] == "Based" and rows[0]["theirs"] == pytest.approx(_interp(presets.PUBLISHED["based-fig2"]["Based"], 14))
    assert _interp([(1.0, 0.0), (3.0, 1.0)], 2.0) == pytest.approx(0.5)
    assert _interp([(1.0, 0.0), (3.0, 1.0)], 9.0) is None


# --------------------------------------------------------------------------- fair budgets, --lr-sweep
def test_should_stop() -> None:
    flat = [{"step": s, "accuracy": 0.30} for s in (100, 200, 300)]
    assert should_stop([{"step": 50, "accuracy": 0.995}], 50, 600, 1000)  # solved
    assert not should_stop(flat, 300, 600, 1000)  # flat but before the nominal presets.budget
    assert should_stop([*flat, {"step": 600, "accuracy": 0.31}] [-3:], 600, 600, 1000)
    rising = [{"step": s, "accuracy": a} for s, a in ((400, 0.3), (500, 0.4), (600, 0.5))]
    assert not should_stop(rising, 600, 600, 1000)  # still rising: goes on to the cap
    assert not should_stop(flat, 600, 1000, 1000)  # no cap beyond the presets.budget: fixed
    assert not should_stop([*flat[1:], {"step": 600, "accuracy": 0.31}], 600, 600, 1000, exact=True)  # plateau 100%


def test_sweep_lrs_and_best_record() -> None:
    assert sweep_lrs(3e-3) == (1e-3, 3e-3, 1e-2)
    assert sweep_lrs(5e-4)[0] == 5e-4
    recs = {lr: {"final": {"accuracy": a}} for lr, a in ((1e-3, 0.5), (3e-3, 0.9), (1e-2, 0.9))}
    best = best_lr_record(recs)
    assert best["best_lr"] == 3e-3 and best["lr_sweep"] == {"0.001": 0.5, "0.003": 0.9, "0.01": 0.9}


def test_adaptive_mqar_budget_is_the_default_and_steps_fix_it() -> None:
    s = settings_for("mqar", _args())
    assert s.max_steps > s.steps and s.horizon == s.max_steps
    assert settings_for("mqar", _args("--steps", "50")).horizon == 50


def test_lr_sweep_keeps_the_pinned_results_shape(tmp_path: Path) -> None:
    out = tmp_path / "a"
    assert run_arena(_args("--quick", "--task", "mqar", "--variants", "mha", "--lr-sweep", "--no-measure",
                           "--progress", "none", "--out", str(out))) == 0
    res = json.loads((out / "results.json").read_text())
    run = res["runs"]["mqar"]["mha"]
    assert 0.0 <= run["final"]["accuracy"] <= 1.0 and "val_loss" in run["final"]
    assert set(run["lr_sweep"]) == {"0.001", "0.003", "0.01"} and run["best_lr"] in (1e-3, 3e-3, 1e-2)
    assert run["final"]["accuracy"] == max(run["lr_sweep"].values())
    assert len(list((out / "runs").glob("mqar-mha-lr*.json"))) == 3


# --------------------------------------------------------------------------- hybrids
def test_hybrid_entries() -> None:
    assert check_entry(" gated_deltanet/mha ") == "gated_deltanet/mha"
    with pytest.raises(ValueError, match="nosuch"):
        check_entry("mha/nosuch")
    assert "window" not in entry_kwargs("sliding/mha", 64, 4, 8)
    assert entry_kwargs("sliding", 64, 4, 8) == {"window": 8}
    pattern = "gated_deltanet/gated_deltanet/gated_deltanet/mha"
    want = 3 * estimate("gated_deltanet", 512, 64, 4).kv_cache_bytes + estimate("mha", 512, 64, 4).kv_cache_bytes
    assert stack_cache_bytes(pattern, 512, 64, 4, 4, None) == pytest.approx(want)


def test_hybrid_runs_in_the_arena_with_its_verdict(tmp_path: Path) -> None:
    out = tmp_path / "h"
    variants = "gated_deltanet,gated_deltanet/mha,mha"
    assert run_arena(_args("--quick", "--task", "mqar", "--depth", "2", "--variants", variants, "--progress", "none",
                           "--out", str(out))) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["runs"]["mqar"]) == {"gated_deltanet", "gated_deltanet/mha", "mha"}
    for r in res["runs"]["mqar"].values():
        assert 0.0 <= r["final"]["accuracy"] <= 1.0
    curve = res["long_context"]["curves"]["gated_deltanet/mha"]
    one = {v: res["long_context"]["curves"][v] for v in ("gated_deltanet", "mha")}
    for i, pt in enumerate(curve):  # an average layer: the stack's cache is the sum of its layers'
        assert 2 * pt["cache_bytes"] == pytest.approx(one["gated_deltanet"][i]["cache_bytes"] + one["mha"][i]["cache_bytes"])
    pts = {p["variant"]: p for p in tradeoff_points(res)}
    assert pts["gated_deltanet"]["state_bytes"] < pts["gated_deltanet/mha"]["state_bytes"] < pts["mha"]["state_bytes"]
    answers = hybrid_answers(res)
    assert [a["question"] for a in answers] == ["hybrid gated_deltanet/mha"]
    assert "gated_deltanet alone" in answers[0]["text"]
    assert any(a["question"] == "hybrid gated_deltanet/mha" for a in res["verdict"])
    assert (out / "recall_vs_state.png").is_file() or "no plots" in (out / "report.md").read_text()
    assert isinstance(plateau_lines(res), list)
    assert list((out / "runs").glob("mqar-gated_deltanet+mha.json"))  # a '/' never makes a folder


def test_the_pinned_pattern_builds_its_softmax_layer_at_the_default_depth(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """DESIGN's CLI call names a 4-layer pattern; the default depth is shorter: the task deepens to it
    (every variant alike) instead of cycling the ``mha`` layer away and training without positions."""
    pattern = "gated_deltanet/gated_deltanet/gated_deltanet/mha"
    out = tmp_path / "p"
    assert run_arena(_args("--quick", "--task", "lm", "--variants", f"{pattern},mha", "--steps", "2",
                           "--no-measure", "--progress", "plain", "--out", str(out))) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["lm"]["depth"] == 4 and res["settings"]["lm"]["pos"] == "rope"
    assert "depth 1 -> 4" in capsys.readouterr().err
    s = arena_runner.settings_for("lm", _args("--quick"))
    model = arena_runner.build_model(replace(s, depth=4), pattern, 65, 0)
    assert [type(b.attn).__name__ for b in model.blocks][-1] == "MultiHeadAttention"
    assert model.blocks[-1].attn.rope is not None  # the softmax layer got its RoPE
    deep, notes = arena_runner.deepen_for_patterns({"lm": s}, [pattern], depth_given=True)
    assert deep["lm"].depth == s.depth and "only the first 1 layer(s)" in notes[0]


def test_hybrid_preset_model_builds_one_variant_per_layer() -> None:
    m = sweep.preset_model("gated_deltanet/mha", 16, 2, 1, 64, 32, 0)
    kinds = [type(b.attn).__name__ for b in m.blocks]
    assert kinds[0] != kinds[1] and kinds[1] == "MultiHeadAttention"
    x = torch.randint(0, 64, (2, 32), generator=batch_generator(0, 1, 0))
    assert m(x).shape == (2, 32, 16)
