"""DeepSeek-V4 through ``from_hf`` / ``load_pretrained``: sliding MQA layers with sinks and a grouped
output projection, heavily compressed (HCA) and compressed sparse (CSA, Lightning-Indexer-selected)
layers, hash-routed and top-k routed clamped-SwiGLU MoE, all on ``hc_mult`` residual streams mixed
by hyper-connections; equal to transformers' eager (logits of ``DeepseekV4ForCausalLM``, hidden
states of ``DeepseekV4Model``, greedy generation), cached decode equal to the full forward and to
transformers' own cached calls, packed sequences, saved folders (the checkpoint's names), config
files without defaults or with the legacy keys, refusals by name.

The hash layers' ``tid2eid`` tables (zeros at init) are filled at random (:func:`_random_tables`).
``_config`` keeps ``index_topk = 3`` of the up to 7 closed CSA windows of the test sequences, so the
indexer decides what each query sees."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import UnsupportedConfigError, from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.deepseek_v4 import (  # noqa: E402
    Compressor,
    DeepseekV4LM,
    LightningIndexer,
    V4Attention,
    V4MoE,
)

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

S, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def _kw(**kw: Any) -> dict[str, Any]:
    """4 layers (sliding, CSA, HCA, CSA), a hash layer then top-k layers of 8 experts, 3 streams, CSA
    windows of 4 and HCA windows of 8, a window of 6 keys, 2 output groups, head_dim 32 != 64 / 4,
    a rotary width of 8, SwiGLU limits small enough to clip."""
    return {"vocab_size": checks.V, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
            "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 24, "partial_rotary_factor": 0.25,
            "num_experts_per_tok": 2, "n_routed_experts": 8, "layer_types": [S, CSA, HCA, CSA],
            "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "compress_rates": {CSA: 4, HCA: 8},
            "hc_mult": 3, "hc_sinkhorn_iters": 5, "sliding_window": 6, "o_groups": 2, "o_lora_rank": 16,
            "index_n_heads": 8, "index_head_dim": 16, "index_topk": 3, "swiglu_limit": 0.5, "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 256, **kw}


def _config(**kw: Any) -> Any:
    return T.DeepseekV4Config(**_kw(**kw))


def _sigmoid_yarn() -> Any:
    """Sigmoid scores, a yarn ``compress`` rope, tied embeddings, 4 output groups, 2 streams, CSA
    windows of 2 and HCA windows of 4, a window of 3 keys, every MoE layer hashed, other eps (``hc_eps``
    large enough to matter)."""
    return _config(scoring_func="sigmoid", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 64},
                   tie_word_embeddings=True, o_groups=4, o_lora_rank=8, hc_mult=2, hc_sinkhorn_iters=3,
                   compress_rates={CSA: 2, HCA: 4}, sliding_window=3, mlp_layer_types=["hash_moe"] * 4,
                   layer_types=[HCA, CSA, S, CSA], rms_norm_eps=1e-5, hc_eps=0.05, routed_scaling_factor=2.5)


def _default_schedules() -> Any:
    """transformers' default schedules (HCA, HCA, HCA, CSA; 3 hash layers), an indexer keeping every
    closed window (no selection: cached decode equals the full forward exactly)."""
    return T.DeepseekV4Config(**{k: v for k, v in _kw(index_topk=64, partial_rotary_factor=0.5).items()
                                 if k not in ("layer_types", "mlp_layer_types")})


def _fill_tables(model: Any, seed: int = 0) -> Any:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, model.config.n_routed_experts, b.shape, generator=g))
    return model


@pytest.fixture(autouse=True)
def _random_tables(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every transformers model the shared checks build gets random hash tables."""
    perturbed = checks.perturbed
    monkeypatch.setattr(checks, "perturbed", lambda model, seed=0, scale=0.1: _fill_tables(
        perturbed(model, seed, scale), seed))
    yield


