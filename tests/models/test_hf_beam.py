"""Beam and Ergo through ``from_hf`` (``families/beam.py``): sliding RoPE / NoPE full layers with
per-head QK norms and four norms a layer, Beam's per-head-biased output gate, scalable-softmax query
factor on NoPE layers, depth-scaled residual, group-limited sigmoid MoE and logit soft-cap; Ergo's
fused qkv, interleaved RoPE, global attention scale, learned residual gates, ReLU² experts each with
its own output norm and a normed shared expert. Equal to transformers' eager (see
``hf_family_checks``); packed sequences and their gradients equal to each sequence alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_hf_deepseek as deepseek  # noqa: E402

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.families.beam import (  # noqa: E402
    DepthScaledResidual,
    ExpertNormMoE,
    HeadBiasedGate,
    LengthScaledAttention,
    MixedResidualBlock,
    ResidualGate,
)
from attnzoo.nn.moe import MixtureOfExperts  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
_ERGO_SMALL = {k: v for k, v in checks.SMALL.items() if k != "intermediate_size"}


def _beam(**kw: Any) -> Any:
    """4 layers alternating sliding (window 6, RoPE) and full (NoPE, length-scaled queries), dense /
    sparse alternating, 8 experts in 2 groups (top-2 from the best group), head_dim 16, soft-cap 30."""
    return T.BeamConfig(**{**checks.SMALL, "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 6,
                           "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2,
                           "topk_group": 1, "layer_types": KINDS, "mlp_layer_types": ["dense", "sparse"] * 2, **kw})


def _beam_other() -> Any:
    """Beam's default kinds (5 layers: full every sixth and the last; three dense first), q/k/v/o
    biases, one key/value head, a tied head, no soft-cap, YaRN on the sliding layers and RoPE on the
    full ones too, one group of 8 top-3 not renormalised."""
    return _beam(num_hidden_layers=5, layer_types=None, mlp_layer_types=None, attention_bias=True,
                 num_key_value_heads=1, tie_word_embeddings=True, final_logit_softcapping=None, n_group=1,
                 topk_group=1, num_experts_per_tok=3, norm_topk_prob=False, routed_scaling_factor=1.5,
                 rope_parameters={"sliding_attention": YARN,
                                  "full_attention": {"rope_type": "default", "rope_theta": 5e5}})


def _beam_nope_sliding() -> Any:
    """The sliding layers NoPE (length-scaled), the full ones roped; a GELU-gated dense MLP everywhere;
    epsilon 0.3, where the depth-scaled residual differs from a plain one (up to the epsilons the two
    differ by a scale, which the next norm removes)."""
    return _beam(mlp_layer_types=["dense"] * 4, hidden_act="gelu_pytorch_tanh", rms_norm_eps=0.3,
                 rope_parameters={"sliding_attention": None,
                                  "full_attention": {"rope_type": "default", "rope_theta": 1e4}})


def _ergo(**kw: Any) -> Any:
    """4 layers alternating sliding (window 6, interleaved RoPE, theta 1e6) and full (NoPE), the first
    dense (ReLU² of 96), then 8 ReLU² experts top-2 with their output norms and a shared expert of 48."""
    return T.ErgoConfig(**{**_ERGO_SMALL, "num_hidden_layers": 4, "first_dense_intermediate_size": 96,
                           "moe_intermediate_size": 32, "shared_intermediate_size": 48, "num_experts": 8,
                           "num_experts_per_tok": 2, "sliding_window": 6, "global_attention_every_n_layers": 2,
                           "rms_norm_eps": 1e-6, **kw})


def _ergo_other() -> Any:
    """A global attention scale on the full layers, two dense layers, one key/value head, YaRN
    (interleaved) on the sliding layers, top-3, scaling 1.3, epsilon 1e-12 (the default)."""
    return _ergo(global_attention_scale=1.7, num_dense_blocks=2, num_key_value_heads=1, num_experts_per_tok=3,
                 moe_routed_scaling_factor=1.3, rms_norm_eps=1e-12, num_hidden_layers=5,
                 rope_parameters={"sliding_attention": YARN, "full_attention": None})


class TestBeam(checks.FamilyChecks):
    """The NoPE layers' query factor reads absolute positions: transformers' forward without
    ``position_ids`` counts a left-padded row's pads, its ``generate`` (and attnzoo) do not; the
    padded checks pass ``generate``'s positions (unpadded rows: transformers' own)."""

    config = staticmethod(_beam)
    cases = (_beam_nope_sliding, _beam_other)

    def test_logits_equal_transformers(self) -> None:
        for make in (self.config, *self.cases):
            hf = checks.hf_model(make())
            deepseek._check_padded(hf, 30, "logits")
            x = checks.tokens(30)
            with torch.no_grad():
                assert checks.rel(from_hf(hf)(x), hf(input_ids=x).logits) <= checks.TOL

    def test_base_model_equals_transformers(self) -> None:
        for make in (self.config, *self.cases):
            deepseek._check_padded(checks.hf_model(make(), T.AutoModel), 16, "last_hidden_state")


class TestErgo(checks.FamilyChecks):
    config = staticmethod(_ergo)
    cases = (_ergo_other,)


def test_layer_structure() -> None:
    beam = from_hf(checks.hf_model(_beam()))
    assert all(type(b) is MixedResidualBlock for b in beam.blocks)
    assert [b.attn.length_scaled for b in beam.blocks] == [False, True, False, True]
    assert [b.attn.rope is None for b in beam.blocks] == [False, True, False, True]
    assert all(type(b.attn) is LengthScaledAttention and type(b.attn.frontier.gate_proj) is HeadBiasedGate
               for b in beam.blocks)
    assert [(b.attn_residual.index, b.ffn_residual.index) for b in beam.blocks] == [(2, 3), (4, 5), (6, 7), (8, 9)]
    assert [isinstance(b.ffn, MixtureOfExperts) for b in beam.blocks] == [False, True, False, True]
    moe = beam.blocks[1].ffn
    assert (moe.groups, moe.topk_groups, moe.routed_scaling, moe.shared_expert) == (2, 1, 2.5, None)
    assert moe.router.weight.dtype == torch.float32 and beam.lm_head.softcap == 30.0
    assert beam.blocks[0].attn.window[0] == 5 and type(beam.blocks[0].attn_residual) is DepthScaledResidual
    ergo = from_hf(checks.hf_model(_ergo_other()))
    assert all(b.attn.frontier.gate_proj is None and not b.attn.length_scaled for b in ergo.blocks)
    assert [b.attn.rope is None for b in ergo.blocks] == [False, True, False, True, False]
    assert ergo.blocks[0].attn.rope.interleaved and ergo.blocks[1].attn.scale == pytest.approx(16 ** -0.5 * 1.7)
    assert ergo.blocks[0].attn.scale is None and type(ergo.blocks[0].attn_residual) is ResidualGate
    assert [type(b.ffn) is ExpertNormMoE for b in ergo.blocks] == [False, False, True, True, True]
    assert ergo.blocks[2].ffn.activation == "relu2" and ergo.lm_head.weight is not ergo.tok_emb.weight


@pytest.mark.parametrize("make", [_beam, _beam_other, _ergo, _ergo_other], ids=["beam", "beam2", "ergo", "ergo2"])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    checks.check_packed_equals_each_alone(make)


@pytest.mark.parametrize("make", [_beam, _ergo_other], ids=["beam", "ergo"])
def test_packed_gradients_equal_each_alone(make: Any) -> None:
    checks.check_packed_gradients_equal_each_alone(make)


def test_greedy_generation_nope_sliding() -> None:
    """Length-scaled sliding layers decode with their positions too (batch 1 and left-padded)."""
    checks.check_generation(_beam_nope_sliding)


def test_ergo_tie_word_embeddings_is_not_read(tmp_path: Path) -> None:
    """``ErgoForCausalLM`` never ties its head (no ``_tied_weights_keys``), whatever the config says."""
    hf = checks.hf_model(_ergo(tie_word_embeddings=True))
    ours, x = from_hf(hf), checks.tokens(10)
    assert ours.lm_head.weight is not ours.tok_emb.weight
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL


def _beam_json() -> Any:
    """Beam with its defaults where the test leaves keys out (the default kinds, 16 experts: 8 groups of 2)."""
    return _beam(num_hidden_layers=4, layer_types=None, mlp_layer_types=None, num_experts=16, n_group=8,
                 topk_group=4, routed_scaling_factor=2.5, final_logit_softcapping=30.0)


@pytest.mark.parametrize("make,keys", [
    (_beam_json, ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "final_logit_softcapping",
                  "attention_bias", "rms_norm_eps", "hidden_act", "tie_word_embeddings", "layer_types",
                  "mlp_layer_types", "rope_parameters")),
    (lambda: _ergo(rms_norm_eps=1e-12, layer_types=None), (
        "rms_norm_eps", "layer_types", "mlp_layer_types", "rope_parameters", "num_dense_blocks",
        "moe_routed_scaling_factor", "global_attention_scale", "tie_word_embeddings")),
], ids=["beam", "ergo"])
def test_config_json_with_keys_left_out(tmp_path: Path, make: Any, keys: tuple[str, ...]) -> None:
    """Keys left out of ``config.json`` read as the config classes' defaults (as ``from_pretrained``)."""
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


