"""Positional encodings: RoPE's relative property and pairings, sinusoidal shift matrices, ALiBi slopes."""

from __future__ import annotations

import math

import pytest
import torch

import attnzoo as az
from attnzoo.nn.parts import AttentionParts, Scores
from attnzoo.nn.positional import interleaved_to_split_half, sinusoidal_table


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------- rotary
@pytest.mark.parametrize("kw", [{}, {"interleaved": True}, {"rotary_dim": 6}, {"scaling": "linear", "scaling_factor": 4.0},
                                {"scaling": "ntk", "scaling_factor": 8.0, "base": 500000.0}])
def test_rope_score_depends_only_on_offset(kw: dict) -> None:
    torch.manual_seed(0)
    rope = az.RotaryEmbedding(16, **kw)
    q = torch.randn(1, 1, 1, 16, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def score(m: int, n: int) -> torch.Tensor:
        rq = rope(q, torch.tensor([m]))
        rk = rope(k, torch.tensor([n]))
        return (rq * rk).sum()

    for m, n in [(3, 1), (10, 2), (7, 7), (0, 5)]:
        base = score(m, n)
        for shift in (1, 13, 1000, 123456):
            assert abs(score(m + shift, n + shift) - base) < 1e-9, (kw, m, n, shift)
    # and it does depend on the offset
    assert abs(score(5, 0) - score(6, 0)) > 1e-6


def test_rope_preserves_norm_and_passes_unrotated_channels() -> None:
    torch.manual_seed(1)
    rope = az.RotaryEmbedding(10, rotary_dim=4)
    x = torch.randn(2, 3, 5, 10, dtype=torch.float64)
    y = rope(x, offset=17)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))
    assert torch.equal(y[..., 4:], x[..., 4:])
    assert max_err(rope(x, torch.zeros(5, dtype=torch.long)), x) == 0.0  # position 0 is the identity


def test_split_half_and_interleaved_agree_after_permutation() -> None:
    torch.manual_seed(2)
    D = 8
    x = torch.randn(2, 3, 6, D, dtype=torch.float64)
    perm = interleaved_to_split_half(D)
    inter = az.RotaryEmbedding(D, interleaved=True)
    half = az.RotaryEmbedding(D)
    assert max_err(half(x[..., perm]), inter(x)[..., perm]) < 1e-12
    assert max_err(half(x), inter(x)) > 1e-3  # the conventions differ without the permutation


def test_split_half_and_interleaved_modules_agree_after_weight_permutation() -> None:
    """A checkpoint trained with interleaved RoPE runs in a split-half module once the q/k rows
    of each head are permuted."""
    torch.manual_seed(3)
    C, H, Hkv = 32, 4, 2
    D = C // H
    inter = az.MultiHeadAttention(C, H, num_kv_heads=Hkv, causal=True,
                                  rope=az.RotaryEmbedding(D, interleaved=True)).eval()
    half = az.MultiHeadAttention(C, H, num_kv_heads=Hkv, causal=True, rope=True).eval()
    perm = interleaved_to_split_half(D)
    wq, wk, wv = inter.qkv_weights()
    bq, bk, bv = inter.qkv_biases()

    def per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
        return t.reshape(heads, D, *t.shape[1:])[:, perm].reshape(heads * D, *t.shape[1:])

    half.load_qkv(per_head(wq, H), per_head(wk, Hkv), wv, per_head(bq, H), per_head(bk, Hkv), bv)
    half.out_proj.load_state_dict(inter.out_proj.state_dict())
    x = torch.randn(2, 9, C)
    with torch.no_grad():
        assert max_err(half(x), inter(x)) < 1e-5


def test_rope_offsets_and_per_row_positions() -> None:
    torch.manual_seed(4)
    rope = az.RotaryEmbedding(8)
    x = torch.randn(2, 2, 10, 8)
    full = rope(x)
    assert max_err(rope(x[:, :, 6:], offset=6), full[:, :, 6:]) < 1e-6
    pos = torch.stack([torch.arange(10), torch.arange(3, 13)])  # [B, N]
    rows = rope(x, pos)
    assert max_err(rows[0], full[0]) < 1e-6
    assert max_err(rows[1], rope(x[1:], offset=3)[0]) < 1e-6


