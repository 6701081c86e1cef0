"""The GPT-NeoX lineage through ``from_hf`` (``attnzoo.models.families.neox``): GPT-NeoX / Pythia
(fused per-head q/k/v, the two-norm parallel layer or the sequential one, partial RoPE), Phi (the
one-norm parallel layer, shared QK LayerNorm, LM-head bias), StableLM (gated MLP, per-head QK LayerNorm,
optional parallel layer), Persimmon (fused q/k/v, QK LayerNorm, ReLU²), GPT-J (interleaved partial
RoPE, parallel layer, LM-head bias) and CodeGen (GPT-J with its grouped ``[q; v; k]`` ``qkv_proj``);
equal to transformers' eager (see ``hf_family_checks``). Config makers: ``_gpt_neox``, ``_phi``,
``_stablelm``, ``_persimmon``, ``_gptj``, ``_codegen`` (no arguments)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.blocks import TransformerBlock  # noqa: E402
from attnzoo.interop import SUPPORTED_ARCHITECTURES, from_hf, to_hf  # noqa: E402
from attnzoo.models.families import neox  # noqa: E402
from attnzoo.models.families.dense import ParallelBlock  # noqa: E402
from attnzoo.models.hf._state import HFConfig  # noqa: E402
from attnzoo.models.hf.convert import BUILDERS  # noqa: E402
from attnzoo.models.parts import LMHead  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")

#: the shared tiny sizes without the key/value heads (GPT-NeoX, Persimmon, GPT-J and CodeGen have none)
TINY = {k: v for k, v in checks.SMALL.items() if k != "num_key_value_heads"} | {"num_hidden_layers": 2}
GPTJ_TINY = {"vocab_size": checks.V, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "rotary_dim": 8,
             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _rope(factor: float, theta: float = 1e4, **kw: Any) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor, **kw}


# --------------------------------------------------------------------------- configs
def _gpt_neox(**kw: Any) -> Any:
    """Parallel residual (the default), q/k/v/dense biases, half of each 16-wide head rotated, untied."""
    return T.GPTNeoXConfig(**{**TINY, "rope_parameters": _rope(0.5), **kw})


def _gpt_neox_sequential() -> Any:
    """The sequential layer, no attention biases, a quarter rotated (Pythia's), tied, eps 1e-3, exact GELU."""
    return _gpt_neox(use_parallel_residual=False, attention_bias=False, tie_word_embeddings=True, layer_norm_eps=1e-3,
                     rope_parameters=_rope(0.25))


def _gpt_neox_scaled() -> Any:
    """Linearly scaled RoPE over the whole head, tanh GELU."""
    return _gpt_neox(hidden_act="gelu_new", rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0,
                                                             "partial_rotary_factor": 1.0})


def _phi(**kw: Any) -> Any:
    """2 key/value heads, half of each head rotated (the default), no QK norm, untied."""
    return T.PhiConfig(**{**TINY, "num_key_value_heads": 2, **kw})


def _phi_qk() -> Any:
    """The shared QK LayerNorm, 4 key/value heads, 0.4 rotated (6 channels), tied (the head's bias apart), GELU."""
    return _phi(qk_layernorm=True, num_key_value_heads=4, tie_word_embeddings=True, hidden_act="gelu",
                rope_parameters=_rope(0.4))


def _stablelm(**kw: Any) -> Any:
    """The sequential layer, 2 key/value heads, no q/k/v biases, no QK norm, a quarter rotated, untied."""
    return T.StableLmConfig(**{**TINY, "num_key_value_heads": 2, **kw})


def _stablelm_parallel() -> Any:
    """The parallel layer, per-head QK LayerNorms, q/k/v biases, half rotated, tied, GELU (gated)."""
    return _stablelm(use_parallel_residual=True, qk_layernorm=True, use_qkv_bias=True, tie_word_embeddings=True,
                     hidden_act="gelu", rope_parameters=_rope(0.5))


def _persimmon(**kw: Any) -> Any:
    """QK LayerNorm and squared ReLU (the defaults), half rotated, untied."""
    return T.PersimmonConfig(**{**TINY, **kw})


def _persimmon_plain() -> Any:
    """No QK norm, tied, GELU, a quarter rotated at theta 25000 (Persimmon-8B's), eps 1e-3."""
    return _persimmon(qk_layernorm=False, tie_word_embeddings=True, hidden_act="gelu", layer_norm_eps=1e-3,
                      rope_parameters=_rope(0.25, 25000.0))


