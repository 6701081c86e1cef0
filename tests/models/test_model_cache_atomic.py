"""Issue 33 gap: a ``DecoderLM`` call through its caches is all-or-nothing, for every variant.

A module call is atomic on its own cache (``tests/nn/test_cache_atomic.py``); here the model's call
fails *after* some layers have already written their caches: in the last layer, the final norm or
the LM head (a ``KeyboardInterrupt``, as a Ctrl-C). No layer's cache moves, and the decoding that
goes on equals the full forward (no cache) of the same tokens. Uniform stacks of every registered
variant, a hybrid stack (recurrent and softmax layers) and a cross-attention model (``BlockCache``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnzoo as az
from attnzoo.variants import VARIANTS

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, T, PREFILL, CTX = 40, 8, 4, 3


class Injected(KeyboardInterrupt):
    """The injected failure (a BaseException, like a real Ctrl-C)."""


def _model(attention: object, **kw: object) -> az.DecoderLM:
    torch.manual_seed(0)
    akw = dict(VARIANTS[attention].check) if isinstance(attention, str) else None
    cfg = az.models.DecoderConfig(VOCAB, 32, 2, 4, attention=attention, max_seq_len=32, attention_kwargs=akw, **kw)
    return az.DecoderLM(config=cfg).eval()


def _fail_after(sub: nn.Module) -> torch.utils.hooks.RemovableHandle:
    def boom(mod: nn.Module, args: object, out: object) -> None:
        raise Injected("injected")

    return sub.register_forward_hook(boom)


def _check(lm: az.DecoderLM, context: torch.Tensor | None = None) -> None:
    tokens = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = lm(tokens, context=context)  # [B, T, V]
        for where in ("last layer", "norm", "lm_head"):
            sub = {"last layer": lm.blocks[-1], "norm": lm.norm, "lm_head": lm.lm_head}[where]
            cache = lm.init_cache(2, T)
            outs = [lm(tokens[:, :PREFILL], cache=cache, context=context)]
            for step in (PREFILL, PREFILL + 1):  # a failed one-token step, then a failed chunk
                n = 1 if step == PREFILL else T - step
                handle = _fail_after(sub)
                try:
                    with pytest.raises(Injected):
                        lm(tokens[:, step:step + n], cache=cache, context=context)
                finally:
                    handle.remove()
                lengths = [c.length for c in cache]
                assert lengths == [step] * len(cache), f"failure in {where}: layer lengths {lengths}, want {step}"
                outs.append(lm(tokens[:, step:step + 1], cache=cache, context=context))
            outs.append(lm(tokens[:, PREFILL + 2:], cache=cache, context=context))
            err = (torch.cat(outs, 1) - full).abs().max().item()
            assert err <= 1e-5, f"after a failure in {where}, decoding is off the full forward by {err:.2e}"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_failed_model_call_leaves_every_layer_cache_unchanged(name: str) -> None:
    lm = _model(name)
    _check(lm)


def test_hybrid_stack_and_cross_attention_calls_are_all_or_nothing() -> None:
    _check(_model(("gla", "mha")))
    torch.manual_seed(0)
    cross = az.DecoderLM.with_blocks(az.models.DecoderConfig(VOCAB, 32, 2, 4, attention="gqa", max_seq_len=32),
                                     lambda b, _: b.replace(cross_attention=True, context_dim=16)).eval()
    _check(cross, context=torch.randn(2, CTX, 16))
