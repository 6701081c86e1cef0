"""DeepSeek-V3 and DeepSeek-V2 through ``from_hf``: multi-head latent attention with interleaved
RoPE (YaRN with ``mscale_all_dim``), a dense first layer then mixtures of experts (V3: group-limited
sigmoid routing with the correction bias, shared experts, scaling; V2: softmax routing, greedy or
group-limited greedy), multi-token-prediction layers dropped; equal to transformers' eager (see
``hf_family_checks``), packed sequences and their gradients equal to each sequence alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.deepseek import (  # noqa: E402
    PositionScaledLatentAttention,
    SoftmaxGroupMoE,
    SoftmaxRouting,
)
from attnzoo.models.hf.errors import WeightLoadError  # noqa: E402
from attnzoo.nn.attention import MultiHeadAttention  # noqa: E402
from attnzoo.nn.mla import MultiHeadLatentAttention  # noqa: E402
from attnzoo.nn.moe import MixtureOfExperts  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
_SIZES = dict(num_key_value_heads=4, num_hidden_layers=3, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              first_k_dense_replace=1)


def _v3(**kw: Any) -> Any:
    """3 layers: dense, then MoE with 8 experts in 4 groups (2 picked from the best 2), one shared
    expert, a full query projection."""
    return T.DeepseekV3Config(**{**checks.SMALL, **_SIZES, "n_group": 4, "topk_group": 2, "q_lora_rank": None,
                                 "routed_scaling_factor": 2.0, **kw})


def _v3_low_rank_yarn() -> Any:
    """A low-rank query, YaRN, attention biases, two shared experts, unnormalised weights, tied head,
    4 layers (two dense), split-half RoPE."""
    return _v3(q_lora_rank=24, rope_parameters=YARN, attention_bias=True, n_shared_experts=2, norm_topk_prob=False,
               tie_word_embeddings=True, num_hidden_layers=4, first_k_dense_replace=2, rope_interleave=False)


def _v2(**kw: Any) -> Any:
    """DeepSeek-V2: 3 layers (dense, MoE, MoE), greedy softmax routing, two shared experts."""
    return T.DeepseekV2Config(**{**checks.SMALL, **_SIZES, "q_lora_rank": None, "n_shared_experts": 2,
                                 "routed_scaling_factor": 1.0, **kw})


def _v2_group_yarn() -> Any:
    """Group-limited greedy (8 experts in 4 groups, the best 2), scaling, a low-rank query, YaRN,
    MLP biases, a stray ``rope_interleave=False`` (V2 ignores it: always interleaved)."""
    return _v2(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5, q_lora_rank=24,
               rope_parameters=YARN, mlp_bias=True, attention_bias=True, rope_interleave=False)


def _glm_lite(**kw: Any) -> Any:
    """GLM-4-MoE-Lite: explicit ``mlp_layer_types`` (dense, sparse, dense, sparse), 8 experts in 2
    groups (the best 1), a low-rank query, YaRN."""
    sizes = {k: v for k, v in _SIZES.items() if k != "first_k_dense_replace"}
    return T.Glm4MoeLiteConfig(**{**checks.SMALL, **sizes, "num_hidden_layers": 4,
                                  "mlp_layer_types": ["dense", "sparse", "dense", "sparse"], "n_group": 2,
                                  "topk_group": 1, "q_lora_rank": 24, "rope_parameters": YARN, **kw})


def _m4(**kw: Any) -> Any:
    """Mistral-4: a dense first layer then softmax MoE (8 experts in 4 groups scored by their two best,
    the best 2 kept), a low-rank query, YaRN with the query scaled by position
    (``llama_4_scaling_beta``, every 8 positions)."""
    rope = {**YARN, "original_max_position_embeddings": 8, "llama_4_scaling_beta": 0.3, "partial_rotary_factor": 0.5}
    return T.Mistral4Config(**{**checks.SMALL, **_SIZES, "n_group": 4, "topk_group": 2, "q_lora_rank": 24,
                               "rope_parameters": rope, **kw})


def _m4_plain() -> Any:
    """Mistral-4 without the position scaling (beta 0), a full query, one group, unnormalised x2."""
    rope = {**YARN, "llama_4_scaling_beta": 0.0, "partial_rotary_factor": 0.5}
    return _m4(q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=2.0,
               rope_parameters=rope)


def _cpm5(**kw: Any) -> Any:
    """MiniCPM5-MoE: gated GQA (4 query heads of 16 on 2 key/value heads, ``q_gate_proj``), explicit
    layer kinds (dense, sparse, sparse), DeepSeek-V3's MoE in 4 groups (the best 2)."""
    return T.MiniCPM5MoeConfig(**{**checks.SMALL, "num_hidden_layers": 3, "head_dim": 16, "n_routed_experts": 8,
                                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 4,
                                  "topk_group": 2, "mlp_layer_types": ["dense", "sparse", "sparse"], **kw})


