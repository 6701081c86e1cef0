"""The mixture-of-experts feed-forward (:class:`attnzoo.nn.moe.MixtureOfExperts`): equal to a
float64 token loop written from the routing formulas, and to transformers' own MoE blocks
(Qwen3-MoE, Qwen3-Next with its gated shared expert, gpt-oss, Llama-4, Kimi Linear) with their
weights mapped by :func:`attnzoo.models.families._moe.put_moe`, and Nemotron-H's (ungated relu^2
experts, group-limited sigmoid routing) mapped by
:func:`attnzoo.models.families.nemotron_h.put_nemotron_moe`."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from attnzoo.blocks import FeedForward
from attnzoo.models.families._moe import moe_from_config, put_moe
from attnzoo.models.hf._state import HFConfig, Plan, Source
from attnzoo.nn.moe import Experts, MixtureOfExperts, Routing
from twins import assert_same_forward_and_gradients

C, HID, E = 16, 12, 4


def _randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter, and the expert-choice bias buffers (ours ``score_bias``, transformers'
    ``e_score_correction_bias``), drawn from N(0, 0.25)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for name, b in module.named_buffers():
            if name.endswith(("score_bias", "e_score_correction_bias")):
                b.copy_(torch.randn(b.shape, generator=g) * 0.5)
    return module.eval()


def _x(n: int = 10, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(2, n, C, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _reference(moe: MixtureOfExperts, x: torch.Tensor) -> torch.Tensor:
    """Token loop in float64: route each token from the formulas, sum its experts' outputs."""
    p = {n: t.detach().double() for n, t in moe.named_parameters()}
    xs = x.double().reshape(-1, C)
    out = torch.zeros_like(xs)
    for t in range(xs.shape[0]):
        xt = xs[t]
        logits = p["router.weight"] @ xt + p.get("router.bias", 0.0)
        order = sorted(range(E), key=lambda e: -float(logits[e]))[: moe.top_k]
        if moe.routing == "sigmoid_topk":  # the bias picks, the sigmoid weights
            bias = moe.score_bias.double()
            order = sorted(range(E), key=lambda e: -float(torch.sigmoid(logits[e]) + bias[e]))[: moe.top_k]
            w = {e: torch.sigmoid(logits[e]) for e in order}
            if moe.norm_topk_prob:
                total = sum(w.values()) + moe.norm_eps
                w = {e: v / total for e, v in w.items()}
        elif moe.routing == "softmax_topk":
            probs = torch.softmax(logits, 0)
            w = {e: probs[e] for e in order}
            if moe.norm_topk_prob:
                total = sum(w.values())
                w = {e: v / total for e, v in w.items()}
        elif moe.routing == "topk_softmax":
            top = torch.stack([logits[e] for e in order]).softmax(0)
            w = dict(zip(order, top, strict=True))
        else:
            w = {e: torch.sigmoid(logits[e]) for e in order}
        for e in order:
            we = w[e] * moe.routed_scaling
            inp = xt * we if moe.weight_inputs else xt
            u = p["up_proj"][e] @ inp + (p["up_bias"][e] if moe.bias else 0.0)
            if moe.activation == "relu2":  # ungated: no gate_proj
                assert "gate_proj" not in p and "gate_bias" not in p
                h = torch.clamp(u, min=0) ** 2
            elif moe.activation == "swiglu":
                g = p["gate_proj"][e] @ inp + (p["gate_bias"][e] if moe.bias else 0.0)
                h = g * torch.sigmoid(g) * u
            elif moe.activation == "limited_swiglu":  # clipped after the activation (Ling's hybrids)
                g = p["gate_proj"][e] @ inp + (p["gate_bias"][e] if moe.bias else 0.0)
                lim = moe.swiglu_limit
                h = torch.clamp(g * torch.sigmoid(g), max=lim) * u.clamp(-lim, lim)
            else:
                g = p["gate_proj"][e] @ inp + (p["gate_bias"][e] if moe.bias else 0.0)
                lim, alpha = moe.swiglu_limit, moe.swiglu_alpha
                g, u = g.clamp(max=lim), u.clamp(-lim, lim)
                h = (u + 1) * g * torch.sigmoid(alpha * g)
            y = p["down_proj"][e] @ h + (p["down_bias"][e] if moe.bias else 0.0)
            out[t] += y if moe.weight_inputs else we * y
        if moe.shared_expert is not None:
            s = {n.split(".", 1)[1]: v for n, v in p.items() if n.startswith("shared_expert.")}
            if "gate_proj.weight" in s:
                hs = F.silu(s["gate_proj.weight"] @ xt) * (s["up_proj.weight"] @ xt)
            else:  # a relu^2 shared expert (Nemotron-H)
                hs = torch.clamp(s["up_proj.weight"] @ xt, min=0) ** 2
            sh = s["down_proj.weight"] @ hs
            if moe.shared_gate is not None:
                sh = sh * torch.sigmoid(p["shared_gate.weight"][0] @ xt)
            out[t] += sh
    return out.view(x.shape)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


