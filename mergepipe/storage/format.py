"""The safetensors file format: dtype table, header parsing, strict validation.

A safetensors file is an 8-byte little-endian unsigned length ``N``, then
``N`` bytes of UTF-8 JSON (the header), then the data section. The header maps
each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` with
offsets relative to the start of the data section, plus an optional
``"__metadata__"`` string-to-string map.

We parse the header ourselves rather than through the safetensors library
because everything above us (blocks, byte-range reads, budgets) needs the
absolute byte range of every tensor, and because a damaged file must be
rejected here, with a message naming the file and tensor, before any plan
trusts its offsets. Validation is deliberately strict: the data section must be
exactly covered by the tensors, in order, with no holes and no overlaps.
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

# Bytes per element of every safetensors dtype whose elements are whole bytes.
# Sub-byte dtypes (F4, F6_E2M3, F6_E3M2) are deliberately absent: their byte
# length is not numel * itemsize, so they are rejected as unknown rather than
# mis-measured.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}

# Length prefix of the header: one little-endian u64.
HEADER_PREFIX_BYTES = 8
# The reference implementation refuses headers above 100 MB; a real header
# (tens of thousands of tensors) is a few MB, so anything bigger is damage.
MAX_HEADER_BYTES = 100_000_000
# The format recommends padding the header so the data section starts 8-aligned.
HEADER_ALIGNMENT = 8
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
        """Elements per row (the whole tensor for 0-d and 1-D tensors)."""
        return math.prod(self.shape[1:]) if len(self.shape) >= 2 else self.numel

    @property
    def row_bytes(self) -> int:
        """Bytes per row; equals ``nbytes // rows`` whenever ``rows > 0``."""
        return self.row_numel * self.itemsize


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed and validated safetensors header.

    ``tensors`` is ordered by ``begin`` offset (file order). ``header_sha256``
    hashes the raw header bytes exactly as stored, padding included.
    """

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


def _is_int(value: Any) -> bool:
    # bool is a subclass of int in Python; JSON true/false are not sizes.
    return isinstance(value, int) and not isinstance(value, bool)


def _reject_duplicate_keys(path: Location):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise _corrupt(path, f"header has the key {key!r} twice")
            out[key] = value
        return out

    return hook


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and strictly validate the header of the local safetensors file at ``path``.

    Raises ``CheckpointError`` if the file cannot be opened and
    ``CorruptCheckpointError`` for any violation of the format. (A remote
    file's header is read by ``storage/checkpoint.py`` through ``header_from``.)
    """
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
        # No readahead: a header read must not pull the first tensors' bytes
        # from disk (for an expert, those bytes belong to the budget).
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        file_size = os.fstat(fd).st_size
        return header_from(path, file_size, lambda begin, end: _pread_exact(fd, begin, end - begin))
    finally:
        os.close(fd)


