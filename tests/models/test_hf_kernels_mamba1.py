"""``attnzoo.hf.register()`` serving transformers' Mamba-1 kernel hooks (``mamba_selective_scan``,
``mamba_selective_state_update``, ``mamba_scan_forward``; Mamba, FalconMamba, Jamba, Zamba) with
:func:`attnzoo.selective_scan`: the logits of a left-padded batch and greedy generation equal those
with transformers' own PyTorch fallback put back, so do a training step's gradients; more tokens
after a filled cache continue from the cached state (transformers' fallback starts that scan from
zeros); packed input keeps its sequences apart; the registry lists the 2026 families' hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_jamba import _config as _jamba  # noqa: E402
from test_hf_mamba1 import _falcon, _mamba  # noqa: E402

import attnzoo.hf as azhf  # noqa: E402
import hf_family_checks as checks  # noqa: E402
from attnzoo import hf_kernels  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")
azhf.register()


def _zamba(**kw: Any) -> Any:
    """hidden 64, 6 layers (the shared attention block at 2 and 5), 2 Mamba heads of 64 channels, state 8."""
    return T.ZambaConfig(**{**checks.SMALL, "num_hidden_layers": 6, "attn_layer_period": 3, "attn_layer_offset": 2,
                            "n_mamba_heads": 2, "mamba_d_state": 8, "mamba_dt_rank": 4, "attention_hidden_size": 128,
                            "use_mamba_kernels": False, **kw})


#: transformers' modeling module -> a tiny offline config of it
FAMILIES: dict[str, Callable[..., Any]] = {"mamba": _mamba, "falcon_mamba": _falcon, "jamba": _jamba,
                                           "zamba": _zamba}
#: the families whose layer calls mamba_scan_forward (Zamba runs its heads' scans itself)
SCAN_FORWARD = ("mamba", "falcon_mamba", "jamba")


def _modeling(family: str) -> Any:
    return __import__(f"transformers.models.{family}.modeling_{family}", fromlist=["_"])


def _fallback(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put transformers' own functions back in ``family``'s module (undone after the test)."""
    for (mod, fn), original in hf_kernels.ORIGINALS.items():
        if mod == family:
            monkeypatch.setattr(_modeling(family), fn, original)


