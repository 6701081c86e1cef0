"""The fourth batch of sparse-MoE decoders through ``from_hf`` (``families/sparse_moe.py``):
GraniteMoeShared (GraniteMoE's multipliers and experts plus an always-on shared MLP), FlexOlmo
(OLMoE's attention and experts on OLMo 2's output norms), Param2-MoE and Sarvam-MoE (transformers'
GLM-4.5 model under their own configs: full rotation, QK norms by default). Equal to transformers'
eager (see ``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_hf_dense_2 as dense2  # noqa: E402

import hf_family_checks as checks  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")


def _granitemoeshared(**kw: Any) -> Any:
    """2 layers, 4 experts top-2, a shared MLP of 40, every multiplier away from 1, untied."""
    return T.GraniteMoeSharedConfig(**{**checks.SMALL, "num_hidden_layers": 2, "num_local_experts": 4,
                                       "num_experts_per_tok": 2, "shared_intermediate_size": 40,
                                       "embedding_multiplier": 2.0, "attention_multiplier": 0.3,
                                       "residual_multiplier": 0.5, "logits_scaling": 4.0, **kw})


def _granitemoeshared_other(**kw: Any) -> Any:
    """No shared MLP (``shared_intermediate_size`` 0, the default), q/k/v/o biases, top-1 of 3, head_dim 24, tied."""
    return _granitemoeshared(**{"shared_intermediate_size": 0, "attention_bias": True, "num_local_experts": 3,
                                "num_experts_per_tok": 1, "head_dim": 24, "tie_word_embeddings": True, **kw})


def _flex_olmo(**kw: Any) -> Any:
    """3 layers, QK norms over all heads, output norms, 5 experts top-2 (not renormalised)."""
    return T.FlexOlmoConfig(**{**checks.SMALL, "num_hidden_layers": 3, "num_experts": 5, "num_experts_per_tok": 2,
                               **kw})


def _flex_olmo_other(**kw: Any) -> Any:
    """Renormalised top-3 of 4, attention biases, 4 key/value heads (= query heads), tied, theta 1e4."""
    return _flex_olmo(**{"num_experts": 4, "num_experts_per_tok": 3, "norm_topk_prob": True, "attention_bias": True,
                         "num_key_value_heads": 4, "tie_word_embeddings": True,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **kw})


def _param2(**kw: Any) -> Any:
    """4 layers (the first dense), 8 experts in 2 groups, top-2 of the best group, 2 shared experts,
    per-head QK norms (the default), full rotation (the default), routed scaling 2.5, head_dim 16, tied."""
    return T.Param2MoeConfig(**{**checks.SMALL, "num_hidden_layers": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1, "head_dim": 16, **kw})


def _param2_other(**kw: Any) -> Any:
    """q/k/v biases, no QK norms, two dense layers, not renormalised, one shared expert, a rotary on
    half of each head, head_dim 24, untied."""
    return _param2(**{"attention_bias": True, "use_qk_norm": False, "first_k_dense_replace": 2,
                      "norm_topk_prob": False, "n_shared_experts": 1, "n_group": 1, "num_experts_per_tok": 3,
                      "head_dim": 24, "tie_word_embeddings": False,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                      **kw})


def _sarvam(**kw: Any) -> Any:
    """3 layers (the first dense), 6 experts top-2, one shared expert, per-head QK norms, full
    rotation, head_dim 16, untied (the defaults)."""
    return T.SarvamMoEConfig(**{**checks.SMALL, "num_hidden_layers": 3, "n_routed_experts": 6,
                                "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16, **kw})


def _sarvam_other(**kw: Any) -> Any:
    """q/k/v biases, routed scaling 1.0, 2 shared experts, tied, head_dim 24."""
    return _sarvam(**{"attention_bias": True, "routed_scaling_factor": 1.0, "n_shared_experts": 2,
                      "tie_word_embeddings": True, "head_dim": 24, **kw})


#: Kolibri 1.1's small indexer: more than 4 + 4 + 2 keys select, more than 8 pool (blocks of 4)
INDEX = {"index_topk": 4, "index_pool_size": 8, "index_compression": 4, "index_num_heads": 2,
         "index_num_local_tokens": 4, "index_num_sink_tokens": 2}
K11_TYPES = ["sliding_attention", "indexed_attention", "indexed_attention", "sliding_attention", "indexed_attention",
             "indexed_attention"]


def _kolibri11(**kw: Any) -> Any:
    """6 layers: sliding 0, 3 (window 6); indexed 1, 2, 4, 5 with indexers 1 and 4, layers 2 and 5
    reading layer 1's keys and values (5 with layer 4's pool); dense layers 0, 1 (the default), 6
    experts top-2 by logits + bias weighted by sigmoids, a shared expert of 40, head_dim 16."""
    return T.Kolibri1_1Config(**{**checks.SMALL, **INDEX, "num_hidden_layers": 6, "head_dim": 16, "num_experts": 6,
                                 "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                 "shared_expert_intermediate_size": 40, "sliding_window": 6,
                                 "mlp_only_intermediate_size": 48, "layer_types": K11_TYPES, "index_layers": [1, 4],
                                 "kv_source_layers": [0, 1, 1, 3, 4, 1], **kw})


def _kolibri11_other(**kw: Any) -> Any:
    """10 layers by the default layout (indexed 4 and 9, 9 reading 4's keys, one indexer), dense
    layer 2 only, top-3 renormalised, one scoring head, pools of 16 in blocks of 8, 3 + 2 + 1 selected,
    tied, theta 1e6."""
    return _kolibri11(**{"num_hidden_layers": 10, "layer_types": None, "index_layers": None, "kv_source_layers": None,
                         "mlp_only_layers": [2], "num_experts_per_tok": 3, "norm_topk_prob": True, "index_topk": 3,
                         "index_pool_size": 16, "index_compression": 8, "index_num_heads": 1,
                         "index_num_local_tokens": 2, "index_num_sink_tokens": 1, "tie_word_embeddings": True,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, **kw})


def _cohere2_moe(**kw: Any) -> Any:
    """4 layers: layer 0 dense (48 wide) and full with RoPE (the prefix pattern 1), then sliding / full
    / sliding by ``sliding_window_pattern`` 2 (window 6; interleaved RoPE on sliding layers, NoPE on
    full ones); 6 experts, the top-2 logits softmaxed, one shared expert averaged with them; bias-free
    LayerNorms, logit scale 0.3, tied, head_dim 16."""
    return T.Cohere2MoeConfig(**{**checks.SMALL, "num_hidden_layers": 4, "first_k_dense_replace": 1, "num_experts": 6,
                                 "num_experts_per_tok": 2, "num_shared_experts": 1, "sliding_window": 6,
                                 "sliding_window_pattern": 2, "prefix_dense_intermediate_size": 48, "head_dim": 16,
                                 "logit_scale": 0.3, **kw})


def _cohere2_moe_other(**kw: Any) -> Any:
    """Two dense layers (sliding, full: prefix pattern 2, so the full one is NoPE), sigmoid routing
    not renormalised, two shared experts summed, RMSNorms, q/k/v/o biases, untied, theta 1e6."""
    return _cohere2_moe(**{"first_k_dense_replace": 2, "prefix_dense_sliding_window_pattern": 2,
                           "expert_selection_fn": "sigmoid", "norm_topk_prob": False, "num_shared_experts": 2,
                           "shared_expert_combination_strategy": "sum", "rms_norm_eps": 1e-5, "attention_bias": True,
                           "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                           **kw})


def _dbrx(**kw: Any) -> Any:
    """3 layers, 4 heads over 2 KV heads, q/k/v clipped at 0.4 (the perturbed projections exceed it),
    4 experts top-2 renormalised to sum 1 (``moe_normalize_expert_weights`` 1), ffn 32, untied."""
    attn = {"kv_n_heads": 2, "clip_qkv": 0.4, "rope_theta": 10000.0, **kw.pop("attn_config", {})}  # read (unused)
    ffn = {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2, **kw.pop("ffn_config", {})}
    return T.DbrxConfig(**{"d_model": 64, "n_heads": 4, "n_layers": 3, "max_seq_len": 256, "vocab_size": checks.V,
                           "pad_token_id": 0, "attn_config": attn, "ffn_config": ffn, **kw})


def _dbrx_other(**kw: Any) -> Any:
    """A clip of 8 (the released checkpoints'; transformers cannot run without one: ``clamp(None, None)``),
    one KV head (MQA), top-3 of 5 divided by their 2-norm, theta 1e6."""
    return _dbrx(attn_config={"kv_n_heads": 1, "clip_qkv": 8.0},
                 ffn_config={"moe_num_experts": 5, "moe_top_k": 3, "moe_normalize_expert_weights": 2.0},
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **kw)


def _dbrx_unnormalised(**kw: Any) -> Any:
    """The top-2 softmax probabilities as they are (``moe_normalize_expert_weights`` null), 8 heads over 4."""
    return _dbrx(n_heads=8, attn_config={"kv_n_heads": 4}, ffn_config={"moe_normalize_expert_weights": None}, **kw)


def _dbrx_every_expert(**kw: Any) -> Any:
    """Every expert of 4 for every token (``moe_top_k`` 4): for the half-precision sweep, whose
    all-inclusive top-k does not reach DBRX's ``ffn_config``."""
    return _dbrx(ffn_config={"moe_top_k": 4}, **kw)


class TestDbrx(checks.FamilyChecks):
    config = staticmethod(_dbrx)
    cases = (_dbrx_unnormalised, _dbrx_other)


def _cohere2_moe_sigmoid(**kw: Any) -> Any:
    """Sigmoid routing renormalised (``norm_topk_prob`` True, the default), top-3, the shared expert averaged."""
    return _cohere2_moe(**{"expert_selection_fn": "sigmoid", "num_experts_per_tok": 3, **kw})


class TestCohere2Moe(checks.FamilyChecks):
    config = staticmethod(_cohere2_moe)
    cases = (_cohere2_moe_sigmoid, _cohere2_moe_other)


def _dory(**kw: Any) -> Any:
    """5 layers (sliding 0-2 and 4 with a window of 6, full 3: the default kinds): layer 0 once, layers
    1-3 twice (``per_loop`` caches), layer 4 once; head_dim 16, ``initializer_range`` 0.1 (the nGPT
    scales are ``s / initializer_range``: at the default 0.0177 the perturbed weights saturate every
    softmax)."""
    return T.DoryConfig(**{**checks.SMALL, "num_hidden_layers": 5, "head_dim": 16, "n_input_layers": 1,
                           "n_output_layers": 1, "sliding_window": 6, "initializer_range": 0.1, **kw})


def _dory_last_loop(**kw: Any) -> Any:
    """The recurrent layers' caches written by the last loop only (``last_loop``)."""
    return _dory(recurrent_kv_cache_mode="last_loop", **kw)


def _dory_other(**kw: Any) -> Any:
    """6 layers by explicit kinds (full 0 and 3), 2 + 2 + 2, three loops, q/k/v/o and MLP biases,
    GELU (tanh), tied, thetas 1e3 / 1e5, ``ngpt_alpha_init`` 0.3."""
    return _dory(**{"num_hidden_layers": 6, "n_input_layers": 2, "n_output_layers": 2, "n_recurrent_loops": 3,
                    "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention",
                                    "sliding_attention", "sliding_attention"],
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
                                        "full_attention": {"rope_type": "default", "rope_theta": 1e5}},
                    "attention_bias": True, "mlp_bias": True, "hidden_act": "gelu_pytorch_tanh",
                    "tie_word_embeddings": True, "ngpt_alpha_init": 0.3, **kw})


