"""``attnzoo.hf.register()`` serves the Mamba-2 SSD hooks of transformers' Mamba-2 models
(``mamba2_chunk_scan`` = mamba_ssm's ``mamba_chunk_scan_combined``, ``mamba2_selective_state_update``,
and the causal conv hooks): each equals transformers' own PyTorch fallback, model logits and greedy
generation (cached decode) are unchanged, and packed input (``seq_idx`` / ``cu_seq_lens_q``), which
the fallback silently runs as one sequence, gives each sequence's outputs alone."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import pytest
import torch

T = pytest.importorskip("transformers")

import attnzoo.hf as azhf  # noqa: E402
import hf_family_checks as checks  # noqa: E402
from attnzoo import hf_kernels  # noqa: E402

azhf.register()
SSM = dict(hidden_size=64, vocab_size=checks.V, num_hidden_layers=2, state_size=8, expand=2, num_heads=8,
           head_dim=16, n_groups=2, conv_kernel=4, chunk_size=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "mamba2": lambda: T.Mamba2Config(**SSM),
    "bamba": lambda: T.BambaConfig(hidden_size=64, intermediate_size=96, vocab_size=checks.V, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16,
                                   mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8, attn_layer_indices=[1],
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2),
}


def _original(family: str, fn: str) -> Any:
    return hf_kernels.ORIGINALS[(family, fn)]


def _scan_inputs(N: int = 37, H: int = 4, G: int = 2, P: int = 6, Ns: int = 5,
                 dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    return {"hidden_states": r(2, N, H, P), "dt": r(2, N, H), "A": -r(H).abs() - 0.1, "B": r(2, N, G, Ns),
            "C": r(2, N, G, Ns), "chunk_size": 8, "D": r(H), "dt_bias": r(H) * 0.1, "dt_softplus": True,
            "initial_states": r(2, H, P, Ns), "dt_limit": (0.0, 3.0)}


@pytest.mark.parametrize("final", [False, True])
def test_chunk_scan_equals_the_fallback(final: bool) -> None:
    inputs = _scan_inputs()
    ours = hf_kernels.ssd_chunk_scan(**inputs, return_final_states=final)
    ref = _original("mamba2", "mamba2_chunk_scan")(**inputs, return_final_states=final)
    for a, b in zip(ours if final else [ours], ref if final else [ref], strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert checks.rel(a, b) <= 1e-5, f"SSD scan vs transformers' fallback: {checks.rel(a, b):.2e}"


def test_chunk_scan_float64_matches_a_token_loop() -> None:
    """Against the recurrence written token by token (float64), not against either chunked form."""
    inputs = _scan_inputs(N=11, dtype=torch.float64)
    y, last = hf_kernels.ssd_chunk_scan(**inputs, return_final_states=True)
    x, A, B, C, D = (inputs[k] for k in ("hidden_states", "A", "B", "C", "D"))
    dt = torch.nn.functional.softplus(inputs["dt"] + inputs["dt_bias"]).clamp(0.0, 3.0)
    rep = x.shape[2] // B.shape[2]
    S = inputs["initial_states"].clone()  # [B, H, P, Ns]
    for t in range(x.shape[1]):
        Bt, Ct = B[:, t].repeat_interleave(rep, 1), C[:, t].repeat_interleave(rep, 1)  # [B, H, Ns]
        S = torch.exp(dt[:, t, :, None, None] * A[:, None, None]) * S \
            + (dt[:, t, :, None] * x[:, t])[..., None] * Bt[:, :, None, :]
        want = (S * Ct[:, :, None, :]).sum(-1) + D[:, None] * x[:, t]
        assert checks.rel(y[:, t], want) <= 1e-12, f"token {t}"
    assert checks.rel(last, S) <= 1e-12


def test_state_update_equals_the_fallback() -> None:
    g = torch.Generator().manual_seed(1)
    B, H, G, P, Ns = 2, 4, 2, 6, 5
    state = torch.randn(B, H, P, Ns, generator=g)
    args = (torch.randn(B, H, P, generator=g), torch.randn(B, H, 1, generator=g).expand(-1, -1, P),
            (-torch.rand(H, 1, 1, generator=g) - 0.1).expand(-1, P, Ns), torch.randn(B, G, Ns, generator=g),
            torch.randn(B, G, Ns, generator=g), torch.randn(H, 1, generator=g).expand(-1, P))
    kw = {"dt_bias": torch.randn(H, 1, generator=g).expand(-1, P), "dt_softplus": True,
          "z": torch.randn(B, H, P, generator=g)}
    s_ours, s_ref = state.clone(), state.clone()
    ours = hf_kernels.ssd_state_update(s_ours, *args, **kw)
    ref = _original("mamba2", "mamba2_selective_state_update")(s_ref, *args, **kw)
    assert checks.rel(ours, ref) <= 1e-5 and checks.rel(s_ours, s_ref) <= 1e-6


def test_packed_scan_restarts_per_sequence_and_bad_seq_idx() -> None:
    inputs = {k: (v[:1] if isinstance(v, torch.Tensor) and k not in ("A", "D", "dt_bias") else v)
              for k, v in _scan_inputs(N=20).items() if k != "initial_states"}
    lengths = [7, 1, 12]
    seq_idx = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None].int()
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    by_idx = hf_kernels.ssd_chunk_scan(**inputs, seq_idx=seq_idx)
    by_cu = hf_kernels.ssd_chunk_scan(**inputs, cu_seq_lens_q=cu)
    starts = [0, 7, 8]
    alone = torch.cat([hf_kernels.ssd_chunk_scan(**{
        k: (v[:, s:s + n] if k in ("hidden_states", "dt", "B", "C") else v) for k, v in inputs.items()})
        for s, n in zip(starts, lengths, strict=True)], dim=1)
    assert checks.rel(by_idx, alone) <= 1e-5 and checks.rel(by_cu, alone) <= 1e-5
    with pytest.raises(ValueError, match="seq_idx"):
        hf_kernels.ssd_chunk_scan(**inputs, seq_idx=seq_idx[0])
    with pytest.raises(ValueError, match="return_final_states"):
        hf_kernels.ssd_chunk_scan(**inputs, seq_idx=seq_idx, return_final_states=True)


def _modeling(family: str) -> Any:
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_model_logits_and_generation_equal_the_fallback(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = checks.hf_model(CONFIGS[family]())
    x, mask = checks.tokens(30), torch.ones(2, 30, dtype=torch.long)
    prompt = x[:1, :7]

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logits = hf(input_ids=x, attention_mask=mask).logits
        gen = hf.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        return logits, gen

    ours, gen = run()
    modeling = _modeling(family)
    for (mod, fn), original in hf_kernels.ORIGINALS.items():
        if mod == family:
            monkeypatch.setattr(modeling, fn, original)
    ref, ref_gen = run()
    assert checks.rel(ours, ref) <= checks.TOL, f"{family}: logits {checks.rel(ours, ref):.2e}"
    assert torch.equal(gen, ref_gen), f"{family}: greedy generation differs"


def test_served_in_every_mamba2_module() -> None:
    served = set(hf_kernels.install())
    for family in ("mamba2", "bamba", "granitemoehybrid", "zamba2", "falcon_h1", "nemotron_h"):
        if importlib.util.find_spec(f"transformers.models.{family}") is None:
            continue
        assert _modeling(family).mamba2_chunk_scan is hf_kernels.ssd_chunk_scan
        assert {f"{family}.mamba2_chunk_scan", f"{family}.mamba2_selective_state_update"} <= served


@pytest.mark.parametrize("packing", ["cu_seq_lens", "seq_idx"])
def test_packed_bamba_equals_each_alone(packing: str) -> None:
    """Bamba (Mamba-2 + attention) hands its mixers the packing metadata; the fallback ignores it and
    leaks state across documents, the served scan and conv keep them apart."""
    hf = checks.hf_model(CONFIGS["bamba"]())
    lengths = [6, 1, 13, 9]
    seqs = [checks.tokens(n, batch=1, seed=20 + i) for i, n in enumerate(lengths)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    kw: dict[str, Any] = ({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 13, "max_length_k": 13}
                          if packing == "cu_seq_lens" else
                          {"seq_idx": torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))[None].int()})
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = hf(input_ids=torch.cat(seqs, dim=1), position_ids=pos, use_cache=False, **kw).logits
        alone = torch.cat([hf(input_ids=s, use_cache=False).logits for s in seqs], dim=1)
    assert checks.rel(packed, alone) <= checks.TOL, f"packed ({packing}) vs each alone: {checks.rel(packed, alone):.2e}"
