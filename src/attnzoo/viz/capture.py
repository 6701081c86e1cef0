"""Record the attention weights of every attention module of a model without changing its outputs."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["AttentionCapture", "capture_attention"]

#: Errors of a ``return_weights=True`` call that mean "this module cannot give weights here".
_NO_WEIGHTS = (ValueError, TypeError, NotImplementedError)


@dataclass
class AttentionCapture:
    """Weights recorded by :func:`capture_attention`.

    ``maps[layer]`` is the list of weight tensors ``[B, H, Nq, Nk]`` one module produced, one per
    call, in call order (decoding with a cache makes one call per step). ``layers`` lists the
    attention modules' qualified names in model order; ``skipped`` the modules that could not
    return weights, with the reason; ``last_skipped`` those whose latest call gave none.
    """

    layers: list[str] = field(default_factory=list)
    maps: dict[str, list[Tensor]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    last_skipped: set[str] = field(default_factory=set)

    def __getitem__(self, layer: str | int) -> Tensor:
        """The weights of ``layer``'s latest call (a name or an index into :attr:`layers`):
        ``[B, H, Nq, Nk]``. ``KeyError`` when that call gave none (e.g. a StreamingLLM cached step:
        the earlier calls' maps stay in :attr:`maps`, but they are not the latest)."""
        name = self.layers[layer] if isinstance(layer, int) else layer
        if name in self.last_skipped:
            raise KeyError(f"the latest call of layer {name!r} gave no attention weights ({self.skipped[name]}); "
                           f"maps[{name!r}] holds its {len(self.maps.get(name, []))} earlier map(s)")
        if name not in self.maps or not self.maps[name]:
            raise KeyError(f"no attention weights recorded for layer {name!r}; recorded: {list(self.maps)}")
        return self.maps[name][-1]

    def __len__(self) -> int:
        return len(self.layers)

    def stacked(self) -> Tensor:
        """The last weights of every layer as ``[L, B, H, Nq, Nk]`` (layers must agree in shape)."""
        return torch.stack([self[name] for name in self.layers if self.maps.get(name)])


def _takes_return_weights(m: nn.Module) -> bool:
    try:
        return "return_weights" in inspect.signature(m.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtin forward
        return False


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Innermost modules whose ``forward`` accepts ``return_weights``."""
    found = [(n, m) for n, m in model.named_modules() if _takes_return_weights(m)]
    names = {n for n, _ in found}
    inner = []
    for n, m in found:
        below = any(o != n and (o.startswith(n + ".") or n == "") for o in names)
        if not below:
            inner.append((n or type(m).__name__, m))
    return inner


def _recording_forward(orig: Callable[..., Any], name: str, cap: AttentionCapture, detach: bool) -> Callable[..., Any]:
    """A ``forward`` that calls ``orig`` as usual and records the weights into ``cap.maps[name]``."""

    def keep(w: Tensor) -> None:
        cap.maps[name].append(w.detach() if detach else w)
        cap.last_skipped.discard(name)

    def skip(exc: Exception) -> None:
        cap.skipped[name] = str(exc)
        cap.last_skipped.add(name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("return_weights"):
            out = orig(*args, **kwargs)
            keep(out[1])
            return out
        if kwargs.get("cache") is not None:  # one call only: a second would write the cache twice
            try:
                out, w = orig(*args, **kwargs, return_weights=True)
            except _NO_WEIGHTS as exc:
                skip(exc)
                return orig(*args, **kwargs)
            keep(w)
            return out
        out = orig(*args, **kwargs)
        try:
            with torch.no_grad():
                res = orig(*args, **kwargs, return_weights=True)
            keep(res[1].detach())
        except _NO_WEIGHTS as exc:
            skip(exc)
        return out

    return wrapped


@contextmanager
def capture_attention(model: nn.Module, *, detach: bool = True) -> Iterator[AttentionCapture]:
    """Record the attention weights of every attention module of ``model``.

    Attention modules are the innermost submodules whose ``forward`` takes ``return_weights``
    (every attnzoo attention module). While the context is open each call of such a module runs
    as usual and its output is returned unchanged; the weights come from a second, gradient-free
    call with ``return_weights=True`` on the same inputs. A call that updates a KV cache is not
    repeated (that would write the cache twice): it is made once with ``return_weights=True``,
    whose output equals the normal one up to float rounding (weights need the ``reference``
    backend). Use it in ``eval()`` mode: with dropout the two calls would draw different masks.

    Example::

        with az.viz.capture_attention(model) as cap:
            model(tokens)
        cap.layers            # ['blocks.0.attn', 'blocks.1.attn', ...]
        cap[0].shape          # [B, H, N, N]

    Yields:
        An :class:`AttentionCapture`, filled as the model runs.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture_attention: model must be a torch.nn.Module, got {type(model).__name__}")
    cap = AttentionCapture()
    wrapped_modules: list[nn.Module] = []
    for name, mod in _attention_modules(model):
        cap.layers.append(name)
        cap.maps[name] = []
        mod.forward = _recording_forward(mod.forward, name, cap, detach)  # type: ignore[method-assign]
        wrapped_modules.append(mod)
    try:
        yield cap
    finally:
        for mod in wrapped_modules:
            del mod.forward  # the instance attribute; the class method shows through again
