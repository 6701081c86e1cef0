"""Eight more dense decoders on the dense lineage builder through ``from_hf``: Command R
(``cohere``: parallel blocks, bias-free LayerNorm, interleaved RoPE, ``logit_scale``), OLMo 1
(non-parametric LayerNorms, ``clip_qkv``), GLM-4-9B (``glm``: fused gate_up, partial interleaved
RoPE), HunYuan-V1-Dense (QK RMSNorm after RoPE, NTK-alpha RoPE), Nemotron-4 (LayerNorm1P, ReLU²,
partial RoPE), Helium (interleaved RoPE, q/k/v biases without an output bias, MLP biases),
ERNIE-4.5 dense (interleaved RoPE, ``use_bias`` everywhere) and Arcee AFM (ungated ReLU² MLP);
equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import SUPPORTED_ARCHITECTURES, from_hf  # noqa: E402
from attnzoo.models.families.dense import DISPATCH, ParallelBlock, ScaledLMHead  # noqa: E402
from attnzoo.models.families.sparse_moe import PostRopeNormAttention  # noqa: E402
from attnzoo.models.hf.convert import BUILDERS  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {**checks.SMALL, "num_hidden_layers": 2}


# --------------------------------------------------------------------------- configs
def _cohere(**kw: Any) -> Any:
    """2 layers, tied, logit_scale 0.3, plain RoPE theta 1e4."""
    return T.CohereConfig(**{**TINY, "logit_scale": 0.3,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, **kw})


def _cohere_other() -> Any:
    """q/k/v/o biases, untied, one key/value head, eps 1e-3, logit_scale 2."""
    return _cohere(attention_bias=True, tie_word_embeddings=False, num_key_value_heads=1, layer_norm_eps=1e-3,
                   logit_scale=2.0)


def _helium(**kw: Any) -> Any:
    """head_dim 16 (the default 128 would not fit), untied, plain RoPE theta 1e4."""
    return T.HeliumConfig(**{**TINY, "head_dim": 16,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, **kw})


def _helium_other() -> Any:
    """q/k/v biases, MLP biases, 2 heads of 32 (one key/value head), tied, eps 1e-5."""
    return _helium(attention_bias=True, mlp_bias=True, head_dim=32, num_attention_heads=2, num_key_value_heads=1,
                   tie_word_embeddings=True, rms_norm_eps=1e-5)


def _ernie(**kw: Any) -> Any:
    """head_dim 16, tied (the default), plain RoPE theta 1e4, no biases."""
    return T.Ernie4_5Config(**{**TINY, "head_dim": 16,
                               "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, **kw})


def _ernie_other() -> Any:
    """``use_bias`` on every projection, head_dim 24, untied."""
    return _ernie(use_bias=True, head_dim=24, tie_word_embeddings=False)


def _arcee(**kw: Any) -> Any:
    """ReLU² (the default), untied."""
    return T.ArceeConfig(**{**TINY, **kw})


def _arcee_other() -> Any:
    """GELU, q/k/v/o and MLP biases, head_dim 24, tied, llama3-scaled RoPE."""
    return _arcee(hidden_act="gelu", attention_bias=True, mlp_bias=True, head_dim=24, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0,
                                   "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0})


def _olmo(**kw: Any) -> Any:
    """No clip_qkv, untied, 4 key/value heads (the default: as many as queries)."""
    return T.OlmoConfig(**{**TINY, "num_key_value_heads": 4, **kw})


def _olmo_other() -> Any:
    """clip_qkv 0.3 (it clamps here), q/k/v/o biases, GQA, tied, theta 1000."""
    return _olmo(clip_qkv=0.3, attention_bias=True, num_key_value_heads=2, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000.0})


def _glm(**kw: Any) -> Any:
    """head_dim 16, half of it rotated (the default), q/k/v biases, untied."""
    return T.GlmConfig(**{**TINY, "head_dim": 16, **kw})


def _glm_other() -> Any:
    """head_dim 24, 3/4 rotated (18 channels), no biases, tied, eps 1e-5."""
    return _glm(head_dim=24, attention_bias=False, tie_word_embeddings=True, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75})


def _hunyuan(**kw: Any) -> Any:
    """Per-head QK norm after RoPE, untied, head_dim 16 (given: transformers' attention reads
    ``config.head_dim`` even when it is ``None``)."""
    return T.HunYuanDenseV1Config(**{**TINY, "head_dim": 16, **kw})


def _hunyuan_other() -> Any:
    """The NTK-alpha RoPE (``dynamic`` with ``alpha``), q/k/v/o biases, head_dim 24, tied, eps 1e-3."""
    return _hunyuan(attention_bias=True, head_dim=24, tie_word_embeddings=True, rms_norm_eps=1e-3,
                    rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "alpha": 50.0, "factor": 1.0})


def _nemotron(**kw: Any) -> Any:
    """Squared ReLU, half of each head rotated (the default), untied, head_dim 16."""
    return T.NemotronConfig(**{**TINY, **kw})


def _nemotron_other() -> Any:
    """GELU, q/k/v/o and MLP biases, head_dim 24 with 3/4 rotated, tied, eps 1e-3."""
    return _nemotron(hidden_act="gelu", attention_bias=True, mlp_bias=True, head_dim=24, tie_word_embeddings=True,
                     norm_eps=1e-3, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                     "partial_rotary_factor": 0.75})


def _cohere_qk_norm() -> Any:
    """Command R+: per-head QK LayerNorms (``use_qk_norm``), GQA, untied."""
    return _cohere(use_qk_norm=True, num_key_value_heads=2, tie_word_embeddings=False)


class TestCohere(checks.FamilyChecks):
    config = staticmethod(_cohere)
    cases = (_cohere_other, _cohere_qk_norm)


class TestOlmo(checks.FamilyChecks):
    config = staticmethod(_olmo)
    cases = (_olmo_other,)


class TestGlm(checks.FamilyChecks):
    config = staticmethod(_glm)
    cases = (_glm_other,)


def _mask_positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp_min(0)


def _check_mask_positions(make: Callable[[], Any], auto: Any = None, n: int = 24) -> float:
    """HunYuan's QK norms follow RoPE, so absolute positions matter: transformers' ``forward``
    counts them from the first slot (left padding included), ``generate`` and attnzoo from the
    attention mask; compared on a left-padded batch with the mask's positions given."""
    hf = checks.hf_model(make(), auto)
    ours = from_hf(hf)
    x, mask = checks.padded(n)
    with torch.no_grad():
        out = hf(input_ids=x, attention_mask=mask, position_ids=_mask_positions(mask))
        ref = out.last_hidden_state if auto is not None else out.logits
        got = ours(x, attention_mask=mask.bool())
    real = mask.bool()
    err = checks.rel(got[real], ref[real])
    assert err <= checks.TOL, f"relative error {err:.2e}"
    return err


