"""Apertus 1.5 text (``apertus1p5_text``) through ``from_hf`` / ``load_pretrained``: Apertus' decoder
(xIELU, QK norms, LLaMA-3 RoPE) with an input vocabulary wider than the LM head
(``output_vocab_size``); equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.apertus1p5 import PrunedLMHead  # noqa: E402
from attnzoo.models.families.dense import XIELU  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

ROPE = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def _apertus1p5(**kw: Any) -> Any:
    """2 layers, xIELU, llama3-scaled RoPE, QK norms, untied, the head pruned to 100 of 128 ids."""
    return T.Apertus1p5TextConfig(**{**checks.SMALL, "num_hidden_layers": 2, "output_vocab_size": 100,
                                     "rope_parameters": dict(ROPE), **kw})


def _unpruned() -> Any:
    """The whole vocabulary in the head (no ``output_vocab_size``), q/k/v/o biases, head_dim 24."""
    return _apertus1p5(output_vocab_size=None, attention_bias=True, head_dim=24)


def _tied() -> Any:
    """Tied embeddings with an ``output_vocab_size``: transformers ties the whole embedding, the logits
    cover every id; squared ReLU, one key/value head, plain RoPE."""
    return _apertus1p5(tie_word_embeddings=True, hidden_act="relu2", num_key_value_heads=1,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e4})


class TestApertus1p5(checks.FamilyChecks):
    config = staticmethod(_apertus1p5)
    cases = (_unpruned, _tied)


def test_pruned_head_and_widths() -> None:
    """The pruned head is ``[output_vocab_size, C]`` and generation samples from it; tied, the head is
    the embedding (the logits span the vocabulary, as transformers' tied head)."""
    hf = checks.hf_model(_apertus1p5())
    ours = from_hf(hf)
    assert isinstance(ours.lm_head, PrunedLMHead) and ours.lm_head.weight.shape == (100, 64)
    assert isinstance(ours.blocks[0].ffn.act_fn, XIELU) and not ours.tie_embeddings
    x = checks.tokens(9)
    with torch.no_grad():
        assert ours(x).shape == (2, 9, 100) == hf(input_ids=x).logits.shape
    assert int(ours.generate(x[:1], 6)[0, 9:].max()) < 100
    tied_hf = checks.hf_model(_tied())
    tied = from_hf(tied_hf)
    assert tied.tie_embeddings and tied_hf.lm_head.weight.shape == (checks.V, 64)
    with torch.no_grad():
        assert tied(x).shape == (2, 9, checks.V)


def test_parameter_counts_equal_transformers() -> None:
    for make in (_apertus1p5, _unpruned, _tied):
        hf = checks.hf_model(make())
        assert sum(p.numel() for p in from_hf(hf).parameters()) == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("make", [_apertus1p5, _unpruned, _tied])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    checks.check_packed_equals_each_alone(make)


def _wide_input() -> Any:
    """A 160-id input vocabulary, the head pruned to the 128 the shared checks' tokens use."""
    return _apertus1p5(vocab_size=checks.V + 32, output_vocab_size=checks.V)


@pytest.mark.parametrize("make", [_wide_input, _tied])
def test_packed_training_gradients_equal_each_alone(make: Any) -> None:
    """Float64 gradients, packed == each alone (the targets, ids < 128, inside the pruned head)."""
    checks.check_packed_gradients_equal_each_alone(make)


def test_base_model_folder_loads(tmp_path: Path) -> None:
    """A saved ``Apertus1p5TextModel``: no head, the final hidden states."""
    hf = checks.hf_model(_apertus1p5(), T.AutoModel)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).last_hidden_state) <= checks.TOL


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A ``config.json`` that leaves out ``Apertus1p5TextConfig``'s defaults reads as transformers reads it."""
    hf = checks.hf_model(_apertus1p5(rope_parameters=None, output_vocab_size=None))
    checks.check_folder_without_keys(hf, tmp_path, ("hidden_act", "rope_parameters", "rms_norm_eps", "attention_bias",
                                                    "tie_word_embeddings", "output_vocab_size", "max_position_embeddings"))


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hidden_act", "tanh", "hidden_act"),
    ("output_vocab_size", 0, "output_vocab_size"),
    ("output_vocab_size", checks.V + 1, "output_vocab_size"),
    ("pretraining_tp", 2, "pretraining_tp"),
    ("rope_parameters", {"rope_type": "su", "rope_theta": 1e4}, "rope_type"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.Apertus1p5TextForCausalLM, _apertus1p5, key, value, named)


def test_multimodal_checkpoint_names_load(tmp_path: Path) -> None:
    """Weights under the multimodal model's names (``model.language_model.*``, the tokenizers' beside
    them): read as transformers' ``from_pretrained`` reads them for ``apertus1p5_text``."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    hf = checks.hf_model(_apertus1p5())
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    weights = {k.replace("model.", "model.language_model.", 1): v for k, v in safetensors_torch.load_file(path).items()}
    weights["model.vision_tokenizer.quant_conv.weight"] = torch.zeros(2, 2)
    safetensors_torch.save_file(weights, path, metadata={"format": "pt"})
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = checks.tokens(10)
    with torch.no_grad():
        ref = again(input_ids=x).logits
        assert checks.rel(ref, hf(input_ids=x).logits) <= checks.TOL
        assert checks.rel(load_pretrained(tmp_path)(x), ref) <= checks.TOL


def test_register_attention_equals_eager() -> None:
    """transformers' own Apertus 1.5 with ``attn_implementation="attnzoo"``: its eager logits."""
    checks.check_register_equals_eager(checks.hf_model(_apertus1p5()))
