"""The delta store's encodings: chunks (LEB128 gaps, then raw element bytes) and sketch stages (fp32
scales, then five trits a byte)."""

from __future__ import annotations

import numpy as np
import pytest

from mergepipe.storage.format import (
    decode_chunk,
    decode_stage_span,
    decode_varints,
    encode_chunk,
    encode_stage,
    encode_varints,
    span_trits,
)


@pytest.mark.parametrize(
    ("value", "encoded"),
    [(0, b"\x00"), (1, b"\x01"), (127, b"\x7f"), (128, b"\x80\x01"), (300, b"\xac\x02"),
     (16383, b"\xff\x7f"), (16384, b"\x80\x80\x01"), (2**32, b"\x80\x80\x80\x80\x10")],
)
def test_varints_are_leb128(value, encoded):
    assert encode_varints(np.array([value])) == encoded
    assert decode_varints(encoded, 1).tolist() == [value]


def test_varints_round_trip_many_sizes():
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.integers(0, 2**bits, size=500) for bits in (1, 7, 8, 14, 15, 21, 35, 62)])
    rng.shuffle(values)
    data = encode_varints(values)
    assert decode_varints(data, len(values)).tolist() == values.tolist()
    assert decode_varints(data, 10).tolist() == values[:10].tolist()  # a prefix decodes on its own


def test_short_varint_data_is_an_error():
    with pytest.raises(ValueError, match="varints"):
        decode_varints(encode_varints(np.array([5, 6, 7])), 4)


def test_chunk_round_trip():
    rng = np.random.default_rng(4)
    positions = np.sort(rng.choice(5_000_000, size=3000, replace=False))
    elements = rng.integers(0, 256, size=(3000, 2), dtype=np.uint8)
    payload, gap_bytes = encode_chunk(positions, elements)
    assert payload[gap_bytes:] == elements.tobytes()
    decoded, raw = decode_chunk(payload, 3000, gap_bytes, 2)
    assert decoded.tolist() == positions.tolist()
    assert raw == elements.tobytes()


def test_truncated_chunk_values_are_an_error():
    payload, gap_bytes = encode_chunk(np.array([3, 9]), np.zeros((2, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match="value bytes"):
        decode_chunk(payload[:-1], 2, gap_bytes, 4)


@pytest.mark.parametrize("count", [0, 1, 4, 5, 6, 12, 4 * 1024 + 3])
def test_a_stage_packs_five_trits_a_byte_first_lowest(count):
    rng = np.random.default_rng(count)
    q = rng.integers(-1, 2, size=count).astype(np.int8)
    scales = rng.random(3).astype(np.float32)
    payload = encode_stage(q, scales)
    trits = [int(v) + 1 for v in q] + [1] * (-count % 5)  # padded with q = 0
    packed = bytes(sum(trits[i + k] * 3**k for k in range(5)) for i in range(0, len(trits), 5))
    assert payload == scales.astype("<f4").tobytes() + packed
    decoded_q, decoded_scales = decode_stage_span(payload, 3, count, 0, count, np.empty(span_trits(0, count), np.int8))
    assert np.array_equal(decoded_q, q) and np.array_equal(decoded_scales, scales)


@pytest.mark.parametrize("dtype", [np.int8, np.float32])
def test_a_stage_decodes_into_a_reused_buffer_of_int8_or_fp32(dtype):
    rng = np.random.default_rng(9)
    buffer = np.full(40, 7, dtype=dtype)  # larger than needed: only a prefix is written
    for count in (12, 33, 35):
        q = rng.integers(-1, 2, size=count).astype(np.int8)
        decoded, _ = decode_stage_span(encode_stage(q, np.ones(2, dtype=np.float32)), 2, count, 0, count, buffer)
        assert decoded.dtype == dtype and np.array_equal(decoded, q.astype(dtype))
        assert np.shares_memory(decoded, buffer)


@pytest.mark.parametrize("dtype", [np.int8, np.float32])
def test_any_span_of_a_stage_decodes_as_the_same_elements_of_the_whole(dtype):
    rng = np.random.default_rng(11)
    count = 103
    q = rng.integers(-1, 2, size=count).astype(np.int8)
    payload = encode_stage(q, np.arange(1, 4, dtype=np.float32))
    for start, end in [(0, 103), (0, 0), (1, 2), (4, 6), (5, 10), (7, 103), (99, 103), (50, 51)]:
        out = np.full(span_trits(start, end), 9, dtype=dtype)
        decoded, scales = decode_stage_span(payload, 3, count, start, end, out)
        assert np.array_equal(decoded, q[start:end].astype(dtype))
        assert start == end or np.shares_memory(decoded, out)
        assert scales.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="decodes into 10"):
        decode_stage_span(payload, 3, count, 4, 6, np.empty(9, dtype=dtype))
    with pytest.raises(ValueError, match="not in a stage"):
        decode_stage_span(payload, 3, count, 100, 104, np.empty(10, dtype=dtype))


def test_a_stage_will_not_decode_into_a_short_or_wrong_buffer():
    payload = encode_stage(np.zeros(11, dtype=np.int8), np.ones(1, dtype=np.float32))
    for out in (np.empty(14, dtype=np.int8), np.empty(15, dtype=np.int16)):
        with pytest.raises(ValueError, match="decodes into 15"):
            decode_stage_span(payload, 1, 11, 0, 11, out)


def test_varints_decode_when_the_first_bytes_hold_fewer_than_count_varints():
    data = encode_varints(np.array([300, 1, 2, 70000, 5]))  # a one-byte shortcut would misread these
    assert decode_varints(data, 5).tolist() == [300, 1, 2, 70000, 5]
    assert decode_varints(data, 2).tolist() == [300, 1]