class TestDory(checks.FamilyChecks):
    """Dory scales its queries per channel after RoPE, so its logits depend on the absolute positions:
    compared at the positions ``generate`` gives a left-padded batch (``test_hf_dense_2``'s HunYuan check)."""

    config = staticmethod(_dory)
    cases = (_dory_last_loop, _dory_other)

    def test_logits_equal_transformers(self) -> None:
        for make in (self.config, *self.cases):
            dense2._check_mask_positions(make)

    def test_base_model_equals_transformers(self) -> None:
        for make in (self.config, *self.cases):
            dense2._check_mask_positions(make, T.AutoModel)


class TestKolibri11(checks.FamilyChecks):
    config = staticmethod(_kolibri11)
    cases = (_kolibri11_other,)


class TestGraniteMoeShared(checks.FamilyChecks):
    config = staticmethod(_granitemoeshared)
    cases = (_granitemoeshared_other,)


class TestFlexOlmo(checks.FamilyChecks):
    config = staticmethod(_flex_olmo)
    cases = (_flex_olmo_other,)


class TestParam2Moe(checks.FamilyChecks):
    config = staticmethod(_param2)
    cases = (_param2_other,)


class TestSarvamMoe(checks.FamilyChecks):
    config = staticmethod(_sarvam)
    cases = (_sarvam_other,)


