"""The classic decoders through ``from_hf`` (``families/classic.py``): Falcon (multi-query, grouped
new-architecture and interleaved ``query_key_value``; sequential, one-norm and two-norm parallel
layers; RoPE or ALiBi rounded in bfloat16), GPT-BigCode (multi-query ``c_attn``, learned
positions), BLOOM (embedding LayerNorm, ALiBi, residuals after the norms), MPT (its own ALiBi
slopes, ``clip_qkv``, ``softmax_scale``), OPT (positions offset by 2, pre/post-norm, ``project_in``
/ ``project_out``) and GPT-Neo (global / local layers, unscaled scores). Equal to transformers'
eager (see ``hf_family_checks``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_hf_dense_2 as dense2  # noqa: E402

import hf_family_checks as checks  # noqa: E402
from attnzoo import alibi_slopes  # noqa: E402
from attnzoo.interop import (  # noqa: E402
    SUPPORTED_ARCHITECTURES,
    CheckpointFormatError,
    UnsupportedConfigError,
    from_hf,
)
from attnzoo.models.families.classic import (  # noqa: E402
    DISPATCH,
    FalconAlibiAttention,
    ResidualNormBlock,
    grouped_rows,
)
from attnzoo.models.families.dense import ParallelBlock  # noqa: E402
from attnzoo.models.families.neox import TwoNormParallelBlock  # noqa: E402
from attnzoo.models.hf.convert import BUILDERS  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS = {"vocab_size": checks.V, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


# --------------------------------------------------------------------------- configs
def _falcon(**kw: Any) -> Any:
    """Falcon-7B's shape: multi-query, one-norm parallel layers, RoPE, no biases, tied."""
    return T.FalconConfig(**{**TOKENS, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                             "ffn_hidden_size": 96, "max_position_embeddings": 64, **kw})


def _falcon_40b() -> Any:
    """Falcon-40B's: the new architecture (2 key/value groups of 2 queries), two-norm parallel layers,
    biases, untied, linear-scaled RoPE, ReLU, eps 1e-3."""
    return _falcon(new_decoder_architecture=True, num_kv_heads=2, bias=True, tie_word_embeddings=False,
                   activation="relu", layer_norm_epsilon=1e-3,
                   rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0})


def _falcon2() -> Any:
    """Falcon2-11B's: the new architecture with one norm (``num_ln_in_parallel_attn=1``), one key/value
    group of 4 queries."""
    return _falcon(new_decoder_architecture=True, num_kv_heads=1, num_ln_in_parallel_attn=1)


def _falcon_rw() -> Any:
    """Falcon-RW's: ALiBi, interleaved ``[H, 3, D]`` heads (16 of 4: slopes that are not powers of two,
    so the bfloat16 rounding of the bias shows), sequential layers, biases."""
    return _falcon(alibi=True, multi_query=False, parallel_attn=False, bias=True, num_attention_heads=16)


def _falcon_mha() -> Any:
    """Interleaved heads with RoPE in one-norm parallel layers, the tanh GELU, untied."""
    return _falcon(multi_query=False, activation="gelu_pytorch_tanh", tie_word_embeddings=False)


def _bigcode(**kw: Any) -> Any:
    """SantaCoder / StarCoder's shape: multi-query, learned positions, tied, tanh GELU."""
    return T.GPTBigCodeConfig(**{**TOKENS, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64, "n_inner": 96,
                                 **kw})


def _bigcode_other() -> Any:
    """Interleaved ``[H, 3, D]`` heads, unscaled scores, exact GELU, untied, eps 1e-3."""
    return _bigcode(multi_query=False, scale_attn_weights=False, activation_function="gelu",
                    tie_word_embeddings=False, layer_norm_epsilon=1e-3)


def _bloom(**kw: Any) -> Any:
    """BLOOM's shape: 4 heads, tied."""
    return T.BloomConfig(**{**TOKENS, "hidden_size": 64, "n_layer": 2, "n_head": 4, **kw})


