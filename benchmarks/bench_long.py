"""Long-context forward cost: causal linear attention, Performer, Infini-attention vs causal SDPA.

B=1, H=8, D=64, float32, forward only (inference mode), attention kernels on ``[B, H, N, D]``
inputs (no projections). Every (method, N) runs in a fresh subprocess so that its memory is its
own:

* time: median wall time of up to ``--repeats`` calls (fewer once they took ``--max-seconds``)
  after a warm-up call at N=1024; also the median process CPU time, which a shared machine
  inflates less than wall time;
* peak memory: the process's peak resident set size (``VmHWM`` from ``/proc/self/status``) during
  the first timed call minus the resident set size just before it (inputs already allocated).
  The peak is reset with ``echo 5 > /proc/self/clear_refs`` (Linux >= 4.0). torch's CPU allocator
  returns large blocks to the OS, so this is the extra memory the call touched. Blocks under
  glibc's mmap threshold (at most 32 MiB) may reuse memory freed earlier in the process, so small
  values are lower bounds. (tracemalloc does not see torch allocations.)

A naive "cumsum" causal linear attention (materialising the per-token state ``[N, F, Dv]``) is
the memory peer; it runs only at the sizes given by ``--cumsum-max``.

Usage::

    python benchmarks/bench_long.py                     # the default grid (~4 min of CPU time)
    python benchmarks/bench_long.py --summarize out.json  # re-print the summary of a saved run
    python benchmarks/bench_long.py --sizes 4096 16384 --repeats 5 --json out.json

Times are comparable only within one run (the machine may be shared): compare columns, and
read ``t(4N)/t(N)`` for the scaling.
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

B, H, D = 1, 8, 64
METHODS = ("linear", "performer", "infini", "sdpa", "cumsum")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _make_call(method: str, n: int) -> Callable[[], object]:
    import torch

    import attnzoo as az
    from attnzoo.functional.feature_maps.infini import infini_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g).mul_(0.5 if i < 2 else 1.0) for i in range(3))
    if method == "linear":
        return lambda: az.linear_attention(q, k, v, causal=True)
    if method == "performer":
        w = az.draw_performer_projection(256, D, seed=0)
        return lambda: az.performer_attention(q, k, v, w, causal=True)
    if method == "infini":
        gate = torch.zeros(H)
        return lambda: infini_attention(q, k, v, gate, segment_len=2048)
    if method == "sdpa":
        return lambda: az.attention(q, k, v, causal=True, backend="sdpa")
    if method == "cumsum":
        def cumsum_linear() -> object:  # the textbook O(N F Dv)-memory prefix-sum form
            fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
            s = torch.cumsum(fk.unsqueeze(-1) * v.unsqueeze(-2), dim=2)  # [B, H, N, F, Dv]
            z = torch.cumsum(fk, dim=2)
            return (fq.unsqueeze(-2) @ s).squeeze(-2) / ((fq * z).sum(-1, keepdim=True) + 1e-6)
        return cumsum_linear
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


def worker(method: str, n: int, repeats: int, threads: int, max_seconds: float) -> dict:
    import torch

    torch.set_num_threads(threads)
    with torch.inference_mode():
        _make_call(method, 1024)()  # warm-up: kernels, allocator, lazy imports
        call = _make_call(method, n)
        rss0 = _status_kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS
        times, cpu = [], []
        c0, t0 = time.process_time(), time.perf_counter()
        out = call()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        peak = _status_kb("VmHWM")
        del out
        while len(times) < repeats and sum(times) < max_seconds:
            c0, t0 = time.process_time(), time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return {"method": method, "n": n, "time_s": statistics.median(times), "cpu_s": statistics.median(cpu),
            "times": times, "peak_extra_mb": (peak - rss0) / 1024}


def run_case(method: str, n: int, repeats: int, threads: int, max_seconds: float, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", method, str(n), str(repeats), str(threads),
           str(max_seconds)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"method": method, "n": n, "error": f"timeout > {timeout:.0f}s"}
    if res.returncode != 0:
        return {"method": method, "n": n, "error": res.stderr.strip().splitlines()[-1] if res.stderr else "failed"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def crossing(rows: list[dict], method: str, key: str = "time_s") -> str:
    """Smallest measured N from which ``method`` is faster than causal SDPA (and stays so)."""
    t = {(r["method"], r["n"]): r[key] for r in rows if key in r}
    ns = sorted(n for (m, n) in t if m == "sdpa" and (method, n) in t)
    if not ns:
        return "n/a"
    faster = [t[(method, n)] < t[("sdpa", n)] for n in ns]
    if all(faster):
        return f"faster already at the smallest N measured ({ns[0]})"
    if not any(faster):
        return f"slower at every N measured (up to {ns[-1]})"
    for i in range(len(ns)):
        if all(faster[i:]):
            return f"between N={ns[i - 1]} and N={ns[i]}"
    return "no stable crossing"


def summarize(rows: list[dict]) -> None:
    """Scaling ratios and SDPA crossings, on wall time and on process CPU time."""
    sizes = sorted({r["n"] for r in rows})
    for key, label in (("time_s", "wall"), ("cpu_s", "cpu")):
        t = {(r["method"], r["n"]): r[key] for r in rows if key in r}
        for m in ("linear", "performer", "infini", "sdpa"):
            pairs = [(n, 4 * n) for n in sizes if (m, n) in t and (m, 4 * n) in t]
            ratios = ", ".join(f"t({n2})/t({n1}) = {t[(m, n2)] / t[(m, n1)]:.2f}" for n1, n2 in pairs)
            if ratios:
                print(f"[{label}] {m:>10}: {ratios}")
        for m in ("linear", "performer", "infini"):
            print(f"[{label}] {m:>10} vs causal SDPA: {crossing(rows, m, key)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 65536])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sdpa-max", type=int, default=16384, help="largest N for causal SDPA (quadratic time)")
    p.add_argument("--cumsum-max", type=int, default=4096, help="largest N for the naive cumsum peer")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per case")
    p.add_argument("--json", type=str, default=None, help="also write the rows here")
    p.add_argument("--summarize", type=str, default=None, metavar="JSON",
                   help="print the summary of rows saved by an earlier --json run, then exit")
    p.add_argument("--max-seconds", type=float, default=10.0,
                   help="stop repeating a case once its calls took this long (at least one call)")
    p.add_argument("--worker", nargs=5, metavar=("METHOD", "N", "REPEATS", "THREADS", "MAXS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        m, n, r, th, mx = a.worker
        print(json.dumps(worker(m, int(n), int(r), int(th), float(mx))))
        return
    if a.summarize:
        with open(a.summarize) as f:
            summarize(json.load(f))
        return
    rows = []
    start = time.perf_counter()
    print(f"B={B} H={H} D={D} float32 forward, threads={a.threads}, median of {a.repeats}")
    print(f"{'method':>10} {'N':>7} {'time (s)':>10} {'cpu (s)':>9} {'calls':>5} {'peak extra (MB)':>16}")
    for n in a.sizes:
        for m in a.methods:
            if (m == "sdpa" and n > a.sdpa_max) or (m == "cumsum" and n > a.cumsum_max):
                continue
            r = run_case(m, n, a.repeats, a.threads, a.max_seconds, a.timeout)
            rows.append(r)
            if "error" in r:
                print(f"{m:>10} {n:>7} {'error: ' + r['error']}")
            else:
                print(f"{m:>10} {n:>7} {r['time_s']:>10.4f} {r['cpu_s']:>9.3f} {len(r['times']):>5} "
                      f"{r['peak_extra_mb']:>16.1f}", flush=True)
    print()
    summarize(rows)
    print(f"total {time.perf_counter() - start:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
