"""Block geometry: blocks of whole rows that tile a tensor's bytes exactly."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mergepipe.storage.format import block_at, num_blocks, rows_per_block, tensor_blocks
from mergepipe.storage.format import DTYPE_SIZES, TensorEntry


def make_entry(shape, dtype="BF16", begin=1000):
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
    return TensorEntry("t", dtype, tuple(shape), begin, begin + nbytes)


entries = st.builds(
    make_entry,
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=4),
    dtype=st.sampled_from(["BF16", "F32", "U8", "F64"]),
    begin=st.integers(8, 10**9),
)


@settings(max_examples=300, deadline=None)
@given(entry=entries, block_bytes=st.integers(1, 6000))
def test_blocks_tile_the_tensor(entry, block_bytes):
    blocks = tensor_blocks(entry, block_bytes)
    assert len(blocks) == num_blocks(entry, block_bytes) >= 1
    assert [b.index for b in blocks] == list(range(len(blocks)))
    # contiguous bytes from begin to end, contiguous rows from 0 to rows
    assert blocks[0].begin == entry.begin and blocks[-1].end == entry.end
    assert blocks[0].row_start == 0 and blocks[-1].row_end == entry.rows
    for prev, cur in zip(blocks, blocks[1:]):
        assert prev.end == cur.begin and prev.row_end == cur.row_start
    assert sum(b.nbytes for b in blocks) == entry.nbytes
    assert sum(b.numel for b in blocks) == entry.numel
    per_block = rows_per_block(entry, block_bytes)
    for block in blocks:
        assert block.nbytes == block.num_rows * entry.row_bytes
        assert block.flat_start == block.row_start * block.row_numel
        assert block.flat_end - block.flat_start == block.nbytes // entry.itemsize
        assert block.begin - entry.begin == block.flat_start * entry.itemsize
        assert math.prod(block.shape(entry)) == block.numel
        # at most block_bytes unless a single row is already bigger
        assert block.nbytes <= block_bytes or block.num_rows == 1
        assert block_at(entry, block_bytes, block.index) == block
    for block in blocks[:-1]:
        assert block.num_rows == per_block
    if entry.nbytes <= block_bytes or len(entry.shape) < 2:
        assert len(blocks) == 1


@settings(max_examples=100, deadline=None)
@given(entry=entries, block_bytes=st.integers(1, 6000))
def test_rows_per_block_formula(entry, block_bytes):
    per_block = rows_per_block(entry, block_bytes)
    if entry.nbytes > block_bytes:
        assert per_block == max(1, block_bytes // entry.row_bytes)
    assert per_block >= 1


def test_vocab_rows_do_not_divide_evenly():
    entry = make_entry((250, 64), "BF16")  # 128-byte rows
    blocks = tensor_blocks(entry, 8 * 128)
    assert len(blocks) == 32
    assert [(b.row_start, b.row_end) for b in blocks[-2:]] == [(240, 248), (248, 250)]
    assert blocks[-1].nbytes == 2 * 128


@pytest.mark.parametrize("shape", [(), (5000,), (0,), (0, 7), (7, 0)])
def test_single_block_cases(shape):
    entry = make_entry(shape, "F32")
    (block,) = tensor_blocks(entry, 16)
    assert (block.begin, block.end) == (entry.begin, entry.end)
    assert block.numel == entry.numel


def test_invalid_block_bytes():
    with pytest.raises(ValueError):
        tensor_blocks(make_entry((4, 4)), 0)
    with pytest.raises(IndexError):
        block_at(make_entry((4, 4)), 8, 99)
