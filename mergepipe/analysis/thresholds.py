"""Exact magnitude-trim thresholds, computed once per tensor in O(n), and
the keep mask that applies one to a block (the contract is in
``spec/thresholds.py``).

Why a radix select instead of ``torch.sort``/``topk``: for non-negative fp32
values the raw bit pattern, read as an int32, orders exactly like the value.
Two histogram passes over 16-bit digits find the k-th largest value for every
density of the grid at once in O(n), where a sort is O(n log n) and a
``topk`` per density repeats the work for every density.

Everything runs on the device of the input (CPU or CUDA).
"""

from __future__ import annotations

from typing import Sequence

import torch

from mergepipe.spec.thresholds import TrimThreshold, kept_count

_DIGIT = 1 << 16


#: Below this many entries a stable sort is cheaper than two 65536-bin
#: histograms, and gives the same answer.
SORT_BELOW = 1 << 16


def trim_thresholds(abs_flat: torch.Tensor, densities: Sequence[float]) -> list[TrimThreshold]:
    """Thresholds for each density, for the fp32 |delta| of one tensor.

    ``abs_flat`` must be a 1-D, non-negative, finite fp32 tensor in row-major
    order (the caller rejects NaN/Inf with a proper error first).
    """
    if abs_flat.dtype != torch.float32 or abs_flat.dim() != 1:
        raise ValueError("trim_thresholds expects a 1-D float32 tensor of |delta|")
    n = abs_flat.numel()
    if n == 0:
        return [TrimThreshold(float(d), 0, float("inf"), -1) for d in densities]
    ks = [kept_count(d, n) for d in densities]
    if n < SORT_BELOW:
        # the k-th entry of a stable descending sort is tau, and its
        # position is p: ties are ordered by position
        values, order = torch.sort(abs_flat, descending=True, stable=True)
        return [
            TrimThreshold(float(d), k, float(values[k - 1]), int(order[k - 1]))
            for d, k in zip(densities, ks)
        ]
    bits = abs_flat.contiguous().view(torch.int32)
    nonzeros = n - int((bits == 0).sum())
    results: dict[int, TrimThreshold] = {}
    # A cut below every non-zero entry falls on the exact zeros that bf16
    # rounding leaves in most deltas: tau = 0, and p is found from the
    # positions of the (fewer) non-zeros without touching the zeros.
    zero_cuts = [i for i, k in enumerate(ks) if k > nonzeros]
    if zero_cuts:
        zeros = _TrueFinder(bits == 0)
        for i in zero_cuts:
            rank = ks[i] - nonzeros - 1  # 0-based rank among the zeros, in position order
            results[i] = TrimThreshold(float(densities[i]), ks[i], 0.0, zeros.position(rank))
    cuts = [i for i in range(len(ks)) if i not in results]
    if cuts:
        for i, thr in zip(cuts, _radix_thresholds(bits, [densities[i] for i in cuts], [ks[i] for i in cuts])):
            results[i] = thr
    return [results[i] for i in range(len(ks))]


