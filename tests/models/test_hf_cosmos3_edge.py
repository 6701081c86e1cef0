"""Cosmos3-Edge's text decoder (``cosmos3_edge_text``: LLaMA's layers with an ungated ReLU² MLP at
``mlp.fc1`` / ``mlp.fc2`` under Qwen3-VL's multimodal RoPE) through ``Cosmos3EdgeForConditionalGeneration``.
The wrapper's shared checks (logits of a left-padded batch, the base model, greedy generation, folders,
``to_hf``) run in ``test_hf_multimodal.py``; here: the rotation is the 1-D one only on text, MLP biases,
and the released layout (the text model at the top, ``to_q`` / ``up_proj`` names, generator tensors
transformers ignores)."""

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
              pytest.mark.filterwarnings("ignore:.*the text decoder of Cosmos3-Edge is converted")]

#: a two-layer text model, head_dim 16 (8 frequencies, in sections of 2 / 3 / 3)
TEXT = {**checks.SMALL, "num_hidden_layers": 2, "head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}}
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
              num_patches=16)


def _cosmos3_edge(**text: Any) -> Any:
    """Cosmos3-Edge, untied, ReLU² without MLP biases (its defaults)."""
    return T.Cosmos3EdgeConfig(text_config={**TEXT, **text}, vision_config=VISION, projector_hidden_size=32)


def test_the_multimodal_rope_is_the_1d_rope_on_text_only() -> None:
    checks.check_multimodal_rope_on_text(checks.hf_model(_cosmos3_edge()))


def test_mlp_biases_and_another_activation() -> None:
    """``mlp_bias`` (``fc1`` / ``fc2`` biases) and a GELU MLP; ``tie_word_embeddings`` ties nothing (the
    class ties no weights): the head stays its own."""
    config = _cosmos3_edge(mlp_bias=True, hidden_act="gelu")
    config.tie_word_embeddings = True
    hf = checks.perturbed(checks.hf_model(config))
    x = checks.tokens(12)
    with torch.no_grad():
        ours = from_hf(hf)
        assert not ours.tie_embeddings
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL


#: the generator tensors of a released checkpoint (transformers' ``_keys_to_ignore_on_load_unexpected``)
GENERATOR = ["action_modality_embed", "action_proj_in.fc.weight", "time_embedder.linear.weight", "proj_in.weight",
             "norm_moe_gen.weight", "layers.0.input_layernorm_moe_gen.weight", "layers.1.mlp_moe_gen.fc1.weight",
             "layers.0.self_attn.add_q_proj.weight", "layers.1.self_attn.norm_added_k.weight"]


def _released(key: str) -> str:
    """transformers' name of a text tensor -> the released checkpoint's (``conversion_mapping.py`` read backwards)."""
    for ours, theirs in ((".q_proj.", ".to_q."), (".k_proj.", ".to_k."), (".v_proj.", ".to_v."),
                         (".o_proj.", ".to_out."), (".mlp.fc1.", ".mlp.up_proj."), (".mlp.fc2.", ".mlp.down_proj.")):
        key = key.replace(ours, theirs)
    return key.removeprefix("model.language_model.")


def test_the_released_layout_loads_and_drops_the_generator(tmp_path: Path) -> None:
    """The released folder: the text model at the top under the generator's own names, the generator's
    tensors beside it; transformers reads it as the model it was written from, and so do we (the
    generator's tensors named in the warning)."""
    from safetensors.torch import load_file, save_file

    hf = checks.perturbed(checks.hf_model(_cosmos3_edge()))
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = {_released(k): v for k, v in load_file(str(path)).items()}
    tensors.update({k: torch.randn(4) for k in GENERATOR})
    save_file(tensors, str(path), metadata={"format": "pt"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = load_pretrained(tmp_path)
    text = " ".join(str(w.message) for w in caught)
    assert all(f"{g} ({n})" in text for g, n in (("layers.0.*", 2), ("layers.1.*", 2), ("action_modality_embed.*", 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = T.Cosmos3EdgeForConditionalGeneration.from_pretrained(tmp_path).eval()
    x = checks.tokens(10)
    with torch.no_grad():
        want = hf(input_ids=x).logits
        assert checks.rel(theirs(input_ids=x).logits, want) <= checks.TOL
        assert checks.rel(ours(x), want) <= checks.TOL


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hidden_act", "swish_glu", "hidden_act='swish_glu'"),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "mrope_section": [2, 3, 3]},
     "rope_type='linear'")])
def test_a_setting_attnzoo_cannot_build_is_refused_by_name(key: str, value: Any, named: str) -> None:
    """An activation without an ungated form, a scaled RoPE (which Cosmos3-Edge's config refuses too)."""
    hf = checks.hf_model(_cosmos3_edge())
    hf.config.text_config.__dict__[key] = value  # past the config's own validation: a hand-edited config.json
    with pytest.raises(UnsupportedConfigError, match=named):
        from_hf(hf)
