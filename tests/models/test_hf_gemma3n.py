"""Gemma 3n text (``Gemma3nForCausalLM`` / ``Gemma3nTextModel``) through ``from_hf``: AltUp's
streams (predict / correct, the stream projections in and out, the active index, the output
scale), LAuReL, activation sparsity (the gaussian top-k of the gate), per-layer embeddings (PLE)
with a smaller per-layer vocabulary, KV sharing across the last layers, sliding / full layers with
their RoPE per type (default, proportional, the scaled types), per-layer MLP widths; equal to
transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.gemma3n import (  # noqa: E402
    DEFAULTS,
    AltUp,
    Gemma3nBlock,
    Gemma3nLM,
    SparseGatedMLP,
    canonical,
)
from attnzoo.models.families.gemma4 import Gemma4Attention, SharedKVCounter  # noqa: E402
from attnzoo.models.hf._state import HFConfig  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")

S, F = "sliding_attention", "full_attention"
ROPES = {S: {"rope_type": "default", "rope_theta": 500.0}, F: {"rope_type": "default", "rope_theta": 20000.0}}


def _config(**kw: Any) -> Any:
    """6 layers (S F S S F S) whose last 2 reuse the keys of layers 1 (full) and 3 (sliding),
    window 6 (< the 30 tokens tested), 3 AltUp streams, LAuReL rank 4, PLE of width 8 over a
    per-layer vocabulary of 100 (< the 128 tokens: the ids above read row 0), activation sparsity
    0.95 and 0.5 on the first two layers, RoPE bases 500 / 2e4, untied head, the default softcap 30."""
    base = dict(num_hidden_layers=6, layer_types=[S, F, S, S, F, S], num_kv_shared_layers=2, head_dim=16,
                sliding_window=6, altup_num_inputs=3, laurel_rank=4, hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=100, activation_sparsity_pattern=[0.95, 0.5, 0.0, 0.0, 0.0, 0.0],
                rope_parameters={k: dict(v) for k, v in ROPES.items()}, tie_word_embeddings=False)
    return T.Gemma3nTextConfig(**{**checks.SMALL, **base, **kw})


def _streams(**kw: Any) -> Any:
    """4 streams with the active one 2 and no output scale, tied embeddings, q/k/v/o biases, exact
    GELU, per-layer MLP widths, sparsity on a middle layer, no sharing, softcap 5, eps 1e-5."""
    return _config(**{"altup_num_inputs": 4, "altup_active_idx": 2, "altup_correct_scale": False,
                      "tie_word_embeddings": True, "attention_bias": True, "hidden_activation": "gelu",
                      "intermediate_size": [48, 96, 64, 80, 32, 96], "num_kv_shared_layers": 0,
                      "activation_sparsity_pattern": [0.0, 0.0, 0.8, 0.0, 0.0, 0.3], "final_logit_softcapping": 5.0,
                      "rms_norm_eps": 1e-5, **kw})


def _no_ple(**kw: Any) -> Any:
    """No per-layer inputs (width 0: transformers adds zeros), one stream (AltUp without projections),
    MQA, SiLU, 4 layers with the last 2 sharing keys."""
    return _config(**{"hidden_size_per_layer_input": 0, "altup_num_inputs": 1, "num_key_value_heads": 1,
                      "hidden_activation": "silu", "num_hidden_layers": 4, "layer_types": [F, S, S, F],
                      "activation_sparsity_pattern": [0.9, 0.0, 0.0, 0.0], **kw})


def _ropes(**kw: Any) -> Any:
    """Proportional RoPE on the sliding layers (a quarter of the head), YaRN on the full ones with
    its original context 64 below the 80 positions, sharing over the last 3 of 7 layers."""
    rope = {S: {"rope_type": "proportional", "rope_theta": 300.0, "partial_rotary_factor": 0.25},
            F: {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 64}}
    return _config(**{"rope_parameters": rope, "num_hidden_layers": 7, "layer_types": [S, F, S, F, S, F, S],
                      "num_kv_shared_layers": 3, "max_position_embeddings": 80,
                      "activation_sparsity_pattern": [0.6] * 7, **kw})


CASES = {"plain": _config, "streams": _streams, "no_ple": _no_ple, "ropes": _ropes}


class TestGemma3n(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_streams, _no_ple, _ropes)


@pytest.mark.parametrize("case", ["streams", "no_ple"])
def test_cached_decode_of_every_case(case: str) -> None:
    checks.check_cached_decode(CASES[case])


def test_greedy_generation_of_the_streams_case() -> None:
    checks.check_generation(_streams)


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                                  {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                   "long_factor": [1.5 + 0.2 * i for i in range(8)],
                                   "original_max_position_embeddings": 16}],
                         ids=lambda r: r["rope_type"])
def test_scaled_rope_of_the_full_layers(rope: dict[str, Any]) -> None:
    """The full layers' scaled rope past ``max_position_embeddings`` (40 < 60 tokens: dynamic rescales,
    longrope takes its long factors past its original 16 positions)."""
    params = {S: dict(ROPES[S]), F: {**rope, "rope_theta": 1e4}}
    checks.check_logits(lambda: _config(rope_parameters=params, max_position_embeddings=40), n=60)


def test_structure() -> None:
    hf = checks.hf_model(_config())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert isinstance(ours, Gemma3nLM) and ours.streams == 3 and len(ours.altup.up) == 2
    assert all(isinstance(b, Gemma3nBlock) and isinstance(b.altup, AltUp) for b in ours.blocks)
    attn = [b.attn for b in ours.blocks]
    assert all(isinstance(a, Gemma4Attention) and a.scale == 1.0 for a in attn)
    assert [a.window for a in attn] == [(5, 5) if k == S else None for k in _config().layer_types]
    assert [a.sharing.role if a.sharing else None for a in attn] == [None, "store", None, "store", "reuse", "reuse"]
    assert isinstance(ours.init_cache(1, 8)[5], SharedKVCounter)
    mlps = [b.ffn for b in ours.blocks]
    assert all(isinstance(m, SparseGatedMLP) for m in mlps)
    assert [m.sparsity for m in mlps] == [0.95, 0.5, 0.0, 0.0, 0.0, 0.0]
    assert mlps[0].cutoff == pytest.approx(1.6448536) and mlps[2].cutoff is None
    widths = [b.ffn.up_proj.weight.shape[0] for b in from_hf(checks.hf_model(_streams())).blocks]
    assert widths == [48, 96, 64, 80, 32, 96]
    assert from_hf(checks.hf_model(_no_ple())).per_layer is None


def test_sparse_mlp_equals_transformers_module() -> None:
    """The gaussian top-k MLP alone, bit for bit (float32) against ``Gemma3nTextMLP``."""
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextMLP

    cfg = _config()
    theirs = checks.perturbed(Gemma3nTextMLP(cfg, layer_idx=0))
    ours = SparseGatedMLP(64, 96, "geglu_tanh", sparsity=0.95)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))


def test_altup_coef_clip_in_training_as_transformers() -> None:
    """In training, ``altup_coef_clip`` clamps ``prediction_coefs`` in place and
    ``correction_coefs`` where used (so its gradient is 0 outside the range): the logits, the
    clamped weights and the gradients as transformers' (no dropout here)."""
    hf = checks.hf_model(_config(altup_coef_clip=0.12)).train()
    ours = from_hf(hf).train()
    x = checks.tokens(12)
    got, ref = ours(x), hf(input_ids=x).logits
    assert checks.rel(got.detach(), ref.detach()) <= checks.TOL
    got.square().sum().backward()
    ref.square().sum().backward()
    for i in range(6):
        mine, theirs = ours.blocks[i].altup, hf.model.layers[i].altup
        assert mine.prediction_coefs.weight.abs().max() <= 0.12
        assert torch.equal(mine.prediction_coefs.weight, theirs.prediction_coefs.weight)
        for name in ("correction_coefs", "prediction_coefs", "modality_router"):
            g, w = getattr(mine, name).weight.grad, getattr(theirs, name).weight.grad
            assert checks.rel(g, w) <= 1e-4, (i, name)
    assert (ours.blocks[0].altup.correction_coefs.weight.grad == 0).any()  # clamped entries


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_config)
    checks.check_packed_gradients_equal_each_alone(_config)


