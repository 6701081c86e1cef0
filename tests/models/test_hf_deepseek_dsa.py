"""DeepSeek-V3.2 and GLM-MoE-DSA (DeepSeek sparse attention), and A.X-K1 (DeepSeek-V3 with a normed
MoE output, the base of their attention) through ``from_hf``: DeepSeek-V3's latent attention
restricted per query to the ``index_topk`` keys a lightning indexer selects (split-half RoPE in
V3.2's indexer, interleaved pairs in GLM's), DeepSeek-V3's MoE after ``mlp_layer_types``; equal to
transformers' eager (see ``hf_family_checks``) with ``index_topk`` below the tested lengths so the
selection matters; at exact top-k ties the cached decode follows transformers' cached decode;
packed sequences (one at a time) and their float64 gradients equal to each sequence alone;
refusals by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

safetensors_torch = pytest.importorskip("safetensors.torch")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.deepseek import IndexedLatentAttention, LightningTopK, PostNormMoE  # noqa: E402
from attnzoo.models.hf.errors import UnsupportedConfigError  # noqa: E402
from attnzoo.nn.moe import MixtureOfExperts  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
_SIZES = dict(num_key_value_heads=4, num_hidden_layers=3, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=24,
              index_head_dim=16, index_n_heads=4, index_topk=5)


def _v32(**kw: Any) -> Any:
    """DeepSeek-V3.2: 3 layers (dense, then MoE: 8 experts in 4 groups, the best 2), each query
    attending its 5 best keys of a 4-head indexer."""
    return T.DeepseekV32Config(**{**checks.SMALL, **_SIZES, "first_k_dense_replace": 1, "n_group": 4,
                                  "topk_group": 2, "routed_scaling_factor": 2.0, **kw})


def _v32_yarn() -> Any:
    """YaRN, attention biases, explicit layer kinds (sparse, dense, sparse, sparse), two shared
    experts, unnormalised weights, a tied head, a wider indexer (8 heads of 24) keeping 7 keys."""
    return _v32(rope_parameters=YARN, attention_bias=True, num_hidden_layers=4,
                mlp_layer_types=["sparse", "dense", "sparse", "sparse"], n_shared_experts=2, norm_topk_prob=False,
                tie_word_embeddings=True, index_n_heads=8, index_head_dim=24, index_topk=7)


def _glm(**kw: Any) -> Any:
    """GLM-MoE-DSA: 3 layers (dense, then MoE: 8 experts, one group), interleaved indexer RoPE."""
    return T.GlmMoeDsaConfig(**{**checks.SMALL, **_SIZES, "first_k_dense_replace": 1, **kw})


def _glm_yarn() -> Any:
    """GLM-MoE-DSA with YaRN, 2 groups (the best 1), a 2-head indexer keeping 4 keys."""
    return _glm(rope_parameters=YARN, n_group=2, topk_group=1, index_n_heads=2, index_topk=4)


def _glm_wide() -> Any:
    """GLM-MoE-DSA with a 16-head indexer: no exact ties at the top-k cut on the tested tokens."""
    return _glm(index_n_heads=16)


def _axk1(**kw: Any) -> Any:
    """A.X-K1: 3 layers (dense, then MoE with 8 experts in 4 groups, the best 2, and a normed output)."""
    sizes = {k: v for k, v in _SIZES.items() if not k.startswith("index_")}
    return T.AXK1Config(**{**checks.SMALL, **sizes, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.0,
                           **kw})


def _axk1_yarn() -> Any:
    """YaRN, split-half RoPE, attention biases, explicit kinds (sparse, dense, sparse, sparse), a tied head."""
    return _axk1(rope_parameters=YARN, rope_interleave=False, attention_bias=True, num_hidden_layers=4,
                 mlp_layer_types=["sparse", "dense", "sparse", "sparse"], tie_word_embeddings=True,
                 norm_topk_prob=False)


class TestAXK1(checks.FamilyChecks):
    config = staticmethod(_axk1)
    cases = (_axk1_yarn,)


class TestDeepseekV32(checks.FamilyChecks):
    config = staticmethod(_v32)
    cases = (_v32_yarn,)  # 8 index heads: no tie at the cut, so the cached decode equals the full forward


class TestGlmMoeDsa(checks.FamilyChecks):
    config = staticmethod(_glm)
    cases = (_glm_yarn,)

    def test_cached_decode_equals_full_forward(self) -> None:
        checks.check_cached_decode(_glm_wide)


def _decode(model: Any, x: torch.Tensor, prefill: int, hf: bool) -> torch.Tensor:
    """Logits of a prefill then one token at a time through the cache (transformers' or attnzoo's)."""
    if hf:
        cache = T.DynamicCache(config=model.config)
        step = [model(input_ids=x[:, :prefill], cache=cache, use_cache=True).logits]
        step += [model(input_ids=x[:, t:t + 1], cache=cache, use_cache=True).logits
                 for t in range(prefill, x.shape[1])]
    else:
        cache = model.init_cache(x.shape[0], x.shape[1])
        step = [model(x[:, :prefill], cache=cache)]
        step += [model(x[:, t:t + 1], cache=cache) for t in range(prefill, x.shape[1])]
    return torch.cat(step, dim=1)


@pytest.mark.parametrize("make", [_v32, _glm_yarn], ids=["v32", "glm_moe_dsa"])
def test_cached_decode_follows_transformers_at_ties(make: Any) -> None:
    """With few index heads many keys score exactly 0 after the ReLU and tie at the top-k cut;
    ``torch.topk`` breaks such ties differently over a query's row in the full forward and in a
    decode step, so transformers' own cached decode differs from its full forward (measured: 0.18
    and 0.66 relative). attnzoo follows transformers in both: its full forward equals
    transformers' full forward, its cached decode transformers' cached decode."""
    check_decode_at_ties(make)


def check_decode_at_ties(make: Any) -> None:
    """The check of :func:`test_cached_decode_follows_transformers_at_ties` for the config ``make()``."""
    hf = checks.hf_model(make())
    ours, x = from_hf(hf), checks.tokens(20)
    with torch.no_grad():
        theirs_full, theirs_decode = hf(input_ids=x).logits, _decode(hf, x, 7, hf=True)
        assert checks.rel(theirs_decode, theirs_full) > 1e-2  # the ties matter here
        assert checks.rel(ours(x), theirs_full) <= checks.TOL
        assert checks.rel(_decode(ours, x, 7, hf=False), theirs_decode) <= checks.TOL


def test_layer_structure() -> None:
    ours = from_hf(checks.hf_model(_v32_yarn()))
    assert all(type(b.attn) is IndexedLatentAttention for b in ours.blocks)
    assert [isinstance(b.ffn, MixtureOfExperts) for b in ours.blocks] == [True, False, True, True]
    indexer = ours.blocks[0].attn.indexer
    assert isinstance(indexer, LightningTopK) and not indexer.interleaved
    assert (indexer.heads, indexer.head_dim, indexer.topk) == (8, 24, 7)
    assert ours.blocks[0].attn.rope.interleaved and ours.lm_head.weight is ours.tok_emb.weight
    assert ours.blocks[0].ffn.router.weight.dtype == torch.float32
    glm = from_hf(checks.hf_model(_glm_yarn()))
    assert glm.blocks[0].attn.indexer.interleaved and glm.blocks[1].ffn.groups == 2
    assert glm.blocks[0].attn_norm.eps == 1e-5
    ax = from_hf(checks.hf_model(_axk1_yarn()))
    assert [type(b.ffn) is PostNormMoE for b in ax.blocks] == [True, False, True, True]
    assert type(ax.blocks[0].attn).__name__ == "MultiHeadLatentAttention" and not ax.blocks[0].attn.rope.interleaved


def test_axk1_checkpoint_names_and_legacy_keys(tmp_path: Path) -> None:
    """A.X-K1's released layout: the MoE output norm on the layer (``layers.{i}.post_mlp_layernorm``,
    also stored, unused, on the dense layers), no ``e_score_correction_bias`` (routing without one:
    0), and ``first_k_dense_replace`` / ``moe_layer_freq`` instead of ``mlp_layer_types``."""
    hf = checks.hf_model(_axk1(num_hidden_layers=4, mlp_layer_types=["dense", "dense", "sparse", "dense"]))
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.zero_()
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    sd = dict(safetensors_torch.load_file(str(path)))
    for key in [k for k in sd if "e_score_correction_bias" in k]:
        del sd[key]
    for key in [k for k in sd if ".mlp.post_mlp_layernorm." in k]:
        sd[key.replace(".mlp.post_mlp_layernorm.", ".post_mlp_layernorm.")] = sd.pop(key)
    sd["model.layers.0.post_mlp_layernorm.weight"] = torch.ones(64)
    safetensors_torch.save_file(sd, str(path), metadata={"format": "pt"})
    data = json.loads((tmp_path / "config.json").read_text())
    data.pop("mlp_layer_types")
    data.update(first_k_dense_replace=1, moe_layer_freq=2)  # sparse at 2 only
    (tmp_path / "config.json").write_text(json.dumps(data))
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).logits) <= checks.TOL


def test_selection_matters() -> None:
    """The sparse selection changes the output: the indexer keeping every key differs."""
    x = checks.tokens(20)
    with torch.no_grad():
        sparse = from_hf(checks.hf_model(_v32()))(x)
        dense = checks.hf_model(_v32(index_topk=64))(input_ids=x).logits  # the same weights, every key kept
    assert checks.rel(sparse, dense) > 1e-3


def test_half_precision_keeps_router_float32() -> None:
    """``_keep_in_fp32_modules_strict``: the MoE routers' ``gate.weight`` stays float32 in bfloat16;
    ``_keep_in_fp32_modules``: the indexer's ``weights_proj`` float32 in float16 (as transformers' loads)."""
    ours = from_hf(checks.hf_model(_v32()), dtype=torch.bfloat16)
    assert ours.blocks[1].ffn.router.weight.dtype == torch.float32
    assert ours.blocks[1].attn.indexer.wk.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.isfinite(ours(checks.tokens(9)).float()).all()
    fp16 = from_hf(checks.hf_model(_v32()), dtype=torch.float16)  # transformers' _keep_in_fp32_modules
    assert fp16.blocks[1].attn.indexer.weights_proj.weight.dtype == torch.float32
    assert fp16.blocks[1].attn.indexer.wk.weight.dtype == torch.float16


@pytest.mark.parametrize("make", [_v32, _glm_yarn, _axk1_yarn], ids=["v32", "glm_moe_dsa", "axk1"])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    checks.check_packed_equals_each_alone(make)


def test_axk1_packed_gradients_equal_each_alone() -> None:
    checks.check_packed_gradients_equal_each_alone(_axk1_yarn)


def test_packed_gradients_equal_each_alone() -> None:
    """Float64 training: the gradients of a packed batch equal the sequences' one at a time; the
    indexers' weights get none (their top-k selection is discrete, as in transformers)."""
    checks.check_packed_gradients_equal_each_alone(_v32_yarn, no_gradient=".indexer.")


