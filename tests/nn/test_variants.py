"""The variant registry: names, builders, configs that agree with the modules they build."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

from attnzoo.variants import (
    VARIANTS,
    build_attention,
    kv_cache_bytes_per_token,
    resolve_config,
    variant_names,
)

SOFTMAX = [n for n, s in VARIANTS.items() if s.family == "softmax"]


def test_the_seed_texts_variants_are_registered_first() -> None:
    # New variants register themselves (docs/adding-a-variant.md): this test pins only the
    # original eight, in the listing order, and never needs an edit when one is added.
    first = ["mha", "mqa", "gqa", "sliding", "local_global", "linear", "performer", "infini"]
    names = variant_names()
    assert [n for n in names if n in first] == first
    assert len(set(names)) == len(names)
    for spec in VARIANTS.values():
        assert spec.exact == (spec.family in ("softmax", "differential")), spec.name


@pytest.mark.parametrize(
    ("name", "dim", "heads", "kw"),
    [(n, d, h, {}) for n in SOFTMAX for d, h in ((64, 8), (96, 6))] + [("gqa", 64, 8, {"num_kv_heads": 4})],
)
def test_resolved_config_matches_the_built_module(name: str, dim: int, heads: int, kw: dict) -> None:
    mod = build_attention(name, dim, heads, **kw)
    cfg = resolve_config(name, dim, heads, **kw)
    assert (cfg.num_kv_heads, cfg.head_dim) == (mod.num_kv_heads, mod.head_dim), (name, dim, heads, kw)
    assert cfg.causal == mod.causal


@pytest.mark.parametrize("name", SOFTMAX)
def test_kv_bytes_per_token_equal_cache_growth(name: str) -> None:
    dim, heads = 64, 8
    mod = build_attention(name, dim, heads).to(torch.bfloat16)
    small = mod.init_cache(1, 100, dtype=torch.bfloat16) if _takes_dtype(mod) else mod.init_cache(1, 100)
    big = mod.init_cache(1, 101, dtype=torch.bfloat16) if _takes_dtype(mod) else mod.init_cache(1, 101)

    def nbytes(c):
        return c.nbytes  # the cache protocol's size

    growth = nbytes(big) - nbytes(small)
    if name in ("sliding", "streaming"):  # past the window (64) the ring buffer stops growing
        assert growth == 0
        assert kv_cache_bytes_per_token(name, dim, heads, dtype_bytes=small.k.element_size()) > 0
    else:
        assert growth == kv_cache_bytes_per_token(name, dim, heads, dtype_bytes=small.dtype.itemsize)


def _takes_dtype(mod) -> bool:
    import inspect

    return "dtype" in inspect.signature(mod.init_cache).parameters


def test_gqa_default_heads_divide() -> None:
    from attnzoo.variants import build_attention, default_kv_heads

    for heads in (2, 4, 6, 8, 12, 16):
        kv = resolve_config("gqa", 8 * heads, heads).num_kv_heads
        assert heads % kv == 0 and kv == default_kv_heads(heads)
        assert build_attention("gqa", 8 * heads, heads).num_kv_heads == kv  # cost model == module
        if heads >= 4:  # distinct from both mqa (1 KV head) and mha (H KV heads)
            assert 1 < kv < heads


def test_window_int_means_left_side_with_causal() -> None:
    assert resolve_config("sliding", 64, 8, window=16).window == (16, 0)
    assert resolve_config("sliding", 64, 8, window=16, causal=False).window == (16, 16)


@pytest.mark.parametrize(
    ("call", "exc", "words"),
    [
        (lambda: build_attention("nope", 64, 8), ValueError, "unknown attention variant"),
        (lambda: resolve_config("nope", 64, 8), ValueError, "unknown attention variant"),
        (lambda: resolve_config("mha", 0, 8), ValueError, "dim"),
        (lambda: resolve_config("mha", 64, 3.0), TypeError, "num_heads"),
        (lambda: resolve_config("mha", 65, 8), ValueError, "divisible"),
        (lambda: resolve_config("gqa", 64, 8, num_kv_heads=3), ValueError, "multiple"),
        (lambda: resolve_config("mha", 64, 8, colour="red"), TypeError, "unknown setting"),
        (lambda: resolve_config("mha", 64, 8, causal="yes"), TypeError, "causal"),
        (lambda: kv_cache_bytes_per_token("mha", 64, 8, dtype_bytes=0), ValueError, "dtype_bytes"),
    ],
)
def test_bad_input(call, exc, words) -> None:
    with pytest.raises(exc, match=words):
        call()


# ----------------------------------------------------------------------------- adding a variant
def test_a_variant_defined_here_appears_everywhere() -> None:
    """docs/adding-a-variant.md, proved: a module class, its spec and a cost function in ONE file
    (this one) make a variant that the registry, build_attention and cost.estimate all know."""
    from torch import nn

    import attnzoo as az
    from attnzoo.nn.base import AttentionBase
    from attnzoo.nn.costs import softmax_cost
    from attnzoo.variants import VariantSpec, register

    class CappedAttention(AttentionBase):
        """Softmax attention with tanh-capped scores (a toy variant)."""

        def __init__(self, dim: int, num_heads: int, causal: bool = True, cap: float = 5.0) -> None:
            super().__init__(dim, num_heads, layout="qkv")
            self.causal, self.cap = causal, cap

        def forward(self, x, context=None, *, mask=None, cache=None, positions=None, return_weights=False):
            x = self.check_call(x, cache, positions, return_weights)
            q, k, v = self.project_qkv(x)
            return self.merge_heads(self.attend(q, k, v, causal=self.causal, softcap=self.cap, mask=mask))

    def build(dim: int, num_heads: int, *, causal: bool = True, **kw) -> nn.Module:
        return CappedAttention(dim, num_heads, causal=causal, **kw)

    spec = VariantSpec("capped_test", "softmax", True, "O(N C^2 + N^2 C)", "O(N)", "K,V of every head", build,
                       lambda cfg, shape: softmax_cost(cfg, shape), check={"cap": 2.0})
    register(spec)
    try:
        assert VARIANTS["capped_test"] is spec and "capped_test" in variant_names()
        m = build_attention("capped_test", 32, 4, cap=3.0)
        assert isinstance(m, CappedAttention) and m.cap == 3.0
        assert m(torch.randn(2, 5, 32)).shape == (2, 5, 32)
        est = az.cost.estimate("capped_test", 256, 32, 4, backend="sdpa")
        assert est.flops == az.cost.estimate("mha", 256, 32, 4, backend="sdpa").flops
        with pytest.raises(ValueError, match="do not apply"):
            az.cost.estimate("capped_test", 256, 32, 4, window=8)
        with pytest.raises(ValueError, match="already registered"):
            register(VariantSpec("capped_test", "softmax", True, "", "", "", build, spec.cost))
    finally:
        VARIANTS.pop("capped_test")


def test_every_spec_builds_with_its_check_and_arena_settings() -> None:
    for name, spec in VARIANTS.items():
        assert build_attention(name, 32, 4, **spec.check) is not None, name
        assert build_attention(name, 64, 4, **spec.arena_settings(64, 4, 8)) is not None, name
        cfg = resolve_config(name, 32, 4)
        assert cfg.name == name


def test_adding_a_variant_doc_example_runs() -> None:
    """docs/adding-a-variant.md's module file, run as written, registers a working variant."""
    import re
    from pathlib import Path

    import attnzoo as az

    text = (Path(__file__).resolve().parents[2] / "docs" / "adding-a-variant.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    try:
        exec(compile(code, "adding-a-variant.md", "exec"), {"__name__": "__doc_example__"})
        assert "capped" in VARIANTS
        assert build_attention("capped", 32, 4, **VARIANTS["capped"].check)(torch.randn(1, 6, 32)).shape == (1, 6, 32)
        assert az.cost.estimate("capped", 10**6, 32, 4).flops > 0
    finally:
        VARIANTS.pop("capped", None)


def test_every_registered_module_is_on_the_one_base() -> None:
    from attnzoo.nn.base import AttentionBase

    for name, spec in VARIANTS.items():
        m = build_attention(name, 32, 4, **spec.check)
        assert isinstance(m, AttentionBase), name
        assert m.attend_fn is not None, name
        with contextlib.suppress(TypeError):  # a module without separate q/k/v projections says so (mla)
            assert len(m.qkv_weights()) == 3, name


@pytest.mark.parametrize("name", variant_names())
def test_build_attention_takes_backend_where_the_module_does(name: str) -> None:
    """``spec.backends`` tells the truth about the module's signature; ``backend="auto"`` builds every
    variant; ``"reference"`` builds those with backends and is a ValueError naming the others."""
    spec = VARIANTS[name]
    module = build_attention(name, 32, 4, backend="auto")
    assert ("backend" in inspect.signature(type(module).__init__).parameters) == spec.backends
    if spec.backends:
        assert build_attention(name, 32, 4, backend="reference").backend == "reference"
    else:
        with pytest.raises(ValueError, match=rf"build_attention\('{name}'\): backend='reference'.*takes no attention"):
            build_attention(name, 32, 4, backend="reference")
