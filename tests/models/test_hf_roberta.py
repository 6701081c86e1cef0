"""RoBERTa, XLM-R, CamemBERT, RoBERTa-PreLayerNorm and XLM-R-XL (``families/roberta.py``) against
transformers' eager models: the shared encoder checks per family, positions counted from the ids
(not the mask), given positions, the untied masked-LM head, refusals."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

T = pytest.importorskip("transformers")

import hf_encoder_checks as ec  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.families.mpnet import padding_offset_positions  # noqa: E402
from attnzoo.models.hf.errors import UnsupportedConfigError  # noqa: E402
from hf_family_checks import V, rel  # noqa: E402

SIZES: dict[str, Any] = {"vocab_size": V, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "intermediate_size": 48, "max_position_embeddings": 24, "pad_token_id": 1}


def _maker(config_class: Any, **base: Any) -> Callable[..., Any]:
    def make(**kw: Any) -> Any:
        return config_class(**{**SIZES, **base, **kw})
    return make


_roberta = _maker(T.RobertaConfig)
_xlmr = _maker(T.XLMRobertaConfig, type_vocab_size=1, layer_norm_eps=1e-5)
_camembert = _maker(T.CamembertConfig)
_preln = _maker(T.RobertaPreLayerNormConfig)
_xl = _maker(T.XLMRobertaXLConfig)

#: config keys whose defaults a folder may leave out (read from the variant's defaults)
DROP = ("hidden_act", "type_vocab_size", "layer_norm_eps", "pad_token_id", "tie_word_embeddings")


class TestRoberta(ec.EncoderChecks):
    config = staticmethod(_roberta)
    base, mlm, classifier = T.RobertaModel, T.RobertaForMaskedLM, T.RobertaForSequenceClassification
    cases = (lambda: _roberta(hidden_act="relu", type_vocab_size=1, layer_norm_eps=1e-5),
             lambda: _roberta(hidden_act="gelu_new"),
             lambda: _roberta(pad_token_id=2),  # the batch's pads (id 1) are then tokens: positions shift
             lambda: _roberta(pad_token_id=0, max_position_embeddings=13))  # 12 tokens: positions 1..12 exactly
    drop = DROP


class TestXLMRoberta(ec.EncoderChecks):
    config = staticmethod(_xlmr)
    base, mlm, classifier = T.XLMRobertaModel, T.XLMRobertaForMaskedLM, T.XLMRobertaForSequenceClassification
    drop = ("hidden_act", "pad_token_id", "tie_word_embeddings")  # its type_vocab_size and eps are not defaults


class TestCamembert(ec.EncoderChecks):
    config = staticmethod(_camembert)
    base, mlm, classifier = T.CamembertModel, T.CamembertForMaskedLM, T.CamembertForSequenceClassification
    drop = DROP


class TestRobertaPreLayerNorm(ec.EncoderChecks):
    config = staticmethod(_preln)
    base, mlm = T.RobertaPreLayerNormModel, T.RobertaPreLayerNormForMaskedLM
    classifier = T.RobertaPreLayerNormForSequenceClassification
    cases = (lambda: _preln(hidden_act="silu", layer_norm_eps=1e-5),)
    drop = DROP


class TestXLMRobertaXL(ec.EncoderChecks):
    config = staticmethod(_xl)
    base, mlm, classifier = T.XLMRobertaXLModel, T.XLMRobertaXLForMaskedLM, T.XLMRobertaXLForSequenceClassification
    cases = (lambda: _xl(hidden_act="relu", type_vocab_size=2),)
    drop = DROP  # XL's own defaults: eps 1e-5, one token type


#: ``model_type`` -> a maker of a transformers base model ``seed`` (the ``to_hf`` export sweep)
SWEEP: dict[str, Callable[[int], Any]] = {
    "roberta": lambda seed: ec.hf_encoder(_roberta(), T.RobertaModel, seed),
    "xlm-roberta": lambda seed: ec.hf_encoder(_xlmr(), T.XLMRobertaModel, seed),
    "camembert": lambda seed: ec.hf_encoder(_camembert(), T.CamembertModel, seed),
    "roberta-prelayernorm": lambda seed: ec.hf_encoder(_preln(), T.RobertaPreLayerNormModel, seed),
    "xlm-roberta-xl": lambda seed: ec.hf_encoder(_xl(), T.XLMRobertaXLModel, seed),
}


@pytest.mark.parametrize("padding_idx", [0, 1, 2])
def test_positions_are_counted_from_the_ids(padding_idx: int) -> None:
    """Equal to transformers' own rule (``RobertaEmbeddings.create_position_ids_from_input_ids``),
    pad ids inside, before and after the real tokens; and per sequence when packed."""
    tokens = torch.tensor([[0, 5, 1, 7, 1, 2], [1, 1, 4, 1, 9, 0], [2, 2, 2, 6, 8, 1]])
    want = T.models.roberta.modeling_roberta.RobertaEmbeddings.create_position_ids_from_input_ids(tokens, padding_idx)
    assert torch.equal(padding_offset_positions(tokens, padding_idx), want)
    cu = torch.arange(0, 19, 6, dtype=torch.int32)
    assert torch.equal(padding_offset_positions(tokens.reshape(1, -1), padding_idx, cu), want.reshape(1, -1))


@pytest.mark.parametrize("make,base", [(_roberta, T.RobertaModel), (_xl, T.XLMRobertaXLModel)])
def test_pad_ids_and_mask_that_disagree_follow_transformers(make: Any, base: Any) -> None:
    """A real token equal to the pad id takes the pad position, a masked token that is not the pad
    id is counted; the mask only hides keys. Also without a mask (pads attended) with token types,
    and given positions (table indices, as transformers' ``position_ids``)."""
    hf = ec.hf_encoder(make(type_vocab_size=2), base)
    x, mask = ec.batch()
    x[0, 3] = ec.PAD  # a real token with the pad id
    x[1, 1] = 7  # a masked-out token that is not the pad id
    types = (torch.arange(x.shape[1]) >= 6).long().expand_as(x)
    ours = from_hf(hf)
    with torch.no_grad():
        assert ec.real_rel(ours(x, attention_mask=mask), ec.hf_hidden(hf, x, mask), mask) <= ec.TOL
        want = hf(input_ids=x, token_type_ids=types).last_hidden_state
        assert rel(ours(x, token_type_ids=types), want) <= ec.TOL
        pos = torch.arange(3, 3 + x.shape[1]).expand_as(x)
        want = hf(input_ids=x, attention_mask=mask, position_ids=pos).last_hidden_state
        assert ec.real_rel(ours(x, attention_mask=mask, positions=pos), want, mask) <= ec.TOL


def test_more_tokens_than_positions_is_a_value_error() -> None:
    ours = from_hf(ec.hf_encoder(_roberta(), T.RobertaModel))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ours(torch.full((1, 23), 5))  # positions 2..24 of a 24-row table


def test_untied_masked_lm_head_uses_its_decoder_and_bias() -> None:
    """Also: the head's GELU is exact whatever ``hidden_act``."""
    cfg = _roberta(tie_word_embeddings=False, hidden_act="relu")
    hf = ec.hf_encoder(cfg, T.RobertaForMaskedLM)
    assert not torch.equal(hf.lm_head.bias, hf.lm_head.decoder.bias)  # perturbed apart: the forward reads decoder's
    ec.check_mlm(hf)
    ours = from_hf(hf)
    assert ours.mlm.decoder.weight is not ours.embedding.tok_emb.weight
    with pytest.warns(UserWarning, match=r"lm_head\.bias"):  # unused by transformers' forward: kept as it was
        ec.check_to_hf(lambda seed: ec.hf_encoder(cfg, T.RobertaForMaskedLM, seed))


def test_tied_masked_lm_head_shares_the_token_embedding() -> None:
    ours = from_hf(ec.hf_encoder(_xl(), T.XLMRobertaXLForMaskedLM))
    assert ours.mlm.decoder.weight is ours.embedding.tok_emb.weight


def test_other_task_heads_are_ignored_with_a_warning() -> None:
    hf = ec.hf_encoder(_roberta(num_labels=3), T.RobertaForTokenClassification)
    with pytest.warns(UserWarning, match=r"classifier\.weight"):
        ours = from_hf(hf)
    assert ours.classifier is None and ours.mlm is None


@pytest.mark.parametrize("settings,why", [
    ({"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
    ({"is_decoder": True}, "is_decoder"),
    ({"is_decoder": True, "add_cross_attention": True}, "add_cross_attention"),
    ({"hidden_act": "quick_gelu"}, "hidden_act='quick_gelu'"),
    ({"pad_token_id": None}, "pad_token_id=None"),
])
def test_unsupported_options_are_refused_by_name(settings: dict[str, Any], why: str) -> None:
    hf = T.RobertaModel._from_config(_roberta(**settings))
    with pytest.raises(UnsupportedConfigError, match=why):
        from_hf(hf)
