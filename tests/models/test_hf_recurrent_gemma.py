"""RecurrentGemma (``RecurrentGemmaForCausalLM``) through ``from_hf``: Griffin's RG-LRU recurrent
blocks (a causal conv1d, block-diagonal gates, the gated diagonal recurrence with its reset and
bounded-gradient square root) mixed with local MQA/GQA attention (partial RoPE, a window),
GeGLU MLPs with biases, ``1 + w`` RMSNorms, the bfloat16 embedding normalizer and the logit
soft-cap; equal to transformers' eager (see ``hf_family_checks``).

transformers' recurrent blocks do not mask padded tokens (its left-padded row depends on the
padding: see the family's docstring), so the padded-batch checks compare each row with
transformers on the row alone; an unpadded batch is compared as is."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")

#: the left padding of row 0 in the padded-batch checks
PAD = 5


def _config(**kw: Any) -> Any:
    """4 layers recurrent, recurrent, attention, recurrent (the default ``block_types`` cycled),
    ``lru_width`` 48 (!= hidden 64) in 4 gate blocks, conv width 4, GQA 4/2 heads, a window of 6
    (< the 30 tokens tested), the default half-rotated head, tied embeddings."""
    return T.RecurrentGemmaConfig(**{**checks.SMALL, "num_hidden_layers": 4, "lru_width": 48,
                                     "attention_window_size": 6, "intermediate_size": 96, **kw})


def _other(**kw: Any) -> Any:
    """hidden 80 (its sqrt rounds in bfloat16: 8.9375), ``block_types`` attention, recurrent; MQA
    with q/k/v biases, head_dim 24 (!= 80 / 4), a quarter rotated (6 channels), theta 500, conv
    width 2, exact GELU, untied, soft-cap 5, eps 1e-3, an odd ``intermediate_size`` (// 2 = 45)."""
    return T.RecurrentGemmaConfig(**{**checks.SMALL, "hidden_size": 80, "num_hidden_layers": 3,
                                     "block_types": ["attention", "recurrent"], "num_key_value_heads": 1,
                                     "attention_bias": True, "head_dim": 24, "lru_width": 32, "conv1d_width": 2,
                                     "rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                                         "partial_rotary_factor": 0.25},
                                     "hidden_activation": "gelu", "tie_word_embeddings": False,
                                     "logits_soft_cap": 5.0, "rms_norm_eps": 1e-3, "intermediate_size": 91,
                                     "attention_window_size": 9, **kw})


def _full_rope(**kw: Any) -> Any:
    """The whole head rotated, SiLU, conv width 1 (no past inputs), 8 gate blocks, a window larger
    than the input, recurrent layers only first then attention."""
    return T.RecurrentGemmaConfig(**{**checks.SMALL, "num_hidden_layers": 3, "num_attention_heads": 8,
                                     "num_key_value_heads": 4, "lru_width": 64, "conv1d_width": 1,
                                     "block_types": ["recurrent", "recurrent", "attention"],
                                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 1.0},
                                     "hidden_activation": "silu", "attention_window_size": 64, **kw})


def _hawk(**kw: Any) -> Any:
    """Recurrent layers only (Griffin's Hawk). transformers' forward with its cache on raises for a
    stack without attention layers (its mask asks the cache for an attention layer): ``use_cache``
    off."""
    return T.RecurrentGemmaConfig(**{**checks.SMALL, "num_hidden_layers": 2, "block_types": ["recurrent"],
                                     "conv1d_width": 3, "use_cache": False, **kw})


CONFIGS = (_config, _other, _full_rope, _hawk)


