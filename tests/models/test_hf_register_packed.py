"""Padding-free (packed) input through ``attn_implementation="attnzoo"``: transformers' packed
mask (built from ``position_ids`` restarting at 0, as ``DataCollatorWithFlattening`` makes them)
reaches :func:`attnzoo.attention_varlen` as sequence boundaries, never as a dense ``[N, N]`` mask;
the logits equal each sequence run alone (and eager on the packed batch), forward and gradients,
for full, sliding-window and hybrid (gated DeltaNet + attention) models."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnzoo.hf as azhf  # noqa: E402
import hf_family_checks as checks  # noqa: E402

azhf.register()
T = transformers
LENGTHS = (6, 1, 13, 9)

CONFIGS: dict[str, Callable[[], Any]] = {
    "llama": lambda: T.LlamaConfig(**{**checks.SMALL, "num_hidden_layers": 2}),
    "mistral": lambda: T.MistralConfig(**{**checks.SMALL, "num_hidden_layers": 2, "sliding_window": 4}),
    "qwen3_next": lambda: T.Qwen3NextConfig(**{**checks.SMALL, "num_hidden_layers": 4, "head_dim": 16,
                                               "num_experts": 4, "num_experts_per_tok": 2,
                                               "moe_intermediate_size": 32, "shared_expert_intermediate_size": 24,
                                               "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                               "linear_key_head_dim": 8, "linear_value_head_dim": 8}),
}


def _model(family: str, impl: str) -> Any:
    torch.manual_seed(0)
    return checks.perturbed(T.AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation=impl))


def _packed() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    seqs = [checks.tokens(n, batch=1, seed=30 + i) for i, n in enumerate(LENGTHS)]
    return seqs, torch.cat(seqs, dim=1), torch.cat([torch.arange(n) for n in LENGTHS])[None]


def _flat(family: str) -> dict[str, Any]:
    """The linear-attention layers of a hybrid learn the boundaries only from ``cu_seq_lens_*``
    (transformers hands them no ``position_ids``): ``DataCollatorWithFlattening(
    return_flash_attn_kwargs=True)`` adds them; attention-only models need ``position_ids`` only."""
    if family != "qwen3_next":
        return {}
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(LENGTHS), "max_length_k": max(LENGTHS)}


class _VarlenSpy:
    """Counts the calls of attention_varlen and of the dense-mask fallback."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.cu: list[list[int]] = []
        self.dense = 0
        real_varlen, real_dense = azhf.attention_varlen, azhf.HFMask.to_dense

        def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                   **kw: Any) -> Any:
            self.cu.append(cu_q.tolist())
            return real_varlen(q, k, v, cu_q, cu_k, **kw)

        def dense(mask: Any) -> torch.Tensor:
            self.dense += 1
            return real_dense(mask)

        monkeypatch.setattr(azhf, "attention_varlen", varlen)
        monkeypatch.setattr(azhf.HFMask, "to_dense", dense)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_packed_logits_equal_each_alone_through_varlen(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(family, "attnzoo")
    seqs, ids, pos = _packed()
    cu = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    flat = _flat(family)
    spy = _VarlenSpy(monkeypatch)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False, **flat).logits
    assert spy.cu and all(c == cu for c in spy.cu), f"{family}: attention_varlen calls {spy.cu}, want {cu}"
    assert spy.dense == 0, f"{family}: a dense mask was built for packed input"
    with torch.no_grad():
        alone = torch.cat([model(input_ids=s, use_cache=False).logits for s in seqs], dim=1)
        eager = _model(family, "eager")(input_ids=ids, position_ids=pos, use_cache=False).logits \
            if family != "qwen3_next" else alone  # eager hybrid refuses packed input without fla
    for name, ref in (("each alone", alone), ("eager packed", eager)):
        err = checks.rel(packed, ref)
        assert err <= checks.TOL, f"{family}: packed vs {name}, lengths {LENGTHS}: max rel error {err:.2e}"


@pytest.mark.parametrize("family", ["mistral", "qwen3_next"])
def test_packed_gradients_equal_each_alone(family: str) -> None:
    """One padding-free training step: parameter gradients equal the sum over sequences alone."""
    model = _model(family, "attnzoo").train()
    seqs, ids, pos = _packed()
    model(input_ids=ids, position_ids=pos, use_cache=False, **_flat(family)).logits.square().sum().backward()
    packed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for s in seqs:
        model(input_ids=s, use_cache=False).logits.square().sum().backward()
    for (name, p), g in zip(model.named_parameters(), packed, strict=True):
        assert checks.rel(g, p.grad) <= 1e-4, f"gradient of {name}: packed vs each alone"


def test_packed_mask_structure_and_dense_fallback() -> None:
    """The mask interface keeps the sequence ids; ``to_dense`` equals transformers' own packed mask,
    and a request the packed path does not serve (attention weights) uses that dense mask."""
    from transformers import masking_utils as mu

    ids = torch.tensor([[0, 0, 1, 1, 1, 2]])
    pos = torch.tensor([[0, 1, 0, 1, 2, 0]])
    fn = mu.and_masks(mu.remap_positions_for_packed_sequence(mu.sliding_window_causal_mask_function(2), pos),
                      mu.packed_sequence_mask_function(ids))
    mask = azhf.attnzoo_mask(1, 6, 6, mask_function=fn)
    assert isinstance(mask, azhf.HFMask) and mask.segments is not None and mask.window == (1, 0)
    assert mask.cu_seqlens().tolist() == [0, 2, 5, 6]
    want = mu.sdpa_mask(1, 6, 6, mask_function=fn, allow_is_causal_skip=False)
    assert torch.equal(mask.to_dense(), want)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    out, weights = azhf.attnzoo_attention_forward(torch.nn.Module(), q, k, v, mask, output_attentions=True)
    ref, _ = azhf.attnzoo_attention_forward(torch.nn.Module(), q, k, v, mask)
    assert weights is not None and bool((weights[0, 0][~want[0, 0]] == 0).all())
    assert checks.rel(out, ref) <= 1e-5
