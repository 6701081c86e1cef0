"""Before/after timing of two checkouts of attnzoo: the same calls in fresh processes, alternating.

A refactor must leave speed unchanged within noise. This runs each case in a new Python process
per tree (``PYTHONPATH=<tree>/src``), the two trees alternating round by round, and prints the
median time of each and the ratio new / old. The cases use only calls both trees accept
(registry names through ``build_attention``, ``DecoderLM``'s positional shape, ``az.attention``).

Usage::

    git worktree add /tmp/attnzoo-old <commit>
    python benchmarks/bench_ab.py --old /tmp/attnzoo-old --new . --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

#: name -> code run in the child (``REPEATS`` calls of ``step()`` are timed; setup is not)
#: the module-forward cases: name -> the ``build_attention`` arguments of the module timed
_MODULES = {"mha": '"mha", 256, 8, causal=True', "sliding": '"sliding", 256, 8, window=128',
            "gated_deltanet": '"gated_deltanet", 256, 4', "linear": '"linear", 256, 8, causal=True'}
_MODULE_STEP = """
m = build_attention({args}).eval()
x = torch.randn(4, 512, 256)
def step():
    with torch.no_grad():
        m(x)
"""

CASES: dict[str, str] = {
    **{f"{name} module fwd N=512": _MODULE_STEP.format(args=args) for name, args in _MODULES.items()},
    "DecoderLM mha fwd 4x512": """
lm = az.DecoderLM(256, 256, 4, 8).eval()
t = torch.randint(0, 256, (4, 512))
def step():
    with torch.no_grad():
        lm(t)
""",
    "DecoderLM mha train step 4x256": """
lm = az.DecoderLM(256, 256, 4, 8)
opt = torch.optim.AdamW(lm.parameters(), lr=1e-4)
t = torch.randint(0, 256, (4, 257))
def step():
    logits = lm(t[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), t[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
""",
    "az.attention auto causal N=2048": """
q, k, v = (torch.randn(1, 8, 2048, 64) for _ in range(3))
def step():
    az.attention(q, k, v, causal=True)
""",
}

CHILD = """
import time, json, sys, torch
import attnzoo as az
from attnzoo.variants import build_attention
torch.manual_seed(0)
torch.set_num_threads({threads})
{setup}
step()
times = []
for _ in range({repeats}):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
times.sort()
print(json.dumps(times[len(times) // 2]))
"""


def run_case(tree: Path, code: str, threads: int, repeats: int) -> float:
    """Median seconds of ``repeats`` steps in a fresh process importing ``tree``'s attnzoo."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    src = CHILD.format(threads=threads, setup=code, repeats=repeats)
    out = subprocess.run([sys.executable, "-c", src], env=env, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, required=True, help="checkout before the change (its src/ is imported)")
    p.add_argument("--new", type=Path, default=Path("."), help="checkout after the change (default: here)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per case (median over them)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per process (their median is one sample)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", nargs="*", default=None, help="case names (substrings) to run")
    args = p.parse_args()
    print(f"old={args.old} new={args.new} threads={args.threads} rounds={args.rounds} repeats={args.repeats}")
    for name, code in CASES.items():
        if args.only and not any(s in name for s in args.only):
            continue
        old, new = [], []
        for _ in range(args.rounds):
            old.append(run_case(args.old.resolve(), code, args.threads, args.repeats))
            new.append(run_case(args.new.resolve(), code, args.threads, args.repeats))
        mo, mn = statistics.median(old), statistics.median(new)
        print(json.dumps({"case": name, "old_ms": round(1e3 * mo, 2), "new_ms": round(1e3 * mn, 2),
                          "new_over_old": round(mn / mo, 3)}), flush=True)


if __name__ == "__main__":
    main()
