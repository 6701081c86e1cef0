"""DistilBERT, ELECTRA and ALBERT (``families/bert_kin.py``) through ``from_hf`` / ``load_pretrained``:
hidden states, the masked-LM and classification heads, pooled embeddings, folders and bf16 against
transformers' eager model (``tests/hf_encoder_checks.py``); cases for every option that changes the
math (activations, sinusoidal tables, embedding widths, untied decoders, ALBERT's layer groups),
token types, the other task heads (ignored with a warning), the refusals, the ``to_hf`` round trip."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
import transformers as T

import hf_encoder_checks as ec
from attnzoo.interop import from_hf
from attnzoo.models.hf.errors import UnsupportedConfigError
from hf_family_checks import V

pytestmark = pytest.mark.usefixtures("one_thread")


def _distilbert(**kw: Any) -> Any:
    base: dict[str, Any] = dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=48,
                                max_position_embeddings=32, pad_token_id=ec.PAD)
    return T.DistilBertConfig(**{**base, **kw})


def _electra(**kw: Any) -> Any:
    """``embedding_size`` 16 < ``hidden_size`` 32: the ``embeddings_project`` case (the generators')."""
    base: dict[str, Any] = dict(vocab_size=V, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, intermediate_size=48, max_position_embeddings=32,
                                pad_token_id=ec.PAD)
    return T.ElectraConfig(**{**base, **kw})


def _albert(**kw: Any) -> Any:
    """One shared layer group run 3 times, embeddings 16 wide mapped to 32."""
    base: dict[str, Any] = dict(vocab_size=V, embedding_size=16, hidden_size=32, num_hidden_layers=3,
                                num_attention_heads=4, intermediate_size=48, max_position_embeddings=32,
                                pad_token_id=ec.PAD, bos_token_id=0, eos_token_id=2)
    return T.AlbertConfig(**{**base, **kw})


def _albert_groups() -> Any:
    """5 layers over 2 groups of 2 layers: layer i runs group int(i / 2.5) = 0, 0, 0, 1, 1."""
    return _albert(num_hidden_layers=5, num_hidden_groups=2, inner_group_num=2, hidden_act="relu")


class TestDistilBert(ec.EncoderChecks):
    config = staticmethod(_distilbert)
    base = T.DistilBertModel
    mlm = T.DistilBertForMaskedLM
    classifier = T.DistilBertForSequenceClassification
    cases = (lambda: _distilbert(activation="relu"), lambda: _distilbert(activation="gelu_new"),
             lambda: _distilbert(sinusoidal_pos_embds=True))
    drop = ("activation", "sinusoidal_pos_embds", "tie_word_embeddings")


class TestElectra(ec.EncoderChecks):
    config = staticmethod(_electra)
    base = T.ElectraModel
    mlm = T.ElectraForMaskedLM
    classifier = T.ElectraForSequenceClassification
    cases = (lambda: _electra(embedding_size=32), lambda: _electra(hidden_act="gelu_new", layer_norm_eps=1e-3),
             lambda: _electra(hidden_act="relu", type_vocab_size=3))
    drop = ("hidden_act", "layer_norm_eps", "type_vocab_size", "tie_word_embeddings")


class TestAlbert(ec.EncoderChecks):
    config = staticmethod(_albert)
    base = T.AlbertModel
    mlm = T.AlbertForMaskedLM
    classifier = T.AlbertForSequenceClassification
    cases = (_albert_groups, lambda: _albert(embedding_size=32, hidden_act="gelu", layer_norm_eps=1e-3),
             lambda: _albert(num_hidden_layers=2, inner_group_num=2))
    drop = ("hidden_act", "num_hidden_groups", "inner_group_num", "tie_word_embeddings")


SWEEP = {
    "distilbert": lambda seed: ec.hf_encoder(_distilbert(), T.DistilBertForMaskedLM, seed),
    "electra": lambda seed: ec.hf_encoder(_electra(), T.ElectraForMaskedLM, seed),
    "albert": lambda seed: ec.hf_encoder(_albert_groups(), T.AlbertForMaskedLM, seed),
}

#: head variants not in the shared checks: untied decoders, other activations, shared groups
HEADS = [
    (T.DistilBertForMaskedLM, _distilbert(tie_word_embeddings=False, activation="relu")),
    (T.ElectraForMaskedLM, _electra(tie_word_embeddings=False, hidden_act="relu")),
    (T.ElectraForMaskedLM, _electra(embedding_size=32)),
    (T.AlbertForMaskedLM, _albert(tie_word_embeddings=False)),
    (T.AlbertForMaskedLM, _albert_groups()),
]


@pytest.mark.parametrize(("cls", "cfg"), HEADS, ids=lambda v: getattr(v, "__name__", ""))
def test_masked_lm_variants(cls: Any, cfg: Any) -> None:
    ec.check_mlm(ec.hf_encoder(cfg, cls))


@pytest.mark.parametrize("cfg", [_distilbert(activation="relu", num_labels=2),
                                 _electra(embedding_size=32, num_labels=1), _albert_groups()],
                         ids=["distilbert", "electra", "albert"])
def test_classifier_variants(cfg: Any) -> None:
    cls = {"distilbert": T.DistilBertForSequenceClassification, "electra": T.ElectraForSequenceClassification,
           "albert": T.AlbertForSequenceClassification}[cfg.model_type]
    ec.check_classify(ec.hf_encoder(cfg, cls))


@pytest.mark.parametrize(("cfg", "cls"), [(_electra(type_vocab_size=3), T.ElectraModel),
                                          (_albert(type_vocab_size=3), T.AlbertModel)], ids=["electra", "albert"])
def test_token_types(cfg: Any, cls: Any) -> None:
    hf = ec.hf_encoder(cfg, cls)
    x, mask = ec.batch()
    types = torch.randint(0, 3, x.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(input_ids=x, attention_mask=mask, token_type_ids=types).last_hidden_state
        got = from_hf(hf)(x, attention_mask=mask, token_type_ids=types)
    assert ec.real_rel(got, want, mask) <= ec.TOL


def test_distilbert_sinusoidal_table_is_loaded_as_stored() -> None:
    """Not perturbed: the table transformers initialises with sinusoids (a stored parameter)."""
    torch.manual_seed(0)
    hf = T.DistilBertModel._from_config(_distilbert(sinusoidal_pos_embds=True), attn_implementation="eager").eval()
    table = hf.embeddings.position_embeddings.weight.detach()
    assert float(table[1, 0]) == pytest.approx(float(torch.sin(torch.tensor(1.0))))
    assert torch.equal(from_hf(hf).embedding.pos.weight, table)
    ec.check_hidden(hf)


def test_albert_blocks_are_shared_modules() -> None:
    ours = from_hf(ec.hf_encoder(_albert_groups(), T.AlbertModel))
    ids = [id(b) for b in ours.blocks]
    assert len(ids) == 10 and len(set(ids)) == 4
    # layers 0-2 run group 0 (blocks 0-5 are its two layers, three times), layers 3-4 group 1
    assert ids[:6] == ids[:2] * 3 and ids[6:] == ids[6:8] * 2 and not set(ids[:2]) & set(ids[6:])


@pytest.mark.parametrize(("cls", "head"), [(T.ElectraForPreTraining, "discriminator_predictions"),
                                           (T.AlbertForPreTraining, "sop_classifier"),
                                           (T.DistilBertForQuestionAnswering, "qa_outputs")])
def test_other_task_heads_are_ignored_by_name(cls: Any, head: str) -> None:
    make = {"electra": _electra, "albert": _albert, "distilbert": _distilbert}
    cfg = make[cls.config_class.model_type]()
    hf = ec.hf_encoder(cfg, cls)
    with pytest.warns(UserWarning, match=head):
        ours = from_hf(hf)
    x, mask = ec.batch()
    with torch.no_grad():
        want = getattr(hf, cls.base_model_prefix)(input_ids=x, attention_mask=mask).last_hidden_state
        assert ec.real_rel(ours(x, attention_mask=mask), want, mask) <= ec.TOL


@pytest.mark.parametrize(("cfg", "match"), [
    (_electra(position_embedding_type="relative_key"), "position_embedding_type='relative_key'"),
    (_electra(is_decoder=True), "decoder"),
    (_albert(hidden_act="quick_gelu"), "hidden_act='quick_gelu'"),
    (_distilbert(activation="quick_gelu"), "activation='quick_gelu'"),
    (_albert(num_hidden_layers=2, num_hidden_groups=3), "num_hidden_groups=3"),
], ids=["electra-relative", "electra-decoder", "albert-act", "distilbert-act", "albert-groups"])
def test_refusals(cfg: Any, match: str) -> None:
    cls = {"distilbert": T.DistilBertModel, "electra": T.ElectraModel, "albert": T.AlbertModel}[cfg.model_type]
    with pytest.raises(UnsupportedConfigError, match=match):
        from_hf(ec.hf_encoder(cfg, cls))
