"""How long a merge takes here, learnt from this catalog's own history: ``a + b·expert_bytes + c·output_bytes``.

What is predicted is the engine's own wall time, from staging to commit: the
manifest's realized ``total`` (reading the base and the planned expert
blocks, merging, writing, publishing). The command's start-up (Python,
importing torch) is not in it.

Per machine and operator, the three coefficients are fitted to the merges
timed here (``catalog.records.Timing``) by least squares, shrunk toward a ``Prior`` that
needs no merge at all: the read rate analysis saw on this machine prices a
byte read (an expert's, and the base's, one per output byte), the kernel
probe (``engine/probe.py``) adds the merging of an expert byte, and a small
constant the staging and publishing. Each coefficient is its prior times
``e^δ`` (so it stays positive, and a prior twice too high is as easy to
correct as one twice too low); residuals are relative (timings vary in
proportion: a 0.2 s merge counts as much as a 20 s one); a ridge penalty on
δ says how far a prior is to be trusted against a merge: priors are off by
about ``spread`` (50%), merges by about ``NOISE`` (10%), so the penalty is
``(NOISE / spread)²`` per coefficient. One or two merges then move a
prediction most of the way to what they showed without turning the split
between the terms into nonsense; three and more decide it.

How uncertain a prediction is, relative: the root mean square of the fit's
relative residuals over the merges, pooled with the prior's spread counted as
one merge (``PRIOR_MERGES``): the prior's spread with no history, the
residuals' with a long one.

Pure Python and numpy: the planner, the engine and the command line share it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mergepipe.spec.plan import TERMS, Prediction

#: How far a merge's seconds stray from a perfect model, relative: timings of the same merge vary about this
#: much run to run (the page cache, other work on the machine).
NOISE = 0.1
#: How far a prior's coefficients may be off, relative: a read rate measured while analysing, and a kernel
#: timed alone, say what a merge costs to within about this.
PRIOR_SPREAD = 0.5
#: How much the prior's spread weighs in a prediction's uncertainty, in merges.
PRIOR_MERGES = 1.0
#: The fixed part of the prior: staging, opening the inputs, the manifest, the rename and the catalog commit
#: of a small merge.
PRIOR_FIXED_SECONDS = 0.1
#: The read rate of a machine analysis never ran on (a catalog analysed elsewhere): a cloud volume's or a
#: SATA disk's, with twice the spread.
UNMEASURED_READ_RATE = 200e6
#: Gauss-Newton steps of a fit at most (it converges in a few; each step moves a coefficient by a factor e at most).
MAX_STEPS = 50


class Timed(Protocol):
    """One past merge as the fit needs it (``catalog.records.Timing``): the expert bytes it read, the output
    bytes it wrote, the engine's seconds."""

    @property
    def expert_bytes(self) -> int: ...

    @property
    def output_bytes(self) -> int: ...

    @property
    def seconds(self) -> float: ...


@dataclass(frozen=True)
class Prior:
    """What a merge is expected to cost before any was timed here, and how far to trust it (relative)."""

    fixed_seconds: float
    seconds_per_expert_byte: float
    seconds_per_output_byte: float
    spread: float = PRIOR_SPREAD

    @classmethod
    def measured(
        cls, read_bytes_per_second: float | None, kernel_seconds_per_element: float | None, element_bytes: float
    ) -> Prior:
        """The prior of a machine whose analysis read at ``read_bytes_per_second`` (None: never analysed here)
        and whose operator's kernel took ``kernel_seconds_per_element`` per element and expert (None: never
        probed on this device) on elements of ``element_bytes`` bytes (the checkpoints' dtype).

        An expert byte costs its read and its share of the kernel; an output byte the read of the base byte it
        comes from (the output is written by a thread of its own, beside the merge)."""
        spread = PRIOR_SPREAD if read_bytes_per_second else 2 * PRIOR_SPREAD
        read = 1 / (read_bytes_per_second or UNMEASURED_READ_RATE)
        kernel = (kernel_seconds_per_element or 0.0) / element_bytes
        return cls(PRIOR_FIXED_SECONDS, read + kernel, read, spread)

    @property
    def coefficients(self) -> np.ndarray:
        return np.array([self.fixed_seconds, self.seconds_per_expert_byte, self.seconds_per_output_byte])


@dataclass(frozen=True)
class TimeModel:
    """``seconds ≈ a + b·expert_bytes + c·output_bytes`` for one machine and operator, and how uncertain."""

    coefficients: tuple[float, float, float]
    uncertainty: float  # relative, e.g. 0.35 for ±35%
    merges: int  # the merges it was fitted to (0: the prior alone)

    def terms(self, expert_bytes: int, output_bytes: int) -> dict[str, float]:
        """Seconds of each term (``TERMS``) of a merge of these bytes."""
        return dict(zip(TERMS, (c * x for c, x in zip(self.coefficients, (1, expert_bytes, output_bytes)))))

    def predict(self, machine: str, expert_bytes: int, output_bytes: int) -> Prediction:
        """The prediction for a merge of these bytes on ``machine``."""
        terms = self.terms(expert_bytes, output_bytes)
        return Prediction(machine, sum(terms.values()), self.uncertainty, self.merges, terms)

    def seconds(self, expert_bytes: int, output_bytes: int) -> float:
        return sum(self.terms(expert_bytes, output_bytes).values())

    def expert_bytes_within(self, seconds: float, output_bytes: int) -> float:
        """The most expert bytes a merge writing ``output_bytes`` may read and be predicted to take at most
        ``seconds``; negative when reading none already takes longer."""
        fixed, per_expert, per_output = self.coefficients
        left = seconds - fixed - per_output * output_bytes
        if left < 0:
            return -1.0
        return left / per_expert if per_expert > 0 else math.inf


def fit(prior: Prior, history: Sequence[Timed]) -> TimeModel:
    """The model of ``history`` (merges of one operator on one machine) shrunk toward ``prior`` (module
    docstring): each coefficient is ``prior × e^δ``, the δ minimising
    ``Σ ((seconds − predicted) / seconds)² + (NOISE / spread)² · Σ δ²`` by Gauss-Newton steps, each one linear
    least squares."""
    rows = [t for t in history if t.seconds > 0]
    if not rows:
        return TimeModel(_triple(prior.coefficients), prior.spread, 0)
    x = np.array([(1.0, t.expert_bytes, t.output_bytes) for t in rows])
    y = np.array([t.seconds for t in rows])
    shares = x * prior.coefficients / y[:, None]  # each term's prior seconds over the merge's seconds
    ridge = NOISE / prior.spread
    delta = np.zeros(3)
    for _ in range(MAX_STEPS):
        scaled = shares * np.exp(delta)  # each term's seconds over the merge's seconds, at δ
        residuals = 1.0 - scaled.sum(axis=1)
        a = np.vstack([scaled, ridge * np.eye(3)])
        b = np.concatenate([residuals, -ridge * delta])
        step = np.clip(np.linalg.lstsq(a, b, rcond=None)[0], -1.0, 1.0)  # at most a factor e per step
        delta += step
        if np.abs(step).max() < 1e-9:
            break
    coefficients = prior.coefficients * np.exp(delta)
    residuals = 1.0 - (x @ coefficients) / y
    uncertainty = math.sqrt((PRIOR_MERGES * prior.spread**2 + float(residuals @ residuals)) / (PRIOR_MERGES + len(y)))
    return TimeModel(_triple(coefficients), uncertainty, len(y))


def _triple(values: np.ndarray) -> tuple[float, float, float]:
    a, b, c = (float(v) for v in values)
    return a, b, c