class TestHunYuanDenseV1(checks.FamilyChecks):
    config = staticmethod(_hunyuan)
    cases = (_hunyuan_other,)

    def test_logits_equal_transformers(self) -> None:
        for make in (self.config, *self.cases):
            _check_mask_positions(make)

    def test_base_model_equals_transformers(self) -> None:
        for make in (self.config, *self.cases):
            _check_mask_positions(make, T.AutoModel)


class TestNemotron(checks.FamilyChecks):
    config = staticmethod(_nemotron)
    cases = (_nemotron_other,)


class TestHelium(checks.FamilyChecks):
    config = staticmethod(_helium)
    cases = (_helium_other,)


class TestErnie4_5(checks.FamilyChecks):
    config = staticmethod(_ernie)
    cases = (_ernie_other,)


class TestArcee(checks.FamilyChecks):
    config = staticmethod(_arcee)
    cases = (_arcee_other,)


ALL: dict[str, Callable[[], Any]] = {
    "cohere": _cohere, "cohere_other": _cohere_other, "olmo": _olmo, "olmo_other": _olmo_other, "glm": _glm,
    "glm_other": _glm_other, "hunyuan": _hunyuan, "hunyuan_other": _hunyuan_other, "helium": _helium, "helium_other": _helium_other,
    "ernie4_5": _ernie, "ernie4_5_other": _ernie_other, "arcee": _arcee, "arcee_other": _arcee_other,
    "nemotron": _nemotron, "nemotron_other": _nemotron_other}


# --------------------------------------------------------------------------- structure
def test_parameter_counts_equal_transformers() -> None:
    for name, make in ALL.items():
        hf = checks.hf_model(make())
        n_ours, n_hf = (sum(p.numel() for p in m.parameters()) for m in (from_hf(hf), hf))
        assert n_ours == n_hf, name


