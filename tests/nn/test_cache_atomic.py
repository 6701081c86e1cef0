"""Issue 33, item 3: a module call through a cache is all-or-nothing, for every registered variant.

A call that raises anywhere in its forward (inside any submodule it runs: projections, RoPE, conv,
the attention, an output gate or norm, ``out_proj``; a ``KeyboardInterrupt`` as much as an error)
leaves the cache exactly as it was: its ``length`` does not move and the decoding that continues
gives the outputs of a run that never failed. A wrong dtype or device of ``x`` is a ``TypeError``
naming ``x`` before any state changes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnzoo.variants import VARIANTS, build_attention

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny modules: no OpenMP spin-waiting

DIM, HEADS, T, PREFILL = 32, 4, 9, 5


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return build_attention(name, DIM, HEADS, causal=True, **VARIANTS[name].check).eval()


class Injected(KeyboardInterrupt):
    """What the injected failure raises (a BaseException, like a real Ctrl-C)."""


def _submodules_called(m: nn.Module, x: torch.Tensor) -> list[str]:
    """Names of the submodules that the first decode step after a prefill runs, in call order (each once)."""
    order: list[str] = []
    cache = m.init_cache(x.shape[0], T + 2)
    with torch.no_grad():
        m(x[:, :PREFILL], cache=cache)
        hooks = [sub.register_forward_hook(lambda mod, args, out, name=name: order.append(name))
                 for name, sub in m.named_modules() if name]
        try:
            m(x[:, PREFILL:PREFILL + 1], cache=cache)
        finally:
            for h in hooks:
                h.remove()
    return list(dict.fromkeys(order))


def _decode(m: nn.Module, x: torch.Tensor, fail: tuple[int, str] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Prefill ``x[:, :PREFILL]`` then one token a step; with ``fail=(step, submodule)`` the call of that
    step first fails once (the submodule raises after running), then is made again."""
    cache = m.init_cache(x.shape[0], T + 2)
    outs, lengths = [], []
    with torch.no_grad():
        outs.append(m(x[:, :PREFILL], cache=cache))
        for i in range(PREFILL, T):
            if fail is not None and fail[0] == i:
                sub = m.get_submodule(fail[1])

                def boom(mod: nn.Module, args: object, out: object) -> None:
                    raise Injected(f"injected after {fail[1]}")

                handle = sub.register_forward_hook(boom)
                before = cache.length
                try:
                    with pytest.raises(Injected):
                        m(x[:, i:i + 1], cache=cache)
                finally:
                    handle.remove()
                lengths.append(cache.length - before)
            outs.append(m(x[:, i:i + 1], cache=cache))
    return torch.cat(outs, dim=1), lengths


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_failure_anywhere_in_a_cached_call_changes_nothing(name: str) -> None:
    """Every submodule a decode step runs (out_proj, gates, norms, convs, projections) fails once in
    turn: the cache length is unchanged by the failed call and the outputs equal an unbroken run."""
    m = build(name)
    x = torch.randn(2, T, DIM, generator=torch.Generator().manual_seed(1))
    ref, _ = _decode(m, x)
    called = _submodules_called(m, x)
    assert "out_proj" in called, f"{name}: a decode step never ran out_proj ({called})"
    for sub in called:
        out, moved = _decode(m, x, fail=(PREFILL, sub))
        assert moved == [0], f"{name}: a failure after {sub} moved cache.length by {moved[0]}"
        err = (out - ref).abs().max().item()
        assert err <= 1e-6, f"{name}: after a failure in {sub}, later outputs are off by {err:.2e}"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_failed_chunk_changes_nothing(name: str) -> None:
    """A chunk of 3 tokens whose call fails in out_proj leaves the length at the prefill (not +3)."""
    m = build(name)
    x = torch.randn(2, T, DIM, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full_cache = m.init_cache(2, T)
        ref = torch.cat([m(x[:, :PREFILL], cache=full_cache), m(x[:, PREFILL:T], cache=full_cache)], dim=1)
        cache = m.init_cache(2, T)
        first = m(x[:, :PREFILL], cache=cache)
        handle = m.out_proj.register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
        try:
            with pytest.raises(RuntimeError, match="injected"):
                m(x[:, PREFILL:PREFILL + 3], cache=cache)
        finally:
            handle.remove()
        assert cache.length == PREFILL, f"{name}: a failed chunk left length {cache.length}, expected {PREFILL}"
        out = torch.cat([first, m(x[:, PREFILL:T], cache=cache)], dim=1)
    assert (out - ref).abs().max().item() <= 1e-6, name


@pytest.mark.parametrize("name", list(VARIANTS))
def test_wrong_dtype_or_device_of_x_is_refused_by_name_before_any_state_changes(name: str) -> None:
    m = build(name)
    x = torch.randn(2, T, DIM)
    cache = m.init_cache(2, T)
    with torch.no_grad():
        m(x[:, :PREFILL], cache=cache)
        mark = cache.mark()
        for bad in (x[:, PREFILL:PREFILL + 1].double(), x[:, PREFILL:PREFILL + 1].half(),
                    torch.empty(2, 1, DIM, device="meta")):
            with pytest.raises(TypeError, match=r"\bx\b"):
                m(bad, cache=cache)
            assert cache.length == PREFILL, f"{name}: a refused {bad.dtype}/{bad.device} call moved the cache"
        with pytest.raises(TypeError, match=r"\bx\b.*float64"):
            m(x.double())  # without a cache too
    assert cache.mark() == mark if isinstance(mark, int) else cache.length == PREFILL


def test_autocast_still_takes_another_dtype() -> None:
    """Under torch.autocast a float32 module takes bfloat16 x (the dtype check steps aside)."""
    m = build("mha")
    x = torch.randn(1, 4, DIM, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert m(x).shape == (1, 4, DIM)


def test_transactions_nest_and_a_foreign_cache_is_refused_by_the_module() -> None:
    from attnzoo.nn.cache import KVCache, transaction

    cache = KVCache(1, 4, 1, 2)
    k = torch.randn(1, 1, 1, 2)

    def inner() -> None:
        transaction(cache, lambda: cache.update(k, k))  # joins the outer transaction
        raise Injected

    with pytest.raises(Injected):
        transaction(cache, inner)
    assert cache.length == 0 and not cache.in_transaction
    with pytest.raises(TypeError, match="cache"):
        build("mha")(torch.randn(1, 1, DIM), cache=object())
