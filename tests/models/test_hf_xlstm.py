"""xLSTM (``xLSTMForCausalLM``) through ``from_hf``: mLSTM blocks (the family-local chunked
:func:`mlstm_chunked` against its token loop and transformers' kernels), soft-capped gates, the
per-head LayerNorm and output gate, SwiGLU feed-forwards, single and fused weights, the soft-capped
logits; equal to transformers' eager (see ``hf_family_checks``).

transformers takes no attention mask (its left-padded row depends on the padding), so the
padded-batch checks compare each row with transformers on the row alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_rwkv import RowsAloneChecks, check_padded_decode_rows_alone  # noqa: E402

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf  # noqa: E402
from attnzoo.models.families.xlstm import mlstm_chunked, mlstm_recurrent  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {k: v for k, v in checks.SMALL.items() if k not in ("num_attention_heads", "num_key_value_heads",
                                                            "intermediate_size", "max_position_embeddings")}


@pytest.fixture(autouse=True)
def fused_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.25's random initialisation of fused weights fails (``_init_weights`` subtracts
    a ``[2H]`` tensor from the ``[H]`` half of the ``ifgate_preact`` bias): initialise them as single
    weights (every weight is perturbed afterwards; loading a checkpoint does not run it)."""
    from transformers.models.xlstm import modeling_xlstm as M

    original = M.xLSTMPreTrainedModel._init_weights

    def init(self: Any, module: torch.nn.Module) -> None:
        mode = self.config.weight_mode
        self.config.weight_mode = "single"
        try:
            original(self, module)
        finally:
            self.config.weight_mode = mode

    monkeypatch.setattr(M.xLSTMPreTrainedModel, "_init_weights", init)


def _config(**kw: Any) -> Any:
    """hidden 128, 2 blocks, 4 heads (q/k heads of 16, v heads of 32), feed-forward 384, chunks of 8
    (transformers runs 24 of 30 tokens in chunks, the rest token by token), the default soft caps."""
    return T.xLSTMConfig(**{**SMALL, "hidden_size": 128, "num_hidden_layers": 2, "num_heads": 4, "chunk_size": 8,
                            **kw})


def _fused(**kw: Any) -> Any:
    """Fused weights with biases, q/k heads of 32 > v heads of 16, caps 5 (gates) and 3 (logits),
    eps 1e-3 (cell and norms), feed-forward 1.5 * C rounded to 32 (192), ``tie_word_embeddings``
    (which transformers does not follow: the head stays its own), 3 blocks."""
    return _config(**{"weight_mode": "fused", "use_bias": True, "qk_dim_factor": 1.0, "v_dim_factor": 0.5,
                      "gate_soft_cap": 5.0, "output_logit_soft_cap": 3.0, "eps": 1e-3, "norm_eps": 1e-3,
                      "ffn_proj_factor": 1.5, "ffn_round_up_to_multiple_of": 32, "tie_word_embeddings": True,
                      "num_hidden_layers": 3, "chunk_size": 16, **kw})


def _narrow(**kw: Any) -> Any:
    """hidden 96: q/k 48 wide (heads of 12), v 96 (heads of 24), widths off transformers' 64-rounded
    cache (its cached path fails: ``use_cache=False``), one head per 2 of ``num_blocks``."""
    return T.xLSTMConfig(**{**SMALL, "hidden_size": 96, "num_blocks": 2, "num_heads": 4, "chunk_size": 64,
                            "use_cache": False, **kw})


CONFIGS = (_config, _fused, _narrow)


class TestXLSTM(RowsAloneChecks):
    config = staticmethod(_config)
    cases = (_fused,)
    configs = CONFIGS


def _cell_inputs(b: int, h: int, t: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, t, 8, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(b, h, t, 6, generator=g, dtype=dtype)
    i = torch.randn(b, h, t, generator=g, dtype=dtype) * 4
    f = torch.randn(b, h, t, generator=g, dtype=dtype) * 3 + 2
    return q, k, v, i, f


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_chunked_cell_equals_the_token_loop(chunk: int) -> None:
    """With padding inside rows, from a carried state, and the state it ends with (float64)."""
    q, k, v, i, f = _cell_inputs(3, 2, 21)
    real = torch.rand(3, 21, generator=torch.Generator().manual_seed(1)) > 0.3
    real[1, :4] = False
    h0, s0 = mlstm_recurrent(q[:, :, :8], k[:, :, :8], v[:, :, :8], i[..., :8], f[..., :8], None, real[:, :8])
    h1, s1 = mlstm_recurrent(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], i[..., 8:], f[..., 8:], s0, real[:, 8:])
    c0, t0 = mlstm_chunked(q[:, :, :8], k[:, :, :8], v[:, :, :8], i[..., :8], f[..., :8], None, real[:, :8],
                           chunk_size=chunk)
    c1, t1 = mlstm_chunked(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], i[..., 8:], f[..., 8:], t0, real[:, 8:],
                           chunk_size=chunk)
    mask = real[:, None, :].expand(-1, 2, -1)
    assert checks.rel(torch.cat([c0, c1], 2)[mask], torch.cat([h0, h1], 2)[mask]) <= 1e-12
    assert all(checks.rel(a, b) <= 1e-12 for a, b in zip(t1, s1, strict=True))


