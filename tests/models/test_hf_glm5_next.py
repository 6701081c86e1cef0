"""GLM-5-Next's text model through ``from_hf`` / ``load_pretrained``: KDA layers (bounded or
softplus decay), MLA layers over the keys a pooled DSA indexer selects (some layers sharing the
previous layer's selection), dense then clamped-SwiGLU DeepSeek MoE layers, all on ``hc_mult``
residual streams mixed by hyper-connections; equal to transformers' eager (hidden states of
``Glm5NextTextModel``, logits and greedy generation of ``Glm5NextForConditionalGeneration``'s
language model), cached decode equal to the full forward, saved folders, refusals by name.

The indexer keeps ``index_topk / index_kpool = 2`` pools (plus the tail) of the 4-8 complete
pools of the test sequences, so the selection decides what each query sees."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import UnsupportedConfigError, from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.glm5_next import (  # noqa: E402
    BoundedKDA,
    ClampedMoE,
    ClampedSwiGLU,
    Glm5NextLM,
    IndexedLatentAttention,
    convert_glm5_next,
)
from attnzoo.models.hf._state import HFConfig  # noqa: E402
from attnzoo.models.hf.convert import read_config  # noqa: E402
from attnzoo.models.hf.safetensors import load_state_dict_from_folder  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
              projection_intermediate_size=32, patch_size=2, image_size=8)


def _text(**kw: Any) -> dict[str, Any]:
    """4 layers (KDA, indexed, indexed sharing layer 1's selection, KDA), a dense layer then MoE
    with 8 experts in 4 groups, 3 streams, pools of 4 with 2 kept, SwiGLU limits small enough to clip."""
    return {"vocab_size": checks.V, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "kv_lora_rank": 16, "q_lora_rank": 24,
            "qk_nope_head_dim": 16, "v_head_dim": 16, "index_topk": 8, "index_kpool": 4, "index_head_dim": 16,
            "index_n_heads": 4, "linear_head_dim": 16, "linear_num_heads": 4, "hc_mult": 3, "hc_sinkhorn_iters": 7,
            "swiglu_limit": 0.3, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
            "layer_types": ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
            "indexer_types": ["full", "full", "shared", "full"], "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2, **kw}


def _config(**kw: Any) -> Any:
    return T.Glm5NextTextConfig(**_text(**kw))


def _softplus_no_tail() -> Any:
    """Kimi's softplus decay (``linear_lower_bound=None``), no tail, attention biases, two shared
    experts, unnormalised expert weights, convolutions of 3, 2 streams, pools of 2 (3 kept)."""
    return _config(linear_lower_bound=None, index_kpool_always_select_tail=False, attention_bias=True,
                   n_shared_experts=2, norm_topk_prob=False, linear_conv_kernel_dim=3, hc_mult=2, index_kpool=2,
                   index_topk=6)


def _default_schedules() -> Any:
    """transformers' default schedules: KDA, KDA, KDA, indexed; three dense layers; every indexer full."""
    return T.Glm5NextTextConfig(**{k: v for k, v in _text(linear_lower_bound=-3.0).items()
                                   if k not in ("layer_types", "mlp_layer_types", "indexer_types")})


def _lm_config(**kw: Any) -> Any:
    return T.Glm5NextConfig(text_config=_text(**kw), vision_config=VISION)


def _base(make: Any = _config) -> Any:
    return checks.hf_model(make(), T.AutoModel)


def _lm(config: Any = None, seed: int = 0) -> Any:
    """``Glm5NextForConditionalGeneration`` (a tiny vision tower beside the language model), eager, perturbed."""
    torch.manual_seed(seed)
    model = T.Glm5NextForConditionalGeneration._from_config(config or _lm_config(), attn_implementation="eager")
    return checks.perturbed(model, seed)


def _convert(hf: Any) -> Glm5NextLM:
    """What ``from_hf`` gives once ``"glm5_next"`` is dispatched to ``convert_glm5_next``."""
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    return convert_glm5_next(HFConfig(hf.config.to_dict(), "test", "GLM-5-Next"), sd, device="cpu",
                             dtype=torch.float32)


def _check_hidden_states(hf: Any) -> None:
    """A model without a head converts to one (no LM head) with its hidden states on a left-padded
    batch (and on the unpadded row alone)."""
    ours = from_hf(hf)
    assert isinstance(ours.lm_head, torch.nn.Identity)
    x, mask = checks.padded(30)
    with torch.no_grad():
        ref = hf(input_ids=x, attention_mask=mask).last_hidden_state
        got = ours(x, attention_mask=mask.bool())
        alone = ours(x[1:])
    real = mask.bool()
    err = max(checks.rel(got[real], ref[real]), checks.rel(alone, ref[1:]))
    assert err <= checks.TOL, f"relative error {err:.2e}"


@pytest.mark.parametrize("make", [_config, _softplus_no_tail, _default_schedules])
def test_hidden_states_equal_transformers(make: Any) -> None:
    _check_hidden_states(_base(make))


def test_language_model_logits_equal_transformers() -> None:
    hf = _lm()
    ours = _convert(hf)
    x, mask = checks.padded(30)
    with torch.no_grad():
        ref = hf(input_ids=x, attention_mask=mask).logits
        got = ours(x, attention_mask=mask.bool())
    real = mask.bool()
    assert checks.rel(got[real], ref[real]) <= checks.TOL


def test_greedy_generation_identical() -> None:
    """Batch 1 and a left-padded batch 2, generating past several pools: the decode path's
    selection (rebuilt from the cached indexer states each step) as transformers'."""
    hf = _lm()
    ours = _convert(hf)
    kw: dict[str, Any] = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    x = checks.tokens(9, batch=1)
    expected = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=12, **kw)
    assert torch.equal(ours.generate(x, 12), expected)
    x, mask = checks.padded(13, pad=4)
    expected = hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=10, **kw)
    assert torch.equal(ours.generate(x, 10, attention_mask=mask.bool()), expected)


