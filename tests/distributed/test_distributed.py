"""Ring attention, sequence sharding, ContextParallel and DDP on real gloo process groups.

Each group of ranks is spawned once per module (``dist_spawn.spawn``: ``torch.multiprocessing``, a
free port on 127.0.0.1, a gloo timeout and a hard deadline, so a broken test fails instead of hanging). The
workers compute every equivalence of one world size and save the measured errors; the tests below
assert on them one property at a time. Equivalences:

* ring attention (contiguous and zigzag layouts, causal / bidirectional / windowed, GQA, MQA,
  uneven shards, a sub-group, a group of one) == single-process ``az.attention`` on the gathered
  sequence, outputs, LSE and the gradients of q, k, v (float64 to 1e-12 and float32 to 1e-5,
  relative; bfloat16 within twice the error of one-process bfloat16 attention);
* ``ContextParallel(MultiHeadAttention)`` and ``context_parallel(DecoderLM)`` on shards == the
  unwrapped module on the full sequence, including the all-reduced parameter gradients;
* DDP on 2 ranks for 20 steps through the arena trainer == one process with the same global batch
  (losses within 1e-4);
* invalid / mismatched shards raise on every rank; a rank dying mid-DDP-training, a dead rank and
  a silent rank give ``RuntimeError`` on the others (no hang).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import attnzoo as az
from attnzoo.distributed import (
    ContextParallel,
    context_parallel,
    gather_sequence,
    ring_attention,
    shard_positions,
    shard_sequence,
    work_per_rank,
)
from attnzoo.variants import build_attention
from dist_spawn import CountingTask, ranks_fixture, rel, save

# (name, layout, causal, window, Hq, Hkv, N[, {"alibi": bool, "softcap": float}]) per world size
CASES_2 = [
    ("bidir", "contiguous", False, None, 4, 4, 16),
    ("causal_gqa", "contiguous", True, None, 4, 2, 16),
    ("causal_mqa_window", "contiguous", True, 3, 4, 1, 16),
    ("window_asym", "contiguous", False, (2, 5), 2, 2, 16),
    ("causal_odd_len", "contiguous", True, None, 2, 1, 15),
    ("zz_bidir", "zigzag", False, None, 4, 4, 16),
    ("zz_causal_gqa", "zigzag", True, None, 4, 2, 16),
    ("zz_causal_window", "zigzag", True, 3, 4, 1, 16),
    ("zz_window_asym", "zigzag", False, (2, 5), 2, 2, 16),
    ("zz_causal_alibi_softcap", "zigzag", True, None, 4, 2, 16, {"alibi": True, "softcap": 2.0}),
    ("bidir_alibi", "contiguous", False, None, 4, 1, 15, {"alibi": True}),
    ("window_softcap", "contiguous", True, 4, 2, 2, 16, {"softcap": 1.5}),
    ("zz_causal_gqa_sinks", "zigzag", True, None, 4, 2, 16, {"sinks": True}),
    ("window_sinks_alibi", "contiguous", True, 3, 4, 1, 15, {"sinks": True, "alibi": True}),
]
CASES_4 = [
    ("bidir_gqa", "contiguous", False, None, 4, 2, 16),
    ("causal_uneven", "contiguous", True, None, 2, 2, 18),
    ("causal_window", "contiguous", True, 5, 4, 1, 16),
    ("zz_causal_gqa", "zigzag", True, None, 4, 2, 24),
    ("zz_window", "zigzag", False, (1, 6), 2, 1, 16),
    ("zz_alibi_window", "zigzag", True, 5, 4, 2, 24, {"alibi": True, "softcap": 3.0}),
]


# ----------------------------------------------------------------------------- worker checks
def _ring_case(rank: int, layout: str, causal: bool, window: Any, hq: int, hkv: int, n: int,
               dtype: torch.dtype, backend: str, group: Any = None, block: int = 256,
               extra: dict[str, Any] | None = None) -> dict[str, float]:
    """Errors of ring attention vs az.attention on the whole sequence (same seed on every rank)."""
    g = torch.Generator().manual_seed(1234 + n + hq)
    B, D, Dv = 2, 8, 6
    q = torch.randn(B, hq, n, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(B, hkv, n, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(B, hkv, n, Dv, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    d_out = torch.randn(B, hq, n, Dv, generator=g, dtype=torch.float64).to(dtype)
    mods: dict[str, Any] = {}
    if (extra or {}).get("alibi"):
        mods["alibi_slopes"] = az.alibi_slopes(hq).to(dtype)
    if (extra or {}).get("softcap"):
        mods["softcap"] = extra["softcap"]  # type: ignore[index]
    sinks = None
    if (extra or {}).get("sinks"):
        sinks = (2 * torch.randn(hq, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
        mods["sinks"] = sinks
    ref, ref_lse = az.attention(q, k, v, causal=causal, window=window, return_lse=True, backend="reference",
                                **mods)
    ref.backward(d_out)
    ref_dsinks = None
    if sinks is not None:
        ref_dsinks, sinks.grad = sinks.grad.clone(), None
    ql, kl, vl = (shard_sequence(t.detach(), 2, group=group, layout=layout).requires_grad_() for t in (q, k, v))
    out, lse = ring_attention(ql, kl, vl, group=group, causal=causal, window=window, layout=layout,
                              backend=backend, return_lse=True, block=block, **mods)
    out.backward(shard_sequence(d_out, 2, group=group, layout=layout))
    pos = shard_positions(n, group=group, layout=layout)
    finite = torch.isfinite(ref_lse[:, :, pos])
    extra_errs = {}
    if sinks is not None:  # each rank holds its rows' share of the sinks' gradient
        dsinks = sinks.grad.clone()
        dist.all_reduce(dsinks, group=group)
        extra_errs["dsinks"] = rel(dsinks, ref_dsinks)
    return {**extra_errs,
        "out": rel(gather_sequence(out.detach(), 2, group=group, layout=layout), ref),
        "lse": rel(lse[finite], ref_lse[:, :, pos][finite]),
        "lse_inf_match": float(torch.equal(torch.isinf(lse), torch.isinf(ref_lse[:, :, pos]))),
        "dq": rel(gather_sequence(ql.grad, 2, group=group, layout=layout), q.grad),
        "dk": rel(gather_sequence(kl.grad, 2, group=group, layout=layout), k.grad),
        "dv": rel(gather_sequence(vl.grad, 2, group=group, layout=layout), v.grad),
    }


def _check_ring(rank: int, cases: list[tuple[Any, ...]], res: dict[str, Any]) -> None:
    for name, layout, causal, window, hq, hkv, n, *extra in cases:
        ex = extra[0] if extra else None
        # float64 with 3-row backward blocks: many blocks per shard, key bands under windows
        res[f"f64/{name}"] = _ring_case(rank, layout, causal, window, hq, hkv, n, torch.float64, "reference",
                                        block=3, extra=ex)
        res[f"f32/{name}"] = _ring_case(rank, layout, causal, window, hq, hkv, n, torch.float32, "auto", extra=ex)


def _check_bf16(rank: int, world: int, res: dict[str, Any]) -> None:
    g = torch.Generator().manual_seed(9)
    q64, k64, v64 = (torch.randn(2, h, 32, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    d_out = torch.randn(2, 4, 32, 16, generator=g, dtype=torch.float64)

    def run(dtype: torch.dtype, ring: bool) -> list[torch.Tensor]:
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q64, k64, v64))
        if ring:
            ql, kl, vl = (shard_sequence(t.detach(), 2, layout="zigzag").requires_grad_() for t in (q, k, v))
            out = ring_attention(ql, kl, vl, causal=True, layout="zigzag")
            out.backward(shard_sequence(d_out.to(dtype), 2, layout="zigzag"))
            return [gather_sequence(t, 2, layout="zigzag") for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
        out = az.attention(q, k, v, causal=True, backend="reference" if dtype == torch.float64 else "auto")
        out.backward(d_out.to(dtype))
        return [out.detach(), q.grad, k.grad, v.grad]

    exact = run(torch.float64, False)
    ring, single = run(torch.bfloat16, True), run(torch.bfloat16, False)
    res["bf16"] = {}
    for name, e, a, b in zip(("out", "dq", "dk", "dv"), exact, ring, single, strict=True):
        res["bf16"][f"ring_{name}"] = rel(a, e)
        res["bf16"][f"single_{name}"] = rel(b, e)


def _check_shard_roundtrip(rank: int, world: int, res: dict[str, Any]) -> None:
    x = torch.arange(2 * 3 * (4 * world) * 5, dtype=torch.float32).view(2, 3, 4 * world, 5)
    for layout in ("contiguous", "zigzag"):
        local = shard_sequence(x, 2, layout=layout)
        res[f"roundtrip/{layout}"] = float(torch.equal(gather_sequence(local, 2, layout=layout), x))
    y = torch.randn(1, 4 * world + 1, 3, generator=torch.Generator().manual_seed(5))  # uneven shards
    res["roundtrip/uneven"] = float(torch.equal(gather_sequence(shard_sequence(y, 1), 1), y))


def _check_errors(rank: int, world: int, res: dict[str, Any]) -> None:
    """Each call must raise ValueError on EVERY rank (and return, not hang)."""
    def capture(key: str, fn: Any) -> None:
        try:
            fn()
            res[key] = "no error"
        except (TypeError, ValueError) as e:
            res[key] = f"{type(e).__name__}: {e}"

    q = torch.randn(1, 2, 8, 4)
    # zigzag shards of different lengths
    qz = torch.randn(1, 2, 8 + 2 * (rank == 1), 4)
    capture("err/zigzag_lengths", lambda: ring_attention(qz, qz, qz, layout="zigzag"))
    # one rank passes k/v with mismatched heads (invalid locally)
    kb = torch.randn(1, 3, 8, 4) if rank == 1 else q
    capture("err/invalid_on_one_rank", lambda: ring_attention(q, kb, q))
    # ranks disagree on head dim
    qd = torch.randn(1, 2, 8, 4 + 4 * (rank == 0))
    capture("err/head_dim", lambda: ring_attention(qd, qd, qd))
    # ranks disagree on causal
    capture("err/causal_flag", lambda: ring_attention(q, q, q, causal=rank == 0))
    # odd local length with zigzag
    qo = torch.randn(1, 2, 7, 4)
    capture("err/zigzag_odd", lambda: ring_attention(qo, qo, qo, layout="zigzag"))
    # one rank passes a bad window / a non-bool causal: its own error type there, ValueError elsewhere
    capture("err/window_on_one_rank", lambda: ring_attention(q, q, q, window=-1 if rank == 1 else 2))
    capture("err/causal_type_on_one_rank", lambda: ring_attention(q, q, q, causal="yes" if rank == 1 else True))
    # ranks disagree on the ALiBi slopes
    slopes = az.alibi_slopes(2) * (2.0 if rank == 1 else 1.0)
    capture("err/alibi_slopes", lambda: ring_attention(q, q, q, alibi_slopes=slopes))
    # only rank 0 would run a backward: refused up front instead of hanging in backward
    qg = q.clone().requires_grad_(rank == 0)
    capture("err/needs_grad", lambda: ring_attention(qg, q, q))
    # the group still works after all of these
    out = ring_attention(q, q, q)
    res["err/group_still_usable"] = float(out.shape == q.shape)


def _check_context_parallel(rank: int, world: int, res: dict[str, Any]) -> None:
    for name, layout, kw in (("mha_rope_causal", "zigzag", {"causal": True, "rope": True}),
                             ("gqa_window", "contiguous", {"num_kv_heads": 2, "causal": True, "window": 4}),
                             ("bidir", "contiguous", {}),
                             ("alibi_causal", "zigzag", {"causal": True, "alibi": True}),
                             ("sinks_gqa_causal", "zigzag", {"causal": True, "sinks": True, "num_kv_heads": 2})):
        torch.manual_seed(7)
        mha = build_attention("mha", 32, 4, **{"causal": False, **kw}, dtype=torch.float64)
        x = torch.randn(2, 16, 32, dtype=torch.float64, requires_grad=True)
        y = mha(x)
        gy = torch.randn_like(y)
        y.backward(gy)
        full_grads = [p.grad.clone() for p in mha.parameters()]
        mha.zero_grad()
        cp = ContextParallel(mha, layout=layout, backend="reference")
        xl = shard_sequence(x.detach(), 1, layout=layout).requires_grad_()
        yl = cp(xl)
        yl.backward(shard_sequence(gy, 1, layout=layout))
        grads = [p.grad.clone() for p in mha.parameters()]
        for gr in grads:
            dist.all_reduce(gr)  # each rank holds the gradient of its tokens only
        res[f"cp/{name}"] = {
            "out": rel(gather_sequence(yl.detach(), 1, layout=layout), y),
            "dx": rel(gather_sequence(xl.grad, 1, layout=layout), x.grad),
            "dparams": max(rel(a, b) for a, b in zip(grads, full_grads, strict=True)),
        }


def _check_context_parallel_model(rank: int, world: int, res: dict[str, Any]) -> None:
    """A whole DecoderLM (RoPE, GQA) with context_parallel: local logits and summed grads match."""
    g = torch.Generator().manual_seed(4)
    torch.manual_seed(3)
    model = az.DecoderLM(32, 32, 2, 4, num_kv_heads=2, dtype=torch.float64)
    tokens = torch.randint(0, 32, (2, 16), generator=g)
    logits = model(tokens)  # [B, N, V]
    g_logits = torch.randn(logits.shape, generator=g, dtype=torch.float64)
    logits.backward(g_logits)
    full_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    context_parallel(model, layout="zigzag", backend="reference")
    local = model(shard_sequence(tokens, 1, layout="zigzag"), positions=shard_positions(16, layout="zigzag"))
    local.backward(shard_sequence(g_logits, 1, layout="zigzag"))
    errs = []
    for n, p in model.named_parameters():
        gr = p.grad.clone()
        dist.all_reduce(gr)
        errs.append(rel(gr, full_grads[n.replace(".module.", ".")]))
    res["cp/decoder_lm"] = {"out": rel(gather_sequence(local.detach(), 1, layout="zigzag"), logits),
                            "dparams": max(errs)}


# DDP: a tiny causal LM of az modules trained by the arena's trainer (attnzoo.arena.trainer.train),
# which under a process group wraps the model in DistributedDataParallel and gives each rank its
# slice of the same global batch.
DDP_STEPS, DDP_GLOBAL_BATCH, DDP_SEQ, DDP_VOCAB = 20, 8, 16, 32


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(DDP_VOCAB, 32)
        self.attn = az.MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, rope=True)
        self.norm = nn.LayerNorm(32)
        self.ffn = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, DDP_VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.attn(self.norm(h))
        h = h + self.ffn(h)
        return self.head(h)


def _ddp_train() -> list[float]:
    """Global-batch losses of 20 steps; data parallel when a process group is initialised."""
    from attnzoo.arena.trainer import TrainConfig, train

    torch.manual_seed(0)
    model = _TinyLM()
    return train(model, CountingTask(DDP_VOCAB, DDP_SEQ, noise=0.1), DDP_STEPS, DDP_GLOBAL_BATCH, seed=0,
                 config=TrainConfig(lr=3e-3, warmup=2))


def _check_ddp(rank: int, world: int, res: dict[str, Any]) -> None:
    res["ddp/losses"] = _ddp_train()


def _check_silent_rank(rank: int, world: int, res: dict[str, Any]) -> None:
    """The last rank never calls ring_attention (stuck elsewhere): the others time out."""
    dist.barrier()
    if rank == world - 1:
        time.sleep(4.0)
        return
    q = torch.randn(1, 2, 8, 4)
    try:
        ring_attention(q, q, q, timeout=1.0)
        res["silent"] = "no error"
    except RuntimeError as e:
        res["silent"] = f"RuntimeError: {e}"


DEAD_RANK, DEAD_AT_STEP = 1, 3


def _check_dead_rank(rank: int, world: int, res: dict[str, Any]) -> None:
    """Rank 1 dies abruptly in the middle of DDP training (with rank 0, on a sub-group); then
    ranks 0, 2, 3 call ring_attention on the world group. Everybody raises; nobody hangs."""
    dist.barrier()
    pair = dist.new_group([0, DEAD_RANK])
    if rank in (0, DEAD_RANK):
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(_TinyLM(), process_group=pair)
        task = CountingTask(DDP_VOCAB, DDP_SEQ, noise=0.1)
        step = 0
        try:
            for step in range(20):
                if rank == DEAD_RANK and step == DEAD_AT_STEP:
                    save(rank, res)
                    os._exit(0)  # no cleanup, like a crash
                x, y = task.batch(step, 4, 0)
                loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()  # DDP all-reduces gradients with the other rank here
                model.zero_grad()
            res["ddp_dead"] = "no error"
        except RuntimeError as e:
            res["ddp_dead"] = f"RuntimeError at step {step}: {e}"
    q = torch.randn(1, 2, 8, 4)
    try:
        for _ in range(50):  # until the death is noticed (first call, in practice)
            ring_attention(q, q, q, timeout=5)
            time.sleep(0.1)
        res["dead"] = "no error"
    except RuntimeError as e:
        res["dead"] = f"RuntimeError: {e}"


def _timed(res: dict[str, Any], name: str, fn: Any, *args: Any) -> None:
    t0 = time.perf_counter()
    fn(*args)
    res[f"time/{name}"] = time.perf_counter() - t0


def _job_two(rank: int, world: int, res: dict[str, Any]) -> None:
    _timed(res, "ring", _check_ring, rank, CASES_2, res)
    _timed(res, "roundtrip", _check_shard_roundtrip, rank, world, res)
    _timed(res, "bf16", _check_bf16, rank, world, res)
    _timed(res, "errors", _check_errors, rank, world, res)
    _timed(res, "context_parallel", _check_context_parallel, rank, world, res)
    _timed(res, "context_parallel_model", _check_context_parallel_model, rank, world, res)
    _timed(res, "ddp", _check_ddp, rank, world, res)
    _timed(res, "silent", _check_silent_rank, rank, world, res)


def _check_subgroup(rank: int, world: int, res: dict[str, Any]) -> None:
    """Ranks 1 and 3 form a ring of their own (group ranks != global ranks)."""
    sub = dist.new_group([1, 3])
    alone = dist.new_group([2])
    if rank in (1, 3):
        res["f64/subgroup"] = _ring_case(rank, "zigzag", True, None, 4, 2, 12, torch.float64, "reference", sub)
    if rank == 2:  # a ring of one rank is plain attention
        res["f64/alone"] = _ring_case(rank, "contiguous", True, 3, 4, 1, 9, torch.float64, "reference", alone)


def _job_four(rank: int, world: int, res: dict[str, Any]) -> None:
    _timed(res, "ring", _check_ring, rank, CASES_4, res)
    _timed(res, "subgroup", _check_subgroup, rank, world, res)
    _timed(res, "roundtrip", _check_shard_roundtrip, rank, world, res)
    _check_dead_rank(rank, world, res)



# ----------------------------------------------------------------------------- fixtures
two = ranks_fixture(2, _job_two, "two_ranks")
four = ranks_fixture(4, _job_four, "four_ranks")


def _assert_ring(results: list[dict[str, Any]], key: str, tol: float) -> None:
    for r, res in enumerate(results):
        assert key in res, f"rank {r} produced no result for {key} (keys: {sorted(res)[:5]}...)"
        errs = res[key]
        assert errs["lse_inf_match"] == 1.0, f"{key} rank {r}: rows with no visible key differ"
        bad = {k: e for k, e in errs.items() if k != "lse_inf_match" and not e <= tol}
        assert not bad, f"{key} rank {r} of {len(results)}: relative errors above {tol}: {bad}"


# ----------------------------------------------------------------------------- tests: 2 ranks
@pytest.mark.parametrize("case", [c[0] for c in CASES_2])
def test_ring_matches_attention_2_ranks_float64(two: list[dict[str, Any]], case: str) -> None:
    _assert_ring(two, f"f64/{case}", 1e-12)


@pytest.mark.parametrize("case", [c[0] for c in CASES_2])
def test_ring_matches_attention_2_ranks_float32(two: list[dict[str, Any]], case: str) -> None:
    _assert_ring(two, f"f32/{case}", 1e-5)


def test_shard_gather_roundtrip_2_ranks(two: list[dict[str, Any]]) -> None:
    for r, res in enumerate(two):
        for key in ("roundtrip/contiguous", "roundtrip/zigzag", "roundtrip/uneven"):
            assert res[key] == 1.0, f"rank {r}: gather_sequence(shard_sequence(x)) != x for {key}"


@pytest.mark.parametrize("key", ["err/zigzag_lengths", "err/invalid_on_one_rank", "err/head_dim",
                                 "err/causal_flag", "err/zigzag_odd", "err/window_on_one_rank",
                                 "err/needs_grad", "err/alibi_slopes"])
def test_bad_shards_raise_on_every_rank(two: list[dict[str, Any]], key: str) -> None:
    for r, res in enumerate(two):
        assert res[key].startswith(f"ValueError: ring_attention on rank {r}"), f"rank {r}, {key}: {res[key]}"
    if key == "err/invalid_on_one_rank":
        assert "same number of heads" in two[1][key], two[1][key]
        assert "rank(s) [1] rejected" in two[0][key], two[0][key]
    if key == "err/zigzag_lengths":
        assert "[1, 2, 10, 4]" in two[0][key] and "[1, 2, 8, 4]" in two[0][key], two[0][key]
    if key == "err/window_on_one_rank":
        assert "window must be >= 0, got -1" in two[1][key], two[1][key]
    if key == "err/needs_grad":
        assert "whether gradients are needed" in two[0][key], two[0][key]
    if key == "err/alibi_slopes":
        assert "alibi_sum" in two[0][key] and "alibi slopes sum" in two[0][key], two[0][key]
    for res in two:
        assert res["err/group_still_usable"] == 1.0


def test_bad_argument_type_keeps_its_type_on_the_offending_rank(two: list[dict[str, Any]]) -> None:
    key = "err/causal_type_on_one_rank"
    assert two[1][key].startswith("TypeError: ring_attention on rank 1: causal must be a bool"), two[1][key]
    assert two[0][key].startswith("ValueError: ring_attention on rank 0: rank(s) [1] rejected"), two[0][key]


def test_ring_bfloat16_error_within_twice_single_process(two: list[dict[str, Any]]) -> None:
    """bf16 ring attention is as accurate as bf16 one-process attention (both vs float64)."""
    for r, res in enumerate(two):
        for name in ("out", "dq", "dk", "dv"):
            ring, single = res["bf16"][f"ring_{name}"], res["bf16"][f"single_{name}"]
            assert ring <= 2 * single + 1e-3, f"rank {r}, {name}: ring error {ring:.2e} vs one process {single:.2e}"


@pytest.mark.parametrize("name", ["mha_rope_causal", "gqa_window", "bidir", "alibi_causal", "sinks_gqa_causal",
                                  "decoder_lm"])
def test_context_parallel_matches_module(two: list[dict[str, Any]], name: str) -> None:
    for r, res in enumerate(two):
        errs = res[f"cp/{name}"]
        assert max(errs.values()) < 1e-12, f"ContextParallel {name}, rank {r}: relative errors {errs}"


def test_ddp_two_ranks_equals_one_process(two: list[dict[str, Any]]) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers; tiny ops crawl with oversubscribed threads
    try:
        single = _ddp_train()
    finally:
        torch.set_num_threads(threads)
    ddp = two[0]["ddp/losses"]
    assert len(ddp) == len(single) == DDP_STEPS
    diff = max(abs(a - b) for a, b in zip(ddp, single, strict=True))
    assert diff < 1e-4, f"DDP (2 ranks) vs 1 process losses differ by {diff:.2e}: {ddp} vs {single}"
    assert single[-1] < single[0], "the reference run did not train at all"
    assert two[1]["ddp/losses"] == ddp, "ranks logged different global losses"


def test_silent_rank_times_out_instead_of_hanging(two: list[dict[str, Any]]) -> None:
    msg = two[0]["silent"]
    assert msg.startswith("RuntimeError: rank 0: ring_attention"), msg
    assert "peer process may have died, timed out" in msg, msg


# ----------------------------------------------------------------------------- tests: 4 ranks
@pytest.mark.parametrize("case", [c[0] for c in CASES_4])
def test_ring_matches_attention_4_ranks(four: list[dict[str, Any]], case: str) -> None:
    _assert_ring(four, f"f64/{case}", 1e-12)
    _assert_ring(four, f"f32/{case}", 1e-5)


def test_ring_on_a_subgroup(four: list[dict[str, Any]]) -> None:
    _assert_ring([four[1], four[3]], "f64/subgroup", 1e-12)
    _assert_ring([four[2]], "f64/alone", 1e-12)


def test_shard_gather_roundtrip_4_ranks(four: list[dict[str, Any]]) -> None:
    for r, res in enumerate(four):
        for key in ("roundtrip/contiguous", "roundtrip/zigzag", "roundtrip/uneven"):
            assert res[key] == 1.0, f"rank {r}: gather_sequence(shard_sequence(x)) != x for {key}"


def test_dead_rank_fails_fast_on_the_others(four: list[dict[str, Any]]) -> None:
    for r in (0, 2, 3):
        msg = four[r].get("dead", "missing")
        assert msg.startswith(f"RuntimeError: rank {r}: ring_attention"), f"rank {r}: {msg}"
        assert "peer process may have died" in msg, msg
    assert "dead" not in four[DEAD_RANK] and "f64/bidir_gqa" in four[DEAD_RANK]


def test_ddp_rank_death_fails_fast(four: list[dict[str, Any]]) -> None:
    msg = four[0].get("ddp_dead", "missing")
    assert msg.startswith(f"RuntimeError at step {DEAD_AT_STEP}"), msg


# ----------------------------------------------------------------------------- single process
def test_shard_positions_layouts() -> None:
    assert shard_positions(8, layout="zigzag", rank=1, world_size=2).tolist() == [2, 3, 4, 5]
    assert shard_positions(8, layout="zigzag", rank=0, world_size=2).tolist() == [0, 1, 6, 7]
    assert shard_positions(7, rank=0, world_size=2).tolist() == [0, 1, 2, 3]
    assert shard_positions(7, rank=1, world_size=2).tolist() == [4, 5, 6]
    allpos = torch.cat([shard_positions(24, layout="zigzag", rank=r, world_size=3) for r in range(3)])
    assert sorted(allpos.tolist()) == list(range(24))


def test_zigzag_balances_causal_work() -> None:
    P, N = 4, 64
    c = N // (2 * P)
    zz = work_per_rank(N, P, layout="zigzag", causal=True)
    assert zz == [(2 * P + 1) * c * c] * P, zz  # the diagonal chunk pairs are computed in full
    cont = work_per_rank(N, P, layout="contiguous", causal=True)
    assert cont == [(r + 1) * (N // P) ** 2 for r in range(P)], cont
    assert work_per_rank(N, P, layout="zigzag") == [N * N // P] * P  # bidirectional: everything
    # a narrow window skips most pairs in either layout
    assert max(work_per_rank(N, P, causal=True, window=2)) < max(cont)


def test_shard_sequence_is_index_select() -> None:
    x = torch.randn(2, 12, 3)
    for layout in ("contiguous", "zigzag"):
        parts = [shard_sequence(x, 1, layout=layout, rank=r, world_size=3) for r in range(3)]
        pos = torch.cat([shard_positions(12, layout=layout, rank=r, world_size=3) for r in range(3)])
        assert torch.equal(torch.cat(parts, dim=1), x[:, pos])


def test_bad_arguments_single_process() -> None:
    with pytest.raises(ValueError, match="divisible by 2 \\* world_size = 4, got 10"):
        shard_positions(10, layout="zigzag", rank=0, world_size=2)
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_positions(8, layout="striped", rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank and world_size"):
        shard_positions(8, rank=0)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        shard_positions(8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="cannot give every one of 4 ranks"):
        shard_positions(3, rank=0, world_size=4)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        shard_sequence([1, 2], 0, rank=0, world_size=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dim must be an int in"):
        shard_sequence(torch.zeros(2, 4), 2, rank=0, world_size=1)
    if not dist.is_initialized():
        q = torch.zeros(1, 1, 4, 4)
        with pytest.raises(RuntimeError, match=r"needs an initialised torch\.distributed"):
            ring_attention(q, q, q)
        with pytest.raises(RuntimeError, match=r"needs an initialised torch\.distributed"):
            gather_sequence(q, 2)


def test_context_parallel_rejects_unsupported_modules() -> None:
    with pytest.raises(TypeError, match="wraps a MultiHeadAttention"):
        ContextParallel(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="dropout"):
        ContextParallel(az.MultiHeadAttention(16, 2, dropout=0.1))
    with pytest.raises(ValueError, match="cross-attention"):
        ContextParallel(az.MultiHeadAttention(16, 2, kv_dim=8))
    with pytest.raises(ValueError, match="layout must be one of"):
        ContextParallel(az.MultiHeadAttention(16, 2), layout="rows")
    with pytest.raises(ValueError, match="no self-attention"):
        context_parallel(nn.Sequential(nn.Linear(4, 4)))
    model = nn.Sequential(az.MultiHeadAttention(16, 2), az.MultiHeadAttention(16, 2, dropout=0.1))
    with pytest.raises(ValueError, match="dropout"):
        context_parallel(model)
    assert not isinstance(model[0], ContextParallel), "a failed context_parallel must not change the model"
    wrapped = context_parallel(nn.Sequential(az.MultiHeadAttention(16, 2), nn.Linear(16, 16)))
    assert isinstance(wrapped[0], ContextParallel) and isinstance(wrapped[1], nn.Linear)



@pytest.mark.slow
def test_example_script_under_torchrun() -> None:
    """docs/distributed.md's quick start: torchrun on 2 ranks, ring == attention, CP loss == 1 process."""
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(root / "examples" / "distributed_ring.py")],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = float(re.search(r"max \|ring - attention\| = (\S+)", proc.stdout).group(1))  # type: ignore[union-attr]
    assert err < 1e-4, proc.stdout
    cp, single = map(float, re.search(r"loss (\S+), one process: (\S+)", proc.stdout).groups())  # type: ignore[union-attr]
    assert abs(cp - single) < 1e-4 * abs(single), proc.stdout
