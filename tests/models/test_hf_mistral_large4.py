"""Mistral-Large-4 (``mistral_large4``, its text model ``mistral_large4_text``) through ``from_hf`` /
``load_pretrained``: latent attention without a query LoRA, learned per-head log-position query scales,
LeRoPE (YaRN frequencies times ``exp(alpha)``), the hidden-state-query DSA indexer, Mistral-4's grouped
softmax MoE, soft-capped logits; equal to transformers' eager ``MistralLarge4ForConditionalGeneration``
on text, with the indexer selecting every key (``index_topk`` >= the sequence) and selecting few.
NoPE layers and "shared" indexer layers convert; KV sharing is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_hf_deepseek_dsa import check_decode_at_ties  # noqa: E402

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import UnsupportedConfigError, from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.mistral_large4 import (  # noqa: E402
    HiddenQueryTopK,
    MistralLarge4Attention,
    MistralLarge4SharedAttention,
)
from attnzoo.nn.mla import LatentCache  # noqa: E402

T = transformers
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*the text decoder of Mistral-Large-4")]

#: a one-layer Pixtral tower
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14, head_dim=8)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0}


def _text(**kw: Any) -> dict[str, Any]:
    """3 layers (a dense one, then MoE: 4 experts in 2 groups, top-2 from 1 group, a shared expert),
    heads of 8 nope + 4 rope channels, a 16-wide latent, YaRN, an indexer of 2 heads keeping 64 keys
    (every key of these sequences), RoPE on every layer, no KV sharing."""
    return {**checks.SMALL, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4, "v_head_dim": 8, "moe_intermediate_size": 16, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5,
            "index_topk": 64, "index_head_dim": 8, "index_n_heads": 2, "no_rope_layers": [1, 1, 1],
            "rope_parameters": dict(YARN), **kw}


def _large4(**kw: Any) -> Any:
    return T.MistralLarge4Config(text_config=_text(**kw), vision_config=dict(VISION))


def _selecting() -> Any:
    """The indexer keeps 5 keys of each query's (selection active from the 6th token), plain RoPE,
    attention biases, every layer MoE, a softcap of 5 (tanh far from linear)."""
    return _large4(index_topk=5, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                   attention_bias=True, first_k_dense_replace=0, final_logit_softcapping=5.0)


def _check_padded(make: Any, n: int = 30, pad: int = 5) -> float:
    """A left-padded batch against transformers given the positions of the real tokens (the query
    scales are a function of the absolute position, so transformers' own arange over the pads, which
    its ``generate`` does not use, gives other numbers); logits and the base model's hidden states."""
    hf = checks.hf_model(make())
    x, mask = checks.padded(n, pad)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    real = mask.bool()
    with torch.no_grad():
        ref = hf(input_ids=x, attention_mask=mask, position_ids=pos).logits
        base = hf.model.language_model(input_ids=x, attention_mask=mask, position_ids=pos).last_hidden_state
        got = from_hf(hf)(x, attention_mask=real)
        hidden = from_hf(hf.model.language_model)(x, attention_mask=real)
    err = max(checks.rel(got[real], ref[real]), checks.rel(hidden[real], base[real]))
    assert err <= checks.TOL, f"relative error {err:.2e}"
    return err


def _nope() -> Any:
    """4 layers with transformers' default ``no_rope_layers`` (the 4th a NoPE layer: its attention and
    indexer rotate nothing, its latent has no RoPE key), YaRN with ``mscale_all_dim`` (the NoPE layer's
    softmax scale takes it too)."""
    config = _large4(num_hidden_layers=4, rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})
    config.text_config.no_rope_layers = [int((i + 1) % 4 != 0) for i in range(4)]  # what no key derives
    return config


def _selecting_wide() -> Any:
    """:func:`_selecting` with a 16-head indexer (no exact ties at the top-k cut on the tested tokens),
    NoPE layers 0 and 2, and layer 1 a ``"shared"`` indexer layer (layer 0's selection, no indexer)."""
    config = _large4(index_topk=5, index_n_heads=16, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                     attention_bias=True, first_k_dense_replace=0, final_logit_softcapping=5.0,
                     no_rope_layers=[0, 1, 0])
    config.text_config.indexer_types = ["full", "shared", "full"]
    return config


class TestMistralLarge4(checks.FamilyChecks):
    config = staticmethod(_large4)
    cases = (_selecting, _nope, _selecting_wide)  # the last one decodes (see test_cached_decode_follows_transformers_at_ties)

    def test_logits_equal_transformers(self) -> None:
        for make in (self.config, *self.cases):
            _check_padded(make)

    def test_base_model_equals_transformers(self) -> None:
        """In :meth:`test_logits_equal_transformers` (the text model's hidden states), and unpadded:"""
        for make in (self.config, *self.cases):
            hf = checks.hf_model(make())
            x = checks.tokens(20)
            with torch.no_grad():
                ref = hf.model.language_model(input_ids=x).last_hidden_state
                assert checks.rel(from_hf(hf.model.language_model)(x), ref) <= checks.TOL


def test_layer_structure_and_parameter_count() -> None:
    hf = checks.hf_model(_large4())
    ours = from_hf(hf)
    attn = ours.blocks[1].attn
    assert isinstance(attn, MistralLarge4Attention) and isinstance(attn.indexer, HiddenQueryTopK)
    alpha = hf.model.language_model.rotary_emb.alpha
    assert torch.equal(attn.rope_alpha, alpha.detach())
    assert ours.lm_head.softcap == 30.0
    text = sum(p.numel() for n, p in hf.named_parameters() if "vision" not in n and "projector" not in n)
    # LeRoPE's alpha: one tensor of the model, a buffer of each attention here
    assert sum(p.numel() for p in ours.parameters()) == text - alpha.numel()


