"""torch.compile: compile time and compiled/eager time ratio of attnzoo calls (CPU, float32).

Cases (shapes of issue 20): ``az.attention`` dense causal and sliding window ``(64, 0)`` at
``[1, 4, N, 32]``, causal ``az.linear_attention``, ``az.sigmoid_attention`` (window 64),
``az.attention_varlen`` (the N tokens as 4 causal sequences), ``az.retention``,
``az.gated_linear_attention`` (a decay per key dimension) and ``az.delta_rule`` (chunked forms) at
the same shape (forward, inference), ``dense-train`` and ``varlen-train`` (the dense causal and
varlen calls, forward + backward to q, k, v), ``nsa-train`` (forward + backward of ``build_attention("nsa", 128, 8)``, the paper's
block sizes, on ``[1, N, 128]``), and a training step (forward + backward) of ``DecoderLM(vocab_size=100, dim=128, depth=2,
num_heads=4, attention="sliding")`` on ``N`` tokens.

"compile s" is the first call of the compiled function (tracing, AOTAutograd, inductor code
generation and C++ builds; a fresh process pays inductor's one-time start-up in the first case,
and inductor's on-disk cache makes later processes faster). Times are medians of interleaved
repeats in the same run (eager then compiled, then compiled then eager, ...), so load from other
processes and the order of the calls hit both alike. ratio = compiled / eager (< 1: compiled is faster).

    python benchmarks/bench_compile.py                     # every case at N = 2048
    python benchmarks/bench_compile.py --cases window,lm --repeats 7 --threads 2
    python benchmarks/bench_compile.py --cases lm --lm-attention mha --setup-first
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnzoo as az
from attnzoo.variants import build_attention

CASES = ("dense", "dense-train", "window", "linear", "sigmoid", "varlen", "varlen-train", "retention", "gla", "deltanet",
         "nsa-train", "lm")


def _calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The inference cases on ``[1, 4, N, 32]`` (varlen: the same tokens packed as 4 sequences)."""
    n = q.shape[2]
    cu = torch.tensor([0, n // 8, n // 4, n // 2, n], dtype=torch.int32)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]  # [N, 4, 32]
    gamma = torch.tensor([0.9, 0.95, 0.98, 0.99])
    gen = torch.Generator().manual_seed(0)
    log_decay = F.logsigmoid(torch.randn(*q.shape, generator=gen) + 3)  # GLA: a decay per key dimension
    beta = torch.rand(*q.shape[:3], generator=gen)
    return {
        "dense": lambda: az.attention(q, k, v, causal=True),
        "window": lambda: az.attention(q, k, v, causal=True, window=(64, 0)),
        "linear": lambda: az.linear_attention(q, k, v, causal=True),
        "sigmoid": lambda: az.sigmoid_attention(q, k, v, causal=True, window=64),
        "varlen": lambda: az.attention_varlen(*packed, cu, cu, causal=True),
        "retention": lambda: az.retention(q * 0.2, k * 0.2, v, gamma),
        "gla": lambda: az.gated_linear_attention(q * 0.2, k * 0.2, v, log_decay),
        "deltanet": lambda: az.delta_rule(q, F.normalize(k, dim=-1), v, beta),
    }


def _time(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _qkv_train(fwd: Callable[..., torch.Tensor], *shape: int) -> tuple[Callable[[], object], Callable[[], object]]:
    """(eager, compiled) forward + backward of ``fwd(q, k, v)`` on q, k, v of ``shape`` (gradients of
    q, k, v; the forward is compiled, its backward is the graph AOTAutograd derived)."""
    q, k, v = (torch.randn(*shape, requires_grad=True) for _ in range(3))
    go = torch.randn(*shape)
    compiled = torch.compile(fwd, fullgraph=True)

    def step(f: Callable[..., torch.Tensor]) -> Callable[[], object]:
        def run() -> object:
            for t in (q, k, v):
                t.grad = None
            (f(q, k, v) * go).sum().backward()
            return q.grad
        return run

    return step(fwd), step(compiled)


def _varlen_train(n: int) -> tuple[Callable[[], object], Callable[[], object]]:
    """The ``varlen`` case, forward + backward."""
    cu = torch.tensor([0, n // 8, n // 4, n // 2, n], dtype=torch.int32)
    return _qkv_train(lambda q, k, v: az.attention_varlen(q, k, v, cu, cu, causal=True), n, 4, 32)


def _nsa_train(n: int) -> tuple[Callable[[], object], Callable[[], object]]:
    """(eager, compiled) forward + backward of the native-sparse-attention module (C = 128, H = 8,
    the paper's block sizes; gradients of the input and every parameter)."""
    torch.manual_seed(0)
    mod = build_attention("nsa", 128, 8)
    x = torch.randn(1, n, 128, requires_grad=True)
    go = torch.randn(1, n, 128)
    compiled = torch.compile(mod, fullgraph=True)

    def step(f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        def run() -> object:
            mod.zero_grad(set_to_none=True)
            x.grad = None
            (f(x) * go).sum().backward()
            return x.grad
        return run

    return step(mod), step(compiled)


def _case(name: str, n: int, lm_attention: str = "sliding") -> tuple[Callable[[], object], Callable[[], object]]:
    """(eager call, compiled call) of a case; the compiled one is built lazily by its first call."""
    if name == "varlen-train":
        return _varlen_train(n)
    if name == "dense-train":
        return _qkv_train(lambda q, k, v: az.attention(q, k, v, causal=True), 1, 4, n, 32)
    if name == "nsa-train":
        return _nsa_train(n)
    q, k, v = (torch.randn(1, 4, n, 32) for _ in range(3))
    if name != "lm":
        attn = _calls(q, k, v)[name]
        compiled = torch.compile(attn, fullgraph=True)

        def eager_inf() -> object:
            with torch.no_grad():
                return attn()

        def compiled_inf() -> object:
            with torch.no_grad():
                return compiled()

        return eager_inf, compiled_inf
    lm = az.DecoderLM(vocab_size=100, dim=128, depth=2, num_heads=4, attention=lm_attention)
    tok = torch.randint(0, 100, (1, n))
    compiled_lm = torch.compile(lm, fullgraph=True)

    def step(model: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        def run() -> object:
            lm.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(tok).flatten(0, 1), tok.flatten())
            loss.backward()
            return loss
        return run

    return step(lm), step(compiled_lm)


def run(cases: list[str], n: int, repeats: int, lm_attention: str = "sliding") -> list[dict[str, object]]:
    rows = []
    for name in cases:
        torch._dynamo.reset()
        eager, compiled = _case(name, n, lm_attention)
        compile_s = _time(compiled)
        eager()  # warm-up (plan caches, allocator)
        compiled()
        te, tc = [], []
        for i in range(repeats):  # the order swaps every repeat: neither call always runs first
            for times, fn in ((te, eager), (tc, compiled))[:: 1 if i % 2 == 0 else -1]:
                times.append(_time(fn))
        e, c = statistics.median(te), statistics.median(tc)
        label = f"lm-{lm_attention}" if name == "lm" else name
        row = {"case": label, "n": n, "compile_s": round(compile_s, 2), "eager_ms": round(e * 1e3, 2),
               "compiled_ms": round(c * 1e3, 2), "ratio": round(c / e, 3)}
        print(f"{label:12s} N={n}  compile {compile_s:6.2f} s   eager {e * 1e3:8.2f} ms   compiled "
              f"{c * 1e3:8.2f} ms   compiled/eager {c / e:.3f}", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {CASES}")
    p.add_argument("--n", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--lm-attention", default="sliding",
                   help="the attention variant of the lm case's DecoderLM (default: sliding; see `attnzoo list`)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--setup-first", action="store_true",
                   help="compile a trivial function first and report its time: inductor's one-time set-up of a "
                        "fresh cache (vector-ISA probes, precompiled header) is then not in the first case")
    a = p.parse_args()
    cases = [c for c in a.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        p.error(f"unknown cases {sorted(unknown)}; choose from {CASES}")
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if a.setup_first:
        x = torch.randn(64, requires_grad=True)
        setup_s = _time(lambda: torch.compile(lambda t: (t * 2).sin().sum())(x).backward())
        print(f"inductor set-up (a trivial function, forward + backward): {setup_s:.2f} s", flush=True)
    rows = run(cases, a.n, a.repeats, a.lm_attention)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