def _gptj(**kw: Any) -> Any:
    """rotary_dim 8 of 16-wide heads, the MLP 4x wide (n_inner None), tanh GELU, untied."""
    return T.GPTJConfig(**{**GPTJ_TINY, **kw})


def _gptj_other() -> Any:
    """Every channel rotated, n_inner 96, tied (the head's bias apart), exact GELU, eps 1e-3."""
    return _gptj(rotary_dim=16, n_inner=96, tie_word_embeddings=True, activation_function="gelu",
                 layer_norm_epsilon=1e-3)


def _codegen(**kw: Any) -> Any:
    """GPT-J's sizes: 4 heads, one per qkv_proj group."""
    return T.CodeGenConfig(**{**GPTJ_TINY, **kw})


def _codegen_two_heads() -> Any:
    """2 heads of 32 (each spans two groups of 16), rotary_dim 16, n_inner 96, tied."""
    return _codegen(n_head=2, rotary_dim=16, n_inner=96, tie_word_embeddings=True)


def _codegen_eight_heads() -> Any:
    """8 heads of 8 (two per group), rotary_dim 4."""
    return _codegen(n_head=8, rotary_dim=4)


class TestGPTNeoX(checks.FamilyChecks):
    config = staticmethod(_gpt_neox)
    cases = (_gpt_neox_scaled, _gpt_neox_sequential)


class TestPhi(checks.FamilyChecks):
    config = staticmethod(_phi)
    cases = (_phi_qk,)


class TestStableLm(checks.FamilyChecks):
    config = staticmethod(_stablelm)
    cases = (_stablelm_parallel,)


class TestPersimmon(checks.FamilyChecks):
    config = staticmethod(_persimmon)
    cases = (_persimmon_plain,)


class TestGPTJ(checks.FamilyChecks):
    config = staticmethod(_gptj)
    cases = (_gptj_other,)


class TestCodeGen(checks.FamilyChecks):
    config = staticmethod(_codegen)
    cases = (_codegen_eight_heads, _codegen_two_heads)


ALL: dict[str, Callable[[], Any]] = {
    "gpt_neox": _gpt_neox, "gpt_neox_sequential": _gpt_neox_sequential, "gpt_neox_scaled": _gpt_neox_scaled,
    "phi": _phi, "phi_qk": _phi_qk, "stablelm": _stablelm, "stablelm_parallel": _stablelm_parallel,
    "persimmon": _persimmon, "persimmon_plain": _persimmon_plain, "gptj": _gptj, "gptj_other": _gptj_other,
    "codegen": _codegen, "codegen_two_heads": _codegen_two_heads, "codegen_eight_heads": _codegen_eight_heads}


# --------------------------------------------------------------------------- structure
@pytest.mark.parametrize("name", list(ALL))
def test_parameter_count_equals_transformers(name: str) -> None:
    """Nothing left over on either side (the weight map names every missing or unexpected key too)."""
    hf = checks.hf_model(ALL[name]())
    assert sum(p.numel() for p in from_hf(hf).parameters()) == sum(p.numel() for p in hf.parameters())


def test_structure() -> None:
    m = from_hf(checks.hf_model(_gpt_neox()))
    assert all(type(b) is neox.TwoNormParallelBlock and b.ffn_norm is not None for b in m.blocks)
    attn = m.blocks[0].attn
    assert attn.rope.rotary_dim == 8 and not attn.rope.interleaved and attn.out_proj.bias is not None
    assert m.norm.bias is not None and m.lm_head.bias is None and not m.tie_embeddings
    m = from_hf(checks.hf_model(_gpt_neox_sequential()))
    assert type(m.blocks[0]) is TransformerBlock and m.blocks[0].attn.qkv_proj.bias is None and m.tie_embeddings
    m = from_hf(checks.hf_model(_phi_qk()))
    attn = m.blocks[0].attn
    assert type(m.blocks[0]) is ParallelBlock and isinstance(attn, neox.LayerNormQKAttention)
    assert attn.q_layernorm.weight.shape == (16,) and attn.k_layernorm.bias is not None and attn.rope.rotary_dim == 6
    assert isinstance(m.lm_head, LMHead) and m.lm_head.bias is not None and m.tie_embeddings
    m = from_hf(checks.hf_model(_stablelm_parallel()))
    attn = m.blocks[0].attn
    assert attn.q_layernorm.weight.shape == (4, 16) and attn.k_layernorm.weight.shape == (2, 16)
    assert attn.q_layernorm.bias is None and attn.qkv_proj.bias is not None and attn.out_proj.bias is None
    assert m.blocks[0].ffn.gate_proj is not None and m.blocks[0].ffn.up_proj.bias is None
    m = from_hf(checks.hf_model(_gptj()))
    attn = m.blocks[0].attn
    assert attn.rope.interleaved and attn.rope.rotary_dim == 8 and attn.qkv_proj.bias is None
    assert m.lm_head.bias is not None and m.blocks[0].ffn.up_proj.out_features == 256


