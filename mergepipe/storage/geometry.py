"""How a tensor is cut into blocks: the only place block geometry is computed.

A block is a run of whole rows (first dimension) of one tensor, about
``block_bytes`` long. Safetensors data is row-major, so a block is one
contiguous byte range of its file: one read. A 0-d or 1-D tensor is a single
row, and a tensor of at most ``block_bytes`` is a single block.
"""

from __future__ import annotations

from dataclasses import dataclass

from mergepipe.storage.format import TensorEntry


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
