"""Whisper (``families/whisper.py``) against transformers' eager ``WhisperForConditionalGeneration`` and
``WhisperModel``: the shared seq2seq checks on random log-mel features (logits, decoder hidden states,
encoder states, cached decoding, greedy generation, saved folders, ``to_hf``, half precision) for
every option that changes the math, greedy generation from Whisper's multi-token decoder prompt,
the encoder's position table, the float16 clamp, the key projection without a bias, the
attnzoo kernel hook, argument checks and refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnzoo.interop import UnsupportedConfigError, from_hf  # noqa: E402
from attnzoo.models.families._seq2seq import PartlyBiasedLinear, split_sinusoids  # noqa: E402
from attnzoo.models.families.whisper import (  # noqa: E402
    WhisperAudioEncoder,
    build_whisper,
    convert_whisper,
)
from attnzoo.models.hf._state import HFConfig  # noqa: E402
from hf_family_checks import V, rel  # noqa: E402
from hf_seq2seq_checks import EOS, PAD, Seq2SeqChecks, hf_seq2seq  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

#: the decoder start token of the configs (real checkpoints: 50257, ``<|startoftranscript|>``)
START = 5
MELS, SOURCE = 8, 6  # features [B, 8, 12] -> 6 encoder positions


def _cfg(**kw: Any) -> Any:
    base = {"vocab_size": V, "num_mel_bins": MELS, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
            "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 48, "decoder_ffn_dim": 40,
            "max_source_positions": SOURCE, "max_target_positions": 20, "pad_token_id": PAD, "eos_token_id": EOS,
            "bos_token_id": 0, "decoder_start_token_id": START, "begin_suppress_tokens": None}
    return T.WhisperConfig(**{**base, **kw})


def features(batch: int = 3, seed: int = 1, cfg: Any = None) -> torch.Tensor:
    """Random log-mel features ``[batch, num_mel_bins, 2 * max_source_positions]``."""
    mels, frames = (MELS, 2 * SOURCE) if cfg is None else (cfg.num_mel_bins, 2 * cfg.max_source_positions)
    return torch.randn(batch, mels, frames, generator=torch.Generator().manual_seed(seed))


#: one transformers model per ``model_type``, for the ``to_hf`` export sweep
SWEEP = {"whisper": lambda seed: hf_seq2seq(_cfg(), T.WhisperForConditionalGeneration, seed)}


class TestWhisper(Seq2SeqChecks):
    config = staticmethod(_cfg)
    model = T.WhisperForConditionalGeneration
    kernel_calls = 2 + 2 * 2  # the encoder's layers, the decoder's self- and cross-attention
    base = T.WhisperModel
    cases = (
        # whisper-large-v3-turbo / distil-whisper: fewer decoder layers; heads differ per stack; relu
        lambda: _cfg(encoder_layers=3, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=8,
                     activation_function="relu"),
        # an untied proj_out; scale_embedding (read, never applied by transformers); gelu_new; large-v3's mels
        lambda: _cfg(tie_word_embeddings=False, scale_embedding=True, activation_function="gelu_new",
                     num_mel_bins=MELS, max_source_positions=4),
    )
    drop = ("activation_function", "tie_word_embeddings", "scale_embedding", "dropout", "attention_dropout",
            "activation_dropout")
    start = START

    def source(self, hf: Any) -> tuple[torch.Tensor, None]:
        return features(cfg=None if hf is None else hf.config), None

    def hf_inputs(self, hf: Any, src: torch.Tensor, src_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return {"input_features": src}


def test_generate_from_a_decoder_prompt_equals_greedy_transformers() -> None:
    """Whisper's task prompt (start, language, task): ``generate(decoder_prompt=[B, 3])`` equals
    greedy decoding with transformers' forward from the same three tokens (seed 1: a model whose
    greedy tokens change along the rows, not one token repeated)."""
    hf = SWEEP["whisper"](1)
    ours = from_hf(hf)
    x = features()
    prompt = torch.tensor([[START, 7, 9], [START, 8, 9], [START, 7, 10]])
    new = 6
    with torch.no_grad():
        got = ours.generate(x, new, decoder_prompt=prompt, eos_token_id=EOS)
        ys = prompt
        for _ in range(new):
            nxt = hf(input_features=x, decoder_input_ids=ys).logits[:, -1].argmax(-1, keepdim=True)
            ys = torch.cat([ys, nxt], 1)
    assert torch.equal(got[:, :3], prompt)
    for row, want in zip(got.tolist(), ys.tolist(), strict=True):
        end = want.index(EOS, 3) + 1 if EOS in want[3:] else len(want)
        assert row[:end] == want[:end], (row, want)


def test_generate_starts_from_the_configs_decoder_start_token() -> None:
    ours = from_hf(SWEEP["whisper"](0))
    assert (ours.decoder_start_token_id, ours.eos_token_id) == (START, EOS)
    assert ours.generate(features(), 2)[:, 0].tolist() == [START] * 3


def test_encoder_positions_are_the_checkpoints_table() -> None:
    """transformers' initial table is Whisper's sinusoids (sin | cos halves); the converted model
    holds the checkpoint's table (here perturbed) as a fixed buffer; a file without it gets the sinusoids."""
    from transformers.models.whisper.modeling_whisper import sinusoids

    assert torch.equal(split_sinusoids(1500, 384), sinusoids(1500, 384))
    fresh = T.WhisperForConditionalGeneration._from_config(_cfg(), attn_implementation="eager")
    assert torch.equal(fresh.model.encoder.embed_positions.weight, split_sinusoids(SOURCE, 32))
    hf = SWEEP["whisper"](0)
    ours = from_hf(hf)
    table = hf.model.encoder.embed_positions.weight
    assert "encoder.embed_positions" in dict(ours.named_buffers())
    assert torch.equal(ours.encoder.embed_positions, table) and not torch.equal(table, split_sinusoids(SOURCE, 32))
    sd = {k: v for k, v in hf.state_dict().items() if k != "model.encoder.embed_positions.weight"}
    again = convert_whisper(HFConfig(hf.config.to_dict(), "test", "Whisper"), sd, device=None, dtype=None)
    assert torch.equal(again.encoder.embed_positions, split_sinusoids(SOURCE, 32))


