"""Packed training of encoder-decoders (``EncoderDecoder.forward(src_cu_seqlens=, tgt_cu_seqlens=)``,
``loss(src_cu_seqlens=, labels_cu_seqlens=)``): ``S`` (source, target) pairs laid end to end, no padding.

Equivalences, for the native ``Transformer`` and every text seq2seq family (tiny random configs through
the families' builders, every weight perturbed, float64): packed logits equal the padded batch's on the
real tokens, the packed loss equals the padded loss (``-100`` on padding and on one label inside), the
gradients of every parameter are equal, one SGD step moves both losses alike; the decoder's per-pair
cross-attention fallback equals the fused one; and every bad input is refused by name."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from attnzoo.models import Seq2SeqConfig, Transformer
from attnzoo.models.families.bart import build_bart
from attnzoo.models.families.m2m_100 import build_m2m_100
from attnzoo.models.families.marian import build_seq2seq
from attnzoo.models.families.t5 import build_t5
from attnzoo.models.families.whisper import build_whisper
from attnzoo.models.hf._state import HFConfig
from attnzoo.models.seq2seq import EncoderDecoder
from attnzoo.nn.packing import run_packed_cross

pytestmark = pytest.mark.usefixtures("one_thread")

V, PAD, EOS = 48, 1, 2
SRC_LENGTHS, TGT_LENGTHS = (5, 2, 7), (4, 6, 1)
#: BART's lineage: the stacks' shapes (the builders fill the rest from the config classes' defaults)
_STACKS = {"vocab_size": V, "d_model": 16, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
           "decoder_attention_heads": 4, "encoder_ffn_dim": 24, "decoder_ffn_dim": 24, "max_position_embeddings": 32,
           "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "pad_token_id": PAD,
           "eos_token_id": EOS, "decoder_start_token_id": EOS}
_T5 = {"vocab_size": V, "d_model": 16, "d_kv": 4, "d_ff": 24, "num_layers": 2, "num_heads": 4,
       "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16, "pad_token_id": 0,
       "eos_token_id": EOS, "decoder_start_token_id": 0}


def _hf(data: dict[str, Any], arch: str) -> HFConfig:
    return HFConfig(data, "config.json", arch)


def _transformer() -> EncoderDecoder:
    model = Transformer(config=Seq2SeqConfig(src_vocab_size=V, tgt_vocab_size=V, dim=16, num_heads=4, encoder_depth=2,
                                             decoder_depth=2, max_seq_len=16, dropout=0.0))
    model.decoder_start_token_id = 0
    return model


#: family -> a builder of a tiny random model
FAMILIES: dict[str, Callable[[], EncoderDecoder]] = {
    "transformer": _transformer,
    "bart": lambda: build_bart(_hf({**_STACKS, "model_type": "bart"}, "BART")),
    "mbart": lambda: build_bart(_hf({**_STACKS, "model_type": "mbart"}, "mBART")),
    "plbart": lambda: build_bart(_hf({**_STACKS, "model_type": "plbart"}, "PLBART")),
    "marian": lambda: build_seq2seq(_hf({**_STACKS, "model_type": "marian", "decoder_start_token_id": PAD}, "Marian"),
                                    "marian"),
    "pegasus": lambda: build_seq2seq(_hf({**_STACKS, "model_type": "pegasus"}, "Pegasus"), "pegasus"),
    "m2m_100": lambda: build_m2m_100(_hf({**_STACKS, "model_type": "m2m_100"}, "M2M100")),
    "t5": lambda: build_t5(_hf({**_T5, "model_type": "t5", "feed_forward_proj": "relu"}, "T5")),
    "mt5": lambda: build_t5(_hf({**_T5, "model_type": "mt5", "feed_forward_proj": "gated-gelu"}, "mT5")),
    "umt5": lambda: build_t5(_hf({**_T5, "model_type": "umt5", "feed_forward_proj": "gated-gelu",
                                  "tie_word_embeddings": False}, "UMT5")),
}


def _model(family: str, seed: int = 0) -> EncoderDecoder:
    """The family's tiny model in float64, every parameter and float buffer perturbed (norms are not
    identities, T5's relative biases and BART's logits bias not zero)."""
    torch.manual_seed(seed)
    model = FAMILIES[family]().double()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.train()  # no dropout in these configs: train mode is exact, and checks the packed path's refusals


def _cu(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _pairs(seed: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``S`` sources and targets of :data:`SRC_LENGTHS` / :data:`TGT_LENGTHS` tokens (no special ids)."""
    gen = torch.Generator().manual_seed(seed)
    return ([torch.randint(3, V, (n,), generator=gen) for n in SRC_LENGTHS],
            [torch.randint(3, V, (n,), generator=gen) for n in TGT_LENGTHS])


