"""The arena: tasks, trainer (determinism, resume, data parallel), measurements and the report."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import socket
from pathlib import Path

import pytest
import torch
from torch import nn

from attnzoo.arena import (
    MQARTask,
    ShakespeareTask,
    TrainConfig,
    add_arena_arguments,
    lr_at,
    run_arena,
    train,
)
from attnzoo.arena.grid import GRID, convergence_text, eval_steps, grid_jobs
from attnzoo.arena.measure import state_bytes, training_memory
from attnzoo.arena.progress import make_progress
from attnzoo.arena.tasks import IGNORE, load_shakespeare
from attnzoo.arena.trainer import StepInfo, load_checkpoint, make_optimizer, save_checkpoint
from attnzoo.arena.workers import worker_plan
from attnzoo.models import DecoderConfig, DecoderLM

# Tiny models gain nothing from a second thread, and on a shared machine OpenMP barriers between
# two threads can cost 30x (conftest.one_thread restores the setting afterwards).
pytestmark = pytest.mark.usefixtures("one_thread")


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arena_arguments(p)
    return p.parse_args(list(argv))


def _tiny(vocab: int, seq: int, attention: str = "mha", seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(vocab, 32, 1, 2, attention=attention, max_seq_len=seq)


# --------------------------------------------------------------------------- tasks
def test_shakespeare_split_is_disjoint_and_complete() -> None:
    task = ShakespeareTask(seq_len=64)
    plays = load_shakespeare()
    assert len(plays) == 7
    total = sum(len(t) for t in plays.values())
    assert task.train_ids.numel() + task.val_ids.numel() == total
    # the validation text is the tail of every play, in order
    val_text = "".join(t[int(len(t) * 0.9):] for t in plays.values())
    assert task.decode(task.val_ids) == val_text
    assert task.decode(task.encode("Ham.\nTo be")) == "Ham.\nTo be"
    assert task.vocab_size == len(set("".join(plays.values())))


def test_shakespeare_batches_are_next_characters_and_deterministic() -> None:
    task = ShakespeareTask(seq_len=16)
    x, y = task.batch(3, 4, seed=7)
    x2, y2 = task.batch(3, 4, seed=7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, task.batch(4, 4, seed=7)[0])
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    batches = task.val_batches()
    assert sum(b[0].shape[0] for b in batches) == task.eval_windows


def test_mqar_targets_are_the_values_of_the_queried_keys() -> None:
    task = MQARTask(seq_len=48, num_kv_pairs=6, vocab_size=40)
    x, y = task.batch(0, 32, seed=1)
    K = task.num_kv_pairs
    half = (task.vocab_size - 1) // 2
    for row in range(x.shape[0]):
        keys, values = x[row, 0:2 * K:2], x[row, 1:2 * K:2]
        assert len(set(keys.tolist())) == K, "keys must be distinct"
        assert bool(((keys >= 1) & (keys <= half)).all()) and bool((values > half).all())
        table = dict(zip(keys.tolist(), values.tolist(), strict=True))
        scored = (y[row] != IGNORE).nonzero().flatten()
        assert scored.numel() == K and bool((scored >= 2 * K).all())
        queried = x[row, scored].tolist()
        assert sorted(queried) == sorted(table), "every key is queried exactly once"
        assert [table[k] for k in queried] == y[row, scored].tolist()
        # the value follows its query key in the input too (the next query can build on it)
        nxt = scored + 1
        nxt = nxt[nxt < x.shape[1]]
        assert bool((x[row, nxt] > half).all())


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"seq_len": 16, "num_kv_pairs": 8}, "seq_len"),
    ({"num_kv_pairs": 20, "vocab_size": 30}, "vocab_size"),
    ({"num_kv_pairs": 0}, "num_kv_pairs"),
])
def test_mqar_rejects_impossible_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MQARTask(**kwargs)


def test_bad_task_arguments() -> None:
    with pytest.raises(TypeError, match="seq_len"):
        ShakespeareTask(seq_len=12.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="val_fraction"):
        ShakespeareTask(val_fraction=0.7)
    with pytest.raises(ValueError, match="outside the Shakespeare vocabulary"):
        ShakespeareTask(seq_len=8).encode("naïve")


# --------------------------------------------------------------------------- trainer
def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    cfg = TrainConfig(lr=1e-3, warmup=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert all(a < b for a, b in itertools.pairwise(lrs[:10]))
    assert lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert lr_at(100, 100, cfg) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr=0.0)


def test_training_is_deterministic_and_learns() -> None:
    task = MQARTask(seq_len=32, num_kv_pairs=4, vocab_size=32)
    runs = [train(_tiny(32, 32), task, steps=12, global_batch=16, seed=3) for _ in range(2)]
    assert runs[0] == runs[1]
    assert sum(runs[0][-3:]) < sum(runs[0][:3]), f"loss did not go down: {runs[0]}"
    other = train(_tiny(32, 32), task, steps=12, global_batch=16, seed=4)
    assert other != runs[0]


def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path: Path) -> None:
    task = ShakespeareTask(seq_len=24)
    cfg = TrainConfig(lr=2e-3, warmup=2)
    full_model = _tiny(task.vocab_size, 24)
    path = tmp_path / "ck.pt"

    def keep_step_4(step: int, opt: torch.optim.Optimizer) -> None:
        if step == 4:
            save_checkpoint(path, full_model, opt, step, {"n": step})

    full = train(full_model, task, steps=8, global_batch=4, seed=0, config=cfg, checkpoint=keep_step_4,
                 checkpoint_every=2)
    state = load_checkpoint(path)
    assert state["step"] == 4 and state["extra"] == {"n": 4}
    resumed_model = _tiny(task.vocab_size, 24, seed=123)  # different init: everything comes from the file
    resumed_model.load_state_dict(state["model"])
    opt = make_optimizer(resumed_model, cfg)
    opt.load_state_dict(state["optimizer"])
    rest = train(resumed_model, task, steps=8, global_batch=4, seed=0, config=cfg, start_step=4, optimizer=opt)
    assert full[4:] == rest, f"resumed losses {rest} != uninterrupted {full[4:]}"
    for (name, a), b in zip(full_model.state_dict().items(), resumed_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_train_rejects_bad_arguments() -> None:
    task = MQARTask(seq_len=16, num_kv_pairs=2, vocab_size=16)
    model = _tiny(16, 16)
    with pytest.raises(ValueError, match="steps"):
        train(model, task, steps=0, global_batch=4, seed=0)
    with pytest.raises(TypeError, match="global_batch"):
        train(model, task, steps=2, global_batch=4.0, seed=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start_step"):
        train(model, task, steps=2, global_batch=4, seed=0, start_step=3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        task = MQARTask(seq_len=32, num_kv_pairs=4, vocab_size=32)
        losses = train(_tiny(32, 32), task, steps=6, global_batch=8, seed=0)
        if rank == 0:
            Path(out).write_text(json.dumps(losses))
    finally:
        dist.destroy_process_group()


def test_data_parallel_matches_one_process(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    single = train(_tiny(32, 32), MQARTask(seq_len=32, num_kv_pairs=4, vocab_size=32), steps=6, global_batch=8,
                   seed=0)
    out = tmp_path / "ddp.json"
    # fork: the workers inherit the imported modules instead of importing torch again
    mp.start_processes(_ddp_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True, start_method="fork")
    ddp = json.loads(out.read_text())
    assert len(ddp) == len(single)
    for step, (a, b) in enumerate(zip(ddp, single, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-4), f"step {step}: 2 ranks {a} vs 1 process {b}"


def _cp_worker(rank: int, world: int, port: int, out: str, arena_out: str) -> None:
    import torch.distributed as dist

    from attnzoo.distributed import context_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        task = MQARTask(seq_len=32, num_kv_pairs=4, vocab_size=32)
        model = context_parallel(_tiny(32, 32, "gqa"), layout="zigzag")
        losses = train(model, task, steps=6, global_batch=4, seed=0, sequence_layout="zigzag")
        # the summed gradients give every rank the same update: parameters stay identical
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        copies = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(copies, flat)
        drift = max(float((c - copies[0]).abs().max()) for c in copies)
        if rank == 0:
            Path(out).write_text(json.dumps({"losses": losses, "param_drift": drift}))
        # the whole arena, sharded: report written by rank 0, evaluation through the ring
        run_arena(_args("--quick", "--context-parallel", "--variants", "mha,gqa", "--task", "mqar",
                        "--progress", "none", "--out", arena_out))
    finally:
        dist.destroy_process_group()


def test_context_parallel_training_matches_one_process(tmp_path: Path) -> None:
    """--context-parallel: 2 ranks, each with half of every sequence (zigzag), ring attention, summed
    gradients -> the loss curve of one process on the whole batch."""
    import torch.multiprocessing as mp

    single = train(_tiny(32, 32, "gqa"), MQARTask(seq_len=32, num_kv_pairs=4, vocab_size=32), steps=6,
                   global_batch=4, seed=0)
    out, arena_out = tmp_path / "cp.json", tmp_path / "arena"
    mp.start_processes(_cp_worker, args=(2, _free_port(), str(out), str(arena_out)), nprocs=2, join=True,
                       start_method="fork")
    cp = json.loads(out.read_text())
    assert cp["param_drift"] == 0.0, f"ranks' parameters drifted apart by {cp['param_drift']}"
    for step, (a, b) in enumerate(zip(cp["losses"], single, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-4), f"step {step}: 2 ranks (context parallel) {a} vs 1 process {b}"

    res = json.loads((arena_out / "results.json").read_text())
    one = tmp_path / "one"
    run_arena(_args("--quick", "--variants", "mha,gqa", "--task", "mqar", "--progress", "none", "--out", str(one)))
    ref = json.loads((one / "results.json").read_text())
    for v in ("mha", "gqa"):
        run = res["runs"]["mqar"][v]
        assert run["context_parallel"] == {"layout": "zigzag", "ranks": 2}
        for step, (a, b) in enumerate(zip(run["train_losses"], ref["runs"]["mqar"][v]["train_losses"], strict=True)):
            assert math.isclose(a, b, rel_tol=1e-4), f"{v} step {step}: {a} vs {b}"
        for a, b in zip(run["evals"], ref["runs"]["mqar"][v]["evals"], strict=True):
            assert math.isclose(a["val_loss"], b["val_loss"], rel_tol=1e-4), (v, a, b)
        # one rank holds half of every sequence's activations
        assert run["memory"]["activation_bytes"] < ref["runs"]["mqar"][v]["memory"]["activation_bytes"]


def test_context_parallel_rejects_variants_without_a_ring(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--context-parallel.*linear"):
        run_arena(_args("--quick", "--context-parallel", "--variants", "mha,linear", "--progress", "none",
                        "--out", str(tmp_path)))
    from attnzoo.arena.runner import CONTEXT_PARALLEL_VARIANTS, _parse_variants

    assert _parse_variants(None, True) == list(CONTEXT_PARALLEL_VARIANTS)
    with pytest.raises(ValueError, match="sequence_layout"):
        train(_tiny(32, 32), MQARTask(seq_len=32, num_kv_pairs=4, vocab_size=32), steps=1, global_batch=2, seed=0,
              sequence_layout="diagonal")


# --------------------------------------------------------------------------- measurements
def test_cache_bytes_follow_the_kv_heads() -> None:
    tokens = torch.randint(0, 20, (1, 24))
    torch.manual_seed(0)
    per = {}
    for name, kw in [("mha", {}), ("gqa", {"num_kv_heads": 1}), ("sliding", {"attention_kwargs": {"window": 7}})]:
        model = DecoderLM(config=DecoderConfig(20, 32, 2, 4, attention=name, max_seq_len=24, **kw)).eval()
        per[name] = state_bytes(model, tokens)
    # mha: K and V of 4 heads x 8 dims x 24 tokens x 2 layers in float32
    assert per["mha"] == 2 * 4 * 8 * 24 * 2 * 4
    assert per["gqa"] * 4 == per["mha"]
    assert per["sliding"] < per["mha"]
    with pytest.raises(ValueError, match=r"\[1, N\]"):
        state_bytes(DecoderLM(20, 32, 1, 4, max_seq_len=8), torch.zeros(2, 4, dtype=torch.long))


def test_training_memory_counts_state_and_grows_with_batch() -> None:
    task = ShakespeareTask(seq_len=32)
    model = _tiny(task.vocab_size, 32)
    small = training_memory(model, task, 2, 0, torch.device("cpu"))
    large = training_memory(model, task, 4, 0, torch.device("cpu"))
    assert small["state_bytes"] == 16 * model.num_parameters()
    assert large["activation_bytes"] == pytest.approx(2 * small["activation_bytes"], rel=0.05)
    assert all(p.grad is None for p in model.parameters())


class _DroppedBranch(torch.nn.Module):
    """A model that also computes, with gradients, a result it throws away (as a cache update the
    caller does not ask for): autograd frees what that branch saved before the backward pass."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.inner(tokens)
        for _ in range(3):
            (logits * logits).exp().sum()  # saves [B, N, V] tensors, then drops them
        return logits


