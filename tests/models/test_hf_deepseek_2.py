"""More of the DeepSeek MLA lineage through ``from_hf``: Sarvam-MLA (DeepSeek-V3 built from its own
config, with its original ``config.json`` names), the dense Youtu-LLM and MiniCPM3 (MiniCPM's
embedding / residual / logit multipliers folded into weights), A.X-K2 (DeepSeek-V3.2's indexed
attention with a gated query projection, gated norms, zero-filled expert groups) and LongCat-Flash
(two latent-attention sub-layers per layer with a shortcut MoE of zero-computation experts); equal to transformers' eager (see
``hf_family_checks``), packed sequences and their gradients equal to each sequence alone, refusals
by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import UnsupportedConfigError, from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.deepseek import (  # noqa: E402
    GatedQueryLatentAttention,
    LongcatLayer,
    SigmoidGatedRMSNorm,
    ZeroExpertMoE,
    ZeroFilledGroupsMoE,
)
from attnzoo.models.parts import ScaledEmbedding  # noqa: E402
from attnzoo.nn.mla import MultiHeadLatentAttention  # noqa: E402
from attnzoo.nn.moe import MixtureOfExperts  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
_MLA = dict(num_key_value_heads=4, num_hidden_layers=3, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=16)
_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def _sarvam(**kw: Any) -> Any:
    """Sarvam-MLA: 3 layers (dense, then MoE: 8 experts, one group), a full query projection."""
    return T.SarvamMLAConfig(**{**checks.SMALL, **_MLA, **_MOE, **kw})


def _sarvam_groups_yarn() -> Any:
    """A low-rank query, YaRN, 4 groups (the best 2), two shared experts, attention biases, split-half RoPE."""
    return _sarvam(q_lora_rank=24, rope_parameters=YARN, n_group=4, topk_group=2, n_shared_experts=2,
                   attention_bias=True, rope_interleave=False, routed_scaling_factor=1.5)


def _youtu(**kw: Any) -> Any:
    """Youtu-LLM: 3 dense layers of latent attention (a low-rank query), a tied head."""
    return T.YoutuConfig(**{**checks.SMALL, **_MLA, "q_lora_rank": 24, **kw})


def _youtu_yarn() -> Any:
    """A full query projection, YaRN, split-half RoPE, attention biases, an untied head."""
    return _youtu(q_lora_rank=None, rope_parameters=YARN, rope_interleave=False, attention_bias=True,
                  tie_word_embeddings=False)


def _youtu_no_pad() -> Any:
    """Youtu-LLM without a ``pad_token_id``: transformers' ``from_pretrained`` then loads its
    embeddings as saved (see :func:`test_youtu_from_pretrained_zeroes_the_pad_row`)."""
    return _youtu(pad_token_id=None)


def _minicpm3(**kw: Any) -> Any:
    """MiniCPM3: 3 dense layers of latent attention (a low-rank query, split-half RoPE), its default
    multipliers (embeddings x12, residual branches x1.4/sqrt(3), hidden states / (64/256))."""
    return T.MiniCPM3Config(**{**checks.SMALL, **_MLA, "q_lora_rank": 24, **kw})


def _minicpm3_yarn() -> Any:
    """A full query projection, YaRN, MLP and attention biases, an untied head, other multipliers."""
    return _minicpm3(q_lora_rank=None, rope_parameters=YARN, mlp_bias=True, attention_bias=True,
                     tie_word_embeddings=False, scale_emb=2.5, scale_depth=0.7, dim_model_base=16)


def _axk2(**kw: Any) -> Any:
    """A.X-K2: 3 layers (dense, then MoE: 8 experts, no groups), each query attending its 5 best keys
    of a 16-head indexer (no ties at the cut), the gated norms of rank 4."""
    return T.AXK2Config(**{**checks.SMALL, **_MLA, **_MOE, "q_lora_rank": 24, "index_head_dim": 16,
                           "index_n_heads": 16, "index_topk": 5, "gated_norm_rank": 4, **kw})


def _axk2_groups_yarn() -> Any:
    """Explicit kinds (sparse, dense, sparse, sparse), 4 groups (the best 2), two shared experts,
    YaRN, attention biases, unnormalised weights, a tied head, 7 keys kept."""
    return _axk2(num_hidden_layers=4, mlp_layer_types=["sparse", "dense", "sparse", "sparse"], n_group=4,
                 topk_group=2, n_shared_experts=2, rope_parameters=YARN, attention_bias=True, norm_topk_prob=False,
                 tie_word_embeddings=True, index_topk=7)


_LONGCAT = dict(num_layers=2, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                qk_rope_head_dim=8, head_dim=8, v_head_dim=16, ffn_hidden_size=48, expert_ffn_hidden_size=32)


def _longcat(**kw: Any) -> Any:
    """LongCat-Flash: 2 layers (4 attention sub-layers), 4 experts beside 2 zero-computation experts,
    2 picked, scaled x2."""
    return T.LongcatFlashConfig(**{**checks.SMALL, **_LONGCAT, "n_routed_experts": 4, "zero_expert_num": 2,
                                   "moe_topk": 2, "routed_scaling_factor": 2.0, **kw})


def _longcat_yarn() -> Any:
    """YaRN, attention biases, a tied head, 4 zero experts and 5 picked (more than the 4 real
    experts), the router's (unused) bias."""
    return _longcat(rope_parameters=YARN, attention_bias=True, tie_word_embeddings=True, zero_expert_num=4,
                    moe_topk=5, routed_scaling_factor=1.5, router_bias=True)