@pytest.mark.parametrize("make", [_config, _softplus_no_tail])
def test_cached_decode_equals_transformers_cached_decode(make: Any) -> None:
    """A prefill, a 4-token chunk, then one token at a time, against transformers' own cache.

    transformers' decode selection is not its full forward's: a query's pools are scored over the
    pools complete so far instead of over the whole sequence's, and ``topk`` breaks the ties of
    pools scored 0 (every head's ReLU at 0) differently; so this compares with its cached calls.
    Without an indexed layer cached decode equals the full forward."""
    hf = _base(make)
    ours = from_hf(hf)
    x, n = checks.tokens(26), 26
    with torch.no_grad():
        cache = T.DynamicCache(config=hf.config)
        spans = [(0, 9), (9, 13)] + [(t, t + 1) for t in range(13, n)]
        ref = torch.cat([hf(input_ids=x[:, a:b], cache=cache, use_cache=True).last_hidden_state for a, b in spans], 1)
        ours_cache = ours.init_cache(2, n)
        got = torch.cat([ours(x[:, a:b], cache=ours_cache) for a, b in spans], dim=1)
    assert checks.rel(got, ref) <= checks.TOL


def test_cached_decode_equals_full_forward_without_indexed_layers() -> None:
    ours = from_hf(_base(lambda: _config(layer_types=["linear_attention"] * 4)))
    x = checks.tokens(20)
    with torch.no_grad():
        full = ours(x)
        cache = ours.init_cache(2, 20)
        got = torch.cat([ours(x[:, :7], cache=cache)] + [ours(x[:, t:t + 1], cache=cache) for t in range(7, 20)], 1)
    assert checks.rel(got, full) <= checks.TOL


