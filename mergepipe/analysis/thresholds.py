"""Exact magnitude-trim thresholds of a tensor held in memory, and the keep
mask that applies one to a block (the contract is in ``spec/trim.py``).

``trim_thresholds`` is the selector of ``topk.py`` fed one window: the whole
tensor. Analysis feeds the same selector window by window instead
(``stats.TensorPass``), so both give the same (τ, p) bit for bit; the engine
calls this for densities off the catalog's grid. Everything runs on the
device of the input (CPU or CUDA).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from mergepipe.analysis.topk import PIECE, SORT_BELOW, ThresholdSelector
from mergepipe.spec.trim import TrimThreshold

__all__ = ["PIECE", "SORT_BELOW", "keep_mask", "trim_thresholds", "trimmed"]


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


def trimmed(block: torch.Tensor, flat_start: int, thr: TrimThreshold, in_place: bool = False) -> torch.Tensor:
    """``block`` (a delta block) with the entries ``keep_mask`` drops set to 0
    (written into ``block`` itself with ``in_place``).

    Why not ``block * keep_mask(...)``: on each side of the tie index p the
    keep rule is ``|d| > t`` for one t (``tau`` after p; before it the fp32
    value just below tau, as every tie there is kept), which ``hardshrink``
    applies in one vectorised pass; the mask path costs five passes with
    bool tensors, several times slower on CPU. The kept values are the same
    (NaN and Inf are kept too); a dropped entry is +0.0 rather than a signed zero.
    """
    below_tau = float(np.nextafter(np.float32(thr.tau), np.float32(-np.inf)))  # |d| > below ⇔ |d| >= tau
    keep_ties = min(max(thr.last_index - flat_start + 1, 0), block.numel())  # entries [0, keep_ties) keep ties
    if keep_ties in (0, block.numel()):
        return torch.hardshrink(block, below_tau if keep_ties else thr.tau, out=block if in_place else None)
    flat = block.reshape(-1)
    out = flat if in_place and block.is_contiguous() else torch.empty_like(flat)  # flat: a view of block then
    torch.hardshrink(flat[:keep_ties], below_tau, out=out[:keep_ties])
    torch.hardshrink(flat[keep_ties:], thr.tau, out=out[keep_ties:])
    return out.view(block.shape)
