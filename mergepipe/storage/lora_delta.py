"""ΔW of a LoRA target by row blocks, and the exact factor bytes each block costs.

ΔW is computed in fp32 from the factors' stored dtype (F32, F16, BF16 widen
exactly), as PEFT merges: the product B·A, transposed for embeddings and
``fan_in_fan_out`` modules, then times the scale s (``storage/lora.py`` says
which tensors are targets and ``storage/lora_config.py`` how s is chosen). The
product is a fixed sum of rank-1 terms, not a GEMM, so that its bits depend on
neither the block split nor the CPU (``delta_rows``).

**What a row block costs.** A block of the base tensor is a run of rows
[r0, r1). Without transposition, row i of ΔW = s·B[i]·A: the block needs
rows [r0, r1) of B (one contiguous range) and all of A. Transposed, row i of
ΔW = s·(B·A[:, i])ᵀ: the block needs columns [r0, r1) of A, which in A's
row-major (r, n) layout are r separate runs of (r1 − r0) elements, one per
rank row, and all of B. ``factor_ranges`` lists exactly those byte ranges
(adjacent runs merged): they are what the budget counts. A replacement
costs its own rows, one contiguous range.

Every read goes through a ``RangeSource``, so its counters show what a block
really cost; ``read_factors`` reads exactly ``factor_ranges``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mergepipe.storage.writer import to_float32
from mergepipe.storage.lora import ByteRange, LoraTarget, SavedTensor, check_rows
from mergepipe.storage.source import RangeSource

Runs = list[tuple[int, int]]


def _a_column_runs(target: LoraTarget, row_start: int, row_end: int) -> Runs:
    """Columns [row_start, row_end) of A: one byte run per rank row (merged when adjacent)."""
    a = target.a
    item, width = a.itemsize, a.row_bytes
    runs = [(a.begin + k * width + row_start * item, a.begin + k * width + row_end * item) for k in range(target.rank)]
    return _merge_runs(runs)


def _merge_runs(runs: Runs) -> Runs:
    merged: list[tuple[int, int]] = []
    for begin, end in sorted(r for r in runs if r[1] > r[0]):
        if merged and merged[-1][1] == begin:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((begin, end))
    return merged


def _factor_runs(target: LoraTarget, row_start: int, row_end: int) -> tuple[Runs, Runs]:
    """(B's runs, A's runs) that rows [row_start, row_end) of ΔW need (see the module docstring)."""
    check_rows(target.tensor, target.shape[0], row_start, row_end)
    a, b = target.a, target.b
    if row_start == row_end:
        return [], []
    if target.transposed:
        return [(b.begin, b.end)], _a_column_runs(target, row_start, row_end)
    return [(b.begin + row_start * b.row_bytes, b.begin + row_end * b.row_bytes)], [(a.begin, a.end)]


def factor_ranges(target: LoraTarget, row_start: int, row_end: int) -> list[ByteRange]:
    """The factor bytes rows [row_start, row_end) of ΔW need, in file order, adjacent ranges merged."""
    b_runs, a_runs = _factor_runs(target, row_start, row_end)
    return [(target.path, begin, end) for begin, end in _merge_runs(b_runs + a_runs)]


def _read_runs(source: RangeSource, path: Path, runs: Runs, tag: str | None) -> bytearray:
    buf = bytearray(sum(end - begin for begin, end in runs))
    view, at = memoryview(buf), 0
    for begin, end in runs:
        source.read(path, begin, end, out=view[at : at + end - begin], tag=tag)
        at += end - begin
    return buf


def read_factors(
    target: LoraTarget, row_start: int, row_end: int, source: RangeSource, tag: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 factor parts rows [row_start, row_end) need, reading exactly ``factor_ranges``.

    Returns ``(B[row_start:row_end], A)``, or ``(B, A[:, row_start:row_end])``
    when transposed: the arguments of ``delta_rows``.
    """
    b_runs, a_runs = _factor_runs(target, row_start, row_end)
    n, a, b = row_end - row_start, target.a, target.b
    b_shape = b.shape if target.transposed else (n, target.rank)
    a_shape = (target.rank, n) if target.transposed else a.shape
    b_part = to_float32(_read_runs(source, target.path, b_runs, tag), b.dtype, b_shape)
    a_part = to_float32(_read_runs(source, target.path, a_runs, tag), a.dtype, a_shape)
    return b_part, a_part


