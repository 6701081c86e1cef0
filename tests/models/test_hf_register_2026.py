"""The 2026 families inside transformers through ``attnzoo.hf.register()``: the same tiny models
as their ``from_hf`` tests (each family module's ``_config``), run with
``attn_implementation="attnzoo"`` (their softmax layers through :func:`attnzoo.attention`; windows,
sinks, NoPE layers, output gates, MLA) give transformers' ``eager`` logits on a left-padded batch.
The linear-attention and convolution hooks have their own tests (``test_hf_kernels*.py``)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnzoo.hf as azhf  # noqa: E402
import hf_family_checks as checks  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
azhf.register()

#: the test modules whose ``_config`` builds a tiny causal LM of a family with softmax layers
FAMILIES = ("test_hf_gemma3", "test_hf_smollm3", "test_hf_olmo3", "test_hf_gpt_oss", "test_hf_llama4",
            "test_hf_granitemoe_swa", "test_hf_granitemoehybrid", "test_hf_bamba", "test_hf_falcon_h1",
            "test_hf_jamba", "test_hf_lfm2", "test_hf_lfm3", "test_hf_lara_mini", "test_hf_qwen3_next",
            "test_hf_kimi_linear", "test_hf_bailing_hybrid", "test_hf_nemotron_h", "test_hf_minimax",
            "test_hf_qwen4_exp", "test_hf_zamba2")


@pytest.mark.parametrize("module", FAMILIES)
def test_attnzoo_attention_equals_eager(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mapping = transformers.AttentionInterface._global_mapping
    served, calls = mapping["attnzoo"], []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return served(*args, **kwargs)

    monkeypatch.setitem(mapping, "attnzoo", counted)
    checks.check_register_equals_eager(checks.hf_model(importlib.import_module(module)._config()))
    assert calls, f"{module}: no layer called attnzoo's attention"


@pytest.mark.parametrize("module", ["test_hf_qwen4_exp", "test_hf_gpt_oss", "test_hf_minimax", "test_hf_lfm3"])
def test_greedy_generation_equals_eager(module: str) -> None:
    """Through the cache (Qwen4-Exp's indexed attention ANDs its key selection into the mask)."""
    hf = checks.hf_model(importlib.import_module(module)._config())
    x, mask = checks.padded(20)
    out = {}
    for impl in ("eager", "attnzoo"):
        hf.set_attn_implementation(impl)
        out[impl] = hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    assert torch.equal(out["attnzoo"], out["eager"]), f"{module}\n{out['attnzoo']}\n{out['eager']}"
