"""The delta store's encoding: an expert's delta entries, largest first, in chunks.

A delta store holds, for each tensor of an expert that differs from the
base, its non-zero delta entries in descending ``|Δ|`` order (ties by
position, as a stable sort orders them), cut into chunks. Reading the first
chunks of a tensor gives exactly its largest entries: the budget can buy
entries rather than whole blocks. A chunk stores, for its entries sorted by
position,

* the positions as LEB128 varints of their gaps (the first one absolute):
  inside one magnitude band positions are spread over the tensor, so a gap
  usually takes one or two bytes where an index takes four;
* then the *expert's* raw element bytes at those positions (exact: the
  engine recomputes ``Δ = E - B`` in fp32 from the base it reads anyway, so
  a complete store gives bit for bit the delta of a full read).

A store also holds, per tensor, *sketch stages*: coarse, dense
approximations of the delta that cost 1.6 bits per element each. Stage s
approximates what the stages before it left over (the residual ``R``) by
``q * scale``: per row, ``q = sign(R)`` where ``|R|`` exceeds half the mean
of the row's non-zero ``|R|`` (else 0), and ``scale`` the mean ``|R|`` of
those entries. Its payload is the rows' fp32 scales, then ``q + 1`` packed
five trits to a byte (``3**5 = 243 <= 256``; 1.6 bits, within 1% of
log2(3)). Stages are written after the tensor's chunks, in order, so a
prefix of stages is one read.

The file is ``MAGIC`` followed by, per tensor, its chunk payloads and then
its stage payloads; the catalog records each part's byte range, content
hash and what it is worth (chunks: entry count, varint bytes, energy
``Σ Δ²``; stages: the residual energy left after it).
"""

from __future__ import annotations

import numpy as np

MAGIC = b"MPDELTA1"
_SEVEN = np.uint64(7)
_LOW7 = np.uint64(0x7F)


def encode_varints(values: np.ndarray) -> bytes:
    """LEB128 bytes of non-negative integers (vectorised)."""
    values = np.asarray(values, dtype=np.uint64)
    if values.size == 0:
        return b""
    lengths = np.ones(values.size, dtype=np.int64)
    rest = values >> _SEVEN
    while rest.any():
        lengths += rest > 0
        rest >>= _SEVEN
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    for k in range(int(lengths.max())):
        live = lengths > k
        byte = (values[live] >> (_SEVEN * np.uint64(k))) & _LOW7
        more = (lengths[live] > k + 1).astype(np.uint64) << np.uint64(7)
        out[starts[live] + k] = (byte | more).astype(np.uint8)
    return out.tobytes()


def decode_varints(data: bytes | memoryview, count: int) -> np.ndarray:
    """The first ``count`` integers of LEB128 ``data`` (vectorised); ValueError if short."""
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    raw = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero((raw & 0x80) == 0)
    if ends.size < count:
        raise ValueError(f"{ends.size} varints where {count} were expected")
    raw = raw[: ends[count - 1] + 1]
    starts = np.concatenate(([0], ends[: count - 1] + 1))
    group_start = np.repeat(starts, np.diff(np.append(starts, raw.size)))
    shift = (np.arange(raw.size) - group_start).astype(np.uint64) * _SEVEN
    parts = (raw & 0x7F).astype(np.uint64) << shift
    return np.add.reduceat(parts, starts).astype(np.int64)  # each varint's bytes are one contiguous run


def encode_chunk(positions: np.ndarray, element_bytes: np.ndarray) -> tuple[bytes, int]:
    """One chunk: ``(payload, varint bytes)``. ``positions`` sorted ascending
    (flat indices); ``element_bytes`` the raw bytes of those elements, one row each."""
    gaps = np.diff(positions, prepend=0) if positions.size else positions
    head = encode_varints(gaps)
    return head + np.ascontiguousarray(element_bytes).tobytes(), len(head)


def decode_chunk(payload: bytes | memoryview, entries: int, gap_bytes: int, itemsize: int) -> tuple[np.ndarray, bytes]:
    """``(flat positions, raw element bytes)`` of one chunk."""
    view = memoryview(payload)
    positions = np.cumsum(decode_varints(view[:gap_bytes], entries))
    values = bytes(view[gap_bytes : gap_bytes + entries * itemsize])
    if len(values) != entries * itemsize:
        raise ValueError(f"chunk holds {len(values)} value bytes, {entries * itemsize} expected")
    return positions, values


#: ``_TRITS[b]``: the five ``q`` values (-1, 0, 1) packed in byte ``b`` (first trit lowest).
_TRITS = (np.arange(256)[:, None] // 3 ** np.arange(5)[None, :] % 3 - 1).astype(np.int8)
_POWERS = (3 ** np.arange(5)).astype(np.uint8)


def encode_stage(q: np.ndarray, scales: np.ndarray) -> bytes:
    """One sketch stage: ``rows`` fp32 scales, then ``q`` (-1/0/1, row-major) five trits per byte."""
    trits = np.asarray(q, dtype=np.int8).reshape(-1).view(np.uint8) + np.uint8(1)  # -1 wraps to 255, +1 to 0
    if trits.size % 5:
        trits = np.concatenate([trits, np.ones(-trits.size % 5, dtype=np.uint8)])  # padding trits encode q = 0
    t = trits.reshape(-1, 5)
    # five columns weighted in uint8 (at most 2 * (1 + 3 + 9 + 27 + 81) = 242): several times faster than a
    # reduction over an axis of 5
    packed = t[:, 0] + t[:, 1] * _POWERS[1] + t[:, 2] * _POWERS[2] + t[:, 3] * _POWERS[3] + t[:, 4] * _POWERS[4]
    return np.ascontiguousarray(scales, dtype="<f4").tobytes() + packed.tobytes()


def stage_bytes(rows: int, numel: int) -> int:
    """The size of a stage's payload."""
    return 4 * rows + -(-numel // 5)


def decode_stage(payload: bytes | memoryview, rows: int, numel: int) -> tuple[np.ndarray, np.ndarray]:
    """``(q as int8 [numel], fp32 scales [rows])`` of one stage."""
    view = memoryview(payload)
    if len(view) != stage_bytes(rows, numel):
        raise ValueError(f"stage holds {len(view)} bytes, {stage_bytes(rows, numel)} expected")
    scales = np.frombuffer(view[: 4 * rows], dtype="<f4")
    packed = np.frombuffer(view[4 * rows :], dtype=np.uint8)
    return _TRITS[packed].reshape(-1)[:numel], scales
