"""DeBERTa-v2 / v3 and v1 (``families/deberta.py``) against transformers' eager models: the shared encoder checks
on DeBERTa-v3's settings (log-bucketed relative positions, shared attention keys, a normed relative table,
no absolute positions), a case per option that changes the math (separate position projections, the
convolution, c2p or p2c alone, unbucketed clamped distances, no relative attention, absolute positions and
token types, an embedding projection, other head counts), every masked-LM head (legacy tied / untied, the
new head, a narrower embedding), padded tokens equal to transformers' too, ``to_hf``, refusals; v1 (its
head-interleaved ``in_proj``, windowed relative lookup, scale over every ``pos_att_type`` entry, float32
LayerNorms) the same way."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

T = pytest.importorskip("transformers")

import hf_encoder_checks as ec  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.deberta import DisentangledAttention, log_buckets, relative_positions  # noqa: E402
from attnzoo.models.hf.errors import UnsupportedConfigError  # noqa: E402
from hf_family_checks import V, rel  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES: dict[str, Any] = {"vocab_size": V, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "intermediate_size": 48, "max_position_embeddings": 64, "pad_token_id": 1}
#: DeBERTa-v3's settings (``microsoft/deberta-v3-base``), small: 8 buckets (exact up to 4, logarithmic
#: beyond, so the 12-token batch reaches them)
V3: dict[str, Any] = {"relative_attention": True, "position_buckets": 8, "max_relative_positions": 32,
                      "pos_att_type": ["p2c", "c2p"], "share_att_key": True, "norm_rel_ebd": "layer_norm",
                      "position_biased_input": False, "type_vocab_size": 0}


#: DeBERTa v1's settings (``microsoft/deberta-base``)
V1: dict[str, Any] = {"relative_attention": True, "max_relative_positions": -1, "pos_att_type": "c2p|p2c",
                      "position_biased_input": False, "type_vocab_size": 0}


def _v3(**kw: Any) -> Any:
    return T.DebertaV2Config(**{**SIZES, **V3, **kw})


def _v1(**kw: Any) -> Any:
    return T.DebertaConfig(**{**SIZES, **V1, **kw})


#: one config per option that changes the math
CASES: tuple[Callable[[], Any], ...] = (
    # deberta-v2-xlarge: own position projections, the convolution, the old "p2c|c2p" string
    lambda: _v3(share_att_key=False, conv_kernel_size=3, pos_att_type="p2c|c2p", hidden_act="gelu_new"),
    lambda: _v3(conv_kernel_size=5, conv_groups=2, conv_act="gelu"),
    lambda: _v3(share_att_key=False, pos_att_type=["c2p"]),
    lambda: _v3(pos_att_type=["c2p", "p2p"]),  # shared keys, c2p only ("p2p" does nothing, as in transformers)
    lambda: _v3(pos_att_type=["p2c"], norm_rel_ebd="none"),
    # no buckets: plain distances clamped to [-4, 4), absolute positions and token types
    lambda: _v3(position_buckets=-1, max_relative_positions=4, position_biased_input=True, type_vocab_size=2),
    lambda: _v3(position_buckets=-1, max_relative_positions=-1, share_att_key=False),  # span = max positions
    # no relative attention: the scale still counts both terms; an unused rel-embedding norm
    lambda: _v3(relative_attention=False, position_biased_input=True, embedding_size=24),
    lambda: _v3(hidden_act="relu", layer_norm_eps=1e-5, num_attention_heads=2),
)
#: config keys whose defaults a folder may leave out
DROP = ("hidden_act", "type_vocab_size", "layer_norm_eps", "pooler_hidden_act", "legacy", "tie_word_embeddings")


class TestDebertaV2(ec.EncoderChecks):
    config = staticmethod(_v3)
    base, mlm, classifier = T.DebertaV2Model, T.DebertaV2ForMaskedLM, T.DebertaV2ForSequenceClassification
    cases = CASES
    drop = DROP


class TestDeberta(ec.EncoderChecks):
    config = staticmethod(_v1)
    base, mlm, classifier = T.DebertaModel, T.DebertaForMaskedLM, T.DebertaForSequenceClassification
    cases = (lambda: _v1(max_relative_positions=5),  # a window of 5 < 12 tokens: clamped lookups
             lambda: _v1(pos_att_type=["c2p"], hidden_act="relu"),
             lambda: _v1(pos_att_type=["p2c", "p2p"]),  # the scale counts "p2p" too
             lambda: _v1(relative_attention=False, position_biased_input=True, type_vocab_size=2, embedding_size=24),
             lambda: _v1(position_buckets=8, share_att_key=True, conv_kernel_size=3))  # v2 settings: not v1's
    drop = DROP


#: ``model_type`` -> a maker of a transformers base model ``seed`` (the ``to_hf`` export sweep)
SWEEP: dict[str, Callable[[int], Any]] = {
    "deberta-v2": lambda seed: ec.hf_encoder(_v3(conv_kernel_size=3, share_att_key=False), T.DebertaV2Model, seed),
    "deberta": lambda seed: ec.hf_encoder(_v1(), T.DebertaModel, seed),
}


@pytest.mark.parametrize("kw", [{"tie_word_embeddings": False}, {"legacy": False}, {"embedding_size": 24},
                                {"embedding_size": 24, "tie_word_embeddings": False}])
def test_every_masked_lm_head(kw: dict[str, Any]) -> None:
    ec.check_mlm(ec.hf_encoder(_v3(**kw), T.DebertaV2ForMaskedLM))
    if "embedding_size" not in kw:
        ec.check_mlm(ec.hf_encoder(_v1(**kw), T.DebertaForMaskedLM))


def test_classifier_pooler_activation() -> None:
    cfg = _v3(pooler_hidden_act="tanh", conv_kernel_size=3)
    cfg.num_labels = 2
    ec.check_classify(ec.hf_encoder(cfg, T.DebertaV2ForSequenceClassification))


def test_padded_tokens_equal_transformers_too() -> None:
    """transformers zeroes the padded embeddings and lets padded queries attend uniformly: so here. No mask:
    every token attends to every token in both."""
    hf = ec.hf_encoder(_v3(conv_kernel_size=3), T.DebertaV2Model)
    x, mask = ec.batch()
    with torch.no_grad():
        assert rel(from_hf(hf)(x, attention_mask=mask), ec.hf_hidden(hf, x, mask)) <= ec.TOL
        assert rel(from_hf(hf)(x), hf(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state) <= ec.TOL


@pytest.mark.parametrize("make,cls", [(_v3, T.DebertaV2ForSequenceClassification),
                                      (_v1, T.DebertaForSequenceClassification)])
def test_classifier_folder_with_the_old_pos_att_type_string(make: Any, cls: Any, tmp_path: Path) -> None:
    """A fine-tuned classifier's folder loads with its head; ``"p2c|c2p"`` as older ``config.json`` files write it."""
    cfg = make()
    cfg.num_labels = 3
    hf = ec.hf_encoder(cfg, cls)
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "pos_att_type": "p2c|c2p"}))
    model = load_pretrained(tmp_path)
    x, mask = ec.batch()
    with torch.no_grad():
        assert rel(model.classify(model(x, attention_mask=mask), mask), hf(input_ids=x, attention_mask=mask).logits) \
            <= ec.TOL