def _base(make: Any = _config) -> Any:
    return checks.hf_model(make(), T.AutoModel)


class TestDeepseekV4(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_sigmoid_yarn, _default_schedules)


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16}])
def test_scaled_compress_rope_logits_equal_transformers(rope: dict[str, Any]) -> None:
    """The ``compress`` rope's other static scalings (yarn is in ``TestDeepseekV4.cases``)."""
    checks.check_logits(lambda: _config(rope_parameters=dict(rope)))


def test_layer_structure() -> None:
    ours = from_hf(checks.hf_model(_config()))
    assert isinstance(ours, DeepseekV4LM) and ours.streams == 3
    attns = [b.attn for b in ours.blocks]
    assert all(isinstance(a, V4Attention) for a in attns)
    assert attns[0].compressor is None and attns[0].indexer is None
    assert attns[1].compressor.overlap and attns[1].compressor.rate == 4 and isinstance(attns[1].indexer,
                                                                                       LightningIndexer)
    assert isinstance(attns[2].compressor, Compressor) and not attns[2].compressor.overlap
    assert attns[2].compressor.rate == 8 and attns[2].indexer is None
    assert attns[0].rope.inv_freq[0] == 1.0 and attns[1].rope is attns[2].compressor.rope
    ffns = [b.ffn for b in ours.blocks]
    assert all(isinstance(f, V4MoE) for f in ffns) and ffns[0].tid2eid is not None and ffns[0].score_bias is None
    assert ffns[1].tid2eid is None and ffns[1].score_bias is not None and ffns[1].scoring == "sqrtsoftplus"
    assert ffns[1].limit == 0.5 and ffns[1].shared_expert.limit == 0.5


@pytest.mark.parametrize("make", [_config, _sigmoid_yarn])
def test_cached_decode_equals_transformers_cached_decode(make: Any) -> None:
    """A prefill, a 4-token chunk, then one token at a time, against transformers' own cache.

    transformers' cached calls differ from its full forward where the indexer's top-k meets a tie
    (entries scored exactly 0: every head's ReLU at 0) and breaks it over the windows closed so far
    instead of the whole sequence's; attnzoo follows it in each (cached here, full in
    ``test_logits_equal_transformers``), and elsewhere cached decode equals the full forward
    (``test_cached_decode_equals_full_forward``: no selection; :func:`test_cached_decode_equals_full_forward_when_no_ties`)."""
    hf = _base(make)
    ours = from_hf(hf)
    x, n = checks.tokens(26), 26
    spans = [(0, 9), (9, 13)] + [(t, t + 1) for t in range(13, n)]
    with torch.no_grad():
        cache = T.DynamicCache(config=hf.config)
        ref = torch.cat([hf(input_ids=x[:, a:b], cache=cache, use_cache=True).last_hidden_state for a, b in spans], 1)
        ours_cache = ours.init_cache(2, n)
        got = torch.cat([ours(x[:, a:b], cache=ours_cache) for a, b in spans], dim=1)
    assert checks.rel(got, ref) <= checks.TOL


def test_transformers_cached_decode_and_full_forward_differ_at_an_index_tie() -> None:
    """A case (these weights, these tokens) where transformers' cached calls differ from its own full
    forward: at token 19 of row 0 two of the 5 closed CSA windows score exactly 0 for ``index_topk=3``
    and ``topk`` over 5 entries (decode) keeps the other one than over all 6 (full forward).
    attnzoo's cached decode is transformers' cached decode, its full forward transformers' full forward."""
    hf = _fill_tables(checks.hf_model(_config()), seed=3)
    ours = from_hf(hf)
    x, n = checks.tokens(26), 26
    spans = [(0, 9), (9, 13)] + [(t, t + 1) for t in range(13, n)]
    with torch.no_grad():
        full = hf(input_ids=x).logits
        cache = T.DynamicCache(config=hf.config)
        cached = torch.cat([hf(input_ids=x[:, a:b], cache=cache, use_cache=True).logits for a, b in spans], 1)
        ours_cache = ours.init_cache(2, n)
        ours_cached = torch.cat([ours(x[:, a:b], cache=ours_cache) for a, b in spans], 1)
        ours_full = ours(x)
    differs = (cached - full).abs().amax(-1) > 1e-3
    assert differs.nonzero().tolist() == [[0, 19]]
    assert checks.rel(ours_full, full) <= checks.TOL and checks.rel(ours_cached, cached) <= checks.TOL


