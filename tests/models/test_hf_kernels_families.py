"""``attnzoo.hf.register()`` end to end on every family whose linear-attention layers call
transformers' kernel hooks (Qwen3.5, Qwen3.5-MoE, OLMo-hybrid, Kimi Linear; Qwen3-Next has its
own module, ``test_hf_kernels.py``; Lara-mini (gated DeltaNet), Bailing-hybrid (KDA); LFM2, LFM2-MoE
and LFM3, whose short convolutions call the
``causal_conv1d`` hooks): with attnzoo's kernels served, the logits of a left-padded
batch and greedy generation (cached decode) equal those with transformers' own PyTorch fallback
put back, and padding-free packed input gives each sequence's logits alone (the fallback
refuses packed input; LFM2's fallback convolution runs it, across the sequence boundaries: 0.66
relative off each sequence alone)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import attnzoo.hf as azhf
import hf_family_checks as checks
from attnzoo import hf_kernels

azhf.register()

#: transformers' modeling module name -> the test module holding that family's tiny offline config
FAMILIES = {"qwen3_5": "test_hf_qwen3_5", "qwen3_5_moe": "test_hf_qwen3_5_moe",
            "olmo_hybrid": "test_hf_olmo_hybrid", "kimi_linear": "test_hf_kimi_linear",
            "lfm2": "test_hf_lfm2", "lfm2_moe": "test_hf_lfm2_moe", "lara_mini": "test_hf_lara_mini",
            "lfm3": "test_hf_lfm3", "bailing_hybrid": "test_hf_bailing_hybrid"}


def _config(family: str) -> Any:
    make: Callable[..., Any] = importlib.import_module(FAMILIES[family])._config
    return make()


def _modeling(family: str) -> Any:
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _run(hf: Any, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits = hf(input_ids=x, attention_mask=mask).logits
    gen = hf.generate(input_ids=x[1:, :7], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    return logits, gen


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_served_hooks_equal_the_fallback(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    modeling = _modeling(family)
    served = [fn for (mod, fn) in hf_kernels.ORIGINALS if mod == family]
    assert served, f"register() serves no hook of {family}"
    assert all(getattr(modeling, fn) is not hf_kernels.ORIGINALS[(family, fn)] for fn in served)
    hf = checks.hf_model(_config(family))
    x, mask = checks.padded(30)
    ours, gen = _run(hf, x, mask)
    for fn in served:
        monkeypatch.setattr(modeling, fn, hf_kernels.ORIGINALS[(family, fn)])
    ref, ref_gen = _run(hf, x, mask)
    real = mask.bool()
    err = checks.rel(ours[real], ref[real])
    assert err <= checks.TOL, f"{family}: served kernels vs fallback, max rel error {err:.2e} (hooks {served})"
    assert torch.equal(gen, ref_gen), f"{family}: greedy generation differs\n{gen}\n{ref_gen}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_sequences_equal_each_alone(family: str) -> None:
    """Padding-free input (``checks.check_transformers_packed``), lengths including 1."""
    checks.check_transformers_packed(checks.hf_model(_config(family)))