def test_dropouts_sit_where_transformers_puts_them() -> None:
    """GPT-NeoX's ``hidden_dropout``: embeddings and both sub-layer outputs; StableLM's and Persimmon's:
    the MLP output only; Phi's / GPT-J's ``resid_pdrop`` on both outputs, ``embd_pdrop`` on the
    embeddings; the attention dropouts on the attention weights."""
    m = from_hf(checks.hf_model(_gpt_neox(hidden_dropout=0.1, attention_dropout=0.2)))
    assert (m.drop.p, m.blocks[0].dropout.p, m.blocks[0].attn.dropout) == (0.1, 0.1, 0.2)
    for make in (_stablelm, _persimmon):
        m = from_hf(checks.hf_model(make(hidden_dropout=0.3, attention_dropout=0.2)))
        assert (m.drop.p, m.blocks[0].dropout.p, m.blocks[0].attn.dropout) == (0.0, 0.0, 0.2)
        assert isinstance(m.blocks[0].ffn, neox.DroppedFeedForward) and m.blocks[0].ffn.out_dropout.p == 0.3
    m = from_hf(checks.hf_model(_phi(resid_pdrop=0.1, embd_pdrop=0.2, attention_dropout=0.3)))
    assert (m.drop.p, m.blocks[0].dropout.p, m.blocks[0].attn.dropout) == (0.2, 0.1, 0.3)
    m = from_hf(checks.hf_model(_gptj(resid_pdrop=0.1, embd_pdrop=0.2, attn_pdrop=0.3)))
    assert (m.drop.p, m.blocks[0].dropout.p, m.blocks[0].attn.dropout) == (0.2, 0.1, 0.3)


def test_every_family_is_dispatched() -> None:
    for t in ("gpt_neox", "phi", "stablelm", "persimmon", "gptj", "codegen"):
        assert BUILDERS[t] == (neox.DISPATCH[t].name, neox.DISPATCH[t].convert)
        assert all(c in SUPPORTED_ARCHITECTURES for c in neox.DISPATCH[t].classes)


# --------------------------------------------------------------------------- packing, export
@pytest.mark.parametrize("name", ["gpt_neox", "gpt_neox_sequential", "phi_qk", "stablelm", "stablelm_parallel",
                                  "persimmon", "gptj", "codegen_two_heads"])
def test_packed_sequences_equal_each_alone(name: str) -> None:
    checks.check_packed_equals_each_alone(ALL[name])
    checks.check_packed_gradients_equal_each_alone(ALL[name])


@pytest.mark.parametrize("name", ["gpt_neox", "phi_qk", "stablelm_parallel", "persimmon", "gptj_other",
                                  "codegen_eight_heads"])
def test_to_hf_inverts_from_hf(name: str) -> None:
    """``to_hf(from_hf(B), A)`` gives A B's parameters (the fused q/k/v permutations, the per-head norms
    stacked, the head's bias inverted) and B's logits."""
    target, source = checks.hf_model(ALL[name](), seed=0), checks.hf_model(ALL[name](), seed=1)
    ours = from_hf(source)
    assert to_hf(ours, target) is target
    again = from_hf(target).state_dict()
    for key, want in ours.state_dict().items():
        assert torch.equal(again[key], want), key
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(target(input_ids=x).logits, source(input_ids=x).logits) <= 1e-6


@pytest.mark.parametrize("name", ["gpt_neox", "stablelm_parallel", "gptj"])
def test_register_attention_equals_eager(name: str) -> None:
    """transformers' own model with ``attn_implementation="attnzoo"``: the eager logits on a
    left-padded batch, and packed sequences equal to each alone."""
    hf = checks.hf_model(ALL[name]())
    checks.check_register_equals_eager(hf)
    checks.check_transformers_packed(hf)


