"""Decoders saved before issue 32 (``DecoderConfig`` with every family's options as fields) load
into the parts-based models: config dicts, state dicts and logits made with commit 9d5a293's
attnzoo (``tests/models/data/legacy_decoders.pt``: a Gemma-2-like, an OLMo-2-like, a classifier,
a post-norm model without head, a cross-attention decoder and a plain GQA one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnzoo.models import DecoderConfig, Rope, decoder_from_dict

DATA = torch.load(Path(__file__).parent / "data" / "legacy_decoders.pt", weights_only=True)


@pytest.mark.parametrize("name", sorted(DATA))
def test_old_config_and_state_dict_give_the_old_logits(name: str) -> None:
    case = DATA[name]
    model = decoder_from_dict(case["config"]).eval()
    model.load_state_dict(case["state"])  # strict: the weight names did not change
    with torch.no_grad():
        out = model(case["tokens"], context=case["context"])
    torch.testing.assert_close(out, case["logits"], rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{name}: logits differ from the saved ones: {m}")


def test_config_from_dict_translates_rope_and_names_the_moved_fields() -> None:
    old = DATA["plain"]["config"]
    cfg = DecoderConfig.from_dict(old)
    assert cfg.rope == Rope(base=1000.0) and cfg.attention == "gqa" and len(DecoderConfig.field_names()) == 18
    assert DecoderConfig.from_dict(cfg.to_dict()) == cfg == DecoderConfig(**cfg.to_dict())  # a new dict round-trips
    assert json.loads(json.dumps(cfg.to_dict()))["rope"] == {"base": 1000.0, "scaling": None, "factor": 1.0,
                                                             "parameters": None}
    yarn = DecoderConfig.from_dict({**old, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    assert yarn.rope.parameters == {"rope_type": "yarn", "factor": 2.0}
    with pytest.raises(ValueError, match=r"embed_scale=4\.0 -> DecoderParts\(embedding=ScaledEmbedding"):
        DecoderConfig.from_dict(DATA["cross"]["config"])
    with pytest.raises(TypeError, match="'depht'"):
        DecoderConfig.from_dict({**old, "depht": 3})
    with pytest.raises(TypeError, match="values must be a dict"):
        DecoderConfig.from_dict([("dim", 3)])  # type: ignore[arg-type]


def test_rope_field_takes_a_number_or_a_hugging_face_dict() -> None:
    assert DecoderConfig(10, 8, 1, 2, rope=5e5).rope == Rope(base=5e5)
    hf = DecoderConfig(10, 8, 1, 2, rope={"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0}).rope
    assert hf.base == 100.0 and hf.parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0}
    with pytest.raises(TypeError, match="rope must be a Rope"):
        DecoderConfig(10, 8, 1, 2, rope="yarn")
    with pytest.raises(ValueError, match="factor must be >= 1"):
        Rope(scaling="linear", factor=0.5)