def test_rope_scaling_definitions() -> None:
    pos = torch.arange(0, 4000, 37)
    plain = az.RotaryEmbedding(16)
    linear = az.RotaryEmbedding(16, scaling="linear", scaling_factor=4.0)
    assert max_err(linear.angles(pos, torch.float64), plain.angles(pos, torch.float64) / 4.0) < 1e-9
    ntk = az.RotaryEmbedding(16, scaling="ntk", scaling_factor=4.0)
    wider_base = az.RotaryEmbedding(16, base=10000.0 * 4.0 ** (16 / 14))
    assert max_err(ntk.angles(pos, torch.float64), wider_base.angles(pos, torch.float64)) < 1e-9


def test_rope_matches_hugging_face_llama() -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    torch.manual_seed(5)
    B, H, N, D = 2, 3, 7, 16
    q, k = torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    pos = torch.arange(N) + 5
    ours = az.RotaryEmbedding(D)
    cos, sin = ours.cos_sin(pos)  # [1, 1, N, D/2]
    cos_hf, sin_hf = torch.cat([cos, cos], -1)[0, 0], torch.cat([sin, sin], -1)[0, 0]  # HF's [N, D] layout
    q_hf, k_hf = llama.apply_rotary_pos_emb(q, k, cos_hf[None], sin_hf[None])
    assert max_err(ours(q, pos), q_hf) < 1e-5 and max_err(ours(k, pos), k_hf) < 1e-5


def test_rope_bad_input() -> None:
    with pytest.raises(ValueError, match="dim must be even, got 7"):
        az.RotaryEmbedding(7)
    with pytest.raises(ValueError, match="rotary_dim must be even, got 5"):
        az.RotaryEmbedding(8, rotary_dim=5)
    with pytest.raises(ValueError, match="rotary_dim must be <= dim = 8"):
        az.RotaryEmbedding(8, rotary_dim=10)
    with pytest.raises(ValueError, match="scaling"):
        az.RotaryEmbedding(8, scaling="yarn")
    rope = az.RotaryEmbedding(8)
    with pytest.raises(ValueError, match=r"\[B, H, N, D\] with D = 8"):
        rope(torch.randn(1, 2, 3, 6))
    with pytest.raises(TypeError, match="integer"):
        rope(torch.randn(1, 2, 3, 8), torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=">= 0"):
        rope(torch.randn(1, 2, 3, 8), torch.tensor([-1, 0, 1]))


