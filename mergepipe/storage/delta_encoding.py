"""The delta store's encodings: an entry chunk holds its entries' positions (sorted) as LEB128 gaps, then the
expert's exact element bytes there; a sketch stage holds the rows' fp32 scales, then ``q`` in -1/0/1 packed five
trits a byte (1.6 bits per element). A store file is ``MAGIC``, then per tensor its chunks and its stages.
"""

from __future__ import annotations

import numpy as np

MAGIC = b"MPDELTA1"
_SEVEN = np.uint64(7)
_LOW7 = np.uint64(0x7F)


def encode_varints(values: np.ndarray) -> bytes:
    """LEB128 bytes of non-negative integers, vectorised; the first (a chunk's absolute position) apart from the
    gaps, which nearly always take one byte each: then a single cast."""
    values = np.asarray(values)
    if values.size > 1:
        return _same_width(values[:1]) + _same_width(values[1:])
    return _same_width(values)


def _same_width(values: np.ndarray) -> bytes:
    """LEB128 as one row of the widest value's width per value, continuation bits set where a higher group is
    non-zero; the rows' used bytes, read row by row, are the stream."""
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
    """``(q [start:end], fp32 scales [rows])`` of one stage, decoding only the bytes that pack those trits into
    ``out`` (int8 or fp32, at least ``span_trits(start, end)`` entries), which ``q`` views."""
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
