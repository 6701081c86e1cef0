"""One validator vocabulary (issue 32): the generic argument checks live in ``attnzoo._validate`` only.

(a) an AST scan of ``src/attnzoo``: no module but ``_validate.py`` defines one of the private duplicates
that were removed, and ``check_cu_seqlens`` is defined once;
(b) each vocabulary function: a value of the wrong type raises ``TypeError`` naming the argument and the
owner, a value out of range ``ValueError`` with the value, a valid value comes back normalised.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from attnzoo import _validate as v

SRC = Path(__file__).resolve().parents[2] / "src" / "attnzoo"

#: Private re-implementations of generic checks that ``_validate`` replaced (none may come back).
REMOVED = {
    "_pos_int", "_finite", "_flag", "_check_pos_int", "_check_prob", "_check_bool", "_check_choice",
    "_check_positive_float", "_check_eps", "_check_scale", "_check_flag", "_check_float", "_check_dropout",
    "check_flag", "check_chunk", "check_chunk_size", "check_int", "check_bool", "check_float",
    "check_positive_float", "check_number_above", "check_optional_int", "check_probability", "check_choice",
    "check_finite_float", "check_nonnegative_float", "check_cu_seqlens_tensor",
}


def _definitions() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.setdefault(node.name, []).append(str(path.relative_to(SRC)))
    return found


def test_no_module_but_validate_defines_a_generic_check() -> None:
    defs = _definitions()
    dupes = {name: [p for p in defs.get(name, []) if p != "_validate.py"] for name in REMOVED}
    assert not {name: paths for name, paths in dupes.items() if paths}, "use attnzoo._validate instead"


def test_check_cu_seqlens_is_defined_once() -> None:
    assert _definitions().get("check_cu_seqlens") == ["_validate.py"]


def test_vocabulary_is_exported() -> None:
    for name in ("check_int", "check_optional_int", "check_bool", "check_float", "check_finite_float",
                 "check_positive_float", "check_nonnegative_float", "check_number_above", "check_probability",
                 "check_choice", "check_tensor_ranks", "check_cu_seqlens"):
        assert name in v.__all__ and callable(getattr(v, name))


# (function, extra keywords, a value of the wrong type, a value out of range, (valid value, normalised))
CASES = [
    (v.check_int, {}, 1.5, 0, (3, 3)),
    (v.check_int, {"minimum": 0}, True, -1, (0, 0)),
    (v.check_optional_int, {}, "4", 0, (None, None)),
    (v.check_optional_int, {"minimum": 2}, 2.0, 1, (2, 2)),
    (v.check_float, {}, "1", None, (2, 2.0)),
    (v.check_finite_float, {}, None, math.inf, (-2, -2.0)),
    (v.check_finite_float, {"optional": True}, "x", math.nan, (None, None)),
    (v.check_positive_float, {}, True, 0.0, (3, 3.0)),
    (v.check_positive_float, {"optional": True}, [1.0], -1.0, (None, None)),
    (v.check_nonnegative_float, {}, "0", -0.5, (0, 0.0)),
    (v.check_number_above, {"lower": 1.0}, None, 1.0, (1.5, 1.5)),
    (v.check_probability, {}, "0.1", 1.0, (0, 0.0)),
    (v.check_choice, {"choices": ("a", "b")}, 1, "c", ("b", "b")),
]


@pytest.mark.parametrize(("fn", "kw", "wrong_type", "out_of_range", "valid"), CASES,
                         ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(CASES)])
def test_vocabulary_function(fn, kw, wrong_type, out_of_range, valid) -> None:
    with pytest.raises(TypeError, match=r"^Owner: arg must be .*, got ") as err:
        fn(wrong_type, "arg", "Owner", **kw)
    assert type(wrong_type).__name__ in str(err.value)
    if out_of_range is not None:
        with pytest.raises(ValueError, match=r"^Owner: arg must be ") as err:
            fn(out_of_range, "arg", "Owner", **kw)
        assert f"got {out_of_range!r}" in str(err.value)
    value, normalised = valid
    out = fn(value, "arg", "Owner", **kw)
    assert out == normalised and type(out) is type(normalised)


def test_check_bool() -> None:
    assert v.check_bool(True, "flag", "Owner") is True
    with pytest.raises(TypeError, match=r"^Owner: flag must be a bool, got int \(1\)"):
        v.check_bool(1, "flag", "Owner")


def test_check_int_without_owner_and_from_a_tensor() -> None:
    with pytest.raises(ValueError, match=r"^n must be >= 1, got 0$"):
        v.check_int(0, "n")
    assert v.check_int(torch.tensor(5), "n", allow_tensor=True) == 5
    with pytest.raises(TypeError, match="n must be an int"):
        v.check_int(torch.tensor(5), "n")
    assert v.check_int(-7, "offset", minimum=None) == -7


def test_check_tensor_ranks() -> None:
    v.check_tensor_ranks(2, "[N, D]", x=torch.zeros(2, 3))
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor, got list"):
        v.check_tensor_ranks(2, "[N, D]", x=[1])
    with pytest.raises(ValueError, match=r"x must be rank 2 \[N, D\], got shape \(3,\)"):
        v.check_tensor_ranks(2, "[N, D]", x=torch.zeros(3))


def test_check_cu_seqlens() -> None:
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    assert v.check_cu_seqlens(cu, owner="f", total=5) is cu
    with pytest.raises(TypeError, match=r"^f: cu_seqlens must be an int32 tensor \[S\+1\], got list"):
        v.check_cu_seqlens([0, 5], owner="f")
    with pytest.raises(TypeError, match=r"^f: cu_seqlens must have dtype torch\.int32"):
        v.check_cu_seqlens(cu.long(), owner="f")
    assert v.check_cu_seqlens(cu.long(), owner="f", int32=False).dtype == torch.int64
    with pytest.raises(TypeError, match=r"must be an int tensor \[S\+1\], got dtype torch\.float32"):
        v.check_cu_seqlens(cu.float(), owner="f", int32=False)
    with pytest.raises(ValueError, match=r"^f: cu_seqlens must be 1-d \[S\+1\] with S >= 1, got shape \(1,\)"):
        v.check_cu_seqlens(cu[:1], owner="f")
    for bad, total in (([1, 5], 5), ([0, 3, 2, 5], 5), ([0, 2, 4], 5)):
        with pytest.raises(ValueError, match=r"^f: cu_seqlens must start at 0, be non-decreasing and end at 5"):
            v.check_cu_seqlens(torch.tensor(bad, dtype=torch.int32), owner="f", total=total)
    with pytest.raises(ValueError, match=r"got \[0, 3, 2\]"):
        v.check_cu_seqlens(torch.tensor([0, 3, 2], dtype=torch.int32), "cu_seqlens_q")
    v.check_cu_seqlens(torch.tensor([0, 3, 2], dtype=torch.int32), values=False)  # values not read


@pytest.mark.parametrize(("value", "expected"), [(1, True), (2.5, True), (-0.0, True), (True, False),
                                                 (math.inf, False), (math.nan, False), ("1", False), (None, False)])
def test_is_finite_number(value: object, expected: bool) -> None:
    assert v.is_finite_number(value) is expected
