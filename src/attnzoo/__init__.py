"""attnzoo: attention mechanisms and the transformer parts built on them.

Everything public is importable from the top level (``import attnzoo as az``). Names resolve
lazily, so ``import attnzoo`` costs one ``import torch`` and optional extras (plots, Hugging Face
interop, the CLI) are imported only when used. Semantics: ``docs/conventions.md``.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from attnzoo._interrupt import interrupted_exit_code


def _command_name() -> str | None:
    """The name this process's Ctrl-C line starts with when it is the ``attnzoo`` command, else ``None``:
    ``python -m attnzoo`` / ``-m attnzoo.arena`` (``sys.argv[0]`` is ``"-m"`` while the module is
    located) or the ``attnzoo`` console script (the main module's file name)."""
    argv = getattr(sys, "orig_argv", [])
    if sys.argv[:1] == ["-m"] and "-m" in argv[1:]:
        i = argv.index("-m", 1)
        target = argv[i + 1] if i + 1 < len(argv) else ""
        return {"attnzoo": "attnzoo", "attnzoo.arena": "arena"}.get(target)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    return "attnzoo" if os.path.splitext(os.path.basename(main_file))[0] in ("attnzoo", "attnzoo-script") else None


try:  # the one ``import torch`` (about a second): Ctrl-C here, when it is the command, is one line
    from attnzoo import masks
except KeyboardInterrupt:
    _name = _command_name()
    if _name is None:
        raise
    print(f"{_name}: interrupted; nothing written", file=sys.stderr)
    raise SystemExit(interrupted_exit_code()) from None

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # functional core
    "attention": "attnzoo.functional.softmax.attention",
    "merge_attention": "attnzoo.functional.softmax.attention",
    "attention_varlen": "attnzoo.functional.softmax.varlen",
    "sigmoid_attention": "attnzoo.functional.softmax.sigmoid",
    "available_backends": "attnzoo.functional.softmax.attention",
    "linear_attention": "attnzoo.functional.feature_maps.linear",
    "performer_attention": "attnzoo.functional.feature_maps.performer",
    "draw_performer_projection": "attnzoo.functional.feature_maps.performer",
    "retention": "attnzoo.functional.recurrent.retention",
    "gated_linear_attention": "attnzoo.functional.recurrent.gla",
    "delta_rule": "attnzoo.functional.recurrent.delta_rule",
    "selective_scan": "attnzoo.functional.recurrent.selective_scan",
    # modules
    "MultiHeadAttention": "attnzoo.nn.attention",
    "MultiQueryAttention": "attnzoo.nn.attention",
    "GroupedQueryAttention": "attnzoo.nn.attention",
    "SlidingWindowAttention": "attnzoo.nn.attention",
    "StreamingAttention": "attnzoo.nn.attention",
    "SigmoidAttention": "attnzoo.nn.attention",
    "AttentionParts": "attnzoo.nn.parts",
    "Scores": "attnzoo.nn.parts",
    "QKNorm": "attnzoo.nn.parts",
    "OutputGate": "attnzoo.nn.parts",
    "MixtureOfExperts": "attnzoo.nn.moe",
    "LocalGlobalAttention": "attnzoo.nn.local_global",
    "DifferentialAttention": "attnzoo.nn.differential",
    "LinearAttention": "attnzoo.nn.feature_attention",
    "PerformerAttention": "attnzoo.nn.feature_attention",
    "InfiniAttention": "attnzoo.nn.infini",
    "MultiScaleRetention": "attnzoo.nn.retnet",
    "GatedLinearAttention": "attnzoo.nn.gla",
    "DeltaNet": "attnzoo.nn.deltanet",
    "GatedDeltaNet": "attnzoo.nn.deltanet",
    "KimiDeltaAttention": "attnzoo.nn.kda",
    "GatedDeltaProduct": "attnzoo.nn.deltaproduct",
    "Mamba2": "attnzoo.nn.mamba2",
    "ParallelMixers": "attnzoo.nn.parallel",
    "RecurrentCache": "attnzoo.nn.recurrent",
    "MultiHeadLatentAttention": "attnzoo.nn.mla",
    "NativeSparseAttention": "attnzoo.nn.nsa",
    "SinusoidalPositionalEncoding": "attnzoo.nn.positional",
    "LearnedPositionalEmbedding": "attnzoo.nn.positional",
    "RotaryEmbedding": "attnzoo.nn.positional",
    "alibi_slopes": "attnzoo.nn.positional",
    "KVCache": "attnzoo.nn.cache",
    "SlidingWindowKVCache": "attnzoo.nn.cache",
    "SinkWindowKVCache": "attnzoo.nn.cache",
    # blocks and models
    "FeedForward": "attnzoo.blocks",
    "RMSNorm": "attnzoo.blocks",
    "TransformerBlock": "attnzoo.blocks",
    "TransformerEncoder": "attnzoo.models",
    "DecoderLM": "attnzoo.models",
    "EncoderDecoder": "attnzoo.models",
    "Transformer": "attnzoo.models",
    "VisionTransformer": "attnzoo.models",
}
_SUBMODULES = {"functional", "nn", "models", "interop", "viz", "cost", "variants", "distributed", "bench", "arena", "hf"}

__all__ = ["masks", *sorted(_EXPORTS), *sorted(_SUBMODULES)]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        module = importlib.import_module(f"attnzoo.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'attnzoo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover - static re-exports for type checkers
    from attnzoo.functional.softmax.attention import (  # noqa: F401
        attention,
        available_backends,
        merge_attention,
    )
