"""The dense 2025-26 decoders through ``from_hf``: Cohere2 (parallel blocks, LayerNorm without
bias, interleaved RoPE on sliding layers, NoPE full layers, ``logit_scale``), EXAONE 4 (output
norms, per-head QK norm, NoPE full layers when windowed), Ministral 3 (query temperature),
Seed-OSS (separate q/k/v and output biases, MLP biases), Apertus (xIELU, QK norm) and GLM-4-0414
(norms on both sides, fused gate_up, partial interleaved RoPE); equal to transformers' eager (see
``hf_family_checks``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")

SLIDING, FULL = "sliding_attention", "full_attention"


# --------------------------------------------------------------------------- configs
def _cohere2(**kw: Any) -> Any:
    """4 layers, the default pattern (3 sliding : 1 full), window 6, tied, logit_scale 0.3."""
    return T.Cohere2Config(**{**checks.SMALL, "num_hidden_layers": 4, "sliding_window": 6, "logit_scale": 0.3, **kw})


def _cohere2_other() -> Any:
    """Full first, q/k/v/o biases, untied, one key/value head, head_dim 24, eps 1e-3, theta 1000,
    logit_scale 2."""
    return _cohere2(num_hidden_layers=3, head_dim=24, layer_types=[FULL, SLIDING, SLIDING], attention_bias=True,
                    tie_word_embeddings=False, num_key_value_heads=1, layer_norm_eps=1e-3, logit_scale=2.0,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000.0})


def _exaone4(**kw: Any) -> Any:
    """4 layers, 3 sliding (window 6, RoPE) : 1 full (NoPE), untied."""
    return T.Exaone4Config(**{**checks.SMALL, "num_hidden_layers": 4, "sliding_window": 6, **kw})


def _exaone4_pattern() -> Any:
    """``sliding_window_pattern=2`` (alternating), head_dim 24, tied, llama3-scaled RoPE."""
    return _exaone4(num_hidden_layers=3, sliding_window=5, sliding_window_pattern=2, head_dim=24,
                    tie_word_embeddings=True, rope_parameters={
                        "rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0})


def _exaone4_unwindowed() -> Any:
    """No sliding window: every layer full and rotated, eps 1e-3."""
    return _exaone4(num_hidden_layers=2, sliding_window=None, layer_types=[FULL, FULL], rms_norm_eps=1e-3)


def _ministral3(**kw: Any) -> Any:
    """2 layers, head_dim 24, the default YaRN rope (its temperature is 1 below 16384 positions)."""
    return T.Ministral3Config(**{**checks.SMALL, "num_hidden_layers": 2, "head_dim": 24, **kw})


def _ministral3_window() -> Any:
    """Window 7 on every layer, tied, eps 1e-3."""
    return _ministral3(sliding_window=7, tie_word_embeddings=True, rms_norm_eps=1e-3)


def _ministral3_tempered(**kw: Any) -> Any:
    """The query temperature changing every 4 positions (beta 0.5)."""
    return _ministral3(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "llama_4_scaling_beta": 0.5,
                                        "original_max_position_embeddings": 4}, **kw)


def _seed_oss(**kw: Any) -> Any:
    """q/k/v biases, no output bias (the defaults), head_dim 24, no dropout."""
    return T.SeedOssConfig(**{**checks.SMALL, "num_hidden_layers": 2, "head_dim": 24, "attention_dropout": 0.0,
                              "residual_dropout": 0.0, **kw})


def _seed_oss_other() -> Any:
    """An output bias without q/k/v biases, MLP biases, tied."""
    return _seed_oss(attention_bias=False, attention_out_bias=True, mlp_bias=True, tie_word_embeddings=True)


def _apertus(**kw: Any) -> Any:
    """xIELU, llama3-scaled RoPE, QK norm, untied."""
    return T.ApertusConfig(**{**checks.SMALL, "num_hidden_layers": 2, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0}, **kw})


def _apertus_other() -> Any:
    """Squared ReLU, q/k/v/o biases, head_dim 24, tied, plain RoPE."""
    return _apertus(hidden_act="relu2", attention_bias=True, head_dim=24, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def _glm4(**kw: Any) -> Any:
    """head_dim 16, half of it rotated (the default), q/k/v biases."""
    return T.Glm4Config(**{**checks.SMALL, "num_hidden_layers": 2, "head_dim": 16, **kw})


def _glm4_other() -> Any:
    """head_dim 24, 3/4 rotated (18 channels), no biases, tied, eps 1e-5."""
    return _glm4(head_dim=24, attention_bias=False, tie_word_embeddings=True, rms_norm_eps=1e-5,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75})


class TestCohere2(checks.FamilyChecks):
    config = staticmethod(_cohere2)
    cases = (_cohere2_other,)


class TestExaone4(checks.FamilyChecks):
    config = staticmethod(_exaone4)
    cases = (_exaone4_unwindowed, _exaone4_pattern)


class TestMinistral3(checks.FamilyChecks):
    config = staticmethod(_ministral3)
    cases = (_ministral3_window,)


class TestSeedOss(checks.FamilyChecks):
    config = staticmethod(_seed_oss)
    cases = (_seed_oss_other,)


class TestApertus(checks.FamilyChecks):
    config = staticmethod(_apertus)
    cases = (_apertus_other,)


class TestGlm4(checks.FamilyChecks):
    config = staticmethod(_glm4)
    cases = (_glm4_other,)


ALL: dict[str, Callable[[], Any]] = {
    "cohere2": _cohere2, "cohere2_other": _cohere2_other, "exaone4": _exaone4, "exaone4_pattern": _exaone4_pattern,
    "exaone4_unwindowed": _exaone4_unwindowed, "ministral3": _ministral3_window,
    "ministral3_tempered": _ministral3_tempered, "seed_oss": _seed_oss, "seed_oss_other": _seed_oss_other,
    "apertus": _apertus, "apertus_other": _apertus_other, "glm4": _glm4, "glm4_other": _glm4_other}


# --------------------------------------------------------------------------- structure
def test_parameter_counts_equal_transformers() -> None:
    for name, make in ALL.items():
        hf = checks.hf_model(make())
        ours = from_hf(hf)
        n_ours, n_hf = (sum(p.numel() for p in m.parameters()) for m in (ours, hf))
        assert n_ours == n_hf, name


def test_cohere2_structure() -> None:
    from attnzoo.models.families.dense import ParallelBlock, ScaledLMHead

    ours = from_hf(checks.hf_model(_cohere2_other()))
    assert all(isinstance(b, ParallelBlock) and b.ffn_norm is None for b in ours.blocks)
    assert [b.attn.window for b in ours.blocks] == [None, (5, 5), (5, 5)]
    assert [b.attn.rope is not None for b in ours.blocks] == [False, True, True]
    assert ours.blocks[1].attn.rope.interleaved and ours.blocks[1].attn.out_proj.bias is not None
    assert isinstance(ours.norm, torch.nn.LayerNorm) and ours.norm.bias is None and ours.norm.eps == 1e-3
    assert isinstance(ours.lm_head, ScaledLMHead) and ours.lm_head.scale == 2.0 and not ours.tie_embeddings
    assert from_hf(checks.hf_model(_cohere2())).tie_embeddings


def test_exaone4_structure() -> None:
    ours = from_hf(checks.hf_model(_exaone4()))
    assert [b.attn.window for b in ours.blocks] == [(5, 5)] * 3 + [None]
    assert [b.attn.rope is not None for b in ours.blocks] == [True] * 3 + [False]
    assert all(isinstance(b.attn_norm, torch.nn.Identity) for b in ours.blocks)
    unwindowed = from_hf(checks.hf_model(_exaone4_unwindowed()))
    assert all(b.attn.rope is not None and b.attn.window is None for b in unwindowed.blocks)
    pattern = from_hf(checks.hf_model(_exaone4_pattern()))
    assert [b.attn.window for b in pattern.blocks] == [(4, 4), None, (4, 4)]


def test_seed_oss_and_glm4_biases() -> None:
    seed = from_hf(checks.hf_model(_seed_oss(residual_dropout=0.2)))
    attn = seed.blocks[0].attn
    assert attn.qkv_proj.bias is not None and attn.out_proj.bias is None and seed.blocks[0].dropout.p == 0.2
    other = from_hf(checks.hf_model(_seed_oss_other())).blocks[0]
    assert other.attn.qkv_proj.bias is None and other.attn.out_proj.bias is not None
    assert other.ffn.up_proj.bias is not None
    glm = from_hf(checks.hf_model(_glm4_other())).blocks[0]
    assert glm.attn.rope.rotary_dim == 18 and glm.attn.rope.interleaved and glm.attn.qkv_proj.bias is None


def test_apertus_xielu_weights_are_transformers() -> None:
    from attnzoo.models.families.dense import XIELU

    hf = checks.hf_model(_apertus())
    ours = from_hf(hf)
    act = ours.blocks[1].ffn.act_fn
    assert isinstance(act, XIELU)
    torch.testing.assert_close(act.alpha_p, hf.model.layers[1].mlp.act_fn.alpha_p)
    x = torch.linspace(-4, 4, 101)
    with torch.no_grad():
        torch.testing.assert_close(act(x), hf.model.layers[1].mlp.act_fn(x))


# --------------------------------------------------------------------------- Ministral 3's temperature
def _mask_positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp_min(0)


def test_ministral3_temperature_equals_transformers() -> None:
    """transformers scales by ``position_ids`` (its forward: slots from 0 unless given; its
    generate: from the attention mask); attnzoo by the mask's positions: compared with them given."""
    hf = checks.hf_model(_ministral3_tempered())
    ours = from_hf(hf)
    x, mask = checks.padded(30)
    with torch.no_grad():
        ref = hf(input_ids=x, attention_mask=mask, position_ids=_mask_positions(mask)).logits
        got = ours(x, attention_mask=mask.bool())
        plain = from_hf(checks.hf_model(_ministral3()))(x, attention_mask=mask.bool())
    real = mask.bool()
    assert checks.rel(got[real], ref[real]) <= checks.TOL
    assert checks.rel(plain[real], ref[real]) > 1e-2  # the temperature matters here