def test_padded_cached_decode_equals_transformers() -> None:
    """A left-padded batch decoded as ``generate`` runs it (positions counting real tokens, pads at 0),
    against transformers' cached calls: the compressed windows count tokens, padding included, while
    the causality of a prefill's entries follows the positions, and one query token sees every closed
    HCA window (transformers' l. 443), which the shifted row meets at tokens 15-17."""
    hf = checks.hf_model(_config())
    ours = from_hf(hf)
    x, mask = checks.padded(20, pad=3)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    spans = [(0, 10)] + [(t, t + 1) for t in range(10, 20)]
    with torch.no_grad():
        cache = T.DynamicCache(config=hf.config)
        ref = torch.cat([hf(input_ids=x[:, a:b], attention_mask=mask[:, :b], position_ids=pos[:, a:b], cache=cache,
                            use_cache=True).logits for a, b in spans], dim=1)
        ours_cache = ours.init_cache(2, 20)
        got = torch.cat([ours(x[:, a:b], cache=ours_cache, positions=pos[:, a:b], attention_mask=mask[:, :b].bool())
                         for a, b in spans], dim=1)
    real = mask.bool()
    assert checks.rel(got[real], ref[real]) <= checks.TOL


def test_cached_decode_equals_full_forward_when_no_ties() -> None:
    """With the selecting indexer (``index_topk=3``) on sequences where no top-k tie occurs (a
    16-head indexer), prefill + chunks + single tokens equal the full forward."""
    ours = from_hf(checks.hf_model(_config(index_n_heads=16)))
    x, n = checks.tokens(22, seed=5), 22
    with torch.no_grad():
        full = ours(x)
        cache = ours.init_cache(2, n)
        got = torch.cat([ours(x[:, a:b], cache=cache) for a, b in [(0, 5), (5, 11)] + [(t, t + 1) for t in
                                                                                   range(11, n)]], 1)
    assert checks.rel(got, full) <= checks.TOL


def test_bfloat16_equals_transformers_bfloat16(tmp_path: Path) -> None:
    """A float32 folder loaded in bfloat16: transformers keeps its ``_keep_in_fp32_modules_strict``
    (norms, hyper-connections, sinks, position biases) in float32, and so does the conversion, with
    transformers' order of casts (the norms' weight before the cast, the sinks promoting the scores):
    the logits are transformers' bfloat16 ones (measured: identical)."""
    checks.hf_model(_config()).save_pretrained(tmp_path)
    hf = T.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    x = checks.tokens(20)
    with torch.no_grad():
        ref = hf(input_ids=x).logits.float()
        for ours in (from_hf(hf), load_pretrained(tmp_path, dtype=torch.bfloat16)):
            wide = {n for n, p in ours.named_parameters() if p.dtype == torch.float32}
            assert {"blocks.1.attn.q_a_norm.weight", "blocks.1.attn.compressor.position_bias", "blocks.0.attn_hc.fn",
                    "blocks.0.ffn_norm.weight", "blocks.1.attn.sinks", "norm.weight", "hc_head.hc_fn"} <= wide
            assert ours.blocks[1].attn.q_b_proj.weight.dtype == torch.bfloat16
            assert checks.rel(ours(x).float(), ref) <= 1e-6


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_config)


