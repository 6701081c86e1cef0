"""The RoPE encoders of ``families/rope_bert.py`` (GTE, NomicBERT, EuroBERT, Jina Embeddings v3)
against transformers' eager models: hidden states on padded batches, the MLM and classifier heads,
pooled embeddings, folders, bf16, ``to_hf``, and the refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

T = pytest.importorskip("transformers")

import hf_encoder_checks as ec  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.rope_bert import Heads, build_rope_bert, convert_rope_bert  # noqa: E402
from attnzoo.models.hf._state import HFConfig  # noqa: E402
from attnzoo.models.hf.errors import UnsupportedConfigError  # noqa: E402
from hf_family_checks import V  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"vocab_size": V, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48,
         "max_position_embeddings": 64, "pad_token_id": ec.PAD}


def _gte(**kw: Any) -> Any:
    return T.GteConfig(**{**SMALL, "type_vocab_size": 2, **kw})


def _nomic(**kw: Any) -> Any:
    return T.NomicBertConfig(**{**SMALL, **kw})


def _eurobert(**kw: Any) -> Any:
    ids = {"bos_token_id": 0, "eos_token_id": 2, "mask_token_id": 3}
    return T.EuroBertConfig(**{**SMALL, **ids, "num_key_value_heads": 2, **kw})


def _jina(**kw: Any) -> Any:
    return T.JinaEmbeddingsV3Config(**{**SMALL, "bos_token_id": 0, "eos_token_id": 2, **kw})


class TestGte(ec.EncoderChecks):
    config = staticmethod(_gte)
    base, mlm, classifier = T.GteModel, T.GteForMaskedLM, T.GteForSequenceClassification
    cases = (lambda: _gte(type_vocab_size=0), lambda: _gte(hidden_act="gelu_pytorch_tanh"),
             lambda: _gte(rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}))
    drop = ("rope_parameters", "layer_norm_eps", "hidden_act", "tie_word_embeddings")


class TestNomicBert(ec.EncoderChecks):
    config = staticmethod(_nomic)
    base, mlm, classifier = T.NomicBertModel, T.NomicBertForMaskedLM, T.NomicBertForSequenceClassification
    cases = (lambda: _nomic(head_dim=16), lambda: _nomic(hidden_act="gelu"))
    drop = ("rope_parameters", "layer_norm_eps", "hidden_act", "type_vocab_size")


class TestEuroBert(ec.EncoderChecks):
    config = staticmethod(_eurobert)
    base, mlm, classifier = T.EuroBertModel, T.EuroBertForMaskedLM, T.EuroBertForSequenceClassification
    cases = (lambda: _eurobert(attention_bias=True, mlp_bias=True, num_key_value_heads=4),
             lambda: _eurobert(head_dim=16, hidden_act="gelu"))
    drop = ("rope_parameters", "rms_norm_eps", "hidden_act", "attention_bias", "mlp_bias")


class TestJinaEmbeddingsV3(ec.EncoderChecks):
    config = staticmethod(_jina)
    base, mlm, classifier = T.JinaEmbeddingsV3Model, T.JinaEmbeddingsV3ForMaskedLM, \
        T.JinaEmbeddingsV3ForSequenceClassification
    cases = (lambda: _jina(hidden_act="relu", type_vocab_size=2),)
    drop = ("rope_parameters", "layer_norm_eps", "hidden_act")


SWEEP = {"gte": lambda seed: ec.hf_encoder(_gte(), T.GteForMaskedLM, seed),
         "nomic_bert": lambda seed: ec.hf_encoder(_nomic(), T.NomicBertForSequenceClassification, seed),
         "eurobert": lambda seed: ec.hf_encoder(_eurobert(mlp_bias=True), T.EuroBertForMaskedLM, seed),
         "jina_embeddings_v3": lambda seed: ec.hf_encoder(_jina(), T.JinaEmbeddingsV3ForSequenceClassification, seed)}


@pytest.mark.parametrize(("make", "head"), [
    (_gte, T.GteForMaskedLM), (_nomic, T.NomicBertForMaskedLM), (_jina, T.JinaEmbeddingsV3ForMaskedLM),
    (_eurobert, T.EuroBertForMaskedLM)])
@pytest.mark.parametrize("tie", [True, False])
def test_masked_lm_heads_tied_and_untied(make: Any, head: Any, tie: bool) -> None:
    hf = ec.hf_encoder(make(tie_word_embeddings=tie, **({"mlp_bias": True} if head is T.EuroBertForMaskedLM else {})),
                       head)
    ec.check_mlm(hf)
    ours = from_hf(hf)
    assert (ours.embedding.tok.weight is _decoder(ours).weight) == tie


def _decoder(model: Any) -> Any:
    return getattr(model.mlm, "decoder", model.mlm)


@pytest.mark.parametrize("pooling", ["bos", "mean", "late"])
def test_eurobert_classifier_poolings(pooling: str) -> None:
    ec.check_classify(ec.hf_encoder(_eurobert(classifier_pooling=pooling, num_labels=3),
                                    T.EuroBertForSequenceClassification))


def test_base_models_with_a_pooler_keep_it() -> None:
    for hf in (ec.hf_encoder(_jina(), T.JinaEmbeddingsV3Model), ec.hf_encoder(_gte(), T.GteModel, add_pooling_layer=True)):
        x, mask = ec.batch()
        with torch.no_grad():
            want = hf(input_ids=x, attention_mask=mask).pooler_output
            ours = from_hf(hf)
            got = ours.pooler_output(ours(x, attention_mask=mask))
        assert ec.rel(got, want) <= ec.TOL


def test_gte_original_new_prefix_loads() -> None:
    """Alibaba's original head checkpoints name the base model ``new.`` (conversion_mapping's
    ``PrefixChange(prefix_to_remove="new")``)."""
    hf = ec.hf_encoder(_gte(), T.GteForMaskedLM)
    sd = {("new." + k[4:] if k.startswith("gte.") else k): v for k, v in hf.state_dict().items()}
    ours = convert_rope_bert(HFConfig(hf.config.to_dict(), "test"), sd, device=None, dtype=None)
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in from_hf(hf).state_dict().items())


def test_lora_adapters_and_token_classifiers_are_refused() -> None:
    jina = ec.hf_encoder(_jina(), T.JinaEmbeddingsV3Model)
    sd = {**jina.state_dict(), "layers.0.self_attn.q_proj.lora_A.retrieval.weight": torch.zeros(4, 32)}
    hf = HFConfig(jina.config.to_dict(), "test")
    with pytest.raises(UnsupportedConfigError, match="LoRA"):
        convert_rope_bert(hf, sd, device=None, dtype=None)
    with pytest.raises(UnsupportedConfigError, match="token-classification"):
        from_hf(ec.hf_encoder(_gte(num_labels=3), T.GteForTokenClassification))


@pytest.mark.parametrize(("hf", "what"), [
    (_gte(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (_nomic(hidden_act="tanh"), "hidden_act"),
    (_jina(hidden_act="tanh"), "hidden_act"),
    (_eurobert(classifier_pooling="max"), "classifier_pooling"),
    (_eurobert(pretraining_tp=2), "pretraining_tp"),
    (_gte(rope_parameters={"rope_type": "mystery", "rope_theta": 1e4}), "rope_type"),
])
def test_refused_options_are_named(hf: Any, what: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=what):
        build_rope_bert(HFConfig(hf.to_dict(), "test"), Heads("", False, False, 0))


HEADS = [(_gte, T.GteForMaskedLM), (_gte, T.GteForSequenceClassification), (_nomic, T.NomicBertForMaskedLM),
         (_nomic, T.NomicBertForSequenceClassification), (_eurobert, T.EuroBertForMaskedLM),
         (_eurobert, T.EuroBertForSequenceClassification), (_jina, T.JinaEmbeddingsV3ForMaskedLM),
         (_jina, T.JinaEmbeddingsV3ForSequenceClassification)]


@pytest.mark.parametrize(("make", "head"), HEADS)
def test_saved_head_folders_load(make: Any, head: Any, tmp_path: Any) -> None:
    """A saved ``*ForMaskedLM`` / ``*ForSequenceClassification`` folder (transformers writes the
    original checkpoint names back: fused q/k/v and up/gate, ``emb_ln``, ``norm1``, ...) loads with
    its head."""
    hf = ec.hf_encoder(make(tie_word_embeddings=True, num_labels=3), head)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    x, mask = ec.batch()
    with torch.no_grad():
        want = hf(input_ids=x, attention_mask=mask).logits
        hidden = ours(x, attention_mask=mask)
        if ours.mlm is not None:
            assert ec.real_rel(ours.mlm_logits(hidden), want, mask) <= ec.TOL
        else:
            assert ec.rel(ours.classify(hidden, mask), want) <= ec.TOL
