"""MiniMax-M3 text (``minimax_m3_vl_text``) through ``from_hf`` / ``load_pretrained``: Gemma-normed GQA
with per-head QK norms and partial RoPE, block-sparse layers whose lightning indexer picks blocks of
keys, sigmoid-routed clamped-SwiGLU experts with a shared expert, dense clamped-SwiGLU layers; equal to
transformers' eager.

transformers' indexer anchors its blocks to key slots and its query blocks to ``position_ids``, so a
left-padded row selects other blocks than the row alone (its TODO says so); attnzoo computes every
padded row as the row alone. The checks on a padded batch therefore compare each row with transformers
on that row unpadded (:func:`check_rows`); unpadded batches are compared as they are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import hf_family_checks as checks  # noqa: E402
from attnzoo.interop import from_hf, load_pretrained  # noqa: E402
from attnzoo.models.families.minimax_m3 import BlockIndexer, OaiSwiGLU  # noqa: E402
from attnzoo.models.families.qwen4_exp import IndexedAttention  # noqa: E402
from attnzoo.nn.moe import MixtureOfExperts  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")

F, S = "full_attention", "minimax_m3_sparse"


def _m3(**kw: Any) -> Any:
    """3 layers (full + dense MLP, then two sparse attentions + MoE), head_dim 16 with half of it rotated,
    a 2-head indexer of 16 over blocks of 4 keys keeping the 2 best (one local), 4 experts top-2, a
    SwiGLU limit small enough to clip, routed scaling 1.5, untied."""
    return T.MiniMaxM3VLTextConfig(**{
        **checks.SMALL, "num_hidden_layers": 3, "head_dim": 16, "intermediate_size": 32, "num_local_experts": 4,
        "num_experts_per_tok": 2, "dense_intermediate_size": 48, "shared_intermediate_size": 24,
        "layer_types": [F, S, S], "mlp_layer_types": ["dense", "sparse", "sparse"], "index_n_heads": 2,
        "index_head_dim": 16, "index_block_size": 4, "index_topk_blocks": 2, "index_local_blocks": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        "swiglu_limit": 0.8, "routed_scaling_factor": 1.5, **kw})


def _m3_other() -> Any:
    """Tied, one key/value head, the whole head rotated (llama3-scaled), a 4-head indexer of 24 over blocks
    of 3 keeping 3 with 2 local, top-1 of 3 experts, sparse layers first, alpha 1.2, eps 1e-5."""
    return _m3(tie_word_embeddings=True, num_key_value_heads=1, index_n_heads=4, index_head_dim=24,
               index_block_size=3, index_topk_blocks=3, index_local_blocks=2, num_local_experts=3,
               num_experts_per_tok=1, layer_types=[S, F, S], mlp_layer_types=["sparse", "sparse", "dense"],
               swiglu_alpha=1.2, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16})


def _m3_no_local() -> Any:
    """No local blocks (the indexer alone decides), one block kept, a 4-head indexer."""
    return _m3(index_local_blocks=0, index_topk_blocks=1, index_n_heads=4)


def _m3_all_blocks() -> Any:
    """Every block kept (8 of 4 keys cover the 30 tokens checked): the indexer selects nothing away, so a
    left-padded batch equals transformers' padded batch too (the half-precision sweep's config)."""
    return _m3(index_topk_blocks=8)


def _outputs(hf: Any, **kw: Any) -> torch.Tensor:
    out = hf(**kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def check_rows(make: Any, auto: Any = None, n: int = 30, pad: int = 5) -> float:
    """A left-padded batch: each row equal to transformers on that row alone (unpadded); an unpadded
    batch equal to transformers' batch. Returns the largest relative error."""
    hf = checks.hf_model(make(), auto)
    ours = from_hf(hf)
    x, mask = checks.padded(n, pad)
    with torch.no_grad():
        got = ours(x, attention_mask=mask.bool())
        rows = [_outputs(hf, input_ids=x[b:b + 1, int((~mask[b].bool()).sum()):]) for b in range(2)]
        full = ours(x[1:].expand(2, -1))
        ref = _outputs(hf, input_ids=x[1:].expand(2, -1))
    err = max(checks.rel(got[0, pad:], rows[0][0]), checks.rel(got[1], rows[1][0]), checks.rel(full, ref))
    assert err <= checks.TOL, f"relative error {err:.2e}"
    return err


