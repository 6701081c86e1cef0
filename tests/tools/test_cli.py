"""The `attnzoo` command: every command runs at small sizes and writes what it says."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnzoo.cli import main
from attnzoo.variants import variant_names

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COMMANDS = ["list", "check", "bench", "cost", "viz", "arena"]


def _png_ok(p: Path, min_bytes: int = 10_000) -> bool:
    data = p.read_bytes()
    return data[:8] == PNG_MAGIC and len(data) >= min_bytes


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_command_has_help(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([cmd, "--help"]) == 0
    assert "usage: attnzoo " + cmd in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["nope"],
        ["list", "--dim", "0"],
        ["cost", "nope"],
        ["cost", "mha", "--window", "a,b"],
        ["cost", "gqa", "--kv-heads", "3"],
        ["check", "--backends", "magic"],
        ["check", "--dtypes", "int8"],
        ["bench", "--seq-lens", "0"],
        ["bench", "--variants", "nope"],
        ["bench", "--mode", "sideways"],
        ["viz"],
        ["viz", "--mask", "causal & foo(2)"],
        ["viz", "--positional", "rope"],
        ["check", "--device", "banana"],
        ["bench", "--device", "nowhere:0"],
        ["bench", "--warmup", "-1"],
        ["bench", "--max-case-seconds", "-1"],
        ["bench", "--max-case-seconds", "nan"],
        ["bench", "--max-case-seconds", "inf"],
    ],
)
def test_bad_arguments_one_line_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnzoo") and "error:" in err
    assert len(err.splitlines()) == 1, err


def test_list_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--json", "--dim", "256", "--heads", "8", "--dtype", "float16"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {v["name"]: v for v in data["variants"]}
    assert set(rows) == set(variant_names())  # every registered variant, nothing pinned here
    assert all(rows[n]["kv_cache_bytes_per_token"] == 0 for n in ("retnet", "gla", "deltanet", "mamba2"))
    assert rows["mha"]["kv_cache_bytes_per_token"] == 2 * 8 * 32 * 2
    assert rows["mqa"]["kv_cache_bytes_per_token"] == 2 * 1 * 32 * 2
    assert rows["linear"]["kv_cache_bytes_per_token"] == 0
    assert rows["streaming"]["kv_cache_max_tokens"] == 4 + 64  # sinks + window (the new token comes with the call)
    for key in ("family", "exact", "time", "memory", "decoding", "masks", "kv_cache_bytes"):
        assert key in rows["gqa"]


def test_list_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--plain"]) == 0
    out = capsys.readouterr().out
    for name in ("mha", "local_global", "performer", "KV bytes/token"):
        assert name in out


def test_cost_json_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cost", "sliding", "-n", "1024", "--dim", "128", "--heads", "4", "--window", "32", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("flops", "flops_useful", "bytes_moved", "activation_bytes", "kv_cache_bytes_per_token",
                "kv_cache_bytes", "params"):
        assert key in d
    assert d["kv_cache_max_tokens"] == 32 and d["seq_len"] == 1024


def test_cost_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cost", "gqa", "--plain"]) == 0
    assert "forward FLOPs" in capsys.readouterr().out


def test_check_passes_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "check.json"
    rc = main(["check", "--quick", "--backends", "reference,sdpa", "--dtypes", "float32",
               "--variants", "mha", "--no-models", "--json", str(out), "--plain", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "OK:" in text
    data = json.loads(out.read_text())
    assert data["ok"] is True
    assert {r["target"] for r in data["rows"]} >= {"reference", "sdpa", "mha"}


def test_check_exit_code_reflects_failure(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import attnzoo.functional.backends.sdpa as sdpa_mod

    real = sdpa_mod.sdpa_attention
    monkeypatch.setattr(sdpa_mod, "sdpa_attention", lambda r: real(r) + 1e-2)
    rc = main(["check", "--quick", "--backends", "sdpa", "--dtypes", "float32", "--no-variants", "--no-grad",
               "--plain", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL" in out and "FAILED" in out


def test_bench_writes_csv_json_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--backends", "torch,sdpa", "--variants", "gqa", "--seq-lens", "64,128", "--heads", "2",
               "--head-dim", "16", "--repeats", "2", "--peak-size", "512", "--out", str(tmp_path), "--plain",
               "--no-progress"])
    assert rc == 0, capsys.readouterr()
    with (tmp_path / "bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and {r["target"] for r in rows} == {"torch", "sdpa", "gqa"}
    assert all(r["status"] == "ok" and float(r["time_ms"]) > 0 and float(r["peak_mem_mb"]) > 0 for r in rows)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["meta"]["matmul_peak_gflops"] > 0 and "memory_method" in data["meta"]
    assert {"seq_len", "time_ms", "peak_mem_mb", "gflops", "frac_of_peak"} <= set(data["results"][0])
    assert _png_ok(tmp_path / "bench.png")


def test_bench_fwd_bwd_bf16(tmp_path: Path) -> None:
    rc = main(["bench", "--backends", "sdpa", "--seq-lens", "64", "--heads", "2", "--head-dim", "16", "--repeats",
               "1", "--mode", "fwd+bwd", "--dtype", "bfloat16", "--window", "8", "--peak-size", "256", "--out", str(tmp_path),
               "--no-plot", "--plain", "--no-progress"])
    assert rc == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    r = data["results"][0]
    assert r["mode"] == "fwd+bwd" and r["dtype"] == "bfloat16" and r["status"] == "ok"
    assert not (tmp_path / "bench.png").exists()


def test_viz_mask_text_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "mask.png"
    assert main(["viz", "--mask", "causal & window(4,0)", "--n", "16", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "█████···········" in out  # query 4 sees keys 0..4
    assert _png_ok(png)


def test_viz_positional_png(tmp_path: Path) -> None:
    png = tmp_path / "pos.png"
    assert main(["viz", "--positional", "all", "--n", "64", "--dim", "32", "--png", str(png)]) == 0
    assert _png_ok(png)


def test_viz_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from attnzoo.arena.runner import _QUICK, _build_model, _signature
    from attnzoo.arena.tasks import ShakespeareTask
    from attnzoo.arena.trainer import save_checkpoint

    s = _QUICK["lm"]
    model = _build_model(s, "mha", ShakespeareTask(seq_len=s.seq_len).vocab_size, 0, torch.device("cpu"))
    ckpt = tmp_path / "lm-mha.pt"
    save_checkpoint(ckpt, model, torch.optim.SGD(model.parameters(), lr=0.1), 0,
                    {"signature": _signature(s, "mha", 0, 1), "losses": [], "evals": []})
    png = tmp_path / "attn.png"
    assert main(["viz", "--model", str(ckpt), "--text", "Ham. What", "--png", str(png)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert _png_ok(png, 5_000)
    assert main(["viz", "--model", str(ckpt), "--text", "Ham.", "--png", str(png), "--layer", "9"]) == 2


def test_python_dash_m_runs_and_the_cli_imports_no_optional_extra() -> None:
    r = subprocess.run([sys.executable, "-m", "attnzoo", "cost", "mqa", "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["num_kv_heads"] == 1
    code = ("import sys, attnzoo.cli; bad = [m for m in ('matplotlib', 'transformers', 'rich') "
            "if m in sys.modules]; print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr


def test_docs_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/cli.md block {i}", "exec"), {})
    assert (tmp_path / "bench-out" / "bench.csv").exists() and (tmp_path / "attn.png").exists()


def test_bench_default_targets(tmp_path: Path) -> None:
    rc = main(["bench", "--seq-lens", "32", "--heads", "1", "--head-dim", "8", "--repeats", "1", "--no-memory",
               "--peak-size", "256", "--no-plot", "--out", str(tmp_path), "--plain", "--no-progress"])
    assert rc == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [r["target"] for r in data["results"]] == ["torch", "sdpa", "tiled"]


def test_rich_table_on_a_terminal_plain_without_rich(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import attnzoo.cli as cli

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    cli.print_table("T", ["a", "b"], [[1, "x"]])
    rich_out = capsys.readouterr().out
    assert "┃" in rich_out or "│" in rich_out  # drawn by rich
    monkeypatch.setattr(cli, "_rich_console", lambda: None)  # as if rich were not installed
    cli.print_table("T", ["a", "b"], [[1, "x"]])
    plain = capsys.readouterr().out
    assert plain.splitlines()[1].split() == ["a", "b"] and "│" not in plain


# ----------------------------------------------------------------------------- outputs, sizes, pipes
def _unwritable(tmp_path: Path) -> dict[str, str]:
    """Paths that cannot be written: below a regular file (portable), and in /proc (Linux)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return {"file": str(blocker), "below_file": str(blocker / "x"),
            "proc": "/proc/attnzoo-x" if Path("/proc").is_dir() else str(blocker / "y")}


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--out", "{proc}", "--seq-lens", "32"],
        ["bench", "--out", "{file}", "--seq-lens", "32"],
        ["bench", "--out", "{below_file}", "--seq-lens", "32"],
        ["check", "--json", "{proc}/r.json", "--quick", "--backends", "reference", "--dtypes", "float32"],
        ["check", "--json", "{below_file}/r.json", "--quick", "--backends", "reference", "--dtypes", "float32"],
        ["viz", "--mask", "causal", "--png", "{proc}.png"],
        ["viz", "--mask", "causal", "--png", "{below_file}.png"],
        ["viz", "--positional", "rope", "--png", "{proc}/pos.png"],
        ["arena", "--quick", "--out", "{proc}"],
        ["arena", "--quick", "--out", "{file}"],
    ],
)
def test_unwritable_outputs_fail_before_any_work(argv: list[str], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    paths = _unwritable(tmp_path)
    argv = [a.format(**paths) for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "error:" in err and ("--out" in err or "--json" in err or "--png" in err)
    assert captured.out == ""  # nothing was measured, checked or drawn
    assert Path(paths["file"]).read_text() == "not a directory"


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--seq-lens", "1000000000", "--no-plot"],
        ["bench", "--variants", "mha", "--seq-lens", "64,1000000000", "--no-plot"],
        ["viz", "--mask", "causal", "--n", "10000000"],
    ],
)
def test_sizes_beyond_memory_are_refused(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if argv[0] == "bench":
        argv = [*argv, "--out", str(tmp_path)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "memory" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert captured.out == ""
    assert not (tmp_path / "bench.csv").exists()


def test_a_closed_pipe_is_no_traceback() -> None:
    """`attnzoo cost mha | head -1`: the reader goes away before the table is written."""
    p = subprocess.Popen([sys.executable, "-m", "attnzoo", "cost", "mha", "--plain"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # like `head -1` after its line, only earlier: every write fails
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_outputs_in_missing_folders_are_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "new" / "deeper" / "mask.png"
    assert main(["viz", "--mask", "causal", "--n", "4", "--png", str(png)]) == 0
    assert _png_ok(png, 1_000)
    out = tmp_path / "also-new" / "check.json"
    assert main(["check", "--quick", "--backends", "reference", "--dtypes", "float32", "--no-variants",
                 "--no-grad", "--json", str(out), "--plain", "--no-progress"]) == 0
    assert json.loads(out.read_text())["ok"] is True
    capsys.readouterr()
    refused = tmp_path / "refused"
    assert main(["bench", "--seq-lens", "1000000000", "--out", str(refused)]) == 2
    assert not refused.exists()  # a refused run leaves nothing behind


def test_cost_and_bench_take_a_stack(tmp_path, capsys) -> None:
    """`attnzoo cost a/b/c` prints one row per layer and the total; bench runs a stack as one target."""
    from attnzoo.cli import main
    assert main(["cost", "gla/mha", "-n", "256", "--dim", "64", "--heads", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["pattern"] == "gla/mha" and len(data["layers"]) == 2
    assert data["flops"] == sum(layer["flops"] for layer in data["layers"])
    assert main(["bench", "--variants", "gla/mha", "--seq-lens", "64", "--repeats", "1", "--warmup", "0",
                 "--heads", "2", "--head-dim", "8", "--no-memory", "--no-plot", "--no-progress",
                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert [r["target"] for r in rows["results"]] == ["gla/mha"]