# --------------------------------------------------------------------------- config.json, legacy checkpoints
FOLDERS = {
    "gpt_neox": (lambda: _gpt_neox(rope_parameters=None),
                 ("rope_parameters", "hidden_act", "use_parallel_residual", "attention_bias", "layer_norm_eps",
                  "tie_word_embeddings", "hidden_dropout", "attention_dropout")),
    "phi": (lambda: _phi(num_key_value_heads=4, rope_parameters=None),
            ("rope_parameters", "num_key_value_heads", "qk_layernorm", "hidden_act", "layer_norm_eps",
             "tie_word_embeddings", "resid_pdrop", "embd_pdrop", "attention_dropout")),
    "stablelm": (lambda: _stablelm(rope_parameters=None),
                 ("rope_parameters", "use_qkv_bias", "qk_layernorm", "use_parallel_residual", "hidden_act",
                  "layer_norm_eps", "tie_word_embeddings", "hidden_dropout", "attention_dropout")),
    "persimmon": (lambda: _persimmon(rope_parameters=None),
                  ("rope_parameters", "qk_layernorm", "hidden_act", "layer_norm_eps", "tie_word_embeddings",
                   "hidden_dropout", "attention_dropout")),
    "gptj": (lambda: _gptj(n_head=1, rotary_dim=64),
             ("rotary_dim", "n_inner", "activation_function", "layer_norm_epsilon", "tie_word_embeddings",
              "resid_pdrop", "embd_pdrop", "attn_pdrop")),
    "codegen": (lambda: _codegen(n_head=1, rotary_dim=64),
                ("rotary_dim", "n_inner", "n_ctx", "activation_function", "layer_norm_epsilon",
                 "tie_word_embeddings", "resid_pdrop", "embd_pdrop", "attn_pdrop")),
}


@pytest.mark.parametrize("name", list(FOLDERS))
def test_config_json_without_defaults_loads(name: str, tmp_path: Path) -> None:
    """A ``config.json`` that leaves out the config class's defaults: read as transformers reads it."""
    make, keys = FOLDERS[name]
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


