"""Paper presets of the arena: the MQAR sweeps behind Zoology's and Based's Figure 2.

``attnzoo arena --preset zoology-fig2`` and ``--preset based-fig2`` rerun, on a CPU, the
multi-query associative recall (MQAR) experiments of

- Arora, Eyuboglu et al. 2023, "Zoology: Measuring and Improving Recall in Efficient Language
  Models" (arXiv:2312.04927), Figure 2: accuracy against model width, one panel per sequence
  length, best of four learning rates per point;
- Arora, Eyuboglu et al. 2024, "Simple linear attention language models balance the
  recall-throughput tradeoff" (Based, arXiv:2402.18668), Figure 2: accuracy against recurrent
  state size.

Every number of :data:`PRESETS` is the paper's, read from the configurations the authors
published in ``HazyResearch/zoology`` (commit d88d6f5, ``zoology/experiments/paper_configs/
iclr24_zoology_figure2/configs.py`` and ``arxiv24_based_figure2/configs.py``; the data generator
``zoology/data/multiquery_ar.py``; the trainer ``zoology/train.py``; the model ``zoology/model.py``).
:data:`PUBLISHED` holds the papers' plotted points, read by eye off the figures the same
repository ships (``assets/figure2.png``, ``arxiv24_based_figure2/figure.png``; about ±0.03 in
accuracy, ±0.25 in log2 bytes).

The full sweeps are GPU-sized (Zoology's is 448 runs of up to 64 epochs over 100,000 sequences);
:func:`budget` derives the ``reduced`` default (fewer widths and lengths, fewer examples and
epochs, stated in the report) and a ``quick`` smoke test from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from attnzoo._validate import check_int as _check_int
from attnzoo.arena.tasks import IGNORE, batch_generator

__all__ = ["PRESETS", "PUBLISHED", "REDUCED_LRS", "MQARCell", "PaperMQAR", "Preset", "budget", "lr_grid", "paper_mqar"]

_SOURCE = "HazyResearch/zoology@d88d6f5"


def lr_grid(low_exp: float, high_exp: float, n: int) -> tuple[float, ...]:
    """``n`` learning rates evenly spaced in log10 from ``10**low_exp`` to ``10**high_exp`` (the
    papers' ``np.logspace(low_exp, high_exp, n)``)."""
    if n == 1:
        return (10.0 ** low_exp,)
    return tuple(10.0 ** (low_exp + (high_exp - low_exp) * i / (n - 1)) for i in range(n))


@dataclass(frozen=True)
class MQARCell:
    """One data segment: ``examples`` sequences of ``seq_len`` tokens with ``pairs`` key-value pairs."""

    seq_len: int
    pairs: int
    examples: int


@dataclass(frozen=True)
class Preset:
    """One paper's MQAR sweep (every field is the paper's unless :func:`budget` changed it).

    ``train`` lists the training segments (Zoology: one per panel; Based: one mixture for every
    model), ``test`` the evaluation segments; ``panels`` the sequence lengths drawn side by side
    (Zoology) or ``()`` (Based: one scatter over state size). ``variants`` maps the paper's mixer
    names to attnzoo registry names or ``/`` layer patterns. ``batch`` maps a training sequence
    length to the batch size.
    """

    name: str
    paper: str
    source: str
    vocab: int
    train: tuple[MQARCell, ...]
    test: tuple[MQARCell, ...]
    widths: tuple[int, ...]
    lrs: tuple[float, ...]
    max_epochs: int
    batch: tuple[tuple[int, int], ...]
    variants: tuple[str, ...]
    depth: int = 2
    heads: int = 1
    threshold: float = 0.99
    power_a: float = 0.01
    random_non_queries: bool = False
    weight_decay: float = 0.1
    mixture: bool = False  # Based: one model trains on every training segment at once
    evals_per_epoch: int = 1  # the papers evaluate (and may stop) after every epoch
    size: str = "full"
    notes: tuple[str, ...] = field(default=())

    def batch_for(self, seq_len: int) -> int:
        """The batch size the paper uses for training sequences of ``seq_len`` tokens."""
        table = dict(self.batch)
        return table.get(seq_len, table.get(0, 256))


# Zoology Fig. 2 (iclr24_zoology_figure2/configs.py): (seq_len, pairs) (64, 4), (128, 8), (256, 16) and
# (512, 64) (the last commented out at d88d6f5 but drawn in the figure); batch 512 below 256 tokens,
# 256 at 256, 128 at 512; 100,000 training and 3,000 test sequences per length; d_model 64..512; lr
# logspace(-4, -2, 4); 2 layers, no MLP (state_mixer Identity); attention 1 head; 64 epochs; early stop
# at valid accuracy > 0.99; AdamW weight decay 0.1, cosine over the epochs; vocabulary 8,192;
# power_a 0.01, random_non_queries False.
_ZOOLOGY_CELLS = ((64, 4), (128, 8), (256, 16), (512, 64))
ZOOLOGY = Preset(
    name="zoology-fig2", paper="Zoology (Arora et al. 2023, arXiv:2312.04927), Figure 2",
    source=f"{_SOURCE}: zoology/experiments/paper_configs/iclr24_zoology_figure2/configs.py",
    vocab=8192,
    train=tuple(MQARCell(n, k, 100_000) for n, k in _ZOOLOGY_CELLS),
    test=tuple(MQARCell(n, k, 3_000) for n, k in _ZOOLOGY_CELLS),
    widths=(64, 128, 256, 512), lrs=lr_grid(-4, -2, 4), max_epochs=64,
    batch=((64, 512), (128, 512), (256, 256), (512, 128)),
    variants=("mha", "gated_deltanet", "gla", "mamba2", "linear"),
)

# Based Fig. 2 (arxiv24_based_figure2/configs.py): training mixture (64, 4) x 100,000 + (128, 8),
# (256, 16), (256, 32), (256, 64) x 20,000; test (64, 4), (64, 8), (64, 16), (128, 32), (256, 64),
# (512, 128), (1024, 256) x 1,000; batch 256; lr logspace(-3, -1.5, 4); 32 epochs; 2 layers, no MLP.
# Models: attention d_model 64, 128; based d_model 48, 64, 128 x feature_dim 8, 16, 24; sliding window
# d_model 128 x window 8..1024; mamba d_model 64, 128, 256 x d_state 8, 16, 24; each (but mamba) after
# a short convolution (BaseConv, kernel 3) in the same layer.
BASED = Preset(
    name="based-fig2", paper="Based (Arora et al. 2024, arXiv:2402.18668), Figure 2",
    source=f"{_SOURCE}: zoology/experiments/paper_configs/arxiv24_based_figure2/configs.py",
    vocab=8192,
    train=(MQARCell(64, 4, 100_000), MQARCell(128, 8, 20_000), MQARCell(256, 16, 20_000),
           MQARCell(256, 32, 20_000), MQARCell(256, 64, 20_000)),
    test=(MQARCell(64, 4, 1_000), MQARCell(64, 8, 1_000), MQARCell(64, 16, 1_000), MQARCell(128, 32, 1_000),
          MQARCell(256, 64, 1_000), MQARCell(512, 128, 1_000), MQARCell(1024, 256, 1_000)),
    widths=(48, 64, 128), lrs=lr_grid(-3, -1.5, 4), max_epochs=32, batch=((0, 256),),
    variants=("mha", "linear", "sliding", "mamba2", "gated_deltanet"),
    random_non_queries=True, mixture=True,
)

PRESETS: dict[str, Preset] = {p.name: p for p in (ZOOLOGY, BASED)}

#: The papers' plotted points, read by eye off the figures in HazyResearch/zoology@d88d6f5
#: (``assets/figure2.png``: Zoology Fig. 2; ``zoology/experiments/paper_configs/arxiv24_based_figure2/
#: figure.png``: Based Fig. 2). Zoology: ``{mixer: {seq_len: [accuracy at d_model 64, 128, 256, 512]}}``.
#: Based: ``{mixer: [(log2 state bytes, accuracy), ...]}``.
PUBLISHED: dict[str, dict[str, Any]] = {
    "zoology-fig2": {
        "widths": (64, 128, 256, 512),
        "Attention": {64: (0.97, 0.97, 0.97, 0.97), 128: (0.97, 0.97, 0.97, 0.97), 256: (0.97, 0.97, 0.97, 0.97),
                      512: (0.97, 0.97, 0.97, 0.97)},
        "Hyena": {64: (0.51, 0.74, 0.83, 0.85), 128: (0.19, 0.63, 0.73, 0.83), 256: (0.05, 0.14, 0.53, 0.69),
                  512: (0.02, 0.04, 0.10, 0.18)},
        "RWKV": {64: (0.74, 0.92, 0.96, 0.96), 128: (0.18, 0.50, 0.75, 0.91), 256: (0.06, 0.07, 0.67, 0.78),
                 512: (0.02, 0.03, 0.16, 0.37)},
        "H3": {64: (0.91, 0.97, 0.97, 0.96), 128: (0.25, 0.72, 0.89, 0.75), 256: (0.08, 0.63, 0.61, 0.66),
               512: (0.02, 0.03, 0.03, 0.10)},
        "BaseConv": {64: (0.69, 0.92, 0.94, 0.97), 128: (0.37, 0.61, 0.83, 0.94), 256: (0.14, 0.34, 0.80, 0.92),
                     512: (0.03, 0.03, 0.03, 0.70)},
    },
    "based-fig2": {
        "Attention (full)": [(19.0, 1.0), (20.0, 1.0), (21.0, 1.0)],
        "Attention (sliding)": [(13.0, 0.07), (14.0, 0.14), (15.0, 0.31), (16.0, 0.51), (17.0, 0.65), (18.0, 0.80),
                                (19.0, 0.93), (20.0, 1.0)],
        "Based": [(12.6, 0.54), (13.6, 0.71), (14.6, 0.82), (15.2, 0.89), (15.4, 0.85), (16.3, 0.97), (16.5, 0.96),
                  (17.3, 0.99), (18.3, 0.99)],
        "Mamba": [(13.0, 0.57), (14.0, 0.61), (14.6, 0.58), (15.0, 0.77), (15.5, 0.82), (16.0, 0.80), (16.6, 0.82),
                  (17.0, 0.89), (17.6, 0.86), (18.0, 0.91), (18.6, 0.88), (19.0, 0.86)],
        "H3": [(13.0, 0.19), (15.0, 0.26), (17.0, 0.31), (19.0, 0.36)],
        "Hyena": [(19.0, 0.20), (20.0, 0.34), (21.0, 0.45), (22.0, 0.50)],
    },
}

#: Which published line each of our variants is set beside in the figure and the comparison.
PAPER_COUNTERPART = {"zoology-fig2": {"mha": "Attention"},
                     "based-fig2": {"mha": "Attention (full)", "sliding": "Attention (sliding)", "linear": "Based",
                                    "mamba2": "Mamba"}}

_DEVIATIONS = (
    "every model gets learned absolute positions (Zoology gives them to attention only; its other mixers, and "
    "Based's every layer, start with a short convolution that supplies the shift: attnzoo's gated_deltanet and "
    "mamba2 have their own (kernel 4), its mha, linear and sliding have none)",
    "no dropout (Zoology: 0.1 on the embeddings and the attention weights)",
    "learned positions are trained only up to the longest training sequence, so Based's longer test segments "
    "(512, 1024 tokens; --full only) test position extrapolation as well",
    "our mixers stand in for the papers' (attention = mha with one head; Based's Taylor feature map -> linear; "
    "Mamba -> mamba2); Hyena, RWKV, H3 and BaseConv have no attnzoo counterpart and are drawn from the paper only",
)


#: The learning rates of the reduced budgets (see :func:`budget`).
REDUCED_LRS = (1e-3, 1e-2)


def budget(preset: Preset, size: str) -> Preset:
    """``preset`` at a budget: ``"full"`` (the paper's numbers), ``"reduced"`` (the default on a
    CPU) or ``"quick"`` (a smoke test of about a minute). The report states which.

    ``reduced``: the two shortest Zoology lengths (64 tokens / 4 pairs, 128 / 8), or Based's
    64-token segment tested at 4 and 8 pairs; widths 64 and 128; learning rates 1e-3 and 1e-2
    (:data:`REDUCED_LRS`: inside both papers' ranges; 1e-3 is on Based's grid, not on Zoology's,
    whose neighbours left attention on its plateau: measured with mha at width 64 on 64 tokens, 2.15e-3
    stayed at 25% for 4,000 steps and 4.64e-4 for 3,500, while 1e-3 passed 90% at 3,500; the
    one-pass gated DeltaNet needs 1e-2); one pass over 192,000 training sequences at batch 64 (3,000
    steps; no sequence is seen twice, so the pool cannot be memorised: with 20,000 sequences and
    several epochs mha's training loss fell to 0.55 nats while its test accuracy stayed at 25%),
    evaluated (and early-stopped) every eighth of the pass; 1,000 test sequences; the first two
    variants. ``quick``: vocabulary 256, widths 16 and 32, 256 sequences, two epochs."""
    if size == "full":
        return preset
    if size not in ("reduced", "quick"):
        raise ValueError(f"budget: size must be 'full', 'reduced' or 'quick', got {size!r}")
    quick = size == "quick"
    examples, test, epochs = (256, 64, 2) if quick else (192_000, 1_000, 1)
    if preset.mixture:
        train = (MQARCell(64, 4, examples),)
        tests = (MQARCell(64, 4, test), MQARCell(64, 8, test))
    else:
        keep = preset.train[:1] if quick else preset.train[:2]
        train = tuple(replace(c, examples=examples) for c in keep)
        tests = tuple(MQARCell(c.seq_len, c.pairs, test) for c in keep)
    return replace(preset, train=train, test=tests, widths=(16, 32) if quick else (64, 128),
                   lrs=preset.lrs[-1:] if quick else REDUCED_LRS, max_epochs=epochs,
                   batch=tuple((n, 32 if quick else 64) for n, _ in preset.batch), vocab=256 if quick else preset.vocab,
                   variants=preset.variants[:2], size=size, evals_per_epoch=1 if quick else 8, notes=_DEVIATIONS)


def _power_law(space: int, power_a: float) -> Tensor:
    """Zoology's query-gap distribution ``p(g) ~ a * g**(a - 1)`` over ``g = 1 .. space``: ``[space]``."""
    g = torch.arange(1, space + 1, dtype=torch.float64)
    p = power_a * g ** (power_a - 1)
    return p / p.sum()


def paper_mqar(count: int, seq_len: int, pairs: int, vocab: int, g: torch.Generator, power_a: float = 0.01,
               random_non_queries: bool = False) -> tuple[Tensor, Tensor]:
    """MQAR sequences with the semantics of Zoology's generator (``multiquery_ar``).

    Each sequence opens with ``pairs`` pairs ``k v``: keys distinct, from ``1 .. vocab // 2 - 1``;
    values distinct, from ``vocab // 2 .. vocab - 1``. The rest holds ``(seq_len - 2 * pairs) // 2``
    two-token slots; every key is queried once, key ``i`` at the slot ``gap_i`` drawn without
    replacement with probability ``~ gap**(power_a - 1)`` (a power law: most queries come soon after
    the context), the key at the slot's first token. The target at a query key's position is its
    value; every other target is ignored (-100). Other positions hold 0, or with
    ``random_non_queries`` a uniform random token of the vocabulary.

    Returns: ``inputs [count, seq_len]`` and ``targets [count, seq_len]`` (long).
    """
    B, K, N, V = count, pairs, seq_len, vocab
    ctx = 2 * K
    if N % 2 or V <= N or 4 * K > N:
        raise ValueError(f"paper_mqar: need an even seq_len, vocab > seq_len and seq_len >= 4 * pairs; got seq_len "
                         f"{N}, vocab {V}, pairs {K}")
    half = V // 2
    # K distinct draws: the indices of the K largest of independent uniforms (a uniform K-subset, in random order)
    keys = torch.rand(B, half - 1, generator=g).topk(K, dim=1).indices + 1  # [B, K]
    values = torch.rand(B, V - half, generator=g).topk(K, dim=1).indices + half  # [B, K]
    space = (N - ctx) // 2
    gaps = torch.multinomial(_power_law(space, power_a).float().expand(B, space), K, replacement=False,
                             generator=g)  # [B, K]: slot of each key's query
    inputs = torch.zeros(B, N, dtype=torch.long)
    inputs[:, 0:ctx:2] = keys
    inputs[:, 1:ctx:2] = values
    where = ctx + 2 * gaps  # [B, K] positions of the query keys
    inputs.scatter_(1, where, keys)
    targets = torch.full((B, N), IGNORE, dtype=torch.long)
    targets.scatter_(1, where, values)
    if random_non_queries:
        noise = torch.randint(0, V, (B, N), generator=g)
        inputs = torch.where(inputs == 0, noise, inputs)
    return inputs, targets


_CHUNK = 2048


def _segment(cell: MQARCell, vocab: int, seed: int, stream: int, power_a: float, random_non_queries: bool,
             seq_len: int) -> tuple[Tensor, Tensor]:
    """A whole segment, generated in chunks (``[examples, seq_len]`` int16 inputs and targets, right-padded
    with 0 / -100 to ``seq_len``)."""
    xs, ys = [], []
    for c, start in enumerate(range(0, cell.examples, _CHUNK)):
        n = min(_CHUNK, cell.examples - start)
        x, y = paper_mqar(n, cell.seq_len, cell.pairs, vocab, batch_generator(seed, stream, c), power_a,
                          random_non_queries)
        pad = seq_len - cell.seq_len
        if pad:
            x = nn.functional.pad(x, (0, pad), value=0)
            y = nn.functional.pad(y, (0, pad), value=IGNORE)
        xs.append(x.to(torch.int16))
        ys.append(y.to(torch.int16))
    return torch.cat(xs), torch.cat(ys)


@dataclass
class PaperMQAR:
    """A finite MQAR data set as the papers train on: ``train`` segments (one pool of sequences,
    reshuffled every epoch), ``test`` segments (held out), generated once from ``seed``.

    Sequences shorter than the longest are right-padded with 0 (ignored targets); in a causal model
    padding after a sequence changes nothing before it.
    """

    train: tuple[MQARCell, ...]
    test: tuple[MQARCell, ...]
    vocab_size: int = 8192
    seed: int = 0
    power_a: float = 0.01
    random_non_queries: bool = False
    eval_batch: int = 256
    name: str = "mqar-paper"

    def __post_init__(self) -> None:
        _check_int(self.vocab_size, "vocab_size", minimum=4)
        if not self.train or not self.test:
            raise ValueError("PaperMQAR: train and test need at least one segment each")
        self.seq_len = max(c.seq_len for c in self.train)
        self.test_len = max(c.seq_len for c in self.test)
        parts = [_segment(c, self.vocab_size, self.seed, 11 + i, self.power_a, self.random_non_queries,
                          self.seq_len) for i, c in enumerate(self.train)]
        self.train_x = torch.cat([p[0] for p in parts])
        self.train_y = torch.cat([p[1] for p in parts])
        self.tests = [(c, *_segment(c, self.vocab_size, self.seed, 101 + i, self.power_a,
                                    self.random_non_queries, c.seq_len)) for i, c in enumerate(self.test)]
        self._order_key: tuple[int, int] | None = None
        self._order = torch.empty(0, dtype=torch.long)

    @property
    def examples(self) -> int:
        return int(self.train_x.shape[0])

    def steps_per_epoch(self, batch: int) -> int:
        """Optimiser steps in one pass over the training pool (the last partial batch is dropped)."""
        return max(1, self.examples // batch)

    def batch(self, step: int, batch_size: int, seed: int) -> tuple[Tensor, Tensor]:
        """Batch ``step``: the next ``batch_size`` sequences of this epoch's shuffle of the pool."""
        per = self.steps_per_epoch(batch_size)
        epoch, i = divmod(step, per)
        if self._order_key != (seed, epoch):  # one shuffle per epoch, not one per step
            self._order = torch.randperm(self.examples, generator=batch_generator(seed, 21, epoch))
            self._order_key = (seed, epoch)
        idx = self._order[i * batch_size:(i + 1) * batch_size]
        return self.train_x[idx].long(), self.train_y[idx].long()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device, seed: int = 0) -> dict[str, Any]:
        """``accuracy`` over every test sequence (mean of per-sequence accuracies, as Zoology's
        ``valid/accuracy``), ``val_loss`` and ``by_segment`` (``"seq_len/pairs"`` -> accuracy)."""
        was = model.training
        model.eval()
        per_seq: list[Tensor] = []
        by: dict[str, float] = {}
        loss_sum, count = 0.0, 0
        for cell, xs, ys in self.tests:
            accs = []
            for i in range(0, xs.shape[0], self.eval_batch):
                x, y = xs[i:i + self.eval_batch].long().to(device), ys[i:i + self.eval_batch].long().to(device)
                logits, scored = scored_logits(model, x, y)  # [S, V], [B, N]
                hit = (logits.argmax(-1) == y[scored]).float()
                acc = torch.zeros(x.shape[0], device=device).index_add_(0, scored.nonzero()[:, 0], hit)
                accs.append((acc / scored.sum(1).clamp(min=1)).cpu())
                loss_sum += float(nn.functional.cross_entropy(logits, y[scored], reduction="sum"))
                count += int(scored.sum())
            seg = torch.cat(accs)
            by[f"{cell.seq_len}/{cell.pairs}"] = float(seg.mean())
            per_seq.append(seg)
        model.train(was)
        return {"accuracy": float(torch.cat(per_seq).mean()), "val_loss": loss_sum / max(count, 1), "by_segment": by}


def scored_logits(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Logits at the scored positions only: ``([S, V], scored [B, N] bool)``.

    ``model`` returns hidden states ``[B, N, C]`` (a :class:`~attnzoo.models.DecoderLM` built with
    ``DecoderParts(head=nn.Identity())``); the head is the token embedding (tied, as in Zoology). With a vocabulary of
    8,192 and a handful of queries per sequence this is the same loss as the full ``[B, N, V]``
    logits at a small fraction of their cost.
    """
    hidden = model(x)  # [B, N, C]
    scored = y != IGNORE  # [B, N]
    weight = model.tok_emb.weight  # type: ignore[union-attr]  # [V, C]
    return hidden[scored] @ weight.t(), scored


def epochs_to_steps(task: PaperMQAR, batch: int, epochs: int) -> int:
    """Total optimiser steps of ``epochs`` passes over ``task``'s training pool."""
    return task.steps_per_epoch(batch) * max(1, epochs)


def log2_bytes(n: float) -> float:
    """``log2(n)`` (0 for n <= 0): the Based figure's x axis."""
    return math.log2(n) if n > 0 else 0.0
