"""RWKV-4 (``RwkvForCausalLM``) through ``from_hf``: token shift, time mixing with the WKV
recurrence (the family-local chunked :func:`wkv` against its token loop and transformers'),
channel mixing, the first layer's extra LayerNorm, the eval-mode rescaling; equal to transformers'
eager (see ``hf_family_checks``).

transformers ignores the attention mask (its left-padded row depends on the padding) and its
cached decode of a batch of 2 is broken (see the family's docstring), so the padded-batch checks
compare each row with transformers on the row alone, and generation with transformers' batch 1."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_recurrent_gemma import PAD, _check_logits  # noqa: E402  (padded rows against each row alone)

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.families.rwkv import wkv, wkv_recurrent  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {k: v for k, v in checks.SMALL.items() if k not in ("num_attention_heads", "num_key_value_heads",
                                                            "max_position_embeddings")}


def _config(**kw: Any) -> Any:
    """3 layers, ``attention_hidden_size`` = hidden 64, intermediate 96, the hidden states halved
    after layer 2 (``rescale_every`` 2: layer 2's output projections halved), untied."""
    return T.RwkvConfig(**{**SMALL, "num_hidden_layers": 3, "rescale_every": 2, "context_length": 256, **kw})


def _other(**kw: Any) -> Any:
    """``attention_hidden_size`` 48 (!= 64; transformers runs it with ``use_cache=False`` only: its
    state is ``hidden_size`` wide), intermediate 4 * hidden, no rescaling, tied, eps 1e-3, 4 layers."""
    return T.RwkvConfig(**{**SMALL, "num_hidden_layers": 4, "attention_hidden_size": 48, "intermediate_size": None,
                           "rescale_every": 0, "tie_word_embeddings": True, "layer_norm_epsilon": 1e-3,
                           "use_cache": False, **kw})


def _every_layer(**kw: Any) -> Any:
    """``rescale_every`` 1: halved after every layer, layer ``i``'s projections by ``2^i``."""
    return _config(num_hidden_layers=4, rescale_every=1, **kw)


CONFIGS = (_config, _other, _every_layer)


def check_generation_rows_alone(make: Callable[[], Any], new: int = 8) -> None:
    """Greedy generation: batch 1 as transformers generates it; a left-padded batch 2: each row as
    transformers generates it alone (transformers ignores the padding; its RWKV decode of a batch
    of 2 is broken besides)."""
    hf = checks.hf_model(make())
    ours = from_hf(hf)

    def hf_generate(x: torch.Tensor) -> torch.Tensor:
        return hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)

    x = checks.tokens(7, batch=1)
    assert torch.equal(ours.generate(x, new), hf_generate(x))
    x, mask = checks.padded(10, pad=3)
    got = ours.generate(x, new, attention_mask=mask.bool())
    assert torch.equal(got[:1, 3:], hf_generate(x[:1, 3:])) and torch.equal(got[1:], hf_generate(x[1:]))


class RowsAloneChecks(checks.FamilyChecks):
    """:class:`~hf_family_checks.FamilyChecks` of a family whose transformers model ignores the
    padding: the padded batch's rows against transformers on each row alone, the unpadded batch as
    is (``configs``: every config so checked and decoded; ``config`` and ``cases`` generate)."""

    configs: tuple[Callable[[], Any], ...] = ()

    def test_logits_equal_transformers(self) -> None:
        for make in self.configs:
            _check_logits(make)

    def test_base_model_equals_transformers(self) -> None:
        assert isinstance(from_hf(checks.hf_model(self.config(), T.AutoModel)).lm_head, torch.nn.Identity)
        for make in self.configs:
            _check_logits(make, T.AutoModel, n=16)

    def test_greedy_generation_identical(self) -> None:
        for make in (self.config, *self.cases):
            check_generation_rows_alone(make)

    def test_cached_decode_equals_full_forward(self) -> None:
        for make in self.configs:
            checks.check_cached_decode(make)


class TestRwkv(RowsAloneChecks):
    config = staticmethod(_config)
    cases = (_every_layer,)
    configs = CONFIGS


def test_logits_over_several_kernel_chunks_equal_transformers() -> None:
    _check_logits(_config, n=75)  # three chunks of 32