def _check_logits(make: Callable[[], Any], auto: Any = None, n: int = 30) -> float:
    """The unpadded batch against transformers as is; the left-padded batch's rows against
    transformers on each row alone (row 0 without its padding). Returns the max relative error."""
    from attnzoo.interop import from_hf

    hf = checks.hf_model(make(), auto)
    ours = from_hf(hf)
    x, mask = checks.padded(n, pad=PAD)

    def ref(tokens: torch.Tensor) -> torch.Tensor:
        out = hf(input_ids=tokens)
        return out.last_hidden_state if auto is not None else out.logits

    with torch.no_grad():
        full, want = ours(x), ref(x)
        padded = ours(x, attention_mask=mask.bool())
        alone = ref(x[:1, PAD:])
    err = max(checks.rel(full, want), checks.rel(padded[0, PAD:], alone[0]), checks.rel(padded[1], want[1]))
    assert err <= checks.TOL, f"relative error {err:.2e}"
    return err


class TestRecurrentGemma(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_full_rope, _other)

    def test_logits_equal_transformers(self) -> None:
        for make in CONFIGS:
            _check_logits(make)

    def test_base_model_equals_transformers(self) -> None:
        from attnzoo.interop import from_hf

        assert isinstance(from_hf(checks.hf_model(_config(), T.AutoModel)).lm_head, torch.nn.Identity)
        for make in CONFIGS:
            _check_logits(make, T.AutoModel, n=16)

    def test_greedy_generation_identical(self) -> None:
        """Batch 1 as transformers generates it; a left-padded batch 2: each row as transformers
        generates it alone."""
        from attnzoo.interop import from_hf

        hf = checks.hf_model(_config())
        ours = from_hf(hf)

        def hf_generate(x: torch.Tensor) -> torch.Tensor:
            return hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False,
                               eos_token_id=None, pad_token_id=0)

        x = checks.tokens(7, batch=1)
        assert torch.equal(ours.generate(x, 8), hf_generate(x))
        x, mask = checks.padded(10, pad=3)
        got = ours.generate(x, 8, attention_mask=mask.bool())
        assert torch.equal(got[:1, 3:], hf_generate(x[:1, 3:]))
        assert torch.equal(got[1:], hf_generate(x[1:]))

    def test_cached_decode_equals_full_forward(self) -> None:
        for make in CONFIGS:
            checks.check_cached_decode(make)


def test_chunked_kernel_equals_transformers() -> None:
    """Chunks of 7 (the 30 tokens of the other checks fit one 64-token chunk) and 150 tokens in
    chunks of 64."""
    from attnzoo.interop import from_hf

    hf = checks.hf_model(_config())
    ours = from_hf(hf)
    x = checks.tokens(150, seed=4)
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL
        for i in (0, 1, 3):
            ours.blocks[i].attn.chunk_size = 7
        assert checks.rel(ours(x[:, :30]), hf(input_ids=x[:, :30]).logits) <= checks.TOL


def test_chunks_after_a_prefill_continue_the_state() -> None:
    """Prefill, a chunk of 5 tokens, then one at a time (past the window): the full forward
    (transformers' cache restarts the convolution on such a chunk; attnzoo's continues it)."""
    from attnzoo.interop import from_hf

    ours = from_hf(checks.hf_model(_config()))
    x = checks.tokens(20)
    with torch.no_grad():
        full = ours(x)
        cache = ours.init_cache(2, 20)
        steps = [ours(x[:, :7], cache=cache), ours(x[:, 7:12], cache=cache)]
        steps += [ours(x[:, t:t + 1], cache=cache) for t in range(12, 20)]
    assert checks.rel(torch.cat(steps, dim=1), full) <= checks.TOL


def test_padded_decode_equals_each_row_alone() -> None:
    """A left-padded prefill then cached steps: the padded row's logits are the row's alone (the
    reset sits on its first real token, the padding feeds the convolution zeros)."""
    from attnzoo.interop import from_hf

    ours = from_hf(checks.hf_model(_config()))
    x, mask = checks.padded(16, pad=PAD)
    with torch.no_grad():
        cache = ours.init_cache(2, 16)
        steps = [ours(x[:, :9], cache=cache, attention_mask=mask[:, :9].bool())]
        steps += [ours(x[:, t:t + 1], cache=cache, attention_mask=mask[:, :t + 1].bool()) for t in range(9, 16)]
        alone = ours(x[:1, PAD:])
    assert checks.rel(torch.cat(steps, dim=1)[0, PAD:], alone[0]) <= 1e-5


