"""Recurrent and feature-map mixers on packed documents under context parallelism, and failures of
Ulysses attention and of the recurrent state scan (real gloo groups of 2 and 4 ranks, float64).

Equivalence: a 2-layer ``DecoderLM`` (layer 0 every recurrent / feature-map variant the
context-parallel path supports, layer 1 GQA with RoPE) under ``context_parallel`` and
``documents(cu)`` == the single-process ``lm(tokens [1, T], cu_seqlens=cu)``: logits and every
parameter gradient (summed over the ranks) to 1e-9 relative. The documents put boundaries inside
shards, exactly on shard edges, and within a short convolution's reach of an edge (its tail must
not leak across), and make a document span several whole shards (the scan composes their maps).

Failures: a bad argument on one rank only (other documents, a batch of two rows under documents,
heads not divisible by the ranks, a too-short shard), and a rank that raises in the middle of the
forward and exits: every rank gets a one-line error, never a hang (the spawn has a deadline).
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

import attnzoo as az
from attnzoo.distributed import (
    ContextParallel,
    ContextParallelGathered,
    ContextParallelRecurrent,
    context_parallel,
    documents,
    gather_sequence,
    ring_attention,
    shard_positions,
    ulysses_attention,
)
from attnzoo.variants import VARIANTS, build_attention
from dist_spawn import ranks_fixture, rel, rel_grad, save

#: every recurrent / feature-map variant context_parallel supports (linear_bidir: causal=False), and
#: the two it runs on the gathered sequence (one call per document)
MIXERS = ("retnet", "gla", "deltanet", "gated_deltanet", "mamba2", "kda", "gated_deltaproduct", "linear",
          "performer", "linear_bidir", "nsa", "infini",
          # softmax layers whose global / sink tokens or score_mod read positions: under documents they
          # count from each document's start, so they run gathered (the sharded seams see absolute ones)
          "local_global", "streaming", "mha_score_mod")
# (name, layout, cu) per world size; the comments give the segments of each rank
CASES = {
    # contiguous [0, 8) | [8, 16): 5 and 11 inside, 8 on the edge
    2: [("contig", "contiguous", [0, 5, 8, 11, 16]),
        # zigzag [0, 4) [12, 16) | [4, 8) [8, 12): 3 inside [0, 4) (the tail 1..3 it passes on is
        # partly another document), 6 inside [4, 8) (likewise the tail 5..7), 12 on an edge
        ("zigzag", "zigzag", [0, 3, 6, 12, 16]),
        # one document over both shards but for a short first one
        ("long_doc", "contiguous", [0, 2, 16])],
    # contiguous shards of 8: [3, 24) spans three shards (two maps composed), 24 on an edge
    4: [("contig", "contiguous", [0, 3, 24, 27, 32]),
        # zigzag chunks of 4: [4, 8) r1, [8, 12) r2, ... ; 7 one token before an edge, 16 on one
        ("zigzag", "zigzag", [0, 7, 16, 30, 32])],
}
TIMEOUT = 10.0


def _lm(mixer: str) -> az.DecoderLM:
    torch.manual_seed(4)
    model = az.DecoderLM(32, 16, 2, 2, num_kv_heads=1, dtype=torch.float64)
    if mixer == "mha_score_mod":  # a learned bias on absolute positions (q_idx - 4)
        table = torch.nn.Parameter(torch.randn(32, dtype=torch.float64, generator=torch.Generator().manual_seed(5)))
        parts = az.AttentionParts(scores=az.Scores(score_mod=lambda s, b, h, q, k: s + table[(q - k).abs() + q % 4]))
        model.blocks[0].attn = az.MultiHeadAttention(16, 2, causal=True, parts=parts).double()
        return model
    name = "linear" if mixer == "linear_bidir" else mixer
    kw = dict(VARIANTS[name].check)
    if mixer == "linear_bidir":
        kw["causal"] = False
    model.blocks[0].attn = build_attention(name, 16, 2, dtype=torch.float64, **kw)
    return model


def _packed_case(mixer: str, layout: str, cu_list: list[int]) -> dict[str, float]:
    n = cu_list[-1]
    cu = torch.tensor(cu_list, dtype=torch.int32)
    tokens = torch.randint(0, 32, (1, n), generator=torch.Generator().manual_seed(8))
    model = _lm(mixer)
    logits = model(tokens, cu_seqlens=cu)
    g_logits = torch.randn(logits.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    logits.backward(g_logits)
    ref = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    context_parallel(model, layout=layout, timeout=TIMEOUT)
    pos = shard_positions(n, layout=layout)
    doc_pos = torch.arange(n) - cu.long()[torch.searchsorted(cu[1:].long(), torch.arange(n), right=True)]
    with documents(cu):
        local = model(tokens[:, pos], positions=doc_pos[pos])
    local.backward(g_logits[:, pos])
    errs = {"out": rel(gather_sequence(local.detach(), 1, layout=layout), logits)}
    scale = max(float(g.abs().max()) for g in ref.values())
    for k, p in model.named_parameters():
        if p.grad is None:
            continue
        gr = p.grad.clone()
        dist.all_reduce(gr)
        errs[f"d:{k}"] = rel_grad(gr, ref[k.replace(".module", "")], scale)
    return errs


def _packed(rank: int, world: int, res: dict[str, Any]) -> None:
    for case, layout, cu in CASES[world]:
        for mixer in MIXERS:
            res[f"packed/{mixer}/{case}"] = _packed_case(mixer, layout, cu)


def _capture(res: dict[str, Any], key: str, call: Any) -> None:
    try:
        call()
        res[key] = "no error"
    except (TypeError, ValueError, RuntimeError) as e:
        res[key] = f"{type(e).__name__}: {e}"


def _bad_arguments(rank: int, world: int, res: dict[str, Any]) -> None:
    """A bad argument on one rank only: ValueError on every rank, and the group still works."""
    mixer = ContextParallelRecurrent(build_attention("gated_deltanet", 16, 2), timeout=TIMEOUT)
    x = torch.randn(1, 8, 16)
    cu_good = torch.tensor([0, 3, 8 * world])
    cu_mine = torch.tensor([0, 3 + (rank == 1), 8 * world])

    def under(cu: torch.Tensor, inp: torch.Tensor) -> Any:
        def call() -> Any:
            with documents(cu):
                return mixer(inp)
        return call

    _capture(res, "err/rec_cu_differs", under(cu_mine, x))
    _capture(res, "err/rec_cu_end", under(torch.tensor([0, 3, 8 * world + 1]), x))
    _capture(res, "err/rec_batch_under_docs", under(cu_good, torch.randn(1 + (rank == 1), 8, 16)))
    _capture(res, "err/rec_cu_type", under(torch.tensor([0.0, 8.0 * world]) if rank == 1 else cu_good, x))
    q = torch.randn(1, 4, 8, 4)
    kv = torch.randn(1, 2, 8, 4)
    _capture(res, "err/uly_cu_differs", lambda: ulysses_attention(q, kv, kv, cu_seqlens=cu_mine, timeout=TIMEOUT))
    h = 4 if rank == 0 else 3  # heads divisible by the ranks on rank 0 only
    _capture(res, "err/uly_heads_one_rank", lambda: ulysses_attention(torch.randn(1, h, 8, 4), torch.randn(1, h, 8, 4),
                                                                       torch.randn(1, h, 8, 4), timeout=TIMEOUT))
    gathered = ContextParallelGathered(build_attention("nsa", 16, 2, **VARIANTS["nsa"].check), timeout=TIMEOUT)
    mine = torch.arange(8.0) if rank == 1 else torch.arange(8) + 8 * rank  # float positions on rank 1 only
    _capture(res, "err/gathered_positions_one_rank", lambda: gathered(x, positions=mine))
    _capture(res, "err/gathered_cu_end", lambda: _under_docs(torch.tensor([0, 3, 8 * world + 1]), gathered, x))
    sinks = torch.tensor([1.0, -0.5, 0.25, 2.0])
    _capture(res, "err/ring_sinks_one_rank", lambda: ring_attention(q, q, q, sinks=sinks if rank == 0 else None,
                                                                     timeout=TIMEOUT))
    _capture(res, "err/ring_score_mod_one_rank", lambda: ring_attention(
        q, q, q, score_mod=(lambda s, b, h, i, j: s) if rank == 0 else None, timeout=TIMEOUT))
    _capture(res, "err/uly_sinks_values", lambda: ulysses_attention(q, kv, kv, sinks=sinks * (1 + 2 * rank),
                                                                    timeout=TIMEOUT))  # sum h*s_h agrees
    slopes = torch.tensor([1.0, -0.5, 0.0, 0.0]) * (1 + 2 * rank)  # sum_h h * s_h = 0 on both ranks
    _capture(res, "err/uly_alibi_values", lambda: ulysses_attention(q, kv, kv, alibi_slopes=slopes, timeout=TIMEOUT))
    _capture(res, "err/uly_mask_one_rank", lambda: ulysses_attention(
        q, kv, kv, mask=az.masks.sliding_window(2, 0) if rank == 0 else None, timeout=TIMEOUT))
    softmax = ContextParallel(build_attention("mha", 16, 2), timeout=TIMEOUT)  # the ring seam
    _capture(res, "err/cp_softmax_width_one_rank", lambda: softmax(torch.randn(1, 8, 16 if rank == 0 else 12)))
    _capture(res, "err/gather_shape", lambda: gather_sequence(torch.ones(1, 4, 3 + rank), 1, timeout=TIMEOUT))
    _capture(res, "err/gather_dtype", lambda: gather_sequence(  # the same bytes: read as the other dtype
        torch.ones(1, 4, 3, dtype=torch.float64) if rank == 0 else torch.ones(1, 4, 6), 1, timeout=TIMEOUT))
    with documents(cu_good):  # the group still works after every one of these
        res["err/usable"] = float(mixer(x).shape == x.shape)


def _under_docs(cu: torch.Tensor, mixer: torch.nn.Module, x: torch.Tensor) -> Any:
    with documents(cu):
        return mixer(x)


class _Raise(torch.nn.Module):
    """Raises in the middle of a forward (after the mixers before it have exchanged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("injected failure")


def _dies_mid_forward(rank: int, world: int, res: dict[str, Any], group: Any, bad: int, method: str) -> None:
    """On ``group``: the rank ``bad`` raises between the two context-parallel mixers of a model and
    exits (a crash); the others block in the second mixer's exchange and must raise, not hang."""
    torch.manual_seed(0)
    first = "gated_deltanet" if method == "ring" else "mha"
    layers = [build_attention(first, 16, 4, **VARIANTS[first].check), torch.nn.Identity(),
              build_attention("gated_deltanet", 16, 4, **VARIANTS["gated_deltanet"].check)]
    model = context_parallel(torch.nn.Sequential(*layers), group, method=method, timeout=TIMEOUT)
    if rank == bad:
        model[1] = _Raise()
    x = torch.randn(1, 8, 16, requires_grad=True)
    key = f"die/{method}"
    try:
        model(x).sum().backward()
        res[key] = "no error"
    except (ValueError, RuntimeError) as e:
        res[key] = f"{type(e).__name__}: {e}"
    if rank == bad:
        save(rank, res)
        os._exit(0)  # the raising rank goes away, like a training script that crashed


def _job_two(rank: int, world: int, res: dict[str, Any]) -> None:
    _packed(rank, world, res)
    _bad_arguments(rank, world, res)
    _dies_mid_forward(rank, world, res, None, 1, "ring")


def _job_four(rank: int, world: int, res: dict[str, Any]) -> None:
    _packed(rank, world, res)
    # two pairs at once: Ulysses then the scan on ranks {0, 1}, the scan twice on {2, 3}; 1 and 3 raise
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    _dies_mid_forward(rank, world, res, pairs[rank // 2], 2 * (rank // 2) + 1, "ulysses" if rank < 2 else "ring")


two = ranks_fixture(2, _job_two, "cp_packed2")
four = ranks_fixture(4, _job_four, "cp_packed4")


def _ok(results: list[dict[str, Any]]) -> None:
    for r, res in enumerate(results):
        assert "worker_error" not in res, f"rank {r}: {res['worker_error']}"


def _keys(world: int) -> list[tuple[str, str]]:
    return [(m, c) for c, _, _ in CASES[world] for m in MIXERS]


def _check_packed(results: list[dict[str, Any]], mixer: str, case: str) -> None:
    _ok(results)
    for r, res in enumerate(results):
        errs = res[f"packed/{mixer}/{case}"]
        worst = max(errs, key=errs.get)
        assert errs[worst] < 1e-9, f"rank {r} {mixer}/{case} {worst}: relative error {errs[worst]:.2e}"


@pytest.mark.parametrize("mixer, case", _keys(2))
def test_recurrent_documents_equal_cu_seqlens_2_ranks(two: list[dict[str, Any]], mixer: str, case: str) -> None:
    _check_packed(two, mixer, case)


@pytest.mark.slow  # the 4-rank job (17 s of spawning on 2 cores); the 2-rank tests above stay in the default run
@pytest.mark.parametrize("mixer, case", _keys(4))
def test_recurrent_documents_equal_cu_seqlens_4_ranks(four: list[dict[str, Any]], mixer: str, case: str) -> None:
    _check_packed(four, mixer, case)


@pytest.mark.parametrize("key, bad, match", [
    ("err/rec_cu_differs", None, r"ranks disagree .*documents' cu_seqlens"),
    ("err/rec_cu_end", None, r"cu_seqlens must end at the global length 16"),
    ("err/rec_batch_under_docs", 1, r"packed documents are one row"),
    ("err/rec_cu_type", 1, r"cu_seqlens must be an int tensor"),
    ("err/uly_cu_differs", None, r"ranks disagree"),
    ("err/uly_heads_one_rank", 1, r"Hq must be divisible by 2"),
    ("err/gathered_positions_one_rank", 1, r"positions must be an int tensor"),
    ("err/gathered_cu_end", None, r"cu_seqlens must end at the global length 16"),
    # options that were not compared (each rank computed with its own: silently not one process's result)
    ("err/ring_sinks_one_rank", None, r"ranks disagree on 'sinks'"),
    ("err/ring_score_mod_one_rank", None, r"ranks disagree on 'score_mod'"),
    ("err/uly_sinks_values", None, r"ranks disagree on 'sinks'"),
    ("err/uly_mask_one_rank", None, r"ranks disagree on 'mask'"),
    ("err/uly_alibi_values", None, r"ranks disagree on 'alibi'"),  # a weighted-sum checksum agreed
    ("err/cp_softmax_width_one_rank", 1, r"x must have shape \[B, n, C\] with C = 16"),  # was: rank 0 timed out
    ("err/gather_shape", None, r"gather_sequence .*ranks disagree on 'size of dim 2'"),  # was: gloo aborted
    ("err/gather_dtype", None, r"gather_sequence .*ranks disagree on 'dtype'"),
])
def test_bad_argument_on_one_rank_raises_on_every_rank(two: list[dict[str, Any]], key: str, bad: int | None,
                                                       match: str) -> None:
    _ok(two)
    for r, res in enumerate(two):
        msg = res[key]
        assert msg.startswith(("ValueError", "TypeError")) and "\n" not in msg, f"rank {r}: {msg!r}"
        if bad is None or r == bad:
            assert re.search(match, msg), f"rank {r}: {msg}"
        else:
            assert f"rank(s) [{bad}] rejected their inputs" in msg, f"rank {r}: {msg}"
    assert all(res["err/usable"] == 1.0 for res in two)


def _check_death(res: dict[str, Any], r: int, method: str, raised: bool) -> None:
    msg = res.get(f"die/{method}", "missing")
    if raised:
        assert msg == "ValueError: injected failure", f"rank {r}: {msg}"
        return
    assert msg.startswith(f"RuntimeError: rank {r % 2}: ") and "\n" not in msg, f"rank {r}: {msg!r}"
    assert "peer process may have died" in msg, f"rank {r}: {msg}"


def test_rank_raising_mid_forward_fails_the_others_2_ranks(two: list[dict[str, Any]]) -> None:
    _check_death(two[0], 0, "ring", False)
    _check_death(two[1], 1, "ring", True)


@pytest.mark.slow  # the 4-rank job (17 s of spawning on 2 cores); the 2-rank tests above stay in the default run
def test_rank_raising_mid_forward_fails_the_others_4_ranks(four: list[dict[str, Any]]) -> None:
    assert "worker_error" not in four[0] and "worker_error" not in four[2]
    _check_death(four[0], 0, "ulysses", False)
    _check_death(four[1], 1, "ulysses", True)
    _check_death(four[2], 2, "ring", False)
    _check_death(four[3], 3, "ring", True)