def _bloom_other() -> Any:
    """6 heads (ALiBi's slopes for a head count that is not a power of two), the residuals after the
    norms, untied, 3 layers, eps 1e-3."""
    return _bloom(hidden_size=48, n_head=6, n_layer=3, apply_residual_connection_post_layernorm=True,
                  tie_word_embeddings=False, layer_norm_epsilon=1e-3)


def _mpt(**kw: Any) -> Any:
    """MPT-7B's shape: 4 heads, ALiBi, no biases, tied."""
    return T.MptConfig(**{**TOKENS, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64, **kw})


def _mpt_other() -> Any:
    """6 heads (MPT's slopes for a head count that is not a power of two), ``clip_qkv`` 0.3 (it clamps
    here), ``softmax_scale`` 0.2, untied, 3 layers."""
    return _mpt(d_model=48, n_heads=6, n_layers=3, tie_word_embeddings=False,
                attn_config={"clip_qkv": 0.3, "softmax_scale": 0.2})


def _opt(**kw: Any) -> Any:
    """OPT-125m's shape: pre-norm, biases, ReLU, tied (no dropout: the packed gradients are compared
    in training mode)."""
    return T.OPTConfig(**{**TOKENS, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "ffn_dim": 96, "max_position_embeddings": 64, "dropout": 0.0, **kw})


def _opt_350m() -> Any:
    """OPT-350m's: post-norm layers (no final norm), ``project_in`` / ``project_out`` to a 32-wide
    embedding, tied."""
    return _opt(do_layer_norm_before=False, word_embed_proj_dim=32)


def _opt_other() -> Any:
    """Pre-norm with ``project_in`` / ``project_out``, no biases, non-parametric LayerNorms, GELU,
    untied."""
    return _opt(word_embed_proj_dim=48, enable_bias=False, layer_norm_elementwise_affine=False,
                activation_function="gelu", tie_word_embeddings=False)


def _opt_no_final() -> Any:
    """Pre-norm without the final LayerNorm (``_remove_final_layer_norm``)."""
    return _opt(_remove_final_layer_norm=True)


def _neo(**kw: Any) -> Any:
    """GPT-Neo's shape: global / local layers (a window of 5 keys), tied, ``gelu_new``."""
    return T.GPTNeoConfig(**{**TOKENS, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "window_size": 5,
                             "attention_types": [[["global", "local"], 1]], "max_position_embeddings": 64, **kw})


def _neo_other() -> Any:
    """3 layers local, global, local (a window of 3), intermediate 96, exact GELU, untied."""
    return _neo(num_layers=3, window_size=3, attention_types=[[["local"], 1], [["global", "local"], 1]],
                intermediate_size=96, activation_function="gelu", tie_word_embeddings=False)


ALL: dict[str, Callable[[], Any]] = {
    "falcon": _falcon, "falcon_40b": _falcon_40b, "falcon2": _falcon2, "falcon_rw": _falcon_rw,
    "falcon_mha": _falcon_mha, "gpt_bigcode": _bigcode, "gpt_bigcode_other": _bigcode_other, "bloom": _bloom,
    "bloom_other": _bloom_other, "mpt": _mpt, "mpt_other": _mpt_other, "opt": _opt, "opt_350m": _opt_350m,
    "opt_other": _opt_other, "opt_no_final": _opt_no_final, "gpt_neo": _neo, "gpt_neo_other": _neo_other}


# --------------------------------------------------------------------------- the family checks
class _MaskPositions(dense2.TestHunYuanDenseV1):
    """Learned absolute positions: transformers' GPT-BigCode / GPT-Neo ``forward`` counts them from the
    first slot (left padding included), ``generate`` and attnzoo from the attention mask; the logits
    and hidden states are compared on a left-padded batch with the mask's positions given (HunYuan's
    checks, ``test_hf_dense_2``)."""


