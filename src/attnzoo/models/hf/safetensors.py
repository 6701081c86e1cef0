"""Reading ``.safetensors`` files and Hugging Face checkpoint folders.

With the ``safetensors`` package installed, files are opened memory-mapped with its
``safe_open``; without it, a small parser written with torch only reads them. Both refuse a
malformed file with :class:`CheckpointFormatError` naming the file and the problem: a header
that is not UTF-8 JSON or not an object, an entry without ``dtype``/``shape``/``data_offsets``,
an unknown dtype, offsets that overlap, leave holes or run past the end of the file, a byte
range whose size does not match its shape and dtype.

Format: an 8-byte little-endian header length ``n``, ``n`` bytes of JSON mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [start, end]}`` (offsets relative to the end of
the header; ``"__metadata__"`` holds free-form strings), then the little-endian data.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnzoo.models.hf.errors import CheckpointFormatError

__all__ = ["load_state_dict_from_folder", "read_json", "read_safetensors"]

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"),
                     ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _ST_DTYPES[_name] = getattr(torch, _attr)

INSTALL_HINT = "pip install safetensors"


def _safetensors_package() -> Any:
    """The ``safetensors`` package's ``safe_open``, or ``None`` when it is not installed."""
    try:
        from safetensors import safe_open
    except ImportError:
        return None
    return safe_open


def read_safetensors(path: str | os.PathLike[str], *, use_package: bool | None = None) -> dict[str, Tensor]:
    """Read every tensor of a ``.safetensors`` file into CPU tensors ``{name: tensor}``.

    Args:
        path: the file.
        use_package: ``None`` (default) uses the ``safetensors`` package when it is installed
            and the torch-only parser otherwise; ``True`` requires the package (``ImportError``
            with the install hint when missing); ``False`` always uses the torch-only parser.

    Raises:
        FileNotFoundError: no such file.
        CheckpointFormatError: the file is malformed (the message names the file and the problem).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"read_safetensors: no such file {str(p)!r}")
    if use_package is not None and not isinstance(use_package, bool):
        raise TypeError(f"read_safetensors: use_package must be None or a bool, got {type(use_package).__name__}")
    safe_open = _safetensors_package() if use_package is not False else None
    if use_package and safe_open is None:
        raise ImportError(f"read_safetensors(use_package=True) needs the safetensors package: {INSTALL_HINT}")
    if safe_open is None:
        return _read_with_torch(p)
    return _read_with_package(p, safe_open)


def _read_with_package(p: Path, safe_open: Any) -> dict[str, Tensor]:
    try:
        with safe_open(str(p), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    except Exception as exc:  # the package raises its own SafetensorError (and others) without the path
        raise CheckpointFormatError(f"{str(p)!r} is not a valid safetensors file: {type(exc).__name__}: {exc}") \
            from exc


def _read_header(p: Path, buf: bytearray) -> tuple[dict[str, Any], int]:
    """The parsed JSON header and the offset where the data starts."""
    size = len(buf)
    if size < 8:
        raise CheckpointFormatError(f"{str(p)!r} is too short ({size} bytes) to be a safetensors file")
    n = int.from_bytes(buf[:8], "little")
    if n <= 0 or 8 + n > size:
        raise CheckpointFormatError(f"{str(p)!r} has an invalid header length {n} (file size {size})")
    try:
        header = json.loads(bytes(buf[8: 8 + n]).decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointFormatError(f"{str(p)!r}: the safetensors header is not UTF-8 text ({exc})") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointFormatError(f"{str(p)!r}: the safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{str(p)!r}: the safetensors header must be a JSON object, "
                                    f"got {type(header).__name__}")
    meta = header.get("__metadata__")
    if meta is not None and (not isinstance(meta, dict)
                             or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise CheckpointFormatError(f"{str(p)!r}: the safetensors __metadata__ must be an object of strings "
                                    f"(name -> text), got {type(meta).__name__} {str(meta)[:80]}")
    return header, 8 + n


def _entry(p: Path, name: str, info: object, data_len: int) -> tuple[torch.dtype, list[int], int, int]:
    """Validate one header entry: dtype, shape, offsets and the size they imply."""
    where = f"{str(p)!r}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointFormatError(f"{where}: entry must be an object, got {type(info).__name__}")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise CheckpointFormatError(f"{where}: entry is missing {missing}")
    dt = _ST_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dt is None:
        raise CheckpointFormatError(f"{where}: unsupported dtype {info['dtype']!r} (supported: {sorted(_ST_DTYPES)})")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                              for s in shape):
        raise CheckpointFormatError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise CheckpointFormatError(f"{where}: data_offsets must be [start, end] ints, got {offsets!r}")
    start, end = offsets
    if not 0 <= start <= end <= data_len:
        raise CheckpointFormatError(f"{where}: data_offsets {offsets} outside the {data_len} data bytes")
    nbytes = math.prod(shape) * torch.empty((), dtype=dt).element_size()
    if end - start != nbytes:
        raise CheckpointFormatError(f"{where}: data_offsets {offsets} hold {end - start} bytes, but shape {shape} "
                                    f"{info['dtype']} needs {nbytes}")
    return dt, shape, start, end


def _check_layout(p: Path, spans: list[tuple[int, int, str]], data_len: int) -> None:
    """Byte ranges must tile the data exactly: no overlap, no hole, nothing after the last."""
    pos, prev = 0, None
    for start, end, name in sorted(spans):
        if start < pos:
            raise CheckpointFormatError(f"{str(p)!r}: tensors {prev!r} and {name!r} overlap (bytes {start}..{pos})")
        if start > pos:
            raise CheckpointFormatError(f"{str(p)!r}: {start - pos} bytes before tensor {name!r} belong to no tensor")
        pos, prev = end, name
    if pos != data_len:
        raise CheckpointFormatError(f"{str(p)!r}: the tensors cover {pos} of the {data_len} data bytes")


def _read_with_torch(p: Path) -> dict[str, Tensor]:
    size = p.stat().st_size
    buf = bytearray(size)
    with open(p, "rb") as f:
        if f.readinto(buf) != size:
            raise CheckpointFormatError(f"could not read all {size} bytes of {str(p)!r}")
    header, base = _read_header(p, buf)
    data_len = size - base
    entries = {name: _entry(p, name, info, data_len) for name, info in header.items() if name != "__metadata__"}
    _check_layout(p, [(start, end, name) for name, (_, _, start, end) in entries.items() if end > start], data_len)
    out: dict[str, Tensor] = {}
    for name, (dt, shape, start, _) in entries.items():
        numel = math.prod(shape)
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dt)
        else:
            out[name] = torch.frombuffer(buf, dtype=dt, count=numel, offset=base + start).reshape(shape)
    return out


def read_json(path: Path, what: str = "file") -> Any:
    """A JSON file's content; invalid JSON is a :class:`CheckpointFormatError` naming the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointFormatError(f"{str(path)!r}: {what} is not valid JSON ({exc})") from exc