def _cpm5_yarn() -> Any:
    """MiniCPM5-MoE with YaRN, head_dim != hidden / heads (24), two shared experts, a tied head."""
    return _cpm5(head_dim=24, n_shared_experts=2, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 64})


@pytest.fixture(scope="module", autouse=True)
def _mistral4_as_causal_lm() -> Any:
    """transformers maps no ``AutoModelForCausalLM`` to ``Mistral4Config`` (the checks build through it)."""
    mapping = T.AutoModelForCausalLM._model_mapping
    try:
        added = mapping[T.Mistral4Config] is None
    except KeyError:
        added = True
        T.AutoModelForCausalLM.register(T.Mistral4Config, T.Mistral4ForCausalLM, exist_ok=True)
    yield
    if added:
        mapping._extra_content.pop(T.Mistral4Config, None)


class TestDeepseekV3(checks.FamilyChecks):
    config = staticmethod(_v3)
    cases = (_v3_low_rank_yarn,)


class TestDeepseekV2(checks.FamilyChecks):
    config = staticmethod(_v2)
    cases = (_v2_group_yarn,)


class TestGlm4MoeLite(checks.FamilyChecks):
    config = staticmethod(_glm_lite)


class TestMiniCPM5Moe(checks.FamilyChecks):
    config = staticmethod(_cpm5)
    cases = (_cpm5_yarn,)


class TestMistral4(checks.FamilyChecks):
    """The position scaling reads absolute positions: transformers' forward without ``position_ids``
    counts a left-padded row's pads, its ``generate`` (and attnzoo) do not; the padded checks pass
    ``generate``'s positions."""

    config = staticmethod(_m4)
    cases = (_m4_plain,)

    def test_logits_equal_transformers(self) -> None:
        for make in (self.config, *self.cases):
            _check_padded(checks.hf_model(make()), 30, "logits")

    def test_base_model_equals_transformers(self) -> None:
        for make in (self.config, *self.cases):
            _check_padded(checks.hf_model(make(), T.AutoModel), 16, "last_hidden_state")


def _check_padded(hf: Any, n: int, field: str) -> None:
    """A left-padded batch with ``generate``'s positions (counted from the first real token)."""
    ours = from_hf(hf)
    x, mask = checks.padded(n)
    with torch.no_grad():
        ref = getattr(hf(input_ids=x, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)), field)
        got = ours(x, attention_mask=mask.bool())
    assert checks.rel(got[mask.bool()], ref[mask.bool()]) <= checks.TOL


