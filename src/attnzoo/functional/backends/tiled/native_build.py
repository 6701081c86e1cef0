"""What the compiled kernels are built from and for: the sources, the compiler flags and the *tag*
(a hash of the Python, torch, CPU flags and sources a build is valid for).

Two builders share it: :func:`attnzoo.functional.backends.tiled.native.build` (``attnzoo native
--build``, into ``$ATTNZOO_NATIVE_DIR``) and the repository's ``setup.py`` (``pip install
--no-build-isolation``, beside this file). ``setup.py`` loads this file by its path, before the
package is installed, so it imports nothing of attnzoo: only the standard library and torch.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import sys
from pathlib import Path

import torch

__all__ = ["HEADERS", "NAME", "SOURCES", "TAG_FILE", "compile_flags", "cpu_tag", "is_x86", "link_flags"]

#: the extension module's name (one module: windows / packed sequences / decoding, and NSA's selected branch)
NAME = "attnzoo_native_window"
#: the compiled sources
SOURCES = tuple(Path(__file__).with_name(name) for name in ("native_window.cpp", "native_nsa.cpp"))
#: what the sources include from beside them (part of the tag)
HEADERS = tuple(Path(__file__).with_name(name) for name in ("native_common.h", "native_fused.h"))
#: written beside a module that ``pip install`` built: the tag it was built for
TAG_FILE = f"{NAME}.tag"


@functools.cache
def cpu_tag() -> str:
    """A short hash of what the compiled code depends on: Python, torch, the CPU's flags
    (``-march=native``) and the sources (computed once a process: it is on every call's path)."""
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    key = "|".join((sys.version, torch.__version__, platform.machine(), flags,
                    *(s.read_text() for s in SOURCES + HEADERS)))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def is_x86() -> bool:
    """Whether this machine is x86-64, the only one the kernels are written for (their BLAS symbol,
    ``-march=native`` and the AVX-512 width hint)."""
    return platform.machine() in ("x86_64", "AMD64")


def compile_flags() -> list[str]:
    """The C++ flags: optimised for the CPU that builds (the tag holds its flags); no debug
    information (Python's default ``-g`` makes the module 16 MB instead of 0.3)."""
    flags = ["-O3", "-g0", "-ffast-math", "-fopenmp"]
    if is_x86():
        flags += ["-march=native", "-mprefer-vector-width=512"]
    return flags


def link_flags() -> list[str]:
    """The linker flags (OpenMP)."""
    return ["-fopenmp"]