class TestFalcon(checks.FamilyChecks):
    config = staticmethod(_falcon)
    cases = (_falcon_40b, _falcon2, _falcon_mha, _falcon_rw)

    def test_greedy_generation_identical_every_layout(self) -> None:
        for make in self.cases:
            checks.check_generation(make)


class TestGPTBigCode(_MaskPositions):
    config = staticmethod(_bigcode)
    cases = (_bigcode_other,)


class TestBloom(checks.FamilyChecks):
    config = staticmethod(_bloom)
    cases = (_bloom_other,)


class TestMpt(checks.FamilyChecks):
    config = staticmethod(_mpt)
    cases = (_mpt_other,)


class TestOPT(checks.FamilyChecks):
    config = staticmethod(_opt)
    cases = (_opt_other, _opt_no_final, _opt_350m)

    def test_greedy_generation_identical_post_norm_projected(self) -> None:
        checks.check_generation(_opt_350m)


class TestGPTNeo(_MaskPositions):
    config = staticmethod(_neo)
    cases = (_neo_other,)


# --------------------------------------------------------------------------- structure
def test_every_family_is_dispatched() -> None:
    for t in ("falcon", "gpt_bigcode", "bloom", "mpt", "opt", "gpt_neo"):
        assert BUILDERS[t] == (DISPATCH[t].name, DISPATCH[t].convert)
        assert all(c in SUPPORTED_ARCHITECTURES for c in DISPATCH[t].classes)


def test_parameter_counts_equal_transformers() -> None:
    """OPT's position table has two rows fewer (the offset rows: only padded slots read them)."""
    for name, make in ALL.items():
        hf = checks.hf_model(make())
        n_ours, n_hf = (sum(p.numel() for p in m.parameters()) for m in (from_hf(hf), hf))
        offset = 2 * hf.config.hidden_size if name.startswith("opt") else 0
        assert n_ours == n_hf - offset, name


def test_structure() -> None:
    blocks = {name: from_hf(checks.hf_model(make())).blocks for name, make in ALL.items()}
    assert all(type(b) is ParallelBlock and b.attn.num_kv_heads == 1 for b in blocks["falcon"])
    assert all(type(b) is TwoNormParallelBlock and b.attn.num_kv_heads == 2 for b in blocks["falcon_40b"])
    assert all(type(b) is ParallelBlock for b in blocks["falcon2"])
    rw = blocks["falcon_rw"][0]
    assert type(rw.attn) is FalconAlibiAttention and rw.attn.rope is None and rw.ffn_norm is not None
    assert blocks["gpt_bigcode"][0].attn.num_kv_heads == 1 and blocks["gpt_bigcode_other"][0].attn.scale == 1.0
    assert all(type(b) is ResidualNormBlock and b.attn.alibi for b in blocks["bloom_other"])
    mpt = blocks["mpt_other"][0].attn
    assert mpt.alibi and mpt.qkv_proj.clip == 0.3 and mpt.scale == 0.2 and mpt.qkv_proj.bias is None
    assert not blocks["opt_350m"][0].norm_first and blocks["opt"][0].norm_first
    assert [b.attn.window for b in blocks["gpt_neo_other"]] == [(2, 2), None, (2, 2)]
    neo = blocks["gpt_neo"][0].attn
    assert neo.scale == 1.0 and neo.qkv_proj.bias is None and neo.out_proj.bias is not None
    opt = from_hf(checks.hf_model(_opt_350m()))
    assert isinstance(opt.norm, torch.nn.Sequential) and isinstance(opt.norm[0], torch.nn.Identity)
    assert opt.tie_embeddings and opt.lm_head.weight.shape == (checks.V, 32) and opt.pos_emb.weight.shape[0] == 64


def test_grouped_rows() -> None:
    """The row order of the ``[kv, g + 2, D]`` layouts into ``[q; k; v]``."""
    assert grouped_rows(2, 2, 1).tolist() == [0, 1, 4, 5, 2, 6, 3, 7]
    assert grouped_rows(2, 1, 2).tolist() == [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]


