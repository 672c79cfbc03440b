"""A GGUF file's metadata and tensor table, and its tensors as views of one memory map.

`gguf.GGUFReader` builds a Python object for every element of every metadata array (the
vocabulary and the merges: 300 000 strings for Qwen2.5), 5-8 s on a busy 2-core machine
before a tensor can be located; this reader walks them without decoding unless asked
(`string_arrays`), so the table is ready in milliseconds. The tests check it against
`gguf.GGUFReader` (names, types, shapes, bytes).

The map is private copy-on-write (`mode="c"`): the tensors are views of the file's pages,
read from disk on first touch and shared with the page cache; ferrobatch never writes them.
"""

from __future__ import annotations

import struct
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ferrobatch.errors import FieldError
from ferrobatch.gguf.formats import qtype_name

__all__ = ["GGUFFile", "TensorEntry", "is_gguf_file"]

MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# metadata scalar types: struct format
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def is_gguf_file(path: str | Path) -> bool:
    """Whether `path` is a file starting with the GGUF magic."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the table: `shape` in torch order (rows first), `offset` absolute."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int

    @property
    def qtype(self) -> str:
        return qtype_name(self.ggml_type)


class GGUFFile:
    """`metadata` (string arrays as their length unless named in `string_arrays`),
    `tensors` (name -> `TensorEntry`, file order) and `raw(name)` / `array(name)` views of the
    tensor bytes. Raises `FieldError` (field "model") for a file that is not GGUF."""

    def __init__(self, path: str | Path, string_arrays: Container[str] = ()) -> None:
        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, mode="c", dtype=np.uint8)
        except (OSError, ValueError) as exc:
            raise FieldError(f"{self.path}: cannot map the file ({exc})", "model") from exc
        blob = self._map
        if blob.size < 24 or bytes(blob[:4]) != MAGIC:
            raise FieldError(f"{self.path} is not a GGUF file (no GGUF magic)", "model")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", blob, 4)
        if version not in _VERSIONS:
            raise FieldError(f"{self.path}: GGUF version {version} is not supported "
                             f"(versions {_VERSIONS})", "model")
        self.version = version
        pos = 24
        meta: dict[str, Any] = {}
        try:
            for _ in range(n_kv):
                key, pos = self._string(pos)
                (vtype,) = struct.unpack_from("<I", blob, pos)
                meta[key], pos = self._value(pos + 4, vtype, key in string_arrays)
            entries: list[tuple[str, tuple[int, ...], int, int]] = []
            for _ in range(n_tensors):
                name, pos = self._string(pos)
                (ndim,) = struct.unpack_from("<I", blob, pos)
                dims = struct.unpack_from(f"<{ndim}Q", blob, pos + 4)
                gtype, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * ndim)
                pos += 4 + 8 * ndim + 12
                entries.append((name, tuple(int(d) for d in reversed(dims)), int(gtype),
                                int(offset)))
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            raise FieldError(f"{self.path}: damaged GGUF header ({exc})", "model") from exc
        self.metadata = meta
        align = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise FieldError(f"{self.path}: damaged GGUF header (general.alignment is "
                             f"{align!r}, not a power of two)", "model")
        self.data_start = (pos + align - 1) // align * align
        self.tensors: dict[str, TensorEntry] = {}
        for name, shape, gtype, offset in entries:
            nbytes = _nbytes(gtype, shape)
            start = self.data_start + offset
            if nbytes is not None and start + nbytes > blob.size:
                raise FieldError(f"{self.path}: tensor {name} runs past the end of the file "
                                 "(truncated?)", "model")
            self.tensors[name] = TensorEntry(name, shape, gtype, start, nbytes or 0)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def file_size(self) -> int:
        return int(self._map.size)

    def maps(self, address: int, nbytes: int) -> bool:
        """Whether the `nbytes` bytes at `address` lie inside this file's memory map (a view
        of the file, not memory of its own)."""
        base = self._map.ctypes.data
        return base <= address and address + nbytes <= base + self._map.size

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a uint8 view of the map, shaped [rows, bytes a row] (a
        vector: [bytes])."""
        t = self.tensors[name]
        flat = self._map[t.offset:t.offset + t.nbytes]
        if len(t.shape) <= 1:
            return flat
        rows = int(np.prod(t.shape[:-1]))
        return flat.reshape(rows, t.nbytes // rows)

    def array(self, name: str) -> np.ndarray:
        """A float tensor (F32 / F16 / BF16: BF16 as uint16 bits) as a view in its dtype,
        torch-order shape."""
        t = self.tensors[name]
        dt = {0: np.float32, 1: np.float16, 30: np.uint16}[t.ggml_type]
        return self._map[t.offset:t.offset + t.nbytes].view(dt).reshape(t.shape)

    # ------------------------------------------------------------------ parsing

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._map, pos)
        pos += 8
        return bytes(self._map[pos:pos + n]).decode("utf-8"), pos + n

    def _value(self, pos: int, vtype: int, keep: bool) -> tuple[Any, int]:
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            (v,) = struct.unpack_from(fmt, self._map, pos)
            return v, pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._string(pos)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", self._map, pos)
            pos += 12
            if etype in _SCALARS:
                fmt = _SCALARS[etype]
                width = struct.calcsize(fmt)
                values = struct.unpack_from(f"<{count}{fmt[1]}", self._map, pos)
                return list(values), pos + count * width
            if etype == _STRING:
                if keep:
                    out = []
                    for _ in range(count):
                        s, pos = self._string(pos)
                        out.append(s)
                    return out, pos
                for _ in range(count):
                    (n,) = struct.unpack_from("<Q", self._map, pos)
                    pos += 8 + n
                return count, pos
            raise ValueError(f"metadata array of element type {etype}")
        raise ValueError(f"metadata value of type {vtype}")


def _nbytes(ggml_type: int, shape: tuple[int, ...]) -> int | None:
    """Bytes of a tensor of `shape` (torch order) and type, None for a type gguf-py does not
    know (refused later, by name)."""
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None
    n = int(np.prod(shape)) if shape else 1
    return n // block * size