def test_selection_is_active_and_matters() -> None:
    """With ``index_topk=5`` the indexer drops keys (the logits differ from the dense selection's), and
    a left-padded batch still equals transformers' (``check_logits`` above)."""
    hf = checks.hf_model(_selecting())
    x = checks.tokens(16)
    with torch.no_grad():
        sparse = from_hf(hf)(x)
        hf.config.text_config.index_topk = 64
        dense = from_hf(hf)(x)
    assert checks.rel(sparse, dense) > 1e-3


def test_cached_decode_follows_transformers_at_ties() -> None:
    """With 2 index heads keys tie at exactly 0 at the top-k cut, which ``torch.topk`` breaks
    differently in a full row and in a decode step: transformers' cached decode differs from its own
    full forward, and attnzoo's equals transformers' in both (as DeepSeek-V3.2's, test_hf_deepseek_dsa)."""
    check_decode_at_ties(_selecting)


def test_the_text_model_alone(tmp_path: Path) -> None:
    """``MistralLarge4TextModel`` converts as the base decoder, in memory and from its saved folder
    (Mistral's layer names: ``layers.{i}.attention.wq``, ``feed_forward.w1``, ...)."""
    hf = checks.hf_model(_large4())
    text = hf.model.language_model
    text.save_pretrained(tmp_path)
    assert "layers.0.attention.wq.weight" in safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    x = checks.tokens(12)
    with torch.no_grad():
        ref = text(input_ids=x).last_hidden_state
        assert checks.rel(from_hf(text)(x), ref) <= checks.TOL
        assert checks.rel(load_pretrained(tmp_path)(x), ref) <= checks.TOL


@pytest.mark.parametrize(("key", "value", "named"), [
    ("no_rope_layers", [1, 2, 1], "no_rope_layers"),
    ("kv_source_layers", [0, 0, 2], "kv_source_layers"),
    ("indexer_types", ["shared", "full", "full"], "indexer_types"),
    ("indexer_types", ["full", "sparse", "full"], "indexer_types"),
])
def test_refused_by_name(key: str, value: Any, named: str) -> None:
    hf = checks.hf_model(_large4())
    setattr(hf.config.text_config, key, value)
    with pytest.raises(UnsupportedConfigError, match=named):
        from_hf(hf)


def test_shared_indexer_layers() -> None:
    """``index_topk_pattern`` ``"FSFS"``: layers 1 and 3 have no indexer and attend the keys layers 0
    and 2 selected (transformers' ``prev_topk_indices``); their caches hold the latent alone."""
    text = _text(num_hidden_layers=4, index_topk=5, index_n_heads=16, no_rope_layers=[1, 1, 1, 1],
                 index_topk_pattern="FSFS")
    hf = checks.hf_model(T.MistralLarge4Config(text_config=text, vision_config=dict(VISION)))
    assert hf.config.text_config.indexer_types == ["full", "shared", "full", "shared"]
    ours = from_hf(hf)
    assert isinstance(ours.blocks[1].attn, MistralLarge4SharedAttention) and ours.blocks[1].attn.indexer is None
    assert isinstance(ours.blocks[1].attn.init_cache(1, 4), LatentCache)
    x = checks.tokens(16)
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL


def test_default_nope_layers() -> None:
    """No ``no_rope_layers`` key: transformers' default (every 4th layer NoPE, its ``kv_a_proj_with_mqa``
    ``kv_lora_rank`` wide, its ``kv_b_proj`` keys ``qk_nope_head_dim + qk_rope_head_dim`` wide)."""
    text = _text(num_hidden_layers=4)
    del text["no_rope_layers"]
    hf = checks.hf_model(T.MistralLarge4Config(text_config=text, vision_config=dict(VISION)))
    assert hf.config.text_config.no_rope_layers == [1, 1, 1, 0]
    ours = from_hf(hf)
    nope = ours.blocks[3].attn
    assert nope.rope is None and nope.sizes.qk_rope_head_dim == 0 and nope.sizes.qk_nope_head_dim == 12
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL


def test_saved_folder_with_the_draft_head(tmp_path: Path) -> None:
    """``save_pretrained`` writes Mistral's own names (``tok_embeddings``, ``layers.{i}.attention.wq``,
    ``experts.{e}.w1``, ``lerope.alpha``, ``ssmax_scaling.s``, ...; what the release holds); with the
    release's ``mtp_dspark.*`` draft head added (transformers ignores it), the folder loads, the
    draft head dropped, and gives transformers' logits."""
    hf = checks.hf_model(_large4())
    hf.save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = safetensors_torch.load_file(path)
    assert "lerope.alpha" in tensors and "layers.1.experts.0.w1.weight" in tensors
    tensors["mtp_dspark.layers.0.attention.wq.weight"] = torch.zeros(4, 4)
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})
    x = checks.tokens(12)
    with pytest.warns(UserWarning, match="mtp_dspark"):
        model = load_pretrained(tmp_path)
    with torch.no_grad():
        assert checks.rel(model(x), hf(input_ids=x).logits) <= checks.TOL


def test_a_query_scaling_class_without_its_factor_is_refused_when_defined() -> None:
    from attnzoo.models.families.deepseek import ScaledQueries
    from attnzoo.nn.mla import MultiHeadLatentAttention

    with pytest.raises(TypeError, match="defines _scale_of"):
        type("Unscaled", (ScaledQueries, MultiHeadLatentAttention), {})