def test_mpt_slopes_are_the_papers() -> None:
    """transformers' MPT slopes (``alibi_bias_max`` 8: odd-indexed, then even-indexed slopes of the
    next power of two) are :func:`~attnzoo.alibi_slopes` for every head count."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    for heads in range(1, 70):
        slopes = -build_mpt_alibi_tensor(heads, 2)[:, 0, 0]  # [H]: the bias of the key one step back
        torch.testing.assert_close(slopes, alibi_slopes(heads), rtol=2e-7, atol=0)


def test_falcon_alibi_rounding_matters() -> None:
    """With 16 heads the slopes are not powers of two: transformers' bfloat16 product differs from a
    float ALiBi by far more than the tolerance, and :class:`FalconAlibiAttention` reproduces it."""
    attn = from_hf(checks.hf_model(_falcon_rw())).blocks[0].attn
    bias = attn._key_bias(None, 40, torch.zeros(1, 1, 64))[0, :, 0]  # [H, Nk]
    float_bias = alibi_slopes(16)[:, None] * torch.arange(40) / attn.head_dim ** 0.5
    assert (bias - float_bias).abs().max() > 1e-3


def test_falcon_alibi_takes_only_a_key_mask() -> None:
    attn = from_hf(checks.hf_model(_falcon_rw())).blocks[0].attn
    x = torch.randn(2, 5, 64)
    with pytest.raises(ValueError, match="bool key mask"):
        attn(x, mask=torch.zeros(2, 1, 5, 5))


# --------------------------------------------------------------------------- transformers' own paths
def test_transformers_forward_counts_positions_from_the_first_slot() -> None:
    """GPT-BigCode's and GPT-Neo's ``forward`` without ``position_ids`` counts padded slots (``arange``),
    ``generate`` does not (it passes positions from the mask): attnzoo follows ``generate``."""
    for make in (_bigcode, _neo):
        hf = checks.hf_model(make())
        x, mask = checks.padded(20)
        with torch.no_grad():
            plain = hf(input_ids=x, attention_mask=mask).logits
            counted = hf(input_ids=x, attention_mask=mask, position_ids=dense2._mask_positions(mask)).logits
        assert checks.rel(plain[0, 5:], counted[0, 5:]) > 1e-2 and torch.equal(plain[1], counted[1])


def test_transformers_mpt_ignores_alibi_bias_max() -> None:
    """transformers' ``MptModel`` builds its slopes with ``alibi_bias_max`` 8 whatever the config says
    (so attnzoo refuses another value rather than follow either)."""
    hf = checks.hf_model(_mpt())
    x = checks.tokens(12)
    with torch.no_grad():
        ref = hf(input_ids=x).logits
        hf.config.attn_config.alibi_bias_max = 16
        assert torch.equal(hf(input_ids=x).logits, ref)


def test_mpt_clip_qkv_matters() -> None:
    hf = checks.hf_model(_mpt_other())
    x = checks.tokens(12)
    with torch.no_grad():
        ref = hf(input_ids=x).logits
        hf.config.attn_config.clip_qkv = None
        assert checks.rel(from_hf(hf)(x), ref) > 1e-3


@pytest.mark.parametrize("name", ["gpt_bigcode_other", "bloom_other", "mpt_other", "opt_other", "gpt_neo_other"])
def test_greedy_generation_identical_other_configs(name: str) -> None:
    checks.check_generation(ALL[name])


@pytest.mark.parametrize("name", ["falcon", "falcon_40b", "falcon_rw", "gpt_bigcode", "gpt_bigcode_other", "opt",
                                  "opt_350m"])
def test_register_equals_eager(name: str) -> None:
    """transformers' own Falcon (RoPE and ALiBi), GPT-BigCode and OPT served by ``attnzoo.hf.register()``
    (Falcon's ALiBi path edits the mask ``create_causal_mask`` returns with ``torch.where``: attnzoo's
    lazy mask answers torch functions with its dense form; BLOOM, MPT and GPT-Neo have their own
    attention code, no attention interface)."""
    checks.check_register_equals_eager(checks.hf_model(ALL[name]()))


@pytest.mark.parametrize(("model_class", "make"), [
    (T.FalconForSequenceClassification, _falcon_40b), (T.GPTBigCodeForSequenceClassification, _bigcode),
    (T.BloomForSequenceClassification, _bloom), (T.MptForSequenceClassification, _mpt),
    (T.OPTForSequenceClassification, _opt_350m), (T.GPTNeoForSequenceClassification, _neo)],
    ids=["falcon", "gpt_bigcode", "bloom", "mpt", "opt", "gpt_neo"])
def test_sequence_classification_heads(model_class: Any, make: Callable[[], Any]) -> None:
    """``*ForSequenceClassification``: the ``score`` head per token (transformers reads the last one)."""
    config = make()
    config.num_labels = 3
    torch.manual_seed(0)
    hf = checks.perturbed(model_class._from_config(config, attn_implementation="eager"))
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(from_hf(hf)(x)[:, -1], hf(input_ids=x).logits) <= checks.TOL


# --------------------------------------------------------------------------- packing
@pytest.mark.parametrize("name", ["falcon", "falcon_40b", "falcon_rw", "gpt_bigcode_other", "bloom_other",
                                  "mpt_other", "opt_350m", "opt_other", "gpt_neo_other"])
def test_packed_sequences_equal_each_alone(name: str) -> None:
    checks.check_packed_equals_each_alone(ALL[name])
    checks.check_packed_gradients_equal_each_alone(ALL[name])


# --------------------------------------------------------------------------- config.json, refusals
FOLDERS: dict[str, tuple[Callable[[], Any], tuple[str, ...]]] = {
    "falcon": (lambda: _falcon(rope_parameters=None, ffn_hidden_size=None),
               ("alibi", "new_decoder_architecture", "multi_query", "parallel_attn", "bias", "layer_norm_epsilon",
                "activation", "tie_word_embeddings", "rope_parameters", "ffn_hidden_size", "num_kv_heads",
                "num_ln_in_parallel_attn", "max_position_embeddings")),
    "falcon_40b": (lambda: _falcon(new_decoder_architecture=True, num_kv_heads=2),
                   ("num_ln_in_parallel_attn", "multi_query", "parallel_attn", "bias")),
    "gpt_bigcode": (lambda: _bigcode(n_inner=None, n_positions=1024),
                    ("n_inner", "n_positions", "activation_function", "layer_norm_epsilon", "scale_attn_weights",
                     "multi_query", "add_cross_attention", "tie_word_embeddings")),
    "bloom": (_bloom, ("layer_norm_epsilon", "apply_residual_connection_post_layernorm", "tie_word_embeddings")),
    "mpt": (lambda: _mpt(max_seq_len=2048),
            ("expansion_ratio", "max_seq_len", "layer_norm_epsilon", "no_bias", "norm_type", "tie_word_embeddings",
             "attn_config", "logit_scale")),
    "opt": (lambda: _opt(max_position_embeddings=2048, dropout=0.1),
            ("max_position_embeddings", "do_layer_norm_before", "_remove_final_layer_norm", "word_embed_proj_dim",
             "activation_function", "enable_bias", "layer_norm_elementwise_affine", "tie_word_embeddings")),
    "gpt_neo": (lambda: _neo(max_position_embeddings=2048, window_size=256, num_layers=24,
                             attention_types=[[["global", "local"], 12]]),
                ("max_position_embeddings", "window_size", "attention_types", "attention_layers", "intermediate_size",
                 "activation_function", "layer_norm_epsilon", "tie_word_embeddings")),
}


@pytest.mark.parametrize("name", list(FOLDERS))
def test_config_json_without_defaults_loads(name: str, tmp_path: Path) -> None:
    """A ``config.json`` that leaves out the config class's defaults: read as transformers reads it."""
    make, keys = FOLDERS[name]
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