CASES: dict[str, dict[str, Any]] = {
    "softmax_topk": {"routing": Routing("softmax_topk")},
    "softmax_topk_norm_scaled": {"routing": Routing("softmax_topk", norm_topk_prob=True, scaling=2.5)},
    "topk_softmax_clamped": {"routing": Routing("topk_softmax", bias=True),
                             "experts": Experts("clamped_swiglu", swiglu_limit=1.0, swiglu_alpha=1.702, bias=True)},
    "topk_sigmoid_inputs_shared": {"routing": Routing("topk_sigmoid", weight_inputs=True), "shared": True},
    "shared_gated": {"routing": Routing("softmax_topk", norm_topk_prob=True), "shared": True, "shared_gate": True},
    "sigmoid_topk_norm_scaled_shared": {"routing": Routing("sigmoid_topk", norm_topk_prob=True, scaling=2.5),
                                        "shared": True},
    "sigmoid_topk": {"routing": Routing("sigmoid_topk")},
    # LFM2-MoE: renormalised by sum + 1e-6 (the float64 comparison sees the 1e-6)
    "sigmoid_topk_norm_eps": {"routing": Routing("sigmoid_topk", norm_topk_prob=True, norm_eps=1e-6, scaling=0.5)},
    "relu2": {"experts": Experts("relu2")},
    "limited_swiglu": {"routing": Routing("sigmoid_topk", norm_topk_prob=True, scaling=2.5),
                       "experts": Experts("limited_swiglu", swiglu_limit=0.05)},
    "relu2_biased": {"routing": Routing("softmax_topk", norm_topk_prob=True), "experts": Experts("relu2", bias=True)},
    # Nemotron-H: sigmoid scores chosen with the bias, renormalised, scaled; a relu^2 shared expert
    "sigmoid_topk_relu2_shared": {"routing": Routing("sigmoid_topk", norm_topk_prob=True, scaling=2.5),
                                  "experts": Experts("relu2"), "shared": "relu2"},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_equals_float64_token_loop(case: str, top_k: int) -> None:
    kw = dict(CASES[case])
    shared_act = kw.pop("shared", False)
    shared = FeedForward(C, 8, "swiglu" if shared_act is True else shared_act, bias=False) if shared_act else None
    moe = _randomize(MixtureOfExperts(C, HID, E, top_k, shared_expert=shared, **kw))
    x = _x()
    with torch.no_grad():
        err = _rel(moe(x), _reference(moe, x))
    assert err < 1e-5, f"{case}, top_k={top_k}: relative error {err:.2e}"
    moe64 = moe.double()
    with torch.no_grad():
        assert _rel(moe64(x.double()), _reference(moe64, x)) < 1e-12


def _check_gradients_reach_the_chosen_experts(moe: MixtureOfExperts, weight: str) -> None:
    """A backward through ``moe`` reaches the per-expert ``weight`` of exactly the experts routed to."""
    x = _x(32).requires_grad_(True)
    moe(x).square().sum().backward()
    chosen = torch.unique(moe.route(x.detach().reshape(-1, C))[1])
    assert x.grad is not None and torch.isfinite(x.grad).all()
    grad = getattr(moe, weight).grad
    for e in range(E):
        assert bool((grad[e] != 0).any()) == bool((chosen == e).any())


def test_moe_gradients_reach_every_chosen_expert() -> None:
    moe = _randomize(MixtureOfExperts(C, HID, E, 2, routing=Routing(norm_topk_prob=True)))
    _check_gradients_reach_the_chosen_experts(moe, "gate_proj")
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0


def test_relu2_experts_have_no_gate() -> None:
    """Ungated experts: no ``gate_proj`` / ``gate_bias`` parameter or state-dict key; every other
    name as for gated experts; gradients reach ``up_proj`` of exactly the chosen experts."""
    moe = _randomize(MixtureOfExperts(C, HID, E, 2, experts=Experts("relu2", bias=True)))
    assert moe.gate_proj is None and moe.gate_bias is None and not moe.gated
    assert sorted(moe.state_dict()) == ["down_bias", "down_proj", "router.weight", "up_bias", "up_proj"]
    assert sum(p.numel() for p in moe.parameters()) == E * C + 2 * E * HID * C + E * HID + E * C
    gated = MixtureOfExperts(C, HID, E, 2, experts=Experts("swiglu", bias=True))
    assert set(gated.state_dict()) - set(moe.state_dict()) == {"gate_proj", "gate_bias"}
    assert "activation='relu2'" in repr(moe)
    _check_gradients_reach_the_chosen_experts(moe, "up_proj")
    moe.reset_parameters()  # skips the missing gate
    assert float(moe.up_proj.detach().abs().max()) <= 1 / C ** 0.5


def test_sigmoid_routing_runs_its_router_in_float32() -> None:
    """``"sigmoid_topk"`` computes its logits as transformers' DeepSeek-V3 / Kimi / Nemotron-H
    routers do, ``linear(x.float(), W.float())``, from a half-precision input: a bfloat16 matmul
    rounds the logits (and the sigmoid scores near ties pick other experts)."""
    moe = _randomize(MixtureOfExperts(C, HID, E, 2, routing=Routing("sigmoid_topk", norm_topk_prob=True),
                                      experts=Experts("relu2"))).to(torch.bfloat16)
    x = _x(40).reshape(-1, C).bfloat16()
    with torch.no_grad():
        weights, experts, logits = moe.route(x)
    want = F.linear(x.float(), moe.router.weight.float())
    assert logits.dtype == torch.float32 and torch.equal(logits, want)
    assert not torch.equal(logits, moe.router(x).float())  # the bfloat16 matmul is not that
    probs = torch.sigmoid(want)
    assert torch.equal(experts, torch.topk(probs + moe.score_bias, 2, dim=-1)[1])
    assert weights.dtype == torch.bfloat16


def test_moe_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match=r"top_k \(5\) must be <= num_experts \(4\)"):
        MixtureOfExperts(C, HID, E, 5)
    with pytest.raises(ValueError, match="Routing: kind must be one of"):
        Routing("softmax")
    with pytest.raises(ValueError, match="Routing: norm_topk_prob applies to kind='softmax_topk'"):
        Routing("topk_softmax", norm_topk_prob=True)
    with pytest.raises(ValueError, match="Routing: scaling must be a finite positive number"):
        Routing(scaling=float("inf"))
    with pytest.raises(TypeError, match="Routing: weight_inputs must be a bool"):
        Routing(weight_inputs=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Routing: norm_eps applies to kind='sigmoid_topk', got 'softmax_topk'"):
        Routing("softmax_topk", norm_topk_prob=True, norm_eps=1e-6)
    with pytest.raises(ValueError, match="Routing: norm_eps must be a finite non-negative number"):
        Routing("sigmoid_topk", norm_eps=-1e-6)
    with pytest.raises(ValueError, match="Routing: norm_eps must be a finite non-negative number"):
        Routing("sigmoid_topk", norm_eps=float("nan"))
    with pytest.raises(TypeError, match="Routing: norm_eps must be a float"):
        Routing("sigmoid_topk", norm_eps=True)  # type: ignore[arg-type]
    assert Routing("sigmoid_topk", norm_eps=0).norm_eps == 0.0 and Routing().norm_eps == 1e-20
    with pytest.raises(ValueError, match="Experts: activation must be one of"):
        Experts("gelu")
    with pytest.raises(ValueError, match="clamped_swiglu' needs swiglu_limit"):
        Experts("clamped_swiglu")
    with pytest.raises(ValueError, match=r"only it takes them\), got activation='relu2', swiglu_limit=1\.0"):
        Experts("relu2", swiglu_limit=1.0)
    with pytest.raises(ValueError, match="only it takes them"):
        Experts("relu2", swiglu_limit=1.0, swiglu_alpha=1.702)
    with pytest.raises(ValueError, match="only it takes them"):  # one of the two was silently accepted
        Experts("swiglu", swiglu_alpha=1.702)
    with pytest.raises(ValueError, match="needs swiglu_limit and swiglu_alpha"):
        Experts("clamped_swiglu", swiglu_limit=7.0)
    with pytest.raises(ValueError, match="limited_swiglu' needs swiglu_limit and takes no swiglu_alpha"):
        Experts("limited_swiglu")
    with pytest.raises(ValueError, match="limited_swiglu' needs swiglu_limit and takes no swiglu_alpha"):
        Experts("limited_swiglu", swiglu_limit=7.0, swiglu_alpha=1.0)
    with pytest.raises(ValueError, match="Experts: activation must be one of"):
        Experts("relu")
    with pytest.raises(TypeError, match="Experts: bias must be a bool"):
        Experts(bias="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="routing must be a Routing or None, got str"):
        MixtureOfExperts(C, HID, E, 2, routing="softmax_topk")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="experts must be an Experts or None, got str"):
        MixtureOfExperts(C, HID, E, 2, experts="swiglu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shared_gate=True needs a shared_expert"):
        MixtureOfExperts(C, HID, E, 2, shared_gate=True)
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., 16\]"):
        MixtureOfExperts(C, HID, E, 2)(torch.zeros(2, 3, 8))


