"""LFM2-MoE through ``from_hf``: LFM2's gated short-convolution and QK-normed attention layers,
dense SwiGLU feed-forwards on the first ``num_dense_layers`` layers and a mixture of SwiGLU
experts on the others (sigmoid scores, ``expert_bias`` choosing, ``norm_topk_prob`` dividing by
``sum + 1e-6``, ``routed_scaling_factor``); equal to transformers' eager (see
``hf_family_checks``), the expert bias perturbed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from attnzoo.blocks import FeedForward
from attnzoo.interop import from_hf, load_pretrained
from attnzoo.models.families.lfm2 import (
    Lfm2ShortConvMixer,
    canonical_moe,
    moe_factory,
    put_lfm2_moe,
)
from attnzoo.models.hf._state import HFConfig, Plan, Source
from attnzoo.models.hf.errors import CheckpointFormatError
from attnzoo.nn.attention import MultiHeadAttention
from attnzoo.nn.moe import MixtureOfExperts

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: no OpenMP spin-waiting on a busy machine


@pytest.fixture(autouse=True)
def _expert_bias_perturbed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hf_family_checks.perturbed`` perturbs DeepSeek's ``e_score_correction_bias`` only; LFM2-MoE's
    ``expert_bias`` (zeros at init) is perturbed here too, enough to change which experts win."""
    plain = checks.perturbed

    def perturbed(model: Any, seed: int = 0, scale: float = 0.1) -> Any:
        model = plain(model, seed, scale)
        g = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith("expert_bias"):
                    b.add_(torch.randn(b.shape, generator=g) * 0.3)
        return model

    monkeypatch.setattr(checks, "perturbed", perturbed)


def _config(**kw: Any) -> Any:
    """conv / attention mixed, conv biases, tied; 1 dense layer (width 96, as given) then 3 MoE
    layers of 4 experts, top-2 of sigmoid + expert_bias, renormalised, scaled by 2.5."""
    return T.Lfm2MoeConfig(**{**checks.SMALL, "num_hidden_layers": 4, "moe_intermediate_size": 32,
                              "layer_types": ["conv", "full_attention", "conv", "full_attention"], "conv_bias": True,
                              "num_dense_layers": 1, "num_experts": 4, "num_experts_per_tok": 2,
                              "use_expert_bias": True, "norm_topk_prob": True, "routed_scaling_factor": 2.5, **kw})


