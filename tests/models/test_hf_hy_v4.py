"""HY-V4 through ``from_hf`` (``families/hy_v4.py``): hyper-connected residual streams without
``comb`` and DeepSeek-V4's hyper-head, DeepSeek sparse attention (latent attention over the keys a
Lightning indexer selects, rotating its last channels) with sinks and an output gate, ``shared``
layers reusing the last full layer's selection, DeepSeek-V3's MoE with clamped routed experts;
equal to transformers' eager (see ``hf_family_checks``) with ``index_topk`` below the tested lengths
so the selection matters; at exact top-k ties the cached decode follows transformers' cached decode;
packed sequences (one at a time) and their float64 gradients equal to each sequence alone; refusals
by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import test_hf_deepseek_dsa as dsa  # noqa: E402

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.deepseek import LightningTopK  # noqa: E402
from attnzoo.models.families.glm5_next import ClampedMoE  # noqa: E402
from attnzoo.models.families.hy_v4 import (  # noqa: E402
    HYV4LM,
    HYV4IndexedAttention,
    HYV4SharedAttention,
    IndependentHyperConnection,
)
from attnzoo.models.hf.errors import UnsupportedConfigError  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

_SIZES = dict(num_hidden_layers=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, index_topk=5,
              index_head_dim=16, index_n_heads=4, hc_mult=3, swiglu_limit=0.5)


def _hy(**kw: Any) -> Any:
    """4 layers by HY-V4's default kinds (dense then 3 MoE; indexers full, full, shared, shared), 3
    streams, each query attending its 5 best keys of a 4-head indexer, 8 experts top-2 clamped at 0.5,
    one shared expert."""
    return T.HYV4Config(**{**checks.SMALL, **_SIZES, **kw})


def _hy_other() -> Any:
    """YaRN, attention biases, 5 layers with explicit kinds (full, shared, full, shared, shared;
    sparse, dense, sparse, sparse, dense), 8 experts in 4 groups (the best 2), two shared experts,
    unnormalised weights, a tied head, GELU-gated dense and shared MLPs, magnitude 1.5, epsilon 1e-6, ``hc_eps`` 0.05, a 16-head
    indexer (no exact tie at the cut: the cached decode equals the full forward)."""
    return _hy(rope_parameters=dsa.YARN, attention_bias=True, num_hidden_layers=5, n_group=4, topk_group=2,
               indexer_types=["full", "shared", "full", "shared", "shared"],
               mlp_layer_types=["sparse", "dense", "sparse", "sparse", "dense"], n_shared_experts=2,
               norm_topk_prob=False, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh", hc_magnitude=1.5,
               index_n_heads=16, routed_scaling_factor=1.7, rms_norm_eps=1e-6, hc_eps=0.05)


class TestHYV4(checks.FamilyChecks):
    config = staticmethod(_hy)
    cases = (_hy_other,)


def test_cached_decode_follows_transformers_at_ties() -> None:
    """With 2 index heads many keys score exactly 0 after the ReLU and tie at the top-k cut;
    ``torch.topk`` breaks such ties differently over a decode step's row and the full forward's, so
    transformers' own cached decode differs from its full forward. attnzoo follows transformers in
    both: its full forward equals transformers' full forward, its cached decode transformers' cached
    decode."""
    hf = checks.hf_model(_hy(index_n_heads=2, index_topk=4))
    ours, x = from_hf(hf), checks.tokens(20)
    with torch.no_grad():
        theirs_full, theirs_decode = hf(input_ids=x).logits, dsa._decode(hf, x, 7, hf=True)
        assert checks.rel(theirs_decode, theirs_full) > 1e-2  # the ties matter here
        assert checks.rel(ours(x), theirs_full) <= checks.TOL
        assert checks.rel(dsa._decode(ours, x, 7, hf=False), theirs_decode) <= checks.TOL


def test_layer_structure() -> None:
    ours = from_hf(checks.hf_model(_hy_other()))
    assert type(ours) is HYV4LM and ours.streams == 3
    assert [type(b.attn) for b in ours.blocks] == [HYV4IndexedAttention, HYV4SharedAttention, HYV4IndexedAttention,
                                                   HYV4SharedAttention, HYV4SharedAttention]
    attn = ours.blocks[0].attn
    assert isinstance(attn.indexer, LightningTopK) and attn.indexer.interleaved and attn.indexer.k_norm.eps == 1e-6
    assert (attn.indexer.heads, attn.indexer.head_dim, attn.indexer.topk) == (16, 16, 5)
    assert attn.rope.interleaved and attn.form == "materialised" and attn.sinks.dtype == torch.float32
    assert [type(b.ffn) is ClampedMoE for b in ours.blocks] == [True, False, True, True, False]
    moe = ours.blocks[0].ffn
    assert (moe.groups, moe.topk_groups, moe.routed_scaling, moe.limit, moe.norm_topk_prob) == (4, 2, 1.7, 0.5, False)
    assert moe.shared_expert.up_proj.weight.shape == (64, 64) and moe.router.weight.dtype == torch.float32
    hc = ours.blocks[0].attn_hc
    assert type(hc) is IndependentHyperConnection and hc.magnitude == 1.5 and hc.fn.shape == (6, 192)
    assert ours.lm_head.weight is ours.tok_emb.weight
    assert from_hf(checks.hf_model(_hy())).blocks[0].attn.indexer.k_norm.eps == 1e-5


def test_selection_and_sharing_matter() -> None:
    """The sparse selection changes the output (the indexer keeping every key differs), and so does
    the shared layers' reuse of it (a layer with its own indexer differs)."""
    x = checks.tokens(20)
    with torch.no_grad():
        sparse = from_hf(checks.hf_model(_hy()))(x)
        dense = checks.hf_model(_hy(index_topk=64))(input_ids=x).logits
        own = checks.hf_model(_hy(indexer_types=["full"] * 4))(input_ids=x).logits
    assert checks.rel(sparse, dense) > 1e-3 and checks.rel(sparse, own) > 1e-3