# --------------------------------------------------------------------------- transformers' blocks
transformers = pytest.importorskip("transformers")
T = transformers


def _hf_blocks() -> dict[str, tuple[Any, Any, str]]:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    common = dict(hidden_size=C, num_experts_per_tok=2)
    return {
        "qwen3_moe": (Qwen3MoeSparseMoeBlock, T.Qwen3MoeConfig(num_experts=E, moe_intermediate_size=HID,
                                                               norm_topk_prob=False, **common), "stacked"),
        "qwen3_moe_norm": (Qwen3MoeSparseMoeBlock, T.Qwen3MoeConfig(num_experts=E, moe_intermediate_size=HID,
                                                                    norm_topk_prob=True, **common), "stacked"),
        "qwen3_next": (Qwen3NextSparseMoeBlock, T.Qwen3NextConfig(num_experts=E, moe_intermediate_size=HID,
                                                                  shared_expert_intermediate_size=8,
                                                                  norm_topk_prob=True, **common), "stacked"),
        "gpt_oss": (GptOssMLP, T.GptOssConfig(num_local_experts=E, intermediate_size=HID, swiglu_limit=1.5,
                                              **common), "interleaved"),
        "llama4": (Llama4TextMoe, T.Llama4TextConfig(num_local_experts=E, intermediate_size=HID,
                                                     intermediate_size_mlp=HID, hidden_size=C,
                                                     num_experts_per_tok=1), "transposed"),
        "kimi_linear": (KimiLinearMoE, T.KimiLinearConfig(num_local_experts=E, moe_intermediate_size=HID,
                                                          n_shared_experts=2, routed_scaling_factor=2.5,
                                                          **common), "deepseek"),
    }


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_norm", "qwen3_next", "gpt_oss", "llama4", "kimi_linear"])
def test_moe_equals_transformers_block(name: str) -> None:
    cls, cfg, layout = _hf_blocks()[name]
    theirs = _randomize(cls(cfg))
    ours = moe_from_config(HFConfig(cfg.to_dict(), name, name), layout)
    plan = Plan(Source({k: v.detach() for k, v in theirs.state_dict().items()}), name)
    put_moe(plan, "", "", layout, shared=ours.shared_expert is not None, shared_gate=ours.shared_gate is not None)
    plan.apply(ours)
    x = _x(9)
    with torch.no_grad():
        ref = theirs(x)
        ref = ref[0] if isinstance(ref, tuple) else ref
        err = _rel(ours(x).reshape(ref.shape), ref)
    assert err < 1e-5, f"{name}: relative error {err:.2e}"


