"""Exact magnitude-trim thresholds, computed once per tensor in O(n).

TIES-style trimming keeps, per expert and tensor, exactly
``k = max(1, int(density * n))`` entries of largest |delta|, ties broken by
position (what a stable descending sort keeps). To apply that to one block
without the whole tensor, the catalog stores for each density

* ``tau``        the k-th largest |delta| (an fp32 value), and
* ``last_index`` p, the flat row-major index of the last entry equal to tau
                 that is still kept,

so entry j is kept iff ``|d_j| > tau or (|d_j| == tau and j <= p)``.

Why a radix select instead of ``torch.sort``/``topk``: for non-negative fp32
values the raw bit pattern, read as an int32, orders exactly like the value.
Two histogram passes over 16-bit digits find the k-th largest value for every
density of the grid at once in O(n), where a sort is O(n log n) and a
``topk`` per density repeats the work for every density.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

#: Densities analysed per (expert, tensor). Covers the values people use for
#: TIES/DARE/breadcrumbs; an off-grid density falls back to a tensor-level
#: computation in the engine.
DENSITY_GRID: tuple[float, ...] = (
    0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9,
)

_DIGIT = 1 << 16


@dataclass(frozen=True)
class TrimThreshold:
    """Where to cut |delta| of one tensor to keep the top ``k`` entries."""

    density: float
    k: int
    tau: float
    last_index: int

    def to_json(self) -> dict:
        return {"density": self.density, "k": self.k, "tau": self.tau, "last_index": self.last_index}

    @classmethod
    def from_json(cls, data: dict) -> "TrimThreshold":
        return cls(
            density=float(data["density"]),
            k=int(data["k"]),
            tau=float(data["tau"]),
            last_index=int(data["last_index"]),
        )


def kept_count(density: float, n: int) -> int:
    """The number of entries a magnitude trim keeps: max(1, int(density * n))."""
    return 0 if n == 0 else max(1, int(density * n))


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
    bits = abs_flat.contiguous().view(torch.int32)
    high = bits >> 16
    high_hist = torch.bincount(high, minlength=_DIGIT)
    # above_high[h] = number of entries whose high digit is > h
    above_high = high_hist.flip(0).cumsum(0).flip(0) - high_hist

    ks = [kept_count(d, n) for d in densities]
    # bucket of the k-th largest: the h with above_high[h] < k <= above_high[h] + hist[h]
    buckets_list = [_exact_bucket(above_high, high_hist, k) for k in ks]

    # One pass selects every entry in any needed bucket, then low digits.
    wanted = torch.tensor(sorted(set(buckets_list)), dtype=high.dtype)
    in_wanted = torch.isin(high, wanted)
    sel_bits = bits[in_wanted]
    sel_high = sel_bits >> 16
    tau_bits: list[int] = []
    for k, h in zip(ks, buckets_list):
        low = sel_bits[sel_high == h] & 0xFFFF
        low_hist = torch.bincount(low, minlength=_DIGIT)
        above_low = low_hist.flip(0).cumsum(0).flip(0) - low_hist
        rank_in_bucket = k - int(above_high[h])
        # the low digit l with above_low[l] < rank <= above_low[l] + hist[l]
        candidates = torch.nonzero((above_low < rank_in_bucket) & (above_low + low_hist >= rank_in_bucket))
        tau_bits.append((h << 16) | int(candidates[0]))

    # One pass finds the positions of every entry equal to some tau.
    taus = torch.tensor(sorted(set(tau_bits)), dtype=torch.int32)
    equal_positions = torch.nonzero(torch.isin(bits, taus)).flatten()
    equal_bits = bits[equal_positions]
    results = []
    for density, k, tb in zip(densities, ks, tau_bits):
        count_above = _count_above(high_hist, above_high, sel_bits, sel_high, tb)
        need = k - count_above
        positions = equal_positions[equal_bits == tb]
        tau = torch.tensor([tb], dtype=torch.int32).view(torch.float32).item()
        results.append(TrimThreshold(float(density), k, float(tau), int(positions[need - 1])))
    return results


def _exact_bucket(above_high: torch.Tensor, high_hist: torch.Tensor, k: int) -> int:
    """The high digit holding the k-th largest entry."""
    mask = (above_high < k) & (above_high + high_hist >= k)
    return int(torch.nonzero(mask)[0])


def _count_above(
    high_hist: torch.Tensor,
    above_high: torch.Tensor,
    sel_bits: torch.Tensor,
    sel_high: torch.Tensor,
    tau_bits: int,
) -> int:
    """#entries with bits > tau_bits, from the histogram plus the selected bucket."""
    h = tau_bits >> 16
    in_bucket = sel_bits[sel_high == h]
    return int(above_high[h]) + int((in_bucket > tau_bits).sum())


def keep_mask(abs_block: torch.Tensor, flat_start: int, thr: TrimThreshold) -> torch.Tensor:
    """Which entries of a block a trim keeps; ``flat_start`` is the block's
    first element's flat index in its tensor."""
    above = abs_block > thr.tau
    n = abs_block.numel()
    if thr.last_index < flat_start:
        return above
    if thr.last_index >= flat_start + n - 1:
        return above | (abs_block == thr.tau)
    index = torch.arange(flat_start, flat_start + n, dtype=torch.int64).view(abs_block.shape)
    return above | ((abs_block == thr.tau) & (index <= thr.last_index))
