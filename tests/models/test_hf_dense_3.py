"""Ten more dense decoders on the dense lineage builder through ``from_hf``: Ministral (windows by
``layer_types``), VaultGemma (Gemma 2 without output norms: softcaps, score scale, ``1 + w``
norms), Jais-2 (biased LayerNorms, ungated ReLU² MLP), HyperCLOVA X (muP multipliers, Peri-LN
output norms), Granite-SWA (Granite's multipliers, sinks, windows, a RoPE base per layer), EXAONE
3.x / InternLM3 / IQuest-Coder (transformers' ``LlamaForCausalLM`` under their own
``model_type``, EXAONE's own checkpoint and config names), NanoChat (weightless norms, the
embeddings normed, reversed RoPE, weightless QK norms, logit softcap) and BitNet (unquantized:
RMSNorms inside the sub-layers, gated ReLU²); equal to transformers' eager (see
``hf_family_checks``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import SUPPORTED_ARCHITECTURES, from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.dense import (  # noqa: E402
    DISPATCH,
    SubNormFeedForward,
    SubNormLinear,
    WeightlessRMSNorm,
)
from attnzoo.models.hf.convert import BUILDERS  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {**checks.SMALL, "num_hidden_layers": 2}
SLIDING, FULL = "sliding_attention", "full_attention"
NEW = ("ministral", "vaultgemma", "jais2", "hyperclovax", "granite_swa", "exaone", "internlm3", "iquestcoder",
       "nanochat", "bitnet")


# --------------------------------------------------------------------------- configs
def _ministral(**kw: Any) -> Any:
    """3 layers, window 6 on every layer (no ``layer_types``: all sliding), head_dim 16, untied."""
    return T.MinistralConfig(**{**TINY, "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 6, **kw})


def _ministral_other() -> Any:
    """Sliding / full / sliding (window 5), head_dim 24, one key/value head, tied, eps 1e-3, llama3 RoPE."""
    return _ministral(layer_types=[SLIDING, FULL, SLIDING], sliding_window=5, head_dim=24, num_key_value_heads=1,
                      tie_word_embeddings=True, rms_norm_eps=1e-3, rope_parameters={
                          "rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 16, "low_freq_factor": 1.0, "high_freq_factor": 4.0})


def _ministral_unwindowed() -> Any:
    """``sliding_window=None`` and no ``layer_types``: every layer full (its config's ``layer_types``;
    transformers' forward then fails, it asks the config for a window to mask with all the same)."""
    return _ministral(sliding_window=None)


def _vaultgemma(**kw: Any) -> Any:
    """Alternating sliding (window 6) / full, score scale 12^-0.5, attention softcap 2, logit softcap 3, tied."""
    return T.VaultGemmaConfig(**{**TINY, "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 6,
                                 "query_pre_attn_scalar": 12, "attn_logit_softcapping": 2.0,
                                 "final_logit_softcapping": 3.0, **kw})


def _vaultgemma_other() -> Any:
    """No softcaps, q/k/v/o biases, exact GeGLU, full / sliding / sliding, untied, eps 1e-3, head_dim 24."""
    return _vaultgemma(attn_logit_softcapping=None, final_logit_softcapping=None, attention_bias=True,
                       hidden_activation="gelu", layer_types=[FULL, SLIDING, SLIDING], tie_word_embeddings=False,
                       rms_norm_eps=1e-3, head_dim=24)


def _jais2(**kw: Any) -> Any:
    """The defaults: q/k/v/o and MLP biases, ReLU², as many key/value heads as queries, untied."""
    return T.Jais2Config(**{**TINY, "num_key_value_heads": None, **kw})


def _jais2_other() -> Any:
    """No biases, GELU, GQA, head_dim 16, tied, eps 1e-3, theta 1000."""
    return _jais2(attention_bias=False, mlp_bias=False, hidden_act="gelu", num_key_value_heads=2,
                  tie_word_embeddings=True, layer_norm_eps=1e-3,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000.0})


def _hyperclovax(**kw: Any) -> Any:
    """Peri-LN (the default), all four multipliers, GQA, untied."""
    return T.HyperCLOVAXConfig(**{**TINY, "embedding_multiplier": 1.7, "residual_multiplier": 0.6,
                                  "logits_scaling": 0.4, "attention_multiplier": 0.2, **kw})


