"""How long a merge takes here, learnt from this catalog's own history: ``a + b·expert_bytes + c·output_bytes``.

What is predicted is the engine's own wall time, from staging to commit: the
manifest's realized ``total`` (reading the base and the planned expert
blocks, merging, writing, publishing). The command's start-up (Python,
importing torch) is not in it.

Per machine and operator, the three coefficients are fitted to the merges
timed here (``Timing``) by least squares, shrunk toward a ``Prior`` that
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mergepipe.spec import fields

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
#: The terms of a prediction, in the order of the coefficients.
TERMS = ("fixed", "experts", "output")


@dataclass(frozen=True)
class Timing:
    """One past merge: the expert bytes it read, the output bytes it wrote, the engine's seconds."""

    expert_bytes: int
    output_bytes: int
    seconds: float


@dataclass(frozen=True)
class Prior:
    """What a merge is expected to cost before any was timed here, and how far to trust it (relative)."""

    fixed_seconds: float
    seconds_per_expert_byte: float
    seconds_per_output_byte: float
    spread: float = PRIOR_SPREAD

    @classmethod
    def measured(cls, read_bytes_per_second: float | None, kernel_seconds_per_element: float | None,
                 element_bytes: float) -> Prior:
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


def fit(prior: Prior, history: Sequence[Timing]) -> TimeModel:
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


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted seconds on one machine: the total, how uncertain (relative), the seconds of each term
    (``TERMS``), and how many merges of its operator the model was fitted to (0: the prior alone)."""

    machine: str
    seconds: float
    uncertainty: float
    merges: int
    terms: dict[str, float]

    @classmethod
    def of(cls, machine: str, model: TimeModel, expert_bytes: int, output_bytes: int) -> Prediction:
        terms = model.terms(expert_bytes, output_bytes)
        return cls(machine, sum(terms.values()), model.uncertainty, model.merges, terms)

    def flat(self) -> dict[str, float]:
        """The form a manifest keeps (``cost.estimated.seconds``) and ``describe`` reads."""
        return {"total": self.seconds, "uncertainty": self.uncertainty, **self.terms, "merges": float(self.merges)}

    def to_json(self) -> dict[str, Any]:
        return {"machine": self.machine, "total": self.seconds, "uncertainty": self.uncertainty,
                "merges": self.merges, "terms": dict(self.terms)}

    @classmethod
    def from_json(cls, data: Any) -> Prediction | None:
        """A stored prediction; None for one the former cost model made (``work`` and ``phases``, in plans
        saved before this model): a plan's seconds are predicted again where it runs."""
        if isinstance(data, dict) and "phases" in data:
            return None
        d = fields.keys(data, ("machine", "total", "uncertainty", "merges", "terms"), "plan seconds")
        terms = fields.keys(d["terms"], TERMS, "plan seconds.terms")
        return cls(fields.text(d["machine"], "plan seconds.machine"), fields.number(d["total"], "plan seconds.total"),
                   fields.number(d["uncertainty"], "plan seconds.uncertainty"),
                   fields.integer(d["merges"], "plan seconds.merges"),
                   {t: fields.number(terms[t], f"plan seconds.terms.{t}") for t in TERMS})


def describe(seconds: Mapping[str, float] | None) -> str:
    """Predicted seconds for people, from ``Prediction.flat`` (a plan's, or a manifest's): the total, how
    uncertain, the terms and what the model learnt from. A manifest sealed by the former cost model (phases)
    shows its total; nothing predicted says so."""
    if not seconds:
        return "none"
    if "uncertainty" not in seconds:
        return f"{seconds.get('total', math.nan):.3g} s"
    merges = int(seconds.get("merges", 0))
    source = (f"fitted to {merges} merge{'s' * (merges != 1)} here" if merges
              else "prior only: no merge of this operator timed here yet")
    terms = " + ".join(f"{name} {seconds[name]:.2g}" for name in TERMS if name in seconds)
    return (f"{seconds['total']:.3g} s ± {100 * seconds['uncertainty']:.0f}%, start-up excluded ({terms} s; "
            f"{source})")
