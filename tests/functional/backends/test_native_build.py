"""Where the compiled kernels come from: ``setup.py`` building them during ``pip install`` (a
failure never fails the install), the tag that keeps a build for another Python/torch/CPU/source from
being loaded, and the order in which ``native_module`` looks (the ``attnzoo native --build`` cache
first, then the installed module)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnzoo.functional.backends.tiled import native, native_build

ROOT = Path(__file__).resolve().parents[3]
MODULE = f"{native_build.NAME}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
TILED = Path("attnzoo", "functional", "backends", "tiled")


def _install(here: Path, tag: str | None, module: bool = True) -> None:
    here.mkdir(parents=True, exist_ok=True)
    if module:
        (here / MODULE).write_bytes(b"")
    if tag is not None:
        (here / native_build.TAG_FILE).write_text(tag + "\n")


@pytest.mark.parametrize("tag, module, used", [
    ("this", True, True),
    ("0123456789abcdef", True, False),  # built for another Python, torch, CPU or source
    (None, True, False),  # no tag: never trusted
    ("this", False, False),  # a tag without its module
])
def test_an_installed_build_is_used_only_under_its_own_tag(tmp_path: Path, tag: str | None, module: bool,
                                                           used: bool) -> None:
    _install(tmp_path, native_build.cpu_tag() if tag == "this" else tag, module)
    assert native._installed_in(tmp_path) == (tmp_path / MODULE if used else None)


def test_the_tag_follows_the_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = native_build.cpu_tag()
    edited = tmp_path / "native_window.cpp"
    edited.write_text(native_build.SOURCES[0].read_text() + "\n// edited\n")
    monkeypatch.setattr(native_build, "SOURCES", (edited, *native_build.SOURCES[1:]))
    native_build.cpu_tag.cache_clear()
    try:
        assert native_build.cpu_tag() != before
    finally:
        monkeypatch.undo()
        native_build.cpu_tag.cache_clear()
    assert native_build.cpu_tag() == before


def test_the_cache_build_comes_before_the_installed_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNZOO_NATIVE_DIR", str(tmp_path / "cache"))
    installed = tmp_path / "site" / MODULE
    monkeypatch.setattr(native, "installed_path", lambda: installed)
    assert native.module_path() == installed
    built = native._built(native.build_dir())
    built.parent.mkdir(parents=True)
    built.write_bytes(b"")
    assert native.module_path() == built


def test_a_module_that_does_not_load_means_the_pytorch_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed file that is not a loadable module (a torch upgraded under it would fail the same way)."""
    monkeypatch.setenv("ATTNZOO_NATIVE_DIR", str(tmp_path / "cache"))
    _install(tmp_path / "site", native_build.cpu_tag())
    monkeypatch.setattr(native, "installed_path", lambda: native._installed_in(tmp_path / "site"))
    native._cache.pop(native.build_dir(), None)
    try:
        assert native.native_module() is None
    finally:
        native._cache.pop(native.build_dir(), None)


def test_cli_native_says_why_an_installed_build_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """After a torch upgrade the install's module no longer matches: ``attnzoo native`` says so."""
    from attnzoo import cli

    here = tmp_path / "site"
    _install(here, "0123456789abcdef")
    monkeypatch.setattr(native, "__file__", str(here / "native.py"))
    monkeypatch.setenv("ATTNZOO_NATIVE_DIR", str(tmp_path / "cache"))
    native._cache.pop(native.build_dir(), None)
    try:
        assert native.installed_path() is None
        assert "built for tag 0123456789abcdef" in (native.stale_install() or "")
        assert cli.main(["native"]) == 0
        out = capsys.readouterr().out
        assert "not built" in out and "the install's build is not used" in out
        (here / native_build.TAG_FILE).unlink()
        assert "has no" in (native.stale_install() or "")
        (here / MODULE).unlink()
        assert native.stale_install() is None  # no module: nothing to explain
    finally:
        native._cache.pop(native.build_dir(), None)


def _setup_build_ext(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``python setup.py build_ext`` of a copy of the repository's build files into ``tmp_path``."""
    src = tmp_path / "repo"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src" / TILED, src / "src" / TILED, ignore=shutil.ignore_patterns("*.so", "*.tag"))
    return subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                           "--build-temp", str(tmp_path / "tmp")], cwd=src, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_setup_py_without_a_compiler_still_installs(tmp_path: Path) -> None:
    run = _setup_build_ext(tmp_path, CXX="/bin/false", CC="/bin/false")
    assert run.returncode == 0, run.stderr
    assert "compiled kernels were not built" in run.stderr
    assert not list(tmp_path.rglob("*.tag"))


def test_setup_py_can_be_told_not_to_build(tmp_path: Path) -> None:
    run = _setup_build_ext(tmp_path, ATTNZOO_NATIVE_BUILD="0")
    assert run.returncode == 0, run.stderr
    assert "ATTNZOO_NATIVE_BUILD=0" in run.stderr
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_setup_py_builds_a_module_the_package_loads_and_that_matches_the_reference(tmp_path: Path) -> None:
    """The real install-time build (about 40 s): its module lies under its tag and computes attention."""
    run = _setup_build_ext(tmp_path)
    assert run.returncode == 0, run.stderr
    here = tmp_path / "lib" / TILED
    path = native._installed_in(here)
    assert path is not None, sorted(p.name for p in here.iterdir())
    spec = importlib.util.spec_from_file_location(native_build.NAME, path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    q, k, v = (torch.randn(1, 2, 200, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    out, _ = mod.window_fwd(q, k, v, 200, 0, 0.25, 0.0, native.BLOCK, True, None)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                           scale=0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
