"""DiffLlama (``families/diffllama.py``: LLaMA with the DIFF Transformer's attention, attnzoo's
``DifferentialAttention`` with transformers' head pairing and weightless group norm) through
``from_hf``: equal to transformers' eager (see ``hf_family_checks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.families import diffllama  # noqa: E402
from attnzoo.nn.differential import lambda_init  # noqa: E402

T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(**kw: Any) -> Any:
    """3 layers (three lambda_init values), 4 query heads over 2 key/value heads (1 differential
    KV group of 2 heads), untied, the group norm's epsilon large enough (0.05) to matter."""
    return T.DiffLlamaConfig(**{**checks.SMALL, "num_hidden_layers": 3, "rms_norm_eps": 0.05, **kw})


def _other(**kw: Any) -> Any:
    """q/k/v/o biases, 8 query heads of 24 over 4 key/value heads (GQA inside the pairs), tied,
    linear-scaled RoPE (factor 2, theta 1000), eps 1e-6."""
    return _config(**{"attention_bias": True, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 24,
                      "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
                      "rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}, **kw})


def _mha() -> Any:
    """Every query head its own key/value head (4 of 4), GELU (tanh) MLP, 2 layers."""
    return _config(num_key_value_heads=4, hidden_act="gelu_pytorch_tanh", num_hidden_layers=2)


class TestDiffLlama(checks.FamilyChecks):
    config = staticmethod(_config)
    cases = (_mha, _other)


def test_structure() -> None:
    """Half the query and key/value heads as differential heads, a lambda_init per depth, no group
    norm weight (the parameter count is transformers'), the config's epsilon."""
    hf = checks.hf_model(_other())
    ours = from_hf(hf)
    attn = ours.blocks[1].attn
    assert isinstance(attn, diffllama.DiffLlamaAttention) and attn.subln_weight is None
    assert (attn.diff_heads, attn.diff_kv_heads, attn.head_dim, attn.norm_eps) == (4, 2, 24, 1e-6)
    assert [b.attn.lambda_init for b in ours.blocks] == [lambda_init(i) for i in range(3)]
    assert [b.attn.lambda_init for b in ours.blocks] == [b.self_attn.lambda_init for b in hf.model.layers]
    assert attn.q_proj.bias is not None and attn.out_proj.bias is not None and ours.tie_embeddings
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())


def test_lambda_equals_transformers() -> None:
    hf = checks.hf_model(_config())
    ours = from_hf(hf)
    for block, layer in zip(ours.blocks, hf.model.layers, strict=True):
        a = layer.self_attn
        ref = (torch.exp((a.lambda_q1 * a.lambda_k1).sum()) - torch.exp((a.lambda_q2 * a.lambda_k2).sum())
               + a.lambda_init)
        torch.testing.assert_close(block.attn.lambda_(), ref)


def test_pair_rows_is_the_head_pairing() -> None:
    """Rows of heads ``[a0 a1 | b0 b1]`` become ``[a0 b0 a1 b1]``."""
    t = torch.arange(4 * 3).float().view(12, 1)
    heads = diffllama.pair_rows(t, 3).view(4, 3)[:, 0].tolist()
    assert heads == [0.0, 6.0, 3.0, 9.0]


def test_group_norm_epsilon_matters() -> None:
    """Built with attnzoo's default 1e-5 instead of the config's 0.05, the logits move."""
    hf = checks.hf_model(_config())
    ours = from_hf(hf)
    x = checks.tokens(12)
    with torch.no_grad():
        ref = hf(input_ids=x).logits
        assert checks.rel(ours(x), ref) <= checks.TOL
        for block in ours.blocks:
            block.attn.norm_eps = 1e-5
        assert checks.rel(ours(x), ref) > 1e-2


#: the keys a ``config.json`` may leave out at ``DiffLlamaConfig``'s defaults
DEFAULT_KEYS = ("num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "attention_bias", "attention_dropout",
                "rope_parameters", "max_position_embeddings", "tie_word_embeddings")


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A ``config.json`` leaving out the keys at their defaults: read as ``from_pretrained`` reads it."""
    hf = checks.hf_model(_config(num_key_value_heads=4, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=2048,
                                 rope_parameters=None))
    checks.check_folder_without_keys(hf, tmp_path, DEFAULT_KEYS)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("attention_dropout", 0.1, "attention_dropout"), ("num_key_value_heads", 1, "num_key_value_heads"),
    ("hidden_act", "relu", "hidden_act"), ("pretraining_tp", 2, "pretraining_tp"),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ("rope_parameters", {"rope_type": "unknown_rope", "rope_theta": 1e4}, "rope_type"),
], ids=["dropout", "odd_kv_heads", "activation", "pretraining_tp", "partial_rotary", "rope_type"])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.DiffLlamaForCausalLM, _config, key, value, named)


@pytest.mark.parametrize("make", [_config, _other], ids=["config", "other"])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    checks.check_packed_equals_each_alone(make)
    checks.check_packed_gradients_equal_each_alone(make)


def test_register_attention_equals_eager() -> None:
    """transformers' DiffLlama with ``attn_implementation="attnzoo"`` (its two attention calls per
    layer) gives its eager logits on a left-padded batch."""
    checks.check_register_equals_eager(checks.hf_model(_other()))