def check_generation_rows(make: Any, prompt: int = 7, new: int = 8) -> None:
    """Greedy generation: batch 1 as transformers'; a left-padded batch 2, each row as transformers'
    generation of that row alone."""
    hf = checks.hf_model(make())
    ours = from_hf(hf)
    kw: dict[str, Any] = {"max_new_tokens": new, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    x = checks.tokens(prompt, batch=1)
    assert torch.equal(ours.generate(x, new), hf.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw))
    x, mask = checks.padded(prompt + 3, pad=3)
    got = ours.generate(x, new, attention_mask=mask.bool())
    for b, pad in ((0, 3), (1, 0)):
        row = x[b:b + 1, pad:]
        assert torch.equal(got[b, pad:], hf.generate(input_ids=row, attention_mask=torch.ones_like(row), **kw)[0])


class TestMiniMaxM3(checks.FamilyChecks):
    config = staticmethod(_m3)
    cases = (_m3_other, _m3_no_local)

    def test_logits_equal_transformers(self) -> None:
        for make in (self.config, *self.cases):
            check_rows(make)

    def test_base_model_equals_transformers(self) -> None:
        for make in (self.config, *self.cases):
            check_rows(make, T.AutoModel, n=16, pad=3)

    def test_greedy_generation_identical(self) -> None:
        check_generation_rows(self.config)


@pytest.mark.parametrize("make", [lambda: _m3(layer_types=[F, F, F]), _m3_all_blocks])
def test_unselective_layers_follow_transformers_padding(make: Any) -> None:
    """Without sparse layers, or with every block kept, a left-padded batch equals transformers' padded
    batch (the shared checks)."""
    checks.check_logits(make)
    checks.check_base_model(make)
    checks.check_generation(make)


def test_transformers_left_padding_changes_the_selection() -> None:
    """transformers' padded forward differs from its own unpadded run of the row (slot-anchored blocks),
    attnzoo's does not; the selection matters (all blocks kept gives other logits)."""
    hf = checks.hf_model(_m3())
    ours = from_hf(hf)
    x, mask = checks.padded(30)
    with torch.no_grad():
        alone = hf(input_ids=x[:1, 5:]).logits[0]
        theirs = hf(input_ids=x, attention_mask=mask).logits[0, 5:]
        got = ours(x, attention_mask=mask.bool())[0, 5:]
        every = from_hf(checks.hf_model(_m3_all_blocks()))(x[:1, 5:])[0]
    assert checks.rel(theirs, alone) > 1e-2 and checks.rel(got, alone) <= checks.TOL
    assert checks.rel(every, alone) > 1e-2


#: a prefill, a chunk, then one token at a time
SPANS = [(0, 9), (9, 13)] + [(t, t + 1) for t in range(13, 26)]


def _stepwise(run: Any, x: torch.Tensor) -> torch.Tensor:
    """``run`` on the :data:`SPANS` of ``x`` in turn, the outputs joined."""
    return torch.cat([run(x[:, a:b]) for a, b in SPANS], dim=1)


@pytest.mark.parametrize("make", [_m3, _m3_other])
def test_cached_decode_equals_transformers_cached_decode(make: Any) -> None:
    """Against transformers' own cache (the index keys cached beside the keys and values)."""
    hf = checks.hf_model(make(), T.AutoModel)
    ours = from_hf(hf)
    x = checks.tokens(26)
    theirs, own = T.DynamicCache(config=hf.config), ours.init_cache(2, 26)
    with torch.no_grad():
        ref = _stepwise(lambda t: hf(input_ids=t, cache=theirs, use_cache=True).last_hidden_state, x)
        assert checks.rel(_stepwise(lambda t: ours(t, cache=own), x), ref) <= checks.TOL


def test_layer_structure() -> None:
    ours = from_hf(checks.hf_model(_m3()))
    a0, a1 = ours.blocks[0].attn, ours.blocks[1].attn
    assert not isinstance(a0, IndexedAttention) and a0.rope.rotary_dim == 8 and a0.num_kv_heads == 2
    assert isinstance(a1, IndexedAttention) and isinstance(a1.indexer, BlockIndexer)
    assert (a1.indexer.block, a1.indexer.topk, a1.indexer.local) == (4, 2, 1) and a1.indexer.rope.rotary_dim == 8
    assert isinstance(ours.blocks[0].ffn, OaiSwiGLU) and ours.blocks[0].ffn.limit == 0.8
    moe = ours.blocks[1].ffn
    assert isinstance(moe, MixtureOfExperts) and moe.routed_scaling == 1.5 and moe.activation == "clamped_swiglu"
    assert isinstance(moe.shared_expert, OaiSwiGLU) and moe.norm_eps == 0.0


