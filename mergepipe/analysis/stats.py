"""Delta statistics of one tensor, from its bytes or from its block hashes alone.

Per block of Δ = E − B (fp32): ‖Δ‖₂, max|Δ|, non-zeros and whether the block
is byte-identical to the base; per tensor: the exact trim thresholds at every
density of ``DENSITY_GRID``. Blocks are equal-sized row ranges, so per-block
sums are one reshape and a few vectorised torch ops over the whole tensor.

A tensor whose result follows from hashes (every block identical, or a
non-mergeable dtype, of which only the identical flags are kept) needs no
bytes: ``from_hashes``. A NaN or Inf in a delta is refused: thresholds and
error bounds would be meaningless.
"""

from __future__ import annotations

import math

import torch

from mergepipe.analysis.thresholds import trim_thresholds
from mergepipe.catalog.records import BlockDelta, BlockRecord, TensorRecord, TensorStats
from mergepipe.errors import CatalogError
from mergepipe.spec.thresholds import DENSITY_GRID, TrimThreshold, kept_count
from mergepipe.storage.convert import MERGEABLE_DTYPES


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


# Counts up to 2**24 are exact in fp32, so below it the (faster) fp32 L0 norm
# counts non-zeros exactly; larger blocks use the integer count.
_EXACT_FP32_COUNT = 1 << 24


def _count_nonzero(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    per_row = x.shape[-1] if dim is not None else x.numel()
    if per_row < _EXACT_FP32_COUNT:
        return torch.linalg.vector_norm(x, ord=0, dim=dim).to(torch.int64)
    return torch.count_nonzero(x, dim=dim)


def block_stats(abs_delta: torch.Tensor, sizes: list[int]) -> tuple[list[float], list[float], list[int]]:
    """Per-block (‖Δ‖₂, max|Δ|, nnz) of a flat |Δ| cut into consecutive runs
    of ``sizes`` elements: all equal but the last, so one reshape covers the
    full blocks and one more op the tail."""
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
        nnz = _count_nonzero(head, dim=1).tolist()
    elif full:
        l2, mx, nnz = [0.0] * full, [0.0] * full, [0] * full
    if full < len(sizes):
        tail = abs_delta[full * first :]
        l2.append(float(torch.linalg.vector_norm(tail)))
        mx.append(float(tail.max()) if tail.numel() else 0.0)
        nnz.append(int(_count_nonzero(tail)))
    return l2, mx, nnz


class DeltaWorkspace:
    """A reusable fp32 buffer for |Δ|, grown to the largest tensor seen: from an expert and its base,
    or from a delta checkpoint's values."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.float32)

    def abs_delta(self, expert_raw: torch.Tensor, base32: torch.Tensor) -> torch.Tensor:
        n = base32.numel()
        if self._buf.numel() < n:
            self._buf = torch.empty(n, dtype=torch.float32)
        out = self._buf[:n].view(base32.shape)
        # bf16/f16 -> fp32 is exact, so E − B here equals e.float() − b.float().
        torch.sub(expert_raw, base32, out=out)
        return out.abs_().view(-1)

    def abs_values(self, delta_raw: torch.Tensor) -> torch.Tensor:
        """``|Δ|`` in fp32 of a delta checkpoint's tensor (its bytes are Δ: no base)."""
        n = delta_raw.numel()
        if self._buf.numel() < n:
            self._buf = torch.empty(n, dtype=torch.float32)
        out = self._buf[:n].view(delta_raw.shape)
        out.copy_(delta_raw)  # exact widening of F16/BF16
        return out.abs_().view(-1)


def from_delta(
    t: TensorRecord, blocks: list[BlockRecord], flags: list[bool], abs_delta: torch.Tensor, who: str
) -> TensorResult:
    """The result of a mergeable tensor from its flat fp32 |Δ| (``who`` names
    the (expert, base) pair in the NaN/Inf error)."""
    itemsize = t.nbytes // t.numel if t.numel else 1
    sizes = [(b.end - b.begin) // itemsize for b in blocks]
    l2, mx, nnz = block_stats(abs_delta, sizes)
    if not all(map(math.isfinite, mx)):
        raise CatalogError(
            f"cannot analyse {who}: tensor '{t.name}' has a NaN or infinite delta; "
            "check both checkpoints for NaN/Inf weights"
        )
    deltas = [
        BlockDelta(t.name, b.index, 0.0, 0.0, 0, True)
        if same
        else BlockDelta(t.name, b.index, l2[i], mx[i], nnz[i], False)
        for i, (b, same) in enumerate(zip(blocks, flags))
    ]
    thresholds = {x.density: x for x in trim_thresholds(abs_delta, DENSITY_GRID)}
    return deltas, TensorStats(t.name, t.numel, True, False, thresholds)
