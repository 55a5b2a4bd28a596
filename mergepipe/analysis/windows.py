"""How analysis reads a tensor: a window of blocks at a time, and a second look at a few pieces.

Memory must not grow with tensor size (a 0.6B model's embedding alone is 155M entries, 622 MB in fp32;
larger models have larger ones), so analysis never reads or converts a whole tensor: it reads a window of
whole blocks of at most ``WINDOW_ELEMENTS`` entries (one block when a block is larger), the same blocks of
the base and of every expert in turn, and computes everything it can while the window's |Δ| is in memory:
block hashes (on the reading thread), block statistics and the threshold selector's counts (``stats.py``,
``topk.py``).

The thresholds then need a second look at a few pieces of the tensor (the one holding each density's k-th
entry). For a tensor of one window those are still in memory. For a larger tensor, ``Rereader`` reads the
blocks of that piece again — from the page cache, where the first pass has just put them — checks them
against the hashes the first pass recorded, and recomputes their |Δ|. Why a second read rather than
keeping bytes: it costs a few pieces per tensor (a few MB of a 0.6B model's analysis), while keeping a
tensor's bytes would make memory grow with the largest tensor again; the worst case, an fp32 delta with low
bits everywhere, re-reads each embedding piece once more. Re-read bytes are counted apart (``REREAD``), so
an analysis still reports each checkpoint byte read once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from mergepipe.analysis.lora_expert import span_hashes
from mergepipe.analysis.stats import Workspace
from mergepipe.catalog.records import BlockRecord, TensorRecord
from mergepipe.errors import ModelChangedError
from mergepipe.storage.convert import raw_view
from mergepipe.storage.hashing import block_digest
from mergepipe.storage.location import Location
from mergepipe.storage.lora import LoraTarget, SavedTensor
from mergepipe.storage.readahead import ByteRange, WorkItem
from mergepipe.storage.source import RangeSource

#: Entries in one window: 16 MiB per fp32 buffer. Every tensor of a Qwen3-0.6B layer fits in one window
#: (no second read); an embedding takes ~40 windows; a few buffers of this size bound analysis memory.
WINDOW_ELEMENTS = 1 << 22

#: The byte-counter tag of second reads (not a model id: reports count each checkpoint byte once).
REREAD = "#reread"


def block_entries(t: TensorRecord, blocks: Sequence[BlockRecord]) -> list[int]:
    """Entries of each block (rows times the entries of a row: the same for every format of a tensor)."""
    rows = t.shape[0] if t.shape else 1
    per_row = t.numel // rows if rows else 0
    return [(b.row_end - b.row_start) * per_row for b in blocks]


def block_windows(sizes: Sequence[int], limit: int | None = None) -> list[tuple[int, int]]:
    """Consecutive block ranges ``(lo, hi)`` of at most ``limit`` (default ``WINDOW_ELEMENTS``) entries each
    (a larger block alone)."""
    limit = WINDOW_ELEMENTS if limit is None else limit
    windows: list[tuple[int, int]] = []
    lo, total = 0, 0
    for i, size in enumerate(sizes):
        if i > lo and total + size > limit:
            windows.append((lo, i))
            lo, total = i, 0
        total += size
    if sizes:
        windows.append((lo, len(sizes)))
    return windows


@dataclass(frozen=True)
class Read:
    """Blocks ``lo .. hi-1`` of one model's tensor, as one read (the payload of a read-ahead item)."""

    model_id: str
    role: str  # "base", "expert" or "hash"
    tensor: TensorRecord
    blocks: list[BlockRecord]  # all of the tensor's blocks
    lo: int
    hi: int
    last: bool  # the tensor's last window
    needs_hash: bool
    lora: LoraTarget | SavedTensor | None = None  # an adapter's factors (read whole, their span) or replacement

    @property
    def begin(self) -> int:
        return self.tensor.begin if isinstance(self.lora, LoraTarget) else self.blocks[self.lo].begin

    @property
    def end(self) -> int:
        return self.tensor.end if isinstance(self.lora, LoraTarget) else self.blocks[self.hi - 1].end

    def item(self, root: Location) -> WorkItem:
        return WorkItem(self, [ByteRange(root / self.tensor.file, self.begin, self.end, self.model_id)])


