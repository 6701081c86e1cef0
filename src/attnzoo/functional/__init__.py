"""The math: parameter-free attention functions. No ``nn.Parameter``, no global state, no printing."""

from attnzoo.functional.attention import (
    BACKENDS,
    attention,
    available_backends,
    choose_backend,
    merge_attention,
)

__all__ = ["BACKENDS", "attention", "available_backends", "choose_backend", "merge_attention"]
