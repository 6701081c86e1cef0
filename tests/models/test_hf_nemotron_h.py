"""Nemotron-H (``NemotronHForCausalLM``) through ``from_hf``: each Hugging Face layer is one
mixer (Mamba-2 ``M``, NoPE attention ``*``, relu^2 MLP ``-``, mixture of relu^2 experts ``E``); a
mixer layer and the MLP or MoE layer after it become one attnzoo block, a lone mixer a
mixer-only block. Equal to transformers' eager (see ``hf_family_checks``), the MoE layers (Nemotron
3 Nano) with group-limited sigmoid routing, the correction bias perturbed, normalised and
unnormalised top-k weights, ``routed_scaling_factor`` away from 1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: no OpenMP spin-waiting on a busy machine


def _config(**kw: Any) -> Any:
    # mamba inner 4 x 24 = 96 (not expand x hidden = 128); attention head_dim 24 (not 64 / 4)
    return T.NemotronHConfig(**{**checks.SMALL, "head_dim": 24, "layers_block_type": T.NemotronHConfig._pattern_to_list(
        "M-M*-MM-"), "mamba_num_heads": 4, "mamba_head_dim": 24, "n_groups": 2, "ssm_state_size": 8,
        "chunk_size": 8, **kw})


def _second(**kw: Any) -> Any:
    # the legacy pattern key; one group, no conv bias, biased MLPs; tie_word_embeddings and
    # attention_bias, which transformers' modeling ignores (lm_head untied, unbiased projections)
    return T.NemotronHConfig(**{**checks.SMALL, "layers_block_type": None, "hybrid_override_pattern": "M*-M-",
                                "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_n_groups": 1, "ssm_state_size": 8,
                                "use_conv_bias": False, "conv_kernel": 3, "mlp_bias": True, "layer_norm_epsilon": 1e-6,
                                "tie_word_embeddings": True, "attention_bias": True, "chunk_size": 8, **kw})


def _moe(**kw: Any) -> Any:
    # "ME*EM-": [ME] [*E] [M-]; 4 relu^2 experts in 2 groups, each token's 2 from its best group
    # (both of it), renormalised, scaled by 2.5; a relu^2 shared expert of 40
    return _config(**{"layers_block_type": T.NemotronHConfig._pattern_to_list("ME*EM-"), "n_routed_experts": 4,
                      "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 40,
                      "n_group": 2, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, **kw})


def _moe_second(**kw: Any) -> Any:
    # the legacy pattern "MEM*EM-": [ME] [M] [*E] [M-]; 8 experts in 4 groups, 3 a token from
    # its best 2 groups, unnormalised, scaled by 0.5; biased MLPs and shared expert (mlp_bias),
    # and the rest of _second (one Mamba group, no conv bias, conv 3, eps 1e-6)
    return _second(**{"hybrid_override_pattern": "MEM*EM-", "n_routed_experts": 8, "num_experts_per_tok": 3,
                      "moe_intermediate_size": 24, "moe_shared_expert_intermediate_size": 16, "n_group": 4,
                      "topk_group": 2, "norm_topk_prob": False, "routed_scaling_factor": 0.5, **kw})


class TestNemotronH(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_second,)


class TestNemotronHMoE(checks.FamilyChecks):
    config = staticmethod(_moe)
    cases = (_moe_second,)


def test_a_mixer_and_the_moe_layer_after_it_are_one_block() -> None:
    from attnzoo.blocks import FeedForward
    from attnzoo.interop import from_hf
    from attnzoo.nn.moe import MixtureOfExperts

    hf = checks.hf_model(_moe())
    ours = from_hf(hf)
    # "ME*EM-": [ME] [*E] [M-]
    assert ours.depth == len(ours.blocks) == 3
    assert [type(b.ffn) for b in ours.blocks] == [MixtureOfExperts, MixtureOfExperts, FeedForward]
    moe, theirs = ours.blocks[1].ffn, hf.model.layers[3].mixer
    assert moe.gate_proj is None and moe.activation == "relu2" and moe.routing == "sigmoid_topk"
    assert (moe.num_experts, moe.top_k, moe.hidden, moe.groups, moe.topk_groups) == (4, 2, 32, 2, 1)
    assert moe.norm_topk_prob and moe.routed_scaling == 2.5
    assert moe.shared_expert.activation == "relu2" and moe.shared_expert.gate_proj is None
    assert torch.equal(moe.up_proj, theirs.experts.up_proj) and torch.equal(moe.down_proj, theirs.experts.down_proj)
    assert torch.equal(moe.score_bias, theirs.gate.e_score_correction_bias) and moe.score_bias.abs().max() > 0
    assert torch.equal(moe.router.weight, theirs.gate.weight)
    assert torch.equal(ours.blocks[1].ffn_norm.weight, hf.model.layers[3].norm.weight)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())


def test_the_correction_bias_chooses_the_experts() -> None:
    """A large correction bias on one expert puts it in every token's top-k (of its group)."""
    from attnzoo.interop import from_hf

    hf = checks.hf_model(_moe(n_group=1))
    with torch.no_grad():
        hf.model.layers[1].mixer.gate.e_score_correction_bias[2] = 10.0
    ours = from_hf(hf)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, experts, _ = ours.blocks[0].ffn.route(x)
    assert bool((experts == 2).any(dim=-1).all())