@pytest.mark.parametrize("case", ["plain", "ropes"])
def test_register_serves_transformers_own_model(case: str) -> None:
    """transformers' Gemma 3n with ``attn_implementation="attnzoo"``: its eager logits, and padding-free
    packed input (``DataCollatorWithFlattening``) equal to each sequence alone, shared keys included."""
    hf = checks.hf_model(CASES[case]())
    checks.check_register_equals_eager(hf)
    checks.check_transformers_packed(hf)


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A ``config.json`` without the keys at their defaults: the layer pattern (every 5th layer
    full), the rope parameters, the sparsity pattern (none at 6 layers), the activation, the norms'
    epsilon, AltUp's switches, the softcap."""
    make = lambda: _config(layer_types=None, rope_parameters=None, activation_sparsity_pattern=None,  # noqa: E731
                           num_kv_shared_layers=1, final_logit_softcapping=30.0)
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, (
        "layer_types", "rope_parameters", "activation_sparsity_pattern", "hidden_activation", "rms_norm_eps",
        "attention_bias", "altup_active_idx", "altup_coef_clip", "altup_correct_scale", "final_logit_softcapping",
        "attention_dropout"))


def test_legacy_rope_keys_load(tmp_path: Path) -> None:
    """A ``config.json`` with the legacy ``rope_theta`` (full layers), ``rope_local_base_freq``
    (sliding layers) and ``rope_scaling`` (full layers) instead of ``rope_parameters``."""
    hf = checks.hf_model(_config())
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    del data["rope_parameters"]
    data.update(rope_theta=3e4, rope_local_base_freq=200.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    path.write_text(json.dumps(data))
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.rope_parameters[F]["rope_type"] == "linear"
    x = checks.tokens(20)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), again(input_ids=x).logits) <= checks.TOL
        assert checks.rel(again(input_ids=x).logits, hf(input_ids=x).logits) > 1e-3  # the keys matter