def _hyperclovax_other() -> Any:
    """Without Peri-LN (the residual multiplier folded into o_proj / down_proj), q/k/v/o and MLP biases,
    the default score scale, head_dim 24, tied, eps 1e-3."""
    return _hyperclovax(use_post_norm=False, attention_bias=True, mlp_bias=True, attention_multiplier=None,
                        head_dim=24, tie_word_embeddings=True, rms_norm_eps=1e-3)


def _granite_swa(**kw: Any) -> Any:
    """3 layers: full, sliding (window 6), sliding; RoPE bases 1e4, none (NoPE), 500; the four multipliers; tied."""
    return T.GraniteSWAConfig(**{**TINY, "num_hidden_layers": 3, "sliding_window": 6, "embedding_multiplier": 1.7,
                                 "residual_multiplier": 0.6, "logits_scaling": 2.5, "attention_multiplier": 0.2,
                                 "layer_rope_theta": [1e4, 0, 500.0], **kw})


def _granite_swa_other() -> Any:
    """5 layers, the default layer kinds (full every fourth from the first) and one RoPE base, q/k/v/o and MLP
    biases, untied, one key/value head."""
    return _granite_swa(num_hidden_layers=5, layer_types=None, layer_rope_theta=None, attention_bias=True,
                        mlp_bias=True, tie_word_embeddings=False, num_key_value_heads=1)


def _exaone(**kw: Any) -> Any:
    """LLaMA under ``model_type="exaone"``: head_dim 16, untied."""
    return T.ExaoneConfig(**{**TINY, "head_dim": 16, **kw})


def _exaone_other() -> Any:
    """q/k/v/o and MLP biases, one key/value head, tied, llama3-scaled RoPE (EXAONE 3.5's)."""
    return _exaone(attention_bias=True, mlp_bias=True, num_key_value_heads=1, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0,
                                    "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0})


def _internlm3(**kw: Any) -> Any:
    """LLaMA under ``model_type="internlm3"``: head_dim 16, biases (``qkv_bias`` = ``bias``, as its config requires)."""
    return T.InternLM3Config(**{**TINY, "head_dim": 16, "attention_bias": True, "mlp_bias": True, **kw})


def _internlm3_other(**kw: Any) -> Any:
    """No biases, dynamic NTK RoPE (InternLM3's; inactive within ``max_position_embeddings``), tied."""
    return _internlm3(attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 6.0}, **kw)


def _internlm3_dynamic() -> Any:
    """:func:`_internlm3_other` past ``max_position_embeddings`` 16: the base grows with the length."""
    return _internlm3_other(max_position_embeddings=16)


def _iquestcoder(**kw: Any) -> Any:
    """LLaMA under ``model_type="iquestcoder"``: head_dim 16, untied."""
    return T.IQuestCoderConfig(**{**TINY, "head_dim": 16, **kw})


def _iquestcoder_other() -> Any:
    """q/k/v/o biases, head_dim 24, tied, GELU gate."""
    return _iquestcoder(attention_bias=True, head_dim=24, tie_word_embeddings=True, hidden_act="gelu")


def _nanochat(**kw: Any) -> Any:
    """The defaults: ReLU², logit softcap 15, as many key/value heads as queries, untied."""
    return T.NanoChatConfig(**{**TINY, "num_key_value_heads": None, **kw})


def _nanochat_other() -> Any:
    """GQA, q/k/v/o biases, GELU, no softcap, tied, eps 1e-3, theta 1000."""
    return _nanochat(num_key_value_heads=2, attention_bias=True, hidden_act="gelu", final_logit_softcapping=None,
                     tie_word_embeddings=True, rms_norm_eps=1e-3,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000.0})


def _bitnet(**kw: Any) -> Any:
    """The defaults: ReLU², GQA, untied."""
    return T.BitNetConfig(**{**TINY, **kw})


def _bitnet_other() -> Any:
    """One key/value head, SiLU, q/k/v/o biases, tied, eps 1e-3."""
    return _bitnet(num_key_value_heads=1, hidden_act="silu", attention_bias=True, tie_word_embeddings=True,
                   rms_norm_eps=1e-3)


class TestMinistral(checks.FamilyChecks):
    config = staticmethod(_ministral)
    cases = (_ministral_other,)


class TestVaultGemma(checks.FamilyChecks):
    config = staticmethod(_vaultgemma)
    cases = (_vaultgemma_other,)


class TestJais2(checks.FamilyChecks):
    config = staticmethod(_jais2)
    cases = (_jais2_other,)