def _padded(rows: list[torch.Tensor], fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` right-padded with ``fill``: ``(tokens [S, N_max], mask [S, N_max])``."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), fill, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, :len(r)], mask[i, :len(r)] = r, True
    return out, mask


def _labels(tgts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The targets as labels, one label inside the second target not counted (``-100``)."""
    out = [t.clone() for t in tgts]
    out[1][2] = -100
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _losses(model: EncoderDecoder) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed loss, padded loss)`` of the same pairs."""
    srcs, tgts = _pairs()
    labels = _labels(tgts)
    src, src_mask = _padded(srcs, PAD)
    padded = model.loss(src, _padded(labels, -100)[0], src_mask=src_mask)
    packed = model.loss(torch.cat(srcs)[None], torch.cat(labels)[None], src_cu_seqlens=_cu(SRC_LENGTHS),
                        labels_cu_seqlens=_cu(TGT_LENGTHS))
    return packed, padded


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_logits_equal_the_padded_batch_on_real_tokens(family: str) -> None:
    model = _model(family).eval()
    srcs, tgts = _pairs()
    src, src_mask = _padded(srcs, PAD)
    tgt, _ = _padded(tgts, PAD)
    with torch.no_grad():
        want = model(src, tgt, src_mask=src_mask)  # [S, N_max, V]
        got = model(torch.cat(srcs)[None], torch.cat(tgts)[None], src_cu_seqlens=_cu(SRC_LENGTHS),
                    tgt_cu_seqlens=_cu(TGT_LENGTHS))  # [1, Tn, V]
    assert got.shape == (1, sum(TGT_LENGTHS), V)
    for i, piece in enumerate(got[0].split(TGT_LENGTHS)):
        err = _rel(piece, want[i, :TGT_LENGTHS[i]])
        assert err < 1e-10, f"{family}: pair {i} ({SRC_LENGTHS[i]} -> {TGT_LENGTHS[i]} tokens): max rel. error {err:.2e}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_loss_and_gradients_equal_the_padded_ones(family: str) -> None:
    model = _model(family)
    packed, padded = _losses(model)
    assert packed.dtype == torch.float32 and packed.dim() == 0
    assert abs(packed.item() - padded.item()) <= 1e-6 * abs(padded.item()), f"{family}: {packed} vs {padded}"
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    g_packed = torch.autograd.grad(packed, params, allow_unused=True)
    g_padded = torch.autograd.grad(padded, params, allow_unused=True)
    for name, a, b in zip(names, g_packed, g_padded, strict=True):
        if a is None or b is None:
            assert a is None and b is None, f"{family}: {name} has a gradient on one side only"
            continue
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max()) + 1e-12), \
            f"{family}: gradient of {name} {tuple(a.shape)} differs by {float((a - b).abs().max()):.2e}"


@pytest.mark.parametrize("family", ["transformer", "mbart", "t5"])
def test_one_training_step_with_packing_moves_the_loss_like_the_padded_one(family: str) -> None:
    model = _model(family)
    after = []
    for side in (0, 1):  # 0: packed, 1: padded
        trained = copy.deepcopy(model)
        opt = torch.optim.SGD(trained.parameters(), lr=0.05)
        before = _losses(trained)[side]
        before.backward()
        opt.step()
        with torch.no_grad():
            now = _losses(trained)[side]
        assert now.item() < before.item(), f"{family}: the step did not lower the loss ({before} -> {now})"
        after.append(float(now))
    assert abs(after[0] - after[1]) <= 1e-6 * abs(after[1]), f"{family}: after one step {after[0]} vs {after[1]}"


def test_the_per_pair_cross_attention_fallback_equals_the_fused_path() -> None:
    model = _model("bart").eval()
    block = model.decoder.blocks[0]

    class Unfused(nn.Module):  # a cross-attention module without a packed path
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
            return self.inner(x, context)

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, sum(TGT_LENGTHS), 16, generator=gen, dtype=torch.float64)
    ctx = torch.randn(1, sum(SRC_LENGTHS), 16, generator=gen, dtype=torch.float64)
    cu_q, cu_k = _cu(TGT_LENGTHS), _cu(SRC_LENGTHS)
    with torch.no_grad():
        fused = run_packed_cross(block.cross_attn, x, ctx, cu_q, cu_k)
        alone = run_packed_cross(Unfused(block.cross_attn), x, ctx, cu_q, cu_k)
        pairs = [block.cross_attn(q, k) for q, k in zip(x.split(TGT_LENGTHS, 1), ctx.split(SRC_LENGTHS, 1), strict=True)]
    assert _rel(fused, torch.cat(pairs, 1)) < 1e-12 and _rel(alone, torch.cat(pairs, 1)) < 1e-12


def _call(model: EncoderDecoder, **changes: Any) -> Any:
    srcs, tgts = _pairs()
    kw: dict[str, Any] = {"src": torch.cat(srcs)[None], "tgt": torch.cat(tgts)[None],
                          "src_cu_seqlens": _cu(SRC_LENGTHS), "tgt_cu_seqlens": _cu(TGT_LENGTHS), **changes}
    return model(kw.pop("src"), kw.pop("tgt"), **kw)


@pytest.mark.parametrize(("changes", "match"), [
    ({"tgt_cu_seqlens": _cu((4, 7))}, r"same number S of pairs; got S = 3 sources and S = 2 targets"),
    ({"src_cu_seqlens": _cu((5, 2, 6))}, r"src_cu_seqlens must start at 0, be non-decreasing and end at 14"),
    ({"tgt_cu_seqlens": None}, r"need both src_cu_seqlens and tgt_cu_seqlens .*tgt_cu_seqlens is None"),
    ({"src": torch.randint(3, V, (2, 7))}, r"packed src must be one row \[1, T\].*got src \(2, 7\)"),
    ({"src_mask": torch.ones(1, 14, dtype=torch.bool)}, r"take no src_mask"),
    ({"tgt_mask": torch.ones(1, 11, dtype=torch.bool)}, r"take no tgt_mask"),
    ({"src_cu_seqlens": _cu(SRC_LENGTHS).long()}, r"src_cu_seqlens must have dtype torch.int32"),
])
def test_bad_packed_input_is_refused_by_name(changes: dict[str, Any], match: str) -> None:
    model = _model("transformer").eval()
    with pytest.raises((ValueError, TypeError), match=match):
        _call(model, **changes)


def test_a_packed_sequence_longer_than_the_positions_is_refused() -> None:
    model = _model("transformer").eval()  # max_seq_len=16
    long = torch.randint(3, V, (1, 20))
    with pytest.raises(ValueError, match=r"packed sequence of 17 tokens is longer than the model's 16 positions"):
        model(long, long[:, :4], src_cu_seqlens=_cu((17, 3)), tgt_cu_seqlens=_cu((2, 2)))
    with pytest.raises(ValueError, match=r"packed sequence of 18 tokens is longer than the model's 16 positions"):
        model(long[:, :4], long, src_cu_seqlens=_cu((2, 2)), tgt_cu_seqlens=_cu((2, 18)))


def test_the_decoder_refuses_a_cache_a_context_mask_or_unpacked_context_with_packing() -> None:
    model = _model("transformer").eval()
    tgt, cu = torch.randint(3, V, (1, 5)), _cu((2, 3))
    memory, memory_cu = torch.randn(1, 4, 16, dtype=torch.float64), _cu((1, 3))
    with pytest.raises(ValueError, match=r"packed input \(cu_seqlens\) takes no cache"):
        model.decoder(tgt, cu_seqlens=cu, context=memory, context_cu_seqlens=memory_cu, cache=model.init_cache(1, 8))
    with pytest.raises(ValueError, match=r"takes no context_mask"):
        model.decoder(tgt, cu_seqlens=cu, context=memory, context_cu_seqlens=memory_cu,
                      context_mask=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"needs context_cu_seqlens .*got None"):
        model.decoder(tgt, cu_seqlens=cu, context=memory)
    with pytest.raises(ValueError, match=r"context_cu_seqlens must describe as many sequences as cu_seqlens"):
        model.decoder(tgt, cu_seqlens=cu, context=memory, context_cu_seqlens=_cu((1, 1, 2)))
    with pytest.raises(ValueError, match=r"context_cu_seqlens \(packed context\) needs cu_seqlens"):
        model.decoder(tgt, context=memory, context_cu_seqlens=memory_cu)


def test_packed_labels_are_checked_by_name() -> None:
    model = _model("transformer").eval()
    labels = torch.randint(3, V, (1, 11))
    src = torch.randint(3, V, (1, 14))
    with pytest.raises(ValueError, match=r"labels_cu_seqlens must start at 0, be non-decreasing and end at 11"):
        model.loss(src, labels, src_cu_seqlens=_cu(SRC_LENGTHS), labels_cu_seqlens=_cu((4, 6, 2)))
    with pytest.raises(ValueError, match=r"need both src_cu_seqlens and labels_cu_seqlens .*labels_cu_seqlens is None"):
        model.loss(src, labels, src_cu_seqlens=_cu(SRC_LENGTHS))
    with pytest.raises(ValueError, match=r"decoder_input must have the labels' shape \(1, 11\)"):
        model.loss(src, labels, src_cu_seqlens=_cu(SRC_LENGTHS), labels_cu_seqlens=_cu(TGT_LENGTHS),
                   decoder_input=labels[:, :5])


def test_whisper_audio_is_not_packed() -> None:
    model = build_whisper(_hf({"vocab_size": V, "d_model": 16, "encoder_layers": 1, "decoder_layers": 1,
                               "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 24,
                               "decoder_ffn_dim": 24, "num_mel_bins": 8, "max_source_positions": 6,
                               "max_target_positions": 16, "decoder_start_token_id": 0}, "Whisper"))
    with pytest.raises(ValueError, match=r"src_cu_seqlens.*encoder is WhisperAudioEncoder.*log-mel"):
        model(torch.randn(1, 8, 12), torch.randint(3, V, (1, 4)), src_cu_seqlens=_cu((12,)),
              tgt_cu_seqlens=_cu((4,)))


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_float16_clamps_that_read_the_whole_batch_refuse_packing(family: str) -> None:
    model = FAMILIES[family]().half().eval()
    srcs, tgts = _pairs()
    with pytest.raises(ValueError, match=r"packed input \(cu_seqlens\) is not taken in float16.*whole batch"):
        model(torch.cat(srcs)[None], torch.cat(tgts)[None], src_cu_seqlens=_cu(SRC_LENGTHS),
              tgt_cu_seqlens=_cu(TGT_LENGTHS))


@pytest.mark.parametrize("family", ["t5", "bart", "m2m_100"])
def test_the_family_encoders_pack_when_asked(family: str) -> None:
    encoder = _model(family).eval().encoder
    srcs, _ = _pairs()
    src, mask = _padded(srcs, PAD)
    with torch.no_grad():
        want = encoder.encode(src, mask, packed=False)
        got = encoder.encode(src, mask, packed=True)
        default = encoder.encode(src, mask)  # their float16-clamped layers pack only when asked
    assert encoder.packable and _rel(got, want) < 1e-10 and torch.equal(default, want)


def test_attention_dropout_in_training_runs_one_sequence_at_a_time() -> None:
    torch.manual_seed(0)
    model = build_bart(_hf({**_STACKS, "model_type": "plbart", "attention_dropout": 0.5}, "PLBART")).train()
    srcs, tgts = _pairs()
    loss = model.loss(torch.cat(srcs)[None], torch.cat(tgts)[None], src_cu_seqlens=_cu(SRC_LENGTHS),
                      labels_cu_seqlens=_cu(TGT_LENGTHS))
    loss.backward()
    assert torch.isfinite(loss) and model.decoder.blocks[0].cross_attn.kv_proj.weight.grad is not None
    with torch.no_grad():  # eval: no dropout, the fused path, equal to the padded batch (as above)
        packed, padded = _losses(model.eval())
    assert abs(packed.item() - padded.item()) <= 1e-5 * abs(padded.item())
