"""Parts, injected (issue 32): the softmax attention modules take QK-norms, an output gate, sink
logits and score changes as modules passed in (``parts=AttentionParts(...)``), never as ``**kwargs``.

* the injected parts and the registry builders' keywords (``qk_norm="head"``, ``sinks=True``, ...)
  build the same module: same seed, same state dict, same outputs;
* state dicts saved in the layout before this change (the parts under ``frontier.``) still load;
* bad input names the argument; no constructor takes ``**kwargs`` or more than 12 parameters;
* cached decoding equals the full forward with every part injected.
"""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch

import attnzoo as az
from attnzoo.nn.attention import build_softmax
from attnzoo.nn.mla import MLAOptions
from attnzoo.nn.parts import AttentionParts, OutputGate, QKNorm, Scores, qk_rmsnorm, sink_logits
from attnzoo.variants import build_attention

C, H, HKV, D = 32, 4, 2, 8
DT = torch.float64


def _parts(qk_norm: str | None = "head", gate: str | None = "element", sinks: bool = True, eps: float = 1e-6,
           scores: Scores | None = None, heads: int = H, kv_heads: int = HKV) -> AttentionParts:
    """What a family builder does: build the parts, in the builders' order (norms, sinks, gate)."""
    q_norm, k_norm = (None, None) if qk_norm is None else qk_rmsnorm(qk_norm, heads, kv_heads, D, eps)
    return AttentionParts(q_norm=q_norm, k_norm=k_norm, sinks=sink_logits(heads) if sinks else None,
                          output_gate=None if gate is None else OutputGate(C, heads, D, gate), scores=scores)


