"""A GGUF file's metadata and tensor table, and its tensors as views of one memory map.

`gguf.GGUFReader` builds a Python object for every element of every metadata array (the
vocabulary and the merges: 300 000 strings for Qwen2.5), 5-8 s on a busy 2-core machine
before a tensor can be located; this reader walks them without decoding unless asked
(`string_arrays`), so the table is ready in milliseconds. The tests check it against
`gguf.GGUFReader` (names, types, shapes, bytes).

The map is private copy-on-write (`mode="c"`): the tensors are views of the file's pages,
read from disk on first touch and shared with the page cache; ferrobatch never writes them.

A split file (`gguf-split`, or a converter's `--split-max-tensors` / `--split-max-size`:
`NAME-00001-of-00003.gguf` and its siblings, `split.*` metadata in each) is opened by its
first shard: the metadata is the first shard's, the tensor table every shard's, each
tensor a view of its own shard's map.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ferrobatch.errors import FieldError
from ferrobatch.gguf.formats import qtype_name

__all__ = ["GGUFFile", "TensorEntry", "is_gguf_file", "shard_paths"]

MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# metadata scalar types: struct format
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: a shard's file name: `PREFIX-NNNNN-of-MMMMM.gguf` (llama.cpp's `llama_split_path`)
SHARD_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
_SPLIT_NO, _SPLIT_COUNT, _SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"


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
    """One tensor of the table: `shape` in torch order (rows first), `offset` absolute in
    the file of shard `shard` (0: the first, or only, file)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int
    shard: int = 0

    @property
    def qtype(self) -> str:
        return qtype_name(self.ggml_type)


class GGUFFile:
    """`metadata` (string arrays as their length unless named in `string_arrays`),
    `tensors` (name -> `TensorEntry`, file order; a split file's shards in order) and
    `raw(name)` / `array(name)` views of the tensor bytes; `paths`: the file, or a split
    file's shards in order. Raises `FieldError` (field "model") for a file that is not
    GGUF, a split file named by a shard other than the first, or a shard missing or not of
    the set."""

    def __init__(self, path: str | Path, string_arrays: Container[str] = ()) -> None:
        self.path = Path(path)
        first = _Shard(self.path, string_arrays)
        self.version = first.version
        self.metadata = first.metadata
        shards = [first, *_other_shards(first)]
        self.paths = [s.path for s in shards]
        self._maps = [s.map for s in shards]
        self.tensors: dict[str, TensorEntry] = {}
        for i, shard in enumerate(shards):
            for t in shard.tensors(i):
                if t.name in self.tensors:
                    raise FieldError(f"{shard.path}: tensor {t.name} is in shard "
                                     f"{self.tensors[t.name].shard + 1} too", "model")
                self.tensors[t.name] = t
        total = self.metadata.get(_SPLIT_TENSORS)
        if len(shards) > 1 and total is not None and total != len(self.tensors):
            raise FieldError(f"{self.path}: the split file's {len(shards)} shards hold "
                             f"{len(self.tensors)} tensors, its metadata says {total}",
                             "model")

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def file_size(self) -> int:
        """Bytes of the file (a split file: of all its shards)."""
        return sum(int(m.size) for m in self._maps)

    def maps(self, address: int, nbytes: int) -> bool:
        """Whether the `nbytes` bytes at `address` lie inside one of this file's memory
        maps (a view of the file, not memory of its own)."""
        for m in self._maps:
            base = m.ctypes.data
            if base <= address and address + nbytes <= base + m.size:
                return True
        return False

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a uint8 view of the map, shaped [rows, bytes a row] (a
        vector: [bytes])."""
        t = self.tensors[name]
        flat = self._maps[t.shard][t.offset:t.offset + t.nbytes]
        if len(t.shape) <= 1:
            return flat
        rows = int(np.prod(t.shape[:-1]))
        return flat.reshape(rows, t.nbytes // rows)

    def array(self, name: str) -> np.ndarray:
        """A float tensor (F32 / F16 / BF16: BF16 as uint16 bits) as a view in its dtype,
        torch-order shape."""
        t = self.tensors[name]
        dt = {0: np.float32, 1: np.float16, 30: np.uint16}[t.ggml_type]
        return self._maps[t.shard][t.offset:t.offset + t.nbytes].view(dt).reshape(t.shape)


class _Shard:
    """One file's header (`version`, `metadata`) and tensor table over its memory map."""

    def __init__(self, path: Path, string_arrays: Container[str] = ()) -> None:
        self.path = path
        try:
            self.map = np.memmap(path, mode="c", dtype=np.uint8)
        except (OSError, ValueError) as exc:
            raise FieldError(f"{path}: cannot map the file ({exc})", "model") from exc
        blob = self.map
        if blob.size < 24 or bytes(blob[:4]) != MAGIC:
            raise FieldError(f"{path} is not a GGUF file (no GGUF magic)", "model")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", blob, 4)
        if version not in _VERSIONS:
            raise FieldError(f"{path}: GGUF version {version} is not supported "
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
            raise FieldError(f"{path}: damaged GGUF header ({exc})", "model") from exc
        self.metadata = meta
        align = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise FieldError(f"{path}: damaged GGUF header (general.alignment is "
                             f"{align!r}, not a power of two)", "model")
        self.data_start = (pos + align - 1) // align * align
        self._entries = entries

    def tensors(self, shard: int) -> list[TensorEntry]:
        """The table's entries, as shard number `shard` of its file; `FieldError` for one
        that runs past the end of the file."""
        out = []
        for name, shape, gtype, offset in self._entries:
            nbytes = _nbytes(gtype, shape)
            start = self.data_start + offset
            if nbytes is not None and start + nbytes > self.map.size:
                raise FieldError(f"{self.path}: tensor {name} runs past the end of the file "
                                 "(truncated?)", "model")
            out.append(TensorEntry(name, shape, gtype, start, nbytes or 0, shard))
        return out

    def split(self) -> tuple[int, int] | None:
        """(this shard's number, from 0; the number of shards) of a split file, or None."""
        count = self.metadata.get(_SPLIT_COUNT)
        if not isinstance(count, int) or count <= 1:
            return None
        no = self.metadata.get(_SPLIT_NO)
        if not isinstance(no, int) or not 0 <= no < count:
            raise FieldError(f"{self.path}: damaged split metadata ({_SPLIT_NO} {no!r} of "
                             f"{_SPLIT_COUNT} {count})", "model")
        return no, count

    # ------------------------------------------------------------------ parsing

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self.map, pos)
        pos += 8
        return bytes(self.map[pos:pos + n]).decode("utf-8"), pos + n

    def _value(self, pos: int, vtype: int, keep: bool) -> tuple[Any, int]:
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            (v,) = struct.unpack_from(fmt, self.map, pos)
            return v, pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._string(pos)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", self.map, pos)
            pos += 12
            if etype in _SCALARS:
                fmt = _SCALARS[etype]
                width = struct.calcsize(fmt)
                values = struct.unpack_from(f"<{count}{fmt[1]}", self.map, pos)
                return list(values), pos + count * width
            if etype == _STRING:
                if keep:
                    out = []
                    for _ in range(count):
                        s, pos = self._string(pos)
                        out.append(s)
                    return out, pos
                for _ in range(count):
                    (n,) = struct.unpack_from("<Q", self.map, pos)
                    pos += 8 + n
                return count, pos
            raise ValueError(f"metadata array of element type {etype}")
        raise ValueError(f"metadata value of type {vtype}")