# ----------------------------------------------------------------------------- sinusoidal
def test_sinusoidal_shift_is_a_position_independent_linear_map() -> None:
    """PE(p + d) = A_d PE(p): fit A_d on some positions, check it on others."""
    C, d = 16, 5
    pe = sinusoidal_table(20000, C)  # float64 [20000, C]
    # Fit on positions spread widely enough that the slowest frequencies are well conditioned.
    fit_p = torch.arange(0, 19000, 97)
    A = torch.linalg.lstsq(pe[fit_p], pe[fit_p + d]).solution.T  # PE(p + d) = A PE(p)
    test_p = torch.arange(3, 19000, 113)
    assert max_err(pe[test_p] @ A.T, pe[test_p + d]) < 1e-9
    # A_d is block-diagonal 2x2 rotations by d * w_i
    w = torch.exp(-math.log(10000.0) * torch.arange(0, C, 2, dtype=torch.float64) / C)
    c, s = torch.cos(d * w), torch.sin(d * w)
    blocks = torch.zeros(C, C, dtype=torch.float64)
    for i in range(C // 2):
        blocks[2 * i: 2 * i + 2, 2 * i: 2 * i + 2] = torch.stack([torch.stack([c[i], s[i]]), torch.stack([-s[i], c[i]])])
    assert max_err(pe[test_p] @ blocks.T, pe[test_p + d]) < 1e-10


def test_sinusoidal_module_and_odd_width() -> None:
    torch.manual_seed(6)
    enc = az.SinusoidalPositionalEncoding(16, max_len=64)
    x = torch.randn(2, 10, 16)
    assert max_err(enc(x), x + sinusoidal_table(10, 16).float()) < 1e-6
    assert max_err(enc(x[:, 4:], offset=4), enc(x)[:, 4:]) == 0.0
    odd = az.SinusoidalPositionalEncoding(15, max_len=64)
    assert odd.pe.shape == (64, 15)
    assert max_err(odd.pe, az.SinusoidalPositionalEncoding(16, max_len=64).pe[:, :15]) == 0.0
    pos = torch.tensor([[0, 1, 2], [5, 6, 7]])
    assert max_err(enc.encoding(pos)[1], enc.pe[5:8]) == 0.0


def test_learned_embedding() -> None:
    torch.manual_seed(7)
    emb = az.LearnedPositionalEmbedding(12, max_len=20)
    assert emb.weight.shape == (20, 12)
    x = torch.randn(3, 5, 12)
    assert max_err(emb(x), x + emb.weight[:5]) == 0.0
    assert max_err(emb(x, offset=15), x + emb.weight[15:20]) == 0.0
    y = emb(x)
    y.sum().backward()
    assert emb.weight.grad is not None and emb.weight.grad[:5].abs().sum() > 0 and emb.weight.grad[5:].abs().sum() == 0


def test_absolute_tables_reject_positions_beyond_the_table() -> None:
    for enc in (az.SinusoidalPositionalEncoding(8, max_len=16), az.LearnedPositionalEmbedding(8, max_len=16)):
        with pytest.raises(ValueError, match=r"position 19 is beyond the table.*max_len=16"):
            enc(torch.randn(1, 4, 8), offset=16)
        with pytest.raises(ValueError, match="position 16 is beyond"):
            enc.encoding(torch.tensor([3, 16]))
        with pytest.raises(ValueError, match="C = 8"):
            enc(torch.randn(1, 4, 6))
        with pytest.raises(ValueError, match=r"\[N\] or \[B, N\] with N = 4"):
            enc(torch.randn(1, 4, 8), positions=torch.arange(3))
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        az.LearnedPositionalEmbedding(8, max_len=0)


# ----------------------------------------------------------------------------- alibi
def test_alibi_slopes_power_of_two_is_the_geometric_sequence() -> None:
    for n in (1, 2, 4, 8, 16):
        s = az.alibi_slopes(n, dtype=torch.float64)
        expected = torch.tensor([2.0 ** (-8.0 * (i + 1) / n) for i in range(n)], dtype=torch.float64)
        assert max_err(s, expected) < 1e-15


def test_alibi_slopes_non_power_of_two() -> None:
    for n in (3, 5, 6, 12, 20):
        s = az.alibi_slopes(n, dtype=torch.float64)
        p = 2 ** int(math.log2(n))
        assert s.shape == (n,)
        assert max_err(s[:p], az.alibi_slopes(p, dtype=torch.float64)) == 0.0
        # the rest: the odd-indexed (1st, 3rd, ...) slopes of the 2p-head sequence
        assert max_err(s[p:], az.alibi_slopes(2 * p, dtype=torch.float64)[0::2][: n - p]) == 0.0
        assert len(set(s.tolist())) == n and bool((s > 0).all() and (s < 1).all())
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        az.alibi_slopes(0)


def test_alibi_module_matches_explicit_bias() -> None:
    torch.manual_seed(8)
    m = az.MultiHeadAttention(36, 6, causal=True, backend="reference", parts=AttentionParts(scores=Scores(alibi=True))).eval()
    plain = az.MultiHeadAttention(36, 6, causal=True, backend="reference").eval()
    plain.load_state_dict(m.state_dict())
    x = torch.randn(2, 7, 36)
    i = torch.arange(7)
    bias = -az.alibi_slopes(6).view(1, 6, 1, 1) * (i.view(-1, 1) - i.view(1, -1)).abs().float()
    with torch.no_grad():
        assert max_err(m(x), plain(x, mask=bias)) < 1e-5
