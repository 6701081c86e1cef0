"""BERT's WordPiece tokenizer, read from a model folder's ``vocab.txt`` (no ``transformers``).

Uncased/cased basic tokenisation and greedy longest-match WordPiece, as ``BertTokenizer``.
"""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from attnzoo.models.hf.safetensors import read_json

__all__ = ["WordPieceTokenizer"]

def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


class WordPieceTokenizer:
    """BERT's tokenizer: basic tokenisation then greedy longest-match-first WordPiece.

    Basic tokenisation: drop control characters, map whitespace to spaces, surround CJK
    characters with spaces, lower-case and strip accents (when ``lowercase``), split on
    whitespace and punctuation. WordPiece: each word becomes the longest vocabulary prefix, then
    ``##``-prefixed continuations; a word with no split (or longer than ``max_chars_per_word``) is
    ``[UNK]``. Sequences are ``[CLS] ... [SEP]``, truncated to ``max_length``.

    Args:
        vocab: path to ``vocab.txt`` (one token per line, id = line number) or a token list.
        lowercase: lower-case and strip accents (uncased models).
    """

    def __init__(self, vocab: str | os.PathLike[str] | Sequence[str], *, lowercase: bool = True,
                 unk_token: str = "[UNK]", cls_token: str = "[CLS]", sep_token: str = "[SEP]",
                 pad_token: str = "[PAD]", max_chars_per_word: int = 100) -> None:
        if isinstance(vocab, (str, os.PathLike)):
            tokens = Path(vocab).read_text(encoding="utf-8").split("\n")
            if tokens and tokens[-1] == "":
                tokens = tokens[:-1]
        elif isinstance(vocab, Sequence) and all(isinstance(t, str) for t in vocab):
            tokens = list(vocab)
        else:
            got = f"a {type(vocab).__name__} with non-str items" if isinstance(vocab, Sequence) else type(vocab).__name__
            raise TypeError(f"WordPieceTokenizer: vocab must be a path or a list of str tokens, got {got}")
        self.vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            self.vocab.setdefault(tok.rstrip("\r"), i)
        for name, tok in (("unk_token", unk_token), ("cls_token", cls_token), ("sep_token", sep_token),
                          ("pad_token", pad_token)):
            if tok not in self.vocab:
                raise ValueError(f"WordPieceTokenizer: {name} {tok!r} is not in the vocabulary")
        self.lowercase = lowercase
        self.unk_id, self.cls_id = self.vocab[unk_token], self.vocab[cls_token]
        self.sep_id, self.pad_id = self.vocab[sep_token], self.vocab[pad_token]
        self.unk_token = unk_token
        self.max_chars_per_word = max_chars_per_word
        self.specials = {unk_token, cls_token, sep_token, pad_token, "[MASK]"}

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> WordPieceTokenizer:
        """From a model folder's ``vocab.txt`` (``do_lower_case`` from ``tokenizer_config.json``)."""
        d = Path(folder)
        lowercase = True
        tc = d / "tokenizer_config.json"
        if tc.is_file():
            data = read_json(tc, "the tokenizer config")
            lowercase = bool(data.get("do_lower_case", True)) if isinstance(data, dict) else True
        return cls(d / "vocab.txt", lowercase=lowercase)

    def _basic(self, text: str) -> list[str]:
        chars = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD:
                continue
            cat = unicodedata.category(ch)
            if ch in "\t\n\r" or cat == "Zs":
                chars.append(" ")
            elif cat in ("Cc", "Cf"):
                continue
            elif _is_cjk(cp):
                chars.append(f" {ch} ")
            else:
                chars.append(ch)
        words: list[str] = []
        for word in "".join(chars).split():
            if word in self.specials:
                words.append(word)
                continue
            if self.lowercase:
                word = "".join(c for c in unicodedata.normalize("NFD", word.lower())
                               if unicodedata.category(c) != "Mn")
            current = ""
            for c in word:
                if _is_punctuation(c):
                    if current:
                        words.append(current)
                        current = ""
                    words.append(c)
                else:
                    current += c
            if current:
                words.append(current)
        return words

    def _wordpiece(self, word: str) -> list[str]:
        if word in self.specials:
            return [word]
        if len(word) > self.max_chars_per_word:
            return [self.unk_token]
        pieces: list[str] = []
        start = 0
        while start < len(word):
            end = len(word)
            piece = None
            while start < end:
                cand = word[start:end] if start == 0 else "##" + word[start:end]
                if cand in self.vocab:
                    piece = cand
                    break
                end -= 1
            if piece is None:
                return [self.unk_token]
            pieces.append(piece)
            start = end
        return pieces

    def tokenize(self, text: str) -> list[str]:
        """``text`` -> WordPiece tokens (without ``[CLS]``/``[SEP]``)."""
        if not isinstance(text, str):
            raise TypeError(f"WordPieceTokenizer: text must be a str, got {type(text).__name__}")
        return [p for w in self._basic(text) for p in self._wordpiece(w)]

    def encode(self, text: str, max_length: int | None = 512) -> list[int]:
        """``[CLS] tokens [SEP]`` ids, truncated so the whole fits ``max_length``."""
        ids = [self.vocab[t] for t in self.tokenize(text)]
        if max_length is not None:
            if max_length < 2:
                raise ValueError(f"WordPieceTokenizer: max_length must be >= 2, got {max_length}")
            ids = ids[: max_length - 2]
        return [self.cls_id, *ids, self.sep_id]

    def __call__(self, texts: str | Sequence[str], max_length: int | None = 512) -> dict[str, Tensor]:
        """Batch-encode with right padding: ``{"input_ids": [B, N] long, "attention_mask": [B, N]
        bool}`` (True for real tokens)."""
        batch = [texts] if isinstance(texts, str) else list(texts)
        if not batch:
            raise ValueError("WordPieceTokenizer: need at least one text")
        seqs = [self.encode(t, max_length) for t in batch]
        n = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), n, dtype=torch.bool)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = True
        return {"input_ids": ids, "attention_mask": mask}
