"""The math: parameter-free attention functions. No ``nn.Parameter``, no global state, no printing.

The modules live in rooms by kind (``docs/architecture.md``, "Rooms of functional/"): ``core``
(the request and the rules every room shares), ``backends`` (the softmax kernels and their
compiled operators), ``softmax`` (the dispatcher ``attention`` and what is built on it),
``feature_maps`` (linear, Performer, Infini) and ``recurrent`` (the chunked scans). Each module's
old path, ``attnzoo.functional.<module>`` (``<module>`` also ``tiled.plan``, ``tiled.scores``,
...), is an alias of the module in its room (``OLD_PATHS``): the same module object, so code
written before the rooms imports and monkeypatches it as before.
"""

import sys
from types import ModuleType

from attnzoo.functional.backends import (
    decode,
    flash,
    flex,
    halfmath,
    reference,
    reference_ops,
    sdpa,
    tiled,
    tiled_ops,
)
from attnzoo.functional.backends.tiled import backward as _tiled_backward
from attnzoo.functional.backends.tiled import forward as _tiled_forward
from attnzoo.functional.backends.tiled import plan as _tiled_plan
from attnzoo.functional.backends.tiled import scores as _tiled_scores
from attnzoo.functional.core import _edge, _request, rules, score_mod
from attnzoo.functional.feature_maps import infini, linear, performer
from attnzoo.functional.recurrent import _chunked_scan, delta_product, delta_rule, gla, retention
from attnzoo.functional.softmax import attention as _attention_module
from attnzoo.functional.softmax import nsa, sigmoid, sinks, varlen, varlen_split
from attnzoo.functional.softmax.attention import (
    BACKENDS,
    attention,
    available_backends,
    choose_backend,
    merge_attention,
)

__all__ = ["BACKENDS", "OLD_PATHS", "attention", "available_backends", "choose_backend", "merge_attention"]

#: Each module's path before the rooms (relative to this package) -> the module in its room.
OLD_PATHS: dict[str, ModuleType] = {
    module.__name__.rsplit(".", 1)[-1]: module
    for module in (_edge, _request, rules, score_mod,
                   decode, flash, flex, halfmath, reference, reference_ops, sdpa, tiled, tiled_ops,
                   _attention_module, nsa, sigmoid, sinks, varlen, varlen_split,
                   infini, linear, performer,
                   _chunked_scan, delta_product, delta_rule, gla, retention)
} | {f"tiled.{part.__name__.rsplit('.', 1)[-1]}": part
     for part in (_tiled_backward, _tiled_forward, _tiled_plan, _tiled_scores)}

for _old, _module in OLD_PATHS.items():
    sys.modules.setdefault(f"{__name__}.{_old}", _module)
# The package attribute ``attention`` stays the function (as it always was: importing the function
# shadowed the submodule of that name; sys.modules has the module); every other old name is the
# module, here and in sys.modules. ``tiled``'s parts are attributes of the tiled package already.
del _old, _module