def _randomise(m: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in m.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


# name, builder settings, the injected module (a callable of the parts' settings)
CASES = [
    ("mha", {"num_kv_heads": HKV, "rope": True, "qk_norm": "head", "output_gate": "element", "sinks": True},
     lambda: az.MultiHeadAttention(C, H, num_kv_heads=HKV, causal=True, rope=True, parts=_parts())),
    ("gqa", {"num_kv_heads": HKV, "qk_norm": "all", "qk_norm_eps": 0.25, "output_gate": "head", "sinks": True,
             "softcap": 0.9},
     lambda: az.GroupedQueryAttention(C, H, HKV, causal=True, parts=_parts("all", "head", eps=0.25,
                                                                          scores=Scores(softcap=0.9)))),
    ("mqa", {"qk_norm": "all", "alibi": True, "scale": 0.3},
     lambda: az.MultiQueryAttention(C, H, causal=True, parts=_parts("all", None, False, kv_heads=1,
                                                                   scores=Scores(alibi=True, scale=0.3)))),
    ("sliding", {"window": 3, "num_kv_heads": HKV, "rope": True, "qk_norm": "head", "sinks": True},
     lambda: az.SlidingWindowAttention(C, H, 3, num_kv_heads=HKV, rope=True, parts=_parts(gate=None))),
    ("streaming", {"window": 3, "global_tokens": (0, 1), "rope": True, "sinks": True, "output_gate": "head"},
     lambda: az.SlidingWindowAttention(C, H, window=3, sink_tokens=2, rope=True,
                                       parts=_parts(None, "head", kv_heads=H))),
    ("local_global", {"window": 2, "global_tokens": (0, 5), "qk_norm": "head", "sinks": True},
     lambda: az.LocalGlobalAttention(C, H, 2, (0, 5), True, parts=_parts(gate=None, kv_heads=H))),
    ("sigmoid", {"sigmoid_bias": -1.5, "qk_norm": "head", "softcap": 2.0},
     lambda: az.SigmoidAttention(C, H, causal=True, sigmoid_bias=-1.5,
                                 parts=_parts(gate=None, sinks=False, kv_heads=H, scores=Scores(softcap=2.0)))),
]


@pytest.mark.parametrize(("name", "settings", "make"), CASES, ids=[c[0] for c in CASES])
def test_injected_parts_equal_the_builder_keywords(name, settings, make) -> None:
    torch.manual_seed(0)
    built = build_attention(name, C, H, **settings)
    torch.manual_seed(0)
    injected = make()
    assert type(injected) is type(built)
    sd_b, sd_i = built.state_dict(), injected.state_dict()
    assert list(sd_b) == list(sd_i)
    for k in sd_b:
        torch.testing.assert_close(sd_i[k], sd_b[k], rtol=0, atol=0, msg=k)
    _randomise(built.to(DT)), _randomise(injected.to(DT))
    x = torch.randn(2, 9, C, dtype=DT)
    torch.testing.assert_close(injected(x), built(x), rtol=0, atol=0)


OLD_KEYS = {  # the layout before issue 32 (main), written out: the parts lived in FrontierParts at `frontier.`
    "qkv_proj.weight": ((H + 2 * HKV) * D, C), "qkv_proj.bias": ((H + 2 * HKV) * D,),
    "out_proj.weight": (C, H * D), "out_proj.bias": (C,),
    "frontier.sinks": (H,), "frontier.q_norm_weight": (D,), "frontier.k_norm_weight": (D,),
    "frontier.gate_proj.weight": (H * D, C),
}


def test_old_state_dict_keys_load() -> None:
    g = torch.Generator().manual_seed(5)
    old = {k: torch.randn(shape, generator=g) for k, shape in OLD_KEYS.items()}
    m = az.MultiHeadAttention(C, H, num_kv_heads=HKV, causal=True, rope=True, parts=_parts())
    assert set(m.state_dict()) == set(OLD_KEYS)
    m.load_state_dict(old)  # strict
    p = m.parts
    torch.testing.assert_close(p.sinks.detach(), old["frontier.sinks"])
    torch.testing.assert_close(p.q_norm.weight.detach(), old["frontier.q_norm_weight"])  # the injected module's own
    torch.testing.assert_close(p.k_norm.weight.detach(), old["frontier.k_norm_weight"])
    torch.testing.assert_close(p.gate_proj.weight.detach(), old["frontier.gate_proj.weight"])
    x = torch.randn(1, 5, C)
    want = m(x)
    # assign=True replaces the parameters: the module reads the registered ones, not stale copies
    fresh = az.MultiHeadAttention(C, H, num_kv_heads=HKV, causal=True, rope=True, parts=_parts())
    fresh.load_state_dict({k: v.clone() for k, v in old.items()}, assign=True)
    torch.testing.assert_close(fresh(x), want)
    # and a builder-made module (attention_kwargs dicts, HF converters) loads it too
    built = build_attention("gqa", C, H, num_kv_heads=HKV, rope=True, qk_norm="head", output_gate="element",
                            sinks=True)
    built.load_state_dict(old)
    torch.testing.assert_close(built(x), want)


def test_named_parameters_keep_the_converter_names() -> None:
    """The HF converters fill ``named_parameters()`` by name: each part appears once, under its old name."""
    m = build_attention("mha", C, H, qk_norm="all", sinks=True, output_gate="head")
    names = [n for n, _ in m.named_parameters()]
    assert [n for n in names if n.startswith("frontier.")] == [
        "frontier.sinks", "frontier.q_norm_weight", "frontier.k_norm_weight", "frontier.gate_proj.weight"]


def test_copies_keep_their_own_parts() -> None:
    m = _randomise(az.MultiHeadAttention(C, H, causal=True, parts=_parts(kv_heads=H)))
    x = torch.randn(1, 6, C)
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        torch.testing.assert_close(clone(x), m(x))
        with torch.no_grad():
            clone.frontier.q_norm_weight.mul_(3.0)
        assert not torch.allclose(clone(x), m(x))  # the clone's norm reads the clone's weight


def test_device_and_dtype_through_the_builder() -> None:
    rope = az.RotaryEmbedding(D)
    score_mod = torch.nn.Linear(1, 1)  # a module score_mod keeps its own dtype (a learned bias, say)
    m = build_attention("mha", C, H, rope=rope, qk_norm="head", sinks=True, output_gate="element",
                        score_mod=lambda s, b, h, qi, ki: s, dtype=DT, device="cpu")
    assert {p.dtype for p in m.parameters()} == {DT} and m.rope is rope
    m2 = build_softmax(az.MultiHeadAttention, C, H, dtype=torch.bfloat16,
                       score_mod=score_mod)  # type: ignore[arg-type]
    assert m2.qkv_proj.weight.dtype == torch.bfloat16 and score_mod.weight.dtype == torch.float32
    mla = build_attention("mla", C, H, dtype=DT, form="materialised", norm_eps=1e-5)
    assert {p.dtype for p in mla.parameters()} == {DT} and mla.form == "materialised"
    assert isinstance(mla.options, MLAOptions) and mla.options.norm_eps == 1e-5
    ready = _parts(kv_heads=H)  # ready-made parts pass through a builder (and take its dtype)
    m3 = build_attention("mha", C, H, parts=ready, dtype=DT)
    assert m3.parts is ready and ready.q_norm_weight.dtype == DT and ready.q_norm.weight is ready.q_norm_weight


# --------------------------------------------------------------------------- decode == full
DECODE = [
    ("mha", lambda: az.MultiHeadAttention(C, H, num_kv_heads=HKV, causal=True, rope=True, parts=_parts(
        scores=Scores(softcap=1.5, score_mod=lambda s, b, h, qi, ki: s - 0.05 * (qi - ki))))),
    ("sliding", lambda: az.SlidingWindowAttention(C, H, 3, num_kv_heads=HKV, rope=True, parts=_parts("all"))),
    ("streaming", lambda: az.StreamingAttention(C, H, 3, sink_tokens=2, position_mode="cache", rope=True,
                                                parts=_parts(gate="head", kv_heads=H))),
    ("local_global", lambda: az.LocalGlobalAttention(C, H, 2, (0, 4), True, rope=True,
                                                     parts=_parts("head", "head", kv_heads=H))),
    ("sigmoid", lambda: az.SigmoidAttention(C, H, HKV, causal=True, rope=True, sigmoid_bias=-1.0,
                                            parts=_parts(sinks=False))),
]


@pytest.mark.parametrize(("name", "make"), DECODE, ids=[c[0] for c in DECODE])
@pytest.mark.parametrize("chunk", [1, 4])
def test_decode_equals_full_with_parts(name, make, chunk) -> None:
    torch.manual_seed(0)
    m = _randomise(make().to(DT)).eval()
    x = torch.randn(2, 13, C, dtype=DT)
    with torch.no_grad():
        full = m(x)
        cache = m.init_cache(2, 13)
        steps = torch.cat([m(x[:, s:s + chunk], cache=cache) for s in range(0, 13, chunk)], dim=1)
    torch.testing.assert_close(steps, full)


# --------------------------------------------------------------------------- signatures and bad input
CLASSES = [az.MultiHeadAttention, az.MultiQueryAttention, az.GroupedQueryAttention, az.SlidingWindowAttention,
           az.StreamingAttention, az.LocalGlobalAttention, az.SigmoidAttention, az.MultiHeadLatentAttention]


@pytest.mark.parametrize("cls", CLASSES, ids=[c.__name__ for c in CLASSES])
def test_signatures_have_no_kwargs(cls) -> None:
    params = inspect.signature(cls.__init__).parameters
    assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params.values()), params
    assert len(params) - 1 <= 12
    assert "**" not in str(inspect.signature(cls))
    with pytest.raises(TypeError, match="unexpected keyword argument 'qk_norm'"):
        kw = {"kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8} \
            if cls is az.MultiHeadLatentAttention else {"num_kv_heads": 2} if cls is az.GroupedQueryAttention \
            else {"window": 2} if cls in (az.SlidingWindowAttention, az.StreamingAttention,
                                           az.LocalGlobalAttention) else {}
        cls(C, H, qk_norm="head", **kw)


