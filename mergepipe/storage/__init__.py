"""Safetensors bytes on disk: headers, checkpoints, blocks, reads, writes.

No SQL and no merging here; everything above codes against these names.
"""

from mergepipe.storage.blocks import BlockSpec, block_at, num_blocks, rows_per_block, tensor_blocks
from mergepipe.storage.checkpoint import Checkpoint, CheckpointFile, open_checkpoint
from mergepipe.storage.convert import (
    MERGEABLE_DTYPES,
    raw_view,
    safetensors_dtype,
    to_bytes,
    to_float32,
    torch_dtype,
)
from mergepipe.storage.format import (
    DTYPE_SIZES,
    MAX_HEADER_BYTES,
    SafetensorsHeader,
    TensorEntry,
    read_header,
)
from mergepipe.storage.reader import BlockReader, RangeReader, read_tensor
from mergepipe.storage.writer import StreamingSafetensorsWriter

__all__ = [
    "DTYPE_SIZES",
    "MAX_HEADER_BYTES",
    "MERGEABLE_DTYPES",
    "BlockReader",
    "BlockSpec",
    "Checkpoint",
    "CheckpointFile",
    "RangeReader",
    "SafetensorsHeader",
    "StreamingSafetensorsWriter",
    "TensorEntry",
    "block_at",
    "num_blocks",
    "open_checkpoint",
    "raw_view",
    "read_header",
    "read_tensor",
    "rows_per_block",
    "safetensors_dtype",
    "tensor_blocks",
    "to_bytes",
    "to_float32",
    "torch_dtype",
]
