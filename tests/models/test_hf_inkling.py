"""Inkling (``InklingForCausalLM`` / ``InklingTextModel``) through ``from_hf``: sliding and full GQA
layers without RoPE, residual short convolutions on the keys, values and both sub-layers' outputs,
hidden-state-conditioned relative-position logits (a ``score_mod``), logarithmic query scaling,
dense SwiGLU and sink-routed MoE layers, a normed embedding, the muP head with a padded vocabulary;
equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

S, F = "hybrid_sliding", "hybrid"


def _config(**kw: Any) -> Any:
    """4 layers sliding / full / sliding / full (``local_layer_ids``), window 8 and relative extent
    12 (< the 30 tokens tested), logarithmic scaling from position 4, dense / sparse / sparse /
    dense feed-forwards, 4 experts top-2 with 2 shared, every scale away from 1."""
    return T.InklingTextConfig(**{
        **checks.SMALL, "num_hidden_layers": 4, "head_dim": 16, "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2, "swa_head_dim": 16, "sliding_window_size": 8, "rel_extent": 12,
        "local_layer_ids": [0, 2], "mlp_layer_types": ["dense", "sparse", "sparse", "dense"],
        "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 2,
        "log_scaling_n_floor": 4, "log_scaling_alpha": 0.3, "route_scale": 2.5, "logits_mup_width_multiplier": 3.0,
        **kw})


def _other(**kw: Any) -> Any:
    """3 layers full / sliding / full given as ``layer_types``; full layers MQA with head_dim 24 (!=
    hidden / heads), sliding ones 8 heads of 8 over 4 key/value heads, window 5, kernel 3, d_rel 5,
    relative extent 40 (> the tokens), no logarithmic scaling, every layer sparse (3 experts top-1, 1
    shared), a vocabulary of 136 whose head keeps 128 (``unpadded_vocab_size``), ``tie_word_embeddings``
    (transformers never ties Inkling's head), eps 1e-3."""
    return _config(**{"num_hidden_layers": 3, "layer_types": [F, S, F], "local_layer_ids": None,
                      "num_key_value_heads": 1, "head_dim": 24, "swa_num_attention_heads": 8,
                      "swa_num_key_value_heads": 4, "swa_head_dim": 8, "sliding_window_size": 5, "rel_extent": 40,
                      "conv_kernel_size": 3, "d_rel": 5, "log_scaling_n_floor": None,
                      "mlp_layer_types": ["sparse"] * 3, "n_routed_experts": 3, "num_experts_per_tok": 1,
                      "n_shared_experts": 1, "vocab_size": 136, "unpadded_vocab_size": checks.V,
                      "tie_word_embeddings": True, "rms_norm_eps": 1e-3, "route_scale": 0.7,
                      "logits_mup_width_multiplier": 0.5, **kw})


def _six(**kw: Any) -> Any:
    """6 layers with transformers' default pattern (sliding except layer 5) and the first two dense
    (``dense_mlp_idx``), window 6, scaling from position 2 (alpha 1), 4 experts top-3, 1 shared."""
    return _config(**{"num_hidden_layers": 6, "local_layer_ids": None, "mlp_layer_types": None, "dense_mlp_idx": 2,
                      "sliding_window_size": 6, "rel_extent": 20, "log_scaling_n_floor": 2,
                      "log_scaling_alpha": 1.0, "num_experts_per_tok": 3, "n_shared_experts": 1, **kw})


class TestInkling(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_six, _other)


def test_structure() -> None:
    from attnzoo.models.families.inkling import InklingAttention, InklingLayer
    from attnzoo.models.families.minimax import NormedEmbedding
    from attnzoo.nn.moe import MixtureOfExperts

    hf = checks.hf_model(_other())
    ours = from_hf(hf)
    hf_params = sum(p.numel() for p in hf.parameters())
    # our head keeps the 128 logits transformers returns (not its 136 rows); the router's and the
    # MLPs' global scales are folded
    assert sum(p.numel() for p in ours.parameters()) == hf_params - (136 - 128) * 64 - 3
    assert all(isinstance(b, InklingLayer) and isinstance(b.attn, InklingAttention) for b in ours.blocks)
    assert isinstance(ours.tok_emb, NormedEmbedding) and tuple(ours.tok_emb.weight.shape) == (136, 64)
    assert ours.vocab_size == 128 and tuple(ours.lm_head.weight.shape) == (128, 64) and not ours.tie_embeddings
    full, sliding = ours.blocks[0].attn, ours.blocks[1].attn
    assert (full.num_heads, full.num_kv_heads, full.head_dim, full.window, full.rel_extent) == (4, 1, 24, None, 40)
    assert (sliding.num_heads, sliding.num_kv_heads, sliding.head_dim, sliding.window) == (8, 4, 8, (4, 0))
    assert sliding.rel_extent == 5 and full.log_scaling is None and full.scale == 1 / 24
    assert full.k_conv.weight.shape == (24, 1, 3) and ours.blocks[0].ffn_conv.weight.shape == (64, 1, 3)
    moe = ours.blocks[0].ffn
    assert isinstance(moe, MixtureOfExperts) and (moe.num_experts, moe.top_k) == (4, 2)
    assert torch.isinf(moe.score_bias[3]) and torch.isfinite(moe.score_bias[:3]).all()
    six = from_hf(checks.hf_model(_six()))
    assert [b.attn.window is None for b in six.blocks] == [False] * 5 + [True]
    assert [isinstance(b.ffn, MixtureOfExperts) for b in six.blocks] == [False, False] + [True] * 4
    assert six.blocks[5].attn.log_scaling == (2.0, 1.0) and six.blocks[0].attn.log_scaling is None


def test_chunked_prefill_through_the_sliding_cache_equals_the_full_forward() -> None:
    """Several tokens at a time after a filled cache (past the window): the held keys' rows of the
    relative table and the convolutions' inputs continue exactly."""
    ours = from_hf(checks.hf_model(_config()))
    x = checks.tokens(29)
    with torch.no_grad():
        full = ours(x)
        cache = ours.init_cache(2, 29)
        steps = [ours(x[:, a:b], cache=cache) for a, b in ((0, 11), (11, 14), (14, 15), (15, 24), (24, 29))]
    assert checks.rel(torch.cat(steps, dim=1), full) <= checks.TOL


def test_generation_with_cache_crossing_the_window_equals_transformers() -> None:
    """A longer greedy continuation (prompt 9, 14 new): both windows and the relative extent are crossed."""
    hf = checks.hf_model(_other())
    ours = from_hf(hf)
    x = checks.tokens(9, batch=1)
    expected = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=14, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.generate(x, 14), expected)


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """6 layers; a ``config.json`` that leaves out ``InklingTextConfig``'s defaults (``layer_types`` derived by
    transformers' rule without ``local_layer_ids``: sliding unless the index plus one is a multiple
    of 6; every layer sparse, kernel 4, d_rel 16, SiLU, eps 1e-6, route scale 8,
    multiplier 24, alpha 0.1, the sink router): read as transformers reads it."""
    hf = checks.hf_model(_config(num_hidden_layers=6, local_layer_ids=None, mlp_layer_types=None, conv_kernel_size=4, d_rel=16, rms_norm_eps=1e-6,
                                 route_scale=8.0, logits_mup_width_multiplier=24.0, log_scaling_alpha=0.1))
    checks.check_folder_without_keys(hf, tmp_path, (
        "layer_types", "local_layer_ids", "mlp_layer_types", "conv_kernel_size", "d_rel", "hidden_act", "rms_norm_eps", "route_scale",
        "logits_mup_width_multiplier", "log_scaling_alpha", "shared_expert_sink", "attention_dropout",
        "unpadded_vocab_size", "tie_word_embeddings"))


