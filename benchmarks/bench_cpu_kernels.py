"""Issue 37's table: each CPU fast path against its peer, measured in one run (ratios).

Rows (float32, forward, ``torch.inference_mode``; medians of interleaved repeats, the peer and
ours alternating so that machine load hits both alike):

* ``decode``: one token against a 32k GQA cache (32 query / 8 KV heads, D=128): ``az.attention``
  (``auto`` = the split-KV kernel, :mod:`attnzoo.functional.backends.decode`) vs SDPA ``enable_gqa``;
* ``local_global``: a decode step after 2,048 tokens (dim 512, 8 heads, window 64) vs the same
  step of ``mha``, and the pattern-as-``Mask`` path it replaced;
* ``nsa``: the ``nsa`` module vs the dense ``gqa`` module (dim 512, 8 heads, 2 KV heads), forward,
  at ``--nsa-sizes`` (the crossing length is where the ratio passes 1);
* ``nsa_train``: the same modules' training steps (forward + backward of the summed output);
* ``varlen``: ``attention_varlen`` (``auto``) on 16 mixed causal sequences (T = 24,576) vs a Python
  loop of per-sequence SDPA that also assembles the packed output, and ``backend="tiled"``;
* ``varlen_train``: the same sequences trained (forward + backward, float32): ``attention_varlen``
  vs the loop of per-sequence SDPA under autograd, and the PyTorch path;
* ``tiled``: ``backend="tiled"`` vs SDPA ``is_causal`` at N=4096, 8 heads (query blocks as whole-row
  softmaxes; and the whole-row softmax, ``TileConfig(row_elems=1 << 22)``, off by default);
* ``window``: causal window (256, 0) at N=65536 (``auto`` = ``tiled``'s flat band,
  :mod:`attnzoo.functional.backends.tiled.flat`) as a fraction of a 2048^2 fp32 matmul's rate,
  the two timed interleaved (the FLOPs are those of the visible scores: ``4 H D sum(min(i, 256) + 1)``),
  and the per-head band it replaced (``TileConfig(flat_elems=0)``).

``--load 2`` starts two busy processes (each a loop of 1024^2 fp32 matmuls on one thread) for the
duration of the run: the "loaded" column of the issue. Print the CPU with ``lscpu`` beside it.

With the compiled kernels built (``attnzoo native --build``; the header says whether they are), the
``decode``, ``nsa``, ``varlen``, ``tiled`` and ``window`` rows use them, and each gains a row of the PyTorch path
(``ATTNZOO_NATIVE=0``) timed in the same interleaved run.

Usage::

    python benchmarks/bench_cpu_kernels.py                  # every row, as the machine is
    python benchmarks/bench_cpu_kernels.py --load 2         # with two busy processes of our own
    python benchmarks/bench_cpu_kernels.py --only decode local_global --repeats 21
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from bench_core import cpu_model, timed  # the script's folder is on sys.path

import attnzoo as az
from attnzoo.functional.backends.tiled.native import native_module
from attnzoo.functional.backends.tiled.plan import DEFAULT_TILES, TileConfig, use_tiles
from attnzoo.nn.attention import MultiHeadAttention
from attnzoo.nn.local_global import LocalGlobalAttention
from attnzoo.variants import build_attention

ROWS = ("decode", "local_global", "nsa", "nsa_train", "varlen", "varlen_train", "tiled", "window")
MIXED = [6144, 3840, 3072, 2304, 1920, 1536, 1344, 1152, 960, 768, 576, 384, 240, 192, 96, 48]  # 16, 24,576


def _busy(stop: float) -> None:
    torch.set_num_threads(1)
    a = torch.randn(1024, 1024)
    while time.time() < stop:
        a = torch.mm(a, a).clamp_(-1, 1)


def _pytorch_path(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with the compiled kernels off (``ATTNZOO_NATIVE=0``): the PyTorch path they replace."""
    def run() -> object:
        old = os.environ.get("ATTNZOO_NATIVE")
        os.environ["ATTNZOO_NATIVE"] = "0"
        try:
            return fn()
        finally:
            if old is None:
                del os.environ["ATTNZOO_NATIVE"]
            else:
                os.environ["ATTNZOO_NATIVE"] = old
    return run


