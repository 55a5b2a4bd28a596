"""Exact magnitude-trim thresholds of a tensor held in memory, and the keep
mask that applies one to a block (the contract is in ``spec/thresholds.py``).

``trim_thresholds`` is the selector of ``topk.py`` fed one window: the whole
tensor. Analysis feeds the same selector window by window instead
(``stats.TensorPass``), so both give the same (τ, p) bit for bit; the engine
calls this for densities off the catalog's grid. Everything runs on the
device of the input (CPU or CUDA).
"""

from __future__ import annotations

from typing import Sequence

import torch

from mergepipe.analysis.topk import PIECE, SORT_BELOW, ThresholdSelector
from mergepipe.spec.thresholds import TrimThreshold

__all__ = ["PIECE", "SORT_BELOW", "keep_mask", "trim_thresholds"]


def trim_thresholds(abs_flat: torch.Tensor, densities: Sequence[float]) -> list[TrimThreshold]:
    """Thresholds for each density, for the fp32 |delta| of one tensor.

    ``abs_flat`` must be a 1-D, non-negative, finite fp32 tensor in row-major
    order (the caller rejects NaN/Inf with a proper error first).
    """
    if abs_flat.dtype != torch.float32 or abs_flat.dim() != 1:
        raise ValueError("trim_thresholds expects a 1-D float32 tensor of |delta|")
    values = abs_flat.contiguous()
    selector = ThresholdSelector(values.numel(), densities)
    selector.add(0, values)
    return selector.thresholds(lambda run, lo, hi: values[lo:hi])


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