def header_from(
    path: Location, file_size: int, read: Callable[[int, int], bytes], first_read_bytes: int = HEADER_PREFIX_BYTES
) -> SafetensorsHeader:
    """Read and validate a header through ``read(begin, end)`` (bytes of the file; shorter only at its end).

    The first read covers ``[0, first_read_bytes)``: just the length prefix for a local file (two exact
    reads, no data byte touched), or for a remote one a probe that usually holds the whole header, so it
    costs one request, and a second only for a header longer than the probe.
    """
    first = read(0, min(max(first_read_bytes, HEADER_PREFIX_BYTES), file_size))
    if len(first) < HEADER_PREFIX_BYTES:
        raise _corrupt(path, f"file is {file_size} bytes, shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", first[:HEADER_PREFIX_BYTES])
    if header_len == 0:
        raise _corrupt(path, "header length is 0")
    if header_len > MAX_HEADER_BYTES:
        raise _corrupt(path, f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
    end = HEADER_PREFIX_BYTES + header_len
    if end > file_size:
        raise _corrupt(path, f"header length {header_len} runs past the end of the file ({file_size} bytes)")
    raw = first[HEADER_PREFIX_BYTES:end]
    if len(first) < end:
        raw += read(len(first), end)
    if len(raw) < header_len:
        raise _corrupt(path, "file shrank while its header was being read")
    return parse_header(path, bytes(raw), file_size)


def _pread_exact(fd: int, offset: int, length: int) -> bytes:
    """Read up to ``length`` bytes at ``offset``, looping on short reads; shorter only at EOF."""
    chunks: list[bytes] = []
    done = 0
    while done < length:
        chunk = os.pread(fd, length - done, offset + done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def parse_header(path: Location, raw: bytes, file_size: int) -> SafetensorsHeader:
    """Validate the raw header bytes of a file of ``file_size`` bytes (see ``read_header``)."""
    header_len = len(raw)
    data_start = HEADER_PREFIX_BYTES + header_len
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _corrupt(path, f"header is not valid UTF-8 (byte {exc.start})") from None
    try:
        doc = json.loads(text, object_pairs_hook=_reject_duplicate_keys(path))
    except json.JSONDecodeError as exc:
        raise _corrupt(path, f"header is not valid JSON ({exc.msg} at char {exc.pos})") from None
    except RecursionError:
        raise _corrupt(path, "header nests JSON arrays or objects too deeply to be a safetensors header") from None
    if not isinstance(doc, dict):
        raise _corrupt(path, f"header is a JSON {type(doc).__name__}, not an object")

    metadata = _parse_metadata(path, doc.pop(METADATA_KEY, None))
    entries = [_parse_entry(path, name, info, data_start) for name, info in doc.items()]
    entries.sort(key=lambda e: (e.begin, e.end, e.name))

    expected = data_start
    for entry in entries:
        if entry.begin < expected:
            raise _corrupt(
                path,
                f"data_offsets overlap the previous tensor (starts at {entry.begin - data_start}, "
                f"previous ends at {expected - data_start})",
                tensor=entry.name,
            )
        if entry.begin > expected:
            raise _corrupt(
                path,
                f"gap in the data section before this tensor (starts at {entry.begin - data_start}, "
                f"previous ends at {expected - data_start})",
                tensor=entry.name,
            )
        expected = entry.end
    data_len = file_size - data_start
    if data_len != expected - data_start:
        raise _corrupt(
            path,
            f"data section is {data_len} bytes but the tensors cover {expected - data_start}",
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


def _parse_metadata(path: Location, value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _corrupt(path, f"{METADATA_KEY} is a JSON {type(value).__name__}, not an object")
    for key, item in value.items():
        if not isinstance(item, str):
            raise _corrupt(path, f"{METADATA_KEY} value of {key!r} is not a string")
    return dict(value)


def _parse_entry(path: Location, name: str, info: Any, data_start: int) -> TensorEntry:
    # Keys beyond these three are ignored, as the reference loader does.
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise _corrupt(path, "entry is not an object with dtype, shape and data_offsets", name)
    dtype = info["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise _corrupt(path, f"unknown dtype {dtype!r}", name)
    shape = info["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _corrupt(path, f"shape {shape!r} is not a list of non-negative integers", name)
    offsets = info["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise _corrupt(path, f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end", name)
    begin, end = offsets
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise _corrupt(
            path,
            f"data_offsets span {end - begin} bytes but {dtype} shape {shape} needs {expected}",
            name,
        )
    return TensorEntry(name=name, dtype=dtype, shape=tuple(shape), begin=data_start + begin, end=data_start + end)


def float64_values(data: bytes | memoryview, dtype: str) -> np.ndarray:
    """The values of raw little-endian ``data`` of a mergeable dtype (F32, F16, BF16) as float64, without
    torch (the paths that run before a merge imports it, e.g. ``recover``): BF16 is the top half of an F32."""
    if dtype == "BF16":
        return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype in ("F32", "F16"):
        return np.frombuffer(data, dtype="<f4" if dtype == "F32" else "<f2").astype(np.float64)
    raise ValueError(f"float64_values: {dtype} is not a mergeable dtype ({sorted(MERGEABLE_DTYPES)})")


@dataclass(frozen=True)
class BlockSpec:
    """Block ``index`` of a tensor: rows ``[row_start, row_end)``, bytes ``[begin, end)``.

    ``begin``/``end`` are absolute file offsets; ``row_numel`` is the number
    of elements in one row, which places the block in the flattened tensor.
    """

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
        """Element offset of the block's first element in the row-major tensor."""
        return self.row_start * self.row_numel

    @property
    def flat_end(self) -> int:
        return self.row_end * self.row_numel

    @property
    def numel(self) -> int:
        return self.flat_end - self.flat_start

    def tensor_offset(self, entry: TensorEntry) -> int:
        """Byte offset of the block inside its tensor's data (for writers)."""
        return self.begin - entry.begin

    def shape(self, entry: TensorEntry) -> tuple[int, ...]:
        """Shape of the block's data: the tensor's shape with ``num_rows`` rows."""
        if len(entry.shape) < 2:
            return entry.shape
        return (self.num_rows, *entry.shape[1:])


def _check_block_bytes(block_bytes: int) -> None:
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
        raise ValueError(f"block_bytes must be a positive integer, got {block_bytes!r}")


def rows_per_block(entry: TensorEntry, block_bytes: int) -> int:
    """Rows in each block of ``entry``: ``max(1, block_bytes // row_bytes)``.

    A tensor that fits in one block (including every zero-byte tensor) gets
    all its rows in one block.
    """
    _check_block_bytes(block_bytes)
    if entry.nbytes <= block_bytes:
        return max(1, entry.rows)
    return max(1, block_bytes // entry.row_bytes)


def num_blocks(entry: TensorEntry, block_bytes: int) -> int:
    """How many blocks ``tensor_blocks`` returns, without building them."""
    per_block = rows_per_block(entry, block_bytes)
    return max(1, -(-entry.rows // per_block))


def tensor_blocks(entry: TensorEntry, block_bytes: int) -> list[BlockSpec]:
    """The blocks of ``entry`` in order; they cover its bytes exactly, without overlap.

    Block ``i`` covers rows ``[i*r, min((i+1)*r, rows))`` with
    ``r = rows_per_block(entry, block_bytes)``. A zero-byte tensor has one
    empty block.
    """
    per_block = rows_per_block(entry, block_bytes)
    count = max(1, -(-entry.rows // per_block))
    return [_block(entry, per_block, index) for index in range(count)]


def block_at(entry: TensorEntry, block_bytes: int, index: int) -> BlockSpec:
    """Block ``index`` of ``entry`` without building the others."""
    count = num_blocks(entry, block_bytes)
    if not 0 <= index < count:
        raise IndexError(f"tensor {entry.name!r} has {count} blocks, no block {index}")
    return _block(entry, rows_per_block(entry, block_bytes), index)


def _block(entry: TensorEntry, per_block: int, index: int) -> BlockSpec:
    row_start = index * per_block
    row_end = min(row_start + per_block, entry.rows)
    return BlockSpec(
        index=index,
        row_start=row_start,
        row_end=row_end,
        begin=entry.begin + row_start * entry.row_bytes,
        end=entry.begin + row_end * entry.row_bytes,
        row_numel=entry.row_numel,
    )
