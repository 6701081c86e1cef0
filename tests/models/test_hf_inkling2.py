"""Inkling2 through ``from_hf``: sliding layers (static short convolutions on k / v) and full layers
(dynamic ones, log-scaled queries), relative position biases, per-query sinks, gated outputs,
softcapped MoE, short convolutions after every sub-layer, and the block attention residuals
carrying the block states; equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import UnsupportedConfigError, from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.inkling2 import (  # noqa: E402
    DynamicShortConv,
    Inkling2LM,
    ShortConv,
    SoftcappedMoE,
    convert_inkling2,
)
from attnzoo.models.hf._state import HFConfig  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

S, F = "hybrid_sliding", "hybrid"


def _config(**kw: Any) -> Any:
    """Sliding / full alternating, blocks of 2 layers, GQA, a window (8) and a relative extent (12)
    shorter than the inputs, clips small enough to act, the unembedding 8 rows short of the embedding."""
    base = dict(vocab_size=136, unpadded_vocab_size=checks.V, hidden_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
                swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=8, d_rel=4, rel_extent=12,
                log_scaling_n_floor=1000, layer_types=[S, F, S, F], moe_intermediate_size=32, n_routed_experts=4,
                num_experts_per_tok=2, n_layers_per_attn_res_block=2, pad_token_id=0, eos_token_id=2,
                max_position_embeddings=256, qk_l2_clip_threshold=1.5, rel_l2_clip_threshold=1.0)
    return T.Inkling2TextConfig(**{**base, **kw})


def _wide() -> Any:
    """Head widths apart from hidden / heads and apart between the layer kinds (full: 6 heads of 12,
    3 kv heads; sliding: 4 heads of 8, MQA), a full first layer, blocks of 3, 3 taps, a window of 5,
    a relative extent past the inputs, no vocabulary padding, small softcaps, 3 of 6 experts."""
    return _config(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=12,
                   swa_num_attention_heads=4, swa_num_key_value_heads=1, swa_head_dim=8, sliding_window_size=5,
                   rel_extent=40, num_hidden_layers=6, layer_types=[F, S, S, F, S, F], n_layers_per_attn_res_block=3,
                   conv_kernel_size=3, vocab_size=checks.V, mlp_gate_softcap=0.5, mlp_up_softcap=1.0,
                   final_logit_softcapping=5.0, route_scale=2.5, n_routed_experts=6, num_experts_per_tok=3,
                   rms_norm_eps=1e-5)


def _default_layout() -> Any:
    """transformers' default ``layer_types`` (full every 6th layer), a block per layer, d_rel 16."""
    return _config(num_hidden_layers=6, layer_types=None, n_layers_per_attn_res_block=1, d_rel=16,
                   conv_kernel_size=4, sliding_window_size=6)


def _log_scaled() -> Any:
    """The full layers' log scale acting from position 3 (``log_scaling_n_floor`` 4)."""
    return _config(log_scaling_n_floor=4, log_scaling_alpha=0.5)


class TestInkling2(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_wide, _default_layout)


def test_structure() -> None:
    ours = from_hf(checks.hf_model(_wide()))
    assert isinstance(ours, Inkling2LM)
    assert [b.attn.full for b in ours.blocks] == [True, False, False, True, False, True]
    assert [b.boundary for b in ours.blocks] == [True, False, False, True, False, False]
    assert ours.blocks[0].attn_input is None
    assert [b.attn_input.query.shape[0] for b in ours.blocks[1:]] == [1, 1, 3, 1, 3]
    full, sliding = ours.blocks[3].attn, ours.blocks[1].attn
    assert isinstance(full.k_conv, DynamicShortConv) and isinstance(sliding.v_conv, ShortConv)
    assert (full.q_proj.out_features, full.k_proj.out_features) == (72, 36)
    assert (sliding.q_proj.out_features, sliding.k_proj.out_features, sliding.window) == (32, 8, 5)
    assert (full.rel.extent, sliding.rel.extent) == (40, 5)
    assert isinstance(ours.blocks[0].ffn, SoftcappedMoE) and ours.blocks[0].ffn.top_k == 3
    assert ours.blocks[0].attn_conv.taps == 3 and ours.lm_head.softcap == 5.0
    padded = from_hf(checks.hf_model(_config()))
    assert padded.tok_emb.weight.shape[0] == 136 and padded.lm_head.out_features == padded.vocab_size == checks.V