def test_padded_tokens_inside_a_row_are_skipped() -> None:
    """The block alone (pointwise convolution): padded tokens between real ones neither write nor
    decay the state, and the reset stays on the first real token."""
    from attnzoo.models.families.recurrent_gemma import GriffinRecurrentBlock

    torch.manual_seed(0)
    block = checks.perturbed(GriffinRecurrentBlock(16, 8, 2, conv_size=1), scale=0.5)
    x = torch.randn(1, 9, 16)
    keep = torch.tensor([[False, True, True, False, False, True, True, False, True]])
    with torch.no_grad():
        got, alone = block(x, mask=keep)[keep], block(x[keep][None])[0]
    assert checks.rel(got, alone) <= 1e-6


def test_structure() -> None:
    from attnzoo.interop import from_hf
    from attnzoo.models.families.recurrent_gemma import GriffinRecurrentBlock
    from attnzoo.models.parts import ScaledEmbedding
    from attnzoo.nn.attention import MultiHeadAttention

    hf = checks.hf_model(_other())
    ours = from_hf(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert [type(b.attn) for b in ours.blocks] == [MultiHeadAttention, GriffinRecurrentBlock, MultiHeadAttention]
    attn = ours.blocks[0].attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.window[0]) == (4, 1, 24, 8)
    assert attn.qkv_proj.bias is not None and attn.out_proj.bias is not None
    assert attn.rope.rotary_dim == 6 and attn.rope.base == 500.0
    rec = ours.blocks[1].attn
    assert rec.linear_x.weight.shape == (32, 80) and rec.out_proj.weight.shape == (80, 32)
    assert rec.conv1d.weight.shape == (32, 1, 2) and rec.rg_lru.input_gate_weight.shape == (4, 8, 8)
    assert ours.blocks[0].ffn.up_proj.weight.shape == (45, 80) and ours.blocks[0].ffn.up_proj.bias is not None
    assert isinstance(ours.tok_emb, ScaledEmbedding) and ours.tok_emb.scale == 8.9375  # bfloat16(sqrt(80))
    assert not ours.tie_embeddings and ours.lm_head.softcap == 5.0
    cache = ours.init_cache(2, 16)
    assert cache[1].state.shape == (2, 33, 1, 1) and cache[1].conv["conv1d"].shape == (2, 32, 1)
    plain = from_hf(checks.hf_model(_config()))
    assert plain.tie_embeddings and plain.blocks[2].attn.qkv_proj.bias is None
    assert plain.blocks[2].attn.out_proj.bias is not None and plain.blocks[2].attn.rope.rotary_dim == 8


