"""Checks shared by the tests of modules that have a variant which must not change float32 results
(a keep-float32 option, a fused path): the twin equals the plain module bit for bit."""

from __future__ import annotations

import torch
from torch import nn


def assert_same_forward_and_gradients(plain: nn.Module, twin: nn.Module, x: torch.Tensor) -> None:
    """``twin(x)`` equals ``plain(x)`` bit for bit, and so do the gradients of every parameter of a
    squared-sum loss (the two modules hold the same parameters in the same order)."""
    out_plain, out_twin = plain(x), twin(x)
    assert torch.equal(out_plain, out_twin)
    out_plain.square().sum().backward()
    out_twin.square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), twin.parameters(), strict=True))
