"""The on-disk formats: safetensors (its dtypes, a header parsed and strictly validated: every tensor's absolute
byte range, the data section covered exactly; raw values as float64 without torch; block geometry: whole rows of
about ``block_bytes``) and the delta store's encodings (entry chunks: LEB128 position gaps, then the expert's
exact element bytes; sketch stages: fp32 row scales, then five trits a byte; a file is ``MAGIC``, then per
tensor its chunks and its stages).
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
    """The validated header through ``read(begin, end)``."""
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


# The delta store's encodings.
MAGIC = b"MPDELTA1"
_SEVEN = np.uint64(7)
_LOW7 = np.uint64(0x7F)


def encode_varints(values: np.ndarray) -> bytes:
    """LEB128 bytes of non-negative integers, vectorised."""
    values = np.asarray(values)
    if values.size > 1:
        return _same_width(values[:1]) + _same_width(values[1:])
    return _same_width(values)


def _same_width(values: np.ndarray) -> bytes:
    """LEB128 as one row of the widest value's width per value."""
    if values.size == 0:
        return b""
    top = int(values.max())
    if top < 1 << 7:
        return values.astype(np.uint8).tobytes()
    if top < 1 << 14:  # two bytes at most, nearly all one: each value's low byte, the few second ones inserted
        more = values >= 1 << 7
        low = (values & 0x7F).astype(np.uint8)
        low |= more.view(np.uint8) << 7
        longer = np.flatnonzero(more)
        return np.insert(low, longer + 1, (values[longer] >> 7).astype(np.uint8)).tobytes()
    values = values.astype(np.uint64, copy=False)
    width = -(-top.bit_length() // 7)
    groups = np.empty((values.size, width), dtype=np.uint8)
    used = np.empty((values.size, width), dtype=bool)  # byte k of a value is written when a group >= k is non-zero
    used[:, 0] = True
    rest = values
    for k in range(width):
        low = (rest & _LOW7).astype(np.uint8)
        if k + 1 < width:
            rest = rest >> _SEVEN
            more = rest != 0
            used[:, k + 1] = more
            low |= more.view(np.uint8) << np.uint8(7)
        groups[:, k] = low
    return groups[used].tobytes()


def decode_varints(data: bytes | memoryview, count: int) -> np.ndarray:
    """The first ``count`` integers of LEB128 ``data`` (vectorised, int64); ValueError if short."""
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    raw = np.frombuffer(data, dtype=np.uint8)
    head = raw[:count]
    if head.size == count and not (head & 0x80).any():  # the first ``count`` bytes end a varint each
        return head.astype(np.int64)
    ends = np.flatnonzero(raw < 0x80)
    if ends.size < count:
        raise ValueError(f"{ends.size} varints where {count} were expected")
    ends = ends[:count]
    starts = np.empty(count, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    values = (raw[starts] & 0x7F).astype(np.int64)
    for k in range(1, int(lengths.max())):
        longer = np.flatnonzero(lengths > k)
        values[longer] |= (raw[starts[longer] + k] & 0x7F).astype(np.int64) << (7 * k)
    return values


def encode_chunk(positions: np.ndarray, element_bytes: np.ndarray) -> tuple[bytes, int]:
    """One chunk: ``(payload, varint bytes)`` of sorted flat ``positions`` and their elements' raw bytes."""
    gaps = np.diff(positions, prepend=0) if positions.size else positions
    head = encode_varints(gaps)
    return head + np.ascontiguousarray(element_bytes).tobytes(), len(head)


def decode_chunk(
    payload: bytes | memoryview, entries: int, gap_bytes: int, itemsize: int
) -> tuple[np.ndarray, memoryview]:
    """``(flat positions, raw element bytes)`` of one chunk; the bytes view ``payload``."""
    view = memoryview(payload)
    positions = decode_varints(view[:gap_bytes], entries)
    np.cumsum(positions, out=positions)
    values = view[gap_bytes : gap_bytes + entries * itemsize]
    if len(values) != entries * itemsize:
        raise ValueError(f"chunk holds {len(values)} value bytes, {entries * itemsize} expected")
    return positions, values


#: ``_TRITS[b]``: the five ``q`` values (-1, 0, 1) packed in byte ``b`` (first trit lowest).
_TRITS = (np.arange(256)[:, None] // 3 ** np.arange(5)[None, :] % 3 - 1).astype(np.int8)
#: The same table as one item of five int8 or fp32 values per byte: decoding is one gather into either dtype.
_TRIT_ITEMS = {
    np.dtype(np.int8): np.ascontiguousarray(_TRITS).view("V5").reshape(256),
    np.dtype(np.float32): np.ascontiguousarray(_TRITS, dtype=np.float32).view("V20").reshape(256),
}


def encode_stage(q: np.ndarray, scales: np.ndarray) -> bytes:
    """One sketch stage: ``rows`` fp32 scales, then ``q`` (-1/0/1, row-major) five trits per byte."""
    trits = np.asarray(q, dtype=np.int8).reshape(-1).view(np.uint8)
    if trits.size % 5:
        trits = np.concatenate([trits, np.zeros(-trits.size % 5, dtype=np.uint8)])  # padding trits encode q = 0
    t = trits.reshape(-1, 5)
    # Horner's rule in uint8 over the five columns, each trit + 1 (-1 is 255 and wraps to 0; a byte is <= 242)
    one, three = np.uint8(1), np.uint8(3)
    packed = t[:, 4] + one
    for k in (3, 2, 1, 0):
        packed = packed * three + t[:, k] + one
    return np.ascontiguousarray(scales, dtype="<f4").tobytes() + packed.tobytes()


def decode_stage_span(
    payload: bytes | memoryview, rows: int, numel: int, start: int, end: int, out: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(q [start:end], fp32 scales [rows])`` of one stage."""
    view = memoryview(payload)
    if len(view) != 4 * rows + -(-numel // 5):
        raise ValueError(f"stage holds {len(view)} bytes, {4 * rows + -(-numel // 5)} expected")
    if not 0 <= start <= end <= numel:
        raise ValueError(f"elements {start}:{end} are not in a stage of {numel}")
    if out.dtype not in _TRIT_ITEMS or len(out) < span_trits(start, end):
        raise ValueError(f"a span {start}:{end} of a stage decodes into {span_trits(start, end)} int8 or fp32 values")
    scales = np.frombuffer(view[: 4 * rows], dtype="<f4")
    first, last = start // 5, -(-end // 5)
    packed = np.frombuffer(view[4 * rows + first : 4 * rows + last], dtype=np.uint8)
    trits = out[: 5 * (last - first)]
    table = _TRIT_ITEMS[trits.dtype]
    np.take(table, packed, out=trits.view(table.dtype), mode="clip")  # every byte indexes the table
    return trits[start - 5 * first : end - 5 * first], scales


def span_trits(start: int, end: int) -> int:
    """The trits decoded for elements ``start:end`` of a stage: those of the whole bytes that pack them."""
    return 5 * (-(-end // 5) - start // 5)