def test_max_target_positions_bounds_the_decoder() -> None:
    ours = from_hf(SWEEP["whisper"](0))
    assert ours.decoder.max_seq_len == 20
    with pytest.raises(ValueError, match="max_seq_len"):
        ours(features(), torch.full((3, 21), 3))


def test_float16_encoder_overflow_is_clamped_as_transformers() -> None:
    hf = SWEEP["whisper"](0)
    with torch.no_grad():  # the first encoder layer's feed-forward overflows float16
        hf.model.encoder.layers[0].fc1.weight.mul_(100.0)
        hf.model.encoder.layers[0].fc2.weight.mul_(300.0)
        hf.model.encoder.layers[0].fc2.bias.fill_(6e4)
    ours = from_hf(hf, dtype=torch.float16)
    hf = hf.half()
    x = features().half()
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(out[0] if isinstance(out, tuple) else out))
             for m in (hf.model.encoder.layers[0], ours.encoder.blocks[0])]
    with torch.no_grad():
        want = hf.get_encoder()(input_features=x).last_hidden_state
        got = ours.encode(x)
    for h in hooks:
        h.remove()
    limit = torch.tensor(torch.finfo(torch.float16).max - 1000.0).half()  # 64504 rounds to 64512
    assert [float(t.abs().max()) for t in seen] == [float(limit)] * 2  # clamped inside the first layer
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    assert rel(got.float(), want.float()) <= 2e-2


def test_the_key_projection_has_no_bias_parameter() -> None:
    """``k_proj`` has no bias: attnzoo's fused projections hold the query and value biases only (the
    key rows' zeros are no parameter: training cannot move them; the fine-tuning check writes back)."""
    ours = from_hf(SWEEP["whisper"](1))
    attn, cross = ours.decoder.blocks[0].attn, ours.decoder.blocks[0].cross_attn
    assert not attn.qkv_proj.bias[32:64].any() and attn.qkv_proj.bias[:32].any()
    assert not cross.kv_proj.bias[:32].any() and cross.kv_proj.bias[32:].any()
    assert tuple(attn.qkv_proj.bias_kept.shape) == (64,) and tuple(cross.kv_proj.bias_kept.shape) == (32,)
    with pytest.raises(ValueError, match="unbiased must be rows"):
        PartlyBiasedLinear(4, 6, unbiased=(4, 8))


def test_features_and_mask_are_checked() -> None:
    ours = from_hf(SWEEP["whisper"](0))
    with pytest.raises(ValueError, match=r"\[B, num_mel_bins, 2\*max_source_positions\] = \[B, 8, 12\]"):
        ours.encode(torch.randn(2, MELS, 10))
    with pytest.raises(ValueError, match="shape"):
        ours.encode(torch.randn(2, MELS + 1, 12))
    with pytest.raises(TypeError, match="float"):
        ours.encode(torch.zeros(2, MELS, 12, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask must be None"):
        ours.encode(features(), torch.ones(3, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match="divisible"):
        WhisperAudioEncoder(8, 32, 3, 1, 48, 6)


def _hf(**kw: Any) -> HFConfig:
    return HFConfig({**_cfg().to_dict(), **kw}, "test", "Whisper")


@pytest.mark.parametrize(("cls", "named"), [(T.WhisperForAudioClassification, "WhisperForAudioClassification"),
                                            (T.WhisperForCausalLM, "WhisperForCausalLM")])
def test_other_whisper_classes_are_refused_by_name(cls: Any, named: str) -> None:
    hf = cls._from_config(_cfg(), attn_implementation="eager")
    with pytest.raises(UnsupportedConfigError, match=named):
        from_hf(hf)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("activation_function", "tanh", "activation_function"),
    ("decoder_attention_heads", 5, "decoder_attention_heads"),
    ("encoder_attention_heads", 3, "encoder_attention_heads"),
])
def test_unsupported_options_are_refused_by_name(key: str, value: Any, named: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=named):
        build_whisper(_hf(**{key: value}), device="meta")