def test_training_gradients_equal_transformers() -> None:
    """float64 gradients of weighted logits through both models, 8 channels' decay so close to 1
    that ``1 - a^2 < 2.5e-7``: there transformers' clipped square-root derivative (1000, not the
    true 47 times more) is reproduced. (transformers accumulates the scan in float32 even in a
    float64 model and computes RoPE in float32: hence 1e-5, not 1e-12.)"""
    from attnzoo.interop import from_hf

    hf = checks.hf_model(_config()).double().train()
    with torch.no_grad():
        hf.model.layers[0].temporal_block.rg_lru.recurrent_param[:8] = -25.0
    ours = from_hf(hf).train()
    for i in (0, 1, 3):  # the chunked kernel's backward across chunks (12 tokens in chunks of 5)
        ours.blocks[i].attn.chunk_size = 5
    x = checks.tokens(12)
    weights = torch.randn(2, 12, checks.V, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    (hf(input_ids=x, use_cache=False).logits * weights).sum().backward()
    (ours(x) * weights).sum().backward()
    theirs, mine = hf.model.layers[0].temporal_block, ours.blocks[0].attn
    lam, want = mine.rg_lru.recurrent_param.grad, theirs.rg_lru.recurrent_param.grad
    assert checks.rel(lam[:8], want[:8]) <= 1e-5 and checks.rel(lam[8:], want[8:]) <= 1e-5
    for name in ("input_gate_weight", "recurrent_gate_bias"):
        assert checks.rel(getattr(mine.rg_lru, name).grad, getattr(theirs.rg_lru, name).grad) <= 1e-5, name
    assert checks.rel(mine.linear_x.weight.grad, theirs.linear_x.weight.grad) <= 1e-5
    assert checks.rel(ours.tok_emb.weight.grad, hf.model.embed_tokens.weight.grad) <= 1e-5


def test_bounded_sqrt_is_transformers() -> None:
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import SqrtBoundDerivative

    from attnzoo.models.families.recurrent_gemma import BoundedSqrt

    u = torch.tensor([0.0, 1e-9, 2e-7, 3e-7, 1e-3, 0.5, 1.0], dtype=torch.float64)
    grads = []
    for fn in (BoundedSqrt.apply, SqrtBoundDerivative.apply):
        v = u.clone().requires_grad_()
        out = fn(v)
        out.sum().backward()
        grads.append((out.detach(), v.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert grads[0][1][0] == 1000.0


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A ``config.json`` that leaves out ``RecurrentGemmaConfig``'s defaults (``block_types``, conv
    width 4, soft-cap 30, eps 1e-6, tanh GELU, window 2048, ``lru_width`` = hidden, key/value heads
    = heads, ``head_dim`` = hidden / heads, theta 1e4 with half the head rotated, tied)."""
    hf = checks.hf_model(T.RecurrentGemmaConfig(**{**checks.SMALL, "num_key_value_heads": None,
                                                   "num_hidden_layers": 3}))
    checks.check_folder_without_keys(hf, tmp_path, (
        "block_types", "conv1d_width", "logits_soft_cap", "rms_norm_eps", "hidden_activation",
        "attention_window_size", "lru_width", "num_key_value_heads", "head_dim", "rope_parameters",
        "attention_bias", "attention_dropout", "tie_word_embeddings", "max_position_embeddings"))


def test_legacy_config_json_loads(tmp_path: Path) -> None:
    """The released ``config.json`` layout: ``rope_theta`` and ``partial_rotary_factor`` at the top
    level, the window as ``sliding_window``."""
    from attnzoo.interop import load_pretrained

    hf = checks.hf_model(_config(rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                  "partial_rotary_factor": 0.25}))
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    rope = data.pop("rope_parameters")
    data.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                sliding_window=data.pop("attention_window_size"))
    path.write_text(json.dumps(data))
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.rope_parameters["partial_rotary_factor"] == 0.25 and again.config.attention_window_size == 6
    model = load_pretrained(tmp_path)
    assert model.blocks[2].attn.rope.rotary_dim == 4 and model.blocks[2].attn.window[0] == 5
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(model(x), again(input_ids=x).logits) <= checks.TOL


@pytest.mark.parametrize(("key", "value", "named"), [
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, "rope_type"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1875},
     "partial_rotary_factor"),
    ("hidden_activation", "relu", "hidden_activation"),
    ("block_types", ["recurrent", "mlp"], "block_types"),
    ("block_types", [], "block_types"),
    ("lru_width", 50, "lru_width"),
    ("logits_soft_cap", 0.0, "logits_soft_cap"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.RecurrentGemmaForCausalLM, _config, key, value, named)


def test_packed_sequences_equal_each_alone() -> None:
    checks.check_packed_equals_each_alone(_config)
    checks.check_packed_equals_each_alone(_other)


def test_packed_training_gradients_equal_each_alone() -> None:
    checks.check_packed_gradients_equal_each_alone(_config)
