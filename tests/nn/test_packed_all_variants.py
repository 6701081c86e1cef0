"""``DecoderLM(tokens [1, T], cu_seqlens=cu)`` for every registered variant: equal to each document
alone (logits and parameter gradients), and perturbing one document never changes another's logits."""

from __future__ import annotations

import itertools

import pytest
import torch

import attnzoo as az
from attnzoo.variants import VARIANTS

LENGTHS = [5, 1, 9, 0, 3]
VOCAB, DIM, HEADS = 17, 32, 4


def _lm(name: str, depth: int = 2) -> az.DecoderLM:
    torch.manual_seed(0)
    return az.DecoderLM(VOCAB, DIM, depth, HEADS, attention=name).double().eval()


def _packed() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    tokens = torch.randint(0, VOCAB, (1, cu[-1]), generator=torch.Generator().manual_seed(1))
    return tokens, torch.tensor(cu, dtype=torch.int32), cu


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_packed_logits_equal_each_document_alone(name: str) -> None:
    lm = _lm(name)
    tokens, cu, bounds = _packed()
    with torch.no_grad():
        packed = lm(tokens, cu_seqlens=cu)
        assert packed.shape == (1, tokens.shape[1], VOCAB)
        for lo, hi in itertools.pairwise(bounds):
            if hi > lo:
                alone = lm(tokens[:, lo:hi])
                torch.testing.assert_close(packed[:, lo:hi], alone, rtol=1e-10, atol=1e-10,
                                           msg=lambda m, lo=lo, hi=hi: f"{name} document [{lo}, {hi}): {m}")
        other = tokens.clone()
        other[:, bounds[2]:bounds[3]] = (other[:, bounds[2]:bounds[3]] + 1) % VOCAB  # change document 2 only
        changed = lm(other, cu_seqlens=cu)
    keep = torch.ones(tokens.shape[1], dtype=torch.bool)
    keep[bounds[2]:bounds[3]] = False
    assert torch.equal(changed[:, keep], packed[:, keep]), f"{name}: another document's logits changed"


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_packed_gradients_equal_the_sum_over_documents(name: str) -> None:
    lm = _lm(name, depth=1)
    tokens, cu, bounds = _packed()
    lm.zero_grad()
    lm(tokens, cu_seqlens=cu).logsumexp(-1).sum().backward()
    packed = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
    lm.zero_grad()
    for lo, hi in itertools.pairwise(bounds):
        if hi > lo:
            lm(tokens[:, lo:hi]).logsumexp(-1).sum().backward()
    for n, p in lm.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed[n], p.grad, rtol=1e-9, atol=1e-10, msg=lambda m, n=n: f"{name} d{n}: {m}")


@pytest.mark.parametrize("name", ["gated_deltanet", "kda", "mamba2", "linear", "nsa"])
def test_bad_cu_seqlens_is_named_by_the_model(name: str) -> None:
    lm = _lm(name, depth=1)
    tokens, _, _ = _packed()
    for cu, exc in ((torch.tensor([0, 3, 2, 18], dtype=torch.int32), ValueError),
                    (torch.tensor([0, 3, 18]), TypeError), (torch.tensor([0, 3, 30], dtype=torch.int32), ValueError)):
        with pytest.raises(exc, match="cu_seqlens"):
            lm(tokens, cu_seqlens=cu)