def test_aliases_and_legacy_keys_load(tmp_path: Path) -> None:
    """Checkpoint spellings transformers maps (``layer_types`` from ``local_layer_ids``,
    ``sconv_kernel_size``, ``sliding_window``,
    ``num_local_experts``, ``embedding_multiplier``; ``dense_intermediate_size`` with the experts'
    width under ``intermediate_size``; ``dense_mlp_idx``) read as transformers reads them."""
    hf = checks.hf_model(_config(mlp_layer_types=["dense", "sparse", "sparse", "sparse"]))
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    for key, alias in (("conv_kernel_size", "sconv_kernel_size"), ("sliding_window_size", "sliding_window"),
                       ("n_routed_experts", "num_local_experts"),
                       ("logits_mup_width_multiplier", "embedding_multiplier")):
        data[alias] = data.pop(key)
    data["dense_intermediate_size"] = data["intermediate_size"]
    data["intermediate_size"] = data.pop("moe_intermediate_size")
    data["dense_mlp_idx"] = 1
    del data["mlp_layer_types"], data["layer_types"]
    path.write_text(json.dumps(data))
    model = load_pretrained(tmp_path)
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = checks.tokens(14)
    with torch.no_grad():
        assert checks.rel(model(x), again(input_ids=x).logits) <= checks.TOL