def test_no_shared_experts() -> None:
    """``n_shared_experts=0``: transformers keeps empty ``shared_experts`` weights; attnzoo none."""
    hf = checks.hf_model(_hy(n_shared_experts=0))
    ours, x = from_hf(hf), checks.tokens(12)
    assert ours.blocks[1].ffn.shared_expert is None
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_hy_other)


def test_packed_gradients_equal_each_alone() -> None:
    """Float64 training: the gradients of a packed batch equal the sequences' one at a time; the
    indexers' weights get none (their top-k selection is discrete, as in transformers)."""
    checks.check_packed_gradients_equal_each_alone(_hy_other, no_gradient=".indexer.")


def test_multi_token_prediction_layers_are_dropped(tmp_path: Path) -> None:
    """A checkpoint with an MTP layer (``model.mtp_layers.0``): transformers ignores it, so does the converter."""
    hf = checks.hf_model(_hy())
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    sd = dict(safetensors_torch.load_file(str(path)))
    sd["model.mtp_layers.0.eh_proj.weight"] = torch.ones(3, 3)
    safetensors_torch.save_file(sd, str(path), metadata={"format": "pt"})
    x = checks.tokens(9)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).logits) <= checks.TOL


@pytest.mark.parametrize("make,keys", [
    (lambda: _hy(rms_norm_eps=1e-5, hc_magnitude=2.0, hc_eps=1e-6, routed_scaling_factor=2.827, n_group=1,
                 topk_group=1, norm_topk_prob=True, swiglu_limit=10.0, n_shared_experts=1),
     ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "attention_bias", "rms_norm_eps",
      "n_shared_experts", "hidden_act", "tie_word_embeddings", "mlp_layer_types", "indexer_types", "layer_types",
      "hc_magnitude", "hc_eps", "swiglu_limit", "rope_parameters")),
], ids=["hy_v4"])
def test_config_json_with_keys_left_out(tmp_path: Path, make: Any, keys: tuple[str, ...]) -> None:
    """Keys left out of ``config.json`` read as the config class's defaults (as ``from_pretrained``)."""
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


@pytest.mark.parametrize("key,value,named", [
    ("swiglu_limit", 0.0, "swiglu_limit"),
    ("swiglu_limit", -1.0, "swiglu_limit"),
    ("index_head_dim", 4, "index_head_dim"),
    ("indexer_types", ["shared", "full", "shared", "shared"], "indexer_types"),
    ("indexer_types", ["full", "own", "shared", "shared"], "indexer type 'own'"),
    ("mlp_layer_types", ["dense", "moe", "sparse", "sparse"], "mlp layer type 'moe'"),
    ("layer_types", ["full_attention"] * 4, "layer type 'full_attention'"),
    ("n_group", 3, "n_group=3"),
    ("hidden_act", "relu", "hidden_act"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "dynamic"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ("pretraining_tp", 2, "pretraining_tp"),
])
def test_unsupported_options_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.HYV4ForCausalLM, _hy, key, value, named)


@pytest.mark.parametrize("key", ["q_lora_rank", "swiglu_limit"])
def test_config_json_nulls_are_refused(tmp_path: Path, key: str) -> None:
    """What only a ``config.json`` can say (transformers' strict config rejects it): a null
    ``q_lora_rank`` (no query latent) or ``swiglu_limit``: refused by name."""
    checks.hf_model(_hy()).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, key: None}))
    with pytest.raises(UnsupportedConfigError, match=key):
        load_pretrained(tmp_path)


def test_register_refuses_the_indexed_attention() -> None:
    """transformers' HY-V4 attention hands a non-eager attention function its top-k ``indices``
    instead of folding them into the mask: ``attnzoo.hf.register()`` refuses to serve it by name
    rather than ignore them (transformers itself supports only ``eager`` for it)."""
    with pytest.raises(NotImplementedError, match="indices"):
        checks.check_register_equals_eager(checks.hf_model(_hy()))
