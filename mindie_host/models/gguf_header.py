"""A GGUF file's metadata and tensor directory, read without touching the tensor data.

``gguf.GGUFReader`` builds a Python object for every element of every metadata array, which takes
seconds for a tokenizer of 49k tokens; every start of a GGUF model asked for it several times. This
reader walks the header once (the key/value pairs, then the tensor directory), keeps the values as plain
Python objects, and is cached per file (path, size and modification time), so a start reads it once.
:func:`gguf_tensors` then maps the tensor data (``gguf.ReaderTensor`` views of one ``np.memmap``) from
that directory, as ``gguf.GGUFReader`` would, without parsing the metadata again.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
#: fixed-size GGUF value types: type id -> (struct format, numpy dtype)
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
    5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the directory: its name, GGML dims (innermost first), GGML type and data offset."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True)
class GgufHeader:
    """The metadata (``key -> value``: numbers, strings, lists) and the tensor directory of one GGUF file."""

    fields: dict[str, Any]
    tensors: tuple[TensorEntry, ...]
    data_start: int

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The tensors' names, in file order."""
        return tuple(t.name for t in self.tensors)

    def get(self, key: str, default: Any = None) -> Any:
        """The value stored under ``key``, or ``default``."""
        return self.fields.get(key, default)


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: the GGUF header ends early (truncated file?)")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind][0])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item][1])
                return np.frombuffer(self.take(dtype.itemsize * count), dtype=dtype).tolist()
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF value type {kind}")


def read_gguf_header(path: str | Path) -> GgufHeader:
    """The header of the GGUF file at ``path`` (cached while the file is unchanged)."""
    p = Path(path)
    st = p.stat()
    return _read(str(p.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read(path: str, size: int, mtime_ns: int) -> GgufHeader:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, Path(path))
        if cur.take(4) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        version = cur.unpack("<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or later)")
        n_tensors, n_fields = cur.unpack("<Q"), cur.unpack("<Q")
        fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = cur.string()
            fields[key] = cur.value(cur.unpack("<I"))
        tensors = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            dims = struct.unpack(f"<{n_dims}Q", cur.take(8 * n_dims))
            tensors.append(TensorEntry(name, tuple(int(d) for d in dims), cur.unpack("<I"), cur.unpack("<Q")))
        align = int(fields.get("general.alignment", 32))
        return GgufHeader(fields, tuple(tensors), -(-cur.pos // align) * align)


def gguf_tensors(path: str | Path) -> list[Any]:
    """The tensors of the GGUF file at ``path`` as ``gguf.ReaderTensor`` views of one read-only memmap."""
    import gguf

    header = read_gguf_header(path)
    data = np.memmap(path, mode="r")
    out = []
    for t in header.tensors:
        kind = gguf.GGMLQuantizationType(t.ggml_type)
        n_elems = int(np.prod(t.dims)) if t.dims else 1
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        n_bytes = n_elems * type_size // block
        shape: tuple[int, ...] = tuple(reversed(t.dims))
        dtype = _PLAIN_TYPES.get(kind.name)
        start = header.data_start + t.offset
        if dtype is None:  # quantized: the raw bytes, one row of blocks per row
            shape = gguf.quant_shape_to_byte_shape(shape, kind)
            array = data[start:start + n_bytes]
        else:
            array = data[start:start + n_bytes].view(dtype)
        out.append(gguf.ReaderTensor(name=t.name, tensor_type=kind, shape=np.array(t.dims, dtype=np.uint64),
                                     n_elements=n_elems, n_bytes=n_bytes, data_offset=start,
                                     data=array.reshape(shape), field=None))
    return out


#: GGML types stored as plain numpy arrays (the rest are blocks of bytes)
_PLAIN_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}
