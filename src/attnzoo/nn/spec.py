"""What a named attention variant is: its spec, declared next to its module class, and the registry.

A variant is one unit. Its module file defines the class and calls :func:`register` with a
:class:`VariantSpec`: name, family, exact or approximate, what its decode cache holds, the settings
it accepts (with defaults shared by the builder and the cost model), small ``check`` settings,
arena defaults, the masks it supports and a **cost function** (FLOPs, bytes moved, activation
memory and cache bytes per token, closed-form). :mod:`attnzoo.variants` only collects the specs;
no tool branches on a variant's name. See ``docs/adding-a-variant.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import nn

from attnzoo._validate import check_bool, check_int
from attnzoo.functional.core._request import normalize_window

__all__ = [
    "REGISTRY",
    "Cost",
    "CostShape",
    "VariantConfig",
    "VariantSpec",
    "register",
    "resolve_config",
]

#: How a variant takes positions (see :attr:`VariantSpec.positions`).
POSITION_KINDS = ("rope", "own", "none")
#: Settings the cost model understands; a spec lists the ones that apply to it in ``options``.
KNOWN_OPTIONS = ("num_kv_heads", "window", "global_tokens", "num_features", "segment_len", "chunk_size")


@dataclass(frozen=True)
class VariantConfig:
    """The shape-relevant settings of a variant, with its defaults filled in.

    ``window`` follows ``docs/conventions.md`` (``(left, right)``, ``None`` = unbounded side);
    ``num_features`` is ``F`` of the feature-map families; ``segment_len`` is Infini-attention's
    segment ``S``; ``chunk_size`` the chunk of a chunked causal form.
    """

    name: str
    dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    window: tuple[int | None, int | None] | None = None
    global_tokens: tuple[int, ...] = ()
    num_features: int | None = None
    segment_len: int | None = None
    chunk_size: int | None = None


@dataclass(frozen=True)
class CostShape:
    """Where a layer runs: ``batch`` x ``seq_len`` tokens, ``elem_bytes`` per stored number,
    ``acc_bytes`` per softmax/accumulator number, and the backend whose work to count."""

    batch: int
    seq_len: int
    elem_bytes: int
    acc_bytes: int
    backend: str = "auto"


@dataclass(frozen=True)
class Cost:
    """What a spec's cost function returns for one forward of one layer (Python numbers only)."""

    backend: str  # the backend (or form) whose work ``flops_attention`` counts
    flops_projections: int
    flops_attention: int
    flops_useful: int
    flops_backward: int
    bytes_moved: int
    activation_bytes: int
    kv_cache_bytes_per_token: int  # 0: a fixed-size state
    kv_cache_bytes: int  # after ``seq_len`` tokens, whole batch
    kv_cache_max_tokens: int | None
    params: int
    visible_pairs: int  # per batch element and head


@dataclass(frozen=True)
class VariantSpec:
    """A named variant: how to build it, what it costs, what it can do.

    Attributes:
        name: registry name (``attnzoo list``, ``build_attention(name, ...)``).
        family: ``"softmax"``, ``"feature-map"``, ``"compressive"``, ... (free text, shown by list).
        exact: exact softmax attention (possibly restricted by a mask) vs an approximation.
        time, memory: complexity notes shown by ``attnzoo list``.
        decoding: what the decode cache holds.
        build: ``build(dim, num_heads, **settings) -> nn.Module``; receives ``defaults`` merged
            under the caller's settings.
        cost: ``cost(cfg: VariantConfig, shape: CostShape) -> Cost``, closed-form.
        defaults: settings both the builder and the cost model assume when not given.
        options: settings of :data:`KNOWN_OPTIONS` that apply (others raise in the cost model).
        kv_heads: ``(num_heads, given) -> Hkv`` (default: ``given`` or ``num_heads`` when
            ``num_kv_heads`` is an option, else ``num_heads``).
        causal_modes: the values of ``causal`` the variant supports.
        check: small settings for ``attnzoo check`` (24 tokens wrap windows, segments, chunks).
        arena: ``arena(width, heads, window) -> settings`` for the arena's small models.
        masks: masks supported (shown by ``attnzoo list``).
        ring: runs under context parallelism (ring attention).
        positions: how the variant takes token positions: ``"rope"`` (its module applies a rotary
            embedding passed as ``rope=``; a model with ``pos="rope"`` builds one for it),
            ``"own"`` (it encodes order itself: decays, short convolutions, gates; a model adds
            none) or ``"none"`` (position-free apart from causality: absolute embeddings are the
            model's only option). :class:`~attnzoo.DecoderLM` applies ``pos`` accordingly or
            refuses it naming the variant, never silently nothing.
        rope_dim: ``head_dim -> channels`` of the rotary embedding the variant takes (default: the
            head width; e.g. differential attention rotates half-heads).
        backends: the module takes an attention ``backend`` (``"reference"``, ``"sdpa"``, ...); False:
            it computes with its own kernels and forms, and :func:`~attnzoo.variants.build_attention`
            refuses a ``backend`` other than ``"auto"`` for it, naming the variant.
        order: listing order (built-ins 0..99; a new variant lands after them by default).
        arena_default: trained by a plain ``attnzoo arena`` (whose whole run must fit in about ten
            minutes on 2 cores, so it holds one representative per family); every variant can be
            named with ``--variants`` and ``--task mqar-grid`` takes them all.
    """

    name: str
    family: str
    exact: bool
    time: str
    memory: str
    decoding: str
    build: Callable[..., nn.Module]
    cost: Callable[[VariantConfig, CostShape], Cost]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    options: tuple[str, ...] = ()
    kv_heads: Callable[[int, int | None], int] | None = None
    causal_modes: tuple[bool, ...] = (True, False)
    check: Mapping[str, Any] = field(default_factory=dict)
    arena: Callable[[int, int, int | None], dict[str, Any]] | None = None
    masks: str = "causal"
    ring: bool = False
    positions: str = "none"
    rope_dim: Callable[[int], int] | None = None
    order: int = 100
    arena_default: bool = False
    backends: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"VariantSpec: name must be an identifier-like str, got {self.name!r}")
        bad = [o for o in self.options if o not in KNOWN_OPTIONS]
        if bad:
            raise ValueError(f"VariantSpec {self.name}: unknown options {bad}; expected some of {KNOWN_OPTIONS}")
        if self.positions not in POSITION_KINDS:
            raise ValueError(f"VariantSpec {self.name}: positions must be one of {POSITION_KINDS}, "
                             f"got {self.positions!r}")
        for attr in ("build", "cost"):
            if not callable(getattr(self, attr)):
                raise TypeError(f"VariantSpec {self.name}: {attr} must be callable")
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "check", MappingProxyType(dict(self.check)))

    def takes_rope(self) -> bool:
        """Whether the module applies a rotary embedding passed as ``rope=``."""
        return self.positions == "rope"

    def rope_channels(self, head_dim: int) -> int:
        """Channels of the rotary embedding the variant takes for heads of ``head_dim``."""
        return head_dim if self.rope_dim is None else int(self.rope_dim(head_dim))

    def arena_settings(self, width: int, heads: int, window: int | None) -> dict[str, Any]:
        """Settings of this variant in the arena's models (``{}`` when it declares none)."""
        return {} if self.arena is None else dict(self.arena(width, heads, window))