def test_register_serves_the_mamba1_and_2026_hooks() -> None:
    served = set(hf_kernels.install())
    for family in SCAN_FORWARD:
        assert {f"{family}.mamba_selective_scan", f"{family}.mamba_selective_state_update",
                f"{family}.mamba_scan_forward", f"{family}.causal_conv1d_fn"} <= served
    assert {"zamba.mamba_selective_scan", "bailing_hybrid.chunk_kimi_delta_attention",
            "glm5_next.chunk_kimi_delta_attention", "qwen4_exp.torch_chunk_gated_delta_rule",
            "lara_mini.torch_chunk_gated_delta_rule", "lfm3.causal_conv1d_fn", "inkling2.causal_conv1d_fn"} <= served


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_served_hooks_equal_the_fallback(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = checks.hf_model(FAMILIES[family]())
    x, mask = checks.padded(24)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logits = hf(input_ids=x, attention_mask=mask).logits
        gen = hf.generate(input_ids=x[1:, :7], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        return logits, gen

    ours, gen = run()
    _fallback(family, monkeypatch)
    ref, ref_gen = run()
    real = mask.bool()
    err = checks.rel(ours[real], ref[real])
    assert err <= checks.TOL, f"{family}: served vs fallback, max rel error {err:.2e}"
    assert torch.equal(gen, ref_gen), f"{family}: greedy generation differs\n{gen}\n{ref_gen}"


def test_training_gradients_equal_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    hf = checks.hf_model(_mamba()).train()
    x = checks.tokens(20)

    def grads() -> list[torch.Tensor]:
        hf.zero_grad()
        hf(input_ids=x, labels=x, use_cache=False).loss.backward()
        return [p.grad.clone() for p in hf.parameters()]

    ours = grads()
    _fallback("mamba", monkeypatch)
    for a, b in zip(ours, grads(), strict=True):
        assert checks.rel(a, b) <= checks.TOL


@pytest.mark.parametrize("family", SCAN_FORWARD)
def test_tokens_after_a_filled_cache_continue_from_its_state(family: str) -> None:
    """Prefill 14 tokens, then 10 more in one call with the cache: the logits of the full forward."""
    hf = checks.hf_model(FAMILIES[family]())
    x = checks.tokens(24, batch=1)
    with torch.no_grad():
        full = hf(input_ids=x).logits
        cache = hf(input_ids=x[:, :14], use_cache=True).cache
        more = hf(input_ids=x[:, 14:], cache=cache, use_cache=True).logits
    err = checks.rel(more, full[:, 14:])
    assert err <= checks.TOL, f"{family}: continuation vs full forward, max rel error {err:.2e}"


def test_state_update_equals_the_fallback() -> None:
    g = torch.Generator().manual_seed(0)
    B, inner, N = 2, 6, 4
    state = torch.randn(B, inner, N, generator=g)
    args = [torch.randn(B, inner, generator=g), torch.randn(B, inner, generator=g),
            -torch.rand(inner, N, generator=g), torch.randn(B, N, generator=g), torch.randn(B, N, generator=g),
            torch.randn(inner, generator=g)]
    kw = {"dt_bias": torch.randn(inner, generator=g), "dt_softplus": True, "z": torch.randn(B, inner, generator=g)}
    ours_state, ref_state = state.clone(), state.clone()
    ours = hf_kernels.mamba1_state_update(ours_state, *args, **kw)
    ref = hf_kernels.ORIGINALS[("mamba", "mamba_selective_state_update")](ref_state, *args, **kw)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_state, ref_state, rtol=1e-5, atol=1e-6)  # updated in place


class _RecordingCache:
    """The cache calls of ``mamba_scan_forward``, keeping the states of the last ``keep`` tokens."""

    def __init__(self, keep: int) -> None:
        self.keep, self.state = keep, None

    def get_recurrent_state(self, layer: int, state_idx: int = 0) -> Any:
        return self.state

    def get_recurrent_states_to_keep(self, layer: int) -> int:
        return self.keep

    def update_recurrent_state(self, state: Any, layer: int) -> None:
        self.state = state


def _scan_inputs(mixer: Any, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    inner, N = mixer.A_log.shape
    return [torch.randn(1, inner, n, generator=g), torch.randn(1, inner, n, generator=g),
            torch.randn(1, n, N, generator=g), torch.randn(1, n, N, generator=g), torch.randn(1, inner, n, generator=g)]


def test_recorded_last_states_equal_the_scan() -> None:
    mixer = checks.hf_model(_mamba()).backbone.layers[0].mixer
    x = _scan_inputs(mixer, 12)
    with torch.no_grad():
        plain = _RecordingCache(0)
        y = hf_kernels.mamba_scan_forward(mixer, *x, plain)
        kept = _RecordingCache(3)
        y3 = hf_kernels.mamba_scan_forward(mixer, *x, kept)
    torch.testing.assert_close(y3, y, rtol=1e-5, atol=1e-6)
    assert isinstance(kept.state, list) and len(kept.state) == 3
    torch.testing.assert_close(kept.state[-1], plain.state, rtol=1e-5, atol=1e-6)


def test_packed_scan_keeps_sequences_apart_and_refuses_a_cache() -> None:
    mixer = checks.hf_model(_mamba()).backbone.layers[0].mixer
    lengths = [5, 1, 9]
    x = _scan_inputs(mixer, sum(lengths))
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    with torch.no_grad():
        packed = hf_kernels.mamba_scan_forward(mixer, *x, None, cu_seq_lens_q=cu)
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            alone = hf_kernels.mamba_scan_forward(mixer, x[0][..., s:e], x[1][..., s:e], x[2][:, s:e], x[3][:, s:e],
                                                  x[4][..., s:e], None)
            torch.testing.assert_close(packed[..., s:e], alone, rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match=r"packed input .* with a cache"):
            hf_kernels.mamba_scan_forward(mixer, *x, _RecordingCache(0), cu_seq_lens_q=cu)
