"""``attnzoo bench --compile``: compile time, compiled and eager medians timed interleaved, their ratio
in CSV/JSON and the table; ``attnzoo arena --compile``: compiled training steps. Tiny sizes; most tests compile with the ``eager`` backend (what is tested is
the plumbing), one slow test runs inductor."""

import argparse
import contextlib
import csv
import functools
import json
from pathlib import Path

import pytest
import torch

from attnzoo.arena import MQARTask, TrainConfig, add_arena_arguments, train
from attnzoo.bench.measure import time_eager_and_compiled
from attnzoo.bench.run import run_bench
from attnzoo.cli import main
from attnzoo.models import DecoderLM

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(seq_lens=(32,), heads=2, head_dim=8, repeats=2, peak_max_n=256, memory=False)


@pytest.fixture
def eager_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))


def test_time_eager_and_compiled_interleaves_and_times_the_first_call() -> None:
    calls: list[str] = []
    compile_s, eager, compiled = time_eager_and_compiled(lambda: calls.append("e"), lambda: calls.append("c"),
                                                         repeats=3, warmup=1)
    assert calls == ["c"] + ["e", "c"] * 4  # first compiled call, one warm-up pair, three timed pairs
    assert len(eager) == len(compiled) == 3 and compile_s >= 0


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_run_bench_compile_reports_compile_time_and_ratio(mode: str, eager_compile: None) -> None:
    report = run_bench(["tiled", "variant:mha"], mode=mode, window=8, compile=True, **TINY)
    assert report.meta["compile"] is True
    for r in report.results:
        assert r.status == "ok", r.status
        assert r.compile_s is not None and r.compile_s > 0
        assert r.eager_ms is not None and r.eager_ms > 0 and r.time_ms is not None
        assert r.compiled_over_eager == pytest.approx(r.time_ms / r.eager_ms, rel=0.5)


def test_run_bench_without_compile_leaves_the_columns_empty() -> None:
    report = run_bench(["sdpa"], **TINY)
    assert report.meta["compile"] is False
    r = report.results[0]
    assert r.status == "ok" and r.compile_s is None and r.eager_ms is None and r.compiled_over_eager is None


def test_run_bench_times_flex_even_where_its_memory_cannot_be_measured() -> None:
    """FlexAttention's higher-order operator refuses the CPU memory tracker's dispatch mode: the case
    still reports its time (before, the whole row was an error), and says why memory is missing."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    report = run_bench(["flex"], **{**TINY, "seq_lens": (128,), "memory": True})
    r = report.results[0]
    assert r.status.startswith("ok"), r.status
    assert r.time_ms is not None and r.time_ms > 0
    assert (r.peak_mem_mb is None) == ("peak memory not measured" in r.status)


def test_cli_bench_compile_table_csv_json(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          eager_compile: None) -> None:
    rc = main(["bench", "--compile", "--backends", "sdpa", "--variants", "linear", "--seq-lens", "32", "--heads",
               "2", "--head-dim", "8", "--repeats", "2", "--peak-size", "256", "--no-memory", "--out",
               str(tmp_path), "--no-plot", "--plain", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "torch.compile" in out and "compile s" in out and "compiled/eager" in out
    with (tmp_path / "bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["target"] for r in rows} == {"sdpa", "linear"}
    assert all(float(r["compile_s"]) > 0 and float(r["compiled_over_eager"]) > 0 for r in rows)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["meta"]["compile"] is True and data["results"][0]["eager_ms"] > 0


def test_cli_bench_help_mentions_compile(capsys: pytest.CaptureFixture[str]) -> None:
    with contextlib.suppress(SystemExit):
        main(["bench", "--help"])
    assert "--compile" in capsys.readouterr().out


@pytest.mark.slow
def test_run_bench_compile_with_inductor(tmp_path: Path) -> None:
    report = run_bench(["tiled"], mode="fwd+bwd", window=8, compile=True, **TINY)
    r = report.results[0]
    assert r.status == "ok" and r.compile_s is not None and r.compiled_over_eager is not None


def _tiny_lm() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(32, 32, 1, 2, attention="sliding", max_seq_len=32)


def test_compiled_training_gives_the_eager_losses(monkeypatch: pytest.MonkeyPatch) -> None:
    task = MQARTask(seq_len=32, num_kv_pairs=4, vocab_size=32)
    want = train(_tiny_lm(), task, steps=4, global_batch=8, seed=3)
    compiled: list[torch.nn.Module] = []

    def spy(model: torch.nn.Module, **kw: object) -> torch.nn.Module:
        compiled.append(model)
        return torch._dynamo.optimize("aot_eager")(model)  # the forward and backward go through AOTAutograd

    monkeypatch.setattr(torch, "compile", spy)
    torch._dynamo.reset()
    got = train(_tiny_lm(), task, steps=4, global_batch=8, seed=3, config=TrainConfig(compile=True))
    assert len(compiled) == 1
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_arena_compile_flag_reaches_the_training_config() -> None:
    p = argparse.ArgumentParser()
    add_arena_arguments(p)
    assert p.parse_args(["--compile"]).compile is True and p.parse_args([]).compile is False
    assert "evaluation and decoding stay eager" in " ".join(p.format_help().split())