def test_ministral3_tempered_generation_and_decode() -> None:
    checks.check_generation(_ministral3_tempered)
    checks.check_cached_decode(_ministral3_tempered)
    checks.check_packed_equals_each_alone(_ministral3_tempered)


# --------------------------------------------------------------------------- packing, register()
@pytest.mark.parametrize("name", ["cohere2", "exaone4", "ministral3", "seed_oss", "apertus", "glm4"])
def test_packed_sequences_equal_each_alone(name: str) -> None:
    checks.check_packed_equals_each_alone(ALL[name])
    checks.check_packed_gradients_equal_each_alone(ALL[name])


@pytest.mark.parametrize("name", ["cohere2", "cohere2_other", "exaone4", "exaone4_pattern", "ministral3"])
def test_register_attention_equals_eager(name: str) -> None:
    """The sliding-window families inside transformers with ``attn_implementation="attnzoo"``: the
    eager logits on a left-padded batch, and packed sequences equal to each alone."""
    hf = checks.hf_model(ALL[name]())
    checks.check_register_equals_eager(hf)
    checks.check_transformers_packed(hf)  # padding-free input (restarting position_ids, cu_seq_lens)


# --------------------------------------------------------------------------- config.json, refusals
FOLDERS = {
    "cohere2": (lambda: _cohere2(logit_scale=0.0625, layer_norm_eps=1e-5, sliding_window=4096, layer_types=None,
                                 num_key_value_heads=4, rope_parameters=None),
                ("logit_scale", "layer_norm_eps", "tie_word_embeddings", "sliding_window", "layer_types",
                 "num_key_value_heads", "rope_parameters", "hidden_act", "attention_bias")),
    "exaone4": (lambda: _exaone4(sliding_window=4096, rms_norm_eps=1e-5, rope_parameters=None),
                ("sliding_window", "sliding_window_pattern", "layer_types", "rms_norm_eps", "rope_parameters",
                 "tie_word_embeddings", "hidden_act")),
    "ministral3": (lambda: _ministral3(head_dim=128, num_attention_heads=2, num_key_value_heads=1),
                   ("rope_parameters", "rms_norm_eps", "head_dim", "sliding_window", "tie_word_embeddings")),
    "seed_oss": (lambda: _seed_oss(head_dim=128, attention_dropout=0.1, residual_dropout=0.1),
                 ("head_dim", "attention_bias", "attention_out_bias", "mlp_bias", "attention_dropout",
                  "residual_dropout", "rms_norm_eps")),
    "apertus": (lambda: _apertus(rope_parameters=None),
                ("hidden_act", "rope_parameters", "rms_norm_eps", "attention_bias", "tie_word_embeddings")),
    "glm4": (lambda: _glm4(head_dim=128, num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1.5625e-7),
             ("head_dim", "attention_bias", "rms_norm_eps", "rope_parameters", "partial_rotary_factor",
              "tie_word_embeddings")),
}


