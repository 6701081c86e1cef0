"""Benchmark of the chunked recurrent kernels (issue 16's performance paragraph).

For each kernel (retention, GLA with a decay per key dimension, GLA with one decay per token =
Mamba-2's SSD, DeltaNet, Gated DeltaNet), at B=1, H=8, Dk=Dv=64, float32, forward only:

* time of the chunked form at N=16384 and N=65536 (median of ``--repeats``, the two lengths
  interleaved so that machine load hits both alike) and their ratio: linear time gives 4
  (target between 3 and 5);
* peak memory at N=65536, measured in a fresh subprocess as ``benchmarks/bench_core.py`` does:
  after a warm-up call (at a small N) and once the inputs exist, the resident-set high-water mark
  (``VmHWM``) is reset through ``/proc/self/clear_refs`` and its growth during the call is
  reported ("extra", target < 1 GB), together with the process's whole ``VmHWM`` (inputs,
  output and the Python/torch runtime included). glibc's mmap threshold is fixed at 64 KiB so
  freed tensors leave the resident set at once (Linux only);
* decode state: bytes of the state a decoder carries (``[B, H, Dk, Dv]``), the same at every N.

Usage::

    python benchmarks/bench_recurrent.py                    # all kernels (several minutes on 2 cores)
    python benchmarks/bench_recurrent.py --only retention deltanet --repeats 1 --threads 1
    python benchmarks/bench_recurrent.py --json out.json
    python benchmarks/bench_recurrent.py --forms --threads 1   # quadratic vs chunked below one chunk
    python benchmarks/bench_recurrent.py --frontier --lengths 16384 65536 --threads 1 --repeats 3

``--frontier`` (issue 34): at each length, forward and forward + backward (chunked, fp32, median of
``--repeats``, the compared calls interleaved): KDA (``delta_rule`` with ``log_decay [B, H, N, Dk]``)
over the scalar-decay gated delta rule, with weak decays (``logsigmoid(x + 3)``: the fast plan) and with
the strong ones of a freshly initialised Kimi Linear layer (the exact plan); 16 packed sequences of mixed lengths (one call with
``cu_seqlens``) over a loop of 16 per-sequence calls (gated delta rule and KDA); and the peak extra
memory of one KDA forward per length (fresh subprocess, as above): linear in N means a constant MB/token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnzoo as az

B, H, D = 1, 8, 64
KERNELS = ("retention", "gla", "gla_scalar", "deltanet", "gated_deltanet", "kda")
Call = Callable[..., "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


def make(kernel: str, n: int, b: int = B, h: int = H, d: int = D) -> tuple[Call, dict[str, torch.Tensor]]:
    """The kernel's function and its float32 inputs at ``[b, h, n, d]`` (gates as a model would give them)."""
    B, H, D = b, h, d
    gen = torch.Generator().manual_seed(0)
    x = {"q": torch.randn(B, H, n, D, generator=gen), "k": torch.randn(B, H, n, D, generator=gen),
         "v": torch.randn(B, H, n, D, generator=gen)}
    if kernel == "retention":
        x["gamma"] = 1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float32))
        return lambda q, k, v, gamma, **kw: az.retention(q, k, v, gamma, **kw), x
    if kernel.startswith("gla"):
        shape = (B, H, n) if kernel == "gla_scalar" else (B, H, n, D)
        x["log_decay"] = F.logsigmoid(torch.randn(*shape, generator=gen) + 3)
        return lambda q, k, v, log_decay, **kw: az.gated_linear_attention(q, k, v, log_decay, **kw), x
    x["k"] = F.normalize(x["k"], dim=-1)
    x["beta"] = torch.rand(B, H, n, generator=gen)
    if kernel == "gated_deltanet":
        x["log_decay"] = F.logsigmoid(torch.randn(B, H, n, generator=gen) + 3)
    if kernel == "kda":  # a decay per key channel
        x["log_decay"] = F.logsigmoid(torch.randn(B, H, n, D, generator=gen) + 3)
    return lambda q, k, v, beta, **kw: az.delta_rule(q, k, v, beta, **kw), x


def kimi_init_decays(n: int, b: int = B, h: int = H, d: int = D) -> torch.Tensor:
    """Per-channel log decays as a freshly initialised Kimi Linear layer gives them (Mamba-2's
    initialisation: ``-A softplus(dt_bias)`` with ``A ~ U(1, 16)`` per head and ``dt`` log-uniform in
    [1e-3, 0.1] per channel): some channels decay by e^-100 over a chunk, so the exact plan runs."""
    gen = torch.Generator().manual_seed(1)
    a = torch.empty(h).uniform_(1, 16, generator=gen)
    dt = torch.empty(h, d).uniform_(-6.9078, -2.3026, generator=gen).exp()
    jitter = 1 + 0.1 * torch.randn(b, h, n, d, generator=gen)
    return -(a[:, None] * dt)[None, :, None, :] * jitter.clamp_min(0)


