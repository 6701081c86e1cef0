"""Inkling2-loop through ``from_hf``: Inkling2's layers (see ``test_hf_inkling2``) with a span of
loop layers run several passes, the later passes message-gated from the previous pass through the
message attention residual, each pass with its own caches; equal to transformers' eager (see
``hf_family_checks``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_inkling2 import check_chunked_cache  # noqa: E402

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.inkling2 import Inkling2LoopLM, MessageGate  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

S, F = "hybrid_sliding", "hybrid"


def _config(**kw: Any) -> Any:
    """6 layers sliding / full alternating, blocks of 2, layers 2-3 looped 3 times (gate rank 8),
    clips small enough to act, the unembedding 8 rows short of the embedding."""
    base = dict(vocab_size=136, unpadded_vocab_size=checks.V, hidden_size=64, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
                swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=8, d_rel=4, rel_extent=12,
                log_scaling_n_floor=1000, layer_types=[S, F, S, F, S, F], moe_intermediate_size=32,
                n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=2, pad_token_id=0,
                eos_token_id=2, max_position_embeddings=256, qk_l2_clip_threshold=1.5, rel_l2_clip_threshold=1.0,
                loop_layer_index_start=2, loop_layer_index_end=4, loop_num_passes=3, loop_gate_rank=8)
    return T.Inkling2LoopTextConfig(**{**base, **kw})


def _wide() -> Any:
    """Blocks of 1, layers 1-4 looped twice (a full layer first in the loop), head widths apart from
    hidden / heads and between the kinds, 3 taps, a window of 5, no vocabulary padding."""
    return _config(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=12,
                   swa_num_attention_heads=4, swa_num_key_value_heads=1, swa_head_dim=8, sliding_window_size=5,
                   rel_extent=40, layer_types=[S, F, S, S, F, S], n_layers_per_attn_res_block=1, conv_kernel_size=3,
                   vocab_size=checks.V, loop_layer_index_start=1, loop_layer_index_end=5, loop_num_passes=2,
                   loop_gate_rank=4, rms_norm_eps=1e-5)


def _one_pass() -> Any:
    """One pass: the message gates are never used."""
    return _config(loop_num_passes=1, loop_layer_index_start=4, loop_layer_index_end=6)


class TestInkling2Loop(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_one_pass, _wide)


def test_structure_and_caches() -> None:
    ours = from_hf(checks.hf_model(_config()))
    assert isinstance(ours, Inkling2LoopLM) and ours.loop == (2, 4, 3)
    assert [b.gates is not None for b in ours.blocks] == [False, False, True, True, False, False]
    assert all(isinstance(g, MessageGate) for g in ours.blocks[2].gates)
    assert tuple(ours.message_input.query.shape) == (2, 4, 64)
    assert len(ours.init_cache(2, 16)) == 6 + 2 * 2  # a cache per layer, then per later pass of the loop layers


def test_passes_change_the_output() -> None:
    """The later passes (and their messages) matter: 3 passes differ from the same weights run once."""
    ours = from_hf(checks.hf_model(_config()))
    x = checks.tokens(10)
    with torch.no_grad():
        three = ours(x)
        ours.loop = (2, 4, 1)
        assert checks.rel(ours(x), three) > 1e-3


def test_generation_past_the_window() -> None:
    checks.check_generation(_wide, prompt=9, new=6)


@pytest.mark.parametrize("check", [checks.check_packed_equals_each_alone,
                                   checks.check_packed_gradients_equal_each_alone])
def test_packed_sequences_and_their_gradients_equal_each_alone(check: Any) -> None:
    check(_config)


def test_saved_folder_of_wide_config_loads(tmp_path: Any) -> None:
    """``save_pretrained`` writes the checkpoint's own names (``controllers.*`` message gates, the
    message queries split in ``middle_cycle_cross_pass_queries`` / ``..._kv_queries``)."""
    checks.check_folder(_wide, tmp_path)


def test_loop_config_of_an_original_config_json_is_read(tmp_path: Any) -> None:
    """An original ``config.json`` sets the loop by ``loop_config`` (``core_start``, ``core_end``,
    ``num_passes``, ``gate_rank``) and leaves out keys at their defaults: read as transformers does."""
    hf = checks.hf_model(_config())
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["loop_config"] = {"core_start": 2, "core_end": 4, "num_passes": 3, "gate_rank": 8}
    for key in ("loop_layer_index_start", "loop_layer_index_end", "loop_num_passes", "loop_gate_rank",
                "rms_norm_eps", "conv_kernel_size", "mlp_gate_softcap", "mlp_up_softcap", "final_logit_softcapping",
                "scoring_func", "route_scale", "attention_dropout", "log_scaling_alpha"):
        data.pop(key, None)
    path.write_text(json.dumps(data))
    model = load_pretrained(tmp_path)
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = checks.tokens(10)
    with torch.no_grad():
        assert checks.rel(model(x), again(input_ids=x).logits) <= checks.TOL


@pytest.mark.parametrize(("key", "value", "named"), [
    ("loop_num_passes", 0, "loop_num_passes=0"),
    ("loop_layer_index_start", 3, "loop_layer_index_start=3"),
    ("loop_layer_index_end", 8, "loop_layer_index_end=8"),
    ("scoring_func", "softmax", "scoring_func"),
    ("layer_types", [S, F, "full_attention", F, S, F], "full_attention"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.Inkling2LoopForCausalLM, _config, key, value, named)


def test_chunked_cached_calls_equal_the_full_forward() -> None:
    """Every pass's caches: chunked cached calls equal the full forward; an overflowing call changes nothing."""
    check_chunked_cache(_wide)
