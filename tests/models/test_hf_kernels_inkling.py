"""``attnzoo.hf.register()`` on transformers' Inkling, Inkling2 and Inkling2-loop text models
(2026: short convolutions in every layer, sliding and full attention, MoE), whose convolutions
call the ``causal_conv1d`` hooks: with attnzoo's kernels served, the logits of a batch and greedy
generation (cached decode) equal those with transformers' own fallback put back, and Inkling2's
padding-free packed input gives each sequence's logits alone. (``from_hf`` converts them too: ``tests/models/test_hf_inkling.py``,
``test_hf_inkling2.py``, ``test_hf_inkling2_loop.py``.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnzoo.hf as azhf  # noqa: E402
import hf_family_checks as checks  # noqa: E402
from attnzoo import hf_kernels  # noqa: E402

T = transformers
pytestmark = pytest.mark.usefixtures("one_thread")
azhf.register()

SMALL = dict(vocab_size=checks.V, unpadded_vocab_size=checks.V, hidden_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
             swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=8, rel_extent=32,
             max_position_embeddings=256, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
             pad_token_id=0, eos_token_id=2, log_scaling_n_floor=64)

#: transformers' modeling module -> (config class, causal LM class, the config's own keys)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "inkling": ("InklingTextConfig", "InklingForCausalLM", {"intermediate_size": 96, "n_shared_experts": 1}),
    "inkling2": ("Inkling2TextConfig", "Inkling2ForCausalLM", {"n_layers_per_attn_res_block": 2}),
    "inkling2_loop": ("Inkling2LoopTextConfig", "Inkling2LoopForCausalLM",
                      {"n_layers_per_attn_res_block": 2, "loop_layer_index_start": 2, "loop_layer_index_end": 4,
                       "loop_num_passes": 2, "loop_gate_rank": 8}),
}


def _model(family: str) -> Any:
    config, model, own = FAMILIES[family]
    torch.manual_seed(0)
    hf = getattr(T, model)(getattr(T, config)(**SMALL, **own)).eval()
    return checks.perturbed(hf)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_served_convolutions_equal_the_fallback(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    modeling = __import__(f"transformers.models.{family}.modeling_{family}", fromlist=["_"])
    served = [fn for (mod, fn) in hf_kernels.ORIGINALS if mod == family]
    assert {"causal_conv1d_fn", "causal_conv1d_update"} <= set(served)
    hf = _model(family)
    x = checks.tokens(30)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logits = hf(input_ids=x).logits
        gen = hf.generate(input_ids=x[:1, :7], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        return logits, gen

    ours, gen = run()
    for fn in served:
        monkeypatch.setattr(modeling, fn, hf_kernels.ORIGINALS[(family, fn)])
    ref, ref_gen = run()
    err = checks.rel(ours, ref)
    assert err <= checks.TOL, f"{family}: served vs fallback, max rel error {err:.2e}"
    assert torch.equal(gen, ref_gen), f"{family}: greedy generation differs\n{gen}\n{ref_gen}"


def test_inkling2_packed_sequences_equal_each_alone() -> None:
    checks.check_transformers_packed(_model("inkling2"))