class TestSarvamMLA(checks.FamilyChecks):
    config = staticmethod(_sarvam)
    cases = (_sarvam_groups_yarn,)


class TestYoutu(checks.FamilyChecks):
    config = staticmethod(_youtu)
    cases = (_youtu_yarn,)


class TestMiniCPM3(checks.FamilyChecks):
    config = staticmethod(_minicpm3)
    cases = (_minicpm3_yarn,)


class TestAXK2(checks.FamilyChecks):
    config = staticmethod(_axk2)
    cases = (_axk2_groups_yarn,)


class TestLongcatFlash(checks.FamilyChecks):
    config = staticmethod(_longcat)
    cases = (_longcat_yarn,)


def test_layer_structure() -> None:
    sarvam = from_hf(checks.hf_model(_sarvam_groups_yarn()))
    assert type(sarvam.blocks[0].attn) is MultiHeadLatentAttention and not sarvam.blocks[0].attn.rope.interleaved
    assert [isinstance(b.ffn, MixtureOfExperts) for b in sarvam.blocks] == [False, True, True]
    assert (sarvam.blocks[1].ffn.groups, sarvam.blocks[1].ffn.routed_scaling) == (4, 1.5)
    youtu = from_hf(checks.hf_model(_youtu()))
    assert not any(isinstance(b.ffn, MixtureOfExperts) for b in youtu.blocks)
    assert youtu.blocks[0].attn.rope.interleaved and youtu.lm_head.weight is youtu.tok_emb.weight
    cpm = from_hf(checks.hf_model(_minicpm3()))
    assert isinstance(cpm.tok_emb, ScaledEmbedding) and cpm.tok_emb.scale == 12.0
    assert not cpm.blocks[0].attn.rope.interleaved and cpm.lm_head.weight is cpm.tok_emb.weight
    assert not any(isinstance(b.ffn, MixtureOfExperts) for b in cpm.blocks)
    axk2 = from_hf(checks.hf_model(_axk2_groups_yarn()))
    assert all(type(b.attn) is GatedQueryLatentAttention and type(b.attn_norm) is SigmoidGatedRMSNorm
               for b in axk2.blocks)
    assert [type(b.ffn_norm) is SigmoidGatedRMSNorm for b in axk2.blocks] == [True, False, True, True]
    assert [type(b.ffn) is ZeroFilledGroupsMoE for b in axk2.blocks] == [True, False, True, True]
    assert axk2.blocks[0].attn.rope.interleaved and not axk2.blocks[0].attn.indexer.interleaved
    assert not hasattr(axk2.blocks[0].attn, "q_b_proj") and axk2.blocks[0].ffn.groups == 4
    longcat = from_hf(checks.hf_model(_longcat_yarn()))
    layer = longcat.blocks[0]
    assert type(layer) is LongcatLayer and len(longcat.blocks) == 2 and type(layer.moe) is ZeroExpertMoE
    assert all(type(s.attn) is MultiHeadLatentAttention and s.attn.rope.interleaved for s in layer.sublayers)
    assert (layer.moe.num_experts, layer.moe.zero_experts, layer.moe.top_k) == (4, 4, 5)
    assert layer.moe.router.weight.shape == (8, 64) and longcat.lm_head.weight is longcat.tok_emb.weight