@pytest.mark.parametrize(
    ("make", "exc", "words"),
    [(lambda: az.MultiHeadAttention(C, H, parts={"sinks": True}), TypeError, "parts must be an AttentionParts"),
     (lambda: AttentionParts(q_norm="head"), TypeError, "q_norm must be a QKNorm"),
     (lambda: AttentionParts(q_norm=QKNorm(D)), ValueError, "q_norm and k_norm come together"),
     (lambda: AttentionParts(output_gate=torch.nn.Linear(C, H)), TypeError, "output_gate must be a OutputGate"),
     (lambda: AttentionParts(sinks=[0.0] * H), TypeError, "sinks must be a 1-D floating tensor"),
     (lambda: AttentionParts(scores={"alibi": True}), TypeError, "scores must be a Scores"),
     (lambda: az.MultiHeadAttention(C, H, HKV, head_dim=4, parts=_parts()), ValueError,
      r"parts.q_norm has width 8 \(over_heads=False\); expected 4"),
     (lambda: az.MultiHeadAttention(C, H, head_dim=4, parts=_parts(None, "head", False)), ValueError,
      "parts.output_gate"),
     (lambda: az.MultiHeadAttention(C, 2, parts=_parts(None, None)), ValueError, r"parts.sinks must have shape"),
     (lambda: Scores(alibi=1), TypeError, "alibi must be a bool"),
     (lambda: Scores(softcap=-1.0), ValueError, "softcap must be a finite positive number"),
     (lambda: Scores(score_mod="x"), TypeError, "score_mod must be callable"),
     (lambda: QKNorm(D, eps=0.0), ValueError, "eps must be a finite positive"),
     (lambda: QKNorm(D, over_heads="yes"), TypeError, "over_heads must be a bool"),
     (lambda: QKNorm(0), ValueError, "width must be >= 1"),
     (lambda: qk_rmsnorm("layer", H, HKV, D), ValueError, "mode must be one of"),
     (lambda: OutputGate(C, H, D, "channel"), ValueError, "mode must be one of"),
     (lambda: sink_logits(2.5), TypeError, "num_heads must be an int"),
     (lambda: az.SigmoidAttention(C, H, parts=_parts(None, None, kv_heads=H)), ValueError, "sinks"),
     (lambda: az.SigmoidAttention(C, H, parts=AttentionParts(scores=Scores(alibi=True))), ValueError, "alibi"),
     (lambda: az.SigmoidAttention(C, H, sigmoid_bias="-1"), TypeError, "sigmoid_bias must be a float"),
     (lambda: az.SigmoidAttention(C, H, sigmoid_bias=float("inf")), ValueError, "sigmoid_bias must be a finite"),
     (lambda: az.StreamingAttention(C, H, 3, 2, position_mode="relative"), ValueError, "position_mode"),
     (lambda: az.SlidingWindowAttention(C, H, window=3, sink_tokens=2, dropout=0.1), TypeError, "dropout"),
     (lambda: build_attention("streaming", C, H, dropout=0.1), ValueError, "dropout"),
     (lambda: MLAOptions(form="fast"), ValueError, "form must be one of"),
     (lambda: MLAOptions(rope_scaling=2.0), TypeError, "rope_scaling must be a dict"),
     (lambda: az.MultiHeadLatentAttention(C, H, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                          options={"form": "auto"}), TypeError, "options must be an MLAOptions"),
     (lambda: build_attention("mha", C, H, qk_norm="layer"), ValueError, "qk_norm must be one of"),
     (lambda: build_attention("mha", C, H, qk_norm_eps=1e-5), ValueError, "qk_norm_eps applies"),
     (lambda: build_attention("gqa", C, H, score="sigmoid"), ValueError, "score"),
     (lambda: build_attention("mha", C, H, parts=AttentionParts(), sinks=True), ValueError, "not both")],
)
def test_bad_input_names_the_argument(make, exc, words) -> None:
    with pytest.raises(exc, match=words):
        make()