@pytest.mark.parametrize("model,make,key,value,named", [
    ("beam", _beam, "rope_parameters", {"rope_type": "default", "rope_theta": 1e4}, "rope_parameters"),
    ("beam", _beam, "rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                              "partial_rotary_factor": 0.5}, "full_attention": None},
     "partial_rotary_factor"),
    ("beam", _beam, "hidden_act", "gelu", "hidden_act"),
    ("beam", _beam, "n_group", 3, "n_group=3"),
    ("beam", _beam, "n_group", None, "n_group=None"),
    ("beam", _beam, "topk_group", 3, "topk_group=3"),
    ("beam", _beam, "mlp_layer_types", ["dense", "moe", "dense", "sparse"], "mlp layer type 'moe'"),
    ("beam", _beam, "layer_types", ["sliding_attention", "chunked_attention"] * 2, "layer type 'chunked_attention'"),
    ("beam", _beam, "sliding_window", None, "sliding_window"),
    ("beam", _beam, "pretraining_tp", 2, "pretraining_tp"),
    ("ergo", _ergo, "rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
     "rope_parameters"),
    ("ergo", _ergo, "mlp_layer_types", ["dense", "sparse", "moe", "sparse"], "mlp layer type 'moe'"),
])
def test_unsupported_options_are_refused(model: str, make: Any, key: str, value: Any, named: str) -> None:
    cls = {"beam": T.BeamForCausalLM, "ergo": T.ErgoForCausalLM}[model]
    checks.check_refused(cls, make, key, value, named)