def test_padded_tokens_inside_a_row_are_skipped() -> None:
    """A row with padded tokens between real ones computes what the row of its real tokens alone
    computes (no write, no decay, no change of the stabiliser), in both forms."""
    q, k, v, i, f = _cell_inputs(1, 2, 15)
    real = torch.ones(1, 15, dtype=torch.bool)
    real[0, [0, 3, 4, 9, 14]] = False
    keep = real[0]
    alone, state = mlstm_recurrent(q[:, :, keep], k[:, :, keep], v[:, :, keep], i[..., keep], f[..., keep])
    for run in (mlstm_recurrent, mlstm_chunked):
        got, last = run(q, k, v, i, f, None, real)
        assert checks.rel(got[:, :, keep], alone) <= 1e-12
        assert all(checks.rel(a, b) <= 1e-12 for a, b in zip(last, state, strict=True))


def test_cell_equals_transformers_kernels() -> None:
    """Against transformers' chunked kernel (a multiple of its chunk) and its token loop, float32."""
    from transformers.models.xlstm import modeling_xlstm as M

    q, k, v, i, f = _cell_inputs(2, 3, 32, dtype=torch.float32)
    ref, (c, _, m) = M.mlstm_chunkwise_native_autograd(q, k, v, i, f, return_last_states=True, chunk_size=8)
    got, (c2, _, m2) = mlstm_chunked(q, k, v, i, f, chunk_size=16)
    assert checks.rel(got, ref) <= 1e-5 and checks.rel(c2, c) <= 1e-5 and checks.rel(m2, m[..., 0]) <= 1e-6
    ref, _ = M.mlstm_recurrent_sequence_native(q[:, :, :11], k[:, :, :11], v[:, :, :11], i[..., :11], f[..., :11],
                                               return_last_states=True)
    assert checks.rel(mlstm_chunked(q[:, :, :11], k[:, :, :11], v[:, :, :11], i[..., :11], f[..., :11])[0],
                      ref) <= 1e-5


def test_cell_gradients_are_finite_with_padding() -> None:
    q, k, v, i, f = (t.requires_grad_() for t in _cell_inputs(2, 2, 12))
    real = torch.ones(2, 12, dtype=torch.bool)
    real[0, :5] = False
    h, _ = mlstm_chunked(q, k, v, i, f, None, real, chunk_size=4)
    h[1].sum().backward()
    h, _ = mlstm_chunked(q, k, v, i, f, None, real, chunk_size=4)
    h[0, :, 5:].sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v, i, f))
    assert k.grad[0, :, :5].abs().max() == 0 and i.grad[0, :, :5].abs().max() == 0


def test_inputs_longer_than_the_inference_chunk_follow_the_float32_path() -> None:
    """Over ``max_inference_chunksize`` tokens transformers' forward without a cache carries its
    states in a bfloat16 ``xLSTMCache`` (rounded), with one in the model's dtype (``generate``'s)
    it agrees with the full-precision computation, which the converted model follows."""
    hf = checks.hf_model(_config(max_inference_chunksize=8))
    ours = from_hf(hf)
    x = checks.tokens(30)
    with torch.no_grad():
        got = ours(x)
        assert checks.rel(got, hf(input_ids=x, use_cache=True).logits) <= checks.TOL
        assert checks.rel(got, hf(input_ids=x, use_cache=False).logits) > 1e-3


def test_structure() -> None:
    from attnzoo.models.families.xlstm import BiasedRMSNorm, MLSTMLayer

    ours = from_hf(checks.hf_model(_fused()))
    attn = ours.blocks[0].attn
    assert isinstance(attn, MLSTMLayer) and (attn.head_dim, attn.v_head_dim) == (32, 16)
    assert attn.norm.bias is not None and isinstance(ours.blocks[0].attn_norm, BiasedRMSNorm)
    assert ours.blocks[0].ffn.gate_proj.out_features == 192 and ours.lm_head.softcap == 3.0
    assert ours.lm_head.weight is not ours.tok_emb.weight  # transformers ties nothing
    plain = from_hf(checks.hf_model(_config())).blocks[0].attn
    assert plain.norm.bias is None and plain.q_proj.bias is None and plain.i_proj.bias is not None


def test_padded_decode_equals_each_row_alone() -> None:
    check_padded_decode_rows_alone(_config)


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """``num_blocks`` / ``embedding_dim`` derived and the defaults left out."""
    hf = checks.hf_model(T.xLSTMConfig(**{**SMALL, "hidden_size": 128, "num_hidden_layers": 2, "num_heads": 4}))
    checks.check_folder_without_keys(hf, tmp_path, (
        "num_blocks", "embedding_dim", "use_bias", "norm_eps", "qk_dim_factor", "v_dim_factor", "eps",
        "inference_state_dtype", "ffn_proj_factor", "ffn_round_up_to_multiple_of", "gate_soft_cap",
        "output_logit_soft_cap", "weight_mode", "tie_word_embeddings", "chunk_size"))


def test_fused_saved_folder_loads(tmp_path: Path) -> None:
    checks.check_folder(_fused, tmp_path)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("inference_state_dtype", "bfloat16", "inference_state_dtype"),
    ("embedding_dim", 64, "embedding_dim"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.xLSTMForCausalLM, _config, key, value, named)


def test_unknown_weight_mode_is_refused() -> None:
    from attnzoo.interop import UnsupportedConfigError
    from attnzoo.models.families.xlstm import convert_xlstm
    from attnzoo.models.hf._state import HFConfig

    hf = checks.hf_model(_config())
    data = {**hf.config.to_dict(), "weight_mode": "sharded"}
    with pytest.raises(UnsupportedConfigError, match="weight_mode"):
        convert_xlstm(HFConfig(data, "test", "xLSTM"), hf.state_dict(), device=None, dtype=None)


@pytest.mark.parametrize("check", [checks.check_packed_equals_each_alone,
                                   checks.check_packed_gradients_equal_each_alone])
def test_packed_sequences_and_their_gradients_equal_each_alone(check: Any) -> None:
    check(_config)
    check(_fused)
