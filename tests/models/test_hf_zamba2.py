"""Zamba2 through ``from_hf``: Mamba-2 layers, and at the hybrid layers a shared transformer block
(one or two of them, round-robin) on ``[h | e]`` with per-use adapters and KV caches; equal to
transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

M, HY = "mamba", "hybrid"


def _config(**kw: Any) -> Any:
    """One mem block for two hybrid layers, no adapters, no rope, GQA, tied."""
    return T.Zamba2Config(**{**checks.SMALL, "num_hidden_layers": 5, "layers_block_type": [M, HY, M, HY, M],
                             "n_mamba_heads": 4, "mamba_d_state": 8, "mamba_ngroups": 2, "chunk_size": 8,
                             "adapter_rank": 8, **kw})


def _two_blocks(**kw: Any) -> Any:
    """Two mem blocks over three hybrid layers (block 0 used twice), q/k/v adapters, rope."""
    return _config(**{"layers_block_type": [M, HY, M, HY, HY], "num_mem_blocks": 2, "num_key_value_heads": 4,
                      "use_shared_attention_adapter": True, "use_mem_rope": True, **kw})


def _untied() -> Any:
    """Untied embeddings: transformers then gives every hybrid layer a block of its own."""
    return _two_blocks(tie_word_embeddings=False, use_mem_rope=False)


def _one_block_adapters() -> Any:
    """One mem block with adapters and rope, SwiGLU, one B/C group, a first hybrid layer."""
    return _config(layers_block_type=[HY, M, HY, HY], num_hidden_layers=4, num_key_value_heads=4,
                   use_shared_attention_adapter=True, use_mem_rope=True, hidden_act="silu", mamba_ngroups=1,
                   rms_norm_eps=1e-6)


class TestZamba2(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_untied, _one_block_adapters, _two_blocks)


def test_shared_block_parameters_are_one_tensor_with_gradients_from_every_use() -> None:
    from attnzoo.models.families.zamba2 import SharedTransformerUse

    ours = from_hf(checks.hf_model(_two_blocks()))
    uses = {i: b.shared for i, b in enumerate(ours.blocks) if b.shared is not None}
    assert list(uses) == [1, 3, 4]
    assert all(isinstance(u, SharedTransformerUse) for u in uses.values())
    assert uses[1].block is uses[4].block and uses[1].block is not uses[3].block
    assert uses[1].attn.qkv_proj.base is uses[4].attn.qkv_proj.base  # through each use's attention too
    assert uses[1].attn.qkv_proj.adapter is not uses[4].attn.qkv_proj.adapter  # adapters are per use
    names = [n for n, _ in ours.named_parameters() if ".shared.block." in n]
    assert {n.split(".")[1] for n in names} == {"1", "3"}  # one tensor each, named at the first use
    # gradients: the shared weight's gradient is the sum over its uses (the per-use copies of the
    # model, each with only one use live, add up to it)
    x = checks.tokens(9)
    w = uses[1].block.gate_up_proj.weight
    (g_all,) = torch.autograd.grad(ours(x).square().sum(), [w])
    parts = []
    for keep in (1, 4):
        twin = copy.deepcopy(ours)
        other = 4 if keep == 1 else 1
        frozen = copy.deepcopy(twin.blocks[other].shared.block)  # a detached copy: no gradient to the shared one
        frozen.requires_grad_(False)
        twin.blocks[other].shared.block = frozen
        twin.blocks[other].shared.attn.qkv_proj.base = frozen.qkv_proj
        twin.blocks[other].shared.attn.out_proj = frozen.out_proj
        twin.blocks[other].shared.gate_up.base = frozen.gate_up_proj
        parts.append(torch.autograd.grad(twin(x).square().sum(), [twin.blocks[keep].shared.block.gate_up_proj.weight])[0])
    assert checks.rel(parts[0] + parts[1], g_all) <= 1e-5


def test_untied_config_gives_every_hybrid_layer_its_own_block() -> None:
    ours = from_hf(checks.hf_model(_untied()))
    blocks = [b.shared.block for b in ours.blocks if b.shared is not None]
    assert len({id(b) for b in blocks}) == 3


@pytest.mark.parametrize(("key", "value", "named"), [
    ("add_bias_linear", True, "add_bias_linear"),
    ("layers_block_type", [M, HY, M, "full_attention", M], "full_attention"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.Zamba2ForCausalLM, _config, key, value, named)


def test_state_dict_round_trip_keeps_sharing() -> None:
    a = from_hf(checks.hf_model(_two_blocks(), seed=0))
    b = from_hf(checks.hf_model(_two_blocks(), seed=1))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    x = checks.tokens(11)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    assert b.blocks[1].shared.block is b.blocks[4].shared.block
    pickled = io.BytesIO()
    torch.save(a, pickled)
    pickled.seek(0)
    c = torch.load(pickled, weights_only=False)
    assert c.blocks[1].shared.block.qkv_proj.weight is c.blocks[4].shared.attn.qkv_proj.base.weight


def test_saved_folder_of_two_blocks_loads(tmp_path: Any) -> None:
    """save_pretrained drops the tied copies (layer 4's block): the first use's keys serve both."""
    checks.check_folder(_two_blocks, tmp_path)


def test_tied_copy_that_differs_is_an_error() -> None:
    from attnzoo.interop import CheckpointFormatError
    from attnzoo.models.families.zamba2 import convert_zamba2
    from attnzoo.models.hf._state import HFConfig

    hf = checks.hf_model(_two_blocks())
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    sd["model.layers.4.shared_transformer.pre_ff_layernorm.weight"] += 1.0
    with pytest.raises(CheckpointFormatError, match=r"layers\.4\.shared_transformer\.pre_ff_layernorm\.weight differs"):
        convert_zamba2(HFConfig(hf.config.to_dict(), "test", "Zamba2"), sd, device=None, dtype=None)


def test_dt_is_floored_at_time_step_min() -> None:
    """transformers clamps dt at time_step_min in its chunked scan: with a large floor it matters."""
    checks.check_logits(lambda: _config(time_step_min=0.05), n=16)


@pytest.mark.parametrize("check", [checks.check_packed_equals_each_alone,
                                   checks.check_packed_gradients_equal_each_alone])
def test_packed_sequences_and_their_gradients_equal_each_alone(check: Any) -> None:
    """Packed sequences (``cu_seqlens``) through the shared blocks: the logits, and the training
    gradients, equal those of each sequence alone."""
    check(_two_blocks)


def test_folder_without_derived_or_default_keys_loads(tmp_path: Any) -> None:
    """transformers derives ``attention_head_dim``, ``mamba_headdim``, ``hybrid_layer_ids``, ... from
    the other keys; a ``config.json`` without them (or without keys at their defaults) loads alike."""
    keys = ("attention_hidden_size", "attention_head_dim", "mamba_headdim", "kv_channels", "num_query_groups",
            "hybrid_layer_ids", "hidden_act", "rms_norm_eps", "time_step_min", "tie_word_embeddings")
    checks.check_folder_without_keys(checks.hf_model(_two_blocks()), tmp_path, keys)
