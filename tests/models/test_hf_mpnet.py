"""MPNet (``mpnet``) through ``from_hf`` / ``load_pretrained`` against transformers' eager model: the
shared encoder checks (hidden states on right/left-padded rows, the masked-LM and classification
heads, mean-pooled embeddings, folders, bfloat16), MPNet's buckets equal to T5's (whose bias parts it
reuses), distances past the log buckets' cap, the config options that change the math, ``to_hf``
and the refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_encoder_checks as ec  # noqa: E402
from attnzoo.interop import UnsupportedConfigError, from_hf, to_hf  # noqa: E402
from attnzoo.models.families.mpnet import SlotBiasAttention, padding_offset_positions  # noqa: E402
from attnzoo.models.families.t5_encoder import relative_position_buckets  # noqa: E402
from hf_family_checks import V  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(**kw: Any) -> Any:
    base: dict[str, Any] = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64, max_position_embeddings=40, pad_token_id=ec.PAD)
    return T.MPNetConfig(**{**base, **kw})


SWEEP = {"mpnet": lambda seed: ec.hf_encoder(_cfg(), T.MPNetForMaskedLM, seed)}


class TestMPNet(ec.EncoderChecks):
    config = staticmethod(_cfg)
    base = T.MPNetModel
    mlm = T.MPNetForMaskedLM
    classifier = T.MPNetForSequenceClassification
    cases = (lambda: _cfg(hidden_act="gelu_new"), lambda: _cfg(hidden_act="relu", layer_norm_eps=1e-5),
             lambda: _cfg(relative_attention_num_buckets=48),  # a bigger table: rows past 32 never read
             lambda: _cfg(pad_token_id=0))  # positions still count from padding_idx 1
    drop = ("relative_attention_num_buckets", "layer_norm_eps", "hidden_act", "tie_word_embeddings")


@pytest.mark.parametrize(("buckets", "distance"), [(32, 128), (64, 256), (8, 20)])
def test_mpnet_buckets_are_t5_buckets(buckets: int, distance: int) -> None:
    d = torch.arange(-3 * distance, 3 * distance + 1)
    mpnet = T.models.mpnet.modeling_mpnet.MPNetEncoder.relative_position_bucket
    assert torch.equal(relative_position_buckets(d, num_buckets=buckets, max_distance=distance),
                       mpnet(d, buckets, distance))


def test_distances_past_max_distance() -> None:
    """Sequences of 150 slots reach the capped last bucket (distance >= 128)."""
    ec.check_hidden(ec.hf_encoder(_cfg(max_position_embeddings=160), T.MPNetModel), n=150)


def test_untied_masked_lm_head_uses_the_decoder_bias() -> None:
    hf = ec.hf_encoder(_cfg(tie_word_embeddings=False), T.MPNetForMaskedLM)
    assert not torch.equal(hf.lm_head.bias, hf.lm_head.decoder.bias)  # untied: the forward adds decoder.bias
    ec.check_mlm(hf)
    ours = from_hf(hf)
    assert ours.mlm.decoder.weight is not ours.embedding.tok_emb.weight


def test_masked_lm_head_is_exact_gelu_whatever_hidden_act() -> None:
    ec.check_mlm(ec.hf_encoder(_cfg(hidden_act="relu"), T.MPNetForMaskedLM))


def test_tied_head_shares_one_weight_and_one_bias_table() -> None:
    ours = from_hf(ec.hf_encoder(_cfg(), T.MPNetForMaskedLM))
    assert ours.mlm.decoder.weight is ours.embedding.tok_emb.weight
    tables = {id(b.attn.relative_bias.weight) for b in ours.blocks}
    assert len(tables) == 1 and isinstance(ours.blocks[1].attn, SlotBiasAttention)


@pytest.mark.parametrize("pos", [torch.arange(3, 15), torch.cat([torch.arange(2, 8), torch.arange(2, 8)])])
def test_given_positions_move_only_the_absolute_embeddings(pos: torch.Tensor) -> None:
    """``positions`` are table indices (transformers' ``position_ids``); the relative bias stays over
    the slots (transformers builds it from ``arange``), also for positions that restart halfway."""
    hf = ec.hf_encoder(_cfg(), T.MPNetModel)
    x, mask = ec.batch()
    with torch.no_grad():
        want = hf(input_ids=x, attention_mask=mask, position_ids=pos.expand_as(x)).last_hidden_state
        got = from_hf(hf)(x, attention_mask=mask, positions=pos.expand_as(x))
    assert ec.real_rel(got, want, mask) <= ec.TOL


@pytest.mark.parametrize("head", [T.MPNetForMaskedLM, T.MPNetForSequenceClassification])
def test_to_hf_inverts_from_hf(head: Any) -> None:
    cfg = _cfg(tie_word_embeddings=head is T.MPNetForSequenceClassification, num_labels=3)
    target, source = ec.hf_encoder(cfg, head, 0), ec.hf_encoder(cfg, head, 1)
    ours = from_hf(source)
    if cfg.tie_word_embeddings:
        assert to_hf(ours, target) is target
    else:  # transformers' forward does not read the untied lm_head.bias: it keeps its value
        with pytest.warns(UserWarning, match=r"lm_head\.bias"):
            assert to_hf(ours, target) is target
    again = from_hf(target).state_dict()
    for name, want in ours.state_dict().items():
        assert torch.equal(again[name], want), name


@pytest.mark.parametrize("head", [T.MPNetForTokenClassification, T.MPNetForQuestionAnswering,
                                  T.MPNetForMultipleChoice])
def test_refused_heads(head: Any) -> None:
    with pytest.raises(UnsupportedConfigError, match="task head weights"):
        from_hf(ec.hf_encoder(_cfg(), head))


@pytest.mark.parametrize(("key", "value"), [("relative_attention_num_buckets", 16), ("hidden_act", "quick_gelu")])
def test_refused_options(key: str, value: Any) -> None:
    hf = ec.hf_encoder(_cfg(), T.MPNetModel)
    hf.config.__dict__[key] = value  # transformers itself cannot build the first (index past the table)
    with pytest.raises(UnsupportedConfigError, match=key):
        from_hf(hf)


def test_to_hf_keeps_the_table_rows_mpnet_never_reads() -> None:
    cfg = _cfg(relative_attention_num_buckets=48)
    target, source = ec.hf_encoder(cfg, T.MPNetModel, 0), ec.hf_encoder(cfg, T.MPNetModel, 1)
    before = target.encoder.relative_attention_bias.weight[32:].clone()
    to_hf(from_hf(source), target)
    table = target.encoder.relative_attention_bias.weight
    assert torch.equal(table[:32], source.encoder.relative_attention_bias.weight[:32])
    assert torch.equal(table[32:], before)


def test_padding_offset_positions_restart_in_every_packed_sequence() -> None:
    """Packed, each sequence is counted as its own row (a real token with the pad id included)."""
    rows = [torch.tensor([[5, 6, 1, 7]]), torch.tensor([[1]]), torch.tensor([[9, 9, 9]])]
    cu = torch.tensor([0, 4, 5, 8], dtype=torch.int32)
    want = torch.cat([padding_offset_positions(r, 1) for r in rows], dim=1)
    assert torch.equal(padding_offset_positions(torch.cat(rows, dim=1), 1, cu), want)
