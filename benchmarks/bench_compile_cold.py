"""Cold ``torch.compile`` time of ``az.attention`` per backend and mask (issue 20: under 10 s at N = 2048).

Each case runs in a fresh Python process with an empty inductor cache
(``TORCHINDUCTOR_CACHE_DIR`` set to a new temporary folder), so nothing from an earlier compile is
reused: the number is what a user pays the first time. "compile s" is the first call of
``torch.compile(fn, fullgraph=True)`` (tracing, AOTAutograd, inductor code generation, C++ builds),
for the forward alone and for forward + backward (a fresh process each). Shape ``[1, 4, N, 32]``,
float32; FlexAttention has no CPU backward, so ``flex`` is timed forward only.

    python benchmarks/bench_compile_cold.py                    # every backend, causal and window (64, 0)
    python benchmarks/bench_compile_cold.py --backends tiled --masks window --threads 2
    python benchmarks/bench_compile_cold.py --setup-first   # without the empty cache's one-time set-up
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

BACKENDS = ("auto", "reference", "sdpa", "tiled", "flex")
MASKS = {"causal": None, "window": (64, 0)}

_CHILD = """
import json, sys, time, torch, attnzoo as az
backend, window, n, train, threads, setup_first = json.loads(sys.argv[1])
if threads:
    torch.set_num_threads(threads)
if setup_first:  # inductor's one-time set-up of the empty cache (ISA probes, precompiled header)
    x = torch.randn(64, requires_grad=True)
    torch.compile(lambda t: (t * 2).sin().sum())(x).backward()
window = tuple(window) if window else None
q, k, v = (torch.randn(1, 4, n, 32, requires_grad=train) for _ in range(3))
fn = torch.compile(lambda q, k, v: az.attention(q, k, v, causal=True, window=window, backend=backend),
                   fullgraph=True)
t = time.perf_counter()
out = fn(q, k, v)
if train:
    out.sum().backward()
print(json.dumps({"compile_s": time.perf_counter() - t}))
"""


def cold_compile_seconds(backend: str, window: tuple[int, int] | None, n: int, train: bool,
                         threads: int | None, setup_first: bool = False) -> float:
    """Seconds of the first compiled call, in a fresh process with an empty inductor cache (with
    ``setup_first``, after a trivial compile has paid the cache's one-time set-up, untimed)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        args = json.dumps([backend, window, n, train, threads, setup_first])
        done = subprocess.run([sys.executable, "-c", _CHILD, args], env=env, capture_output=True, text=True,
                              check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{backend}/{window}: the child failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["compile_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated subset of {BACKENDS}")
    p.add_argument("--masks", default=",".join(MASKS), help=f"comma-separated subset of {tuple(MASKS)}")
    p.add_argument("--n", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--threads", type=int, default=None, help="torch threads in the child (default: torch's)")
    p.add_argument("--setup-first", action="store_true",
                   help="in each child, compile a trivial function first (untimed): the empty cache's one-time "
                        "set-up (vector-ISA probes, precompiled header) is then left out of the number")
    a = p.parse_args()
    backends, masks = a.backends.split(","), a.masks.split(",")
    for name, allowed in (("backends", BACKENDS), ("masks", tuple(MASKS))):
        bad = set(getattr(a, name).split(",")) - set(allowed)
        if bad:
            p.error(f"unknown {name} {sorted(bad)}; choose from {allowed}")
    print(f"{'backend':<10} {'mask':<7} {'fwd s':>7} {'fwd+bwd s':>10}")
    for backend in backends:
        for mask in masks:
            fwd = cold_compile_seconds(backend, MASKS[mask], a.n, False, a.threads, a.setup_first)
            both = ("-" if backend == "flex" else
                    f"{cold_compile_seconds(backend, MASKS[mask], a.n, True, a.threads, a.setup_first):.2f}")
            print(f"{backend:<10} {mask:<7} {fwd:>7.2f} {both:>10}", flush=True)


if __name__ == "__main__":
    main()