def test_structure() -> None:
    cohere = from_hf(checks.hf_model(_cohere_other()))
    assert all(isinstance(b, ParallelBlock) and b.ffn_norm is None and b.attn.window is None for b in cohere.blocks)
    assert all(b.attn.rope.interleaved and b.attn.out_proj.bias is not None for b in cohere.blocks)
    assert isinstance(cohere.norm, torch.nn.LayerNorm) and cohere.norm.bias is None and cohere.norm.eps == 1e-3
    assert isinstance(cohere.lm_head, ScaledLMHead) and cohere.lm_head.scale == 2.0 and not cohere.tie_embeddings
    olmo = from_hf(checks.hf_model(_olmo_other()))
    assert not list(olmo.norm.parameters()) and not list(olmo.blocks[0].attn_norm.parameters())
    assert olmo.blocks[0].attn.qkv_proj.clip == 0.3 and olmo.blocks[0].attn.out_proj.bias is not None
    glm = from_hf(checks.hf_model(_glm_other())).blocks[0]
    assert glm.attn.rope.rotary_dim == 18 and glm.attn.rope.interleaved and glm.attn.qkv_proj.bias is None
    assert isinstance(glm.attn_out_norm, torch.nn.Identity) and glm.ffn_norm is not None  # LLaMA's pre-norm layer
    hunyuan = from_hf(checks.hf_model(_hunyuan_other())).blocks[0].attn
    assert isinstance(hunyuan, PostRopeNormAttention) and hunyuan.frontier.q_norm_weight.shape == (24,)
    assert hunyuan.rope.base == pytest.approx(1e4 * 50.0 ** (24 / 22))
    nemotron = from_hf(checks.hf_model(_nemotron_other()))
    assert nemotron.blocks[0].attn.rope.rotary_dim == 18 and not nemotron.blocks[0].attn.rope.interleaved
    assert isinstance(nemotron.norm, torch.nn.LayerNorm) and nemotron.norm.bias is not None
    helium = from_hf(checks.hf_model(_helium_other())).blocks[0]
    assert helium.attn.rope.interleaved and helium.attn.qkv_proj.bias is not None and helium.attn.out_proj.bias is None
    assert helium.ffn.up_proj.bias is not None
    ernie = from_hf(checks.hf_model(_ernie_other())).blocks[0]
    assert ernie.attn.rope.interleaved and ernie.attn.out_proj.bias is not None and ernie.ffn.gate_proj.bias is not None
    arcee = from_hf(checks.hf_model(_arcee())).blocks[0]
    assert not arcee.attn.rope.interleaved and getattr(arcee.ffn, "gate_proj", None) is None


def test_olmo_clip_qkv_matters() -> None:
    """The clamp is active in ``_olmo_other`` (without it the logits differ)."""
    hf = checks.hf_model(_olmo_other())
    x = checks.tokens(12)
    with torch.no_grad():
        ref = hf(input_ids=x).logits
        hf.config.clip_qkv = None
        assert checks.rel(from_hf(hf)(x), ref) > 1e-3


def test_every_new_family_is_dispatched() -> None:
    for t in ("cohere", "olmo", "glm", "hunyuan_v1_dense", "helium", "ernie4_5", "arcee", "nemotron"):
        assert BUILDERS[t] == (DISPATCH[t].name, DISPATCH[t].convert)
        assert all(c in SUPPORTED_ARCHITECTURES for c in DISPATCH[t].classes)


# --------------------------------------------------------------------------- packing
@pytest.mark.parametrize("name", ["cohere", "olmo_other", "glm", "hunyuan_other", "helium_other", "ernie4_5_other", "arcee", "nemotron_other"])
def test_packed_sequences_equal_each_alone(name: str) -> None:
    checks.check_packed_equals_each_alone(ALL[name])
    checks.check_packed_gradients_equal_each_alone(ALL[name])