def shard_paths(path: Path, count: int) -> list[Path] | None:
    """The `count` shard paths of the split file whose first shard is `path`
    (`PREFIX-00001-of-0000N.gguf`), or None where `path` is not named as a first shard of
    `count`."""
    m = SHARD_NAME.fullmatch(path.name)
    if m is None or int(m["no"]) != 1 or int(m["count"]) != count:
        return None
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf")
            for i in range(1, count + 1)]


def _other_shards(first: _Shard) -> list[_Shard]:
    """The shards after `first` of its split file (none for a file that is not split);
    `FieldError` where `first` is not the first shard, or a shard is missing or not of
    the set."""
    split = first.split()
    if split is None:
        return []
    no, count = split
    m = SHARD_NAME.fullmatch(first.path.name)
    if no != 0:
        name = f"{m['prefix']}-00001-of-{count:05d}.gguf" if m is not None else "the first"
        raise FieldError(f"{first.path} is shard {no + 1} of {count} of a split GGUF file; "
                         f"name its first shard ({name})", "model")
    paths = shard_paths(first.path, count)
    if paths is None:
        raise FieldError(f"{first.path} is the first of {count} shards of a split GGUF file, "
                         f"but not named as one (PREFIX-00001-of-{count:05d}.gguf): its "
                         "other shards can't be found", "model")
    shards = []
    for i, p in enumerate(paths[1:], start=1):
        if not p.is_file():
            raise FieldError(f"{first.path}: shard {i + 1} of {count}, {p.name}, is missing "
                             f"from {p.parent}", "model")
        shard = _Shard(p)
        said = shard.split()
        if said != (i, count):
            what = "no split metadata" if said is None else \
                f"split metadata of shard {said[0] + 1} of {said[1]}"
            raise FieldError(f"{p}: not shard {i + 1} of {count} of {first.path.name} (it "
                             f"has {what})", "model")
        shards.append(shard)
    return shards


def _nbytes(ggml_type: int, shape: tuple[int, ...]) -> int | None:
    """Bytes of a tensor of `shape` (torch order) and type, None for a type gguf-py does not
    know (refused later, by name)."""
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None
    n = int(np.prod(shape)) if shape else 1
    return n // block * size
