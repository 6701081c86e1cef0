"""Group-limited expert routing (DeepSeek-V3 / Kimi Linear ``n_group`` / ``topk_group``) of
:class:`attnzoo.nn.moe.MixtureOfExperts`, against a per-token loop written from the definition."""

from __future__ import annotations

import pytest
import torch

from attnzoo.nn.moe import MixtureOfExperts, Routing


def _loop_choice(probs: torch.Tensor, bias: torch.Tensor, groups: int, topk_groups: int, k: int) -> list[set[int]]:
    """Per token: group score = sum of its two largest ``p + bias``; experts of the best groups only."""
    out = []
    per = probs.shape[-1] // groups
    for row in probs + bias:
        scores = [sorted(row[g * per:(g + 1) * per].tolist(), reverse=True) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -(scores[g][0] + scores[g][1]))[:topk_groups]
        allowed = [e for g in best for e in range(g * per, (g + 1) * per)]
        out.append(set(sorted(allowed, key=lambda e: -float(row[e]))[:k]))
    return out


def test_grouped_routing_picks_from_the_best_groups() -> None:
    torch.manual_seed(0)
    moe = MixtureOfExperts(16, 8, 8, 3, routing=Routing("sigmoid_topk", groups=4, topk_groups=2, norm_topk_prob=True))
    with torch.no_grad():
        moe.score_bias.copy_(torch.randn(8) * 0.5)
    x = torch.randn(40, 16)
    with torch.no_grad():
        weights, experts, logits = moe.route(x)
    probs = torch.sigmoid(logits.float())
    want = _loop_choice(probs, moe.score_bias, 4, 2, 3)
    assert [set(e.tolist()) for e in experts] == want
    kept = probs.gather(-1, experts)
    assert torch.allclose(weights, kept / (kept.sum(-1, keepdim=True) + 1e-20), atol=1e-6)
    y = moe(x)
    assert y.shape == x.shape and torch.isfinite(y).all()


def test_one_group_is_the_plain_routing() -> None:
    torch.manual_seed(1)
    a = MixtureOfExperts(16, 8, 8, 2, routing=Routing("sigmoid_topk"))
    b = MixtureOfExperts(16, 8, 8, 2, routing=Routing("sigmoid_topk", groups=1, topk_groups=1))
    b.load_state_dict(a.state_dict())
    x = torch.randn(9, 16)
    assert torch.equal(a(x), b(x))


@pytest.mark.parametrize(("routing", "experts", "top_k", "match"), [
    (dict(kind="softmax_topk", groups=2), 8, 2, "sigmoid_topk"),
    (dict(kind="sigmoid_topk", groups=2, topk_groups=3), 8, 2, "topk_groups"),
    (dict(kind="sigmoid_topk", groups=3), 8, 2, "divisible"),
    (dict(kind="sigmoid_topk", groups=8), 8, 2, "groups of >= 2"),
    (dict(kind="sigmoid_topk", groups=4, topk_groups=1), 8, 3, "top_k=3"),
    (dict(kind="sigmoid_topk", groups=0), 8, 2, "groups"),
])
def test_bad_grouped_routing_is_named(routing: dict, experts: int, top_k: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MixtureOfExperts(16, 8, experts, top_k, routing=Routing(**routing))
