"""Models to look at: a Hugging Face model folder and a tokenizer that labels its tokens.

Arena checkpoints are read by :func:`attnzoo.arena.load_arena_model` (the arena knows how it
builds its models); ``attnzoo viz --model`` picks the right loader.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from attnzoo.interop import WordPieceTokenizer, load_pretrained

__all__ = ["Tokenize", "load_model"]

#: ``tokenize(text) -> (ids [1, N], token labels)``
Tokenize = Callable[[str], tuple[Tensor, list[str]]]


def load_model(path: str | Path) -> tuple[nn.Module, Tokenize]:
    """Load a Hugging Face model folder for ``attnzoo viz --model`` and a matching tokenizer.

    The folder (``config.json`` + weights) is read by :func:`attnzoo.interop.load_pretrained`;
    its ``vocab.txt`` (BERT WordPiece) or, when ``transformers`` is installed, its tokenizer files
    (never downloaded) label the tokens. An arena checkpoint (``.pt``) is read by
    :func:`attnzoo.arena.load_arena_model` instead.

    Returns:
        ``(model in eval mode, tokenize)`` where ``tokenize(text) -> (ids [1, N], labels)``.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    if not p.is_dir():
        raise ValueError(f"{p} is not a model folder (config.json + weights); an arena checkpoint (.pt) is "
                         f"read by attnzoo.arena.load_arena_model")
    model = load_pretrained(p).eval()
    if (p / "vocab.txt").exists():
        return model, _wordpiece_tokenize(p)
    return model, _hf_tokenize(p)


def _wordpiece_tokenize(p: Path) -> Tokenize:
    tok = WordPieceTokenizer.from_folder(p)
    inverse = {i: t for t, i in tok.vocab.items()}

    def tokenize(text: str) -> tuple[Tensor, list[str]]:
        ids = tok.encode(text)
        return torch.tensor([ids]), [inverse.get(i, str(i)) for i in ids]

    return tokenize


def _hf_tokenize(p: Path) -> Tokenize:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ValueError(f"{p} has no vocab.txt; reading its tokenizer needs transformers "
                         f"(pip install 'attnzoo[hf]')") from exc
    try:
        hf_tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError) as exc:  # no tokenizer files: transformers' message names none of ours
        raise ValueError(f"{p} has no tokenizer attnzoo can read (vocab.txt, or tokenizer.json / "
                         f"tokenizer_config.json for transformers): {str(exc).splitlines()[0]}") from exc

    def tokenize(text: str) -> tuple[Tensor, list[str]]:
        ids = hf_tok(text)["input_ids"]
        return torch.tensor([ids]), hf_tok.convert_ids_to_tokens(ids)

    return tokenize
