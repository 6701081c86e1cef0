"""Molmo2's text decoder (``molmo2_text``: OLMo 2's attention with per-head or whole-projection QK
RMSNorms, pre- or post-sub-layer norms, the scaled RoPE on some layers, an embedding with
``additional_vocab_size`` more rows than the head) through ``Molmo2ForConditionalGeneration``. The
wrapper's shared checks (logits of a left-padded batch, the base model, greedy generation, folders,
``to_hf``) run in ``test_hf_multimodal.py`` on :func:`_molmo2`; here the other settings and the refusals."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.models.hf.errors import UnsupportedConfigError  # noqa: E402

T = transformers
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*the text decoder of Molmo2 is converted")]

#: a two-layer text model, head_dim 16, 8 extra embedding rows (ids V .. V + 7)
TEXT = {**checks.SMALL, "num_hidden_layers": 2, "head_dim": 16, "additional_vocab_size": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              head_dim=8, patch_size=4, image_size=[16, 16])
ADAPTER = dict(vision_feature_layer=[-1], hidden_size=16, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
               intermediate_size=32, text_hidden_size=checks.SMALL["hidden_size"])


def _molmo2(**text: Any) -> Any:
    """Molmo2: per-head QK norms (``"qwen3"``), pre-norms, q/k/v biases, untied."""
    return T.Molmo2Config(text_config={**TEXT, "attention_bias": True, **text}, vision_config=VISION,
                          adapter_config=ADAPTER)


LLAMA3 = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
SETTINGS = {
    "olmo_qk_norm_after": dict(qk_norm_type="olmo", norm_after=True, attention_bias=False),
    "qwen3_norm_after": dict(norm_after=True),
    "scaled_rope_on_layer_1": dict(rope_parameters=LLAMA3, rope_scaling_layers=[1]),
    "scaled_rope_everywhere": dict(rope_parameters=LLAMA3),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_the_text_settings_equal_transformers(name: str) -> None:
    """Each setting on ids that include the additional vocabulary's (the image / video special tokens)."""
    hf = checks.perturbed(checks.hf_model(_molmo2(**SETTINGS[name])))
    x = checks.tokens(40)
    x[:, ::5] = checks.V + torch.arange(8).repeat(2)[:x[:, ::5].numel() // 2]
    with torch.no_grad():
        ours = from_hf(hf)
        assert ours.tok_emb.weight.shape[0] == checks.V + 8 and ours.lm_head.weight.shape[0] == checks.V
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL


def test_the_head_is_never_tied() -> None:
    """The class ties no weights (the head has fewer rows than the embedding), whatever the config says."""
    config = _molmo2()
    config.tie_word_embeddings = True
    hf = checks.perturbed(checks.hf_model(config))
    ours = from_hf(hf)
    assert not ours.tie_embeddings
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL


@pytest.mark.parametrize(("key", "value"), [("qk_norm_type", "layer"), ("additional_vocab_size", -1),
                                            ("rope_scaling_layers", ["0"])])
def test_a_setting_attnzoo_cannot_build_is_refused_by_name(key: str, value: Any) -> None:
    hf = checks.hf_model(_molmo2())
    hf.config.text_config.__dict__[key] = value  # past the config's own validation: a hand-edited config.json
    with pytest.raises(UnsupportedConfigError, match=key):
        from_hf(hf)


def test_the_released_layout_loads(tmp_path: Path) -> None:
    """The released folder (what transformers' ``save_pretrained`` writes too): ``model.transformer.*`` with
    the fused ``att_proj`` (grouped queries: 4 query and 2 key/value heads), ``ff_proj`` as ``[up; gate]``,
    and the embedding as ``wte.embedding [V]`` + ``wte.new_embedding [additional_vocab_size]``;
    transformers reads it as the model it was written from, and so do we."""
    from safetensors.torch import load_file, save_file

    hf = checks.perturbed(checks.hf_model(_molmo2(**SETTINGS["olmo_qk_norm_after"])))
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    assert "model.transformer.blocks.0.self_attn.att_proj.weight" in tensors
    table = torch.cat([tensors.pop("model.transformer.wte.embedding"), tensors.pop("model.transformer.wte.new_embedding")])
    tensors.update({"model.transformer.wte.embedding": table[:checks.V], "model.transformer.wte.new_embedding": table[checks.V:]})
    save_file(tensors, str(path), metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, ours = T.Molmo2ForConditionalGeneration.from_pretrained(tmp_path).eval(), load_pretrained(tmp_path)
    x = checks.tokens(10)
    x[:, 3] = checks.V + 5
    with torch.no_grad():
        want = hf(input_ids=x).logits
        assert checks.rel(theirs(input_ids=x).logits, want) <= checks.TOL
        assert checks.rel(ours(x), want) <= checks.TOL


def test_greedy_generation_from_a_prompt_with_additional_ids() -> None:
    """A prompt holding ids of the additional vocabulary (read by the embedding, never predicted)."""
    hf = checks.perturbed(checks.hf_model(_molmo2()))
    x = torch.tensor([[5, checks.V + 2, 17, checks.V + 7, 40]])
    with torch.no_grad():
        assert torch.equal(from_hf(hf).generate(x, 6), hf.generate(x, max_new_tokens=6, do_sample=False))
