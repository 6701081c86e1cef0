"""Multi-head latent attention (DeepSeek-V2/V3): float64 reference from the paper's equations,
absorbed decoding == materialised full forward, the latent cache's size, gradients, costs, errors
and the all-dense DeepSeek-V3 conversion from transformers."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import attnzoo as az
from attnzoo.cost import estimate
from attnzoo.models import DecoderConfig, DecoderLM
from attnzoo.nn.mla import LatentCache, MLAOptions, MultiHeadLatentAttention, mla_flops, mla_sizes
from attnzoo.variants import build_attention, kv_cache_bytes_per_token

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
SIZES = {"kv_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 6, "v_head_dim": 10}


def _module(q_lora: int | None = 12, dtype: torch.dtype = torch.float32, **kw: object) -> MultiHeadLatentAttention:
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(48, 4, **SIZES, q_lora_rank=q_lora, **kw).to(dtype).eval()  # type: ignore[arg-type]
    with torch.no_grad():  # non-trivial norm weights and biases
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return m


# ----------------------------------------------------------------------------- reference
def _rms(t: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(t: torch.Tensor, base: float, interleaved: bool) -> torch.Tensor:
    """``t [B, N, ..., dr]`` rotated by position ``n`` (pairs adjacent or split in halves)."""
    dr, N = t.shape[-1], t.shape[1]
    ang = torch.arange(N, dtype=F64)[:, None] * base ** (-torch.arange(0, dr, 2, dtype=F64) / dr)  # [N, dr/2]
    ang = ang.view(1, N, *([1] * (t.dim() - 3)), dr // 2)
    c, s = ang.cos(), ang.sin()
    if interleaved:
        a, b = t[..., 0::2], t[..., 1::2]
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    a, b = t[..., : dr // 2], t[..., dr // 2:]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)


def mla_reference(m: MultiHeadLatentAttention, x: torch.Tensor, base: float = 10000.0,
                  interleaved: bool = False) -> torch.Tensor:
    """DeepSeek-V2 eqs. (9)-(19) in float64: latent, up-projections, decoupled RoPE, causal softmax."""
    p = {k: v.detach().double() for k, v in m.state_dict().items()}
    s, H, eps = m.sizes, m.num_heads, m.options.norm_eps
    x = x.double()
    B, N, _ = x.shape
    if s.q_lora_rank is None:
        q = x @ p["q_proj.weight"].T
    else:
        cq = _rms(x @ p["q_a_proj.weight"].T + p.get("q_a_proj.bias", 0), p["q_a_norm.weight"], eps)
        q = cq @ p["q_b_proj.weight"].T
    q_c, q_r = q.view(B, N, H, -1).split((s.qk_nope_head_dim, s.qk_rope_head_dim), dim=-1)
    c, k_r = (x @ p["kv_a_proj.weight"].T + p.get("kv_a_proj.bias", 0)).split(
        (s.kv_lora_rank, s.qk_rope_head_dim), dim=-1)
    c = _rms(c, p["kv_a_norm.weight"], eps)
    k_c, v = (c @ p["kv_b_proj.weight"].T).view(B, N, H, -1).split((s.qk_nope_head_dim, s.v_head_dim), dim=-1)
    q_r, k_r = _rope(q_r, base, interleaved), _rope(k_r, base, interleaved)
    scores = torch.einsum("bnhd,bmhd->bhnm", q_c, k_c) + torch.einsum("bnhd,bmd->bhnm", q_r, k_r)
    scores = scores / math.sqrt(s.qk_head_dim)
    scores = scores.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhnm,bmhd->bnhd", scores.softmax(-1), v).reshape(B, N, -1)
    return o @ p["out_proj.weight"].T + p.get("out_proj.bias", 0)


@pytest.mark.parametrize("q_lora", [None, 12])
@pytest.mark.parametrize("interleaved", [False, True])
def test_forward_equals_float64_reference(q_lora: int | None, interleaved: bool) -> None:
    m = _module(q_lora, bias=True, options=MLAOptions(rope_interleave=interleaved))
    x = torch.randn(2, 11, 48)
    ref = mla_reference(m, x, interleaved=interleaved)
    for form in ("materialised", "absorbed"):
        m.form = form
        err = (m(x).double() - ref).abs().max().item()
        assert err < 1e-5, f"{form}, q_lora={q_lora}, interleaved={interleaved}: max err {err:.2e}"
    m64 = _module(q_lora, F64, bias=True, options=MLAOptions(rope_interleave=interleaved))
    assert (m64(x.double()) - mla_reference(m64, x, interleaved=interleaved)).abs().max().item() < 1e-12


# ----------------------------------------------------------------------------- decoding
def _decode(m: MultiHeadLatentAttention, x: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    cache = m.init_cache(x.shape[0], x.shape[1])
    outs, s = [], 0
    for n in chunks:
        outs.append(m(x[:, s:s + n], cache=cache))
        s += n
    assert cache.length == x.shape[1]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (F64, 1e-12)])
def test_absorbed_decoding_equals_materialised_full_forward(dtype: torch.dtype, tol: float) -> None:
    m = _module(dtype=dtype, bias=True)
    x = torch.randn(2, 17, 48, dtype=dtype)
    m.form = "materialised"
    full = m(x)
    m.form = "absorbed"
    for chunks in ([1] * 17, [5, 1, 1, 4, 6]):
        err = (_decode(m, x, chunks) - full).abs().max().item()
        assert err <= tol, f"{dtype} chunks={chunks}: absorbed decode vs materialised full, max err {err:.2e}"
    m.form = "auto"
    err = (_decode(m, x, [6] + [1] * 11) - full).abs().max().item()
    assert err <= tol, f"{dtype} auto: max err {err:.2e}"


def test_auto_prefills_materialised_and_decodes_absorbed(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module()
    calls: list[str] = []
    for form in ("_absorbed", "_materialised"):
        orig = getattr(m, form)
        monkeypatch.setattr(m, form, lambda *a, _o=orig, _f=form, **k: (calls.append(_f), _o(*a, **k))[1])
    x = torch.randn(1, 8, 48)
    m(x)
    cache = m.init_cache(1, 8)
    m(x[:, :6], cache=cache)
    m(x[:, 6:7], cache=cache)
    m(x[:, 7:8], cache=cache)
    assert calls == ["_materialised", "_materialised", "_absorbed", "_absorbed"], calls
    s = mla_sizes(128)
    assert mla_flops(s, 128, 1, 4096, "absorbed") < mla_flops(s, 128, 1, 4096, "materialised") / 2


def test_positions_and_padding_mask_match_the_full_forward() -> None:
    m = _module()
    x = torch.randn(2, 9, 48)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, :3] = False  # left padding of row 1
    mask = keep[:, None, None, :]
    full = m(x, mask=mask)
    m.form = "absorbed"
    cache = m.init_cache(2, 9)
    outs = [m(x[:, :4], cache=cache, mask=mask[..., :4])]
    outs += [m(x[:, i:i + 1], cache=cache, mask=mask[..., : i + 1]) for i in range(4, 9)]
    assert (torch.cat(outs, 1) - full)[keep].abs().max().item() < 1e-5


def test_weights_and_mask_objects_agree_across_forms() -> None:
    m = _module()
    x = torch.randn(2, 9, 48)
    pad = az.masks.key_padding(torch.tensor([9, 6]))
    res = {}
    for form in ("materialised", "absorbed"):
        m.form = form
        cache = m.init_cache(2, 9)
        first = m(x[:, :5], cache=cache, mask=pad, return_weights=True)
        rest = [m(x[:, i:i + 1], cache=cache, mask=pad, return_weights=True) for i in range(5, 9)]
        res[form] = (torch.cat([first[0]] + [r[0] for r in rest], 1), first[1], rest[-1][1])
    for a, b in zip(res["materialised"], res["absorbed"], strict=True):
        assert a.shape == b.shape and (a - b).abs().max().item() < 1e-5
    assert res["absorbed"][2][1, :, :, 6:].abs().max().item() == 0.0  # padded keys get no weight


def test_left_padded_generation_matches_unpadded() -> None:
    model = DecoderLM(config=DecoderConfig(50, 48, 2, 4, attention="mla", norm="rms", ffn="swiglu",
                                           attention_kwargs=SIZES)).eval()
    prompt = torch.randint(2, 50, (1, 5))
    alone = model.generate(prompt, max_new_tokens=6)
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), prompt), 1)
    both = model.generate(torch.cat((padded, torch.randint(2, 50, (1, 8)))),
                          attention_mask=torch.tensor([[False] * 3 + [True] * 5, [True] * 8]), max_new_tokens=6)
    assert torch.equal(both[0, 3:], alone[0])


def test_packed_sequences_equal_each_alone_forward_and_backward() -> None:
    m = _module(dtype=F64, bias=True)
    x = torch.randn(1, 13, 48, dtype=F64, requires_grad=True)
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    packed = m(x, cu_seqlens=cu)
    alone = torch.cat([m(x[:, a:b]) for a, b in ((0, 5), (5, 6), (6, 13))], dim=1)
    assert (packed - alone).abs().max().item() < 1e-12
    g1 = torch.autograd.grad(packed.sum(), x)[0]
    g2 = torch.autograd.grad(alone.sum(), x)[0]
    assert (g1 - g2).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="cache"):
        m(x, cu_seqlens=cu, cache=m.init_cache(1, 13))
    with pytest.raises(ValueError, match="end"):
        m(x, cu_seqlens=torch.tensor([0, 5, 12], dtype=torch.int32))


# ----------------------------------------------------------------------------- the cache
def test_cache_holds_only_the_latent_and_the_rope_key() -> None:
    m = _module()
    cache = m.init_cache(3, 20, dtype=torch.bfloat16)
    assert isinstance(cache, LatentCache)
    r_dr = SIZES["kv_lora_rank"] + SIZES["qk_rope_head_dim"]
    assert tuple(cache.latent.shape) == (3, 20, r_dr)
    assert cache.bytes_per_token() == 3 * r_dr * 2 and cache.nbytes == 3 * 20 * r_dr * 2  # [B, max_len, r + dr]
    # DeepSeek-V3: 512 + 64 = 576 numbers per token and layer, against 2 * 128 * 128 for MHA
    assert kv_cache_bytes_per_token("mla", 7168, 128, dtype_bytes=2, head_dim=128) == 576 * 2
    assert kv_cache_bytes_per_token("mha", 16384, 128, dtype_bytes=2) == 2 * 128 * 128 * 2
    v3 = MultiHeadLatentAttention(64, 2, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                  v_head_dim=128, q_lora_rank=96)
    assert v3.init_cache(1, 4).latent.shape[-1] == 576


def test_a_failed_call_leaves_the_cache_unchanged() -> None:
    m = _module()
    x = torch.randn(1, 5, 48)
    cache = m.init_cache(1, 5)
    m(x[:, :3], cache=cache)
    before = cache.latent.clone()
    with pytest.raises(ValueError, match="broadcast"):
        m(x[:, 3:4], cache=cache, mask=torch.ones(1, 1, 1, 9, dtype=torch.bool))
    assert cache.length == 3 and torch.equal(cache.latent, before)
    with pytest.raises(ValueError, match="overflow"):
        m(x[:, :3], cache=cache)
    assert cache.length == 3


# ----------------------------------------------------------------------------- gradients
def test_backward_of_both_forms_agrees_in_float64() -> None:
    m = _module(dtype=F64, bias=True)
    x = torch.randn(2, 7, 48, dtype=F64)
    grads = []
    for form in ("materialised", "absorbed"):
        m.zero_grad()
        m.form = form
        xg = x.clone().requires_grad_(True)
        (m(xg) * torch.linspace(-1, 1, 48, dtype=F64)).sum().backward()
        grads.append([xg.grad] + [p.grad for p in m.parameters()])
    assert all(g is not None for g in grads[0]), "every parameter gets a gradient"
    for a, b in zip(*grads, strict=True):
        assert (a - b).abs().max().item() < 1e-10


def test_gradcheck_tiny() -> None:
    torch.manual_seed(1)
    m = MultiHeadLatentAttention(8, 2, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3,
                                 q_lora_rank=3, bias=True).double()
    x = torch.randn(1, 4, 8, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: m(t), (x,))


# ----------------------------------------------------------------------------- rope scaling
def test_yarn_scale_and_frequencies_follow_deepseek() -> None:
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    m = MultiHeadLatentAttention(64, 2, kv_lora_rank=16, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                 v_head_dim=128, options=MLAOptions(rope_scaling=yarn))
    mscale = 0.1 * math.log(40.0) + 1.0
    assert m.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2)
    with pytest.raises(ValueError, match="dynamic"):
        MultiHeadLatentAttention(64, 2, **SIZES,
                                 options=MLAOptions(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))


# ----------------------------------------------------------------------------- costs
def test_cost_flops_match_flop_counter() -> None:
    dim, heads, n = 64, 4, 12
    m = build_attention("mla", dim, heads, backend="reference").eval()
    est = estimate("mla", n, dim, heads, backend="reference")
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        m(torch.randn(1, n, dim))
    assert est.flops == fc.get_total_flops(), (est.flops, fc.get_total_flops())
    assert est.kv_cache_bytes_per_token == (4 * 16 + 8) * 4


# ----------------------------------------------------------------------------- errors
def test_bad_input_errors() -> None:
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        MultiHeadLatentAttention(48, 4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=5, v_head_dim=8)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MultiHeadLatentAttention(48, 4, kv_lora_rank=0, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    with pytest.raises(TypeError, match="q_lora_rank"):
        MultiHeadLatentAttention(48, 4, **SIZES, q_lora_rank=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword"):
        MultiHeadLatentAttention(48, 4, **SIZES, window=3)
    with pytest.raises(ValueError, match="form"):
        MultiHeadLatentAttention(48, 4, **SIZES, options=MLAOptions(form="fast"))
    with pytest.raises(ValueError, match="form"):
        build_attention("mla", 48, 4, form="fast")
    with pytest.raises(TypeError, match="options"):
        MultiHeadLatentAttention(48, 4, **SIZES, options={"form": "auto"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword"):
        MultiHeadLatentAttention(48, 4, **SIZES, form="auto")
    m = _module()
    with pytest.raises(ValueError, match="form"):
        m.form = "fused"
    with pytest.raises(ValueError, match=r"\[B, N, C\]"):
        m(torch.randn(2, 5, 47))
    with pytest.raises(ValueError, match="context"):
        m(torch.randn(2, 5, 48), torch.randn(2, 5, 48))
    with pytest.raises(TypeError, match="LatentCache"):
        m(torch.randn(1, 1, 48), cache=az.nn.KVCache(1, 4, 4, 14))
    with pytest.raises(ValueError, match="causal"):
        bi = MultiHeadLatentAttention(48, 4, **SIZES, causal=False)
        bi(torch.randn(1, 1, 48), cache=bi.init_cache(1, 4))
    with pytest.raises(TypeError, match="q/k/v"):
        m.qkv_weights()
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_attention("mla", 48, 4, num_kv_heads=2)


def test_decoder_lm_with_mla_decodes_like_its_full_forward() -> None:
    model = DecoderLM(config=DecoderConfig(50, 48, 2, 4, attention="mla", norm="rms", ffn="swiglu",
                                           attention_kwargs={**SIZES, "q_lora_rank": 12})).eval()
    toks = torch.randint(0, 50, (2, 10))
    full = model(toks)
    cache = model.init_cache(2, 10)
    out = torch.cat([model(toks[:, :4], cache=cache)] + [model(toks[:, i:i + 1], cache=cache) for i in range(4, 10)],
                    dim=1)
    assert (out - full).abs().max().item() < 1e-5


# ----------------------------------------------------------------------------- transformers
def _hf_model(q_lora: int | None, **extra: object):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    kw = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": q_lora,
          "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12, "first_k_dense_replace": 2,
          "max_position_embeddings": 128, "n_routed_experts": 4, "moe_intermediate_size": 16,
          "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "eos_token_id": None, "bos_token_id": None}
    cfg = transformers.DeepseekV3Config(**{**kw, **extra})
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(cfg).eval()


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}


@pytest.mark.parametrize("q_lora,extra", [(24, {}), (None, {"rope_parameters": YARN}),
                                          (24, {"rope_interleave": False, "attention_bias": True})],
                         ids=["q_lora", "yarn", "split_half_bias"])
def test_deepseek_v3_dense_converts_with_equal_logits_and_generation(q_lora: int | None, extra: dict) -> None:
    from attnzoo.interop import from_hf

    hf = _hf_model(q_lora, **extra)
    ours = from_hf(hf).eval()
    assert all(type(b.attn) is MultiHeadLatentAttention for b in ours.blocks)
    toks = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        a, b = hf(toks).logits, ours(toks)
    rel = ((a - b).abs().max() / a.abs().max()).item()
    assert rel <= 1e-4, f"logits relative error {rel:.2e}"
    prompt = toks[:, :6]
    g_hf = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                       pad_token_id=0)
    assert torch.equal(ours.generate(prompt, max_new_tokens=10), g_hf)


def test_deepseek_v3_folder_loads_and_moe_converts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from attnzoo.interop import from_hf, load_pretrained

    hf = _hf_model(24)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    toks = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        assert (hf(toks).logits - ours(toks)).abs().max().item() <= 1e-4 * hf(toks).logits.abs().max().item()
    moe = _hf_model(24, first_k_dense_replace=1)  # MoE layers convert (tests/models/test_hf_deepseek.py)
    with torch.no_grad():
        ref = moe(toks).logits
        assert (ref - from_hf(moe)(toks)).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_docs_example_runs() -> None:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "softmax-frontier.md").read_text()
    section = text[text.index("## Multi-head latent attention"):]
    code = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    exec(compile(code, "softmax-frontier.md[mla]", "exec"), {"__name__": "__doc_example__"})


def test_cli_list_reports_the_latent_cache(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from attnzoo.cli import main

    assert main(["list", "--json", "--dim", "1024", "--heads", "8", "--dtype", "float16"]) == 0
    rows = {v["name"]: v for v in json.loads(capsys.readouterr().out)["variants"]}
    assert rows["mla"]["kv_cache_bytes_per_token"] == 576 * 2  # head width 128: DeepSeek-V3's r + dr
    assert rows["mha"]["kv_cache_bytes_per_token"] == 2 * 8 * 128 * 2


def test_nope_latent_attention_decodes_like_its_full_forward() -> None:
    """``qk_rope_head_dim=0`` with ``rope=False`` (Mistral-Large-4's NoPE layers): keys of the latent
    alone, a cache of ``r`` numbers per token; both forms agree. With a RoPE it is refused by name."""
    torch.manual_seed(0)
    sizes = dict(kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=0, v_head_dim=8)
    with pytest.raises(ValueError, match="qk_rope_head_dim=0"):
        MultiHeadLatentAttention(48, 4, **sizes)
    m = MultiHeadLatentAttention(48, 4, rope=False, **sizes).double()
    x = torch.randn(2, 9, 48, dtype=torch.float64)
    m.form = "materialised"
    full = m(x)
    m.form = "absorbed"
    assert (_decode(m, x, [4, 1, 1, 3]) - full).abs().max().item() <= 1e-12
    assert m.init_cache(2, 9).latent.shape[-1] == 16
