"""The base of every attention module: projections, head split/merge, input checks, caches, attend seam.

:class:`AttentionBase` owns what every attention module shares:

* the projections, in one of three layouts (``"qkv"``: one ``qkv_proj`` whose output rows are
  ``[q; k; v]``; ``"q_kv"``: ``q_proj`` and ``kv_proj`` with rows ``[k; v]`` (cross-attention);
  ``"q_k_v"``: ``q_proj``, ``k_proj``, ``v_proj``) and ``out_proj``, with
  :meth:`qkv_weights`/:meth:`qkv_biases` views and :meth:`load_qkv` to fill them from separate
  checkpoint tensors;
* head split ``[B, N, H*D] -> [B, H, N, D]`` and merge, the shared checks of ``x``, ``positions``
  and ``return_weights``;
* :meth:`init_cache` (device/dtype default to the module's) and the all-or-nothing call: every
  subclass's ``forward`` is wrapped (in ``__init_subclass__``) so that a call with ``cache=`` runs in
  one :func:`attnzoo.nn.cache.transaction`: when it raises anywhere (a bad argument, the attention,
  the output projection or gate, a ``KeyboardInterrupt``) the cache is rolled back to where it was,
  and it is committed only when ``forward`` returns. :meth:`guarded` is the same transaction around
  a part of a call (it joins the call's transaction);
* empty inputs: ``x [B, N, C]`` with ``B = 0`` or ``N = 0`` is checked like any input and gives an
  empty ``[B, N, C]`` output (a cache is left unchanged), whatever the module's kernels are;
* the *attend seam*: softmax modules compute attention only through :meth:`attend`, which calls
  ``self.attend_fn`` (by default :func:`attnzoo.attention`, with exactly its keywords;
  ``default_attend`` of the class, e.g. :func:`attnzoo.sigmoid_attention` for sigmoid attention). Context
  parallelism swaps that function (a picklable callable) instead of copying a forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnzoo._devices import cache_dtype
from attnzoo._validate import check_bool, check_int
from attnzoo.functional.softmax.attention import BACKENDS, attention
from attnzoo.nn.cache import transaction
from attnzoo.nn.positional import resolve_positions

__all__ = ["AttentionBase", "check_backend"]

T = TypeVar("T")


def check_backend(backend: object, owner: str) -> str:
    """A backend name of :func:`attnzoo.attention` (``"auto"`` included)."""
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
        raise ValueError(f"{owner}: backend must be one of {('auto', *BACKENDS)}, got {backend!r}")
    return backend


class AttentionBase(nn.Module):
    """Projections, heads, checks, caches and the attend seam shared by every attention module.

    Args:
        dim: model width ``C``.
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads ``Hkv`` (default ``H``); ``H % Hkv == 0``.
        head_dim: ``D`` (default ``C // H``; then ``C % H == 0`` is required).
        bias: biases in every projection.
        layout: ``"qkv"``, ``"q_kv"`` or ``"q_k_v"`` (see above).
        kv_dim: width of the key/value source (default ``C``; not with ``"qkv"``).
        factory: ``{"device": ..., "dtype": ...}`` of the parameters.
    """

    #: The function behind the attend seam by default (:class:`~attnzoo.SigmoidAttention`:
    #: :func:`attnzoo.sigmoid_attention`); ``attend_fn`` starts as it and takes its keywords.
    default_attend: ClassVar[Callable[..., Any]] = staticmethod(attention)

    #: Why ``return_weights=True`` is refused (``None``: the module can return attention weights).
    no_weights_reason: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Make the subclass's own ``forward`` an all-or-nothing call (see the module docstring)."""
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        if forward is not None and not getattr(forward, "all_or_nothing", False):
            cls.forward = _all_or_nothing(forward)  # type: ignore[method-assign]

    def __init__(self, dim: int, num_heads: int, *, num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = True, layout: str = "q_k_v", kv_dim: int | None = None,
                 factory: dict[str, Any] | None = None) -> None:
        super().__init__()
        cls = type(self).__name__
        self.dim = check_int(dim, "dim", owner=cls)
        self.num_heads = check_int(num_heads, "num_heads", owner=cls)
        self.num_kv_heads = self.num_heads if num_kv_heads is None else check_int(num_kv_heads, "num_kv_heads",
                                                                                   owner=cls)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{cls}: num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                             f"({self.num_kv_heads}), got remainder {self.num_heads % self.num_kv_heads}")
        if head_dim is None:
            if self.dim % self.num_heads:
                raise ValueError(f"{cls}: dim ({self.dim}) must be divisible by num_heads ({self.num_heads}), "
                                 f"or pass head_dim explicitly")
            head_dim = self.dim // self.num_heads
        self.head_dim = check_int(head_dim, "head_dim", owner=cls)
        check_bool(bias, "bias", cls)
        if layout not in ("qkv", "q_kv", "q_k_v"):
            raise ValueError(f"{cls}: layout must be 'qkv', 'q_kv' or 'q_k_v', got {layout!r}")
        self.attend_fn: Callable[..., Any] = type(self).default_attend
        self._layout = layout
        kv_dim = self.dim if kv_dim is None else check_int(kv_dim, "kv_dim", owner=cls)
        self._make_projections(bias, factory or {}, kv_dim)

    # ------------------------------------------------------------------ projections
    def _make_projections(self, bias: bool, fk: dict[str, Any], kv_dim: int) -> None:
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self._layout == "qkv":
            self.qkv_proj = nn.Linear(self.dim, (H + 2 * Hkv) * D, bias=bias, **fk)
        else:
            self.q_proj = nn.Linear(self.dim, H * D, bias=bias, **fk)
        if self._layout == "q_kv":
            self.kv_proj = nn.Linear(kv_dim, 2 * Hkv * D, bias=bias, **fk)
        elif self._layout == "q_k_v":
            self.k_proj = nn.Linear(kv_dim, Hkv * D, bias=bias, **fk)
            self.v_proj = nn.Linear(kv_dim, Hkv * D, bias=bias, **fk)
        self.out_proj = nn.Linear(H * D, self.dim, bias=bias, **fk)

    def qkv_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """Views ``(Wq [H*D, C], Wk [Hkv*D, C_kv], Wv [Hkv*D, C_kv])`` of the projection weights."""
        return self._parts("weight")  # type: ignore[return-value]

    def qkv_biases(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """Views ``(bq, bk, bv)`` of the projection biases, or ``None`` without biases."""
        return self._parts("bias")

    def _parts(self, attr: str) -> tuple[Tensor, Tensor, Tensor] | None:
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self._layout == "qkv":
            t = getattr(self.qkv_proj, attr)
            return None if t is None else (t[: H * D], t[H * D: (H + Hkv) * D], t[(H + Hkv) * D:])
        if self._layout == "q_kv":
            q, kv = getattr(self.q_proj, attr), getattr(self.kv_proj, attr)
            return None if q is None or kv is None else (q, kv[: Hkv * D], kv[Hkv * D:])
        ts = (getattr(self.q_proj, attr), getattr(self.k_proj, attr), getattr(self.v_proj, attr))
        return None if any(t is None for t in ts) else ts  # type: ignore[return-value]

    @torch.no_grad()
    def load_qkv(self, q_weight: Tensor, k_weight: Tensor, v_weight: Tensor, q_bias: Tensor | None = None,
                 k_bias: Tensor | None = None, v_bias: Tensor | None = None) -> None:
        """Copy separate q/k/v projection weights (``nn.Linear`` layout ``[out, in]``) into this module
        (whatever its layout: fused rows ``[q; k; v]`` or separate projections)."""
        for name, dst, src in zip(("q_weight", "k_weight", "v_weight"), self.qkv_weights(),
                                  (q_weight, k_weight, v_weight), strict=True):
            _copy_checked(name, dst, src, "[out, in]")
        biases = self.qkv_biases()
        given = (q_bias, k_bias, v_bias)
        if biases is None:
            if any(b is not None for b in given):
                raise ValueError("load_qkv: this module was built with bias=False, but biases were given")
            return
        for name, dst, src in zip(("q_bias", "k_bias", "v_bias"), biases, given, strict=True):
            if src is None:
                dst.zero_()
            else:
                _copy_checked(name, dst, src, "")

    def project_qkv(self, x: Tensor, source: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``q [B, H, N, D]``, ``k, v [B, Hkv, M, D]`` from ``x [B, N, C]`` (keys/values from
        ``source [B, M, C_kv]`` when given, else from ``x``)."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        src = x if source is None else source
        if self._layout == "q_k_v":
            return self.split_heads(self.q_proj(x)), self.split_heads(self.k_proj(src)), self.split_heads(self.v_proj(src))
        if self._layout == "qkv" and source is None:
            q_, k_, v_ = self.qkv_proj(x).split((H * D, Hkv * D, Hkv * D), dim=-1)  # [B, N, (H + 2 Hkv) D]
            return self.split_heads(q_), self.split_heads(k_), self.split_heads(v_)
        return self.project_q(x), *self.project_kv(src)

    def project_q(self, x: Tensor) -> Tensor:
        """``q [B, H, N, D]`` from ``x [B, N, C]``."""
        if self._layout != "qkv":
            return self.split_heads(self.q_proj(x))
        w, b = self.qkv_proj.weight, self.qkv_proj.bias
        n = self.num_heads * self.head_dim
        return self.split_heads(F.linear(x, w[:n], None if b is None else b[:n]))

    def project_kv(self, source: Tensor) -> tuple[Tensor, Tensor]:
        """``k, v [B, Hkv, M, D]`` from ``source [B, M, C_kv]``."""
        if self._layout == "q_k_v":
            return self.split_heads(self.k_proj(source)), self.split_heads(self.v_proj(source))
        if self._layout == "q_kv":
            kv = self.kv_proj(source)  # [B, M, 2 Hkv D]
        else:
            w, b = self.qkv_proj.weight, self.qkv_proj.bias
            n = self.num_heads * self.head_dim
            kv = F.linear(source, w[n:], None if b is None else b[n:])  # rows [k; v]
        k_, v_ = kv.split(self.num_kv_heads * self.head_dim, dim=-1)
        return self.split_heads(k_), self.split_heads(v_)

    # ------------------------------------------------------------------ heads
    def split_heads(self, t: Tensor) -> Tensor:
        """``[B, N, h*D] -> [B, h, N, D]`` (a view)."""
        B, N, width = t.shape
        return t.view(B, N, width // self.head_dim, self.head_dim).transpose(1, 2)  # [B, h, N, D] (also when empty)

    def merge_heads(self, out: Tensor) -> Tensor:
        """``[B, H, N, Dv] -> out_proj([B, N, H*Dv]) = [B, N, C]``."""
        B, H, N, Dv = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, N, H * Dv))  # [B, N, C]

    # ------------------------------------------------------------------ checks
    def check_x(self, x: object, name: str = "x") -> Tensor:
        """``x`` must be a floating tensor ``[B, N, C]`` with ``C = dim``, in the dtype and on the device
        of the module's parameters (any floating dtype under ``torch.autocast``)."""
        cls = type(self).__name__
        if not isinstance(x, Tensor):
            raise TypeError(f"{cls}: {name} must be a tensor [B, N, C], got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{cls}: {name} must be a floating-point tensor [B, N, C], got dtype {x.dtype}")
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"{cls}: {name} must have shape [B, N, C] with C = dim = {self.dim}, "
                             f"got {tuple(x.shape)}")
        w = self.out_proj.weight
        if x.device != w.device:
            raise TypeError(f"{cls}: {name} is on {x.device}, but the module's parameters are on {w.device}; "
                            f"move one of them (module.to(...) or {name}.to(...))")
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"{cls}: {name} has dtype {x.dtype}, but the module's parameters are {w.dtype}; "
                            f"cast one of them (module.to({x.dtype}) or {name}.to({w.dtype})), or run under "
                            f"torch.autocast")
        return x

    def check_call(self, x: object, cache: Any, positions: object, return_weights: object,
                   cache_type: type | tuple[type, ...] | None = None) -> Tensor:
        """Shared checks of a forward call; returns ``x``. ``positions`` are validated only."""
        cls = type(self).__name__
        x = self.check_x(x)
        check_bool(return_weights, "return_weights", cls)
        if return_weights and self.no_weights_reason is not None:
            raise ValueError(f"{cls}: return_weights=True is not supported ({self.no_weights_reason})")
        if cache is not None:
            if cache_type is not None and not isinstance(cache, cache_type):
                kinds = cache_type if isinstance(cache_type, tuple) else (cache_type,)
                raise TypeError(f"{cls}: cache must be a {' or '.join(k.__name__ for k in kinds)} from "
                                f"init_cache(), got {type(cache).__name__}")
            if cache.batch_size != x.shape[0]:
                raise ValueError(f"{cls}: the cache was built for batch size {cache.batch_size}, but x has batch "
                                 f"size {x.shape[0]} (x shape {tuple(x.shape)})")
        if positions is not None:
            start = 0 if cache is None else cache.length
            resolve_positions(positions, x.shape[1], start, x.device, batch=x.shape[0])  # type: ignore[arg-type]
        return x

    # ------------------------------------------------------------------ caches
    def init_cache(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> Any:
        """A decode cache for this module (see the subclass); device/dtype default to the module's
        (under ``torch.autocast``, a float32 module's cache takes the autocast dtype, as its keys do)."""
        check_int(batch_size, "batch_size")
        check_int(max_len, "max_len")
        p = self.out_proj.weight
        return self._new_cache(batch_size, max_len, p.device if device is None else device, cache_dtype(p, dtype))

    def _new_cache(self, batch_size: int, max_len: int, device: torch.device | str, dtype: torch.dtype) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no decode cache")

    @staticmethod
    def guarded(cache: Any, fn: Callable[[], T]) -> T:
        """Run ``fn()`` in a :func:`~attnzoo.nn.cache.transaction` of ``cache`` (inside a module call it
        joins the call's own transaction; no cache: just run it)."""
        return transaction(cache, fn)

    def _empty_call(self, x: Tensor, context: Any, cache: Any, positions: Any, return_weights: Any) -> Any:
        """The result of a call on an empty ``x [B, N, C]`` (``B = 0`` or ``N = 0``): checked like any
        call, then ``[B, N, C]`` (and empty weights ``[B, H, N, Nk]`` with ``return_weights``); no
        kernel runs and a cache is left as it was."""
        x = self.check_call(x, cache, positions, return_weights)
        B, N, _ = x.shape
        y = self.out_proj(x.new_zeros(B, N, self.out_proj.in_features)) + 0 * x  # [B, N, C]; x stays in the graph
        if not return_weights:
            return y
        held = 0 if cache is None else int(getattr(cache, "num_cached", cache.length))  # a ring holds fewer
        n_k = context.shape[1] if isinstance(context, Tensor) else held
        return y, x.new_zeros(B, self.num_heads, N, n_k)

    # ------------------------------------------------------------------ the attend seam
    def attend(self, q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> Any:
        """Attention of ``q [B, H, Nq, D]`` over ``k, v [B, Hkv, Nk, D]`` through ``self.attend_fn``
        (default :func:`attnzoo.attention`); ``kw`` are exactly the keywords of the class's
        ``default_attend`` (:func:`attnzoo.attention`'s, or :func:`attnzoo.sigmoid_attention`'s)."""
        return self.attend_fn(q, k, v, **kw)


def _all_or_nothing(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` as an all-or-nothing call through its ``cache=`` keyword (see the module docstring),
    with empty inputs answered by :meth:`AttentionBase._empty_call`."""

    @functools.wraps(forward)
    def call(self: AttentionBase, x: Any, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache")
        if isinstance(x, Tensor) and x.dim() == 3 and (x.shape[0] == 0 or x.shape[1] == 0):
            context = args[0] if args else kwargs.get("context")
            return self._empty_call(x, context, cache, kwargs.get("positions"), kwargs.get("return_weights", False))
        return transaction(cache, lambda: forward(self, x, *args, **kwargs))

    call.all_or_nothing = True  # type: ignore[attr-defined]
    return call


def _copy_checked(name: str, dst: Tensor, src: object, layout: str) -> None:
    if not isinstance(src, Tensor) or src.shape != dst.shape:
        got = tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__
        raise ValueError(f"load_qkv: {name} must have shape {tuple(dst.shape)} {layout}".rstrip() + f", got {got}")
    dst.copy_(src)
