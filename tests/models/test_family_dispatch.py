"""The families dispatch themselves: every module of ``attnzoo.models.families`` declares its
``DISPATCH`` (``model_type`` -> name, converter, transformers classes) and ``models/hf/convert.py``
takes each of them, so a family is never written and then forgotten by ``from_hf``."""

from __future__ import annotations

import importlib
import pkgutil

import attnzoo.models.families as families
from attnzoo.models.families._common import Dispatch
from attnzoo.models.hf.convert import BUILDERS, FAMILY_MODULES, MODEL_TYPES, SUPPORTED_ARCHITECTURES


def test_every_family_module_is_dispatched() -> None:
    public = [importlib.import_module(f"{families.__name__}.{m.name}")
              for m in pkgutil.iter_modules(families.__path__) if not m.name.startswith("_")]
    assert public and all(isinstance(getattr(m, "DISPATCH", None), dict) for m in public), \
        [m.__name__ for m in public if not hasattr(m, "DISPATCH")]
    assert {m.__name__ for m in public} == {m.__name__ for m in FAMILY_MODULES}


def test_each_dispatch_reaches_from_hf() -> None:
    seen: set[str] = set()
    for module in FAMILY_MODULES:
        for model_type, d in module.DISPATCH.items():
            assert isinstance(d, Dispatch) and d.classes and callable(d.convert), (module.__name__, model_type)
            assert model_type not in seen, f"{model_type} dispatched twice"
            seen.add(model_type)
            assert BUILDERS[model_type] == (d.name, d.convert) and MODEL_TYPES[model_type] == d.name
            assert set(d.classes) <= set(SUPPORTED_ARCHITECTURES)
    assert seen == set(BUILDERS)