def test_longcat_zero_experts_are_picked() -> None:
    """The tested tokens route to zero-computation experts (the identity) as well as real ones."""
    ours = from_hf(checks.hf_model(_longcat()))
    moe = ours.blocks[0].moe
    with torch.no_grad():
        h = ours.blocks[0].sublayers[0](ours.embed(checks.tokens(20)))
        experts = moe.route(ours.blocks[0].ffn_norms[0](h).reshape(-1, 64))[1]
    assert (experts >= 4).any() and (experts < 4).any()


@pytest.mark.parametrize("make", [_sarvam_groups_yarn, _youtu, _minicpm3_yarn, _axk2_groups_yarn, _longcat_yarn],
                         ids=["sarvam", "youtu", "minicpm3", "axk2", "longcat"])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    checks.check_packed_equals_each_alone(make)


@pytest.mark.parametrize("make,no_gradient", [(_sarvam, None), (_youtu_yarn, None), (_minicpm3, None),
                                              (_axk2_groups_yarn, ".indexer."), (_longcat_yarn, None)],
                         ids=["sarvam", "youtu", "minicpm3", "axk2", "longcat"])
def test_packed_gradients_equal_each_alone(make: Any, no_gradient: str | None) -> None:
    """Float64 training: packed == each alone (A.X-K2's indexers get no gradient: a discrete top-k)."""
    checks.check_packed_gradients_equal_each_alone(make, no_gradient=no_gradient)


@pytest.mark.parametrize("make", [_sarvam, _youtu_yarn, _minicpm3_yarn, _longcat_yarn],
                         ids=["sarvam", "youtu", "minicpm3", "longcat"])
def test_register_equals_eager(make: Any) -> None:
    """transformers' own model with ``attn_implementation="attnzoo"`` gives its eager logits (A.X-K2,
    as DeepSeek-V3.2, hands the attention function its indexer's ``indices``: refused by name there)."""
    checks.check_register_equals_eager(checks.hf_model(make()))


def test_axk2_groups_fill_zero() -> None:
    """A.X-K2's group-limited routing scores the experts outside the kept groups 0, not ``-inf``:
    with every correction bias at -2 (every biased score negative) it picks experts of the dropped
    groups, and attnzoo with it; DeepSeek-V3's routing would not."""
    hf = checks.hf_model(_axk2_groups_yarn())
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.fill_(-2.0)
    ours, x = from_hf(hf), checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL
        for block in ours.blocks:
            if isinstance(block.ffn, ZeroFilledGroupsMoE):
                block.ffn.__class__ = MixtureOfExperts  # DeepSeek-V3's -inf
        assert checks.rel(ours(x), hf(input_ids=x).logits) > 1e-3


def _decode(model: Any, x: torch.Tensor, prefill: int, hf: bool) -> torch.Tensor:
    """Logits of a prefill then one token at a time through the cache (transformers' or attnzoo's)."""
    cache = T.DynamicCache(config=model.config) if hf else model.init_cache(x.shape[0], x.shape[1])
    run = (lambda t: model(input_ids=t, cache=cache, use_cache=True).logits) if hf else (lambda t: model(t, cache=cache))
    return torch.cat([run(x[:, :prefill])] + [run(x[:, t:t + 1]) for t in range(prefill, x.shape[1])], dim=1)


