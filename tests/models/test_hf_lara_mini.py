"""Lara-mini through ``from_hf`` / ``load_pretrained``: gated DeltaNet layers with grouped value heads,
sliding-window attention with RoPE, NoPE full attention (by ``layer_types``), the MoE with float32
router logits and an ungated shared expert on every layer; equal to transformers' eager (see
``hf_family_checks``), packed sequences equal to each sequence alone (forward and gradients), the
checkpoint's fused ``in_proj`` / ``out_norm`` loaded from a saved folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.lara_mini.modeling_lara_mini import LaraMiniTopKRouter  # noqa: E402

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.families.lara_mini import Float32Router  # noqa: E402
from attnzoo.models.families.qwen3_next import QwenGatedDeltaNet  # noqa: E402
from attnzoo.nn.moe import MixtureOfExperts  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {k: v for k, v in checks.SMALL.items() if k != "intermediate_size"}  # no dense layer: no such key


def _config(**kw: Any) -> Any:
    """The released layer pattern (linear, sliding, linear, full, sliding), a window of 6 (shorter
    than the tested sequences), 4 value heads per 2 key heads, 4 experts + a shared one, tied."""
    return T.LaraMiniConfig(**{**SMALL, "num_hidden_layers": 5, "head_dim": 16, "num_experts": 4,
                               "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                               "shared_expert_intermediate_size": 24, "linear_num_key_heads": 2,
                               "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                               "sliding_window": 6, **kw})


def _untied() -> Any:
    """Untied head, q/k/v/o biases, top-k weights not renormalised, 3 value heads per key head of
    other widths, a conv of 3, a window of 4, another layer order."""
    return _config(tie_word_embeddings=False, attention_bias=True, norm_topk_prob=False, linear_num_key_heads=1,
                   linear_num_value_heads=3, linear_key_head_dim=12, linear_value_head_dim=6, linear_conv_kernel_dim=3,
                   sliding_window=4, num_hidden_layers=4,
                   layer_types=["sliding_attention", "linear_attention", "full_attention", "linear_attention"])


def _scaled_rope() -> Any:
    """Linear-scaled RoPE on the sliding layers, no shared expert, top-1 of 3 experts."""
    return _config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
                   shared_expert_intermediate_size=0, num_experts=3, num_experts_per_tok=1)


def test_layer_structure() -> None:
    ours = from_hf(checks.hf_model(_config()))
    kinds = [type(b.attn).__name__ for b in ours.blocks]
    assert [isinstance(b.attn, QwenGatedDeltaNet) for b in ours.blocks] == [True, False, True, False, False], kinds
    assert [ours.blocks[i].attn.window for i in (1, 3, 4)] == [(5, 5), None, (5, 5)]  # sliding_window - 1 keys
    assert ours.blocks[3].attn.rope is None and ours.blocks[1].attn.rope is not None  # NoPE full attention
    moe = ours.blocks[0].ffn
    assert isinstance(moe, MixtureOfExperts) and isinstance(moe.router, Float32Router)
    assert moe.shared_expert is not None and moe.shared_gate is None and moe.norm_topk_prob
    assert from_hf(checks.hf_model(_scaled_rope())).blocks[0].ffn.shared_expert is None


def test_router_logits_are_float32_in_bfloat16() -> None:
    """Half precision routes as ``LaraMiniTopKRouter``: logits from the float32-cast input and
    weight (a bfloat16 matmul gives other logits, and other experts near ties)."""
    hf = checks.hf_model(_config(num_experts=16, num_experts_per_tok=4)).to(torch.bfloat16)
    ours = from_hf(hf)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    router = hf.model.layers[0].mlp.gate
    assert isinstance(router, LaraMiniTopKRouter)
    ref_logits, ref_weights, ref_experts = router(x)
    weights, experts, logits = ours.blocks[0].ffn.route(x)
    assert logits.dtype == torch.float32 and torch.equal(logits, ref_logits)
    assert torch.equal(experts, ref_experts) and torch.equal(weights, ref_weights)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5"),
    ("layer_types", ["linear_attention", "chunked_attention", "linear_attention", "full_attention",
                     "sliding_attention"], "layer type 'chunked_attention'"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.LaraMiniForCausalLM, _config, key, value, named)


def test_untied_saved_folder_loads(tmp_path: Path) -> None:
    """``save_pretrained`` writes the fused ``in_proj`` / ``out_norm`` and the untied ``lm_head``."""
    checks.check_folder(_untied, tmp_path)


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A ``config.json`` that leaves out ``LaraMiniConfig``'s defaults (the period-5 layer pattern,
    a window of 512, tied, renormalised top-k, SiLU, a conv of 4): read as transformers reads it."""
    hf = checks.hf_model(_config(sliding_window=512))
    checks.check_folder_without_keys(hf, tmp_path, (
        "layer_types", "sliding_window", "tie_word_embeddings", "norm_topk_prob", "hidden_act",
        "linear_conv_kernel_dim", "attention_bias", "rms_norm_eps"))


class TestLaraMini(checks.FamilyChecks):
    """The shared checks on the three configs, and packed sequences (``cu_seqlens``: the windows,
    the convolutions and the DeltaNet states stay inside each sequence)."""

    config = staticmethod(_config)
    cases = (_untied, _scaled_rope)

    def test_packed_sequences_equal_each_alone(self) -> None:
        checks.check_packed_equals_each_alone(self.config)

    def test_packed_training_gradients_equal_each_alone(self) -> None:
        checks.check_packed_gradients_equal_each_alone(self.cases[0])