def test_structure() -> None:
    from attnzoo.blocks import FeedForward
    from attnzoo.interop import from_hf
    from attnzoo.nn.moe import MixtureOfExperts

    hf = checks.hf_model(_granitemoeshared())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert all(type(b.ffn.shared_expert) is FeedForward and b.ffn.shared_gate is None for b in ours.blocks)
    assert all(b.ffn.shared_expert is None for b in from_hf(checks.hf_model(_granitemoeshared_other())).blocks)

    hf = checks.hf_model(_flex_olmo())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert all(type(b.attn_norm) is torch.nn.Identity and type(b.attn_out_norm) is not torch.nn.Identity
               and type(b.ffn_out_norm) is not torch.nn.Identity for b in ours.blocks)

    from attnzoo.models.families.sparse_moe import IndexedAttention, LogitBiasSigmoidMoE

    hf = checks.hf_model(_kolibri11())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    attns = [b.attn for b in ours.blocks]
    assert [type(a) is IndexedAttention for a in attns] == [False, True, True, False, True, True]
    assert [a.window for a in attns] == [(5, 5), None, None, (5, 5), None, None]
    assert [a.rope is not None for a in attns] == [True, False, False, True, False, False]
    assert [(a.source, a.reuses) for a in attns if isinstance(a, IndexedAttention)] == [
        (True, False), (False, True), (True, False), (False, True)]
    assert [type(b.ffn) for b in ours.blocks] == [FeedForward] * 2 + [LogitBiasSigmoidMoE] * 4
    other = from_hf(checks.hf_model(_kolibri11_other()))
    assert [i for i, b in enumerate(other.blocks) if isinstance(b.attn, IndexedAttention)] == [4, 9]
    assert other.blocks[4].attn.source and other.blocks[9].attn.reuses and not other.blocks[9].attn.source

    from attnzoo.nn.parallel import ParallelMixers

    hf = checks.hf_model(_cohere2_moe())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert all(type(b.attn) is ParallelMixers and b.ffn is None for b in ours.blocks)
    attns = [b.attn.mixers[0] for b in ours.blocks]
    assert [a.window for a in attns] == [None, (5, 5), None, (5, 5)]
    assert [a.rope is not None for a in attns] == [True, True, False, True] and attns[0].rope.interleaved
    assert [type(b.attn.mixers[1].module) for b in ours.blocks] == [FeedForward] + [MixtureOfExperts] * 3
    assert type(ours.norm) is torch.nn.LayerNorm and ours.norm.bias is None
    other = from_hf(checks.hf_model(_cohere2_moe_other()))
    assert [b.attn.mixers[0].rope is not None for b in other.blocks] == [True, False, True, False]
    assert type(other.blocks[3].attn.mixers[1].module) is LogitBiasSigmoidMoE and type(other.norm) is not torch.nn.LayerNorm

    from attnzoo.models.families.sparse_moe import ClippedAttention, NormalizedTopKMoE

    hf = checks.hf_model(_dbrx())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert all(type(b.attn) is ClippedAttention and b.attn.clip == 0.4 and b.attn.num_kv_heads == 2
               and type(b.ffn) is NormalizedTopKMoE and b.ffn.p == 1.0 for b in ours.blocks)
    assert type(ours.norm) is torch.nn.LayerNorm and ours.norm.bias is None and ours.norm.eps == 1e-5
    unclipped = from_hf(checks.hf_model(_dbrx(attn_config={"clip_qkv": None})))
    assert all(b.attn.clip is None for b in unclipped.blocks)

    from attnzoo.models.families.dory import DoryAttention, DoryLayer, DoryLM, L2Norm

    hf = checks.hf_model(_dory())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert type(ours) is DoryLM and ours.sections == (1, 3, 2) and not ours.last_loop and type(ours.norm) is L2Norm
    assert all(type(b) is DoryLayer and type(b.attn) is DoryAttention for b in ours.blocks)
    assert [b.uses for b in ours.blocks] == [1, 2, 2, 2, 1]
    assert [b.attn.window for b in ours.blocks] == [(5, 5)] * 3 + [None, (5, 5)]
    other = from_hf(checks.hf_model(_dory_other()))
    assert other.sections == (2, 2, 3) and [b.uses for b in other.blocks] == [1, 1, 3, 3, 1, 1]
    last = from_hf(checks.hf_model(_dory_last_loop()))
    assert last.last_loop and [b.uses for b in last.blocks] == [1] * 5

    for make in (_param2, _sarvam):
        hf = checks.hf_model(make())
        assert type(hf).__name__ == "Glm4MoeForCausalLM"
        ours = from_hf(hf)
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
        assert [type(b.ffn) for b in ours.blocks] == [FeedForward] + [MixtureOfExperts] * (len(ours.blocks) - 1)
        assert ours.blocks[0].attn.rope.rotary_dim == 16  # the whole head