class TestHyperCLOVAX(checks.FamilyChecks):
    config = staticmethod(_hyperclovax)
    cases = (_hyperclovax_other,)


class TestGraniteSWA(checks.FamilyChecks):
    config = staticmethod(_granite_swa)
    cases = (_granite_swa_other,)


class TestExaone(checks.FamilyChecks):
    config = staticmethod(_exaone)
    cases = (_exaone_other,)


class TestInternLM3(checks.FamilyChecks):
    config = staticmethod(_internlm3)
    cases = (_internlm3_dynamic, _internlm3_other)

    def test_greedy_generation_past_the_dynamic_limit(self) -> None:
        """Past ``max_position_embeddings`` a dynamic RoPE rotates each new query with the base of the
        length so far and keeps the cached keys as they were rotated: cached decode is not the full
        forward there, in transformers as here; generation follows transformers' ``generate``."""
        hf = checks.hf_model(_internlm3_dynamic())
        ours = from_hf(hf)
        x, mask = checks.padded(12, pad=3)
        for ids, m in ((x[1:], mask[1:]), (x, mask)):
            want = hf.generate(input_ids=ids, attention_mask=m, max_new_tokens=10, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
            with pytest.warns(UserWarning, match="past the model's 16 positions"):
                got = ours.generate(ids, 10, attention_mask=m.bool(), extend_context=True)
            assert torch.equal(got, want)


class TestIQuestCoder(checks.FamilyChecks):
    config = staticmethod(_iquestcoder)
    cases = (_iquestcoder_other,)


class TestNanoChat(checks.FamilyChecks):
    config = staticmethod(_nanochat)
    cases = (_nanochat_other,)


class TestBitNet(checks.FamilyChecks):
    config = staticmethod(_bitnet)
    cases = (_bitnet_other,)


ALL: dict[str, Callable[[], Any]] = {
    "ministral": _ministral, "ministral_other": _ministral_other, "vaultgemma": _vaultgemma,
    "vaultgemma_other": _vaultgemma_other, "jais2": _jais2, "jais2_other": _jais2_other, "hyperclovax": _hyperclovax,
    "hyperclovax_other": _hyperclovax_other, "granite_swa": _granite_swa, "granite_swa_other": _granite_swa_other,
    "exaone": _exaone, "exaone_other": _exaone_other, "internlm3": _internlm3, "internlm3_other": _internlm3_other,
    "iquestcoder": _iquestcoder, "iquestcoder_other": _iquestcoder_other, "nanochat": _nanochat,
    "nanochat_other": _nanochat_other, "bitnet": _bitnet, "bitnet_other": _bitnet_other}


# --------------------------------------------------------------------------- structure
def test_parameter_counts_equal_transformers() -> None:
    for name, make in ALL.items():
        hf = checks.hf_model(make())
        n_ours, n_hf = (sum(p.numel() for p in m.parameters()) for m in (from_hf(hf), hf))
        assert n_ours == n_hf, name


def test_structure() -> None:
    ministral = from_hf(checks.hf_model(_ministral_other()))
    assert [b.attn.window for b in ministral.blocks] == [(4, 4), None, (4, 4)]
    assert all(b.attn.window is None for b in from_hf(checks.hf_model(_ministral_unwindowed())).blocks)
    vault = from_hf(checks.hf_model(_vaultgemma()))
    assert [b.attn.window for b in vault.blocks] == [(5, 5), None, (5, 5)] and vault.tok_emb.scale == 64 ** 0.5
    assert vault.blocks[0].attn.scale == pytest.approx(12 ** -0.5) and vault.lm_head.softcap == 3.0
    jais = from_hf(checks.hf_model(_jais2())).blocks[0]
    assert isinstance(jais.attn_norm, torch.nn.LayerNorm) and jais.ffn.gate_proj is None
    assert jais.ffn.up_proj.bias is not None
    hcx = from_hf(checks.hf_model(_hyperclovax())).blocks[0]
    assert hcx.attn.scale == pytest.approx(0.2) and not isinstance(hcx.attn_out_norm, torch.nn.Identity)
    plain = from_hf(checks.hf_model(_hyperclovax_other())).blocks[0]
    assert isinstance(plain.attn_out_norm, torch.nn.Identity) and plain.attn.scale == pytest.approx(24 ** -0.5)
    swa = from_hf(checks.hf_model(_granite_swa()))
    assert [b.attn.window for b in swa.blocks] == [None, (5, 5), (5, 5)] and swa.blocks[1].attn.rope is None
    assert swa.blocks[2].attn.rope.base == 500.0 and swa.blocks[0].attn.frontier.sinks is not None
    assert [b.attn.window is None for b in from_hf(checks.hf_model(_granite_swa_other())).blocks] == \
        [True, False, False, False, True]
    nano = from_hf(checks.hf_model(_nanochat()))
    assert isinstance(nano.norm, WeightlessRMSNorm) and isinstance(nano.tok_emb.norm, WeightlessRMSNorm)
    assert not any("norm" in n for n, _ in nano.named_parameters()) and nano.lm_head.softcap == 15.0
    bitnet = from_hf(checks.hf_model(_bitnet())).blocks[0]
    assert isinstance(bitnet.attn.out_proj, SubNormLinear) and isinstance(bitnet.ffn, SubNormFeedForward)
    assert isinstance(bitnet.ffn.down_proj, SubNormLinear) and bitnet.ffn.down_proj.sub_norm.weight.shape == (96,)


def test_every_new_family_is_dispatched() -> None:
    for t in NEW:
        assert BUILDERS[t] == (DISPATCH[t].name, DISPATCH[t].convert)
        assert all(c in SUPPORTED_ARCHITECTURES for c in DISPATCH[t].classes)


def _break(hf: Any, **values: Any) -> float:
    """The relative logit error of the conversion of ``hf`` with its config changed to ``values``."""
    x = checks.tokens(16)
    with torch.no_grad():
        ref = hf(input_ids=x).logits
        for key, value in values.items():
            setattr(hf.config, key, value)
        return checks.rel(from_hf(hf)(x), ref)


@pytest.mark.parametrize(("make", "values"), [
    (_hyperclovax, {"residual_multiplier": 1.0}), (_hyperclovax, {"logits_scaling": 1.0}),
    (_hyperclovax, {"embedding_multiplier": 1.0}), (_granite_swa, {"layer_rope_theta": [1e4, 1e4, 500.0]}),
    (_vaultgemma, {"attn_logit_softcapping": None}), (_vaultgemma, {"query_pre_attn_scalar": 16}),
    (_ministral_other, {"layer_types": [SLIDING] * 3}), (_nanochat, {"final_logit_softcapping": None}),
])
def test_each_option_matters(make: Callable[[], Any], values: dict[str, Any]) -> None:
    """The options the tiny configs set are active: converted without them, the logits differ."""
    assert _break(checks.hf_model(make()), **values) > 1e-3


def test_nanochat_rope_turns_the_other_way() -> None:
    """NanoChat's RoPE rotates by ``-angle``: converted as a plain RoPE (the q/k rows left as they
    are), the logits differ; the conversion's sign flips make them equal."""
    from attnzoo.models.families import dense

    hf = checks.hf_model(_nanochat())
    x = checks.tokens(16)
    row = dense.FAMILIES["nanochat"]
    try:
        dense.FAMILIES["nanochat"] = dense.Family(**{**row.__dict__, "qkv": None})
        with torch.no_grad():
            assert checks.rel(from_hf(hf)(x), hf(input_ids=x).logits) > 1e-3
    finally:
        dense.FAMILIES["nanochat"] = row


# --------------------------------------------------------------------------- packing, register()
@pytest.mark.parametrize("name", ["ministral_other", "vaultgemma", "jais2", "hyperclovax", "granite_swa",
                                  "exaone_other", "internlm3", "iquestcoder_other", "nanochat_other", "bitnet_other"])
def test_packed_sequences_equal_each_alone(name: str) -> None:
    checks.check_packed_equals_each_alone(ALL[name])
    checks.check_packed_gradients_equal_each_alone(ALL[name])


@pytest.mark.parametrize("name", ["ministral_other", "granite_swa", "exaone"])
def test_register_attention_equals_eager(name: str) -> None:
    """transformers' own model served by ``attnzoo.hf.register()``: the eager logits on a left-padded
    batch (sliding / full layers, sinks), and packed sequences equal to each alone."""
    hf = checks.hf_model(ALL[name]())
    checks.check_register_equals_eager(hf)
    checks.check_transformers_packed(hf)


# --------------------------------------------------------------------------- checkpoints' own names
def _saved(make: Callable[[], Any], tmp_path: Path, keys: dict[str, str]) -> tuple[Any, Path]:
    """``make()``'s model saved with its ``config.json`` keys renamed by ``keys`` (a release's own names)."""
    hf = checks.hf_model(make())
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({keys.get(k, k): v for k, v in data.items()}))
    return hf, tmp_path