def test_parameter_counts_equal_transformers() -> None:
    for make in (_m3, _m3_other):
        hf = checks.hf_model(make())
        assert sum(p.numel() for p in from_hf(hf).parameters()) == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("make", [_m3, _m3_other])
def test_packed_sequences_equal_each_alone(make: Any) -> None:
    checks.check_packed_equals_each_alone(make)


def test_packed_training_gradients_equal_each_alone() -> None:
    """Float64: the indexers' weights get no gradient (a discrete block selection, as in transformers)."""
    checks.check_packed_gradients_equal_each_alone(_m3, no_gradient=".indexer.")


def test_config_json_without_defaults_loads(tmp_path: Path) -> None:
    """A ``config.json`` leaving out ``MiniMaxM3VLTextConfig``'s defaults (all MoE layers, every layer full)."""
    hf = checks.hf_model(_m3(layer_types=None, mlp_layer_types=None, swiglu_alpha=1.702, rms_norm_eps=1e-6,
                             index_local_blocks=1, routed_scaling_factor=2.0, swiglu_limit=7.0, num_experts_per_tok=4))
    checks.check_folder_without_keys(hf, tmp_path, (
        "layer_types", "mlp_layer_types", "swiglu_alpha", "rms_norm_eps", "index_local_blocks", "routed_scaling_factor",
        "swiglu_limit", "num_experts_per_tok", "tie_word_embeddings", "attention_dropout", "hidden_act", "rotary_dim"))


def test_released_config_keys_and_mtp_weights_load(tmp_path: Path) -> None:
    """The released ``config.json`` form: the indexer in ``sparse_attention_config`` (with
    ``sparse_attention_freq`` for the layer kinds), ``moe_layer_freq``, ``num_experts``; the checkpoint's
    ``model.mtp.*`` weights dropped. Read as transformers' ``from_pretrained`` reads them."""
    hf = checks.hf_model(_m3())
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    for key in ("layer_types", "mlp_layer_types", "index_n_heads", "index_block_size", "index_topk_blocks"):
        data.pop(key)
    data["num_experts"] = data.pop("num_local_experts")
    data["sparse_attention_config"] = {"sparse_attention_freq": [0, 1, 1], "sparse_num_index_heads": 2,
                                       "sparse_block_size": 4, "sparse_topk_blocks": 2}
    data["moe_layer_freq"] = [0, 1, 1]
    path.write_text(json.dumps(data))
    weights = safetensors_torch.load_file(tmp_path / "model.safetensors")
    weights["model.mtp.0.proj.weight"] = torch.zeros(3, 3)
    safetensors_torch.save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    again = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.layer_types == [F, S, S] and again.config.index_block_size == 4
    x = checks.tokens(20)
    with torch.no_grad():
        ref = again(input_ids=x).logits
        assert checks.rel(load_pretrained(tmp_path)(x), ref) <= checks.TOL
        assert checks.rel(ref, hf(input_ids=x).logits) <= checks.TOL


@pytest.mark.parametrize(("key", "value", "named"), [
    ("layer_types", ["sliding_attention", S, S], "sliding_attention"),
    ("mlp_layer_types", ["dense", "moe", "sparse"], "moe"),
    ("index_head_dim", 6, "index_head_dim"),
    ("index_n_heads", 3, "index_n_heads"),
    ("pretraining_tp", 2, "pretraining_tp"),
    ("rope_parameters", {"rope_type": "su", "rope_theta": 1e4}, "rope_type"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3125},
     "partial_rotary_factor"),
])
def test_options_it_cannot_reproduce_are_refused(key: str, value: Any, named: str) -> None:
    checks.check_refused(T.MiniMaxM3VLForCausalLM, _m3, key, value, named)


def test_register_attention_equals_eager() -> None:
    """transformers' own model with ``attn_implementation="attnzoo"`` on full-attention layers: its eager
    logits (a sparse layer passes ``block_indices``, which ``attnzoo.hf`` refuses by name)."""
    checks.check_register_equals_eager(checks.hf_model(_m3(layer_types=[F, F, F])))
    with pytest.raises(NotImplementedError, match="block_indices"):
        checks.check_register_equals_eager(checks.hf_model(_m3()))