def test_packed_training_gradients_equal_each_alone() -> None:
    """Float64 training: the gradients of a packed batch equal the sequences' one at a time; the
    indexers' weights get none (their top-k selection is discrete, as in transformers)."""
    checks.check_packed_gradients_equal_each_alone(_sigmoid_yarn, no_gradient=".indexer.")


def test_saved_folder_uses_checkpoint_names(tmp_path: Path) -> None:
    """``save_pretrained`` writes the checkpoint's names (``attn.wq_a``, ``ffn.experts.{e}.w1``,
    ``hc_attn_fn``, ``head.weight``); the base model's folder (no head) loads too, and ``mtp.*``
    weights are dropped."""
    hf = _base()
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    sd = dict(safetensors_torch.load_file(str(path)))
    assert {"layers.1.attn.wq_a.weight", "layers.1.ffn.experts.0.w1.weight", "layers.0.hc_attn_fn",
            "layers.1.attn.indexer.compressor.ape"} <= set(sd)
    sd["mtp.0.eh_proj.weight"] = torch.ones(3, 3)
    safetensors_torch.save_file(sd, str(path), metadata={"format": "pt"})
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).last_hidden_state) <= checks.TOL


def test_config_json_with_keys_left_out(tmp_path: Path) -> None:
    """The schedules, rope dicts and hyper-connection settings from transformers' defaults."""
    hf = checks.hf_model(_config(layer_types=None, mlp_layer_types=None))
    checks.check_folder_without_keys(hf, tmp_path, (
        "layer_types", "mlp_layer_types", "rope_parameters", "partial_rotary_factor", "hc_eps", "hc_sinkhorn_iters",
        "rms_norm_eps", "scoring_func", "routed_scaling_factor", "swiglu_limit", "compress_rope_theta"))


def test_config_json_with_legacy_keys(tmp_path: Path) -> None:
    """``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, ``compress_rate_csa`` /
    ``compress_rate_hca`` and a flat yarn ``rope_parameters``, as older configs ship them."""
    hf = checks.hf_model(_config())
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    for key in ("layer_types", "mlp_layer_types", "partial_rotary_factor", "compress_rates"):
        data.pop(key)
    data.update(compress_ratios=[0, 4, 128, 4], num_hash_layers=1, qk_rope_head_dim=16, compress_rate_hca=8,
                rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32})
    path.write_text(json.dumps(data))
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.layer_types == [S, CSA, HCA, CSA] and again.config.qk_rope_head_dim == 16
    x = checks.tokens(20)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), again(input_ids=x).logits) <= checks.TOL


@pytest.mark.parametrize(("key", "value", "named"), [
    ("scoring_func", "softmax", "scoring_func='softmax'"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("mlp_bias", True, "mlp_bias=True"),
    ("num_key_value_heads", 2, "num_key_value_heads=2"),
    ("swiglu_limit", None, "swiglu_limit=None"),
    ("o_groups", 3, "o_groups=3"),
    ("index_head_dim", 4, "index_head_dim=4"),
    ("partial_rotary_factor", 0.1, "partial_rotary_factor=0.1"),
    ("compress_rates", {CSA: 0, HCA: 8}, "compress_rates="),
    ("rope_parameters", {"main": {"rope_type": "default", "rope_theta": 1e4},
                         "compress": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type='dynamic'"),
    ("rope_parameters", {"main": {"rope_type": "default", "rope_theta": 1e4},
                         "compress": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                                      "long_factor": [2.0] * 4}}, "rope_type='longrope'"),
    ("layer_types", [S, CSA, "full_attention", CSA], "layer type 'full_attention'"),
    ("mlp_layer_types", ["hash_moe", "dense", "moe", "moe"], "mlp_layer_types"),
])
def test_unsupported_options_are_named(key: str, value: Any, named: str) -> None:
    hf = T.DeepseekV4Model(_config())
    object.__setattr__(hf.config, key, value)  # past the strict config's checks (a hand-written config.json)
    with pytest.raises(UnsupportedConfigError, match=named):
        from_hf(hf)