def test_ergo_half_precision_keeps_the_float32_stream(tmp_path: Path) -> None:
    """``from_hf(dtype=bfloat16)``: Ergo's embedding, norms, residual gates, router and expert norms stay
    float32 (transformers' ``_keep_in_fp32_modules_strict``, but the q/k norms), through ``.half()`` too;
    the residual stream runs in float32 and the logits come in bfloat16, no worse than transformers' own
    bfloat16 model (``from_pretrained(dtype=)``) by more than 1.3x against the float32 logits (measured
    0.92-1.11 over seeds 0-2 in both half dtypes, top-k made all-inclusive; 1.2-1.5 with a 16-bit stream)."""
    hf = checks.hf_model(_ergo(num_experts_per_tok=8))
    ours = from_hf(hf, dtype=torch.bfloat16)
    kept = {n for n, p in ours.named_parameters() if p.dtype == torch.float32}
    ends = ("tok_emb.weight", "norm.weight", "_residual.weight", "router.weight", "expert_norm",
            "post_mlp_layernorm.weight")
    assert kept == {n for n, _ in ours.named_parameters() if n.endswith(ends)}
    hf.save_pretrained(tmp_path)
    peer = T.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    x, mask = checks.padded(30)
    real = mask.bool()
    with torch.no_grad():
        ref = hf(input_ids=x, attention_mask=mask).logits[real]
        got = ours(x, attention_mask=real)
        theirs = peer(input_ids=x, attention_mask=mask).logits.float()[real]
    assert got.dtype == torch.bfloat16
    err, peer_err = (float((t.float() - ref).norm() / ref.norm()) for t in (got[real], theirs))
    assert err <= 1.3 * peer_err, (err, peer_err)
    ours.half()
    assert {n for n, p in ours.named_parameters() if p.dtype == torch.float32} == kept


@pytest.mark.parametrize("make", [_beam, _beam_other, _ergo_other], ids=["beam", "beam2", "ergo"])
def test_register_equals_eager_and_packs(make: Any) -> None:
    """transformers' own model served by ``attnzoo.hf.register()`` gives its eager logits on a
    left-padded batch, and packed (``DataCollatorWithFlattening``) input gives each sequence's alone."""
    hf = checks.hf_model(make())
    checks.check_register_equals_eager(hf)
    checks.check_transformers_packed(hf)
