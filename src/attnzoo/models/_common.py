"""Shared pieces of the models: input validation, positions from padding masks, layer caches."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from attnzoo._devices import tracing
from attnzoo.blocks import RMSNorm, state_without_unpicklable_config
from attnzoo.nn.cache import CacheList
from attnzoo.nn.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
)
from attnzoo.variants import VARIANTS

POSITIONS = ("rope", "learned", "sinusoidal", "none")


def takes_rope(attention: object) -> bool:
    """Registry variants whose modules apply RoPE: their spec declares ``positions="rope"``
    (see :attr:`attnzoo.nn.spec.VariantSpec.positions`)."""
    spec = VARIANTS.get(attention) if isinstance(attention, str) else None
    return spec is not None and spec.takes_rope()


def position_table(pos: str, dim: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> nn.Module | None:
    """The absolute position module of ``pos``: learned, sinusoidal, or ``None`` (rope/none)."""
    if pos == "learned":
        return LearnedPositionalEmbedding(dim, max_len, device=device, dtype=dtype)
    if pos == "sinusoidal":
        return SinusoidalPositionalEncoding(dim, max_len, device=device, dtype=dtype)
    return None


def rotary_for(pos: str, attention: object, attention_kwargs: Any, head_dim: int, base: float,
               scaling: str | None = None, scaling_factor: float = 1.0) -> RotaryEmbedding | None:
    """The RotaryEmbedding a model shares across its layers: ``None`` unless ``pos="rope"`` and
    the attention applies RoPE; a configured one passed as ``attention_kwargs["rope"]`` is used
    as is; ``"rope"`` set to anything else in ``attention_kwargs`` is left to the module."""
    if pos != "rope" or not takes_rope(attention):
        return None
    given = (attention_kwargs or {}).get("rope")
    if isinstance(given, RotaryEmbedding):
        return given
    if attention_kwargs and "rope" in attention_kwargs:
        return None
    return RotaryEmbedding(head_dim, base=base, scaling=scaling, scaling_factor=scaling_factor)


def check_tokens(tokens: object, vocab_size: int, owner: str, name: str = "tokens") -> Tensor:
    """``tokens`` must be an integer tensor ``[B, N]`` with ids in ``[0, vocab_size)``."""
    if not isinstance(tokens, Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor [B, N] of token ids, got {type(tokens).__name__}")
    if tokens.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"{owner}: {name} must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.dim() != 2 or tokens.shape[1] == 0:
        raise ValueError(f"{owner}: {name} must have shape [B, N] with N >= 1, got {tuple(tokens.shape)}")
    if tokens.numel() and not tracing():  # a value check syncs: eager only
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{owner}: {name} ids must be in [0, {vocab_size}), got values in [{lo}, {hi}]")
    return tokens


def check_padding_mask(mask: object, batch: int, length: int, owner: str, name: str = "attention_mask") -> Tensor:
    """A key-padding mask ``[B, L]`` (bool, or 0/1 ints), True/1 for real tokens; returned as bool."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"{owner}: {name} must be a bool tensor [B, N] (True = real token), got {type(mask).__name__}")
    if mask.is_floating_point():
        raise TypeError(f"{owner}: {name} must be bool (True = real token) or 0/1 ints, got dtype {mask.dtype}")
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"{owner}: {name} must have shape [B, L] = [{batch}, {length}], got {tuple(mask.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def check_left_padding(attention_mask: object, prompt: Tensor, new: int, owner: str) -> Tensor:
    """A prompt's ``attention_mask [B, N]`` (left padding: in every row the real tokens are a
    non-empty suffix) extended by ``new`` real slots: bool ``[B, N + new]``."""
    batch, n = prompt.shape
    am = check_padding_mask(attention_mask, batch, n, owner)
    if not bool(am.any(dim=1).all()):
        raise ValueError(f"{owner}: every prompt row needs at least one real token in attention_mask")
    gaps = am[:, :-1] & ~am[:, 1:]  # [B, N-1]: a real token followed by padding
    if bool(gaps.any()):
        row, col = (int(i) for i in gaps.nonzero()[0])
        raise ValueError(f"{owner}: attention_mask must be left padding (generation appends after the last "
                         f"token, so each row's real tokens must be a suffix: once True, True to the end); row "
                         f"{row} has a real token at {col} followed by padding at {col + 1}: "
                         f"{am[row].int().tolist()}")
    full = torch.ones(batch, n + new, dtype=torch.bool, device=prompt.device)
    full[:, :n] = am
    return full


def positions_from_mask(mask: Tensor) -> Tensor:
    """Absolute positions ``[B, L]`` of the real tokens of a (left- or right-) padded batch:
    the first real token of each row is position 0; padded slots get 0 (they are masked)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def key_padding_bias(mask: Tensor) -> Tensor:
    """``[B, Nk]`` bool (True = real) -> ``[B, 1, 1, Nk]`` bool attention mask."""
    return mask[:, None, None, :]


class FromConfig:
    """``from_config`` for a model whose constructor takes ``config=`` (set ``config_class``)."""

    config_class: ClassVar[type]

    @classmethod
    def from_config(cls, config: Any, *, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> Any:
        """The model ``config`` describes (e.g. a preset), parameters on ``device`` in ``dtype``."""
        if not isinstance(config, cls.config_class):
            raise TypeError(f"{cls.__name__}.from_config: config must be a {cls.config_class.__name__}, "
                            f"got {type(config).__name__}")
        return cls(config=config, device=device, dtype=dtype)  # type: ignore[call-arg]

    def __getstate__(self) -> dict[str, Any]:
        return state_without_unpicklable_config(super().__getstate__())  # type: ignore[misc]

    def num_parameters(self) -> int:
        """Number of distinct parameters (a tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())  # type: ignore[attr-defined]


class LayerCaches(CacheList):
    """The decode caches of a stack of layers (one per layer), with the cache protocol:
    ``length`` (tokens written so far), ``batch_size``, ``reset()``, ``mark()``/``rollback()``/
    ``commit()`` over every layer (:class:`~attnzoo.nn.cache.CompositeCache`: a model call through
    it is all-or-nothing); index it for one layer's cache."""

    def __repr__(self) -> str:
        return f"LayerCaches(layers={len(self.layers)}, length={self.length}, batch_size={self.batch_size})"


def init_weights(model: nn.Module, *, std: float = 0.02, depth: int | None = None) -> None:
    """GPT-2 / BERT / ViT initialisation: ``nn.Linear`` and ``nn.Embedding`` weights (and conv
    patch embeddings) ~ ``N(0, std)``, biases 0, norm weights 1 and biases 0. With ``depth``, the
    projections that write into the residual stream (``out_proj``, ``down_proj``) get
    ``std / sqrt(2 * depth)`` so the residual variance does not grow with depth (GPT-2)."""
    resid_std = std / math.sqrt(2 * depth) if depth else std
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Conv2d)):
            last = name.rsplit(".", 1)[-1]
            nn.init.normal_(mod.weight, 0.0, resid_std if last in ("out_proj", "down_proj") else std)
            if mod.bias is not None:
                nn.init.zeros_(mod.bias)
        elif isinstance(mod, nn.Embedding):
            nn.init.normal_(mod.weight, 0.0, std)
        elif isinstance(mod, (nn.LayerNorm, RMSNorm)):
            if getattr(mod, "weight", None) is not None:
                nn.init.ones_(mod.weight)
            if getattr(mod, "bias", None) is not None:
                nn.init.zeros_(mod.bias)
