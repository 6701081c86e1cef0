"""Builds attnzoo's optional compiled CPU kernels while pip installs the package.

Everything about the package is in ``pyproject.toml``; this file only adds the kernels
(``src/attnzoo/functional/backends/tiled/native_*.cpp``) as an *optional* extension:

- they are built with ``torch.utils.cpp_extension`` against the torch that will run them, so they
  need torch importable while building: ``pip install --no-build-isolation`` after torch is
  installed (the README's commands). In pip's default isolated build there is no torch and the
  kernels are skipped;
- a failed build (no C++ compiler, not x86-64) never fails the install: the package keeps its
  PyTorch path, and ``attnzoo native --build`` can build them later;
- ``ATTNZOO_NATIVE_BUILD=0`` skips them;
- beside the module a ``.tag`` file records the Python, torch, CPU flags and sources it was built
  for; attnzoo loads the module only where its own tag matches (``native_build.cpu_tag``).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
TILED = Path("src", "attnzoo", "functional", "backends", "tiled")
PACKAGE = "attnzoo.functional.backends.tiled"


def _say(message: str) -> None:
    print(f"attnzoo setup: {message}", file=sys.stderr)


def _recipe():  # type: ignore[no-untyped-def]
    """``native_build.py`` loaded by its path (the package is not installed yet)."""
    spec = importlib.util.spec_from_file_location("_attnzoo_native_build", HERE / TILED / "native_build.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _native_extension() -> dict:
    """``ext_modules`` and ``cmdclass`` for the kernels, or nothing where they are not to be built."""
    if os.environ.get("ATTNZOO_NATIVE_BUILD", "1") == "0":
        _say("ATTNZOO_NATIVE_BUILD=0: the compiled kernels are not built")
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        _say("torch is not importable in this build (pip's isolated build): the compiled kernels are "
             "not built; install with --no-build-isolation after torch, or run `attnzoo native --build`")
        return {}
    recipe = _recipe()  # imports torch: after the check above
    if not recipe.is_x86():
        _say(f"the compiled kernels are for x86-64 CPUs, this is {platform.machine()}: not built")
        return {}

    class OptionalBuild(BuildExtension):  # type: ignore[misc]
        """Builds the kernels if it can; a failure leaves the PyTorch path and the install intact."""

        def run(self) -> None:
            try:
                super().run()  # into the build folder, then copied into src/ for an editable install
            except Exception as exc:  # any compiler or linker failure: the kernels are optional
                _say(f"the compiled kernels were not built ({type(exc).__name__}: {exc}); attnzoo uses "
                     "its PyTorch path (`attnzoo native --build` shows the reason again)")
                return
            for ext in self.extensions:  # where the module now lies (the source tree when in place)
                module = Path(self.get_ext_fullpath(ext.name))
                if module.exists():
                    module.with_name(recipe.TAG_FILE).write_text(recipe.cpu_tag() + "\n")

    ext = CppExtension(f"{PACKAGE}.{recipe.NAME}", [str(s.relative_to(HERE)) for s in recipe.SOURCES],
                       extra_compile_args=recipe.compile_flags(), extra_link_args=recipe.link_flags())
    return {"ext_modules": [ext], "cmdclass": {"build_ext": OptionalBuild.with_options(use_ninja=True)}}


setup(**_native_extension())