def test_axk2_cached_decode_follows_transformers_at_ties() -> None:
    """A.X-K2's indexer is DeepSeek-V3.2's: with 2 index heads many keys tie at the top-k cut and
    transformers' own cached decode differs from its full forward (measured 0.40 relative); attnzoo's
    full forward equals transformers' full forward, its cached decode transformers' cached decode."""
    hf = checks.hf_model(_axk2(index_n_heads=2))
    ours, x = from_hf(hf), checks.tokens(20)
    with torch.no_grad():
        theirs_full, theirs_decode = hf(input_ids=x).logits, _decode(hf, x, 7, hf=True)
        assert checks.rel(theirs_decode, theirs_full) > 1e-2
        assert checks.rel(ours(x), theirs_full) <= checks.TOL
        assert checks.rel(_decode(ours, x, 7, hf=False), theirs_decode) <= checks.TOL


@pytest.mark.parametrize("make,cls", [(_minicpm3, "MiniCPM3ForSequenceClassification"),
                                      (_axk2, "AXK2ForSequenceClassification")], ids=["minicpm3", "axk2"])
def test_sequence_classification(make: Any, cls: str) -> None:
    """``*ForSequenceClassification`` reads the base model's hidden states (MiniCPM3: the residual
    scale is folded, the logit divisor is not: it belongs to the LM head)."""
    torch.manual_seed(0)
    hf = checks.perturbed(getattr(T, cls)(make(num_labels=3)))
    ours, x = from_hf(hf), checks.tokens(12)
    assert ours.lm_head.out_features == 3
    with torch.no_grad():
        assert checks.rel(ours(x)[:, -1], hf(input_ids=x).logits) <= checks.TOL


def _rewrite_config(folder: Path, change: Any) -> None:
    path = folder / "config.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _same_as_transformers(folder: Path, hf: Any) -> None:
    """``load_pretrained(folder)`` == transformers' ``from_pretrained(folder)`` == ``hf``."""
    again = T.AutoModelForCausalLM.from_pretrained(folder).eval()
    x = checks.tokens(12)
    with torch.no_grad():
        want = again(input_ids=x).logits
        assert checks.rel(load_pretrained(folder)(x), want) <= checks.TOL
        assert checks.rel(hf(input_ids=x).logits, want) <= checks.TOL


def test_sarvam_original_config_names(tmp_path: Path) -> None:
    """Sarvam's original ``config.json`` (written for its remote code): ``num_experts`` /
    ``num_shared_experts``, ``rope_scaling.type = "deepseek_yarn"``, a vLLM ``head_dim`` and
    ``q_head_dim``: read as ``SarvamMLAConfig`` translates them."""
    hf = checks.hf_model(_sarvam_groups_yarn())
    hf.save_pretrained(tmp_path)

    def legacy(data: dict[str, Any]) -> None:
        data["num_experts"], data["num_shared_experts"] = data.pop("n_routed_experts"), data.pop("n_shared_experts")
        rope = data.pop("rope_parameters")
        data["rope_theta"] = rope.pop("rope_theta")
        data["rope_scaling"] = {**{k: v for k, v in rope.items() if k != "rope_type"}, "type": "deepseek_yarn"}
        data.update(head_dim=16 + 8, q_head_dim=16)

    _rewrite_config(tmp_path, legacy)
    _same_as_transformers(tmp_path, hf)


def test_minicpm3_null_multipliers(tmp_path: Path) -> None:
    """``scale_depth`` / ``dim_model_base`` written as ``null``: no scaling (``sqrt(num_hidden_layers)``,
    ``hidden_size``), as ``MiniCPM3Config`` reads them; ``v_head_dim`` left out: ``hidden_size // heads``."""
    hf = checks.hf_model(_minicpm3(scale_depth=None, dim_model_base=None))
    hf.save_pretrained(tmp_path)
    _rewrite_config(tmp_path, lambda d: d.update(scale_depth=None, dim_model_base=None, v_head_dim=None))
    _same_as_transformers(tmp_path, hf)


