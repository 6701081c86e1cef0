"""ModernBERT (``modernbert``) through ``from_hf`` / ``load_pretrained``: hidden states, the masked-LM
and classification heads, pooled embeddings, folders and bf16 against transformers' eager model
(``tests/hf_encoder_checks.py``), on alternating global / local layers with their own RoPE bases;
cases for every option that changes the math, the refusals, the ``to_hf`` round trip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
import transformers as T

import hf_encoder_checks as ec
from attnzoo.interop import from_hf, load_pretrained, to_hf
from attnzoo.models.families.modernbert import PredictionHead, convert_modernbert
from attnzoo.models.hf._state import HFConfig
from attnzoo.models.hf.errors import UnsupportedConfigError
from hf_family_checks import V, rel

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(**kw: Any) -> Any:
    """2 layers (global, local), local_attention 8 (4 keys each side of the query: a left-padded row's
    first slot still sees a real key, so ``"cls"`` pooling is defined), RoPE bases 1000 / 50."""
    base: dict[str, Any] = dict(
        vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        pad_token_id=ec.PAD, bos_token_id=0, eos_token_id=2, cls_token_id=0, sep_token_id=2, local_attention=8,
        global_rope_theta=1000.0, local_rope_theta=50.0, max_position_embeddings=64)
    base.update(kw)
    return T.ModernBertConfig(**base)


def _biased() -> Any:
    return _cfg(norm_bias=True, attention_bias=True, mlp_bias=True, classifier_bias=True)


def _layers() -> Any:
    """3 layers given by ``layer_types`` (local, global, local), a window of 2 each side (a left-padded
    row's first queries see only padded keys), tanh GeLU, untied decoder without bias."""
    return _cfg(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                local_attention=4, hidden_activation="gelu_pytorch_tanh", norm_eps=1e-3)


def _every_two() -> Any:
    return _cfg(num_hidden_layers=4, global_attn_every_n_layers=2, local_attention=5, hidden_activation="silu")


def _rope_parameters() -> Any:
    return _cfg(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 321.0},
                                 "sliding_attention": {"rope_type": "linear", "rope_theta": 20.0, "factor": 2.0}})


class TestModernBert(ec.EncoderChecks):
    config = staticmethod(_cfg)
    base = T.ModernBertModel
    mlm = T.ModernBertForMaskedLM
    classifier = T.ModernBertForSequenceClassification
    cases = (_biased, _layers, _every_two, _rope_parameters)
    drop = ("norm_bias", "attention_bias", "mlp_bias", "hidden_activation", "norm_eps", "layer_types",
            "classifier_pooling", "decoder_bias", "tie_word_embeddings", "local_attention")


SWEEP = {"modernbert": lambda seed: ec.hf_encoder(_cfg(), T.ModernBertModel, seed)}


@pytest.mark.parametrize("make", [_biased, _layers], ids=["biased", "layers"])
def test_masked_lm_head_options(make: Any) -> None:
    cfg = make()
    if make is _layers:
        cfg.tie_word_embeddings, cfg.decoder_bias, cfg.classifier_activation = False, False, "relu"
    hf = ec.hf_encoder(cfg, T.ModernBertForMaskedLM)
    assert ec.check_mlm(hf) <= ec.TOL
    ours = from_hf(hf)
    assert (ours.mlm.decoder.weight is ours.embedding.weight) == (make is not _layers)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_classifier_pooling(pooling: str) -> None:
    hf = ec.hf_encoder(_cfg(classifier_pooling=pooling, num_labels=4, classifier_activation="gelu_new",
                            classifier_bias=True), T.ModernBertForSequenceClassification)
    assert ec.check_classify(hf) <= ec.TOL
    ours, x = from_hf(hf), ec.batch()[0]
    with torch.no_grad():  # no mask: every token counts
        assert rel(ours.classify(ours(x), None), hf(input_ids=x).logits) <= ec.TOL


