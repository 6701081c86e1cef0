"""The errors of Hugging Face conversion and loading (all ``ValueError`` subclasses)."""

from __future__ import annotations

__all__ = ["CheckpointFormatError", "UnsupportedConfigError", "WeightLoadError"]


class WeightLoadError(ValueError):
    """A checkpoint's state dict does not match the model built from its config (missing,
    unexpected or mis-shaped keys, listed all at once)."""


class UnsupportedConfigError(ValueError):
    """A configuration option that attnzoo has no equivalent for (e.g. ``rope_type='dynamic'``)."""


class CheckpointFormatError(ValueError):
    """A file of a checkpoint is malformed: a safetensors header or data layout, ``config.json``
    (invalid JSON, not an object, a missing or mistyped key), a shard index. The message names
    the file and the problem."""