def test_layer_structure() -> None:
    ours = from_hf(checks.hf_model(_v3_low_rank_yarn()))
    assert all(type(b.attn) is MultiHeadLatentAttention for b in ours.blocks)
    assert [isinstance(b.ffn, MixtureOfExperts) for b in ours.blocks] == [False, False, True, True]
    moe = ours.blocks[2].ffn
    assert (moe.routing, moe.groups, moe.topk_groups, moe.routed_scaling) == ("sigmoid_topk", 4, 2, 2.0)
    assert not moe.norm_topk_prob and moe.shared_expert.up_proj.weight.shape == (64, 64)
    assert not ours.blocks[0].attn.rope.interleaved and ours.lm_head.weight is ours.tok_emb.weight
    v2 = from_hf(checks.hf_model(_v2_group_yarn()))
    assert [type(b.ffn) for b in v2.blocks[1:]] == [SoftmaxGroupMoE] * 2
    assert v2.blocks[1].ffn.softmax_routing == SoftmaxRouting(1.5, 4, 2, "max", False, True)
    assert v2.blocks[0].attn.rope.interleaved and v2.blocks[0].ffn.up_proj.bias is not None
    glm = from_hf(checks.hf_model(_glm_lite()))
    assert [isinstance(b.ffn, MixtureOfExperts) for b in glm.blocks] == [False, True, False, True]
    assert glm.blocks[1].ffn.groups == 2 and glm.blocks[0].attn_norm.eps == 1e-5
    m4 = from_hf(checks.hf_model(_m4()))
    assert type(m4.blocks[0].attn) is PositionScaledLatentAttention and m4.blocks[0].attn.original == 8
    assert m4.blocks[1].ffn.softmax_routing == SoftmaxRouting(1.0, 4, 2, "top2", True, False)
    assert type(from_hf(checks.hf_model(_m4_plain())).blocks[0].attn) is MultiHeadLatentAttention
    cpm = from_hf(checks.hf_model(_cpm5_yarn()))
    assert type(cpm.blocks[0].attn) is MultiHeadAttention and cpm.blocks[0].attn.frontier.gate_proj is not None
    assert cpm.blocks[1].ffn.score_bias is not None and cpm.lm_head.weight is cpm.tok_emb.weight


@pytest.mark.parametrize("make", [_v3, _v2_group_yarn, _m4, _cpm5_yarn], ids=["v3", "v2", "mistral4", "minicpm5"])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    checks.check_packed_equals_each_alone(make)


@pytest.mark.parametrize("make", [_v3_low_rank_yarn, _m4], ids=["v3", "mistral4"])
def test_packed_gradients_equal_each_alone(make: Any) -> None:
    checks.check_packed_gradients_equal_each_alone(make)


def test_all_dense_config_converts() -> None:
    """``first_k_dense_replace >= num_hidden_layers``: the former dense-only path, still exact."""
    hf = checks.hf_model(_v3(first_k_dense_replace=3))
    x = checks.tokens(12)
    ours = from_hf(hf)
    assert not any(isinstance(b.ffn, MixtureOfExperts) for b in ours.blocks)
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL


@pytest.mark.parametrize("make", [_v3, _v2], ids=["v3", "v2"])
def test_no_shared_experts(make: Any) -> None:
    """``n_shared_experts=0``: transformers keeps empty ``shared_experts`` weights; attnzoo none."""
    hf = checks.hf_model(make(n_shared_experts=0))
    ours, x = from_hf(hf), checks.tokens(12)
    assert ours.blocks[1].ffn.shared_expert is None
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL


def _rewrite_weights(folder: Path, change: Any) -> None:
    path = folder / "model.safetensors"
    sd = dict(safetensors_torch.load_file(str(path)))
    change(sd)
    safetensors_torch.save_file(sd, str(path), metadata={"format": "pt"})


def test_multi_token_prediction_layers_load_beside_the_model(tmp_path: Path) -> None:
    """A checkpoint with its MTP layer (``layers.{num_hidden_layers}``): transformers' model drops it;
    the converter loads it as the model's ``mtp`` and the model's logits stay transformers'
    (tests/models/test_mtp.py checks the MTP layer's own logits); a malformed one is refused
    naming its keys; a type whose MTP layers transformers never reads (GLM-4-MoE-Lite) drops them."""
    hf = checks.hf_model(_v3())
    hf.save_pretrained(tmp_path / "v3")
    four = checks.hf_model(_v3(num_hidden_layers=4)).state_dict()
    C = _v3().hidden_size

    def add_mtp(sd: dict[str, torch.Tensor]) -> None:
        sd.update({k: v.contiguous() for k, v in four.items() if k.startswith("model.layers.3.")})
        sd.update({f"model.layers.3.{n}.weight": torch.ones(C) for n in ("enorm", "hnorm", "shared_head.norm")})
        sd["model.layers.3.eh_proj.weight"] = torch.randn(C, 2 * C)
        sd["model.layers.3.shared_head.head.weight"] = sd["lm_head.weight"].clone()

    _rewrite_weights(tmp_path / "v3", add_mtp)
    x = checks.tokens(9)
    model = load_pretrained(tmp_path / "v3")
    assert model.mtp is not None and model.mtp.depth == 1
    with torch.no_grad():
        assert checks.rel(model(x), hf(input_ids=x).logits) <= checks.TOL
    _rewrite_weights(tmp_path / "v3", lambda sd: sd.__setitem__("model.layers.3.eh_proj.weight", torch.ones(3, 3)))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.3\.eh_proj\.weight: checkpoint shape \(3, 3\) vs attnzoo "
                                              r"mtp\.layers\.0\.eh_proj\.weight"):
        load_pretrained(tmp_path / "v3")
    lite = checks.hf_model(_glm_lite())
    lite.save_pretrained(tmp_path / "lite")
    depth = lite.config.num_hidden_layers
    _rewrite_weights(tmp_path / "lite", lambda sd: sd.update(
        {f"model.layers.{depth}.{n}": torch.ones(3, 3) for n in ("eh_proj.weight", "enorm.weight")}))
    model = load_pretrained(tmp_path / "lite")
    assert model.mtp is None
    with torch.no_grad():
        assert checks.rel(model(x), lite(input_ids=x).logits) <= checks.TOL