def test_packed_sequences_equal_each_alone() -> None:
    ours = from_hf(_base())
    lengths = (5, 11, 1, 8)
    seqs = [checks.tokens(n, batch=1, seed=10 + i) for i, n in enumerate(lengths)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        packed = ours(torch.cat(seqs, dim=1), cu_seqlens=cu)
        alone = torch.cat([ours(s) for s in seqs], dim=1)
    assert checks.rel(packed, alone) <= 1e-6


def test_layer_structure() -> None:
    ours = from_hf(_base())
    assert [type(b.attn) for b in ours.blocks] == [BoundedKDA, IndexedLatentAttention, IndexedLatentAttention,
                                                   BoundedKDA]
    assert ours.blocks[0].attn.lower_bound == -5.0 and ours.streams == 3
    assert ours.blocks[1].attn.indexer is not None and ours.blocks[1].attn.share
    assert ours.blocks[2].attn.indexer is None and not ours.blocks[2].attn.share
    assert isinstance(ours.blocks[0].ffn, ClampedSwiGLU) and isinstance(ours.blocks[1].ffn, ClampedMoE)
    assert isinstance(ours.blocks[1].ffn.shared_expert, ClampedSwiGLU) and ours.blocks[1].ffn.limit == 0.3


def test_saved_folder_loads(tmp_path: Path) -> None:
    """The text model's folder (the checkpoint's names: ``hc_attn_fn``, ``{q,k,v}_conv1d``, one tensor
    per expert) through ``load_pretrained``."""
    hf = _base()
    hf.save_pretrained(tmp_path)
    names = set(safetensors_torch.load_file(str(tmp_path / "model.safetensors")))
    assert "layers.0.hc_attn_fn" in names and "layers.1.mlp.experts.0.gate_proj.weight" in names
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), hf(input_ids=x).last_hidden_state) <= checks.TOL


def test_saved_language_model_with_mtp_layer(tmp_path: Path) -> None:
    """``Glm5NextForConditionalGeneration``'s folder (vision tower, ``lm_head``) plus a
    multi-token-prediction layer (``layers.{num_hidden_layers}``, which transformers drops)."""
    hf = _lm()
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    sd = dict(safetensors_torch.load_file(str(path)))
    sd["model.language_model.layers.4.eh_proj.weight"] = torch.ones(3, 3)
    safetensors_torch.save_file(sd, str(path), metadata={"format": "pt"})
    hf_cfg = read_config(tmp_path)
    ours = convert_glm5_next(hf_cfg, load_state_dict_from_folder(tmp_path), device=None, dtype=None)
    x = checks.tokens(12)
    with torch.no_grad():
        assert checks.rel(ours(x), hf(input_ids=x).logits) <= checks.TOL


def test_config_json_with_keys_left_out(tmp_path: Path) -> None:
    """The schedules and the hyper-connection, decay and pooling settings from transformers' defaults
    (``index_topk_freq`` 2 making every other indexer shared)."""
    hf = _base(lambda: T.Glm5NextTextConfig(**{k: v for k, v in _text().items() if k not in (
        "layer_types", "mlp_layer_types", "indexer_types", "hc_sinkhorn_iters")},
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        index_topk_freq=2, index_skip_topk_offset=2))
    assert hf.config.indexer_types == ["full", "full", "shared", "full"]
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    for key in ("indexer_types", "mlp_layer_types", "hc_eps", "hc_sinkhorn_iters", "linear_lower_bound",
                "index_kpool_always_select_tail", "rms_norm_eps"):
        data.pop(key, None)
    path.write_text(json.dumps(data))
    again = T.AutoModel.from_pretrained(tmp_path).eval()
    x = checks.tokens(14)
    with torch.no_grad():
        assert checks.rel(load_pretrained(tmp_path)(x), again(input_ids=x).last_hidden_state) <= checks.TOL


@pytest.mark.parametrize(("key", "value", "named"), [
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("qk_rope_head_dim", 8, "qk_rope_head_dim=8"),
    ("num_key_value_heads", 2, "num_key_value_heads=2"),
    ("q_lora_rank", None, "q_lora_rank=None"),
    ("swiglu_limit", None, "swiglu_limit=None"),
    ("index_topk", 6, "index_topk=6"),
    ("indexer_types", ["full", "shared", "full", "full"], "indexer_types=.*layer 1"),
    ("mlp_layer_types", ["dense", "moe", "sparse", "sparse"], "mlp_layer_types"),
])
def test_unsupported_options_are_named(key: str, value: Any, named: str) -> None:
    hf = T.Glm5NextTextModel(_config())
    object.__setattr__(hf.config, key, value)  # past the strict config's checks (a hand-written config.json)
    with pytest.raises(UnsupportedConfigError, match=named):
        from_hf(hf)


def test_multimodal_base_model_converts_to_its_text_model() -> None:
    """``Glm5NextModel`` (``language_model.*`` beside ``visual.*``, no head): its text part."""
    torch.manual_seed(0)
    _check_hidden_states(checks.perturbed(T.Glm5NextModel._from_config(_lm_config(), attn_implementation="eager")))
