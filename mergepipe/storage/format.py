"""The safetensors format: its dtypes, a header parsed and strictly validated (every tensor's absolute byte
range; the data section covered exactly, in order; a damaged file refused naming file, tensor and reason), raw
values as float64 without torch, and block geometry: whole rows of about ``block_bytes``, one contiguous range.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mergepipe.errors import CheckpointError, CorruptCheckpointError
from mergepipe.storage.location import Location

#: Dtypes the operators merge; every other dtype is passed through unchanged.
MERGEABLE_DTYPES = frozenset({"F32", "F16", "BF16"})
#: Each safetensors dtype whose elements are whole bytes: (bytes per element, torch's name). Sub-byte dtypes
#: (F4, F6_*) are absent: their length is not numel * itemsize, so they are refused rather than mis-measured.
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "F8_E4M3FNUZ": (1, "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": (1, "float8_e5m2fnuz"),
    "F8_E8M0": (1, "float8_e8m0fnu"),
    "I16": (2, "int16"),
    "U16": (2, "uint16"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "I32": (4, "int32"),
    "U32": (4, "uint32"),
    "F32": (4, "float32"),
    "I64": (8, "int64"),
    "U64": (8, "uint64"),
    "F64": (8, "float64"),
    "C64": (8, "complex64"),
}
DTYPE_SIZES = {name: size for name, (size, _) in DTYPES.items()}
HEADER_PREFIX_BYTES = 8  # the header's length: one little-endian u64
MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit; a real header is a few MB
HEADER_ALIGNMENT = 8  # the data section starts 8-aligned
METADATA_KEY = "__metadata__"
_FIX = "re-download or re-export it"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        """Rows for block purposes: ``shape[0]``, but a 0-d or 1-D tensor is one row."""
        return self.shape[0] if len(self.shape) >= 2 else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) >= 2 else self.numel

    @property
    def row_bytes(self) -> int:
        return self.row_numel * self.itemsize


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header: ``tensors`` in file order; ``header_sha256`` of the raw header bytes, padding included."""

    path: Location
    header_len: int
    data_start: int
    file_size: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] | None
    header_sha256: str

    @property
    def data_bytes(self) -> int:
        return self.file_size - self.data_start