def test_half_casts_keep_the_expert_choice_bias_in_float32() -> None:
    """``score_bias`` is float32 at construction in any dtype; ``.to(bfloat16)`` rounded it (the
    bias decides the top-k near ties), so the two ways of getting a bfloat16 model disagreed."""
    torch.manual_seed(0)
    moe = MixtureOfExperts(16, 8, 4, 2, routing=Routing(kind="sigmoid_topk"))
    with torch.no_grad():
        moe.score_bias.copy_(torch.randn(4) * 1e-3 + 0.1)
    built = MixtureOfExperts(16, 8, 4, 2, routing=Routing(kind="sigmoid_topk"), dtype=torch.bfloat16)
    built.load_state_dict(moe.state_dict())
    cast = moe.to(torch.bfloat16)
    assert cast.score_bias.dtype == built.score_bias.dtype == torch.float32
    assert torch.equal(cast.score_bias, built.score_bias)
    x = torch.randn(5, 16).bfloat16()
    assert torch.equal(cast(x), built(x))
    assert cast.double().score_bias.dtype == torch.float64  # wider casts apply as usual


@pytest.mark.parametrize(("groups", "topk_groups", "norm"), [(1, 1, True), (2, 1, True), (2, 2, False)])
def test_moe_equals_nemotron_h_block(groups: int, topk_groups: int, norm: bool) -> None:
    """transformers' ``NemotronHMoE`` (ungated relu^2 experts, sigmoid scores with the correction
    bias choosing, group-limited, ``routed_scaling_factor``, a relu^2 shared expert) equals the
    converter's :class:`MixtureOfExperts`, weights from the in-memory (stacked) names."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    from attnzoo.models.families.nemotron_h import moe_factory, put_nemotron_moe

    cfg = T.NemotronHConfig(hidden_size=C, n_routed_experts=E, num_experts_per_tok=2, moe_intermediate_size=HID,
                            moe_shared_expert_intermediate_size=8, n_group=groups, topk_group=topk_groups,
                            norm_topk_prob=norm, routed_scaling_factor=2.5)
    theirs = _randomize(NemotronHMoE(cfg))
    hf = HFConfig(cfg.to_dict(), "nemotron_h", "nemotron_h")
    ours = moe_factory(hf, "relu2")()
    assert ours.gate_proj is None and ours.groups == groups and ours.norm_topk_prob == norm
    plan = Plan(Source({k: v.detach() for k, v in theirs.state_dict().items()}), "nemotron_h")
    put_nemotron_moe(plan, "", "", E, mlp_bias=False)
    plan.apply(ours)
    x = _x(9)
    with torch.no_grad():
        err = _rel(ours(x), theirs(x))
    assert err < 1e-5, f"relative error {err:.2e}"


@pytest.mark.parametrize("routing", ["sigmoid_topk", "softmax_topk", "topk_softmax"])
def test_keep_router_float32_keeps_the_router_through_half_casts(routing: str) -> None:
    """``keep_router_float32=True`` (transformers' ``gate.weight`` in ``_keep_in_fp32_modules_strict``):
    the router weight and bias are float32 when built in bfloat16 and after ``.half()`` /
    ``.bfloat16()`` / ``.to()``, the same ``nn.Parameter`` (its value exact: a float32 checkpoint's);
    the other weights follow the casts; wider casts apply as usual."""
    kw: dict[str, Any] = {"routing": Routing(routing, bias=True)}
    moe = _randomize(MixtureOfExperts(C, HID, E, 2, keep_router_float32=True, **kw))
    want = moe.router.weight.detach().clone()
    built = MixtureOfExperts(C, HID, E, 2, keep_router_float32=True, dtype=torch.bfloat16, **kw)
    assert built.router.weight.dtype == built.router.bias.dtype == torch.float32
    assert built.up_proj.dtype == torch.bfloat16
    built.load_state_dict(moe.state_dict())
    assert torch.equal(built.router.weight, want)
    param = moe.router.weight
    for cast, dtype in ((moe.half, torch.float16), (moe.bfloat16, torch.bfloat16),
                        (lambda: moe.to(torch.float16), torch.float16)):
        cast()
        assert moe.router.weight is param and moe.router.weight.dtype == moe.router.bias.dtype == torch.float32
        assert torch.equal(moe.router.weight, want) and moe.up_proj.dtype == dtype
    assert moe.double().router.weight.dtype == torch.float64
    plain = MixtureOfExperts(C, HID, E, 2, dtype=torch.bfloat16, **kw)
    assert not plain.keep_router_float32 and plain.router.weight.dtype == torch.bfloat16
    assert MixtureOfExperts(C, HID, E, 2, **kw).keep_router_in_float32().keep_router_float32
    with pytest.raises(TypeError, match="keep_router_float32 must be a bool"):
        MixtureOfExperts(C, HID, E, 2, keep_router_float32=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("routing", ["sigmoid_topk", "softmax_topk", "topk_softmax", "topk_sigmoid"])
def test_keep_router_float32_routes_in_float32_and_leaves_float32_unchanged(routing: str) -> None:
    """In float32 the option changes nothing (bit for bit, forward and gradients); in bfloat16 the
    logits are ``linear(x.float(), W)`` from the float32 weight, the output is bfloat16, and
    gradients reach the float32 router weight."""
    kw: dict[str, Any] = {"routing": Routing(routing, weight_inputs=routing == "topk_sigmoid")}
    plain = _randomize(MixtureOfExperts(C, HID, E, 2, **kw))
    kept = MixtureOfExperts(C, HID, E, 2, keep_router_float32=True, **kw)
    kept.load_state_dict(plain.state_dict())
    x = _x(12)
    assert_same_forward_and_gradients(plain, kept, x)
    kept.zero_grad()
    kept.bfloat16()
    xb = _x(12).bfloat16()
    _, _, logits = kept.route(xb.reshape(-1, C))
    assert logits.dtype == torch.float32
    assert torch.equal(logits, F.linear(xb.reshape(-1, C).float(), kept.router.weight))
    out = kept(xb)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    out.float().square().sum().backward()
    grad = kept.router.weight.grad
    assert grad is not None and grad.dtype == torch.float32 and float(grad.abs().sum()) > 0
    kept.half()  # a float32 gradient stays float32 with its weight
    assert kept.router.weight.grad.dtype == torch.float32