#: Rows of ΔW summed at a time, by elements: a piece and its rank-1 term stay in a core's cache.
PIECE_ELEMENTS = 1 << 18


def delta_rows(b: torch.Tensor, a: torch.Tensor, scale: float, transposed: bool) -> torch.Tensor:
    """fp32 ΔW for a run of n rows: ``(L·R)·s`` with L (n, r) and R (r, m) the factors in the rows' orientation.

    Not transposed: ``b`` is B's n rows (n, r), ``a`` all of A (r, in); L = b, R = a. Transposed: ``b`` is all
    of B (out, r), ``a`` A's n columns (r, n); ΔW = (b·a)ᵀ·s, so L = aᵀ and R = bᵀ.

    The product is the sum of its r rank-1 terms, each entry ``L[i,k]·R[k,j]`` rounded to fp32 and added in
    order k = 0, 1, …, r−1 (no fused multiply-add), then scaled. Not ``b @ a``: a BLAS chooses its kernel (FMA
    or not, the order of the k sums) by the matrices' shapes and the CPU, so the same rows computed within a
    block of another size, or on another machine, differed in the last bit (MKL on AVX-512: A's columns of a
    block against the whole product). ΔW must depend on neither: analysis takes exact trim thresholds from the
    whole tensor's values and a merge computes them block by block, a full budget must give the bits of a
    full read, and a snapshot id must not name the CPU. The price is r passes over ΔW (0.6 ms for a
    512K-entry block at r = 8 on one core, 4.5 ms at r = 64) where a GEMM takes 0.3-0.7 ms; PEFT's own
    ``merge_and_unload`` (a GEMM) agrees to within r roundings.
    """
    left, right = (a.float().T, b.float().T) if transposed else (b.float(), a.float())
    n, rank = left.shape
    out = torch.empty((n, right.shape[1]), dtype=torch.float32)
    step = max(1, PIECE_ELEMENTS // max(1, right.shape[1]))
    term = torch.empty((min(step, n), right.shape[1]), dtype=torch.float32)
    for start in range(0, n, step):
        end = min(start + step, n)
        piece, scratch = out[start:end], term[: end - start]
        torch.mul(left[start:end, :1], right[:1], out=piece)
        for k in range(1, rank):
            piece.add_(torch.mul(left[start:end, k : k + 1], right[k : k + 1], out=scratch))
    return out.mul_(scale)


def delta_block(
    target: LoraTarget, row_start: int, row_end: int, source: RangeSource, tag: str | None = None
) -> torch.Tensor:
    """fp32 ΔW rows [row_start, row_end), reading only their factor bytes."""
    b_part, a_part = read_factors(target, row_start, row_end, source, tag)
    return delta_rows(b_part, a_part, target.scale, target.transposed)


def delta_tensor(target: LoraTarget, source: RangeSource, tag: str | None = None) -> torch.Tensor:
    """The whole fp32 ΔW of ``target`` (reads every factor byte once)."""
    return delta_block(target, 0, target.shape[0], source, tag)


def saved_rows(
    saved: SavedTensor, row_start: int, row_end: int, source: RangeSource, tag: str | None = None
) -> torch.Tensor:
    """Rows [row_start, row_end) of a replacement tensor, as fp32 (exact for F16/BF16)."""
    path, begin, end = saved.byte_range(row_start, row_end)
    entry = saved.entry
    shape = entry.shape if len(entry.shape) < 2 else (row_end - row_start, *entry.shape[1:])
    return to_float32(source.read(path, begin, end, tag=tag), entry.dtype, shape)