def test_token_types_and_positions_follow_transformers() -> None:
    hf = ec.hf_encoder(_v3(position_biased_input=True, type_vocab_size=2), T.DebertaV2Model)
    x, mask = ec.batch()
    types = (torch.arange(x.shape[1]) >= 6).long().expand_as(x)
    pos = torch.arange(3, 3 + x.shape[1]).expand_as(x)
    with torch.no_grad():
        want = hf(input_ids=x, attention_mask=mask, token_type_ids=types, position_ids=pos).last_hidden_state
        got = from_hf(hf)(x, attention_mask=mask, token_type_ids=types, positions=pos)
    assert ec.real_rel(got, want, mask) <= ec.TOL


def test_log_buckets() -> None:
    """Exact up to mid = 4, then logarithmic, 7 = buckets - 1 at max_positions - 1, antisymmetric; as
    transformers' on every distance up to 600 (also large tables: DeBERTa-v3's 256 buckets, 512 positions)."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

    r = torch.arange(-40, 41)
    b = log_buckets(r, 8, 32)
    assert b[40 - 4: 40 + 5].tolist() == list(range(-4, 5))
    assert b[40 + 31].item() == 7 and (b == -b.flip(0)).all() and (b.diff() >= 0).all()
    r = torch.arange(-600, 601)
    for buckets, max_positions in ((8, 32), (256, 512), (3, 10)):
        assert torch.equal(log_buckets(r, buckets, max_positions),
                           make_log_bucket_position(r, buckets, max_positions).long())
    assert relative_positions(3, -1, -1).tolist() == [[0, -1, -2], [1, 0, -1], [2, 1, 0]]


def test_attention_refuses_packed_input_and_cross_attention() -> None:
    from attnzoo.models.families.deberta import RelativePositionTable

    attn = DisentangledAttention(16, 2, table=RelativePositionTable(4, 16))
    x = torch.randn(1, 6, 16)
    assert attn(x).shape == (1, 6, 16)
    with pytest.raises(ValueError, match="packed"):
        attn(x, cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="self-attention only"):
        attn(x, context=x)


@pytest.mark.parametrize("model_type", list(SWEEP))
def test_to_hf_with_the_convolution_and_own_position_projections(model_type: str) -> None:
    ec.check_to_hf(SWEEP[model_type])


def test_other_heads_are_ignored_with_a_warning() -> None:
    hf = ec.hf_encoder(_v3(), T.DebertaV2ForTokenClassification)
    with pytest.warns(UserWarning, match="classifier"):
        ours = from_hf(hf)
    x, mask = ec.batch()
    with torch.no_grad():
        assert ec.real_rel(ours(x, attention_mask=mask), hf.deberta(input_ids=x, attention_mask=mask)[0], mask) \
            <= ec.TOL


@pytest.mark.parametrize("kw,what", [
    ({"conv_kernel_size": 4}, "conv_kernel_size=4"),
    ({"pooler_hidden_size": 16}, "pooler_hidden_size=16"),
    ({"attention_head_size": 12}, "attention_head_size=12"),
    ({"hidden_act": "mish"}, "hidden_act='mish'"),
    ({"conv_kernel_size": 3, "conv_act": "mish"}, "conv_act='mish'"),
    ({"pooler_hidden_act": "mish"}, "pooler_hidden_act='mish'"),
])
def test_refusals(kw: dict[str, Any], what: str) -> None:
    cfg = _v3()
    for k, v in kw.items():
        setattr(cfg, k, v)
    cfg.num_labels = 2
    hf = ec.hf_encoder(_v3(), T.DebertaV2ForSequenceClassification)
    hf.config = cfg  # the weights do not matter: the config is refused first
    with pytest.raises(UnsupportedConfigError, match=what.replace("(", r"\(")):
        from_hf(hf)


def test_new_head_with_narrow_embeddings_is_refused() -> None:
    hf = ec.hf_encoder(_v3(), T.DebertaV2ForMaskedLM)
    hf.config.legacy, hf.config.embedding_size = False, 24
    with warnings.catch_warnings(), pytest.raises(UnsupportedConfigError, match="legacy=False"):
        warnings.simplefilter("ignore")
        from_hf(hf)


def test_v1_talking_heads_are_refused() -> None:
    hf = ec.hf_encoder(_v1(), T.DebertaModel)
    hf.config.talking_head = True
    with pytest.raises(UnsupportedConfigError, match="talking_head=True"):
        from_hf(hf)