def test_local_window_is_half_of_local_attention_each_side() -> None:
    """Two local layers of ``local_attention=6``: a window of 3 keys each side (``window == (3, 3)``), so a
    change at token 15 reaches tokens 9.. (two layers, 2 * 3 away) and no earlier one."""
    hf = ec.hf_encoder(_cfg(num_hidden_layers=2, layer_types=["sliding_attention"] * 2, local_attention=6),
                       T.ModernBertModel)
    ours = from_hf(hf)
    assert ours.blocks[0].attn.window == (3, 3)
    x = ec.batch(16, pad=0)[0][:1]
    y = x.clone()
    y[0, 15] = (y[0, 15] + 1) % V
    with torch.no_grad():
        a, b = ours(x), ours(y)
    assert torch.equal(a[0, :9], b[0, :9]) and not torch.equal(a[0, 9], b[0, 9])  # two layers: 2 * 3 away
    with torch.no_grad():
        assert rel(b, hf(input_ids=y).last_hidden_state) <= ec.TOL


def test_prediction_head_takes_a_plain_activation() -> None:
    with pytest.raises(ValueError, match="activation"):
        PredictionHead(8, "geglu", torch.nn.LayerNorm(8))


@pytest.mark.parametrize(("kw", "what"), [
    ({"hidden_activation": "relu"}, "hidden_activation='relu'"),
    ({"classifier_activation": "tanh"}, "classifier_activation='tanh'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "rope_type='dynamic'"),
])
def test_refusals(kw: dict[str, Any], what: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=what):
        from_hf(ec.hf_encoder(_cfg(**kw), T.ModernBertModel))


@pytest.mark.parametrize(("extra", "what"), [
    ({"head_dim": 16}, "head_dim=16"),
    ({"sliding_window": 3}, "sliding_window=3"),
    ({"architectures": ["ModernBertForTokenClassification"]}, "ModernBertForTokenClassification"),
])
def test_refusals_of_config_keys(extra: dict[str, Any], what: str) -> None:
    hf = ec.hf_encoder(_cfg(), T.ModernBertModel)
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    with pytest.raises(UnsupportedConfigError, match=what):
        convert_modernbert(HFConfig({**hf.config.to_dict(), **extra}, "config"), sd, device=None, dtype=None)


def test_sparse_prediction_and_reference_compile_change_nothing_in_eval() -> None:
    hf = ec.hf_encoder(_cfg(sparse_prediction=True, reference_compile=True, deterministic_flash_attn=True),
                       T.ModernBertForMaskedLM)
    assert ec.check_mlm(hf) <= ec.TOL


@pytest.mark.parametrize("head", [T.ModernBertModel, T.ModernBertForMaskedLM, T.ModernBertForSequenceClassification])
def test_to_hf_round_trip(head: Any) -> None:
    cfg_a, cfg_b = _biased(), _biased()
    a, b = ec.hf_encoder(cfg_a, head, seed=0), ec.hf_encoder(cfg_b, head, seed=1)
    ours = from_hf(b)
    assert to_hf(ours, a) is a
    again = from_hf(a).state_dict()
    for name, want in ours.state_dict().items():
        assert torch.equal(again[name], want), name


def test_a_folder_in_the_hub_format_loads(tmp_path: Path) -> None:
    """The published ModernBERT ``config.json`` format (before transformers 5): no ``layer_types`` nor
    ``rope_parameters`` but ``global_attn_every_n_layers``, ``global_rope_theta`` / ``local_rope_theta``,
    and keys with no effect in eval (``reference_compile``, ``sparse_prediction``, ...)."""
    hf = ec.hf_encoder(_cfg(num_hidden_layers=3), T.ModernBertForMaskedLM)
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    for key in ("layer_types", "rope_parameters"):
        data.pop(key)
    data.update(global_attn_every_n_layers=2, global_rope_theta=500.0, local_rope_theta=30.0, reference_compile=True,
                sparse_prediction=True, repad_logits_with_grad=False, position_embedding_type="absolute",
                layer_norm_eps=1e-5, gradient_checkpointing=False)
    path.write_text(json.dumps(data))
    hf = T.ModernBertForMaskedLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.config.layer_types == ["full_attention", "sliding_attention", "full_attention"]
    ours, (x, mask) = load_pretrained(tmp_path), ec.batch()
    with torch.no_grad():
        want = hf(input_ids=x, attention_mask=mask).logits
        assert ec.real_rel(ours.mlm_logits(ours(x, attention_mask=mask)), want, mask) <= ec.TOL
