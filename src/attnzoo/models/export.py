"""A cached decoding step as a function of tensors, for ``torch.export``.

``torch.export`` takes tensors (and pytrees of them), not the Python cache objects that
:meth:`DecoderLM.init_cache` builds (they keep their length as a Python int and write their
buffers in place). :class:`CachedStep` wraps a model so that one decoding step takes the cache's
key/value buffers as inputs and returns the updated buffers as outputs::

    cache = lm.init_cache(1, max_len=64)
    lm(prompt, cache=cache)                             # eager prefill: cache.length == prompt length
    keys, values = cache_tensors(cache)
    step = CachedStep(lm, past_len=cache.length)
    ep = torch.export.export(step, (next_tok, keys, values))
    logits, keys, values = ep.module()(next_tok, keys, values)

The number of cached tokens is fixed when exporting (``past_len``: it sets the positions and the
attention's key range); export one step per position needed, or export the full forward without a
cache (``torch.export.export(lm, (tokens,))``) for prefill/scoring. Softmax layers with a
:class:`~attnzoo.KVCache` (``mha``, ``mqa``, ``gqa``) are supported.
"""

from __future__ import annotations

from torch import Tensor, nn

from attnzoo._validate import check_int
from attnzoo.models._common import LayerCaches
from attnzoo.models.decoder import DecoderLM
from attnzoo.nn.cache import KVCache

__all__ = ["CachedStep", "cache_tensors"]


def cache_tensors(cache: LayerCaches) -> tuple[list[Tensor], list[Tensor]]:
    """The key and value buffers ``[B, Hkv, max_len, D]`` of every layer of a decode cache."""
    if not isinstance(cache, LayerCaches) or not all(type(c) is KVCache for c in cache):
        raise TypeError(f"cache_tensors: expected the LayerCaches of a DecoderLM whose layers use KVCache "
                        f"(mha/mqa/gqa attention), got {cache!r}")
    return [c.k for c in cache], [c.v for c in cache]


class CachedStep(nn.Module):
    """One decoding step of ``model`` after ``past_len`` cached tokens, as a pure tensor function.

    ``forward(tokens [B, n], keys, values) -> (logits [B, n, V], new_keys, new_values)`` where
    ``keys``/``values`` are per-layer lists of ``[B, Hkv, max_len, D]`` buffers (from
    :func:`cache_tensors`); the inputs are not modified.
    """

    def __init__(self, model: DecoderLM, past_len: int) -> None:
        super().__init__()
        if not isinstance(model, DecoderLM):
            raise TypeError(f"CachedStep: model must be a DecoderLM, got {type(model).__name__}")
        check_int(past_len, "past_len", "CachedStep", minimum=0)
        self.model = model
        self.past_len = past_len

    def forward(self, tokens: Tensor, keys: list[Tensor], values: list[Tensor],
                ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        if len(keys) != self.model.depth or len(values) != self.model.depth:
            raise ValueError(f"CachedStep: expected {self.model.depth} key and value buffers (one per layer), "
                             f"got {len(keys)} and {len(values)}")
        layers = []
        for k, v in zip(keys, values, strict=True):
            c = KVCache(k.shape[0], k.shape[2], k.shape[1], k.shape[3], v_head_dim=v.shape[3], device=k.device,
                        dtype=k.dtype)
            c.k, c.v, c.length = k.clone(), v.clone(), self.past_len
            layers.append(c)
        cache = LayerCaches(layers)
        logits = self.model(tokens, cache=cache)
        return logits, [c.k for c in layers], [c.v for c in layers]
