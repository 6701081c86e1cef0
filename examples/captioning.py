"""Image captioning in miniature: a ViT encoder and a decoder that cross-attends to its patches.

Synthetic data: 32x32 images of a coloured square on a noisy background; the caption names the
colour and where the square is, e.g. ``<bos> red top left <eos>``. The two models train jointly
for a few hundred steps (teacher forcing, cross-entropy), then caption held-out images greedily
with the decoder's KV cache (the cross-attention keys of the image are projected once).

    python examples/captioning.py            # ~20 s on 2 CPU cores
    python examples/captioning.py --steps 50 # quicker, less accurate
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnzoo as az

COLORS = {"red": (1.0, 0.1, 0.1), "green": (0.1, 0.9, 0.1), "blue": (0.1, 0.2, 1.0)}
ROWS, COLS = ("top", "bottom"), ("left", "right")
VOCAB = ["<pad>", "<bos>", "<eos>", *COLORS, *ROWS, *COLS]
TOK = {w: i for i, w in enumerate(VOCAB)}
IMAGE, SQUARE = 32, 10


def make_batch(n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Images ``[n, 3, 32, 32]`` and captions ``[n, 5]`` (``<bos> colour row col <eos>``)."""
    images = 0.15 * torch.rand(n, 3, IMAGE, IMAGE, generator=generator)
    captions = torch.empty(n, 5, dtype=torch.long)
    names = list(COLORS)
    for i in range(n):
        c = int(torch.randint(3, (1,), generator=generator))
        r, k = (int(x) for x in torch.randint(2, (2,), generator=generator))
        jitter = torch.randint(0, IMAGE // 2 - SQUARE + 1, (2,), generator=generator)
        y0, x0 = r * IMAGE // 2 + int(jitter[0]), k * IMAGE // 2 + int(jitter[1])
        images[i, :, y0:y0 + SQUARE, x0:x0 + SQUARE] = torch.tensor(COLORS[names[c]]).view(3, 1, 1)
        captions[i] = torch.tensor([TOK["<bos>"], TOK[names[c]], TOK[ROWS[r]], TOK[COLS[k]], TOK["<eos>"]])
    return images, captions


class Captioner(nn.Module):
    """ViT features ``[B, 1 + 16, 64]`` -> a 2-layer decoder with cross-attention to them."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.encoder = az.VisionTransformer(IMAGE, 8, 3, num_classes=0, dim=dim, depth=2, num_heads=4)
        cfg = az.models.DecoderConfig(len(VOCAB), dim, 2, 4, max_seq_len=8, pos="learned")
        # cross-attention is a property of the blocks: the decoder's own blocks, each attending to the image
        self.decoder = az.DecoderLM.with_blocks(cfg, lambda block, _: block.replace(cross_attention=True,
                                                                                    context_dim=dim))

    def forward(self, images: Tensor, captions: Tensor) -> Tensor:
        return self.decoder(captions, context=self.encoder.forward_features(images))  # [B, N, V]

    @torch.no_grad()
    def caption(self, images: Tensor) -> Tensor:
        feats = self.encoder.forward_features(images)
        start = torch.full((images.shape[0], 1), TOK["<bos>"], dtype=torch.long)
        return self.decoder.generate(start, 4, context=feats, eos_token_id=TOK["<eos>"])


def train(steps: int = 300, batch: int = 32, seed: int = 0, log_every: int = 50) -> tuple[Captioner, float]:
    """Train from scratch; return the model and its exact-caption accuracy on 200 new images."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = Captioner()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=max(steps, 1), pct_start=0.1)
    for step in range(1, steps + 1):
        images, captions = make_batch(batch, g)
        logits = model(images, captions[:, :-1])  # predict every next caption token
        loss = F.cross_entropy(logits.reshape(-1, len(VOCAB)), captions[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if log_every and (step % log_every == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item():.3f}")
    model.eval()
    images, captions = make_batch(200, torch.Generator().manual_seed(seed + 1))
    pred = model.caption(images)
    n = min(pred.shape[1], captions.shape[1])
    accuracy = (pred[:, :n] == captions[:, :n]).all(dim=1).float().mean().item()
    return model, accuracy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the models are tiny: 1 is fastest)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, accuracy = train(args.steps, seed=args.seed)
    print(f"trained {args.steps} steps in {time.perf_counter() - t0:.1f} s; exact captions on 200 new images: "
          f"{accuracy:.1%}")
    images, _ = make_batch(4, torch.Generator().manual_seed(123))
    for row in model.caption(images):
        print("  " + " ".join(VOCAB[int(t)] for t in row[1:] if VOCAB[int(t)] != "<eos>"))


if __name__ == "__main__":
    main()
