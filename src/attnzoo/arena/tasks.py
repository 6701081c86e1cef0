"""The arena's tasks: character-level Shakespeare (``lm``) and multi-query associative recall (``mqar``).

A task is a deterministic source of batches plus an evaluation. Every batch is a pure function of
``(seed, step)``, so a run resumed from a checkpoint sees exactly the batches it would have seen,
and every rank of a data-parallel run can build the same global batch and take its own slice.

Batches are ``(inputs [B, N] long, targets [B, N] long)``; a target of :data:`IGNORE` (-100) is not
scored (``torch.nn.functional.cross_entropy(..., ignore_index=-100)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Protocol

import torch
from torch import Tensor, nn

from attnzoo._validate import check_int as _check_int

__all__ = [
    "IGNORE",
    "MQARTask",
    "ShakespeareTask",
    "Task",
    "batch_generator",
    "load_shakespeare",
]

IGNORE = -100

# Stream ids keep the training, evaluation and sampling random streams apart for one seed.
_TRAIN_STREAM = 1
_EVAL_STREAM = 2


def batch_generator(seed: int, stream: int, step: int) -> torch.Generator:
    """A CPU generator whose state depends only on ``(seed, stream, step)``."""
    mixed = (seed * 1_000_003 + stream * 998_244_353 + step * 2_654_435_761) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


class Task(Protocol):
    """What the trainer needs from a task."""

    name: str
    vocab_size: int
    seq_len: int

    def batch(self, step: int, batch_size: int, seed: int) -> tuple[Tensor, Tensor]:
        """Training batch number ``step``: ``inputs [B, N]``, ``targets [B, N]`` (long, CPU)."""
        ...

    def evaluate(self, model: nn.Module, device: torch.device, seed: int) -> dict[str, float]:
        """Held-out metrics of ``model`` (at least ``"val_loss"``)."""
        ...


# --------------------------------------------------------------------------- Shakespeare
@lru_cache(maxsize=1)
def load_shakespeare() -> dict[str, str]:
    """The seven plays shipped with the package, ``{name: text}`` in a fixed (sorted) order."""
    root = resources.files("attnzoo").joinpath("data", "shakespeare")
    plays = {}
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".txt"):
            plays[entry.name[:-4]] = entry.read_text(encoding="utf-8")
    if not plays:  # pragma: no cover - a broken installation
        raise FileNotFoundError(f"no Shakespeare plays found under {root}; reinstall attnzoo")
    return plays


@dataclass
class ShakespeareTask:
    """Character-level language modelling on seven Shakespeare plays (about 940k characters).

    Split: the last ``val_fraction`` of every play is validation, the rest is training, so both
    halves see every play's characters and style but never the same lines. The vocabulary is
    every character of the corpus (76 symbols). Validation loss is the mean cross entropy in nats
    per character over ``eval_windows`` windows of ``seq_len`` characters spread evenly over the
    validation text (bits per character = nats / ln 2).
    """

    seq_len: int = 128
    val_fraction: float = 0.1
    eval_windows: int = 64
    eval_batch: int = 32
    name: str = "lm"
    chars: list[str] = field(init=False, repr=False)
    train_ids: Tensor = field(init=False, repr=False)
    val_ids: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_int(self.seq_len, "seq_len", minimum=2)
        _check_int(self.eval_windows, "eval_windows")
        _check_int(self.eval_batch, "eval_batch")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5), got {self.val_fraction}")
        plays = load_shakespeare()
        self.chars = sorted(set("".join(plays.values())))
        lookup = {c: i for i, c in enumerate(self.chars)}
        train, val = [], []
        for text in plays.values():
            cut = int(len(text) * (1.0 - self.val_fraction))
            train.append(text[:cut])
            val.append(text[cut:])
        self.train_ids = torch.tensor([lookup[c] for c in "".join(train)], dtype=torch.long)
        self.val_ids = torch.tensor([lookup[c] for c in "".join(val)], dtype=torch.long)
        if self.val_ids.numel() < self.seq_len + 2:
            raise ValueError(f"seq_len={self.seq_len} is longer than the validation text "
                             f"({self.val_ids.numel()} characters)")

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        """``text`` -> ``[len(text)]`` long; characters outside the corpus raise ``ValueError``."""
        lookup = {c: i for i, c in enumerate(self.chars)}
        missing = sorted(set(text) - set(lookup))
        if missing:
            raise ValueError(f"text contains characters outside the Shakespeare vocabulary: {missing}")
        return torch.tensor([lookup[c] for c in text], dtype=torch.long)

    def decode(self, ids: Tensor) -> str:
        """``[N]`` token ids -> text."""
        return "".join(self.chars[i] for i in ids.tolist())

    def batch(self, step: int, batch_size: int, seed: int) -> tuple[Tensor, Tensor]:
        """Random windows of the training text: ``inputs [B, N]`` and next characters ``targets [B, N]``."""
        g = batch_generator(seed, _TRAIN_STREAM, step)
        starts = torch.randint(0, self.train_ids.numel() - self.seq_len - 1, (batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)  # [B, N + 1]
        window = self.train_ids[idx]
        return window[:, :-1], window[:, 1:]

    def unigram_loss(self) -> float:
        """Validation loss (nats/char) of the unigram baseline: training-text character frequencies
        (add-one smoothed), no context at all."""
        counts = torch.bincount(self.train_ids, minlength=self.vocab_size).double() + 1.0
        logp = (counts / counts.sum()).log()
        return float(-logp[self.val_ids].mean())

    def val_batches(self) -> list[tuple[Tensor, Tensor]]:
        """The fixed validation windows, in batches of ``eval_batch``."""
        span = self.seq_len + 1
        count = min(self.eval_windows, self.val_ids.numel() // span)
        starts = torch.linspace(0, self.val_ids.numel() - span, count).long()
        idx = starts[:, None] + torch.arange(span)  # [W, N + 1]
        window = self.val_ids[idx]
        return [(window[i:i + self.eval_batch, :-1], window[i:i + self.eval_batch, 1:])
                for i in range(0, count, self.eval_batch)]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device, seed: int = 0) -> dict[str, float]:
        """``val_loss`` (nats/char) and ``bits_per_char`` on the validation windows."""
        total, count = 0.0, 0
        for x, y in self.val_batches():
            logits = model(x.to(device))  # [B, N, V]
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten(), reduction="sum")
            total += float(loss)
            count += y.numel()
        val = total / count
        return {"val_loss": val, "bits_per_char": val / math.log(2)}


# --------------------------------------------------------------------------- MQAR
@dataclass
class MQARTask:
    """Multi-query associative recall (Arora et al. 2023, "Zoology", arXiv:2312.04927).

    Each sequence opens with ``num_kv_pairs`` key-value pairs ``k1 v1 k2 v2 ...`` (keys drawn
    without repetition from the lower half of the vocabulary, values from the upper half). Every
    key is then queried once, in a random order, at random positions of the rest of the sequence:
    the query key is followed by its value, and the model is scored only on predicting that value
    from the key. All other positions hold the filler token 0. Unlike Zoology's power-law query
    placement, queries are placed uniformly, so many sit far from their pair: a model must look
    back over the whole sequence, which is what separates exact attention from fixed-size states
    and windows.

    ``accuracy`` is the fraction of queried values predicted exactly (greedy argmax) on
    ``eval_examples`` held-out sequences; ``val_loss`` the cross entropy on the same answers.
    """

    seq_len: int = 128
    num_kv_pairs: int = 16
    vocab_size: int = 256
    eval_examples: int = 512
    eval_batch: int = 128
    name: str = "mqar"

    def __post_init__(self) -> None:
        _check_int(self.seq_len, "seq_len", minimum=4)
        _check_int(self.num_kv_pairs, "num_kv_pairs")
        _check_int(self.vocab_size, "vocab_size", minimum=4)
        _check_int(self.eval_examples, "eval_examples")
        _check_int(self.eval_batch, "eval_batch")
        if 4 * self.num_kv_pairs > self.seq_len:
            raise ValueError(f"mqar: seq_len={self.seq_len} cannot hold num_kv_pairs={self.num_kv_pairs} pairs "
                             f"and their queries; need seq_len >= 4 * num_kv_pairs = {4 * self.num_kv_pairs}")
        if self.num_kv_pairs > (self.vocab_size - 1) // 2:
            raise ValueError(f"mqar: vocab_size={self.vocab_size} has too few keys for num_kv_pairs="
                             f"{self.num_kv_pairs}; need vocab_size >= 2 * num_kv_pairs + 1 = "
                             f"{2 * self.num_kv_pairs + 1}")

    def sample(self, batch_size: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
        """``batch_size`` fresh sequences drawn with ``g``: ``inputs [B, N]``, ``targets [B, N]``."""
        B, K, N = batch_size, self.num_kv_pairs, self.seq_len
        half = (self.vocab_size - 1) // 2
        keys = torch.rand(B, half, generator=g).argsort(dim=1)[:, :K] + 1  # [B, K] distinct in 1..half
        values = torch.randint(half + 1, self.vocab_size, (B, K), generator=g)  # [B, K]
        seq = torch.zeros(B, N + 1, dtype=torch.long)
        seq[:, 0:2 * K:2] = keys
        seq[:, 1:2 * K:2] = values
        # K non-overlapping (key, value) slots among the (N + 1 - 2K) // 2 slots after the context.
        slots = (N + 1 - 2 * K) // 2
        slot = torch.rand(B, slots, generator=g).argsort(dim=1)[:, :K]  # [B, K]
        pos = 2 * K + 2 * slot  # position of each query key
        order = torch.rand(B, K, generator=g).argsort(dim=1)  # which pair each query asks for
        seq.scatter_(1, pos, keys.gather(1, order))
        seq.scatter_(1, pos + 1, values.gather(1, order))
        inputs = seq[:, :-1]
        targets = torch.full((B, N), IGNORE, dtype=torch.long)
        targets.scatter_(1, pos, values.gather(1, order))  # predict the value from its key
        return inputs, targets

    def batch(self, step: int, batch_size: int, seed: int) -> tuple[Tensor, Tensor]:
        """Training batch ``step``: a fresh sample (the model never sees the same sequence twice)."""
        return self.sample(batch_size, batch_generator(seed, _TRAIN_STREAM, step))

    def eval_set(self, seed: int) -> tuple[Tensor, Tensor]:
        """The held-out sequences for ``seed`` (a stream disjoint from training)."""
        return self.sample(self.eval_examples, batch_generator(seed, _EVAL_STREAM, 0))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device, seed: int = 0) -> dict[str, float]:
        """``accuracy`` on the queried values and ``val_loss`` (nats) on the same positions."""
        x_all, y_all = self.eval_set(seed)
        correct, total, loss_sum = 0, 0, 0.0
        for i in range(0, x_all.shape[0], self.eval_batch):
            x = x_all[i:i + self.eval_batch].to(device)
            y = y_all[i:i + self.eval_batch].to(device)
            logits = model(x).float()  # [B, N, V]
            scored = y != IGNORE
            correct += int((logits.argmax(-1)[scored] == y[scored]).sum())
            total += int(scored.sum())
            loss_sum += float(nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(),
                                                          ignore_index=IGNORE, reduction="sum"))
        return {"accuracy": correct / total, "val_loss": loss_sum / total}