def _second(**kw: Any) -> Any:
    """2 dense layers then 3 MoE layers of 6 experts, top-3 of the plain sigmoids (no expert
    bias), unnormalised, scaling 1; no conv bias, kernel 4, untied, eps 1e-6, linear-scaled rope."""
    return T.Lfm2MoeConfig(**{**checks.SMALL, "num_hidden_layers": 5, "moe_intermediate_size": 24,
                              "layer_types": ["full_attention", "conv", "conv", "full_attention", "conv"],
                              "conv_bias": False, "conv_L_cache": 4, "tie_word_embeddings": False, "norm_eps": 1e-6,
                              "num_dense_layers": 2, "num_experts": 6, "num_experts_per_tok": 3,
                              "use_expert_bias": False, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                              "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                              **kw})


class TestLfm2Moe(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_second,)


def test_structure() -> None:
    hf = checks.hf_model(_config())
    ours = from_hf(hf)
    assert [type(b.attn) for b in ours.blocks] == [Lfm2ShortConvMixer, MultiHeadAttention] * 2
    assert [type(b.ffn) for b in ours.blocks] == [FeedForward] + [MixtureOfExperts] * 3
    assert ours.blocks[0].ffn.up_proj.weight.shape == (96, 64)  # intermediate_size as given: no auto-adjust
    moe = ours.blocks[1].ffn
    assert (moe.num_experts, moe.top_k, moe.hidden, moe.routing) == (4, 2, 32, "sigmoid_topk")
    assert moe.norm_topk_prob and moe.norm_eps == 1e-6 and moe.routed_scaling == 2.5 and moe.shared_expert is None
    theirs = hf.model.layers[1].feed_forward.expert_bias
    assert moe.score_bias.dtype == torch.float32 and torch.equal(moe.score_bias, theirs) and theirs.abs().min() > 0
    assert ours.tie_embeddings and ours.blocks[1].attn.frontier.q_norm.eps == 1e-5
    second = from_hf(checks.hf_model(_second()))
    assert [type(b.ffn) for b in second.blocks] == [FeedForward] * 2 + [MixtureOfExperts] * 3
    moe = second.blocks[4].ffn
    assert (moe.num_experts, moe.top_k, moe.norm_topk_prob) == (6, 3, False)
    assert not moe.score_bias.any() and not second.tie_embeddings  # no expert bias: the plain top-k
    every_dense = from_hf(T.Lfm2MoeForCausalLM(_config(num_dense_layers=9)))
    assert all(type(b.ffn) is FeedForward for b in every_dense.blocks)
    no_dense = from_hf(T.Lfm2MoeForCausalLM(_config(num_dense_layers=0)))
    assert all(type(b.ffn) is MixtureOfExperts for b in no_dense.blocks)


@pytest.mark.parametrize(("expert_bias", "norm", "scaling"), [(True, True, 2.5), (False, True, 1.0),
                                                              (True, False, 0.5)])
def test_moe_block_equals_transformers_in_float64(expert_bias: bool, norm: bool, scaling: float) -> None:
    """``Lfm2MoeSparseMoeBlock`` alone, float64: equal to rounding (1e-12), which the ``1e-6`` of
    its renormalisation is far above (the end-to-end float32 checks could not see it)."""
    config = _config(use_expert_bias=expert_bias, norm_topk_prob=norm, routed_scaling_factor=scaling)
    torch.manual_seed(0)
    block = T.models.lfm2_moe.modeling_lfm2_moe.Lfm2MoeSparseMoeBlock(config)
    with torch.no_grad():  # built alone, its expert weights are torch.empty (garbage, NaN at times)
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    theirs = checks.perturbed(block, scale=0.5).double()
    ours = moe_factory(canonical_moe(HFConfig(config.to_dict(), "test", "LFM2-MoE")), dtype=torch.float64)()
    plan = Plan(Source({k: v.detach() for k, v in theirs.state_dict().items()}), "LFM2-MoE")
    put_lfm2_moe(plan, "", "", 4, expert_bias=expert_bias)
    plan.apply(ours)
    x = torch.randn(2, 13, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        assert checks.rel(ours(x), theirs(x)) <= 1e-12


def test_saved_folder_holds_each_expert_and_loads(tmp_path: Path) -> None:
    """A saved folder names each expert (``experts.{e}.w1/w3/w2.weight``, no ``gate_up_proj``) and
    keeps ``expert_bias``; it loads (the in-memory stacked layout is the other checks')."""
    from safetensors import safe_open

    hf = checks.hf_model(_config())
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    moe = "model.layers.2.feed_forward."
    assert {f"{moe}experts.3.w1.weight", f"{moe}experts.0.w2.weight", f"{moe}expert_bias"} <= keys
    assert not any("gate_up_proj" in k for k in keys)
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).logits) <= checks.TOL


def test_legacy_config_keys_and_defaults_load(tmp_path: Path) -> None:
    """A ``config.json`` with the class's defaults left out, ``tie_embedding`` for
    ``tie_word_embeddings``, a legacy ``rope_theta``, and LFM2's ``block_*`` width keys (which
    ``Lfm2MoeMLP`` ignores: the dense width stays ``intermediate_size``); transformers reads the
    folder the same way."""
    config = _config(conv_bias=False, norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                     tie_word_embeddings=False)
    hf = checks.hf_model(config)
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    for key in ("conv_bias", "conv_L_cache", "norm_eps", "rope_parameters", "tie_word_embeddings"):
        data.pop(key)
    data.update(tie_embedding=False, rope_theta=1e6, block_auto_adjust_ff_dim=True, block_multiple_of=256,
                block_ffn_dim_multiplier=1.0)
    path.write_text(json.dumps(data))
    model, x = load_pretrained(tmp_path), checks.tokens(10)
    assert not model.tie_embeddings and model.blocks[0].ffn.up_proj.weight.shape == (96, 64)
    with torch.no_grad():
        theirs = T.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()(input_ids=x)
        assert checks.rel(theirs.logits, hf(input_ids=x).logits) <= 1e-6  # transformers reads the edited folder alike
        assert checks.rel(model(x), theirs.logits) <= checks.TOL


@pytest.mark.parametrize(("key", "value", "named"), [
    ("layer_types", ["conv", "sliding_attention", "conv", "full_attention"], "layer type 'sliding_attention'"),
    ("rope_parameters", {"rope_type": "proportional", "rope_theta": 10000.0}, "rope_type='proportional'"),
    ("routed_scaling_factor", -1.0, r"routed_scaling_factor=-1\.0"),
    ("routed_scaling_factor", 0.0, r"routed_scaling_factor=0\.0"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.Lfm2MoeForCausalLM, _config, key, value, named)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("layer_types", None, "missing key 'layer_types'"),
    ("num_experts_per_tok", 5, "num_experts_per_tok=5 is more than num_experts=4"),
    ("moe_intermediate_size", 0, "'moe_intermediate_size' must be >= 1"),
    ("conv_L_cache", 0, "'conv_L_cache' must be >= 1"),
])
def test_malformed_configs_are_named(key: str, value: Any, named: str) -> None:
    hf = T.Lfm2MoeForCausalLM(_config())
    setattr(hf.config, key, value)
    with pytest.raises(CheckpointFormatError, match=named):
        from_hf(hf)


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_config)


def test_packed_training_gradients_equal_each_alone() -> None:
    checks.check_packed_gradients_equal_each_alone(_config)