def test_youtu_from_pretrained_zeroes_the_pad_row(tmp_path: Path) -> None:
    """transformers' ``YoutuPreTrainedModel._init_weights`` zeroes ``embed_tokens``' ``pad_token_id``
    row through ``weight.data`` (past the guard that spares loaded weights), so its
    ``from_pretrained`` runs with that row zeroed (the tied head's too) where the checkpoint holds
    other numbers; ``load_pretrained`` keeps the checkpoint's row (as the in-memory model has it)."""
    hf = checks.hf_model(_youtu())
    hf.save_pretrained(tmp_path)
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not again.model.embed_tokens.weight[0].any() and hf.model.embed_tokens.weight[0].any()
    ours = load_pretrained(tmp_path)
    assert torch.equal(ours.tok_emb.weight, hf.model.embed_tokens.weight)


@pytest.mark.parametrize("make,keys", [
    (lambda: _sarvam(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5),
     ("q_lora_rank", "n_group", "topk_group", "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob",
      "rope_interleave", "n_shared_experts", "hidden_act", "rms_norm_eps", "tie_word_embeddings")),
    (_youtu_no_pad, ("tie_word_embeddings", "rope_interleave", "attention_bias", "rms_norm_eps", "hidden_act")),
    (_minicpm3, ("scale_emb", "scale_depth", "dim_model_base", "v_head_dim", "mlp_bias", "tie_word_embeddings",
                 "rms_norm_eps", "attention_bias")),
    (lambda: _axk2(num_hidden_layers=4, mlp_layer_types=["dense", "sparse", "sparse", "sparse"], gated_norm_rank=16),
     ("mlp_layer_types", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "n_shared_experts",
      "attention_bias", "rms_norm_eps", "hidden_act", "tie_word_embeddings", "layer_types", "gated_norm_rank")),
    (lambda: _longcat(routed_scaling_factor=6.0, rms_norm_eps=1e-5),
     ("rope_parameters", "routed_scaling_factor", "rms_norm_eps", "attention_bias", "hidden_act",
      "tie_word_embeddings", "qk_head_dim", "num_key_value_heads")),
], ids=["sarvam", "youtu", "minicpm3", "axk2", "longcat"])
def test_config_json_with_keys_left_out(tmp_path: Path, make: Any, keys: tuple[str, ...]) -> None:
    """Keys left out of ``config.json`` read as the config classes' defaults (as ``from_pretrained``)."""
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


def test_axk2_legacy_layer_keys(tmp_path: Path) -> None:
    """A ``config.json`` with ``first_k_dense_replace`` / ``moe_layer_freq`` instead of
    ``mlp_layer_types`` (``AXK2Config`` derives the kinds: sparse where ``i >= first`` and ``i % freq == 0``)."""
    hf = checks.hf_model(_axk2(num_hidden_layers=4, mlp_layer_types=["dense", "dense", "sparse", "dense"]))
    hf.save_pretrained(tmp_path)

    def legacy(data: dict[str, Any]) -> None:
        data.pop("mlp_layer_types")
        data.update(first_k_dense_replace=1, moe_layer_freq=2)  # sparse at 2 only

    _rewrite_config(tmp_path, legacy)
    _same_as_transformers(tmp_path, hf)


def test_longcat_other_config_names_and_mtp(tmp_path: Path) -> None:
    """A ``config.json`` naming the sizes by ``LongcatFlashConfig``'s aliases (``num_hidden_layers``:
    twice ``num_layers``; ``intermediate_size``, ``moe_intermediate_size``, ``num_experts_per_tok``,
    ``num_local_experts``) and a checkpoint with the multi-token-prediction module (``model.mtp.*``,
    dropped by transformers): read as transformers reads them."""
    hf = checks.hf_model(_longcat())
    hf.save_pretrained(tmp_path)
    names = {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size",
             "expert_ffn_hidden_size": "moe_intermediate_size", "moe_topk": "num_experts_per_tok",
             "n_routed_experts": "num_local_experts"}

    def aliases(data: dict[str, Any]) -> None:
        for name, alias in names.items():
            data[alias] = data.pop(name) * (2 if alias == "num_hidden_layers" else 1)

    _rewrite_config(tmp_path, aliases)
    path = tmp_path / "model.safetensors"
    sd = dict(safetensors_torch.load_file(str(path)))
    sd.update({"model.mtp.layers.0.eh_proj.weight": torch.ones(64, 128), "model.mtp.norm.weight": torch.ones(64)})
    safetensors_torch.save_file(sd, str(path), metadata={"format": "pt"})
    _same_as_transformers(tmp_path, hf)