def test_legacy_n_embed_is_the_width(tmp_path: Path) -> None:
    """Early BLOOM / Falcon ``config.json`` files name the width ``n_embed``."""
    import json

    for make in (_bloom, _falcon):
        hf = checks.hf_model(make())
        folder = tmp_path / type(hf).__name__
        hf.save_pretrained(folder)
        data = json.loads((folder / "config.json").read_text())
        data["n_embed"] = data.pop("hidden_size")
        (folder / "config.json").write_text(json.dumps(data))
        checks.check_folder_without_keys(hf, folder, ())


def _mpt_attn(**kw: Any) -> Callable[[], Any]:
    return lambda: _mpt(attn_config=kw)


@pytest.mark.parametrize(("model_class", "make", "key", "value", "named"), [
    (T.FalconForCausalLM, _falcon_40b, "parallel_attn", False, "parallel_attn=False"),
    (T.FalconForCausalLM, _falcon, "num_ln_in_parallel_attn", 2, "num_ln_in_parallel_attn=2"),
    (T.FalconForCausalLM, _falcon, "num_ln_in_parallel_attn", 3, "num_ln_in_parallel_attn=3"),
    (T.FalconForCausalLM, _falcon_mha, "num_kv_heads", 2, "num_kv_heads=2"),
    (T.FalconForCausalLM, _falcon, "activation", "tanh", "activation"),
    (T.FalconForCausalLM, _falcon, "rope_parameters", {"rope_type": "su", "rope_theta": 1e4}, "rope_type"),
    (T.GPTBigCodeForCausalLM, _bigcode, "add_cross_attention", True, "add_cross_attention"),
    (T.GPTBigCodeForCausalLM, _bigcode, "activation_function", "tanh", "activation_function"),
    (T.MptForCausalLM, _mpt, "logit_scale", 0.5, "logit_scale"),
    (T.MptForCausalLM, _mpt, "no_bias", False, "no_bias"),
    (T.MptForCausalLM, _mpt, "expansion_ratio", 2, "expansion_ratio"),
    (T.MptForCausalLM, _mpt, "norm_type", "rmsnorm", "norm_type"),
    (T.OPTForCausalLM, _opt, "activation_function", "tanh", "activation_function"),
    (T.GPTNeoForCausalLM, _neo, "activation_function", "tanh", "activation_function"),
], ids=["falcon_new_sequential", "falcon_two_norms_old", "falcon_three_norms", "falcon_interleaved_gqa",
        "falcon_activation", "falcon_rope_type", "bigcode_cross", "bigcode_activation", "mpt_logit_scale",
        "mpt_bias", "mpt_expansion", "mpt_norm", "opt_activation", "neo_activation"])
def test_options_it_cannot_reproduce_are_refused(model_class: Any, make: Callable[[], Any], key: str, value: Any,
                                                 named: str) -> None:
    checks.check_refused(model_class, make, key, value, named)


@pytest.mark.parametrize(("key", "value"), [("alibi", False), ("qk_ln", True), ("prefix_lm", True),
                                            ("attn_type", "multiquery_attention"), ("alibi_bias_max", 16),
                                            ("clip_qkv", -1.0)])
def test_mpt_attention_options_are_refused(key: str, value: Any) -> None:
    hf = T.MptForCausalLM(_mpt())
    setattr(hf.config.attn_config, key, value)
    with pytest.raises(UnsupportedConfigError, match=f"attn_config.{key}"):
        from_hf(hf)


def test_gpt_neo_attention_types_are_checked() -> None:
    hf = T.GPTNeoForCausalLM(_neo())
    hf.config.attention_types = [[["global", "sparse"], 1]]
    with pytest.raises(checks.UnsupportedConfigError, match="'sparse'"):
        from_hf(hf)
    hf.config.attention_types = [[["global"], 3]]
    with pytest.raises(CheckpointFormatError, match="3 entries for 2 layers"):
        from_hf(hf)