@pytest.mark.parametrize(("make", "keys"), [
    (lambda: _granitemoeshared(num_key_value_heads=4, shared_intermediate_size=0),
     ("num_key_value_heads", "shared_intermediate_size", "attention_bias", "rms_norm_eps", "hidden_act")),
    (lambda: _flex_olmo(num_key_value_heads=4, num_experts=7, num_experts_per_tok=5),
     ("num_key_value_heads", "num_experts", "num_experts_per_tok", "norm_topk_prob", "attention_bias",
      "rope_parameters", "rms_norm_eps", "hidden_act")),
    (lambda: _param2(num_key_value_heads=8, num_attention_heads=8, n_routed_experts=64, num_experts_per_tok=6,
                     n_shared_experts=2, moe_intermediate_size=2048, n_group=1, hidden_size=32, head_dim=64,
                     rope_parameters=None),
     ("num_key_value_heads", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
      "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob", "use_qk_norm",
      "head_dim", "rms_norm_eps", "attention_bias", "tie_word_embeddings", "rope_parameters", "hidden_act")),
    (lambda: _sarvam(num_key_value_heads=4, n_routed_experts=128, num_experts_per_tok=6, n_shared_experts=1,
                     moe_intermediate_size=1024, hidden_size=32, num_attention_heads=4, head_dim=64,
                     rope_parameters=None),
     ("num_key_value_heads", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
      "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob", "use_qk_norm",
      "head_dim", "rms_norm_eps", "attention_bias", "tie_word_embeddings", "rope_parameters", "hidden_act")),
    (lambda: _cohere2_moe(first_k_dense_replace=0, num_attention_heads=4, num_key_value_heads=4, head_dim=128,
                          hidden_size=32, num_experts=8, num_shared_experts=0, sliding_window=4096, logit_scale=0.0625,
                          sliding_window_pattern=4),
     ("num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok", "num_shared_experts",
      "shared_expert_combination_strategy", "expert_selection_fn", "norm_topk_prob", "layer_types", "mlp_layer_types",
      "sliding_window", "sliding_window_pattern", "prefix_dense_sliding_window_pattern", "logit_scale",
      "layer_norm_eps", "rms_norm_eps", "attention_bias", "tie_word_embeddings", "hidden_act")),
    (lambda: _dory(num_hidden_layers=9, n_input_layers=4, n_output_layers=4, sliding_window=1024, num_key_value_heads=4),
     ("n_input_layers", "n_output_layers", "n_recurrent_layers", "n_recurrent_loops", "recurrent_kv_cache_mode",
      "ngpt_alpha_init", "attention_bias", "mlp_bias", "hidden_act", "tie_word_embeddings", "rope_parameters",
      "sliding_window", "num_key_value_heads")),
    (lambda: _kolibri11_other(num_key_value_heads=4, num_attention_heads=12, hidden_size=48, head_dim=128,
                              num_experts=6, num_experts_per_tok=6, moe_intermediate_size=512,
                              shared_expert_intermediate_size=512, sliding_window=513, norm_topk_prob=False,
                              mlp_only_layers=None, mlp_only_intermediate_size=3584, index_topk=2048,
                              index_pool_size=16384, index_compression=16, index_num_heads=3,
                              index_num_local_tokens=128, index_num_sink_tokens=8),
     ("num_key_value_heads", "head_dim", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
      "sliding_window", "norm_topk_prob", "layer_types", "index_layers", "kv_source_layers", "mlp_only_layers",
      "mlp_only_intermediate_size", "index_topk", "index_pool_size", "index_compression", "index_num_local_tokens",
      "index_num_sink_tokens", "rms_norm_eps", "hidden_act")),
], ids=["granitemoeshared", "flex_olmo", "param2moe", "sarvam_moe", "cohere2_moe", "dory", "kolibri1_1"])
def test_config_json_without_defaults_loads(make: Any, keys: tuple[str, ...], tmp_path: Path) -> None:
    """A ``config.json`` leaving these keys out: read as transformers' ``from_pretrained`` reads it."""
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