@pytest.mark.parametrize("make,keys", [
    (lambda: _v32(n_group=8, topk_group=4, routed_scaling_factor=2.5, n_routed_experts=16, first_k_dense_replace=3,
                  num_hidden_layers=4),
     ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "attention_bias", "rms_norm_eps",
      "n_shared_experts", "hidden_act", "tie_word_embeddings", "mlp_layer_types", "first_k_dense_replace")),
    (lambda: _glm(first_k_dense_replace=3, num_hidden_layers=4),
     ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "rms_norm_eps", "mlp_layer_types",
      "first_k_dense_replace", "indexer_types", "hidden_act")),
    (lambda: _axk1(n_group=8, topk_group=4, routed_scaling_factor=2.5, n_routed_experts=16),
     ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "rope_interleave", "attention_bias",
      "rms_norm_eps", "n_shared_experts", "hidden_act", "tie_word_embeddings", "mlp_layer_types")),
], ids=["v32", "glm_moe_dsa", "axk1"])
def test_config_json_with_keys_left_out(tmp_path: Path, make: Any, keys: tuple[str, ...]) -> None:
    """Keys left out of ``config.json`` read as the config classes' defaults (as ``from_pretrained``)."""
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


def test_stray_rope_interleave_is_ignored(tmp_path: Path) -> None:
    """A ``config.json`` saying ``rope_interleave: false``: DeepSeek-V3.2's attention rotates
    interleaved pairs regardless (its config has no such field), so does the converter."""
    hf = checks.hf_model(_v32())
    hf.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "rope_interleave": False}))
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).logits) <= checks.TOL


