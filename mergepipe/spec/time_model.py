"""How long a merge takes here, ``a + b·expert_bytes + c·output_bytes`` (the engine's seconds, staging to
commit), fitted per machine and operator to this catalog's timed merges and shrunk toward a ``Prior``
(analysis's read rate, the kernel probe); docs/ARCHITECTURE.md ("Seconds") says how.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mergepipe.spec.plan import TERMS, Prediction

#: How far a merge's seconds stray from a perfect model, relative (run to run: the page cache, other work).
NOISE = 0.1
#: How far a prior's coefficients may be off, relative.
PRIOR_SPREAD = 0.5
#: How much the prior's spread weighs in a prediction's uncertainty, in merges.
PRIOR_MERGES = 1.0
#: The prior's fixed part: staging, opening the inputs, the manifest, rename and commit of a small merge.
PRIOR_FIXED_SECONDS = 0.1
#: The read rate of a machine analysis never ran on (a cloud volume's or a SATA disk's), with twice the spread.
UNMEASURED_READ_RATE = 200e6
#: Gauss-Newton steps of a fit at most (it converges in a few; a step moves a coefficient by a factor e at most).
MAX_STEPS = 50


class Timed(Protocol):
    """One past merge as the fit needs it (``catalog.records.Timing``)."""

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
        """An expert byte costs its read (at analysis's rate here; None: never analysed here) and its share of
        the kernel (None: never probed on this device); an output byte the read of its base byte (the output
        is written by a thread of its own)."""
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
        return dict(zip(TERMS, (c * x for c, x in zip(self.coefficients, (1, expert_bytes, output_bytes)))))

    def predict(self, machine: str, expert_bytes: int, output_bytes: int) -> Prediction:
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
    """The model of ``history`` (one operator, one machine): each coefficient ``prior × e^δ``, the δ minimising
    ``Σ ((seconds − predicted) / seconds)² + (NOISE / spread)² · Σ δ²`` by Gauss-Newton steps."""
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