def _read_index(index: Path) -> dict[str, Tensor]:
    data = read_json(index, "the shard index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointFormatError(f"{str(index)!r}: expected an object with a 'weight_map' of "
                                    f"tensor name -> shard file name")
    sd: dict[str, Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        tensors = read_safetensors(index.parent / shard)
        twice = sorted(set(sd) & set(tensors))
        if twice:
            raise CheckpointFormatError(f"{str(index.parent / shard)!r}: tensors {twice[:5]} also appear in "
                                        f"another shard")
        sd.update(tensors)
    return sd


def load_state_dict_from_folder(folder: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The checkpoint of a Hugging Face model folder: ``model.safetensors``, sharded safetensors
    (``model.safetensors.index.json``) or ``pytorch_model.bin`` (loaded with ``weights_only``)."""
    d = Path(folder)
    single = d / "model.safetensors"
    index = d / "model.safetensors.index.json"
    if single.is_file():
        return read_safetensors(single)
    if index.is_file():
        return _read_index(index)
    binary = d / "pytorch_model.bin"
    if binary.is_file():
        try:
            sd = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several types (pickle, zip, runtime) without the path
            raise CheckpointFormatError(f"{str(binary)!r} could not be loaded: {type(exc).__name__}: {exc}") from exc
        if not isinstance(sd, dict) or not all(isinstance(v, Tensor) for v in sd.values()):
            raise CheckpointFormatError(f"{str(binary)!r}: expected a state dict (name -> tensor)")
        return sd
    raise FileNotFoundError(f"no model.safetensors, model.safetensors.index.json or pytorch_model.bin in {str(d)!r}")
