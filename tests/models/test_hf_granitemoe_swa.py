"""GraniteMoe-SWA (``granitemoe_swa``) through ``from_hf``: sliding/full layers (every fourth full
by default) with a window shorter than the test sequences, attention sinks, per-layer RoPE bases
(``0``: NoPE), scores scaled by ``attention_multiplier``, top-k-softmax experts with or without
the shared MLP, the embedding, residual and logit multipliers. Equal to transformers' eager (see
``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo import FeedForward  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.families.granitemoe_swa import build_granitemoe_swa  # noqa: E402
from attnzoo.models.hf._state import HFConfig  # noqa: E402
from attnzoo.models.parts import ScaledEmbedding  # noqa: E402
from attnzoo.nn.moe import MixtureOfExperts  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

#: every multiplier != 1, the attention's != head_dim ** -0.5 (0.25 here)
MULTIPLIERS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.5,
                   logits_scaling=4.0)
#: five layers: transformers' default layer_types (full, sliding, sliding, sliding, full)
THETAS = [10000.0, 500.0, 0.0, 10000.0, 0.0]


def _config(**kw: Any) -> Any:
    """The default layer mix (every fourth layer full) with a window of 6 keys, per-layer RoPE
    bases with two NoPE layers (one sliding, one full), experts plus the shared MLP, tied
    embeddings, every multiplier != 1."""
    return T.GraniteMoeSWAConfig(**{
        **checks.SMALL, "num_hidden_layers": 5, "sliding_window": 6, "layer_rope_theta": THETAS,
        "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 48,
        "tie_word_embeddings": True, **MULTIPLIERS, **kw})


def _plain(**kw: Any) -> Any:
    """Explicit layer types, one RoPE base for all layers (``layer_rope_theta`` left to the config's
    ``rope_theta``), no shared MLP, attention biases, untied head, top-1 of 3 experts, other
    multipliers (a logit scale < 1)."""
    return T.GraniteMoeSWAConfig(**{
        **checks.SMALL, "num_hidden_layers": 4, "sliding_window": 5,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, "attention_bias": True,
        "intermediate_size": 32, "num_local_experts": 3, "num_experts_per_tok": 1, "shared_intermediate_size": 0,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5, "attention_multiplier": 0.3, "logits_scaling": 0.5, **kw})


def _scaled_rope(**kw: Any) -> Any:
    """A scaled RoPE type (linear) under per-layer bases, the shared MLP with an untied head."""
    return _config(**{"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
                      "tie_word_embeddings": False, **kw})


def _left(attn: Any) -> int | None:
    """The keys an attention layer sees back (``None``: every earlier key)."""
    return None if attn.window is None else attn.window[0]


class TestGraniteMoeSWA(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_scaled_rope, _plain)

    def test_packed_sequences_equal_each_alone(self) -> None:
        """Packed sequences through the windows, sinks and NoPE layers == each sequence alone."""
        for make in (_config, _plain):
            checks.check_packed_equals_each_alone(make)

    def test_packed_training_gradients_equal_each_alone(self) -> None:
        checks.check_packed_gradients_equal_each_alone(_config)


def test_layers_are_built_from_the_config() -> None:
    ours = from_hf(checks.hf_model(_config()))
    attns = [b.attn for b in ours.blocks]
    assert [_left(a) for a in attns] == [None, 5, 5, 5, None]  # sliding_window - 1 keys back
    assert [None if a.rope is None else a.rope.base for a in attns] == [1e4, 500.0, None, 1e4, None]
    assert all(a.scale == 0.5 and a.frontier.sinks is not None for a in attns)
    moes = [b.ffn for b in ours.blocks]  # top-2 of the logits, then a softmax; the shared MLP as shared expert
    assert {(type(f), f.routing, f.top_k, type(f.shared_expert)) for f in moes} == \
        {(MixtureOfExperts, "topk_softmax", 2, FeedForward)}
    assert (type(ours.tok_emb), ours.tok_emb.scale, ours.tie_embeddings) == (ScaledEmbedding, 12.0, True)

    plain = from_hf(checks.hf_model(_plain()))
    assert [_left(b.attn) for b in plain.blocks] == [4, None, 4, 4]
    assert all(b.attn.rope.base == 500.0 and b.ffn.shared_expert is None for b in plain.blocks)
    assert not plain.tie_embeddings


def test_multipliers_are_folded_into_the_weights() -> None:
    """``residual_multiplier`` scales every weight writing into the residual stream,
    ``1 / logits_scaling`` the final norm of the LM (not of the base model)."""
    hf = checks.hf_model(_config())
    ours, layer, r = from_hf(hf), hf.model.layers[1], 0.22
    with torch.no_grad():
        assert torch.allclose(ours.blocks[1].attn.out_proj.weight, r * layer.self_attn.o_proj.weight)
        assert torch.allclose(ours.blocks[1].ffn.down_proj, r * layer.block_sparse_moe.experts.down_proj)
        assert torch.allclose(ours.blocks[1].ffn.shared_expert.down_proj.weight, r * layer.shared_mlp.output_linear.weight)
        assert torch.allclose(ours.norm.weight, hf.model.norm.weight / 4.0)
        base = from_hf(checks.hf_model(_config(), T.AutoModel))
        assert torch.equal(base.norm.weight, hf.model.norm.weight)
        plain = checks.hf_model(_plain())
        got = from_hf(plain).blocks[0].attn.out_proj.bias
        assert torch.allclose(got, 0.5 * plain.model.layers[0].self_attn.o_proj.bias)


def test_builder_matches_the_conversion() -> None:
    """``build_granitemoe_swa`` (random weights) has the converted model's parameters, and reads a
    config.json without the keys transformers defaults (every fourth layer full, one RoPE base)."""
    for make in (_config, _plain):
        built = build_granitemoe_swa(HFConfig(make().to_dict(), "test"))
        converted = from_hf(checks.hf_model(make()))
        assert {k: v.shape for k, v in built.state_dict().items()} == \
            {k: v.shape for k, v in converted.state_dict().items()}
    bare = {k: v for k, v in _config().to_dict().items()
            if k not in ("layer_types", "layer_rope_theta", "sliding_window", "rms_norm_eps")}
    built = build_granitemoe_swa(HFConfig(bare, "test"))
    assert [_left(b.attn) for b in built.blocks] == [None, 127, 127, 127, None]
    assert all(b.attn.rope.base == 1e4 for b in built.blocks) and built.norm.eps == 1e-6


def test_saved_folder_without_defaulted_keys_loads(tmp_path: Path) -> None:
    """A config.json without ``layer_types`` (every fourth layer full), ``rms_norm_eps``,
    ``num_experts_per_tok``: read as transformers reads it."""
    checks.check_folder_without_keys(checks.hf_model(_config()), tmp_path / "a",
                                     ("layer_types", "rms_norm_eps", "num_experts_per_tok"))
    checks.check_folder_without_keys(checks.hf_model(_plain(rms_norm_eps=1e-6)), tmp_path / "b",
                                      ("layer_rope_theta", "shared_intermediate_size", "tie_word_embeddings"))


def test_saved_folder_of_the_plain_case_loads(tmp_path: Path) -> None:
    checks.check_folder(_plain, tmp_path)


@pytest.mark.parametrize(("make", "key", "value", "named"), [
    (_config, "hidden_act", "gelu", "hidden_act"),
    (_config, "attention_multiplier", 0.0, "attention_multiplier"),
    (_config, "embedding_multiplier", -1.0, "embedding_multiplier"),
    (_config, "logits_scaling", 0.0, "logits_scaling"),
    (_config, "layer_rope_theta", [1e4, -5.0, 0.0, 1e4, 0.0], "layer_rope_theta"),
    (_config, "num_local_experts", 0, "num_local_experts"),
    (_config, "sliding_window", None, "sliding_window"),
    (_config, "layer_types", ["full_attention", "chunked_attention", "full_attention", "full_attention",
                              "full_attention"], "chunked_attention"),
    (_plain, "rope_parameters", {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    (_plain, "rope_parameters", {"rope_type": "made_up", "rope_theta": 500.0}, "rope_type"),
])
def test_options_it_cannot_reproduce_are_refused(make: Any, key: str, value: Any, named: str) -> None:
    checks.check_refused(T.GraniteMoeSWAForCausalLM, make, key, value, named)