@pytest.mark.parametrize(("make", "keys"), [
    (_exaone, {"num_hidden_layers": "num_layers", "rms_norm_eps": "layer_norm_epsilon",
               "hidden_act": "activation_function"}),
    (_internlm3, {"attention_bias": "qkv_bias", "mlp_bias": "bias"}),
])
def test_a_release_config_json_loads(make: Callable[[], Any], keys: dict[str, str], tmp_path: Path) -> None:
    """EXAONE 3.x's ``config.json`` names (``num_layers``, ``layer_norm_epsilon``,
    ``activation_function``) and InternLM3's (``qkv_bias``, ``bias``): read as transformers reads them."""
    _, folder = _saved(make, tmp_path, keys)
    again = T.AutoModelForCausalLM.from_pretrained(folder).eval()
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(load_pretrained(folder)(x), again(input_ids=x).logits) <= checks.TOL


def test_exaone_checkpoint_names() -> None:
    """transformers writes EXAONE folders with the release's names (``transformer.h.{i}.attn.attention``,
    ``ln_1``, ``c_fc_0`` ...); the saved folder holds them and loads (the base model's too)."""
    import tempfile

    from safetensors import safe_open

    for auto in (None, T.AutoModel):
        hf = checks.hf_model(_exaone(), auto)
        with tempfile.TemporaryDirectory() as folder:
            hf.save_pretrained(folder)
            with safe_open(f"{folder}/model.safetensors", "pt") as f:
                names = list(f.keys())
            assert any(".attn.attention.q_proj" in n for n in names) and any(".mlp.c_fc_0" in n for n in names)
            x = checks.tokens(10)
            with torch.no_grad():
                out = hf(input_ids=x)
                ref = out.logits if auto is None else out.last_hidden_state
                assert checks.rel(load_pretrained(folder)(x), ref) <= checks.TOL