def test_log_scale_reads_positions_from_the_mask() -> None:
    """The full layers' log scale at positions counted from each row's first real token (as
    transformers' ``generate`` numbers them); generation and cached decode with it."""
    hf = checks.hf_model(_log_scaled())
    ours = from_hf(hf)
    x, mask = checks.padded(30)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(input_ids=x, attention_mask=mask, position_ids=positions).logits
        got = ours(x, attention_mask=mask.bool())
    real = mask.bool()
    assert checks.rel(got[real], ref[real]) <= checks.TOL
    checks.check_generation(_log_scaled)
    checks.check_cached_decode(_log_scaled)


def test_generation_past_the_window() -> None:
    """Generation past the sliding window (5) and the dynamic convolutions of a full first layer."""
    checks.check_generation(_wide, prompt=9, new=6)


@pytest.mark.parametrize("check", [checks.check_packed_equals_each_alone,
                                   checks.check_packed_gradients_equal_each_alone])
def test_packed_sequences_and_their_gradients_equal_each_alone(check: Any) -> None:
    check(_config)


def test_saved_folder_of_wide_config_loads(tmp_path: Any) -> None:
    """``save_pretrained`` writes the checkpoint's own names (``model.llm.*``, interleaved experts,
    ``attn_res`` queries, the unembedding padded back): they load too."""
    checks.check_folder(_wide, tmp_path)


def test_base_model_folder_loads(tmp_path: Any) -> None:
    hf = checks.hf_model(_config(), T.AutoModel)
    hf.save_pretrained(tmp_path)
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).last_hidden_state) <= checks.TOL


def test_folder_without_default_keys_loads(tmp_path: Any) -> None:
    """A ``config.json`` without the keys at ``Inkling2TextConfig``'s defaults loads as transformers reads it."""
    hf = checks.hf_model(_config(layer_types=None, num_hidden_layers=6, n_layers_per_attn_res_block=6, d_rel=16,
                                 qk_l2_clip_threshold=22.627416997969522, rel_l2_clip_threshold=8.0))
    keys = ("layer_types", "n_layers_per_attn_res_block", "d_rel", "qk_l2_clip_threshold", "rel_l2_clip_threshold",
            "rms_norm_eps", "conv_kernel_size", "log_scaling_alpha", "mlp_gate_softcap", "mlp_up_softcap",
            "final_logit_softcapping", "scoring_func", "route_scale", "attention_dropout")
    checks.check_folder_without_keys(hf, tmp_path, keys)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("scoring_func", "softmax", "scoring_func"),
    ("layer_types", [S, "full_attention", S, F], "full_attention"),
    ("swa_num_key_value_heads", 3, "swa_num_attention_heads=4 not a multiple of swa_num_key_value_heads=3"),
    ("num_key_value_heads", 3, "num_attention_heads=4 not a multiple of num_key_value_heads=3"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.Inkling2ForCausalLM, _config, key, value, named)


def test_quantized_weights_are_refused() -> None:
    hf = checks.hf_model(_config())
    sd = dict(hf.state_dict())
    sd["model.layers.0.mlp.experts.gate_up_proj_scale_inv"] = torch.ones(4, 64, 2)
    with pytest.raises(UnsupportedConfigError, match="quantized weights"):
        convert_inkling2(HFConfig(hf.config.to_dict(), "test", "Inkling2"), sd, device=None, dtype=None)



def test_tie_word_embeddings_leaves_the_head_apart() -> None:
    """transformers never ties Inkling2's unembedding (``_tied_weights_keys = {}``), whatever
    ``tie_word_embeddings`` says: neither does the converted model."""
    make = lambda: _config(tie_word_embeddings=True, vocab_size=checks.V)  # noqa: E731
    checks.check_logits(make, n=12)
    ours = from_hf(checks.hf_model(make()))
    assert not ours.tie_embeddings and ours.lm_head.weight is not ours.tok_emb.weight


def check_chunked_cache(make: Any) -> None:
    """Cached calls of several tokens (chunked prefill) equal the full forward, and a call that
    overflows the cache leaves it as it was (the next call goes on from there)."""
    ours = from_hf(checks.hf_model(make()))
    x = checks.tokens(24)
    with torch.no_grad():
        full = ours(x)
        cache = ours.init_cache(2, 24)
        steps = [ours(x[:, a:b], cache=cache) for a, b in ((0, 3), (3, 10), (10, 11), (11, 24))]
        assert checks.rel(torch.cat(steps, dim=1), full) <= checks.TOL
        cache = ours.init_cache(2, 12)
        ours(x[:, :5], cache=cache)
        with pytest.raises(ValueError, match="overflow"):
            ours(x[:, 5:20], cache=cache)
        assert cache.length == 5
        assert checks.rel(ours(x[:, 5:12], cache=cache), full[:, 5:12]) <= checks.TOL


def test_chunked_cached_calls_equal_the_full_forward() -> None:
    check_chunked_cache(_wide)
