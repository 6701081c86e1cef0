"""The block classes families build instead of :class:`~attnzoo.TransformerBlock` (Cohere / Phi's
one-norm parallel layer, GPT-NeoX's two-norm one, BLOOM's post-norm residual, Beam's mixed
residual): bad input is refused by the shared check, named with the class."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_hf_beam as beam  # noqa: E402
import test_hf_classic as classic  # noqa: E402
import test_hf_dense_2 as dense2  # noqa: E402
import test_hf_neox as neox  # noqa: E402

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {"ParallelBlock": dense2._cohere, "TwoNormParallelBlock": neox._gpt_neox,
         "ResidualNormBlock": classic._bloom_other, "MixedResidualBlock": beam._ergo}


def _block(name: str) -> Any:
    model = from_hf(checks.hf_model(CASES[name]()))
    block = next(b for b in model.blocks if type(b).__name__ == name)
    return block


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_named(name: str) -> None:
    block = _block(name)
    x = torch.randn(2, 5, block.dim)
    with pytest.raises(ValueError, match=rf"{name}: no cross-attention; context and context_mask must be None"):
        block(x, context=x)
    with pytest.raises(ValueError, match=rf"{name}: no cross-attention"):
        block(x, context_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=rf"{name}: x must be \[B, N, C\] with C={block.dim}, got \(2, 5, 3\)"):
        block(torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match=rf"{name}: x must be \[B, N, C\] with C={block.dim}, got list"):
        block([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(CASES))
def test_key_padding_equals_the_rows_alone(name: str) -> None:
    """A padded key is invisible: the real tokens of a left-padded row equal the row alone (the
    block's positions relative: RoPE, ALiBi)."""
    block = _block(name).eval()
    x = torch.randn(2, 6, block.dim)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, :2] = False
    with torch.no_grad():
        both = block(x, key_padding=keep)
        alone = block(x[:1, 2:])
        ignored = block(x)
    torch.testing.assert_close(both[:1, 2:], alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ignored[:1, 2:], alone, rtol=1e-3, atol=1e-3)  # the pads do matter