REFUSED = [
    ("altup_active_idx", 3, r"altup_active_idx=3 with altup_num_inputs=3"),
    ("num_kv_shared_layers", 5, r"num_kv_shared_layers=5"),
    ("rope_parameters", {S: ROPES[S], F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                          "partial_rotary_factor": 0.5}}, r"partial_rotary_factor=0.5"),
    ("rope_parameters", {S: ROPES[S], F: {"rope_type": "ntk", "rope_theta": 1e4}}, r"rope_type='ntk'"),
    ("hidden_activation", "relu", r"hidden_activation='relu'"),
]


@pytest.mark.parametrize(("key", "value", "named"), REFUSED, ids=[f"{k}={v!r}"[:40] for k, v, _ in REFUSED])
def test_unsupported_options_are_named(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.Gemma3nForCausalLM, _config, key, value, named)


def test_multimodal_model_without_its_language_model_is_refused() -> None:
    """The multimodal ``model_type="gemma3n"`` converts as its text decoder (``test_hf_multimodal``);
    a module carrying its config but no language-model weights is refused by name."""
    model = torch.nn.Linear(1, 1)
    model.config = T.Gemma3nConfig(text_config=_config().to_dict())  # type: ignore[assignment]
    with pytest.raises(ValueError, match="no language model in the Gemma 3n"):
        from_hf(model)


def test_defaults_are_the_config_class_defaults() -> None:
    """Every default read where a ``config.json`` leaves a key out is ``Gemma3nTextConfig``'s."""
    ref = T.Gemma3nTextConfig().to_dict()
    assert ref["intermediate_size"] == [DEFAULTS["intermediate_size"]] * DEFAULTS["num_hidden_layers"]
    assert {k: ref[k] for k in DEFAULTS if k != "intermediate_size"} == {k: v for k, v in DEFAULTS.items()
                                                                          if k != "intermediate_size"}


def test_canonical_defaults() -> None:
    """As ``Gemma3nTextConfig.__post_init__``: one MLP width and sparsity per layer (0.95 on the
    first 10 of a model deeper than 10), every 5th layer full, the rope bases per type."""
    hf = canonical(HFConfig({"num_hidden_layers": 12, "intermediate_size": 32}, "config.json"))
    assert hf.raw("intermediate_size") == [32] * 12
    assert hf.raw("activation_sparsity_pattern") == [0.95] * 10 + [0.0] * 2
    assert [i for i, k in enumerate(hf.raw("layer_types")) if k == F] == [4, 9]
    assert {k: v["rope_theta"] for k, v in hf.raw("rope_parameters").items()} == {F: 1e6, S: 1e4}