@pytest.mark.parametrize("name", list(FOLDERS))
def test_config_json_without_defaults_loads(name: str, tmp_path: Path) -> None:
    """A ``config.json`` that leaves out the config class's defaults: read as transformers reads it."""
    make, keys = FOLDERS[name]
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


@pytest.mark.parametrize(("model_class", "make", "key", "value", "named"), [
    (T.Cohere2ForCausalLM, _cohere2, "hidden_act", "relu", "hidden_act"),
    (T.Cohere2ForCausalLM, _cohere2, "layer_types", ["chunked_attention"] * 4, "chunked_attention"),
    (T.Cohere2ForCausalLM, _cohere2, "rope_parameters", {"rope_type": "su", "rope_theta": 1e4}, "rope_type"),
    (T.Ministral3ForCausalLM, _ministral3, "rope_parameters",
     {"rope_type": "default", "rope_theta": 1e4, "llama_4_scaling_beta": 0.1}, "llama_4_scaling_beta"),
    (T.SeedOssForCausalLM, _seed_oss, "pretraining_tp", 2, "pretraining_tp"),
    (T.ApertusForCausalLM, _apertus, "hidden_act", "tanh", "hidden_act"),
    (T.Glm4ForCausalLM, _glm4, "rope_parameters", {"rope_type": "default", "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.1875}, "partial_rotary_factor"),
])
def test_options_it_cannot_reproduce_are_refused(model_class: Any, make: Callable[[], Any], key: str, value: Any,
                                                 named: str) -> None:
    checks.check_refused(model_class, make, key, value, named)


def test_string_window_pattern_is_refused() -> None:
    """EXAONE 4's documented string pattern (``"LLG"``) without ``layer_types``: transformers builds
    only int patterns, so it is refused by name."""
    hf = T.Exaone4ForCausalLM(_exaone4())
    hf.config.layer_types, hf.config.sliding_window_pattern = None, "LLG"
    with pytest.raises(checks.UnsupportedConfigError, match="sliding_window_pattern='LLG'"):
        from_hf(hf)


def test_apertus_checkpoint_without_xielu_buffers_loads() -> None:
    """A checkpoint without ``act_fn.beta`` / ``act_fn.eps`` (buffers): transformers keeps 0.5 and -1e-6."""
    from attnzoo.models.families.dense import convert_dense
    from attnzoo.models.hf._state import HFConfig

    hf = checks.hf_model(_apertus())
    sd = {k: v for k, v in hf.state_dict().items() if not k.endswith(("act_fn.beta", "act_fn.eps"))}
    ours = convert_dense(HFConfig(hf.config.to_dict(), "test", "Apertus"), sd, device=None, dtype=None)
    assert float(ours.blocks[0].ffn.act_fn.beta) == 0.5
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL



def test_every_family_is_dispatched() -> None:
    """A dense family is a ``Family`` row (its name and classes included); ``convert.py`` dispatches
    every one of them with no line of its own."""
    from attnzoo.interop import SUPPORTED_ARCHITECTURES
    from attnzoo.models.families.dense import DISPATCH, FAMILIES
    from attnzoo.models.hf.convert import BUILDERS

    assert set(DISPATCH) == set(FAMILIES)
    assert all(BUILDERS[t] == (d.name, d.convert) for t, d in DISPATCH.items())
    assert all(c in SUPPORTED_ARCHITECTURES for d in DISPATCH.values() for c in d.classes)
