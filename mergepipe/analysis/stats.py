"""Delta statistics of one tensor, from its bytes window by window or from its block hashes alone.

Per block of Δ = E − B (fp32): ‖Δ‖₂, max|Δ|, non-zeros and whether the block
is byte-identical to the base; per tensor: the exact trim thresholds at every
density of ``DENSITY_GRID`` (``topk.py``).

``TensorPass`` takes a tensor one window of blocks at a time, in order: the
caller puts a window's |Δ| in the ``Workspace`` (a few reused fp32 buffers,
never a whole tensor), the pass takes the blocks' statistics and feeds the
threshold selector while the values are in memory, and at the end asks for
the few pieces the selector must look at again. A block known to be
identical (equal hashes) is never converted: its statistics are 0 and its
entries are zeros for the thresholds. Blocks are equal-sized row ranges, so
per-block sums are one reshape and a few vectorised torch ops per window,
each block reduced alone (the same bits whatever the window holds).

A tensor whose result follows from hashes (every block identical, or a
non-mergeable dtype, of which only the identical flags are kept) needs no
bytes: ``from_hashes``. A NaN or Inf in a delta is refused: thresholds and
error bounds would be meaningless.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from typing import Callable, Sequence

import torch

from mergepipe.analysis.thresholds import trim_thresholds
from mergepipe.analysis.topk import ThresholdSelector
from mergepipe.catalog.records import BlockDelta, BlockRecord, TensorRecord, TensorStats
from mergepipe.errors import CatalogError
from mergepipe.spec.trim import DENSITY_GRID, TrimThreshold, kept_count
from mergepipe.storage.format import MERGEABLE_DTYPES


def zero_thresholds(numel: int) -> dict[float, TrimThreshold]:
    """Thresholds of an all-zero |Δ|: tau 0, the first k entries kept (what
    ``trim_thresholds`` returns for zeros; a test pins the equality)."""
    if numel == 0:
        return {t.density: t for t in trim_thresholds(torch.zeros(0), DENSITY_GRID)}
    return {
        d: TrimThreshold(float(d), kept_count(d, numel), 0.0, kept_count(d, numel) - 1) for d in DENSITY_GRID
    }


TensorResult = tuple[list[BlockDelta], TensorStats]


def from_hashes(t: TensorRecord, blocks: list[BlockRecord], flags: list[bool]) -> TensorResult:
    """The result of a tensor that needs no bytes: all blocks identical, or
    a non-mergeable tensor (only identical flags are kept)."""
    mergeable = t.dtype in MERGEABLE_DTYPES
    deltas = [
        BlockDelta(t.name, b.index, 0.0, 0.0, 0, True) if same else BlockDelta(t.name, b.index, None, None, None, False)
        for b, same in zip(blocks, flags)
    ]
    thresholds = zero_thresholds(t.numel) if mergeable else {}
    return deltas, TensorStats(t.name, t.numel, mergeable, all(flags), thresholds)


# Counts up to 2**24 are exact in fp32, so below it a sum of signs (|Δ| ≥ 0: 0 or 1 each; vectorised,
# unlike a data-dependent count) counts non-zeros exactly; larger blocks use the integer count.
_EXACT_FP32_COUNT = 1 << 24


def _count_nonzero(x: torch.Tensor, dim: int | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    per_row = x.shape[-1] if dim is not None else x.numel()
    if per_row >= _EXACT_FP32_COUNT:
        return torch.count_nonzero(x, dim=dim)
    signs = torch.sign(x) if scratch is None else torch.sign(x, out=scratch[: x.numel()].view(x.shape))
    return (signs.sum() if dim is None else signs.sum(dim)).to(torch.int64)


def block_stats(
    abs_delta: torch.Tensor, sizes: list[int], scratch: torch.Tensor | None = None
) -> tuple[list[float], list[float], list[int]]:
    """Per-block (‖Δ‖₂, max|Δ|, nnz) of a flat |Δ| cut into consecutive runs
    of ``sizes`` elements: all equal but the last, so one reshape covers the
    full blocks and one more op the tail. ``scratch``: an fp32 buffer of at
    least ``len(abs_delta)`` to reuse."""
    first = sizes[0]
    if any(s != first for s in sizes[:-1]):  # never for tensor_blocks geometry; kept exact anyway
        parts = torch.split(abs_delta, sizes)
        return (
            [float(torch.linalg.vector_norm(p)) for p in parts],
            [float(p.max()) if p.numel() else 0.0 for p in parts],
            [int(_count_nonzero(p)) for p in parts],
        )
    full = len(sizes) if sizes[-1] == first else len(sizes) - 1
    l2: list[float] = []
    mx: list[float] = []
    nnz: list[int] = []
    if full and first:
        head = abs_delta[: full * first].view(full, first)
        l2 = torch.linalg.vector_norm(head, dim=1).tolist()
        mx = head.amax(dim=1).tolist()
        nnz = _count_nonzero(head, dim=1, scratch=scratch).tolist()
    elif full:
        l2, mx, nnz = [0.0] * full, [0.0] * full, [0] * full
    if full < len(sizes):
        tail = abs_delta[full * first :]
        l2.append(float(torch.linalg.vector_norm(tail)))
        mx.append(float(tail.max()) if tail.numel() else 0.0)
        nnz.append(int(_count_nonzero(tail, scratch=scratch)))
    return l2, mx, nnz


class Workspace:
    """The reused buffers one worker computes |Δ| in, each grown to the largest window seen: no fresh
    (page-faulting) allocation per window, and never more than a window of fp32 each.

    ``window`` holds the current window's |Δ| (each run of changed blocks at its offset), ``again`` a
    piece recomputed for a second look while ``window`` holds another, ``scratch`` base values and signs;
    ``keys`` is the threshold selector's. ``generation`` counts windows, so a caller can tell whether
    ``window`` still holds the one it filled.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.generation = 0

    def buffer(self, name: str, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype)
        return buf[:numel]

    def new_window(self, numel: int) -> torch.Tensor:
        self.generation += 1
        return self.buffer("window", numel)

    def abs_delta(self, out: torch.Tensor, expert_raw: torch.Tensor, base_raw: torch.Tensor | None) -> torch.Tensor:
        """``|fp32(E) − fp32(B)|`` into ``out`` (bf16/f16 → fp32 is exact, so this is the fp32 difference
        of the values); ``base_raw`` None: the expert's bytes are Δ itself (a delta checkpoint)."""
        out.copy_(expert_raw.reshape(-1))
        if base_raw is not None:
            base = self.buffer("scratch", out.numel())
            base.copy_(base_raw.reshape(-1))
            out.sub_(base)
        return out.abs_()


