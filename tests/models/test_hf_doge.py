"""Doge (``families/doge.py``: dynamic mask attention — a per-key score bias from the values and a
kept window of the largest —, per-channel residual weights, the cross-domain MoE) through
``from_hf``: equal to transformers' eager (see ``hf_family_checks``).

transformers' MoE routes each token by the router logits of other tokens of the same call (its
``view(2, B * N, K)``); attnzoo follows it call by call, so for the MoE the full forward, the
padded batch (padding rows included) and ``generate`` equal transformers', while its cached decode
equals transformers' cached decode, not the full forward (:func:`test_cached_decode_follows_transformers`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo import DecoderLM  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.families import doge  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(**kw: Any) -> Any:
    """2 layers, GQA (4 heads over 2), a kept window of 6 keys (so the top-k selection acts on the
    30-token inputs), untied, eps 1e-5."""
    return T.DogeConfig(**{**checks.SMALL, "num_hidden_layers": 2, "keep_window_size": 6, "rms_norm_eps": 1e-5, **kw})


def _other(**kw: Any) -> Any:
    """3 layers, q/k/v/o/dt and MLP biases, one key/value head of 24, a sliding window of 8 with a
    kept window of 5, tied, GELU (tanh), linear-scaled RoPE."""
    return _config(**{"num_hidden_layers": 3, "attention_bias": True, "mlp_bias": True, "num_key_value_heads": 1,
                      "head_dim": 24, "sliding_window": 8, "keep_window_size": 5, "tie_word_embeddings": True,
                      "hidden_act": "gelu_pytorch_tanh",
                      "rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}, **kw})


def _wide() -> Any:
    """The kept window wider than any input (transformers' default 2048): no selection."""
    return _config(keep_window_size=2048, num_key_value_heads=4)


def _moe(**kw: Any) -> Any:
    """The cross-domain MoE: 20 experts (4 keys a side, 4 embeddings unused), top-3, normalised."""
    return _config(**{"is_moe": True, "num_experts": 20, "num_experts_per_tok": 3, "norm_topk_prob": True, **kw})


def _moe_other() -> Any:
    """The MoE with MLP biases, GELU, 9 experts top-5, unnormalised, one key/value head."""
    return _moe(num_experts=9, num_experts_per_tok=5, norm_topk_prob=False, mlp_bias=True, hidden_act="gelu",
                num_key_value_heads=1)


class TestDoge(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_other, _wide)  # the last one decodes: no kept window, whose ties the two paths break apart


class TestDogeMoE(checks.FamilyChecks):
    """The MoE's logits are compared on the padded batch (padding rows too) and on each row alone,
    never one row of a batch against the row alone (transformers' routing mixes the rows)."""

    config = staticmethod(_moe)
    cases = (_moe_other,)

    def test_logits_equal_transformers(self) -> None:
        for make in (self.config, *self.cases):
            hf = checks.hf_model(make())
            ours = from_hf(hf)
            x, mask = checks.padded(self.tokens)
            with torch.no_grad():
                ref, got = hf(input_ids=x, attention_mask=mask).logits, ours(x, attention_mask=mask.bool())
                alone = checks.rel(ours(x[1:]), hf(input_ids=x[1:]).logits)
            assert max(checks.rel(got, ref), alone) <= checks.TOL

    def test_cached_decode_equals_full_forward(self) -> None:
        """Not the full forward, in transformers either: its cached calls (see the module docstring)."""
        test_cached_decode_follows_transformers(_moe)


def _cached(model: Any, x: torch.Tensor, prefill: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits of a prefill then one token a step through the cache, full-forward logits)``, for
    transformers' model (``DynamicCache``) or attnzoo's."""
    n = x.shape[1]
    with torch.no_grad():
        if isinstance(model, DecoderLM):
            cache = model.init_cache(x.shape[0], n)
            steps = [model(x[:, :prefill], cache=cache)] + [model(x[:, t:t + 1], cache=cache) for t in range(prefill, n)]
            return torch.cat(steps, 1), model(x)
        out = model(input_ids=x[:, :prefill], use_cache=True)
        steps = [out.logits]
        for t in range(prefill, n):
            out = model(input_ids=x[:, t:t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
        return torch.cat(steps, 1), model(input_ids=x).logits


@pytest.mark.parametrize("make", [_config, _other], ids=["config", "other"])
def test_cached_decode_follows_transformers(make: Any) -> None:
    """Prefill 7 tokens then decode one a step (batch 2): equal to transformers' own cached calls.
    Those may differ from its full forward: the MoE's routing mixes other tokens, and the kept window
    breaks exact ties of the bias (a token repeated: its layer-0 value, so its bias, is the same)
    by ``torch.topk``'s order over other rows (20 keys vs the 8 a sliding cache holds)."""
    hf = checks.hf_model(make())
    ours = from_hf(hf)
    x = checks.tokens(20)
    (got, full), (ref, ref_full) = _cached(ours, x), _cached(hf, x)
    assert checks.rel(got, ref) <= checks.TOL and checks.rel(full, ref_full) <= checks.TOL
    if make is _moe:
        assert checks.rel(ref, ref_full) > 1e-3


def test_structure() -> None:
    """Parameters as transformers' (A, dt_proj, the residual weights, the MoE's embeddings), the kept
    and sliding windows, the per-head QK norms."""
    for make in (_other, _moe_other):
        hf = checks.hf_model(make())
        ours = from_hf(hf)
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    ours = from_hf(checks.hf_model(_other()))
    attn = ours.blocks[0].attn
    assert isinstance(attn, doge.DynamicMaskAttention) and isinstance(ours.blocks[0], doge.ScaledResidualBlock)
    assert attn.keep_window_size == 5 and attn.window == (7, 7) and attn.dt_proj.bias is not None
    assert attn.frontier.q_norm_weight.shape == (24,) and ours.tie_embeddings
    moe = from_hf(checks.hf_model(_moe())).blocks[1].ffn
    assert isinstance(moe, doge.CDMoE) and (moe.num_keys, moe.top_k, moe.norm_topk_prob) == (4, 3, True)


def test_kept_window_and_bias_matter() -> None:
    """The selection of the largest biases and the bias itself change the logits."""
    hf = checks.hf_model(_config())
    ours = from_hf(hf)
    x = checks.tokens(20)
    with torch.no_grad():
        ref = ours(x)
        for block in ours.blocks:
            block.attn.keep_window_size = 2048
        assert checks.rel(ours(x), ref) > 1e-3
        for block in ours.blocks:
            block.attn.A.zero_()  # every bias exp(0) = 1: no effect on the softmax
        plain = ours(x)
        for block in ours.blocks:
            block.attn.dt_proj.weight.mul_(3.0)
        torch.testing.assert_close(ours(x), plain)


@pytest.mark.parametrize(("make", "keys"), [
    (lambda: _config(num_key_value_heads=4, keep_window_size=2048, rms_norm_eps=1e-6, max_position_embeddings=2048,
                     rope_parameters=None),
     ("num_key_value_heads", "keep_window_size", "rms_norm_eps", "max_position_embeddings", "rope_parameters",
      "hidden_act", "hidden_dropout", "attention_bias", "attention_dropout", "mlp_bias", "is_moe",
      "tie_word_embeddings")),
    (lambda: _moe(num_experts=16384, num_experts_per_tok=64, norm_topk_prob=False, hidden_size=32,
                  intermediate_size=48, num_attention_heads=2, num_key_value_heads=2),
     ("num_experts", "num_experts_per_tok", "norm_topk_prob")),
], ids=["dense", "moe"])
def test_config_json_without_defaults_loads(make: Any, keys: tuple[str, ...], tmp_path: Path) -> None:
    checks.check_folder_without_keys(checks.hf_model(make()), tmp_path, keys)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hidden_act", "relu", "hidden_act"), ("pretraining_tp", 2, "pretraining_tp"),
    ("rope_parameters", {"rope_type": "unknown_rope", "rope_theta": 1e4}, "rope_type"),
], ids=["activation", "pretraining_tp", "rope_type"])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.DogeForCausalLM, _config, key, value, named)


@pytest.mark.parametrize("make", [_config, _other, _moe], ids=["config", "other", "moe"])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    """Packed: the attention and the MoE one sequence at a time; forward and float64 gradients."""
    checks.check_packed_equals_each_alone(make)
    checks.check_packed_gradients_equal_each_alone(make)


@pytest.mark.parametrize("make", [_wide, _config], ids=["wide", "kept_window"])
def test_register_equals_eager(make: Callable[[], Any]) -> None:
    """transformers' own Doge served by ``attnzoo.hf.register()`` (its attention calls ``torch.where``
    on the mask: attnzoo's lazy mask answers with its dense form)."""
    checks.check_register_equals_eager(checks.hf_model(make()))