def _corrupt(path: Location, reason: str, tensor: str | None = None) -> CorruptCheckpointError:
    where = f"{path}: tensor {tensor!r}: " if tensor is not None else f"{path}: "
    return CorruptCheckpointError(f"corrupt safetensors file {where}{reason}; {_FIX}")


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """The validated header of the local safetensors file at ``path``."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointError(
            f"no such safetensors file: {path} (check the path or re-download the checkpoint)"
        ) from None
    except OSError as exc:
        raise CheckpointError(
            f"cannot open safetensors file {path}: {exc.strerror} (check the path and its permissions)"
        ) from None
    try:
        if hasattr(os, "posix_fadvise"):  # no readahead: an expert's first tensor bytes belong to the budget
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        file_size = os.fstat(fd).st_size

        def read(begin: int, end: int) -> bytes:  # shorter only at the end of the file
            chunks, done = [], 0
            while done < end - begin and (chunk := os.pread(fd, end - begin - done, begin + done)):
                chunks.append(chunk)
                done += len(chunk)
            return b"".join(chunks)

        return header_from(path, file_size, read)
    finally:
        os.close(fd)


def header_from(
    path: Location, file_size: int, read: Callable[[int, int], bytes], first_read_bytes: int = HEADER_PREFIX_BYTES
) -> SafetensorsHeader:
    """The validated header through ``read(begin, end)``; the first read covers ``[0, first_read_bytes)``: the
    length alone (local), or a probe that usually holds the whole header too (remote: one request)."""
    first = read(0, min(max(first_read_bytes, HEADER_PREFIX_BYTES), file_size))
    if len(first) < HEADER_PREFIX_BYTES:
        raise _corrupt(path, f"file is {file_size} bytes, shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", first[:HEADER_PREFIX_BYTES])
    if header_len == 0:
        raise _corrupt(path, "header length is 0")
    if header_len > MAX_HEADER_BYTES:
        raise _corrupt(path, f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
    data_start = HEADER_PREFIX_BYTES + header_len
    if data_start > file_size:
        raise _corrupt(path, f"header length {header_len} runs past the end of the file ({file_size} bytes)")
    raw = bytes(first[HEADER_PREFIX_BYTES:data_start])
    if len(first) < data_start:
        raw += read(len(first), data_start)
    if len(raw) < header_len:
        raise _corrupt(path, "file shrank while its header was being read")
    return _parsed(path, raw, file_size)


def _parsed(path: Location, raw: bytes, file_size: int) -> SafetensorsHeader:
    header_len, data_start = len(raw), HEADER_PREFIX_BYTES + len(raw)
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=lambda pairs: _unique(path, pairs))
    except UnicodeDecodeError as exc:
        raise _corrupt(path, f"header is not valid UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise _corrupt(path, f"header is not valid JSON ({exc.msg} at char {exc.pos})") from None
    except RecursionError:
        raise _corrupt(path, "header nests JSON arrays or objects too deeply to be a safetensors header") from None
    if not isinstance(doc, dict):
        raise _corrupt(path, f"header is a JSON {type(doc).__name__}, not an object")
    metadata = doc.pop(METADATA_KEY, None)
    if metadata is not None and not isinstance(metadata, dict):
        raise _corrupt(path, f"{METADATA_KEY} is a JSON {type(metadata).__name__}, not an object")
    for key, item in (metadata or {}).items():
        if not isinstance(item, str):
            raise _corrupt(path, f"{METADATA_KEY} value of {key!r} is not a string")
    entries = sorted((_entry(path, name, info, data_start) for name, info in doc.items()), key=_file_order)
    expected = data_start
    for entry in entries:
        if entry.begin != expected:
            what = "data_offsets overlap the previous tensor" if entry.begin < expected else "gap in the data section"
            what += "" if entry.begin < expected else " before this tensor"
            where = f"starts at {entry.begin - data_start}, previous ends at {expected - data_start}"
            raise _corrupt(path, f"{what} ({where})", entry.name)
        expected = entry.end
    if file_size != expected:
        raise _corrupt(
            path, f"data section is {file_size - data_start} bytes but the tensors cover {expected - data_start}"
        )
    return SafetensorsHeader(
        path=path,
        header_len=header_len,
        data_start=data_start,
        file_size=file_size,
        tensors={e.name: e for e in entries},
        metadata=metadata,
        header_sha256=hashlib.sha256(raw).hexdigest(),
    )


def _file_order(entry: TensorEntry) -> tuple[int, int, str]:
    return entry.begin, entry.end, entry.name


def _unique(path: Location, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _corrupt(path, f"header has the key {key!r} twice")
        out[key] = value
    return out


def _entry(path: Location, name: str, info: Any, data_start: int) -> TensorEntry:
    def is_size(value: Any) -> bool:  # JSON true/false are no sizes
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():  # others ignored
        raise _corrupt(path, "entry is not an object with dtype, shape and data_offsets", name)
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise _corrupt(path, f"unknown dtype {dtype!r}", name)
    if not isinstance(shape, list) or not all(map(is_size, shape)):
        raise _corrupt(path, f"shape {shape!r} is not a list of non-negative integers", name)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(is_size, offsets)) or offsets[0] > offsets[1]:
        raise _corrupt(path, f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end", name)
    begin, end = offsets
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise _corrupt(path, f"data_offsets span {end - begin} bytes but {dtype} shape {shape} needs {expected}", name)
    return TensorEntry(name=name, dtype=dtype, shape=tuple(shape), begin=data_start + begin, end=data_start + end)


def float64_values(data: bytes | memoryview, dtype: str) -> np.ndarray:
    """Raw little-endian values of a mergeable dtype as float64, without torch (BF16: the top half of an F32)."""
    if dtype == "BF16":
        return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype in ("F32", "F16"):
        return np.frombuffer(data, dtype="<f4" if dtype == "F32" else "<f2").astype(np.float64)
    raise ValueError(f"float64_values: {dtype} is not a mergeable dtype ({sorted(MERGEABLE_DTYPES)})")


@dataclass(frozen=True)
class BlockSpec:
    """Block ``index`` of a tensor: rows ``[row_start, row_end)``, absolute bytes ``[begin, end)``."""

    index: int
    row_start: int
    row_end: int
    begin: int
    end: int
    row_numel: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def flat_start(self) -> int:
        """The block's first element in the flattened tensor."""
        return self.row_start * self.row_numel

    @property
    def flat_end(self) -> int:
        return self.row_end * self.row_numel

    @property
    def numel(self) -> int:
        return self.flat_end - self.flat_start

    def shape(self, entry: TensorEntry) -> tuple[int, ...]:
        return entry.shape if len(entry.shape) < 2 else (self.num_rows, *entry.shape[1:])


def rows_per_block(entry: TensorEntry, block_bytes: int) -> int:
    """``max(1, block_bytes // row_bytes)``; all rows when the tensor fits in one block (a zero-byte one too)."""
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
        raise ValueError(f"block_bytes must be a positive integer, got {block_bytes!r}")
    if entry.nbytes <= block_bytes:
        return max(1, entry.rows)
    return max(1, block_bytes // entry.row_bytes)


def num_blocks(entry: TensorEntry, block_bytes: int) -> int:
    return max(1, -(-entry.rows // rows_per_block(entry, block_bytes)))


def tensor_blocks(entry: TensorEntry, block_bytes: int) -> list[BlockSpec]:
    """The blocks of ``entry`` in order, covering its bytes exactly (a zero-byte tensor: one empty block)."""
    return [block_at(entry, block_bytes, index) for index in range(num_blocks(entry, block_bytes))]


def block_at(entry: TensorEntry, block_bytes: int, index: int) -> BlockSpec:
    """Block ``index`` of ``entry``: rows ``[index*r, min((index+1)*r, rows))``, r = ``rows_per_block``."""
    count, per_block = num_blocks(entry, block_bytes), rows_per_block(entry, block_bytes)
    if not 0 <= index < count:
        raise IndexError(f"tensor {entry.name!r} has {count} blocks, no block {index}")
    row_start, row_end = index * per_block, min((index + 1) * per_block, entry.rows)
    begin, row = entry.begin, entry.row_bytes
    return BlockSpec(index, row_start, row_end, begin + row_start * row, begin + row_end * row, entry.row_numel)