#: name -> spec, in registration order; :mod:`attnzoo.variants` exposes it sorted as ``VARIANTS``.
REGISTRY: dict[str, VariantSpec] = {}


def register(spec: VariantSpec) -> VariantSpec:
    """Add ``spec`` to the registry (a module file calls this next to its class); returns it.

    Registering a second spec under a taken name raises ``ValueError``.
    """
    if not isinstance(spec, VariantSpec):
        raise TypeError(f"register: expected a VariantSpec, got {type(spec).__name__}")
    old = REGISTRY.get(spec.name)
    if old is not None and old is not spec:
        raise ValueError(f"register: a variant named {spec.name!r} is already registered")
    REGISTRY[spec.name] = spec
    return spec


def _check_options(spec: VariantSpec, given: dict[str, Any]) -> None:
    unknown = sorted(set(given) - set(KNOWN_OPTIONS) - {"head_dim", "causal"})
    if unknown:
        raise TypeError(f"resolve_config: unknown setting(s) {unknown}; expected some of "
                        f"{sorted({*KNOWN_OPTIONS, 'head_dim', 'causal'})}")
    stray = sorted(k for k in given if k in KNOWN_OPTIONS and k not in spec.options)
    if stray:
        raise ValueError(f"{spec.name}: setting(s) {stray} do not apply to this variant "
                         f"(it takes {list(spec.options) or 'none of ' + str(list(KNOWN_OPTIONS))})")
    causal = given.get("causal", True)
    check_bool(causal, "causal")
    if causal not in spec.causal_modes:
        raise ValueError(f"{spec.name}: causal={causal} is not supported (supported: {list(spec.causal_modes)})")


def resolve_config(spec: VariantSpec, dim: int, num_heads: int, **settings: Any) -> VariantConfig:
    """Fill in ``spec``'s defaults exactly as its builder would build it.

    ``settings`` (``None`` = not given): ``num_kv_heads``, ``head_dim``, ``causal``, ``window``,
    ``global_tokens``, ``num_features``, ``segment_len``, ``chunk_size``. A setting outside the
    spec's ``options`` raises ``ValueError`` (it would be silently ignored otherwise).
    """
    dim = check_int(dim, "dim")
    num_heads = check_int(num_heads, "num_heads")
    given = {k: v for k, v in settings.items() if v is not None}
    _check_options(spec, given)
    kw = {**spec.defaults, **given}
    head_dim = kw.get("head_dim")
    if head_dim is None:
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}; pass head_dim")
        head_dim = dim // num_heads
    head_dim = check_int(head_dim, "head_dim")
    causal = bool(kw.get("causal", True))
    kv_given = kw.get("num_kv_heads") if "num_kv_heads" in spec.options else None
    kv_rule = spec.kv_heads or (lambda h, g: h if g is None else g)
    kv = check_int(kv_rule(num_heads, None if kv_given is None else check_int(kv_given, "num_kv_heads")), "num_kv_heads")
    if num_heads % kv:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={kv}")
    window = None
    if "window" in spec.options and kw.get("window") is not None:
        w = kw["window"]
        window = normalize_window((w, 0) if isinstance(w, int) and not isinstance(w, bool) and causal else w)
    globals_ = tuple(int(g) for g in kw.get("global_tokens", ())) if "global_tokens" in spec.options else ()
    nf = kw.get("num_features") if "num_features" in spec.options else None
    nf = None if nf is None else check_int(nf, "num_features")
    seg = check_int(kw["segment_len"], "segment_len") if "segment_len" in spec.options else None
    chunk = kw.get("chunk_size") if "chunk_size" in spec.options else None
    return VariantConfig(name=spec.name, dim=dim, num_heads=num_heads, num_kv_heads=kv, head_dim=head_dim,
                         causal=causal, window=window, global_tokens=globals_, num_features=nf,
                         segment_len=seg, chunk_size=None if chunk is None else check_int(chunk, "chunk_size"))
