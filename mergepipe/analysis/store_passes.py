"""How a store build reads a tensor's delta: whole, or window by window in as many passes as it needs.

Every block read is checked against the hash analysis recorded, on every pass: the files may change
between passes (a later pass reads a small tensor's blocks from the page cache, where the first put them).
A remote model's blocks are fetched once: the first pass keeps them in a temporary local file (in the
store's directory) and later passes read them from there.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mergepipe.analysis.windows import block_windows
from mergepipe.errors import ModelChangedError
from mergepipe.storage.geometry import BlockSpec, tensor_blocks
from mergepipe.storage.checkpoint import Checkpoint
from mergepipe.storage.convert import raw_view
from mergepipe.storage.format import TensorEntry
from mergepipe.storage.hashing import block_digest
from mergepipe.storage.location import Location, RemotePath
from mergepipe.storage.remote_source import CheckpointSource


@dataclass(frozen=True)
class Side:
    """One model of the pair: its id, checkpoint and recorded block hashes (by tensor)."""

    model_id: str
    checkpoint: Checkpoint
    hashes: dict[str, list[str | None]]


@dataclass(frozen=True)
class Window:
    """Entries ``[start, start + len(delta))`` of a tensor: Δ in fp32 and the expert's element bytes."""

    start: int
    delta: torch.Tensor  # flat fp32
    elements: np.ndarray  # the expert's element bytes, one ``V<itemsize>`` item per entry


class TensorReader:
    """Reads the delta of one tensor of an (expert, base) pair, whole or as passes of windows."""

    def __init__(self, source: CheckpointSource, base: Side, expert: Side, block_bytes: int,
                 spill_dir: Path) -> None:
        self.source = source
        self.base, self.expert = base, expert
        self.block_bytes = block_bytes
        self.spill_dir = spill_dir

    def whole(self, entry: TensorEntry) -> Window:
        """The whole tensor as one window (one read of each model)."""
        return next(iter(self._windows(entry, [(0, None)], {})))

    def passes(self, entry: TensorEntry) -> Passes:
        """Windowed passes over ``entry``; close it (a ``with`` block) to drop what remote reads kept."""
        return Passes(self, entry)

    def _windows(self, entry: TensorEntry, windows: Sequence[tuple[int, int | None]],
                 spills: dict[str, _Spill], reuse: bool = False) -> Iterator[Window]:
        sides = [(side, side.checkpoint.tensor(entry.name) if side is self.expert else entry)
                 for side in (self.base, self.expert)]
        blocks = {side.model_id: tensor_blocks(e, self.block_bytes) for side, e in sides}
        buffers: dict[str, np.ndarray] = {}
        scratch = [np.empty(0, dtype=np.float32)] * 2  # with ``reuse``: the memory of the delta and the base's
        for lo, hi in windows:
            raw = []
            for side, e in sides:
                chosen = blocks[side.model_id][lo:hi]
                hashes = side.hashes[entry.name][lo:hi]
                path = side.checkpoint.file_of(entry.name).path
                raw.append(self._read(side, path, entry.name, chosen, hashes, buffers, spills.get(side.model_id)))
            numel = len(raw[1]) // entry.itemsize
            if reuse and len(scratch[0]) < numel:
                scratch = [np.empty(numel, dtype=np.float32) for _ in range(2)]
            delta, base = (_float32(r, entry.dtype, numel, scratch[k][:numel] if reuse else None)
                           for k, r in ((0, raw[1]), (1, raw[0])))
            delta.sub_(base)  # (subtracting the base's bf16 values from fp32 directly is several times slower)
            elements = np.frombuffer(raw[1], dtype=f"V{entry.itemsize}")
            yield Window(blocks[self.base.model_id][lo].flat_start, delta, elements)

    def _read(self, side: Side, path: Location, name: str, blocks: Sequence[BlockSpec],
              recorded: Sequence[str | None], buffers: dict[str, np.ndarray], spill: _Spill | None) -> memoryview:
        """Blocks ``blocks`` of one model's tensor (consecutive), each checked against its recorded hash."""
        begin, end = blocks[0].begin, blocks[-1].end
        if spill is not None and spill.holds(begin, end):
            return spill.read(begin, end)  # our own copy of bytes checked when they were fetched
        buffer = buffers.get(side.model_id)
        if buffer is None or buffer.nbytes < end - begin:
            buffer = buffers[side.model_id] = np.empty(end - begin, dtype=np.uint8)
        view = self.source.read(path, begin, end, out=buffer[: end - begin], tag=side.model_id)
        for block, digest in zip(blocks, recorded):
            if block_digest(view[block.begin - begin : block.end - begin]) != digest:
                raise ModelChangedError(
                    f"model '{side.model_id}' changed on disk since it was analysed: block {block.index} of "
                    f"tensor '{name}' in {path} no longer matches its recorded hash; re-register and analyse it"
                )
        if spill is not None:
            spill.write(begin, view)
        return view


