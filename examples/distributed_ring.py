"""Ring and Ulysses attention, and context-parallel DecoderLMs (attention and recurrent layers) on
several ranks (gloo on CPU, NCCL on GPUs).

    torchrun --standalone --nproc_per_node=2 examples/distributed_ring.py

Every rank builds the same full tensors only so that rank 0 can compare with one-process
attention at the end; in real use each rank would load just its shard.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

import attnzoo as az
from attnzoo.distributed import (
    context_parallel,
    gather_sequence,
    ring_attention,
    shard_positions,
    shard_sequence,
    ulysses_attention,
)
from attnzoo.variants import build_attention


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    # 1. Ring attention on a zigzag-sharded sequence (causal, GQA: 8 query heads, 2 KV heads).
    N = 1024
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, N, 64, generator=g).to(device)
    k = torch.randn(1, 2, N, 64, generator=g).to(device)
    v = torch.randn(1, 2, N, 64, generator=g).to(device)
    q_l, k_l, v_l = (shard_sequence(t, 2, layout="zigzag") for t in (q, k, v))  # [B, H, N / P, D]
    out = ring_attention(q_l, k_l, v_l, causal=True, layout="zigzag", timeout=60)  # [1, 8, N / P, 64]
    full = gather_sequence(out, 2, layout="zigzag")  # [1, 8, N, 64] on every rank
    err = (full - az.attention(q, k, v, causal=True)).abs().max().item()
    if rank == 0:
        print(f"ring attention on {world} ranks: local shard {tuple(out.shape)}, max |ring - attention| = {err:.2e}")

    # 1b. The same with Ulysses attention: all-to-all to head shards (8 / P query heads per rank).
    out_u = ulysses_attention(q_l, k_l, v_l, causal=True, layout="zigzag", timeout=60)
    err_u = (gather_sequence(out_u, 2, layout="zigzag") - az.attention(q, k, v, causal=True)).abs().max().item()
    if rank == 0:
        print(f"ulysses attention on {world} ranks: max |ulysses - attention| = {err_u:.2e}")

    # 2. A whole decoder LM with its attention layers on the ring.
    torch.manual_seed(0)  # same weights on every rank
    model = az.DecoderLM(vocab_size=64, dim=64, depth=2, num_heads=4, num_kv_heads=2).to(device)
    tokens = torch.randint(0, 64, (2, 257), generator=g).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # [2, 256]
    with torch.no_grad():  # one process, whole sequence, for comparison
        ref_loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    context_parallel(model, layout="zigzag")  # in place: same parameters, attention on the ring
    logits = model(shard_sequence(inputs, 1, layout="zigzag"),
                   positions=shard_positions(256, layout="zigzag", device=device))  # [2, 256 / P, 64]
    local_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                   shard_sequence(targets, 1, layout="zigzag").flatten())
    local_loss.backward()
    for p in model.parameters():  # every rank saw 1/P of the tokens: average like DDP does
        dist.all_reduce(p.grad)
        p.grad /= world
    loss = local_loss.detach()
    dist.all_reduce(loss)
    if rank == 0:
        print(f"context-parallel DecoderLM: loss {loss.item() / world:.6f}, one process: {ref_loss.item():.6f}")

    # 3. A hybrid LM: a Gated DeltaNet layer (state summaries scanned over the ranks) + attention.
    torch.manual_seed(1)
    hybrid = az.DecoderLM(vocab_size=64, dim=64, depth=2, num_heads=4, num_kv_heads=2).to(device)
    hybrid.blocks[0].attn = build_attention("gated_deltanet", 64, 4).to(device)
    with torch.no_grad():
        ref = hybrid(inputs)  # [2, 256, 64]
        context_parallel(hybrid, layout="zigzag", method="ulysses")
        local = hybrid(shard_sequence(inputs, 1, layout="zigzag"),
                       positions=shard_positions(256, layout="zigzag", device=device))
        err_h = (gather_sequence(local, 1, layout="zigzag") - ref).abs().max().item()
    if rank == 0:
        print(f"context-parallel hybrid (gated_deltanet + mha, ulysses): max |logits - one process| = {err_h:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