def test_training_memory_counts_only_what_the_graph_keeps() -> None:
    task = ShakespeareTask(seq_len=32)
    model = _tiny(task.vocab_size, 32)
    plain = training_memory(model, task, 2, 0, torch.device("cpu"))
    dropped = training_memory(_DroppedBranch(model), task, 2, 0, torch.device("cpu"))
    assert dropped["activation_bytes"] == plain["activation_bytes"]


def test_progress_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    with make_progress("plain", "run", 2) as bar:
        bar.update(StepInfo(2, 2, 1.5, 1e-3, 1000.0))
    assert "step 2/2 loss 1.5000" in capsys.readouterr().err
    with make_progress("none", "run", 2) as bar:
        bar.update(StepInfo(1, 2, 1.5, 1e-3, 1000.0))
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="progress"):
        make_progress("fancy", "run", 2)


# --------------------------------------------------------------------------- the arena end to end
def test_quick_arena_writes_the_report_and_is_deterministic(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    argv = ("--quick", "--variants", "mha,sliding", "--progress", "none", "--window", "8")
    assert run_arena(_args(*argv, "--out", str(a))) == 0
    for name in ("report.md", "index.html", "results.json", "lm_curves.png", "mqar_accuracy.png",
                 "speed_memory.png"):
        assert (a / name).is_file(), name
    res = json.loads((a / "results.json").read_text())
    assert set(res["runs"]) == {"lm", "mqar"}
    md = (a / "report.md").read_text()
    for v in ("mha", "sliding"):
        assert f"| {v} |" in md
        assert "sample" in res["runs"]["lm"][v], res["runs"]["lm"][v].get("decode_error")
    assert "How to read this" in md and "data:image/png;base64," in (a / "index.html").read_text()
    # a smoke test says so; speeds come from the measurement pass; the verdict and long-context costs are there
    assert "Smoke test" in md and 'class="banner"' in (a / "index.html").read_text()
    assert set(res["measurements"]["variants"]) == {"mha", "sliding"} and "busy" in res["measurements"]
    assert {x["question"] for x in res["verdict"]} >= {"recall (MQAR)", "quality per parameter"}
    assert set(res["long_context"]["curves"]) == {"mha", "sliding"} and (a / "long_context.png").is_file()
    assert res["seed_runs"]["seeds"] == [0, 1] and "## Verdict" in md and "## Long-context cost" in md

    assert run_arena(_args(*argv, "--out", str(b))) == 0
    res_b = json.loads((b / "results.json").read_text())
    for t in ("lm", "mqar"):
        for v in ("mha", "sliding"):
            assert res["runs"][t][v]["train_losses"] == res_b["runs"][t][v]["train_losses"], (t, v)
            assert res["runs"][t][v]["evals"] == res_b["runs"][t][v]["evals"], (t, v)

    # --resume reuses finished runs as they are
    assert run_arena(_args(*argv, "--out", str(a), "--resume")) == 0
    res_c = json.loads((a / "results.json").read_text())
    assert res_c["runs"]["lm"]["mha"]["train_wall_s"] == res["runs"]["lm"]["mha"]["train_wall_s"]
    # ... and refuses a checkpoint made with other settings
    (a / "runs" / "lm-mha.json").unlink()
    with pytest.raises(ValueError, match=r"different settings \(steps: 12 -> 5, warmup: 3 -> 1, eval_every: 6 -> 5\)\."):
        run_arena(_args(*argv, "--out", str(a), "--resume", "--steps", "5"))


@pytest.mark.parametrize(("argv", "match"), [
    (("--variants", "mha,nope"), "--variants"),
    (("--variants", "mha,mha"), "twice"),
    (("--task", "mqar", "--mqar-pairs", "40", "--seq-len", "32"), "seq_len"),
    (("--device", "tpu9"), "--device"),
])
def test_run_arena_rejects_bad_settings(argv: tuple[str, ...], match: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=match):
        run_arena(_args("--quick", "--progress", "none", "--out", str(tmp_path), *argv))


def test_argument_parser_rejects_non_positive_numbers() -> None:
    with pytest.raises(SystemExit):
        _args("--steps", "0")
    with pytest.raises(SystemExit):
        _args("--lr", "-1")


@pytest.mark.parametrize("quick", [False, True])
def test_default_settings_build_valid_tasks(quick: bool) -> None:
    from attnzoo.arena.runner import _make_task, settings_for

    for t in ("lm", "mqar"):
        s = settings_for(t, _args(*(["--quick"] if quick else [])))
        task = _make_task(s)
        assert task.seq_len == s.seq_len and s.batch >= 1 and s.warmup < s.steps
    s = settings_for("mqar", _args("--steps", "30", "--mqar-pairs", "3", "--width", "48"))
    assert (s.steps, s.num_kv_pairs, s.width) == (30, 3, 48) and s.warmup <= 3 and s.eval_every <= 30
    assert settings_for("mqar", _args("--steps", "900", "--warmup", "300")).warmup == 300
    with pytest.raises(ValueError, match="--warmup"):
        settings_for("lm", _args("--steps", "10", "--warmup", "20"))


def test_two_models_differ_only_in_attention() -> None:
    from attnzoo.arena.runner import _build_model, settings_for

    s = settings_for("lm", _args("--quick"))
    a = _build_model(s, "mha", 50, 0, torch.device("cpu"))
    b = _build_model(s, "sliding", 50, 0, torch.device("cpu"))
    # same seed -> same initial weights wherever the parameter shapes agree
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    assert isinstance(a, nn.Module)


def test_docs_examples_run() -> None:
    import re

    page = Path(__file__).resolve().parents[2] / "docs" / "arena.md"
    found = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert found, "docs/arena.md has no python example"
    for i, code in enumerate(found):
        exec(compile(code, f"docs/arena.md[block {i}]", "exec"), {"__name__": "__doc_example__"})


# --------------------------------------------------------------------------- resume with damaged files
_RESUME_ARGV = ("--quick", "--task", "mqar", "--variants", "mha", "--progress", "none", "--steps", "6",
                "--checkpoint-every", "3")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("arena-resume") / "out"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module scope: set up outside the one_thread fixture
    try:
        assert run_arena(_args(*_RESUME_ARGV, "--out", str(out))) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def _wrong_shape(path: Path) -> None:
    state = torch.load(path, weights_only=True)
    name = next(k for k, v in state["model"].items() if v.dim() == 2)
    state["model"][name] = torch.zeros(3, 3)
    torch.save(state, path)


_DAMAGE = {
    "record truncated": ("runs/mqar-mha.json", lambda p: p.write_text(p.read_text()[:40])),
    "record garbage": ("runs/mqar-mha.json", lambda p: p.write_bytes(b"\x00\xff garbage")),
    "record without results": ("runs/mqar-mha.json",
                               lambda p: p.write_text(json.dumps({"signature": json.loads(p.read_text())["signature"]}))),
    "record is a list": ("runs/mqar-mha.json", lambda p: p.write_text("[1, 2]")),
    "checkpoint empty": ("checkpoints/mqar-mha.pt", lambda p: p.write_bytes(b"")),
    "checkpoint truncated": ("checkpoints/mqar-mha.pt", lambda p: p.write_bytes(p.read_bytes()[:200])),
    "checkpoint garbage": ("checkpoints/mqar-mha.pt", lambda p: p.write_bytes(b"not a checkpoint at all")),
    "checkpoint wrong shape": ("checkpoints/mqar-mha.pt", _wrong_shape),
    "checkpoint without losses": ("checkpoints/mqar-mha.pt",
                                  lambda p: torch.save({**torch.load(p, weights_only=True), "extra": {}}, p)),
}


@pytest.mark.parametrize("damage", list(_DAMAGE))
def test_resume_sets_damaged_files_aside_and_retrains(damage: str, finished_run: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    out = tmp_path / "out"
    shutil.copytree(finished_run, out)
    rel, spoil = _DAMAGE[damage]
    if rel.startswith("checkpoints"):  # the run must resume from its checkpoint, not reuse its record
        (out / "runs" / "mqar-mha.json").unlink()
    spoil(out / rel)
    capsys.readouterr()
    assert run_arena(_args(*_RESUME_ARGV, "--out", str(out), "--resume")) == 0
    err = capsys.readouterr().err
    assert "warning" in err and str(out / rel) in err and "set aside" in err, err
    assert (out / (rel + ".damaged")).exists()
    fresh = json.loads((out / "results.json").read_text())["runs"]["mqar"]["mha"]
    want = json.loads((finished_run / "results.json").read_text())["runs"]["mqar"]["mha"]
    # trained again from scratch, deterministically: the same curve as the undamaged run
    assert fresh["train_losses"] == want["train_losses"] and fresh["evals"] == want["evals"]
    assert json.loads((out / "runs" / "mqar-mha.json").read_text())["final"] == want["final"]


def test_run_records_are_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from attnzoo.arena import storage

    target = tmp_path / "runs" / "r.json"
    storage.write_atomic(target, '{"old": 1}')

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(storage.os, "replace", crash)
    with pytest.raises(OSError):
        storage.write_atomic(target, '{"new": 2}')
    assert json.loads(target.read_text()) == {"old": 1}  # the old record is whole
    assert [p.name for p in target.parent.iterdir()] == ["r.json"]  # no temporary file left


def test_arena_out_that_is_a_file_is_refused_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="--out"):
        run_arena(_args("--quick", "--progress", "none", "--out", str(blocker)))
    with pytest.raises(ValueError, match="--out"):
        run_arena(_args("--quick", "--progress", "none", "--out", str(blocker / "below")))


# --------------------------------------------------------------------------- mqar-grid
def _grid_argv(out: Path, *extra: str) -> tuple[str, ...]:
    return ("--task", "mqar-grid", "--quick", "--variants", "mha,linear", "--progress", "none", "--out", str(out),
            *extra)


def test_mqar_grid_writes_points_figure_and_smoke_report(tmp_path: Path) -> None:
    assert run_arena(_args(*_grid_argv(tmp_path, "--jobs", "1"))) == 0
    grid = json.loads((tmp_path / "grid.json").read_text())
    assert grid["errors"] == {} and grid["jobs"] == 1
    cells = {(p["variant"], p["width"], p["pairs"], p["seq_len"]) for p in grid["points"]}
    assert cells == {(v, w, 2, 16) for v in ("mha", "linear") for w in (16, 32)}
    assert all(0.0 <= p["accuracy"] <= 1.0 and p["state_bytes"] > 0 for p in grid["points"])
    for p in grid["points"]:  # evaluated half-way, at three quarters and at the end; the last is the accuracy
        assert [e["step"] for e in p["evals"]] == list(eval_steps(grid["grid"]["steps"]))
        assert p["accuracy"] == p["evals"][-1]["accuracy"] and isinstance(p["converged"], bool)
    assert {p["variant"]: p["sees_every_token"] for p in grid["points"]} == {"mha": True, "linear": False}
    report = (tmp_path / "report.md").read_text()
    assert "Smoke test" in report and report.count("| mha |") == 2 and "accuracy over training" in report
    pytest.importorskip("matplotlib")
    assert (tmp_path / "mqar_grid.png").stat().st_size > 0


def test_mqar_grid_parallel_workers_give_the_sequential_points(tmp_path: Path) -> None:
    """Two spawned workers with one thread each train the same cells as one process with one thread:
    every run is seeded by its cell, so the points are equal whatever order they finish in."""
    run_arena(_args(*_grid_argv(tmp_path / "seq", "--jobs", "1", "--threads", "1")))
    run_arena(_args(*_grid_argv(tmp_path / "par", "--jobs", "2", "--threads", "1")))
    seq, par = (json.loads((tmp_path / d / "grid.json").read_text()) for d in ("seq", "par"))
    assert par["jobs"] == 2 and seq["jobs"] == 1
    strip = [{k: v for k, v in p.items() if k != "train_wall_s"} for p in seq["points"]]
    assert strip == [{k: v for k, v in p.items() if k != "train_wall_s"} for p in par["points"]]


def test_arena_runs_in_workers_equal_the_sequential_runs(tmp_path: Path) -> None:
    """The default arena's runs (and the extra lm seeds, which wait for the first runs' ranking) in
    two spawned workers of one thread: the same records as one process with one thread."""
    argv = ("--quick", "--task", "lm", "--variants", "mha,linear", "--seeds-top", "1", "--no-measure",
            "--progress", "none", "--threads", "1")
    assert run_arena(_args(*argv, "--jobs", "1", "--out", str(tmp_path / "seq"))) == 0
    assert run_arena(_args(*argv, "--jobs", "2", "--out", str(tmp_path / "par"))) == 0
    seq, par = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("seq", "par"))
    assert (seq["environment"]["train_jobs"], par["environment"]["train_jobs"]) == (1, 2)
    assert par["environment"]["train_threads"] == 1
    for v in ("mha", "linear"):
        a, b = seq["runs"]["lm"][v], par["runs"]["lm"][v]
        assert (a["train_losses"], a["evals"], a["memory"]) == (b["train_losses"], b["evals"], b["memory"]), v
    assert seq["seed_runs"] == par["seed_runs"] and len(par["seed_runs"]["finals"]) == 1
    trained_cpu = sum(r["train_cpu_s"] for r in par["runs"]["lm"].values())
    assert par["cpu_s"] >= trained_cpu > 0  # the invocation's CPU time counts its workers'
    assert "2 worker processes of 1 thread each" in (tmp_path / "par" / "report.md").read_text()