#: ``values(a, b)``: fp32 |Δ| of blocks ``a .. b-1`` (a run of changed blocks), 1-D.
BlockValues = Callable[[int, int], torch.Tensor]


class TensorPass:
    """Block statistics and trim thresholds of one (expert, tensor) from its |Δ|, a window of blocks at a
    time in block order (module docstring); ``who`` names the (expert, base) pair in errors."""

    def __init__(self, t: TensorRecord, blocks: Sequence[BlockRecord], who: str, workspace: Workspace) -> None:
        itemsize = t.nbytes // t.numel if t.numel else 1
        self.t, self.blocks, self.who, self.workspace = t, list(blocks), who, workspace
        self.sizes = [(b.end - b.begin) // itemsize for b in self.blocks]
        self.starts = list(itertools.accumulate(self.sizes, initial=0))  # flat start of each block, then n
        self.deltas: list[BlockDelta | None] = [None] * len(self.blocks)
        self.selector = ThresholdSelector(t.numel, DENSITY_GRID)
        self._runs: list[tuple[int, int]] = []  # the block range of each run given to the selector

    def add(self, lo: int, flags: Sequence[bool], values: BlockValues) -> None:
        """Blocks ``lo .. lo+len(flags)-1`` with their unchanged flags; ``values`` gives the |Δ| of each run
        of changed blocks among them (never asked for unchanged ones)."""
        for a, b, same in _runs(flags, lo):
            if same:
                for i in range(a, b):
                    self.deltas[i] = BlockDelta(self.t.name, self.blocks[i].index, 0.0, 0.0, 0, True)
                self.selector.add_zeros(self.starts[a], self.starts[b] - self.starts[a])
            else:
                self._add_values(a, b, values(a, b))
            self._runs.append((a, b))

    def _add_values(self, a: int, b: int, v: torch.Tensor) -> None:
        l2, mx, nnz = block_stats(v, self.sizes[a:b], self.workspace.buffer("scratch", v.numel()))
        if not all(map(math.isfinite, mx)):
            raise CatalogError(
                f"cannot analyse {self.who}: tensor '{self.t.name}' has a NaN or infinite delta; "
                "check both checkpoints for NaN/Inf weights"
            )
        if not all(map(math.isfinite, l2)):  # finite entries whose norm overflows float32: a merge would too
            raise CatalogError(
                f"cannot analyse {self.who}: tensor '{self.t.name}' has deltas too large to merge in float32 "
                f"(|Δ| up to {max(mx):.3g}: a block's norm overflows); check both checkpoints for exploded weights"
            )
        for i in range(a, b):
            self.deltas[i] = BlockDelta(self.t.name, self.blocks[i].index, l2[i - a], mx[i - a], nnz[i - a], False)
        keys = self.workspace.buffer("keys", v.numel(), torch.int32)
        self.selector.add(self.starts[a], v, keys)

    def result(self, again: BlockValues) -> TensorResult:
        """The tensor's rows, once every block was added; ``again(a, b)`` gives a run's |Δ| once more
        (at most a window of blocks: the pieces the threshold selector looks at again)."""

        def values_of(run: int, lo: int, hi: int) -> torch.Tensor:
            first = self.starts[self._runs[run][0]]
            c0 = bisect.bisect_right(self.starts, first + lo) - 1
            c1 = bisect.bisect_left(self.starts, first + hi)
            return again(c0, c1)[first + lo - self.starts[c0] : first + hi - self.starts[c0]]

        thresholds = {x.density: x for x in self.selector.thresholds(values_of)}
        deltas = [d for d in self.deltas if d is not None]
        if len(deltas) != len(self.blocks):
            raise ValueError(f"tensor {self.t.name}: {len(self.blocks) - len(deltas)} blocks were never added")
        identical = all(d.identical for d in deltas)
        return deltas, TensorStats(self.t.name, self.t.numel, True, identical, thresholds)


def _runs(flags: Sequence[bool], lo: int) -> list[tuple[int, int, bool]]:
    """Maximal runs ``(a, b, same)`` of equal flags, as block indices starting at ``lo``."""
    out, a = [], lo
    for same, group in itertools.groupby(flags):
        n = len(list(group))
        out.append((a, a + n, bool(same)))
        a += n
    return out


def from_delta(
    t: TensorRecord, blocks: list[BlockRecord], flags: list[bool], abs_delta: torch.Tensor, who: str
) -> TensorResult:
    """The result of a mergeable tensor from its whole flat fp32 |Δ| in memory (``who`` names the
    (expert, base) pair in the NaN/Inf error). Blocks flagged identical must hold zeros there. The tensor
    is recorded as changed (``identical`` False) whatever its flags, as it always was: callers with all
    blocks unchanged use ``from_hashes``."""
    work = TensorPass(t, blocks, who, Workspace())
    flat = abs_delta.reshape(-1)

    def values(a: int, b: int) -> torch.Tensor:
        return flat[work.starts[a] : work.starts[b]]

    work.add(0, [bool(f) for f in flags], values)
    deltas, stats = work.result(values)
    return deltas, dataclasses.replace(stats, identical=False)
