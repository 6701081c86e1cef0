"""Ulysses attention (all-to-all sequence -> heads -> sequence) on real gloo groups of 2 and 4 ranks.

Equivalences, each against single-process ``az.attention`` on the gathered sequence (reference
backend, float64 to 1e-9 relative; float32 ``auto`` to 1e-5), outputs and the gradients of q, k,
v (and sinks): contiguous and zigzag layouts, causal / bidirectional / windowed, GQA with K/V heads
sharded (Hkv divisible by the ranks) and replicated (Hkv < ranks, MQA), uneven contiguous shards,
ALiBi + softcap + sinks, packed documents (global ``cu_seqlens``), a position ``Mask``. Bad
arguments on one rank raise on every rank, before any data moves.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import attnzoo as az
from attnzoo.distributed import gather_sequence, shard_sequence, ulysses_attention
from dist_spawn import ranks_fixture, rel

# name, layout, causal, window, Hq, Hkv, N, extras
CASES_2 = [
    ("causal_mha", "contiguous", True, None, 4, 4, 16, {}),
    ("bidir_gqa_uneven", "contiguous", False, None, 4, 2, 15, {}),
    ("zz_causal_mqa", "zigzag", True, None, 4, 1, 16, {}),
    ("zz_window_gqa", "zigzag", False, (2, 5), 4, 2, 16, {}),
    ("alibi_softcap_sinks", "contiguous", True, None, 4, 2, 16, {"alibi": True, "softcap": 2.0, "sinks": True}),
    ("docs_causal", "zigzag", True, None, 2, 2, 16, {"cu": [0, 3, 9, 16]}),
    ("docs_window_mqa", "contiguous", True, 3, 2, 1, 13, {"cu": [0, 5, 6, 13]}),
    ("mask_global_tokens", "contiguous", True, None, 2, 2, 16, {"mask": True}),
]
CASES_4 = [
    ("causal_gqa_sharded", "contiguous", True, None, 8, 4, 18, {}),
    ("zz_causal_gqa_replicated", "zigzag", True, None, 4, 2, 24, {}),
    ("zz_bidir_mqa", "zigzag", False, None, 8, 1, 16, {"sinks": True}),
    ("docs_window", "contiguous", True, 4, 4, 2, 17, {"cu": [0, 2, 11, 17]}),
]


def _case(layout: str, causal: bool, window: Any, hq: int, hkv: int, n: int, ex: dict[str, Any],
          dtype: torch.dtype, backend: str) -> dict[str, float]:
    g = torch.Generator().manual_seed(99 + n + hq)
    B, D, Dv = 2, 8, 6
    q, k, v = (torch.randn(B, h, n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
               for h, d in ((hq, D), (hkv, D), (hkv, Dv)))
    d_out = torch.randn(B, hq, n, Dv, generator=g, dtype=torch.float64).to(dtype)
    mods: dict[str, Any] = {}
    if ex.get("alibi"):
        mods["alibi_slopes"] = az.alibi_slopes(hq).to(dtype)
    if ex.get("softcap"):
        mods["softcap"] = ex["softcap"]
    sinks = None
    if ex.get("sinks"):
        sinks = torch.randn(hq, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
        mods["sinks"] = sinks
    ref_mask: Any = None
    dist_kw: dict[str, Any] = {}
    if "cu" in ex:
        cu = torch.tensor(ex["cu"], dtype=torch.int32)
        ids = torch.searchsorted(cu[1:].long(), torch.arange(n), right=True)
        ref_mask = az.masks.document(ids)
        dist_kw["cu_seqlens"] = cu
    if ex.get("mask"):
        ref_mask = az.masks.sliding_window(3, 0) | az.masks.global_tokens([0, 5])
        dist_kw["mask"] = ref_mask
    ref = az.attention(q, k, v, mask=ref_mask, causal=causal, window=window, backend="reference", **mods)
    ref.backward(d_out)
    ref_grads = [t.grad.clone() for t in (q, k, v)] + ([sinks.grad.clone()] if sinks is not None else [])
    if sinks is not None:
        sinks.grad = None
    ql, kl, vl = (shard_sequence(t.detach(), 2, layout=layout).requires_grad_() for t in (q, k, v))
    out = ulysses_attention(ql, kl, vl, causal=causal, window=window, layout=layout, backend=backend,
                            **mods, **dist_kw)
    out.backward(shard_sequence(d_out, 2, layout=layout))
    got = [gather_sequence(t.grad, 2, layout=layout) for t in (ql, kl, vl)]
    if sinks is not None:
        ds = sinks.grad.clone()
        dist.all_reduce(ds)  # each rank holds its heads' share
        got.append(ds)
    errs = {"out": rel(gather_sequence(out.detach(), 2, layout=layout), ref)}
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, ref_grads, strict=False):
        errs[name] = rel(a, b)
    return errs


def _errors(rank: int, world: int, res: dict[str, Any]) -> None:
    """Bad inputs on one rank, or heads that do not shard: ValueError on every rank, no hang."""
    q = torch.randn(1, 4, 8, 4)
    kv = torch.randn(1, 2, 8, 4)
    checks = {
        "err/one_rank_bad_shape": lambda: ulysses_attention(q if rank else q[..., :3], kv, kv),
        "err/heads_not_divisible": lambda: ulysses_attention(torch.randn(1, 3, 8, 4), torch.randn(1, 3, 8, 4),
                                                             torch.randn(1, 3, 8, 4)),
        "err/causal_differs": lambda: ulysses_attention(q, kv, kv, causal=bool(rank)),
        "err/cu_end": lambda: ulysses_attention(q, kv, kv, cu_seqlens=torch.tensor([0, 4, 15])),
    }
    for key, call in checks.items():
        try:
            call()
            res[key] = "no error"
        except (ValueError, TypeError) as e:
            res[key] = f"{type(e).__name__}: {e}"
    dist.barrier()  # the group still works after the errors


def _job(rank: int, world: int, res: dict[str, Any]) -> None:
    for name, layout, causal, window, hq, hkv, n, ex in (CASES_2 if world == 2 else CASES_4):
        res[f"f64/{name}"] = _case(layout, causal, window, hq, hkv, n, ex, torch.float64, "reference")
        res[f"f32/{name}"] = _case(layout, causal, window, hq, hkv, n, ex, torch.float32, "auto")
    _errors(rank, world, res)


two = ranks_fixture(2, _job, "ulysses2")
four = ranks_fixture(4, _job, "ulysses4")


def _check(results: list[dict[str, Any]], key: str, tol: float) -> None:
    for r, res in enumerate(results):
        assert "worker_error" not in res, f"rank {r}: {res['worker_error']}"
        for what, err in res[key].items():
            assert err < tol, f"rank {r} {key} {what}: relative error {err:.2e} >= {tol}"


@pytest.mark.parametrize("case", [c[0] for c in CASES_2])
def test_ulysses_equals_attention_2_ranks(two: list[dict[str, Any]], case: str) -> None:
    _check(two, f"f64/{case}", 1e-9)
    _check(two, f"f32/{case}", 1e-5)


@pytest.mark.parametrize("case", [c[0] for c in CASES_4])
def test_ulysses_equals_attention_4_ranks(four: list[dict[str, Any]], case: str) -> None:
    _check(four, f"f64/{case}", 1e-9)
    _check(four, f"f32/{case}", 1e-5)


@pytest.mark.parametrize("key, match", [
    ("err/one_rank_bad_shape", r"head dims|rejected their inputs"),
    ("err/heads_not_divisible", r"Hq must be divisible"),
    ("err/causal_differs", r"ranks disagree"),
    ("err/cu_end", r"cu_seqlens must end at the global length 16"),
])
def test_bad_arguments_raise_on_every_rank(two: list[dict[str, Any]], key: str, match: str) -> None:
    import re

    for r, res in enumerate(two):
        msg = res[key]
        assert msg.startswith("ValueError") or msg.startswith("TypeError"), f"rank {r}: {msg}"
        assert "\n" not in msg, f"rank {r}: not one line: {msg!r}"
        assert re.search(match, msg), f"rank {r}: {msg}"
