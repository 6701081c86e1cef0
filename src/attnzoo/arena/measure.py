"""Measurements for the arena report: training memory, decode-state bytes and decode speed.

- Training memory: on CUDA, ``torch.cuda.max_memory_allocated`` over one training step. On the
  CPU torch keeps no allocator statistics, so the arena counts what a training step must hold at
  its peak: parameters + gradients + the two AdamW moments (16 bytes per float32 parameter) plus
  every distinct tensor the forward pass saves for the backward pass and the graph still holds at
  the loss (captured with ``torch.autograd.graph.saved_tensors_hooks``). This is exact for what it counts and
  deterministic, and it is where attention variants differ (an ``N x N`` score matrix vs a
  fixed-size state), but it leaves out short-lived temporaries.
- Decode state: the bytes of every tensor in the model's cache after it has consumed ``N``
  tokens, divided by ``N`` (a full KV cache grows by a constant per token; a sliding window or a
  recurrent state stops growing, so its per-token cost falls with ``N``).
- Decode speed: greedy ``generate`` with the cache, batch 1, median of a few repeats.
"""

from __future__ import annotations

import statistics
import time
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo.arena.tasks import IGNORE, Task
from attnzoo.distributed import shard_positions

__all__ = ["cache_bytes", "decode_speed", "state_bytes", "training_memory"]


def _storage_key(t: Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def training_memory(model: nn.Module, task: Task, batch_size: int, seed: int,
                    device: torch.device, sequence_layout: str | None = None) -> dict[str, float]:
    """Memory of one training step at ``batch_size`` (see the module docstring for the method).

    With ``sequence_layout`` (a context-parallel model under a process group) the step is this
    rank's: every row, this rank's shard of the positions, ring attention across the ranks.

    Returns ``{"peak_bytes", "activation_bytes", "state_bytes", "method"}`` (``method`` is
    ``"cuda allocator"`` or ``"saved tensors + 16 B/param"``; numbers as floats).
    """
    x, y = task.batch(0, batch_size, seed)
    x, y = x.to(device), y.to(device)
    kwargs: dict[str, Tensor] = {}
    if sequence_layout is not None:
        pos = shard_positions(x.shape[1], layout=sequence_layout, device=device)  # [n]
        x, y, kwargs = x[:, pos], y[:, pos], {"positions": pos}
    params = [p for p in model.parameters() if p.requires_grad]
    n_param_bytes = sum(p.numel() * p.element_size() for p in params)
    state = 4.0 * n_param_bytes  # weights, gradients, AdamW exp_avg and exp_avg_sq
    was_training = model.training
    model.train()
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            logits = model(x, **kwargs)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE)
            loss.backward()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - base
            model.zero_grad(set_to_none=True)
            return {"peak_bytes": float(peak + state), "activation_bytes": float(peak), "state_bytes": state,
                    "method": "cuda allocator"}  # type: ignore[dict-item]
        skip = {_storage_key(p) for p in model.parameters()}
        seen: dict[tuple[int, int], list[weakref.ref[Tensor]]] = {}

        def pack(t: Tensor) -> Tensor:
            saved = t.detach()  # what the node holds; t itself would tie an output to its own node (a leak)
            key = _storage_key(saved)
            if key not in skip:
                seen.setdefault(key, []).append(weakref.ref(saved))
            return saved

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(x, **kwargs)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE)
        # only what the graph still holds: a tensor saved by a branch whose result was dropped is freed,
        # and the allocator may hand its address to a later one (counting it would depend on that luck)
        act = float(sum(key[1] for key, refs in seen.items() if any(r() is not None for r in refs)))
        loss.backward()
        model.zero_grad(set_to_none=True)
        return {"peak_bytes": act + state, "activation_bytes": act, "state_bytes": state,
                "method": "saved tensors + 16 B/param"}  # type: ignore[dict-item]
    finally:
        model.train(was_training)


def _tensors(obj: Any, out: dict[tuple[int, int], int], depth: int = 0) -> None:
    if depth > 6:
        return
    if isinstance(obj, Tensor):
        key = _storage_key(obj)
        out[key] = key[1]
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out, depth + 1)
    elif isinstance(obj, nn.Module):
        return  # a cache that points back to a module does not own its weights
    elif hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            _tensors(v, out, depth + 1)
    elif hasattr(obj, "__slots__"):
        for name in obj.__slots__:
            if hasattr(obj, name):
                _tensors(getattr(obj, name), out, depth + 1)


@torch.no_grad()
def state_bytes(model: nn.Module, tokens: Tensor) -> int:
    """Bytes held by the decode cache of ``model`` after prefilling ``tokens [1, N]``.

    Counts every distinct tensor storage reachable from the cache object. A preallocated cache
    is counted at the size it was allocated for, ``N`` tokens.
    """
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise ValueError(f"state_bytes: tokens must be [1, N], got {tuple(tokens.shape)}")
    cache = model.init_cache(1, tokens.shape[1])  # type: ignore[operator]
    model(tokens, cache=cache)
    return cache_bytes(cache)


def cache_bytes(cache: Any) -> int:
    """Bytes of every distinct tensor storage reachable from a decode cache object."""
    found: dict[tuple[int, int], int] = {}
    _tensors(cache, found)
    return sum(found.values())


@torch.no_grad()
def decode_speed(model: nn.Module, prompt: Tensor, new_tokens: int, repeats: int = 3) -> tuple[float, Tensor]:
    """Greedy decoding speed (new tokens per second, median of ``repeats``) and the generated tokens.

    ``prompt`` is ``[1, P]``; the model's ``generate`` prefills it once and then decodes one token
    a step with its cache. The time includes the prefill.
    """
    times = []
    out = prompt
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = model.generate(prompt, new_tokens, temperature=0.0)  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return new_tokens / statistics.median(times), out
