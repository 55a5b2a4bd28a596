"""Sketch stages of a delta: dense ternary approximations, 1.6 bits per element each.

Full fine-tunes (Adam, bf16 checkpoints) change most entries of every tensor
by similar, small amounts: the largest entries hold little of what the
fine-tune learned, and a budget spent on them loses quality (measured in
BENCHMARKS.md). A coarse value for *every* entry keeps far more. Stage s
approximates the residual ``R`` the stages before it left (``R = Δ`` for the
first) row by row:

    m     = mean |R| over the row's non-zero entries
    keep  = |R| > m / 2
    scale = mean |R| over ``keep``               (fp32)
    q     = sign(R) where ``keep``, else 0        (-1, 0, 1)
    S_s   = q * scale

and the engine's reconstruction is ``Σ_s q_s * scale_s``, added in stage
order in fp32 — the residual after stage s is ``Δ`` minus exactly that. Three
stages bring ‖R‖/‖Δ‖ to about 0.13 on the quality benchmark's experts.

Row sums run in float64 over a group of rows at a time (bounded memory: a
group holds about ``GROUP_ELEMENTS`` elements), so the scales do not depend
on how torch splits a reduction across threads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mergepipe.storage.delta_encoding import encode_stage

#: Stages written per tensor.
STAGES = 3
#: Elements per group of rows (a multiple of 5 elements, so packed stages concatenate).
GROUP_ELEMENTS = 4 * 1024 * 1024


@dataclass(frozen=True)
class SketchStage:
    """One stage of a tensor: its payload and what is left after it."""

    payload: bytes
    residual: float  # ||Δ - Σ_{s' <= s} S_s'||², float64
    norm: float  # ||Σ_{s' <= s} S_s'||, float64


def rows_of(shape: tuple[int, ...]) -> int:
    """Rows of a tensor as blocks count them: the first dimension; 0-d and 1-D tensors are one row."""
    return shape[0] if len(shape) >= 2 else 1


class Sketcher:
    """The stages of one tensor's delta, fed a run of whole rows at a time.

    Why a class: a store build streams a large tensor (``deltastore.py``), so the delta is never whole in
    memory; the sketcher keeps at most one group of rows plus the run fed last. The groups are the same
    whatever the runs, so the payloads are the same bytes as from the whole delta.
    """

    def __init__(self, shape: tuple[int, ...], stages: int = STAGES) -> None:
        self.rows = rows_of(shape)
        self.cols = math.prod(shape) // self.rows if self.rows else 0
        self.step = max(5, GROUP_ELEMENTS // max(self.cols, 1) // 5 * 5)
        self.stages = stages
        self._scales = [np.zeros(self.rows, dtype=np.float32) for _ in range(stages)]
        self._packed: list[list[bytes]] = [[] for _ in range(stages)]
        self._residual = [0.0] * stages
        self._norm2 = [0.0] * stages
        self._pending: list[torch.Tensor] = []  # rows fed and not yet sketched, in order
        self._done = 0  # rows sketched

    def add(self, rows: torch.Tensor) -> None:
        """Feed the next rows of the delta (fp32; flat or ``[n, cols]``)."""
        self._pending.append(rows.reshape(-1, self.cols))
        while sum(len(p) for p in self._pending) >= self.step:
            self._group(self._take(self.step))

    def finish(self) -> list[SketchStage]:
        """The stages, once every row has been fed."""
        left = sum(len(p) for p in self._pending)
        if left:
            self._group(self._take(left))
        if self._done != self.rows:
            raise ValueError(f"sketch fed {self._done} of {self.rows} rows")
        return [
            SketchStage(self._scales[s].astype("<f4").tobytes() + b"".join(self._packed[s]), self._residual[s],
                        math.sqrt(self._norm2[s]))
            for s in range(self.stages)
        ]

    def _take(self, count: int) -> torch.Tensor:
        """The first ``count`` pending rows (a view when one run holds them)."""
        pieces, taken = [], 0
        while taken < count:
            run = self._pending[0]
            piece = run[: count - taken]
            pieces.append(piece)
            taken += len(piece)
            if len(piece) == len(run):
                self._pending.pop(0)
            else:
                self._pending[0] = run[len(piece):]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _group(self, group: torch.Tensor) -> None:
        start = self._done
        approx = torch.zeros_like(group)
        rest = group  # group - approx: what the stages so far left (x - 0 is x, bit for bit)
        for s in range(self.stages):
            q, scale = _stage(rest)
            approx = approx + q.to(torch.float32) * scale[:, None]
            rest = group - approx
            self._scales[s][start : start + len(group)] = scale.numpy()
            self._packed[s].append(encode_stage(q.numpy(), np.zeros(0, dtype=np.float32)))
            self._residual[s] += float(torch.sum(torch.square(rest.double())))
            self._norm2[s] += float(torch.sum(torch.square(approx.double())))
        self._done += len(group)


def _stage(residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8, fp32 scale per row)`` of one stage for a group of rows."""
    magnitude = residual.abs().double()
    nonzero = (magnitude > 0).sum(dim=1)
    mean = magnitude.sum(dim=1) / nonzero.clamp(min=1)
    keep = magnitude > (mean / 2)[:, None]
    kept = keep.sum(dim=1)
    scale = (torch.where(keep, magnitude, 0.0).sum(dim=1) / kept.clamp(min=1)).to(torch.float32)
    q = (torch.sign(residual) * keep).to(torch.int8)
    return q, scale
