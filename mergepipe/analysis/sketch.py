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

A stage is computed as written above (``_stage_as_defined``) only for a
residual holding NaN or ±inf. Otherwise ``_stage`` gives the same bits with
every elementwise pass in fp32, into buffers reused across stages and groups:
``|R| > m/2`` is ``|R| > t`` for t the largest fp32 not above m/2; the float64
row sums are of the very values the definition sums (an fp32 copy into a
float64 buffer); and ``q * scale`` is exact, so the first stage's ``0 + S``
is ``S``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

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
    whatever the runs, so the payloads are the same bytes as from the whole delta. ``buffers``: memory to
    work in, shared with other sketchers run one after the other.
    """

    def __init__(self, shape: tuple[int, ...], stages: int = STAGES, buffers: SketchBuffers | None = None) -> None:
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
        self._buffers = SketchBuffers() if buffers is None else buffers

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
        start, count = self._done, len(group)
        work = self._buffers.rows(count, self.cols)
        approx: torch.Tensor | None = None
        rest = group  # group - approx: what the stages so far left (x - 0 is x, bit for bit)
        for s in range(self.stages):
            q, scale, finite = _stage(rest, work)
            if approx is None and finite:  # 0 + q * scale is q * scale: a finite row's scale is 0 only where q is
                approx = torch.mul(q, scale[:, None], out=work.approx)
            elif approx is None:
                approx = work.approx.zero_().addcmul_(q, scale[:, None])
            else:
                approx.addcmul_(q, scale[:, None])  # q * scale is exact: the same rounding as approx + q * scale
            rest = torch.sub(group, approx, out=work.rest)
            self._scales[s][start : start + count] = scale.numpy()
            self._packed[s].append(encode_stage(q.numpy(), _NO_SCALES))
            self._residual[s] += _energy(rest, work.wide)
            self._norm2[s] += _energy(approx, work.wide)
        self._done += count


_NO_SCALES = np.zeros(0, dtype=np.float32)
_COUNT_EXACT = 1 << 24  # fp32 counts whole numbers exactly up to here


class _Scratch(NamedTuple):
    """The buffers a group's stages work in, ``[rows, cols]`` each, contiguous (as a new tensor of that shape
    would be: reductions over them give the same bits)."""

    magnitude: torch.Tensor  # fp32: |R|, then sign(R)
    keep: torch.Tensor  # fp32: 1 where kept, else 0
    rest: torch.Tensor  # fp32: the residual after the stage
    approx: torch.Tensor  # fp32: the approximation so far
    wide: torch.Tensor  # float64: what a float64 reduction reads


class SketchBuffers:
    """The memory of ``_Scratch``, reused from group to group and tensor to tensor: a store build sketches
    every tensor in one (fresh tensor-sized buffers would cost their page faults again each time)."""

    def __init__(self) -> None:
        self._flat: list[torch.Tensor] = []  # four fp32 buffers, then a float64 one, of one length

    def rows(self, count: int, cols: int) -> _Scratch:
        size = count * cols
        if not self._flat or len(self._flat[0]) < size:
            self._flat = [*(torch.empty(size, dtype=torch.float32) for _ in range(4)),
                          torch.empty(size, dtype=torch.float64)]
        magnitude, keep, rest, approx, wide = (t[:size].view(count, cols) for t in self._flat)
        return _Scratch(magnitude, keep, rest, approx, wide)

    def clear(self) -> None:
        """Free the memory (the next ``rows`` allocates again)."""
        self._flat = []


def _energy(values: torch.Tensor, wide: torch.Tensor) -> float:
    """``float(torch.sum(torch.square(values.double())))``, squared in ``wide`` instead of a new tensor."""
    return float(wide.copy_(values).square_().sum())


def _stage(residual: torch.Tensor, work: _Scratch) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(q int8, fp32 scale per row, finite)`` of one stage for a group of rows: ``_stage_as_defined``'s bits,
    in fp32 passes for a finite residual (module docstring); ``finite`` False where it was computed as defined."""
    magnitude = torch.abs(residual, out=work.magnitude)
    total = work.wide.copy_(magnitude).sum(dim=1)  # the definition's float64 row sums of |R|
    if not bool(torch.isfinite(total).all()):
        q, scale = _stage_as_defined(residual)
        return q, scale, False
    counts = torch.float32 if residual.shape[1] < _COUNT_EXACT else torch.float64
    nonzero = torch.sign(magnitude, out=work.keep).sum(dim=1, dtype=counts).double()
    half_mean = total / nonzero.clamp(min=1) / 2
    # 1 where |R| > m/2, else 0: |R| - t > 0 exactly when |R| > t (a difference of fp32 values is 0 only if equal)
    keep = torch.sub(magnitude, _round_down(half_mean)[:, None], out=work.keep).sign_().clamp_(min=0)
    kept = keep.sum(dim=1, dtype=counts).double()
    chosen = work.wide.copy_(magnitude.mul_(keep)).sum(dim=1)  # Σ |R| over the kept entries, float64
    scale = (chosen / kept.clamp(min=1)).to(torch.float32)
    q = torch.sign(residual, out=work.magnitude).mul_(keep).to(torch.int8)
    return q, scale, True


def _round_down(values: torch.Tensor) -> torch.Tensor:
    """The largest fp32 not above each float64 value (for v >= 0: fp32 x > v exactly when x > it)."""
    nearest = values.to(torch.float32)
    return torch.where(nearest.double() > values, torch.nextafter(nearest, torch.tensor(-math.inf)), nearest)


def _stage_as_defined(residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8, fp32 scale per row)`` of one stage for a group of rows, as the module docstring defines it."""
    magnitude = residual.abs().double()
    nonzero = (magnitude > 0).sum(dim=1)
    mean = magnitude.sum(dim=1) / nonzero.clamp(min=1)
    keep = magnitude > (mean / 2)[:, None]
    kept = keep.sum(dim=1)
    scale = (torch.where(keep, magnitude, 0.0).sum(dim=1) / kept.clamp(min=1)).to(torch.float32)
    q = (torch.sign(residual) * keep).to(torch.int8)
    return q, scale