def _radix_thresholds(bits: torch.Tensor, densities: Sequence[float], ks: Sequence[int]) -> list[TrimThreshold]:
    """Two 16-bit digit passes: the high digit by a full histogram, the low
    one only among the entries of the buckets that hold a k-th largest."""
    high = bits >> 16
    high_hist = torch.bincount(high, minlength=_DIGIT)
    buckets = _digit_of_kth(high_hist, ks)
    above_high = _count_above_each(high_hist)

    # One pass selects every entry in a needed bucket; the rest works on them.
    device = bits.device
    wanted = torch.zeros(_DIGIT, dtype=torch.bool, device=device)
    wanted[torch.tensor(sorted(set(buckets)), device=device)] = True
    sel_index = torch.nonzero(wanted[high]).flatten()
    sel_bits = bits[sel_index]
    sel_high = sel_bits >> 16

    # Densities often share a bucket (all those whose cut falls on the many
    # exact zeros of a sparse delta): work per bucket and per tau once.
    per_bucket: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    equal_at: dict[int, torch.Tensor] = {}
    results = []
    for density, k, h in zip(densities, ks, buckets):
        if h not in per_bucket:
            in_bucket = sel_high == h
            bucket_bits = sel_bits[in_bucket]
            low_hist = torch.bincount(bucket_bits & 0xFFFF, minlength=_DIGIT)
            per_bucket[h] = (bucket_bits, sel_index[in_bucket], low_hist, _count_above_each(low_hist))
        bucket_bits, bucket_index, low_hist, above_low = per_bucket[h]
        rank = k - int(above_high[h])  # rank of the k-th largest inside the bucket
        (low,) = _digit_of_kth(low_hist, [rank])
        tau_bits = (h << 16) | low
        if tau_bits not in equal_at:
            equal_at[tau_bits] = bucket_index[bucket_bits == tau_bits]
        count_above = int(above_high[h]) + int(above_low[low])
        tau = torch.tensor([tau_bits], dtype=torch.int32).view(torch.float32).item()  # host scalar
        results.append(TrimThreshold(float(density), k, float(tau), int(equal_at[tau_bits][k - count_above - 1])))
    return results


#: Chunk of a mask scanned at once when looking for its r-th True entry.
_SCAN_CHUNK = 1 << 16


class _TrueFinder:
    """Finds the r-th True of a 1-D bool mask with O(n / chunk) extra memory:
    True counts per chunk once, then one chunk per query."""

    def __init__(self, mask: torch.Tensor) -> None:
        n = mask.numel()
        full = n - n % _SCAN_CHUNK
        if full:
            counts = mask[:full].view(-1, _SCAN_CHUNK).sum(1)
        else:
            counts = torch.zeros(0, dtype=torch.int64, device=mask.device)
        if full < n:
            counts = torch.cat([counts, mask[full:].sum().view(1)])
        self.mask = mask
        self.before = counts.cumsum(0)  # Trues up to the end of each chunk

    def position(self, rank: int) -> int:
        """Index of the ``rank``-th (0-based) True."""
        chunk = int(torch.searchsorted(self.before, torch.tensor([rank], device=self.before.device), right=True)[0])
        skipped = int(self.before[chunk - 1]) if chunk else 0
        start = chunk * _SCAN_CHUNK
        inside = torch.nonzero(self.mask[start : start + _SCAN_CHUNK]).flatten()
        return start + int(inside[rank - skipped])


def _count_above_each(hist: torch.Tensor) -> torch.Tensor:
    """``out[d]`` = number of entries whose digit is greater than ``d``."""
    return hist.flip(0).cumsum(0).flip(0) - hist


def _digit_of_kth(hist: torch.Tensor, ks: Sequence[int]) -> list[int]:
    """For each k, the digit holding the k-th largest entry: the largest d
    with (#entries with digit >= d) >= k, found by one binary search."""
    at_least = hist.flip(0).cumsum(0)  # at_least[j] = #entries with digit >= 65535 - j
    first = torch.searchsorted(at_least, torch.tensor(ks, dtype=at_least.dtype, device=at_least.device), side="left")
    return [_DIGIT - 1 - int(j) for j in first]


def keep_mask(abs_block: torch.Tensor, flat_start: int, thr: TrimThreshold) -> torch.Tensor:
    """Which entries of a block a trim keeps; ``flat_start`` is the block's
    first element's flat index in its tensor."""
    above = abs_block > thr.tau
    n = abs_block.numel()
    if thr.last_index < flat_start:
        return above
    if thr.last_index >= flat_start + n - 1:
        return above | (abs_block == thr.tau)
    index = torch.arange(flat_start, flat_start + n, dtype=torch.int64, device=abs_block.device).view(abs_block.shape)
    return above | ((abs_block == thr.tau) & (index <= thr.last_index))