def _vm(field: str) -> int:
    """A ``/proc/self/status`` memory field in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(kernel: str, n: int) -> None:
    """Runs in a fresh process: peak memory of one chunked forward at length ``n``."""
    fn, x = make(kernel, 256)
    with torch.no_grad():
        fn(**x, form="chunked")  # warm-up: library initialisation, not at the measured size
    fn, x = make(kernel, n)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current resident set
    base = _vm("VmRSS")
    with torch.no_grad():
        out = fn(**x, form="chunked")
    print(json.dumps({"peak_extra_MB": (_vm("VmHWM") - base) / 1024, "process_VmHWM_MB": _vm("VmHWM") / 1024,
                      "output_MB": out.numel() * out.element_size() / 2**20}))


def child_memory(kernel: str, n: int, threads: int) -> dict[str, float]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(threads)}
    res = subprocess.run([sys.executable, __file__, "--child", kernel, str(n)], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(res.stdout.strip().splitlines()[-1])


def timings(kernel: str, lengths: tuple[int, int], repeats: int) -> dict[int, float]:
    """Median forward time (s) of the chunked form at each length, lengths interleaved."""
    runs: dict[int, list[float]] = {n: [] for n in lengths}
    cases = {n: make(kernel, n) for n in lengths}
    with torch.no_grad():
        for _ in range(repeats):
            for n, (fn, x) in cases.items():
                t0 = time.perf_counter()
                fn(**x, form="chunked")
                runs[n].append(time.perf_counter() - t0)
    return {n: statistics.median(ts) for n, ts in runs.items()}


#: ``(B, H, D)`` of training batches like the arena's (width 64 and 256), at ``N = 64`` = one chunk.
FORM_SHAPES = ((32, 4, 16), (8, 4, 64))


def form_timings(kernel: str, repeats: int) -> list[dict[str, object]]:
    """Forward + backward ms of the quadratic, chunked and auto forms at one chunk (``N = 64``), the
    forms interleaved: the measurement behind each kernel's ``form="auto"`` choice below one chunk."""
    rows = []
    for b, h, d in FORM_SHAPES:
        fn, x = make(kernel, 64, b, h, d)
        x = {k: t.requires_grad_() for k, t in x.items()}
        runs: dict[str, list[float]] = {f: [] for f in ("quadratic", "chunked", "auto")}
        for _ in range(repeats + 1):  # the first round warms up
            for form, ts in runs.items():
                t0 = time.perf_counter()
                fn(**x, form=form).sum().backward()
                ts.append(time.perf_counter() - t0)
        ms = {f: 1000 * statistics.median(ts[1:]) for f, ts in runs.items()}
        rows.append({"kernel": kernel, "B,H,N,D": f"{b},{h},64,{d}", **{f"{f}_ms": round(v, 1) for f, v in ms.items()},
                     "quadratic_over_chunked": round(ms["quadratic"] / ms["chunked"], 2)})
    return rows


