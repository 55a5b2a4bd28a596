"""Delta statistics of one tensor: per block ‖Δ‖₂, max|Δ|, non-zeros; exact trim thresholds at every density
of ``DENSITY_GRID`` (``TensorPass``, ``ThresholdSelector``); the in-memory trim the engine and export use.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from mergepipe.catalog.records import BlockDelta, BlockRecord, TensorRecord, TensorStats
from mergepipe.errors import CatalogError
from mergepipe.spec.operators import DENSITY_GRID, TrimThreshold, kept_count
from mergepipe.storage.format import MERGEABLE_DTYPES
from mergepipe.storage.lora import LoraTarget, delta_rows
from mergepipe.storage.writer import to_float32

_DIGIT = 1 << 16
_IMPURE = 1 << 15  # key bit: the low 16 bits are not all zero (|Δ| ≥ 0: bit 31, the sign, is free)
#: Index of the low 16 bits of an fp32 value viewed as two int16 (the host's byte order; CUDA's is little).
_LOW = 0 if sys.byteorder == "little" else 1

#: Below this many entries a stable sort is cheaper than the histograms (the same answer).
SORT_BELOW = 1 << 16

#: Entries per piece: what the search for a position looks at again.
PIECE = 1 << 16

#: Entries counted at once (the int32 high digits of that many entries are held).
_COUNT_SPAN = 32 * PIECE

#: Impure entries (low 16 bits not zero) are kept apart while at most one in this many is; beyond, the keys
#: carry the impure bit and impure cuts collect their bucket's entries in a second look.
_FEW_IMPURE = 64

#: Most impure entries collected at once for impure cuts (12 bytes each); more buckets take more looks.
_COLLECT_CAP = 1 << 22

#: ``values_of(run, lo, hi)``: fp32 |Δ| of entries ``[lo, hi)`` of the ``run``-th run added, again.
ValuesOf = Callable[[int, int, int], torch.Tensor]


@dataclass(frozen=True)
class _Piece:
    """Entries ``[lo, hi)`` of run ``run`` (offsets in the run); ``start`` is the tensor position of ``lo``."""

    run: int
    lo: int
    hi: int
    start: int
    data: bool  # False: all exact zeros, never looked at


@dataclass
class _Counts:
    """Sparse (piece, key) counts of a tensor: ``keys`` = piece * 65536 + key, in piece order."""

    keys: list[torch.Tensor] = field(default_factory=list)
    counts: list[torch.Tensor] = field(default_factory=list)

    def add(self, keys: torch.Tensor, counts: torch.Tensor) -> None:
        self.keys.append(keys)
        self.counts.append(counts)

    def of_key(self, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pieces, counts) holding ``key``, in position order."""
        if len(self.keys) > 1:  # joined once, then every lookup filters one tensor
            self.keys, self.counts = [torch.cat(self.keys)], [torch.cat(self.counts)]
        keys, counts = self.keys[0], self.counts[0]
        hit = (keys & (_DIGIT - 1)) == key
        return keys[hit] >> 16, counts[hit]