# --------------------------------------------------------------------------- config.json, refusals
FOLDERS = {
    "cohere": (lambda: _cohere(rope_parameters=None, layer_norm_eps=1e-5, logit_scale=0.0625, num_key_value_heads=4),
               ("logit_scale", "layer_norm_eps", "tie_word_embeddings", "rope_parameters", "hidden_act",
                "attention_bias", "use_qk_norm", "num_key_value_heads")),
    "olmo": (lambda: _olmo(rope_parameters=None),
             ("rope_parameters", "clip_qkv", "attention_bias", "tie_word_embeddings", "hidden_act",
              "num_key_value_heads")),
    "glm": (lambda: _glm(head_dim=128, num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1.5625e-7),
            ("head_dim", "attention_bias", "rms_norm_eps", "rope_parameters", "partial_rotary_factor",
             "tie_word_embeddings", "num_key_value_heads")),
    "hunyuan_v1_dense": (lambda: _hunyuan(rope_parameters=None, rms_norm_eps=1e-5),
                         ("rope_parameters", "rms_norm_eps", "attention_bias", "tie_word_embeddings", "hidden_act")),
    "helium": (lambda: _helium(head_dim=128, hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                               rope_parameters=None,
                               rms_norm_eps=1e-8),
               ("head_dim", "rope_parameters", "rms_norm_eps", "attention_bias", "mlp_bias", "tie_word_embeddings",
                "hidden_act")),
    "ernie4_5": (lambda: _ernie(head_dim=128, num_attention_heads=2, num_key_value_heads=2, rope_parameters=None),
                 ("head_dim", "rope_parameters", "rms_norm_eps", "use_bias", "tie_word_embeddings", "hidden_act")),
    "nemotron": (lambda: _nemotron(rope_parameters=None),
                 ("rope_parameters", "partial_rotary_factor", "norm_eps", "hidden_act", "attention_bias", "mlp_bias",
                  "tie_word_embeddings")),
    "arcee": (lambda: _arcee(rope_parameters=None),
              ("rope_parameters", "rms_norm_eps", "hidden_act", "attention_bias", "mlp_bias", "tie_word_embeddings",
               "head_dim")),
}


def test_hunyuan_released_rope_scaling_loads(tmp_path: Path) -> None:
    """Hunyuan-7B's released ``config.json``: ``rope_scaling: {"type": "dynamic", "alpha": ...}`` beside
    ``rope_theta`` (was read as the default RoPE: 0.5 relative off)."""
    import json

    from attnzoo.interop import load_pretrained

    hf = checks.hf_model(_hunyuan_other())
    hf.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    rope = data.pop("rope_parameters")
    data.update(rope_theta=rope.pop("rope_theta"), rope_scaling={**rope, "type": rope.pop("rope_type")})
    (tmp_path / "config.json").write_text(json.dumps(data))
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).logits) <= checks.TOL


@pytest.mark.parametrize("name", list(FOLDERS))
def test_config_json_without_defaults_loads(name: str, tmp_path: Path) -> None:
    """A ``config.json`` that leaves out the config class's defaults: read as transformers reads it."""
    make, keys = FOLDERS[name]
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


@pytest.mark.parametrize(("model_class", "make", "key", "value", "named"), [
    (T.CohereForCausalLM, _cohere, "hidden_act", "relu", "hidden_act"),
    (T.OlmoForCausalLM, _olmo, "clip_qkv", -1.0, "clip_qkv"),
    (T.GlmForCausalLM, _glm, "rope_parameters", {"rope_type": "default", "rope_theta": 1e4,
                                                 "partial_rotary_factor": 0.1875}, "partial_rotary_factor"),
    (T.HunYuanDenseV1ForCausalLM, _hunyuan, "pretraining_tp", 2, "pretraining_tp"),
    (T.HunYuanDenseV1ForCausalLM, _hunyuan, "rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4,
                                                                 "alpha": -1.0}, "alpha"),
    (T.HeliumForCausalLM, _helium, "rope_parameters", {"rope_type": "su", "rope_theta": 1e4}, "rope_type"),
    (T.HeliumForCausalLM, _helium, "head_dim", 24, "head_dim=24"),
    (T.Ernie4_5ForCausalLM, _ernie, "hidden_act", "tanh", "hidden_act"),
    (T.ArceeForCausalLM, _arcee, "hidden_act", "tanh", "hidden_act"),
    (T.NemotronForCausalLM, _nemotron, "hidden_act", "tanh", "hidden_act"),
    (T.NemotronForCausalLM, _nemotron, "rope_parameters", {"rope_type": "default", "rope_theta": 1e4,
                                                           "partial_rotary_factor": 0.1875}, "partial_rotary_factor"),
])
def test_options_it_cannot_reproduce_are_refused(model_class: Any, make: Callable[[], Any], key: str, value: Any,
                                                 named: str) -> None:
    checks.check_refused(model_class, make, key, value, named)