def mixed_lengths(n: int, count: int = 16, seed: int = 0) -> list[int]:
    """``count`` lengths >= 1 summing to ``n``, spread over two orders of magnitude (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(count, generator=gen, dtype=torch.float64).mul(4.6).exp()  # e^0 .. e^4.6 ~ 1 .. 100
    lengths = [max(1, int(n * float(x) / float(w.sum()))) for x in w]
    lengths[int(w.argmax())] += n - sum(lengths)
    return lengths


def _timed_call(fn: Callable[[], torch.Tensor], backward: bool) -> float:
    t0 = time.perf_counter()
    if backward:
        fn().sum().backward()
    else:
        with torch.no_grad():
            fn()
    return time.perf_counter() - t0


def interleaved(calls: dict[str, Callable[[], torch.Tensor]], backward: bool, repeats: int) -> dict[str, float]:
    """Median seconds of each call (``repeats`` rounds, calls interleaved; with ``repeats > 1`` one
    warm-up round first, whose times are dropped)."""
    runs: dict[str, list[float]] = {k: [] for k in calls}
    warm = 1 if repeats > 1 else 0
    for r in range(repeats + warm):
        for k, fn in calls.items():
            t = _timed_call(fn, backward)
            if r >= warm:
                runs[k].append(t)
    return {k: statistics.median(v) for k, v in runs.items()}


def frontier_rows(n: int, repeats: int, threads: int) -> list[dict[str, object]]:
    """KDA vs the gated delta rule, packed vs a loop, at length ``n`` (forward and forward + backward)."""
    rows: list[dict[str, object]] = []
    inputs = {k: make(k, n)[1] for k in ("gated_deltanet", "kda")}
    inputs["kda_strong"] = {**inputs["kda"], "log_decay": kimi_init_decays(n)}
    for backward in (False, True):
        xs = {k: {name: t.clone().requires_grad_(backward) for name, t in x.items()} for k, x in inputs.items()}

        def run(k: str, **kw: object) -> Callable[[], torch.Tensor]:
            x = xs[k]
            return lambda: az.delta_rule(x["q"], x["k"], x["v"], x["beta"], log_decay=x["log_decay"],
                                         form="chunked", **kw)  # type: ignore[return-value]

        t = interleaved({"gdn": run("gated_deltanet"), "kda": run("kda"), "strong": run("kda_strong")}, backward,
                        repeats)
        rows.append({"case": "kda_vs_gated_delta", "N": n, "pass": "fwd+bwd" if backward else "fwd",
                     "gated_delta_s": round(t["gdn"], 3), "kda_s": round(t["kda"], 3),
                     "kda_over_gated_delta": round(t["kda"] / t["gdn"], 2)})
        rows.append({"case": "kda_kimi_init_decays_vs_gated_delta", "N": n, "pass": "fwd+bwd" if backward else "fwd",
                     "gated_delta_s": round(t["gdn"], 3), "kda_s": round(t["strong"], 3),
                     "kda_over_gated_delta": round(t["strong"] / t["gdn"], 2)})
        lengths = mixed_lengths(n)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        for k in ("gated_deltanet", "kda"):
            x = xs[k]

            def loop(x: dict[str, torch.Tensor] = x) -> torch.Tensor:
                outs = []
                for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=False):
                    outs.append(az.delta_rule(*(x[name][:, :, lo:hi] for name in ("q", "k", "v", "beta")),
                                              log_decay=x["log_decay"][:, :, lo:hi], form="auto"))  # type: ignore[arg-type]
                return torch.cat(outs, dim=2)

            t = interleaved({"packed": run(k, cu_seqlens=cu), "loop": loop}, backward, repeats)
            rows.append({"case": f"packed16_{k}", "N": n, "pass": "fwd+bwd" if backward else "fwd",
                         "lengths_min_max": [min(lengths), max(lengths)], "packed_s": round(t["packed"], 3),
                         "loop_s": round(t["loop"], 3), "packed_over_loop": round(t["packed"] / t["loop"], 2)})
    mem = child_memory("kda", n, threads)
    rows.append({"case": "kda_fwd_peak_memory", "N": n, "peak_extra_MB": round(mem["peak_extra_MB"], 1),
                 "extra_KB_per_token": round(1024 * mem["peak_extra_MB"] / n, 2),
                 "process_VmHWM_MB": round(mem["process_VmHWM_MB"], 1), "output_MB": mem["output_MB"]})
    return rows


def decode_state_bytes(kernel: str) -> int:
    """Bytes of the state after a one-token decode step (what a decoder keeps, independent of N)."""
    fn, x = make(kernel, 1)
    _, state = fn(**x, return_state=True)
    return state.numel() * state.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--forms", action="store_true",
                        help="instead: forward + backward of the quadratic / chunked / auto forms at one chunk")
    parser.add_argument("--frontier", action="store_true",
                        help="instead: KDA vs gated delta rule, packed vs loop, KDA memory (issue 34)")
    parser.add_argument("--lengths", nargs="+", type=int, default=[16384, 65536], help="N for --frontier")
    parser.add_argument("--child", nargs=2, metavar=("KERNEL", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    torch.set_num_threads(args.threads)
    if args.frontier:
        print(f"B={B} H={H} Dk=Dv={D} fp32, chunked, {args.threads} thread(s), median of {args.repeats}")
        for n in args.lengths:
            for row in frontier_rows(n, args.repeats, args.threads):
                print(json.dumps(row), flush=True)
        return
    if args.forms:
        print(f"forward + backward at one chunk, fp32, {args.threads} thread(s), median of {args.repeats}")
        for kernel in args.only:
            for row in form_timings(kernel, args.repeats):
                print(json.dumps(row), flush=True)
        return
    rows = []
    print(f"B={B} H={H} Dk=Dv={D} fp32, chunked forward, {args.threads} thread(s), median of {args.repeats}")
    for kernel in args.only:
        t = timings(kernel, (16384, 65536), args.repeats)
        mem = child_memory(kernel, 65536, args.threads)
        row = {"kernel": kernel, "t16k_s": round(t[16384], 3), "t64k_s": round(t[65536], 3),
               "ratio_64k_16k": round(t[65536] / t[16384], 2), "peak_extra_MB_64k": round(mem["peak_extra_MB"], 1),
               "process_VmHWM_MB_64k": round(mem["process_VmHWM_MB"], 1), "output_MB": mem["output_MB"],
               "decode_state_bytes": decode_state_bytes(kernel)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "repeats": args.repeats, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