class ThresholdSelector:
    """Exact (τ, p) at every density for one tensor's |Δ|, fed in position order."""

    def __init__(self, numel: int, densities: Sequence[float]) -> None:
        self.numel = numel
        self.densities = [float(d) for d in densities]
        self.ks = [kept_count(d, numel) for d in densities]
        self.pieces: list[_Piece] = []
        self._runs = 0
        self._end = 0
        self._hist = torch.zeros(_DIGIT, dtype=torch.int64)
        self._counts = _Counts()
        # the impure entries (bit patterns, positions) while they are few, None once a window had many
        self._impure: list[tuple[torch.Tensor, torch.Tensor]] | None = []

    def _next_run(self, start: int, numel: int) -> int:
        if start != self._end:
            raise ValueError(f"entries must come in position order without gaps: expected {self._end}, got {start}")
        self._end += numel
        self._runs += 1
        return self._runs - 1

    def add(self, start: int, values: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """Entries ``[start, start + len(values))``."""
        n = values.numel()
        run = self._next_run(start, n)
        if keys is None or keys.numel() < min(n, _COUNT_SPAN) or keys.device != values.device:
            keys = torch.empty(min(n, _COUNT_SPAN), dtype=torch.int32, device=values.device)
        for lo in range(0, n, _COUNT_SPAN):
            self._count(run, start, lo, values[lo : lo + _COUNT_SPAN], keys)

    def _count(self, run: int, start: int, offset: int, values: torch.Tensor, keys: torch.Tensor) -> None:
        """Count each piece's keys (high 16 bits) in ``values``, entries ``offset ...`` of run ``run``."""
        n = values.numel()
        high = torch.bitwise_right_shift(values.view(torch.int32), 16, out=keys[:n])
        low = values.view(torch.int16)[_LOW::2]
        impure = torch.nonzero(low).flatten() if self._impure is not None else None
        if impure is not None and impure.numel() * _FEW_IMPURE > n:
            impure = self._impure = None
        if impure is None:
            high.add_(low != 0, alpha=_IMPURE)
            impure = high[:0].long()  # none apart
        else:
            assert self._impure is not None  # impure entries are looked for only while they are kept apart
            self._impure.append((values.view(torch.int32)[impure], impure + (start + offset)))
        pieces = -(-n // PIECE)
        impure_keys, impure_counts = _sparse_counts((impure // PIECE) * _DIGIT + high[impure], pieces * _DIGIT)
        starts = torch.arange(pieces + 1, device=impure_keys.device) * _DIGIT
        bounds = torch.searchsorted(impure_keys, starts).tolist()  # each piece's impure keys
        if self._hist.device != values.device:
            self._hist = self._hist.to(values.device)
        first, piece_keys, piece_counts = len(self.pieces), [], []
        for j, lo in enumerate(range(0, n, PIECE)):
            self.pieces.append(_Piece(run, offset + lo, offset + min(lo + PIECE, n), start + offset + lo, True))
            counts = torch.bincount(high[lo : lo + PIECE])  # as many bins as the largest key needs
            a, b = bounds[j], bounds[j + 1]
            if b > a:  # impure entries: their own keys, and no longer counted as pure
                buckets, n_impure = impure_keys[a:b] & (_DIGIT - 1), impure_counts[a:b]
                counts.index_add_(0, buckets, -n_impure)
                piece_keys.append(buckets + (_IMPURE + (first + j) * _DIGIT))
                piece_counts.append(n_impure)
            nonzero = torch.nonzero(counts).flatten()
            piece_keys.append(nonzero + (first + j) * _DIGIT)
            piece_counts.append(counts[nonzero])
        keys_, counts_ = torch.cat(piece_keys), torch.cat(piece_counts)
        self._hist.index_add_(0, keys_ & (_DIGIT - 1), counts_)
        self._counts.add(keys_.cpu(), counts_.cpu())

    def add_zeros(self, start: int, numel: int) -> None:
        """Entries ``[start, start + numel)`` are all exact zeros (unchanged blocks): nothing to look at."""
        run = self._next_run(start, numel)
        if numel:
            self.pieces.append(_Piece(run, 0, numel, start, False))
            self._hist[0] += numel
            self._counts.add(torch.tensor([(len(self.pieces) - 1) * _DIGIT]), torch.tensor([numel]))

    def thresholds(self, values_of: ValuesOf) -> list[TrimThreshold]:
        """The thresholds, in the order of the densities, once every entry has been added."""
        if self._end != self.numel:
            raise ValueError(f"entries added cover {self._end} of {self.numel}")
        if self.numel == 0:
            return [TrimThreshold(d, 0, float("inf"), -1) for d in self.densities]
        if self.numel < SORT_BELOW:
            return self._by_sort(values_of)
        buckets_hist = self._hist[:_IMPURE] + self._hist[_IMPURE:]
        above = _count_above_each(buckets_hist)
        pure: dict[int, list[tuple[int, int]]] = {}  # key -> [(density index, rank among that key)]
        impure: dict[int, list[tuple[int, int]]] = {}  # bucket -> [(density index, rank from its top)]
        for i, bucket in enumerate(_digit_of_kth(buckets_hist, self.ks)):
            rank = self.ks[i] - int(above[bucket])  # 1-based, from the top of the bucket
            n_impure = int(self._hist[bucket | _IMPURE])
            if rank > n_impure:
                pure.setdefault(bucket, []).append((i, rank - n_impure - 1))
            else:
                impure.setdefault(bucket, []).append((i, rank))
        found = self._pure_cuts(pure, values_of)
        found.update(self._impure_cuts(impure, values_of))
        return [found[i] for i in range(len(self.ks))]

    def _by_sort(self, values_of: ValuesOf) -> list[TrimThreshold]:
        """The k-th entry of a stable descending sort is τ and its position p (ties are ordered by position)."""
        parts = [values_of(p.run, p.lo, p.hi).clone() if p.data else None for p in self.pieces]  # may share a buffer
        device = next((v.device for v in parts if v is not None), torch.device("cpu"))
        full = torch.cat(
            [v if v is not None else torch.zeros(p.hi - p.lo, device=device) for v, p in zip(parts, self.pieces)]
        )
        values, order = torch.sort(full, descending=True, stable=True)
        return [TrimThreshold(d, k, float(values[k - 1]), int(order[k - 1])) for d, k in zip(self.densities, self.ks)]

    def _pure_cuts(self, cuts: dict[int, list[tuple[int, int]]], values_of: ValuesOf) -> dict[int, TrimThreshold]:
        """τ is the key's value; p the rank-th entry with that key, in the one piece holding it."""
        targets = []  # (piece, key, rank in the piece, density index)
        for key, wanted in cuts.items():
            pieces, counts = self._counts.of_key(key)
            ends = counts.cumsum(0)
            ranks = torch.tensor([rank for _, rank in wanted], dtype=ends.dtype, device=ends.device)
            at = torch.searchsorted(ends, ranks, right=True).tolist()
            for (i, rank), j in zip(wanted, at):
                before = int(ends[j - 1]) if j else 0
                targets.append((int(pieces[j]), key, rank - before, i))
        found = {}
        hits, looked_at = None, None
        for piece_index, key, rank, i in sorted(targets):
            piece = self.pieces[piece_index]
            if not piece.data:  # all zeros: the rank-th zero is at rank
                position = rank
            else:
                if looked_at != (piece_index, key):
                    values = values_of(piece.run, piece.lo, piece.hi).view(torch.int32)
                    hits, looked_at = torch.nonzero(values == (key << 16)).flatten(), (piece_index, key)
                assert hits is not None  # found above at the first look at this piece
                position = int(hits[rank])
            found[i] = TrimThreshold(self.densities[i], self.ks[i], _value_of(key << 16), piece.start + position)
        return found

    def _impure_cuts(self, cuts: dict[int, list[tuple[int, int]]], values_of: ValuesOf) -> dict[int, TrimThreshold]:
        """The bucket's impure entries in position order (kept from the first look, or collected)."""
        found = {}
        for batch in self._batches(sorted(cuts)):
            if self._impure:  # every impure entry was kept (an impure cut means there are some)
                bits, positions = torch.cat([b for b, _ in self._impure]), torch.cat([p for _, p in self._impure])
            else:
                bits, positions = self._collect(batch, values_of)
            for bucket in batch:
                inside = torch.nonzero((bits >> 16) == bucket).flatten()
                ordered, order = torch.sort(bits[inside], descending=True, stable=True)
                at = positions[inside]
                for i, rank in cuts[bucket]:
                    found[i] = TrimThreshold(
                        self.densities[i], self.ks[i], _value_of(int(ordered[rank - 1])), int(at[order[rank - 1]])
                    )
        return found

    def _batches(self, buckets: list[int]) -> list[list[int]]:
        """Buckets grouped so that each group's impure entries, collected at once, stay under the cap."""
        batches: list[list[int]] = []
        total = _COLLECT_CAP + 1
        for bucket in buckets:
            size = int(self._hist[bucket | _IMPURE])
            if self._impure is None and total + size > _COLLECT_CAP:
                batches.append([])
                total = 0
            elif not batches:
                batches.append([])
            batches[-1].append(bucket)
            total += size
        return batches

    def _collect(self, buckets: list[int], values_of: ValuesOf) -> tuple[torch.Tensor, torch.Tensor]:
        """Bit patterns and positions of the impure entries of ``buckets``, in position order."""
        member = torch.zeros(_IMPURE, dtype=torch.bool, device=self._hist.device)
        member[torch.tensor(buckets, device=member.device)] = True
        pieces = sorted({int(j) for bucket in buckets for j in self._counts.of_key(bucket | _IMPURE)[0]})
        bits = [torch.zeros(0, dtype=torch.int32, device=member.device)]
        positions = [torch.zeros(0, dtype=torch.int64, device=member.device)]
        for j in pieces:
            piece = self.pieces[j]
            values = values_of(piece.run, piece.lo, piece.hi).view(torch.int32)
            inside = torch.nonzero(member.index_select(0, values >> 16) & ((values & 0xFFFF) != 0)).flatten()
            bits.append(values[inside])
            positions.append(inside + piece.start)
        return torch.cat(bits), torch.cat(positions)


def _sparse_counts(keys: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted distinct keys and their counts: by sorting when there are few, else by one histogram."""
    if keys.numel() * 16 < bins:
        return torch.unique(keys, sorted=True, return_counts=True)
    counts = torch.bincount(keys, minlength=bins)
    nonzero = torch.nonzero(counts).flatten()
    return nonzero, counts[nonzero]


def _value_of(bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.int32).view(torch.float32).item())


def _count_above_each(hist: torch.Tensor) -> torch.Tensor:
    """``out[d]`` = number of entries whose digit is greater than ``d``."""
    return hist.flip(0).cumsum(0).flip(0) - hist


def _digit_of_kth(hist: torch.Tensor, ks: Sequence[int]) -> list[int]:
    """For each k, the digit holding the k-th largest entry."""
    at_least = hist.flip(0).cumsum(0)  # at_least[j] = #entries with digit >= len(hist) - 1 - j
    first = torch.searchsorted(at_least, torch.tensor(ks, dtype=at_least.dtype, device=at_least.device), side="left")
    return [hist.numel() - 1 - int(j) for j in first]


def trim_thresholds(abs_flat: torch.Tensor, densities: Sequence[float]) -> list[TrimThreshold]:
    """Thresholds for each density of one tensor's |Δ| (1-D, non-negative, finite fp32, row-major)."""
    if abs_flat.dtype != torch.float32 or abs_flat.dim() != 1:
        raise ValueError("trim_thresholds expects a 1-D float32 tensor of |delta|")
    values = abs_flat.contiguous()
    selector = ThresholdSelector(values.numel(), densities)
    selector.add(0, values)
    return selector.thresholds(lambda run, lo, hi: values[lo:hi])


def zero_thresholds(numel: int) -> dict[float, TrimThreshold]:
    """Thresholds of an all-zero |Δ|: tau 0, the first k entries kept (as ``trim_thresholds`` gives)."""
    if numel == 0:
        return {t.density: t for t in trim_thresholds(torch.zeros(0), DENSITY_GRID)}
    return {d: TrimThreshold(float(d), kept_count(d, numel), 0.0, kept_count(d, numel) - 1) for d in DENSITY_GRID}


TensorResult = tuple[list[BlockDelta], TensorStats]


def from_hashes(t: TensorRecord, blocks: list[BlockRecord], flags: list[bool]) -> TensorResult:
    """The result of a tensor that needs no bytes."""
    mergeable = t.dtype in MERGEABLE_DTYPES
    deltas = [
        BlockDelta(t.name, b.index, 0.0, 0.0, 0, True) if same else BlockDelta(t.name, b.index, None, None, None, False)
        for b, same in zip(blocks, flags)
    ]
    thresholds = zero_thresholds(t.numel) if mergeable else {}
    return deltas, TensorStats(t.name, t.numel, mergeable, all(flags), thresholds)


# Below 2**24 a sum of signs (0 or 1 each) counts non-zeros exactly in fp32, and faster than count_nonzero.
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
    """Per-block (‖Δ‖₂, max|Δ|, nnz) of a flat |Δ| cut into runs of ``sizes`` elements, all equal but the last."""
    first = sizes[0]
    if any(s != first for s in sizes[:-1]):
        raise ValueError(f"blocks of {sizes} entries: all but the last must be equal")
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
    """Named buffers reused from window to window (never more than a window each)."""

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
        """``|fp32(E) − fp32(B)|`` into ``out``; ``base_raw`` None: the expert's bytes are Δ (a delta checkpoint)."""
        out.copy_(expert_raw.reshape(-1))
        if base_raw is not None:
            base = self.buffer("scratch", out.numel())
            base.copy_(base_raw.reshape(-1))
            out.sub_(base)
        return out.abs_()


#: ``values(a, b)``: fp32 |Δ| of blocks ``a .. b-1`` (a run of changed blocks), 1-D.
BlockValues = Callable[[int, int], torch.Tensor]


class TensorPass:
    """Block statistics and trim thresholds of one (expert, tensor) from its |Δ|."""

    def __init__(self, t: TensorRecord, blocks: Sequence[BlockRecord], who: str, workspace: Workspace) -> None:
        itemsize = t.nbytes // t.numel if t.numel else 1
        self.t, self.blocks, self.who, self.workspace = t, list(blocks), who, workspace
        self.sizes = [(b.end - b.begin) // itemsize for b in self.blocks]
        self.starts = list(itertools.accumulate(self.sizes, initial=0))  # flat start of each block, then n
        self.deltas: list[BlockDelta | None] = [None] * len(self.blocks)
        self.selector = ThresholdSelector(t.numel, DENSITY_GRID)
        self._runs: list[tuple[int, int]] = []  # the block range of each run given to the selector

    def add(self, lo: int, flags: Sequence[bool], values: BlockValues) -> None:
        """Blocks ``lo .. lo+len(flags)-1`` with their unchanged flags."""
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
        """The tensor's rows, once every block was added."""

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


def span_result(
    target: LoraTarget, view: memoryview, t: TensorRecord, blocks: Sequence[BlockRecord], who: str
) -> TensorResult:
    """Per-block statistics and trim thresholds of ΔW (this tensor only, in fp32), recorded as changed."""
    a32, b32 = (
        to_float32(view[f.begin - t.begin : f.end - t.begin], f.dtype, tuple(f.shape)) for f in (target.a, target.b)
    )
    flat = delta_rows(b32, a32, target.scale, target.transposed).abs_().reshape(-1)
    if target.transposed:  # row i of ΔW is column i of A (times B)
        flags = [bool((a32[:, b.row_start : b.row_end] == 0).all()) for b in blocks]
    else:
        flags = [bool((b32[b.row_start : b.row_end] == 0).all()) for b in blocks]
    row = 4 * target.shape[1]  # TensorPass sizes blocks by bytes: ΔW as the F32 tensor it is
    as_f32 = TensorRecord(t.name, t.file, "F32", t.shape, 0, target.shape[0] * row, t.ordinal)
    f32_blocks = [
        BlockRecord(t.name, b.index, b.row_start, b.row_end, b.row_start * row, b.row_end * row, b.hash) for b in blocks
    ]
    work = TensorPass(as_f32, f32_blocks, who, Workspace())

    def values(a: int, b: int) -> torch.Tensor:
        return flat[work.starts[a] : work.starts[b]]

    work.add(0, flags, values)
    deltas, stats = work.result(values)
    return deltas, dataclasses.replace(stats, identical=False)