@pytest.mark.parametrize("make,stray", [(_longcat, False), (_minicpm3, True), (_axk2, False)],
                         ids=["longcat", "minicpm3", "axk2"])
def test_stray_rope_interleave_is_ignored(tmp_path: Path, make: Any, stray: bool) -> None:
    """A ``config.json`` with a ``rope_interleave`` its config class does not have: LongCat-Flash and
    A.X-K2 rotate adjacent pairs, MiniCPM3 split halves, whatever it says (as transformers)."""
    hf = checks.hf_model(make())
    hf.save_pretrained(tmp_path)
    _rewrite_config(tmp_path, lambda d: d.update(rope_interleave=stray))
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).logits) <= checks.TOL


@pytest.mark.parametrize("make", [_axk2, _longcat], ids=["axk2", "longcat"])
def test_null_query_latent_is_refused(tmp_path: Path, make: Any) -> None:
    """``q_lora_rank: null`` (only a ``config.json`` can say it: the config classes reject it) is refused by name."""
    checks.hf_model(make()).save_pretrained(tmp_path)
    _rewrite_config(tmp_path, lambda d: d.update(q_lora_rank=None))
    with pytest.raises(UnsupportedConfigError, match="q_lora_rank"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("model,make,key,value,named", [
    ("sarvam", _sarvam, "hidden_act", "gelu", "hidden_act"),
    ("sarvam", _sarvam, "num_key_value_heads", 2, "num_key_value_heads"),
    ("sarvam", _sarvam, "moe_layer_freq", 2, "moe_layer_freq"),
    ("sarvam", _sarvam, "rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "dynamic"),
    ("youtu", _youtu, "num_key_value_heads", 2, "num_key_value_heads"),
    ("youtu", _youtu, "hidden_act", "relu", "hidden_act"),
    ("youtu", _youtu, "rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, "longrope"),
    ("cpm3", _minicpm3, "num_key_value_heads", 2, "num_key_value_heads"),
    ("cpm3", _minicpm3, "scale_emb", 0, "scale_emb"),
    ("cpm3", _minicpm3, "dim_model_base", 0, "dim_model_base"),
    ("cpm3", _minicpm3, "pretraining_tp", 2, "pretraining_tp"),
    ("cpm3", _minicpm3, "rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ("axk2", _axk2, "hidden_act", "gelu", "hidden_act"),
    ("axk2", _axk2, "num_key_value_heads", 2, "num_key_value_heads"),
    ("axk2", _axk2, "index_head_dim", 4, "index_head_dim"),
    ("axk2", _axk2, "rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "dynamic"),
    ("axk2", _axk2, "n_group", 3, "n_group=3"),
    ("longcat", _longcat, "num_key_value_heads", 2, "num_key_value_heads"),
    ("longcat", _longcat, "head_dim", 4, "head_dim"),
    ("longcat", _longcat, "qk_head_dim", 20, "qk_head_dim"),
    ("longcat", _longcat, "hidden_act", "gelu", "hidden_act"),
    ("longcat", _longcat, "routed_scaling_factor", 0.0, "routed_scaling_factor"),
    ("longcat", _longcat, "rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "dynamic"),
])
def test_unsupported_options_are_refused(model: str, make: Any, key: str, value: Any, named: str) -> None:
    cls = {"sarvam": T.DeepseekV3ForCausalLM, "youtu": T.YoutuForCausalLM, "cpm3": T.MiniCPM3ForCausalLM,
           "axk2": T.AXK2ForCausalLM, "longcat": T.LongcatFlashForCausalLM}[model]
    checks.check_refused(cls, make, key, value, named)