def _float32(raw: memoryview, dtype: str, numel: int, out: np.ndarray | None = None) -> torch.Tensor:
    """The values in ``raw`` as an fp32 tensor in ``out``, or in new memory numpy allocated: numpy asks the
    kernel for huge pages for a large array, so a window's fresh tensors cost far fewer page faults than
    torch's own."""
    out = np.empty(numel, dtype=np.float32) if out is None else out
    return torch.from_numpy(out).copy_(raw_view(raw, dtype, (numel,)))


class Passes:
    """Passes over one tensor, a window of whole blocks (at most ``windows.WINDOW_ELEMENTS`` entries, or one
    block) at a time. Each pass yields the tensor's windows in order."""

    def __init__(self, reader: TensorReader, entry: TensorEntry) -> None:
        self.reader, self.entry = reader, entry
        blocks = tensor_blocks(entry, reader.block_bytes)
        self.windows = block_windows([b.numel for b in blocks])
        self._spills = {side.model_id: _Spill(reader.spill_dir) for side in (reader.base, reader.expert)
                        if isinstance(side.checkpoint.file_of(entry.name).path, RemotePath)}

    @property
    def fetched(self) -> bool:
        """Whether a model's bytes are remote (fetched by the first pass, kept for the later ones)."""
        return bool(self._spills)

    def __enter__(self) -> Passes:
        return self

    def __exit__(self, *exc: object) -> None:
        for spill in self._spills.values():
            spill.close()

    def __iter__(self) -> Iterator[Window]:
        return self.reader._windows(self.entry, self.windows, self._spills)

    def reusing(self) -> Iterator[Window]:
        """A pass whose windows' deltas share one buffer, each overwritten by the next: for a consumer that
        keeps nothing of a window once it asks for the next (their element bytes are always so)."""
        return self.reader._windows(self.entry, self.windows, self._spills, reuse=True)


class _Spill:
    """A remote tensor's bytes kept in a temporary local file by the first pass, for the later ones."""

    def __init__(self, directory: Path) -> None:
        self._file = tempfile.TemporaryFile(dir=directory, prefix=".mpdelta-spill-")
        self._ranges: dict[int, int] = {}  # file begin -> end of the ranges written
        self._first: int | None = None  # file offset of the first byte kept (the spill's offset 0)

    def holds(self, begin: int, end: int) -> bool:
        return self._ranges.get(begin) == end

    def write(self, begin: int, data: memoryview) -> None:
        if self._first is None:
            self._first = begin
        os.pwrite(self._file.fileno(), data, begin - self._first)
        self._ranges[begin] = begin + len(data)

    def read(self, begin: int, end: int) -> memoryview:
        assert self._first is not None
        data = bytearray(end - begin)  # writable: torch views it without a copy
        got = os.preadv(self._file.fileno(), [data], begin - self._first)
        if got != end - begin:
            raise OSError(f"temporary copy of a remote tensor is short: {got} of {end - begin} bytes")
        return memoryview(data)

    def close(self) -> None:
        self._file.close()