def test_multi_token_prediction_weights_are_ignored() -> None:
    """A checkpoint's ``model.mtp.*`` tensors (transformers ignores them on load) load and change nothing."""
    from attnzoo.models.families.inkling import convert_inkling
    from attnzoo.models.hf._state import HFConfig

    hf = checks.hf_model(_config(num_mtp_layers=1))
    sd = {**hf.state_dict(), "model.mtp.0.eh_proj.weight": torch.ones(64, 128)}
    model = convert_inkling(HFConfig(hf.config.to_dict(), "test", "Inkling"), sd, device=None, dtype=None)
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(model(x), hf(input_ids=x).logits) <= checks.TOL


def test_the_multimodal_model_is_not_converted(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "inkling_mm_model",
                                                      "architectures": ["InklingForConditionalGeneration"]}))
    with pytest.raises(ValueError, match="inkling_mm_model"):
        load_pretrained(tmp_path)


def test_bfloat16_runs() -> None:
    ours = from_hf(checks.hf_model(_config())).to(torch.bfloat16)
    assert ours.blocks[1].ffn.score_bias.dtype == torch.float32
    assert torch.isfinite(ours(checks.tokens(12)).float()).all()


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hidden_act", "gelu", "hidden_act"),
    ("shared_expert_sink", False, "shared_expert_sink"),
    ("n_shared_experts", 0, "n_shared_experts"),
    ("layer_types", [S, "full_attention", S, F], "full_attention"),
    ("mlp_layer_types", ["dense", "moe", "sparse", "dense"], "moe"),
    ("logits_mup_width_multiplier", 0.0, "logits_mup_width_multiplier"),
    ("log_scaling_n_floor", 0, "log_scaling_n_floor"),
    ("route_scale", float("inf"), "route_scale"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.InklingForCausalLM, _config, key, value, named)


def test_packed_sequences_equal_each_alone() -> None:
    """transformers' eager Inkling takes no packed sequences (its relative positions and log scaling
    read the packed stream's index): ours alone are compared, on both layer kinds."""
    checks.check_packed_equals_each_alone(_config, lengths=(5, 13, 1, 9))
    checks.check_packed_equals_each_alone(_other)


def test_packed_training_gradients_equal_each_alone() -> None:
    """float64; the relative table's gradients come back through the tiled backward of the score_mod."""
    checks.check_packed_gradients_equal_each_alone(_config)


def test_training_gradients_through_the_tiled_score_mod_equal_the_dense_reference() -> None:
    """float64, 90 tokens (several tiles): the tiled backend's backward of the relative logits (and of
    everything else) equals autograd through the dense reference backend."""
    ours = from_hf(checks.hf_model(_config())).double().train()
    x = checks.tokens(90)

    def grads(backend: str) -> tuple[torch.Tensor, ...]:
        for block in ours.blocks:
            block.attn.backend = backend
        return torch.autograd.grad(ours(x).square().mean(), list(ours.parameters()))

    tiled, dense = grads("tiled"), grads("reference")
    assert max(checks.rel(g, w) for g, w in zip(tiled, dense, strict=True) if w.abs().max() > 0) <= 1e-9