def _inputs(b: int, t: int, a: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    w = torch.exp(torch.randn(a, generator=g, dtype=dtype) * 1.5)  # decays from ~0.05 to ~20 per step
    u = torch.randn(a, generator=g, dtype=dtype)
    k = torch.randn(b, t, a, generator=g, dtype=dtype) * 3
    v = torch.randn(b, t, a, generator=g, dtype=dtype)
    return w, u, k, v


@pytest.mark.parametrize("chunk", [1, 5, 32])
def test_chunked_wkv_equals_the_token_loop(chunk: int) -> None:
    """With padding inside rows, from a carried state, and the state it ends with (float64)."""
    w, u, k, v = _inputs(3, 23, 6)
    real = torch.rand(3, 23, generator=torch.Generator().manual_seed(1)) > 0.3
    real[0] = True
    real[1, :4] = False
    y0, s0 = wkv_recurrent(w, u, k[:, :9], v[:, :9], None, real[:, :9])
    y1, s1 = wkv_recurrent(w, u, k[:, 9:], v[:, 9:], s0, real[:, 9:])
    c0, t0 = wkv(w, u, k[:, :9], v[:, :9], None, real[:, :9], chunk_size=chunk)
    c1, t1 = wkv(w, u, k[:, 9:], v[:, 9:], t0, real[:, 9:], chunk_size=chunk)
    assert checks.rel(torch.cat([c0, c1], 1)[real], torch.cat([y0, y1], 1)[real]) <= 1e-12
    assert checks.rel(t1[..., :2] * t1[..., 2:].exp(), s1[..., :2] * s1[..., 2:].exp()) <= 1e-12


def test_padded_tokens_inside_a_row_are_skipped() -> None:
    """A row with padded tokens between real ones computes what the row of its real tokens alone
    computes (no write, no decay), in both forms."""
    w, u, k, v = _inputs(1, 15, 5)
    real = torch.ones(1, 15, dtype=torch.bool)
    real[0, [0, 3, 4, 9, 14]] = False
    keep = real[0]
    alone, state = wkv_recurrent(w, u, k[:, keep], v[:, keep])
    for run in (wkv_recurrent, wkv):
        got, last = run(w, u, k, v, None, real)
        assert checks.rel(got[:, keep], alone) <= 1e-12
        assert checks.rel(last[..., :2] * last[..., 2:].exp(), state[..., :2] * state[..., 2:].exp()) <= 1e-12


def test_wkv_equals_transformers_kernel() -> None:
    """Against transformers' ``rwkv_linear_attention_cpu`` (float32), its state continued."""
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    w, u, k, v = _inputs(2, 40, 8, dtype=torch.float32)
    ref, (num, den, top) = rwkv_linear_attention_cpu(w.log(), u, k, v, return_state=True)
    got, state = wkv(w, u, k, v)
    assert checks.rel(got, ref) <= 1e-5
    a, b, p = state.unbind(-1)
    assert checks.rel(a * (p - top).exp(), num) <= 1e-5 and checks.rel(b * (p - top).exp(), den) <= 1e-5


def test_wkv_gradients_are_finite_with_padding() -> None:
    w, u, k, v = (t.requires_grad_() for t in _inputs(2, 12, 4))
    real = torch.ones(2, 12, dtype=torch.bool)
    real[0, :5] = False
    real[1, 7] = False
    y, _ = wkv(w, u, k, v, None, real, chunk_size=4)
    y[real].sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (w, u, k, v))
    assert k.grad[0, :5].abs().max() == 0 and v.grad[1, 7].abs().max() == 0


def test_rescaling_follows_the_mode_as_transformers() -> None:
    """Eval: transformers divides the projections and halves the hidden states; training mode
    neither. The converted model follows both modes (its weights stay the checkpoint's)."""
    hf = checks.hf_model(_every_layer(layer_norm_epsilon=1e-1))  # a large epsilon: the modes differ
    ours = from_hf(hf)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    x = checks.tokens(12)
    with torch.no_grad():
        for train in (False, True, False):
            hf.train(train)
            ours.train(train)
            assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in before.items())
    hf.eval()
    with torch.no_grad():
        ours.train()
        assert checks.rel(ours(x), hf(input_ids=x).logits) > 1e-3


def test_time_decay_and_first_stay_float32() -> None:
    ours = from_hf(checks.hf_model(_config())).to(torch.bfloat16)
    mixer = ours.blocks[1].attn
    assert mixer.time_decay.dtype == torch.float32 and mixer.time_first.dtype == torch.float32
    assert mixer.q_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        out = ours(checks.tokens(9))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_structure() -> None:
    from attnzoo.models.families.minimax import NormedEmbedding
    from attnzoo.models.families.rwkv import RwkvChannelMix, RwkvLM, RwkvTimeMix

    ours = from_hf(checks.hf_model(_other()))
    assert isinstance(ours, RwkvLM) and isinstance(ours.tok_emb, NormedEmbedding)
    assert ours.lm_head.weight is ours.tok_emb.weight  # tied
    assert isinstance(ours.blocks[0].attn, RwkvTimeMix) and ours.blocks[0].attn.inner == 48
    assert isinstance(ours.blocks[0].ffn, RwkvChannelMix) and ours.blocks[0].ffn.k_proj.out_features == 256
    assert ours.norm.eps == 1e-5 and ours.blocks[0].attn_norm.eps == 1e-3
    assert [b.attn.rescale for b in from_hf(checks.hf_model(_every_layer())).blocks] == [0, 1, 2, 3]


def check_padded_decode_rows_alone(make: Callable[[], Any], n: int = 16, prefill: int = 9) -> None:
    """A left-padded prefill then one token at a time through the cache: each row equals the
    converted model on the row alone."""
    ours = from_hf(checks.hf_model(make()))
    x, mask = checks.padded(n, pad=PAD)
    with torch.no_grad():
        cache = ours.init_cache(2, n)
        steps = [ours(x[:, :prefill], cache=cache, attention_mask=mask[:, :prefill].bool())]
        steps += [ours(x[:, t:t + 1], cache=cache, attention_mask=mask[:, :t + 1].bool()) for t in range(prefill, n)]
        alone, full = ours(x[:1, PAD:]), ours(x[1:])
    got = torch.cat(steps, dim=1)
    assert checks.rel(got[0, PAD:], alone[0]) <= 1e-5 and checks.rel(got[1], full[0]) <= 1e-5


def test_padded_decode_equals_each_row_alone() -> None:
    check_padded_decode_rows_alone(_config)


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """``attention_hidden_size`` / ``intermediate_size`` derived, the defaults (eps 1e-5, rescaling
    every 6 layers, untied, context 1024) left out."""
    hf = checks.hf_model(T.RwkvConfig(**{**SMALL, "num_hidden_layers": 7, "intermediate_size": None}))
    checks.check_folder_without_keys(hf, tmp_path, ("attention_hidden_size", "intermediate_size", "layer_norm_epsilon",
                                                    "rescale_every", "tie_word_embeddings", "context_length"))


@pytest.mark.parametrize("check", [checks.check_packed_equals_each_alone,
                                   checks.check_packed_gradients_equal_each_alone])
def test_packed_sequences_and_their_gradients_equal_each_alone(check: Any) -> None:
    check(_config)
    check(_other)
