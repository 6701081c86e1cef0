"""dots.3-note text (``dots3_note_text``) through ``from_hf`` / ``load_pretrained``: latent attention of
per-layer shapes (``per_layer_config``: the sliding layers' own heads and ranks) with LoRA-scaled
latents, a normed RoPE key and a per-head output gate, on indexed (GLM-MoE-DSA's lightning indexer),
sliding and full layers; DeepSeek-V3's MoE with dots' shared experts; equal to transformers' eager.

``_dots3``'s 2-head indexer keeps 4 keys: its ReLU scores tie at 0, where transformers' cached decode
differs from its full forward; attnzoo follows each (``test_cached_decode_equals_transformers_cached_decode``),
and the shared decode check runs a tie-free 16-head indexer (``_dots3_other``)."""

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
from attnzoo.models.families.deepseek import LightningTopK  # noqa: E402
from attnzoo.models.families.dots3 import (  # noqa: E402
    DotsIndexedAttention,
    DotsLatentAttention,
    KRopeNormedLinear,
)
from attnzoo.nn.moe import MixtureOfExperts  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

F, S, X = "full_attention", "sliding_attention", "indexed_attention"
#: the sliding layers' shapes (2 heads, their own ranks and widths; the same rope width)
SWA = {"swa_num_attention_heads": 2, "swa_num_key_value_heads": 2, "swa_q_lora_rank": 20, "swa_kv_lora_rank": 12,
       "swa_head_dim": 20, "swa_qk_nope_head_dim": 12, "swa_v_head_dim": 8, "swa_rope_theta": 1000.0}


def _dots3(**kw: Any) -> Any:
    """6 layers (the default kinds: indexed on 0, 1, 5, sliding elsewhere, a window of 6), the first
    dense, 4 experts top-2, a 2-head indexer keeping 4 keys, untied."""
    return T.Dots3NoteTextConfig(**{
        **checks.SMALL, "num_key_value_heads": 4, "moe_intermediate_size": 32, "num_hidden_layers": 6,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "qk_nope_head_dim": 16, "head_dim": 24, "index_topk": 4, "index_head_dim": 16,
        "index_n_heads": 2, "shared_experts_intermediate_size": 24, "sliding_window": 6, "rope_theta": 1e4,
        **SWA, **kw})


def _dots3_other() -> Any:
    """Full (non-indexed) and sliding layers, a tie-free 16-head indexer on the last, biases, tied, two
    expert groups (one kept), routed scaling 2.5 without renormalisation, 2 shared experts, yarn on the
    sliding layers, a window of 3, eps 1e-6."""
    rope = {F: {"rope_type": "default", "rope_theta": 1e4}, X: {"rope_type": "default", "rope_theta": 3e4},
            S: {"rope_type": "yarn", "rope_theta": 1e3, "factor": 4.0, "original_max_position_embeddings": 16,
                "mscale_all_dim": 0.8, "mscale": 1.0}}
    return _dots3(layer_types=[F, S, S, F, S, X], use_dsa=None, attention_bias=True, tie_word_embeddings=True,
                  n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=False, n_shared_experts=2,
                  index_n_heads=16, sliding_window=3, rms_norm_eps=1e-6, rope_parameters=rope)


class TestDots3(checks.FamilyChecks):
    config = staticmethod(_dots3)
    cases = (_dots3_other,)


@pytest.mark.parametrize("make", [_dots3, _dots3_other])
def test_cached_decode_equals_transformers_cached_decode(make: Any) -> None:
    """A prefill, a chunk, then one token at a time, against transformers' own cache; ``_dots3``
    meets index ties there, where transformers' cached decode differs from its full forward."""
    hf = checks.hf_model(make(), T.AutoModel)
    ours = from_hf(hf)
    x = checks.tokens(26)
    spans = [(0, 9), (9, 13)] + [(t, t + 1) for t in range(13, 26)]
    theirs, own = T.DynamicCache(config=hf.config), ours.init_cache(2, 26)
    with torch.no_grad():
        ref = torch.cat([hf(input_ids=x[:, a:b], cache=theirs, use_cache=True).last_hidden_state for a, b in spans], 1)
        got = torch.cat([ours(x[:, a:b], cache=own) for a, b in spans], 1)
    assert checks.rel(got, ref) <= checks.TOL


def test_layer_structure() -> None:
    ours = from_hf(checks.hf_model(_dots3()))
    attns = [b.attn for b in ours.blocks]
    assert [type(a) for a in attns] == [DotsIndexedAttention] * 2 + [DotsLatentAttention] * 3 + [DotsIndexedAttention]
    assert isinstance(attns[0].indexer, LightningTopK) and attns[0].indexer.interleaved and attns[0].indexer.topk == 4
    assert attns[2].window == 6 and attns[2].num_heads == 2 and attns[2].sizes.kv_lora_rank == 12
    assert attns[0].num_heads == 4 and attns[0].sizes.q_lora_rank == 24 and attns[0].softmax_scale == 24 ** -0.5
    assert all(isinstance(a.kv_a_proj, KRopeNormedLinear) and a.g_proj.weight.shape[0] == a.num_heads for a in attns)
    assert attns[2].rope.base == 1000.0 and attns[0].rope.base == 1e4 and attns[0].rope.interleaved
    moe = ours.blocks[1].ffn
    assert isinstance(moe, MixtureOfExperts) and moe.shared_expert.hidden == 24 and moe.keep_router_float32
    other = from_hf(checks.hf_model(_dots3_other()))
    assert [getattr(b.attn, "window", None) for b in other.blocks] == [None, 3, 3, None, 3, None]
    assert other.blocks[1].ffn.shared_expert.hidden == 48 and other.blocks[1].ffn.groups == 2