def _with_pytorch_path(fns: dict[str, Callable[[], object]], key: str = "ours") -> dict[str, Callable[[], object]]:
    """``fns`` and, where the compiled kernels are built, ``"pytorch"``: ``fns[key]`` without them."""
    return {**fns, "pytorch": _pytorch_path(fns[key])} if native_module() is not None else fns


def _row(name: str, ours: float, peer: float, what: str) -> None:
    print(f"| {name} | {what} | {ours * 1e3:.2f} ms / {peer * 1e3:.2f} ms | **{peer / ours:.2f}x** faster |"
          if ours <= peer else
          f"| {name} | {what} | {ours * 1e3:.2f} ms / {peer * 1e3:.2f} ms | **{ours / peer:.2f}x** slower |",
          flush=True)


def bench_decode(repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 1, 128, generator=g)
    k, v = torch.randn(1, 8, 32768, 128, generator=g), torch.randn(1, 8, 32768, 128, generator=g)
    t = timed(_with_pytorch_path({"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                                  "ours": lambda: az.attention(q, k, v)}), repeats)
    _row("decode 1 token, 32k cache, GQA 32/8, D=128", t["ours"], t["sdpa"], "auto (split-KV) / SDPA enable_gqa")
    if "pytorch" in t:
        _row("  (PyTorch split-KV, ATTNZOO_NATIVE=0)", t["pytorch"], t["sdpa"], "auto (split-KV) / SDPA enable_gqa")


def _step(module: torch.nn.Module, prompt: torch.Tensor, token: torch.Tensor) -> Callable[[], object]:
    cache = module.init_cache(1, prompt.shape[1] + 8)
    module(prompt, cache=cache)

    def step() -> object:
        mark = cache.mark()
        out = module(token, cache=cache)
        cache.rollback(mark)
        return out

    return step


def bench_local_global(repeats: int) -> None:
    torch.manual_seed(0)
    lg = LocalGlobalAttention(512, 8, window=64, global_tokens=(0,), causal=True).eval()
    mha = MultiHeadAttention(512, 8, causal=True).eval()
    masked = LocalGlobalAttention(512, 8, window=64, global_tokens=(0,), causal=True).eval()
    masked._attend_keys = lambda *a, **kw: MultiHeadAttention._attend_keys(masked, *a, **kw)  # the Mask path
    x, tok = torch.randn(1, 2048, 512), torch.randn(1, 1, 512)
    t = timed({"mha": _step(mha, x, tok), "ours": _step(lg, x, tok), "mask": _step(masked, x, tok)}, repeats)
    _row("local_global decode step after 2,048 tokens", t["ours"], t["mha"], "local_global / mha step")
    _row("  (before: pattern as a Mask over all keys)", t["mask"], t["mha"], "Mask path / mha step")


def bench_nsa(sizes: list[int], repeats: int) -> None:
    torch.manual_seed(0)
    nsa = build_attention("nsa", 512, 8, causal=True).eval()
    gqa = build_attention("gqa", 512, 8, causal=True, num_kv_heads=2).eval()
    for n in sizes:
        x = torch.randn(1, n, 512)
        t = timed(_with_pytorch_path({"gqa": lambda x=x: gqa(x), "ours": lambda x=x: nsa(x)}), repeats)
        _row(f"nsa module N={n} (dim 512, 8 heads)", t["ours"], t["gqa"], "nsa / dense gqa module")
        if "pytorch" in t:
            _row("  (PyTorch selected branch, ATTNZOO_NATIVE=0)", t["pytorch"], t["gqa"], "nsa / dense gqa module")


def bench_nsa_train(sizes: list[int], repeats: int) -> None:
    with torch.inference_mode(False), torch.enable_grad():
        torch.manual_seed(0)
        nsa = build_attention("nsa", 512, 8, causal=True)
        gqa = build_attention("gqa", 512, 8, causal=True, num_kv_heads=2)
        for n in sizes:
            x = torch.randn(1, n, 512)

            def step(module: torch.nn.Module, x: torch.Tensor = x) -> Callable[[], object]:
                def run() -> object:
                    with torch.enable_grad():
                        xi = x.clone().requires_grad_()
                        module(xi).sum().backward()
                    return xi.grad
                return run

            t = timed(_with_pytorch_path({"gqa": step(gqa), "ours": step(nsa)}), repeats)
            _row(f"nsa module training step (fwd + bwd) N={n}", t["ours"], t["gqa"], "nsa / dense gqa module")
            if "pytorch" in t:
                _row("  (PyTorch selected branch, ATTNZOO_NATIVE=0)", t["pytorch"], t["gqa"], "nsa / dense gqa module")


def _loop_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    outs, start = [], 0
    for n in lengths:
        qi, ki, vi = (t[start:start + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True)[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


def bench_varlen(repeats: int, packed_peer: bool = True) -> None:
    g = torch.Generator().manual_seed(0)
    t_ = sum(MIXED)
    q, k, v = (torch.randn(t_, 8, 64, generator=g) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(MIXED).cumsum(0).tolist()], dtype=torch.int32)
    fns: dict[str, Callable[[], object]] = {"loop": lambda: _loop_sdpa(q, k, v, MIXED),
                                            "ours": lambda: az.attention_varlen(q, k, v, cu, cu, causal=True)}
    if packed_peer:
        fns["tiled"] = lambda: az.attention_varlen(q, k, v, cu, cu, causal=True, backend="tiled")
    t = timed(_with_pytorch_path(fns), repeats)
    _row("attention_varlen, 16 mixed causal sequences, T=24,576", t["ours"], t["loop"], "auto / per-sequence SDPA loop")
    if "pytorch" in t:
        _row("  (PyTorch path, ATTNZOO_NATIVE=0)", t["pytorch"], t["loop"], "auto / per-sequence SDPA loop")
    if packed_peer:
        _row("  (before: the packed tiled path)", t["tiled"], t["loop"], "tiled / per-sequence SDPA loop")


def bench_varlen_train(repeats: int) -> None:
    with torch.inference_mode(False), torch.enable_grad():
        g = torch.Generator().manual_seed(0)
        t_ = sum(MIXED)
        base = [torch.randn(t_, 8, 64, generator=g) for _ in range(4)]  # q, k, v, d_out
        cu = torch.tensor([0, *torch.tensor(MIXED).cumsum(0).tolist()], dtype=torch.int32)

        def step(attend: Callable[..., torch.Tensor]) -> Callable[[], object]:
            def run() -> object:
                with torch.enable_grad():
                    q, k, v = (t.clone().requires_grad_() for t in base[:3])
                    (attend(q, k, v) * base[3]).sum().backward()
                return q.grad
            return run

        fns = {"loop": step(lambda q, k, v: _loop_sdpa(q, k, v, MIXED)),
               "ours": step(lambda q, k, v: az.attention_varlen(q, k, v, cu, cu, causal=True))}
        t = timed(_with_pytorch_path(fns), repeats)
    _row("attention_varlen training (fwd + bwd), 16 mixed causal sequences", t["ours"], t["loop"],
         "auto / per-sequence SDPA loop")
    if "pytorch" in t:
        _row("  (PyTorch path, ATTNZOO_NATIVE=0)", t["pytorch"], t["loop"], "auto / per-sequence SDPA loop")


def _with_tiles(tiles: TileConfig, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with use_tiles(tiles):
            return fn()
    return run


def bench_tiled(repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 4096, 64, generator=g) for _ in range(3))
    tiled = lambda: az.attention(q, k, v, causal=True, backend="tiled")  # noqa: E731
    t = timed(_with_pytorch_path({"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                  "ours": tiled, "rows": _pytorch_path(_with_tiles(replace(DEFAULT_TILES, row_elems=1 << 22), tiled))}),
              repeats)
    _row("tiled dense causal N=4096, 8 heads, D=64 (online softmax by 512-key chunks)", t["ours"], t["sdpa"],
         "tiled / SDPA is_causal")
    if "pytorch" in t:
        _row("  (PyTorch path, ATTNZOO_NATIVE=0)", t["pytorch"], t["sdpa"], "tiled / SDPA is_causal")
    _row("  (whole-row softmax, row_elems=2^22; off by default)", t["rows"], t["sdpa"], "tiled, rows / SDPA")


def bench_window(repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    n = 65536
    q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))
    a = torch.randn(2048, 2048, generator=g)
    auto = lambda: az.attention(q, k, v, causal=True, window=(256, 0))  # noqa: E731
    t = timed(_with_pytorch_path({"auto": auto, "band": _pytorch_path(_with_tiles(replace(DEFAULT_TILES, flat_elems=0), auto)),
                                  "mm": lambda: torch.mm(a, a)}, "auto"), repeats)  # the peak measured between our calls
    flops = 4.0 * 8 * 64 * sum(min(i, 256) + 1 for i in range(n))
    peak = 2 * 2048**3 / t["mm"] / 1e9
    rows = [("auto", "auto (compiled kernel)" if "pytorch" in t else "auto (tiled flat band)"),
            *([("pytorch", "  (PyTorch flat band, ATTNZOO_NATIVE=0)")] if "pytorch" in t else []),
            ("band", "  (before: per-head band, flat_elems=0)")]
    for name, what in rows:
        rate = flops / t[name] / 1e9
        print(f"| window (256, 0) N=65536, {what} | {rate:.1f} GFLOP/s vs fp32 matmul {peak:.1f} | "
              f"{t[name] * 1e3:.1f} ms | **{100 * rate / peak:.0f}%** of peak |", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--nsa-sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--no-packed-peer", action="store_true", help="skip varlen's packed tiled row (slow when loaded)")
    p.add_argument("--load", type=int, default=0, help="busy processes started for the run (the loaded column)")
    a = p.parse_args(argv)
    stop = time.time() + 3600
    busy = [mp.get_context("spawn").Process(target=_busy, args=(stop,), daemon=True) for _ in range(a.load)]
    for b in busy:
        b.start()
    try:
        mod = native_module()
        form = "" if mod is None else (", register-blocked AVX-512 forward" if mod.has_fused() else ", sgemm forward")
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU {cpu_model()} "
              f"({platform.machine()}), load average {os.getloadavg()[0]:.1f} at start, {a.load} busy processes of "
              f"ours, compiled kernels {'built' + form if mod is not None else 'not built'}")
        print("| row | ours / peer | times | ratio |\n| --- | --- | --- | --- |")
        with torch.inference_mode():
            few = max(1, a.repeats // 3)
            runs: dict[str, Callable[[], None]] = {
                "decode": lambda: bench_decode(a.repeats), "local_global": lambda: bench_local_global(a.repeats),
                "nsa": lambda: bench_nsa(a.nsa_sizes, max(1, a.repeats // 9)),
                "nsa_train": lambda: bench_nsa_train(a.nsa_sizes, max(1, a.repeats // 9)), "varlen": lambda: bench_varlen(few, not a.no_packed_peer), "varlen_train": lambda: bench_varlen_train(few),
                "tiled": lambda: bench_tiled(few), "window": lambda: bench_window(few)}
            for name in a.only:
                runs[name]()
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
    finally:
        for b in busy:
            b.terminate()


if __name__ == "__main__":
    main()