def _v3_json() -> Any:
    """V3 with its defaults where the test leaves keys out (16 experts: the default 8 groups of 2)."""
    return _v3(n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1,
               n_routed_experts=16)


def _glm_json() -> Any:
    """GLM-4-MoE-Lite with its default layer kinds (a dense first layer, then sparse)."""
    return _glm_lite(mlp_layer_types=["dense", "sparse", "sparse", "sparse"])


@pytest.mark.parametrize("make,keys", [
    (_v3_json, ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "rope_interleave",
                "attention_bias", "rms_norm_eps", "n_shared_experts", "hidden_act", "tie_word_embeddings")),
    (_v2, ("topk_method", "routed_scaling_factor", "mlp_bias", "attention_bias", "rms_norm_eps", "hidden_act",
           "n_group", "topk_group")),
    (_glm_json, ("mlp_layer_types", "rms_norm_eps", "routed_scaling_factor", "norm_topk_prob", "rope_interleave",
                 "n_shared_experts", "hidden_act")),
    (_m4, ("routed_scaling_factor", "norm_topk_prob", "rope_interleave", "rms_norm_eps", "hidden_act",
           "n_shared_experts")),
    (_cpm5, ("routed_scaling_factor", "norm_topk_prob", "rms_norm_eps", "rope_parameters", "n_shared_experts",
             "attention_bias")),
], ids=["v3", "v2", "glm4_moe_lite", "mistral4", "minicpm5"])
def test_config_json_with_keys_left_out(tmp_path: Path, make: Any, keys: tuple[str, ...]) -> None:
    """Keys left out of ``config.json`` read as the config classes' defaults (as ``from_pretrained``)."""
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


@pytest.mark.parametrize("model,make,key,value,named", [
    ("v3", _v3, "hidden_act", "gelu", "hidden_act"),
    ("v3", _v3, "pretraining_tp", 2, "pretraining_tp"),
    ("v3", _v3, "rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "dynamic"),
    ("v3", _v3, "moe_layer_freq", 2, "moe_layer_freq"),
    ("v2", _v2, "topk_method", "noaux_tc", "topk_method"),
    ("v2", _v2, "num_key_value_heads", 2, "num_key_value_heads"),
    ("v3", _v3, "n_group", 8, "n_group=8"),
    ("v3", _v3, "n_group", 3, "n_group=3"),
    ("m4", _m4, "rope_parameters", {**YARN, "partial_rotary_factor": 0.25}, "partial_rotary_factor"),
    ("cpm5", _cpm5, "attention_bias", True, "attention_bias"),
    ("cpm5", _cpm5, "rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
])
def test_unsupported_options_are_refused(model: str, make: Any, key: str, value: Any, named: str) -> None:
    cls = {"v3": T.DeepseekV3ForCausalLM, "v2": T.DeepseekV2ForCausalLM, "m4": T.Mistral4ForCausalLM,
           "cpm5": T.MiniCPM5MoeForCausalLM}[model]
    checks.check_refused(cls, make, key, value, named)