# --------------------------------------------------------------------------- config.json, refusals
FOLDERS = {
    "ministral": (lambda: _ministral(sliding_window=4096, rms_norm_eps=1e-6, num_key_value_heads=8,
                                     num_attention_heads=8, rope_parameters=None, layer_types=None),
                  ("sliding_window", "rms_norm_eps", "num_key_value_heads", "rope_parameters", "layer_types",
                   "tie_word_embeddings", "hidden_act")),
    "vaultgemma": (lambda: _vaultgemma(head_dim=256, num_attention_heads=4, num_key_value_heads=4, sliding_window=4096,
                                       query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                                       final_logit_softcapping=30.0, rope_parameters=None, layer_types=None),
                   ("head_dim", "num_key_value_heads", "sliding_window", "query_pre_attn_scalar", "layer_types",
                    "attn_logit_softcapping", "final_logit_softcapping", "rope_parameters", "rms_norm_eps",
                    "tie_word_embeddings", "hidden_activation", "attention_bias")),
    "jais2": (lambda: _jais2(rope_parameters=None),
              ("attention_bias", "mlp_bias", "hidden_act", "layer_norm_eps", "rope_parameters", "tie_word_embeddings",
               "num_key_value_heads", "head_dim")),
    "hyperclovax": (lambda: _hyperclovax(attention_multiplier=None, rope_parameters=None, num_key_value_heads=None),
                    ("attention_multiplier", "use_post_norm", "rms_norm_eps", "rope_parameters", "head_dim",
                     "num_key_value_heads", "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias")),
    "granite_swa": (lambda: _granite_swa(sliding_window=128, num_key_value_heads=4, layer_types=None,
                                         layer_rope_theta=None, rope_parameters=None, rms_norm_eps=1e-5,
                                         attention_multiplier=1.0),
                    ("sliding_window", "num_key_value_heads", "layer_types", "layer_rope_theta", "rope_parameters",
                     "rms_norm_eps", "attention_multiplier", "tie_word_embeddings", "hidden_act")),
    "granite_swa_kinds": (lambda: _granite_swa(sliding_window=4, layer_types=None), ("layer_types",)),
    "exaone": (lambda: _exaone(num_key_value_heads=8, num_attention_heads=8, rope_parameters=None, head_dim=None),
               ("num_key_value_heads", "rope_parameters", "head_dim", "rms_norm_eps", "hidden_act",
                "tie_word_embeddings", "attention_bias", "mlp_bias")),
    "internlm3": (lambda: _internlm3(head_dim=128, num_attention_heads=2, num_key_value_heads=2, rope_parameters=None),
                  ("head_dim", "num_key_value_heads", "rope_parameters", "rms_norm_eps", "tie_word_embeddings")),
    "iquestcoder": (lambda: _iquestcoder(head_dim=128, num_attention_heads=8, num_key_value_heads=8,
                                         rope_parameters=None),
                    ("head_dim", "num_key_value_heads", "rope_parameters", "rms_norm_eps", "tie_word_embeddings",
                     "attention_bias")),
    "nanochat": (lambda: _nanochat(rope_parameters=None),
                 ("final_logit_softcapping", "hidden_act", "rms_norm_eps", "rope_parameters", "num_key_value_heads",
                  "tie_word_embeddings", "attention_bias")),
    "bitnet": (lambda: _bitnet(hidden_size=80, num_attention_heads=10, num_key_value_heads=5, rope_parameters=None),
               ("num_key_value_heads", "rope_parameters", "hidden_act", "rms_norm_eps", "tie_word_embeddings",
                "attention_bias")),
}