def test_gpt_neox_legacy_checkpoint_loads(tmp_path: Path) -> None:
    """A Pythia folder as the hub keeps it: ``rotary_pct`` / ``rotary_emb_base`` instead of
    ``rope_parameters``, the head under ``embed_out`` (transformers 5 still saves it so,
    ``conversion_mapping.py``), the old causal-mask and rotary buffers in the weights; read as
    transformers' ``from_pretrained`` reads it."""
    import json

    from safetensors.torch import load_file, save_file

    hf = checks.hf_model(_gpt_neox(rope_parameters=_rope(0.5, 100.0)))
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    del data["rope_parameters"]
    path.write_text(json.dumps({**data, "rotary_pct": 0.5, "rotary_emb_base": 100}))
    sd = load_file(tmp_path / "model.safetensors")
    assert "embed_out.weight" in sd and "lm_head.weight" not in sd
    sd["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 8, 8).tril()
    sd["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    sd["gpt_neox.layers.1.attention.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = checks.tokens(10)
    with torch.no_grad():
        ref = hf(input_ids=x).logits
        assert checks.rel(again(input_ids=x).logits, ref) <= 1e-6  # transformers reads it as it was
        assert checks.rel(checks.load_pretrained(tmp_path)(x), ref) <= checks.TOL


def test_codegen_groups_are_read_as_q_v_k() -> None:
    """The converted ``qkv_proj`` rows: CodeGen's group ``g`` holds ``[q_g; v_g; k_g]`` (16 rows each)."""
    hf = checks.hf_model(_codegen())
    theirs = hf.transformer.h[0].attn.qkv_proj.weight.detach().view(4, 3, 16, 64)
    ours = from_hf(hf).blocks[0].attn.qkv_proj.weight.detach().view(3, 4, 16, 64)
    for i, j in ((0, 0), (1, 2), (2, 1)):  # ours q, k, v <- their slots 0, 2, 1
        assert torch.equal(ours[i], theirs[:, j])


# --------------------------------------------------------------------------- refusals
def _partial(factor: float) -> dict[str, Any]:
    return _rope(factor)


@pytest.mark.parametrize(("model_class", "make", "key", "value", "named"), [
    (T.GPTNeoXForCausalLM, _gpt_neox, "hidden_act", "tanh", "hidden_act"),
    (T.GPTNeoXForCausalLM, _gpt_neox, "rope_parameters", _partial(0.1), "partial_rotary_factor"),
    (T.GPTNeoXForCausalLM, _gpt_neox, "rope_parameters", _partial(0.35), "partial_rotary_factor"),
    (T.GPTNeoXForCausalLM, _gpt_neox, "rope_parameters", {"rope_type": "su", "rope_theta": 1e4}, "rope_type"),
    (T.PhiForCausalLM, _phi_qk, "head_dim", 24, "head_dim=24"),
    (T.PhiForCausalLM, _phi, "hidden_act", "tanh", "hidden_act"),
    (T.StableLmForCausalLM, _stablelm, "hidden_act", "relu", "hidden_act"),
    (T.StableLmForCausalLM, _stablelm, "rope_parameters", _partial(1.5), "partial_rotary_factor"),
    (T.PersimmonForCausalLM, _persimmon, "hidden_act", "tanh", "hidden_act"),
    (T.GPTJForCausalLM, _gptj, "rotary_dim", 7, "rotary_dim"),
    (T.GPTJForCausalLM, _gptj, "rotary_dim", 32, "rotary_dim"),
    (T.GPTJForCausalLM, _gptj, "rotary_dim", 0, "rotary_dim"),
    (T.CodeGenForCausalLM, _codegen, "rotary_dim", 5, "rotary_dim=5 with head_dim=16"),
    (T.CodeGenForCausalLM, _codegen, "activation_function", "tanh", "hidden_act"),
])
def test_options_it_cannot_reproduce_are_refused(model_class: Any, make: Callable[[], Any], key: str, value: Any,
                                                 named: str) -> None:
    checks.check_refused(model_class, make, key, value, named)


def test_codegen_width_not_in_four_groups_is_refused() -> None:
    hf = T.CodeGenForCausalLM(_codegen(n_embd=66, n_head=2))
    with pytest.raises(checks.UnsupportedConfigError, match="n_embd=66"):
        from_hf(hf)


def test_gptj_rotary_dim_null() -> None:
    """``rotary_dim: null`` (older ``config.json`` files; transformers 5's config no longer takes it)
    rotates ``hidden_size`` channels (``modeling_gptj.py`` 56): the whole head when there is one head,
    refused with several."""
    data = {**GPTJ_TINY, "model_type": "gptj", "rotary_dim": None}
    with pytest.raises(checks.UnsupportedConfigError, match="rotary_dim=64 with head_dim=16"):
        neox.build_neox(HFConfig(data, "config.json", "GPT-J"))
    one = neox.build_neox(HFConfig({**data, "n_head": 1}, "config.json", "GPT-J"))
    assert one.blocks[0].attn.rope.rotary_dim == 64 and one.blocks[0].attn.head_dim == 64


# --------------------------------------------------------------------------- more heads, scaled rope
@pytest.mark.parametrize(("make", "cls"), [(_gpt_neox, T.GPTNeoXForSequenceClassification),
                                           (lambda **kw: _phi(qk_layernorm=True, **kw), T.PhiForSequenceClassification),
                                           (_stablelm, T.StableLmForSequenceClassification),
                                           (_gptj, T.GPTJForSequenceClassification)])
def test_sequence_classification_head(make: Callable[[], Any], cls: Any) -> None:
    """A ``*ForSequenceClassification`` converts with its ``score`` head per token: transformers'
    logits are ours at the last token."""
    hf = checks.perturbed(cls(make(num_labels=3)))
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(from_hf(hf)(x)[:, -1], hf(input_ids=x).logits) <= 1e-5


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64,
     "partial_rotary_factor": 0.5},
    {"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16,
     "low_freq_factor": 1.0, "high_freq_factor": 4.0, "partial_rotary_factor": 0.25}], ids=["yarn", "llama3"])
def test_scaled_rope_on_the_rotated_channels(rope: dict[str, Any]) -> None:
    """Scaled RoPE types over the rotated channels only (their frequencies of ``rotary_dim``)."""
    checks.check_logits(lambda: _gpt_neox(rope_parameters=rope))
    checks.check_logits(lambda: _stablelm(rope_parameters=rope))