def test_param2_original_config_names_load(tmp_path: Path) -> None:
    """Param2's original configs name ``attention_bias`` ``use_qkv_bias`` and ``n_shared_experts``
    ``num_shared_experts`` (its config's ``attribute_map``): read as transformers reads them."""
    import json

    from attnzoo.interop import load_pretrained

    hf = checks.hf_model(_param2(attention_bias=True, n_shared_experts=1))
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["use_qkv_bias"], data["num_shared_experts"] = data.pop("attention_bias"), data.pop("n_shared_experts")
    path.write_text(json.dumps(data))
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.attention_bias and again.config.n_shared_experts == 1
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), again(input_ids=x).logits) <= checks.TOL


@pytest.mark.parametrize(("model_class", "make", "key", "value", "named"), [
    (T.GraniteMoeSharedForCausalLM, _granitemoeshared, "hidden_act", "gelu", "hidden_act"),
    (T.GraniteMoeSharedForCausalLM, _granitemoeshared, "rope_parameters",
     {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    (T.FlexOlmoForCausalLM, _flex_olmo, "hidden_act", "gelu", "hidden_act"),
    (T.Glm4MoeForCausalLM, _param2, "hidden_act", "gelu", "hidden_act"),
    (T.Glm4MoeForCausalLM, _sarvam, "pretraining_tp", 2, "pretraining_tp"),
    (T.Kolibri1_1ForCausalLM, _kolibri11, "hidden_act", "gelu", "hidden_act"),
    (T.Cohere2MoeForCausalLM, _cohere2_moe, "hidden_act", "gelu", "hidden_act"),
    (T.DoryForCausalLM, _dory, "hidden_act", "tanh", "hidden_act"),
    (T.DoryForCausalLM, _dory, "layer_types", ["sliding_attention"] * 4 + ["chunked_attention"], "layer type"),
    (T.Cohere2MoeForCausalLM, _cohere2_moe, "expert_selection_fn", "relu", "expert_selection_fn"),
    (T.Cohere2MoeForCausalLM, _cohere2_moe, "shared_expert_combination_strategy", "max",
     "shared_expert_combination_strategy"),
    (T.Cohere2MoeForCausalLM, _cohere2_moe, "rope_parameters", {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
     "rope_type"),
    (T.Kolibri1_1ForCausalLM, _kolibri11, "layer_types", ["full_attention"] * 6, "layer type"),
], ids=["kolibri1_1_activation", "kolibri1_1_layer_type", "cohere2_moe_activation", "dory_activation", "dory_layer_type", "cohere2_moe_selection",
        "cohere2_moe_combination", "cohere2_moe_rope_type","granitemoeshared_activation", "granitemoeshared_partial_rope", "flex_olmo_activation", "param2_activation",
        "sarvam_pretraining_tp"])
def test_options_it_cannot_reproduce_are_refused(model_class: Any, make: Any, key: str, value: Any,
                                                  named: str) -> None:
    checks.check_refused(model_class, make, key, value, named)


@pytest.mark.parametrize("make", [_granitemoeshared, _flex_olmo, _param2, _sarvam, _kolibri11, _cohere2_moe, _dbrx,
                                  _dory_other],
                         ids=["granitemoeshared", "flex_olmo", "param2moe", "sarvam_moe", "kolibri1_1", "cohere2_moe",
                              "dbrx", "dory"])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    checks.check_packed_equals_each_alone(make)


@pytest.mark.parametrize("make", [_granitemoeshared, _flex_olmo, _param2_other, _sarvam, _kolibri11,
                                  _cohere2_moe_other, _dbrx_other, _dory],
                         ids=["granitemoeshared", "flex_olmo", "param2moe", "sarvam_moe", "kolibri1_1", "cohere2_moe",
                              "dbrx", "dory"])
def test_packed_training_gradients_equal_each_alone(make: Any) -> None:
    checks.check_packed_gradients_equal_each_alone(make)


def test_kolibri11_layouts_it_cannot_read_are_refused() -> None:
    """More indexed layers than the default ``kv_source_layers`` covers (10) without the key (transformers'
    config refuses it too), and a layer reading the keys of a later or a sliding layer."""
    from attnzoo.interop import UnsupportedConfigError
    from attnzoo.models.families.sparse_moe import kolibri1_1_layout
    from attnzoo.models.hf._state import HFConfig
    from attnzoo.models.hf.errors import CheckpointFormatError

    with pytest.raises(UnsupportedConfigError, match="kv_source_layers"):
        kolibri1_1_layout(HFConfig({}, "test"), 55)
    kinds = {"layer_types": K11_TYPES, "index_layers": [1]}
    for sources in ([0, 1, 4, 3, 4, 5], [0, 1, 1, 0, 4, 5], [0, 1, 1, 3, 2, 5]):
        with pytest.raises(CheckpointFormatError, match="kv_source_layers"):
            kolibri1_1_layout(HFConfig({**kinds, "kv_source_layers": sources}, "test"), 6)
    with pytest.raises(CheckpointFormatError, match="index_layers"):
        kolibri1_1_layout(HFConfig({**kinds, "index_layers": [2]}, "test"), 6)


def test_kolibri11_nvfp4_and_selection_equal_transformers() -> None:
    """:func:`nvfp4` equals transformers' ``nvfp4_fake_quantize`` bit for bit (float32 and bfloat16);
    :class:`KolibriIndex`'s pools and selections equal ``Kolibri1_1Indexer``'s on a left-padded batch
    of 40 keys (an indexer layer, then a layer selecting from its pool), and leave keys out."""
    from transformers.models.kolibri1_1 import modeling_kolibri1_1 as theirs

    from attnzoo.interop import from_hf
    from attnzoo.models.families.sparse_moe import nvfp4

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g) * torch.logspace(-4, 3, 64)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(nvfp4(x.to(dtype)), theirs.nvfp4_fake_quantize(x.to(dtype)))
    config = _kolibri11()
    index = from_hf(checks.hf_model(config)).blocks[1].attn.index
    q, k = torch.randn(2, 4, 40, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g)
    visible = torch.ones(40, 40, dtype=torch.bool).tril().repeat(2, 1, 1)
    visible[0, :, :7] = False  # row 0 left-padded by 7
    pool = index.select_pool(q, k, visible)
    chosen = index.select(q, k, visible, pool)
    with torch.no_grad():
        want, want_pool = theirs.Kolibri1_1Indexer(config, 1)(q, k, visible[:, None])
        want2, _ = theirs.Kolibri1_1Indexer(config, 2)(q.flip(1), k, visible[:, None], want_pool)
    assert torch.equal(pool, want_pool) and torch.equal(chosen, want[:, 0])
    assert torch.equal(index.select(q.flip(1), k, visible, pool), want2[:, 0])
    assert int(chosen[1, -1].sum()) == 4 + 4 + 2 and int(pool[1, -1].sum()) < 40


def test_dbrx_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A DBRX ``config.json`` leaving out its top-level defaults and its whole ``ffn_config``
    (``ffn_hidden_size`` 3584, 4 experts top-1 renormalised, SiLU): read as transformers reads it."""
    hf = checks.hf_model(_dbrx(ffn_config={"ffn_hidden_size": 3584, "moe_num_experts": 4, "moe_top_k": 1}))
    checks.check_folder_without_keys(hf, tmp_path, ("max_seq_len", "tie_word_embeddings", "rope_parameters",
                                                    "resid_pdrop", "emb_pdrop", "num_key_value_heads", "ffn_config"))


@pytest.mark.parametrize(("sub", "key", "value"), [
    ("ffn_config", "moe_jitter_eps", 0.1), ("ffn_config", "ffn_act_fn", {"name": "gelu"}),
    ("ffn_config", "moe_normalize_expert_weights", 0.0), ("attn_config", "clip_qkv", -1.0),
], ids=["jitter", "activation", "norm_p", "clip"])
def test_dbrx_options_it_cannot_reproduce_are_refused(sub: str, key: str, value: Any) -> None:
    from attnzoo.interop import UnsupportedConfigError, from_hf

    hf = T.DbrxForCausalLM(_dbrx())
    setattr(getattr(hf.config, sub), key, value)
    with pytest.raises(UnsupportedConfigError, match=key):
        from_hf(hf)


def test_dory_last_loop_decodes_as_transformers() -> None:
    """``recurrent_kv_cache_mode="last_loop"``: the loops before the last attend to the last loop's
    cached past and their own tokens, so transformers' cached decode differs from its full forward;
    attnzoo's cached decode equals transformers' cached decode, step by step (and generation is
    token-identical: the class checks)."""
    from transformers import DynamicCache

    from attnzoo.interop import from_hf

    hf = checks.hf_model(_dory_last_loop())
    ours = from_hf(hf)
    x = checks.tokens(16)
    with torch.no_grad():
        cache = DynamicCache(config=hf.config)
        theirs = [hf(input_ids=x[:, :6], cache=cache, use_cache=True).logits]
        theirs += [hf(input_ids=x[:, t:t + 1], cache=cache, use_cache=True).logits for t in range(6, 16)]
        mine = ours.init_cache(2, 16)
        got = [ours(x[:, :6], cache=mine)] + [ours(x[:, t:t + 1], cache=mine) for t in range(6, 16)]
        full = hf(input_ids=x).logits
    theirs_t, got_t = torch.cat(theirs, dim=1), torch.cat(got, dim=1)
    assert checks.rel(got_t, theirs_t) <= checks.TOL
    assert checks.rel(theirs_t, full) > 1e-3  # transformers' own two paths differ


def test_dory_released_layout_loads(tmp_path: Path) -> None:
    """The released checkpoints' two blocks a layer (``backbone.layers.{2i}.mixer`` attention,
    ``layers.{2i+1}.mixer`` MLP, ``attn_alpha`` / ``mlp_alpha``): loaded as transformers loads them."""
    import re

    from safetensors.torch import load_file, save_file

    from attnzoo.interop import load_pretrained

    hf = checks.hf_model(_dory())
    hf.save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))

    def released(key: str) -> str:
        m = re.match(r"(backbone\.layers\.)(\d+)\.(self_attn|mlp|lambda_1|lambda_2)(.*)", key)
        if m is None:
            return key
        i, part = int(m.group(2)), m.group(3)
        index = 2 * i + (part in ("mlp", "lambda_2"))
        name = {"lambda_1": "attn_alpha", "lambda_2": "mlp_alpha"}.get(part, "mixer")
        return f"{m.group(1)}{index}.{name}{m.group(4)}"

    save_file({released(k): v for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(again(input_ids=x).logits, hf(input_ids=x).logits) <= 1e-6
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).logits) <= checks.TOL


def test_dory_layouts_it_cannot_read_are_refused() -> None:
    """A ``recurrent_kv_cache_mode`` transformers' config would not take, and sections that do not
    add up to the layers."""
    from attnzoo.interop import UnsupportedConfigError
    from attnzoo.models.families.dory import canonical
    from attnzoo.models.hf._state import HFConfig
    from attnzoo.models.hf.errors import CheckpointFormatError

    data = {k: v for k, v in _dory().to_dict().items() if k != "recurrent_kv_cache_mode"}
    with pytest.raises(UnsupportedConfigError, match="recurrent_kv_cache_mode"):
        canonical(HFConfig({**data, "recurrent_kv_cache_mode": "every_loop"}, "test"))
    with pytest.raises(CheckpointFormatError, match="n_input_layers"):
        canonical(HFConfig({**data, "n_recurrent_layers": 8}, "test"))
    assert canonical(HFConfig(data, "test")).req("n_recurrent_layers") == 3