def test_mqar_grid_jobs_and_grid_options() -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    assert grid_jobs(_args("--task", "mqar-grid"), 1000) == (cores, 1 if cores > 1 else None)
    assert grid_jobs(_args("--task", "mqar-grid"), 1) == (1, None)  # never more workers than runs
    assert grid_jobs(_args("--task", "mqar-grid", "--jobs", "3", "--threads", "2"), 10) == (3, 2)
    assert grid_jobs(_args("--task", "mqar-grid", "--device", "cuda"), 10) == (1, None)
    # the default arena trains one run at a time unless --jobs asks (measured: no gain at its sizes)
    assert worker_plan(_args(), 18, parallel_by_default=False) == (1, None)
    assert worker_plan(_args("--jobs", "2"), 18, parallel_by_default=False) == (2, max(1, cores // 2))
    with pytest.raises(ValueError, match=r"--grid-pairs, --grid-seq-lens: only for --task mqar-grid"):
        run_arena(_args("--task", "lm", "--grid-pairs", "2", "--grid-seq-lens", "16", "--jobs", "2"))


def test_grid_eval_steps() -> None:
    assert eval_steps(600) == (300, 450, 600)
    assert eval_steps(8) == (4, 6, 8)
    assert eval_steps(2) == (1, 2) and eval_steps(1) == (1,)


def _cell_point(variant: str, accs: list[float], full: bool = False) -> dict[str, object]:
    from attnzoo.arena.verdict import mqar_converged

    evals = [{"step": s, "accuracy": a} for s, a in zip(eval_steps(600), accs, strict=True)]
    return {"variant": variant, "evals": evals, "accuracy": accs[-1], "converged": mqar_converged(evals),
            "sees_every_token": full}


def test_grid_convergence_text_names_rising_cells_and_full_attention_below_its_plateau() -> None:
    """Synthetic cells: a plateau, a solved one, a rising recurrent one, and exact full attention
    flat at the guessing level (converged by the rising rule, yet below its 100% plateau)."""
    g = dict(GRID)
    flat, solved = _cell_point("linear", [0.29, 0.30, 0.30]), _cell_point("gqa", [0.5, 0.9, 1.0], full=True)
    rising = _cell_point("deltanet", [0.4, 0.6, 0.9])
    stuck = _cell_point("mha", [0.28, 0.29, 0.29], full=True)
    assert flat["converged"] is True and solved["converged"] is True and stuck["converged"] is True
    assert rising["converged"] is False
    text = convergence_text([flat, solved], g)
    assert text.startswith("Every cell converged") and "solved every cell" in text
    only_rec = convergence_text([flat, rising], g)
    assert "in 1 of 2 cells" in only_rec and "plateau" not in only_rec
    both = convergence_text([flat, rising, stuck, solved], g)
    assert "in 1 of 4 cells" in both and "Below its plateau" in both and "(gqa, mha)" in both
    assert "1 of its 2 cells stayed under 99% (at most 29.0%" in both


def test_sees_every_token_comes_from_the_cost_model() -> None:
    """Exact attention whose queries see every earlier token, from the specs' cost functions: the
    windowed and approximate variants are out (the window is a quarter of the sequence)."""
    from attnzoo.arena.grid import grid_window, sees_every_token
    from attnzoo.variants import VARIANTS

    full = [v for v in VARIANTS if sees_every_token(v, 64, 4, 64, grid_window(None, 64))]
    assert {"mha", "mqa", "gqa"} <= set(full)
    assert not {"sliding", "local_global", "streaming", "linear", "deltanet", "nsa"} & set(full)


def test_an_early_stopped_run_checkpoints_the_weights_it_reports(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An adaptive MQAR budget ends a run by raising from the step callback, which used to skip the
    trainer's checkpoint of that step: the checkpoint (what load_arena_model and viz read) was up
    to checkpoint_every steps older than the weights the record reports."""
    from dataclasses import replace

    import attnzoo.arena.runner as runner
    from attnzoo.arena import load_arena_model

    monkeypatch.setitem(runner._DEFAULTS, "mqar", replace(
        runner._DEFAULTS["mqar"], steps=6, max_steps=30, batch=8, width=16, depth=1, heads=2, lr=1e-4, warmup=1,
        eval_every=3))
    assert run_arena(_args("--task", "mqar", "--variants", "linear", "--no-measure", "--progress", "none",
                           "--checkpoint-every", "4", "--out", str(tmp_path))) == 0
    rec = json.loads((tmp_path / "runs" / "mqar-linear.json").read_text())
    assert len(rec["train_losses"]) < 30  # the run did stop early (at a step checkpoint_every does not hit)
    assert len(rec["train_losses"]) % 4
    ckpt = tmp_path / "checkpoints" / "mqar-linear.pt"
    assert torch.load(ckpt, weights_only=True)["step"] == len(rec["train_losses"])
    model, _ = load_arena_model(ckpt)
    task = runner._make_task(runner._DEFAULTS["mqar"])
    assert task.evaluate(model, torch.device("cpu"), 0) == rec["final"]