@pytest.mark.parametrize("make,drop,change,named", [
    (_glm, "indexer_types", {"index_topk_freq": 2, "index_skip_topk_offset": 1}, "indexer_types"),
    (_glm, "indexer_types", {"index_topk_pattern": "FSF"}, "shared"),
    (_v32, None, {"q_lora_rank": None}, "q_lora_rank"),
    (_axk1, None, {"q_lora_rank": None}, "q_lora_rank"),
], ids=["glm-freq", "glm-pattern", "v32-q_lora_rank", "axk1-q_lora_rank"])
def test_config_json_options_are_refused(tmp_path: Path, make: Any, drop: str | None, change: dict[str, Any],
                                         named: str) -> None:
    """What only a ``config.json`` can say: GLM-MoE-DSA's ``index_topk_freq`` / ``index_topk_pattern``
    instead of ``indexer_types`` (``GlmMoeDsaConfig`` derives shared layers from them), a null
    ``q_lora_rank`` (transformers' strict config rejects it): refused by name."""
    checks.hf_model(make()).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data.pop(drop, None)
    data.update(change)
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(UnsupportedConfigError, match=named):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("model,make,key,value,named", [
    ("v32", _v32, "index_head_dim", 4, "index_head_dim"),
    ("v32", _v32, "hidden_act", "gelu", "hidden_act"),
    ("v32", _v32, "num_key_value_heads", 2, "num_key_value_heads"),
    ("v32", _v32, "rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "dynamic"),
    ("glm", _glm, "indexer_types", ["full", "shared", "full"], "indexer_types"),
    ("glm", _glm, "indexer_types", ["full", "full", "shared"], "shared"),
    ("axk1", _axk1, "hidden_act", "gelu", "hidden_act"),
    ("axk1", _axk1, "pretraining_tp", 2, "pretraining_tp"),
    ("axk1", _axk1, "num_key_value_heads", 2, "num_key_value_heads"),
])
def test_unsupported_options_are_refused(model: str, make: Any, key: str, value: Any, named: str) -> None:
    cls = {"v32": T.DeepseekV32ForCausalLM, "glm": T.GlmMoeDsaForCausalLM, "axk1": T.AXK1ForCausalLM}[model]
    checks.check_refused(cls, make, key, value, named)