def test_a_mixer_and_the_mlp_after_it_are_one_block() -> None:
    from attnzoo.interop import from_hf
    from attnzoo.nn.mamba2 import Mamba2

    hf = checks.hf_model(_config())
    ours = from_hf(hf)
    # "M-M*-MM-": [M-] [M] [*-] [M] [M-]
    assert ours.depth == len(ours.blocks) == 5
    assert [isinstance(b.attn, Mamba2) for b in ours.blocks] == [True, True, False, True, True]
    assert [b.ffn is None and b.ffn_norm is None for b in ours.blocks] == [False, True, False, True, False]
    assert ours.blocks[2].attn.rope is None  # NoPE
    assert ours.blocks[0].attn.v_proj.weight.shape == (96, 64)  # mamba_num_heads x mamba_head_dim
    assert ours.blocks[0].ffn.activation == "relu2" and ours.blocks[0].ffn.gate_proj is None
    layers = hf.model.layers
    assert torch.equal(ours.blocks[2].ffn_norm.weight, layers[4].norm.weight)
    assert torch.equal(ours.blocks[4].ffn.down_proj.weight, layers[7].mixer.down_proj.weight)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("make", [_config, _moe], ids=["mlp", "moe"])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    checks.check_packed_equals_each_alone(make)


@pytest.mark.parametrize("make", [_config, _moe], ids=["mlp", "moe"])
def test_packed_training_gradients_equal_each_alone(make: Any) -> None:
    checks.check_packed_gradients_equal_each_alone(make)


def test_legacy_config_json_loads(tmp_path: Path) -> None:
    """A ``config.json`` with ``hybrid_override_pattern``, the legacy ``mamba_*`` keys and a
    ``num_hidden_layers`` (ignored, as transformers ignores it) loads the same model."""
    from attnzoo.interop import load_pretrained

    hf = checks.hf_model(_config())
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["hybrid_override_pattern"] = "M-M*-MM-"
    data["mamba_n_groups"] = data.pop("n_groups")
    data["mamba_d_conv"] = data.pop("conv_kernel")
    for key in ("layers_block_type", "mlp_hidden_act", "use_bias"):  # the last two: the class defaults
        data.pop(key)
    data["num_hidden_layers"] = 3
    path.write_text(json.dumps(data))
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).logits) <= checks.TOL


def test_saved_moe_folder_holds_one_tensor_per_expert_and_loads(tmp_path: Path) -> None:
    """``save_pretrained`` writes ``backbone.layers.{j}.mixer.experts.{e}.up_proj.weight`` (one per
    expert, transformers' conversion mapping); a legacy ``config.json`` (the pattern string, and
    ``num_local_experts`` for ``n_routed_experts``) loads the same model."""
    from safetensors.torch import load_file

    from attnzoo.interop import load_pretrained

    hf = checks.hf_model(_moe())
    hf.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert saved["backbone.layers.1.mixer.experts.3.up_proj.weight"].shape == (32, 64)
    assert saved["backbone.layers.1.mixer.experts.3.down_proj.weight"].shape == (64, 32)
    assert not any(k.endswith("experts.up_proj") for k in saved)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["hybrid_override_pattern"] = "ME*EM-"
    data["num_local_experts"] = data.pop("n_routed_experts")
    data.pop("layers_block_type")
    path.write_text(json.dumps(data))
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).logits) <= checks.TOL


@pytest.mark.parametrize(("pattern", "named"), [
    ("-M*", r"an mlp layer with no mixer layer before it \(layer 0"),
    ("M--*", r"an mlp layer with no mixer layer before it \(layer 2"),
    ("EM*", r"a moe layer with no mixer layer before it \(layer 0"),
    ("M-E*", r"a moe layer with no mixer layer before it \(layer 2"),
    ("MEE", r"a moe layer with no mixer layer before it \(layer 2"),
])
def test_layers_it_cannot_express_are_refused(pattern: str, named: str) -> None:
    from attnzoo.interop import UnsupportedConfigError, from_hf

    hf = T.NemotronHForCausalLM(_config(layers_block_type=T.NemotronHConfig._pattern_to_list(pattern),
                                        n_routed_experts=4, moe_intermediate_size=32,
                                        moe_shared_expert_intermediate_size=32))
    with pytest.raises(UnsupportedConfigError, match=named):
        from_hf(hf)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("use_bias", True, "use_bias"),
    ("time_step_limit", (0.0, 5.0), "time_step_limit"),
    ("mamba_hidden_act", "gelu", "mamba_hidden_act"),
    ("mlp_hidden_act", "quick_gelu", "mlp_hidden_act"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.NemotronHForCausalLM, _config, key, value, named)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("moe_latent_size", 16, r"moe_latent_size=16 \(the fc1_latent_proj / fc2_latent_proj"),
    ("mlp_hidden_act", "relu", r"mlp_hidden_act='relu' with moe layers"),
    ("n_group", 3, r"n_routed_experts=4 in n_group=3 groups"),
    ("n_group", 4, r"n_routed_experts=4 in n_group=4 groups"),
    ("topk_group", 3, r"n_group=2, topk_group=3"),
    ("routed_scaling_factor", 0.0, r"routed_scaling_factor=0\.0"),
])
def test_moe_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.NemotronHForCausalLM, _moe, key, value, named)


def test_mlp_activation_without_moe_layers_still_converts() -> None:
    """``mlp_hidden_act`` other than relu2 is refused only with ``moe`` layers (their experts take it)."""
    from attnzoo.interop import from_hf

    assert from_hf(T.NemotronHForCausalLM(_config(mlp_hidden_act="relu"))).blocks[0].ffn.activation == "relu"