@pytest.mark.parametrize("make", [_dots3, _dots3_other])
def test_parameter_counts_and_packing(make: Any) -> None:
    """As many parameters as transformers' model; packed sequences (``cu_seqlens``) equal each alone."""
    hf = checks.hf_model(make())
    assert sum(p.numel() for p in from_hf(hf).parameters()) == sum(p.numel() for p in hf.parameters())
    checks.check_packed_equals_each_alone(make)


def test_packed_training_gradients_equal_each_alone() -> None:
    """Float64: the indexers' weights get no gradient (a discrete selection under ``no_grad``, as in transformers)."""
    checks.check_packed_gradients_equal_each_alone(_dots3_other, no_gradient=".indexer.")


def test_released_config_keys_load(tmp_path: Path) -> None:
    """The released ``config.json`` form (no ``layer_types``, ``per_layer_config``, ``rope_parameters`` or
    ``mlp_layer_types``: ``use_dsa``, ``use_sliding_window``, ``swa_*``, ``rope_theta`` / ``swa_rope_theta``,
    ``first_k_dense_replace``, ``moe_layer_freq``, ``sliding_window_size``,
    ``moe_shared_expert_intermediate_size``) and the layers past ``num_hidden_layers`` / ``mtp`` weights:
    read as transformers' ``from_pretrained`` reads them."""
    hf = checks.hf_model(_dots3(moe_layer_freq=2, first_k_dense_replace=2, moe_shared_expert_intermediate_size=16,
                                sliding_window=None, sliding_window_size=5))
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    for key in ("layer_types", "per_layer_config", "rope_parameters", "mlp_layer_types", "sliding_window",
                "shared_experts_intermediate_size"):
        data.pop(key)
    data.update({"use_dsa": True, "use_sliding_window": True, "first_k_dense_replace": 2, "moe_layer_freq": 2,
                 "sliding_window_size": 5, "moe_shared_expert_intermediate_size": 16, "rope_theta": 1e4, **SWA})
    path.write_text(json.dumps(data))
    weights = safetensors_torch.load_file(tmp_path / "model.safetensors")
    weights["model.mtp.0.proj.weight"] = torch.zeros(3, 3)
    weights["model.layers.6.input_layernorm.weight"] = torch.zeros(64)
    safetensors_torch.save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.mlp_layer_types == ["dense", "dense", "sparse", "dense", "sparse", "dense"]
    x = checks.tokens(20)
    with torch.no_grad():
        ref = again(input_ids=x).logits
        assert checks.rel(ref, hf(input_ids=x).logits) <= checks.TOL
        assert checks.rel(load_pretrained(tmp_path)(x), ref) <= checks.TOL


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A saved ``config.json`` leaving out ``Dots3NoteTextConfig``'s defaults."""
    hf = checks.hf_model(_dots3(rms_norm_eps=1e-5, n_group=1, topk_group=1, routed_scaling_factor=1.0))
    checks.check_folder_without_keys(hf, tmp_path, ("rms_norm_eps", "n_group", "topk_group", "routed_scaling_factor",
                                                    "norm_topk_prob", "hidden_act", "attention_bias",
                                                    "tie_word_embeddings", "n_shared_experts", "attention_dropout"))


@pytest.mark.parametrize(("key", "value", "named"), [
    ("q_lora_rank", None, "q_lora_rank"),
    ("index_head_dim", 4, "index_head_dim"),
    ("n_shared_experts", 0, "n_shared_experts"),
    ("n_group", 3, "n_group"),
    ("hidden_act", "gelu", "hidden_act"),
    ("layer_types", [X, X, "chunked_attention", S, S, X], "chunked_attention"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "rope_type"),
    ("pretraining_tp", 2, "pretraining_tp"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.Dots3NoteForCausalLM, _dots3, key, value, named)


@pytest.mark.parametrize(("entries", "named"), [
    ({"3": {"intermediate_size": 8}}, "intermediate_size"),
    ({"2": {"num_attention_heads": 4}}, "shaped unlike"),
    ({"0": {"num_key_value_heads": 2}, "1": {"num_key_value_heads": 2}, "5": {"num_key_value_heads": 2}},
     "num_key_value_heads"),
])
def test_per_layer_options_it_cannot_reproduce_are_refused(entries: dict[str, Any], named: str) -> None:
    """``per_layer_config`` entries outside the attention's shapes, a kind of differently shaped layers,
    grouped keys (a config file; transformers' own classes build none of them)."""
    from attnzoo.models.families.dots3 import convert_dots3
    from attnzoo.models.hf._state import HFConfig

    hf = checks.hf_model(_dots3())
    data = hf.config.to_dict()
    data["per_layer_config"] = {**data["per_layer_config"], **entries}
    with pytest.raises(checks.UnsupportedConfigError, match=named):
        convert_dots3(HFConfig(data, "test", "dots.3-note"), hf.state_dict(), device=None, dtype=None)