def tensor_reads(model_id: str, role: str, t: TensorRecord, blocks: list[BlockRecord],
                 windows: list[tuple[int, int]], lora: LoraTarget | SavedTensor | None) -> list[Read]:
    """The reads of one model's tensor, window by window; an adapter's factors are read whole."""
    if isinstance(lora, LoraTarget):
        windows = [(0, len(blocks))]
    return [
        Read(model_id, role, t, blocks, lo, hi, n == len(windows) - 1,
             any(b.hash is None for b in blocks[lo:hi]), lora)
        for n, (lo, hi) in enumerate(windows)
    ]


def hash_window(item: WorkItem, views: list[memoryview]) -> list[str] | None:
    """Block hashes of a freshly read window, computed on the reading thread (the second core is better
    spent on torch than on blake3)."""
    read: Read = item.payload
    if not read.needs_hash:
        return None
    (view,) = views
    if isinstance(read.lora, LoraTarget):  # each block: its rows of B, then A
        return span_hashes(read.lora, view, read.begin, read.blocks)
    return [block_digest(view[b.begin - read.begin : b.end - read.begin]) for b in read.blocks[read.lo : read.hi]]


def window_raw(read: Read, view: memoryview, a: int, b: int) -> torch.Tensor:
    """Blocks ``a .. b-1`` of a fetched window as a flat tensor of their dtype (no copy)."""
    t = read.tensor
    part = view[read.blocks[a].begin - read.begin : read.blocks[b - 1].end - read.begin]
    itemsize = t.nbytes // t.numel
    return raw_view(part, t.dtype, (len(part) // itemsize,))


class Rereader:
    """The second look: blocks read again, checked against their recorded hashes, their |Δ| recomputed."""

    def __init__(self, source: RangeSource[Location], workspace: Workspace) -> None:
        self.source = source
        self.workspace = workspace
        self._buffers: dict[str, np.ndarray] = {}

    def _read(self, name: str, model_id: str, root: Location, t: TensorRecord, blocks: Sequence[BlockRecord],
              hashes: Sequence[str | None]) -> torch.Tensor:
        begin, end = blocks[0].begin, blocks[-1].end
        buf = self._buffers.get(name)
        if buf is None or buf.nbytes < end - begin:
            buf = self._buffers[name] = np.empty(end - begin, dtype=np.uint8)
        view = self.source.read(root / t.file, begin, end, out=buf, tag=REREAD)
        for block, digest in zip(blocks, hashes):
            if block_digest(view[block.begin - begin : block.end - begin]) != digest:
                raise ModelChangedError(
                    f"model '{model_id}' changed on disk while analyze ran: block {block.index} of tensor "
                    f"'{t.name}' no longer matches the bytes read first; run `mergepipe analyze` again"
                )
        return raw_view(view, t.dtype, ((end - begin) // (t.nbytes // t.numel),))

    def delta(self, expert: tuple[str, Location, TensorRecord, Sequence[BlockRecord], Sequence[str | None]],
              base: tuple[str, Location, TensorRecord, Sequence[BlockRecord], Sequence[str | None]] | None,
              ) -> torch.Tensor:
        """|Δ| of the given blocks of an expert (model id, root, tensor, blocks, their hashes) against the
        same blocks of the base (``None``: the expert's bytes are Δ), in the workspace's ``again`` buffer."""
        expert_raw = self._read("expert", *expert)
        base_raw = self._read("base", *base) if base is not None else None
        out = self.workspace.buffer("again", expert_raw.numel())
        return self.workspace.abs_delta(out, expert_raw, base_raw)
