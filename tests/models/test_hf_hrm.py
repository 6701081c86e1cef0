"""HRM text (``families/hrm.py``: the Hierarchical Reasoning Model's L/H recurrence over two stacks
of gated-attention layers with weightless norms, a KV cache per layer invocation) through
``from_hf``: equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families import hrm  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(**kw: Any) -> Any:
    """2 layers a stack, 2 H cycles of 2 L cycles, head_dim 16, untied, the default embedding
    scale (1 / 0.02). (A small embedding scale makes these random recurrences chaotic: transformers'
    own float32 and float64 logits then differ by 1e-3.)"""
    return T.HrmTextConfig(**{k: v for k, v in checks.SMALL.items() if k != "num_key_value_heads"},
                           **{"num_hidden_layers": 2, "head_dim": 16, "H_cycles": 2, "L_cycles": 2, **kw})


def _other(**kw: Any) -> Any:
    """q/k/v/o/gate and MLP biases, one layer a stack, transformers' default cycles (2 x 3) with
    L_bp_cycles [1, 3], head_dim 24, tied, GELU (tanh), linear-scaled RoPE, an embedding scale of 30."""
    return _config(**{"attention_bias": True, "mlp_bias": True, "num_hidden_layers": 1, "H_cycles": 2, "L_cycles": 3,
                      "L_bp_cycles": [1, 3], "head_dim": 24, "tie_word_embeddings": True,
                      "hidden_act": "gelu_pytorch_tanh", "embedding_scale": 30.0,
                      "rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}, **kw})


def _one_cycle() -> Any:
    """One H cycle of one L cycle: each stack runs once."""
    return _config(H_cycles=1, L_cycles=1, num_hidden_layers=3)


class TestHrmText(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_one_cycle, _other)

    def test_saved_folder_with_biases_loads(self, tmp_path: Path) -> None:
        """A saved folder holds the fused ``attn.gqkv_proj`` / ``mlp.gate_up_proj`` weights and the
        biases under the modules' names."""
        checks.check_folder(_other, tmp_path)


def test_structure() -> None:
    """The two stacks' layers (2 P blocks, weightless norms, element-wise output gates), one cache per
    invocation, the frozen z_L_init a buffer (transformers: a parameter without gradient)."""
    hf = checks.hf_model(_config())
    ours = from_hf(hf)
    assert isinstance(ours, hrm.HrmTextLM) and len(ours.blocks) == 4 and isinstance(ours.norm, torch.nn.Identity)
    assert (ours.high_cycles, ours.low_cycles, ours.per_stack, ours.backprop) == (2, 2, 2, [1, 2])
    assert len(ours.init_cache(1, 8)) == ours.cache_layers == hf.config.num_hidden_layers == 12
    assert ours.blocks[0].attn.frontier.gate_proj.mode == "element" and ours.tok_emb.scale == 50.0
    assert not list(ours.blocks[0].attn_norm.parameters())
    torch.testing.assert_close(ours.z_L_init, hf.model.z_L_init.detach())
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters()) - 64
    other = from_hf(checks.hf_model(_other()))
    assert other.blocks[0].attn.frontier.gate_proj.bias is not None and other.backprop == [1, 3]


def test_training_gradients_equal_transformers() -> None:
    """In training the early L cycles of each H cycle run without gradient (``L_bp_cycles``), as in
    transformers: every gradient equal; back-propagating through every cycle would give others."""
    hf = checks.hf_model(_other()).train()
    ours = from_hf(hf).train()
    x = checks.tokens(10)

    def grads(loss: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(torch.autograd.grad(loss, params))

    pairs = [(hf.model.embed_tokens.weight, ours.tok_emb.weight),
             (hf.model.L_module.layers[0].mlp.down_proj.weight, ours.blocks[0].ffn.down_proj.weight),
             (hf.model.H_module.layers[0].self_attn.gate_proj.weight, ours.blocks[1].attn.frontier.gate_proj.weight)]
    ref = grads(hf(input_ids=x).logits.square().mean(), [p for p, _ in pairs])
    got = grads(ours(x).square().mean(), [q for _, q in pairs])
    assert max(checks.rel(g, r) for g, r in zip(got, ref, strict=True)) <= 1e-4
    ours.backprop = [3, 3]
    full = grads(ours(x).square().mean(), [q for _, q in pairs])
    assert checks.rel(full[1], ref[1]) > 1e-3


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A ``config.json`` leaving out the keys at their defaults (the embedding scale then from
    ``initializer_range``): read as ``from_pretrained`` reads it."""
    hf = checks.hf_model(_config(H_cycles=2, L_cycles=3, head_dim=128, initializer_range=0.02))
    checks.check_folder_without_keys(hf, tmp_path, (
        "H_cycles", "L_cycles", "L_bp_cycles", "head_dim", "embedding_scale", "initializer_range", "rms_norm_eps",
        "hidden_act", "attention_bias", "mlp_bias", "tie_word_embeddings", "rope_parameters",
        "max_position_embeddings", "attention_dropout"))


def test_legacy_config_with_layers_per_stack_in_num_hidden_layers(tmp_path: Path) -> None:
    """An older ``config.json`` without ``num_layers_per_stack`` counts the layers of one stack in
    ``num_hidden_layers``: read as transformers reads it."""
    hf = checks.hf_model(_config())
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data.pop("num_layers_per_stack")
    data["num_hidden_layers"] = 2
    path.write_text(json.dumps(data))
    x = checks.tokens(9)
    with torch.no_grad():
        ref = T.AutoModelForCausalLM.from_pretrained(tmp_path)(input_ids=x).logits
        assert checks.rel(load_pretrained(tmp_path)(x), ref) <= checks.TOL


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hidden_act", "relu", "hidden_act"), ("H_cycles", 0, "H_cycles"), ("L_cycles", 0, "L_cycles"),
    ("rope_parameters", {"rope_type": "unknown_rope", "rope_theta": 1e4}, "rope_type"),
], ids=["activation", "h_cycles", "l_cycles", "rope_type"])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.HrmTextForCausalLM, _config, key, value, named)


def test_packed_sequences_equal_each_alone() -> None:
    """Packed input runs each sequence alone through the recurrence: forward, and float64 gradients
    (the truncated L cycles as well)."""
    for make in (_config, _other):
        checks.check_packed_equals_each_alone(make)
    checks.check_packed_gradients_equal_each_alone(_other)