@pytest.mark.parametrize("name", list(FOLDERS))
def test_config_json_without_defaults_loads(name: str, tmp_path: Path) -> None:
    """A ``config.json`` that leaves out the config class's defaults: read as transformers reads it."""
    make, keys = FOLDERS[name]
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


@pytest.mark.parametrize(("model_class", "make", "key", "value", "named"), [
    (T.MinistralForCausalLM, _ministral, "layer_types", ["chunked_attention"] * 3, "chunked_attention"),
    (T.MinistralForCausalLM, _ministral_other, "sliding_window", None, "sliding_window"),
    (T.VaultGemmaForCausalLM, _vaultgemma, "hidden_activation", "tanh", "hidden_activation"),
    (T.VaultGemmaForCausalLM, _vaultgemma, "query_pre_attn_scalar", 0, "query_pre_attn_scalar"),
    (T.VaultGemmaForCausalLM, _vaultgemma, "attn_logit_softcapping", -1.0, "attn_logit_softcapping"),
    (T.Jais2ForCausalLM, _jais2, "hidden_act", "tanh", "hidden_act"),
    (T.HyperCLOVAXForCausalLM, _hyperclovax, "logits_scaling", 0.0, "logits_scaling"),
    (T.HyperCLOVAXForCausalLM, _hyperclovax, "attention_multiplier", -0.1, "attention_multiplier"),
    (T.HyperCLOVAXForCausalLM, _hyperclovax, "embedding_multiplier", 0.0, "embedding_multiplier"),
    (T.HyperCLOVAXForCausalLM, _hyperclovax, "hidden_act", "tanh", "hidden_act"),
    (T.GraniteSWAForCausalLM, _granite_swa, "hidden_act", "gelu", "hidden_act"),
    (T.GraniteSWAForCausalLM, _granite_swa, "layer_rope_theta", [1e4, -1.0, 1e4], "layer_rope_theta"),
    (T.GraniteSWAForCausalLM, _granite_swa, "rope_parameters", {"rope_type": "default", "rope_theta": 1e4,
                                                                "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    (T.LlamaForCausalLM, _exaone, "rope_parameters", {"rope_type": "su", "rope_theta": 1e4}, "rope_type"),
    (T.LlamaForCausalLM, _internlm3, "hidden_act", "tanh", "hidden_act"),
    (T.LlamaForCausalLM, _iquestcoder, "clip_qkv", 0.5, "clip_qkv"),
    (T.LlamaForCausalLM, _iquestcoder, "use_sliding_window", True, "use_sliding_window"),
    (T.NanoChatForCausalLM, _nanochat, "hidden_act", "tanh", "hidden_act"),
    (T.BitNetForCausalLM, _bitnet, "quantization_config", {"quant_method": "bitnet"}, "quantization_config"),
    (T.BitNetForCausalLM, _bitnet, "head_dim", 8, "head_dim=8"),
    (T.BitNetForCausalLM, _bitnet, "hidden_act", "tanh", "hidden_act"),
])
def test_options_it_cannot_reproduce_are_refused(model_class: Any, make: Callable[[], Any], key: str, value: Any,
                                                 named: str) -> None:
    checks.check_refused(model_class, make, key, value, named)
