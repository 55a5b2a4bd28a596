"""A plan's predicted seconds, as plans and manifests keep them and people read them.

The model that makes them is ``spec/time_model.py`` (numpy, loaded by the
planner); this module is what a plan, a manifest or a view needs to hold and
show a prediction, and imports nothing heavy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mergepipe.spec import fields

#: The terms of a prediction, in the order of the coefficients.
TERMS = ("fixed", "experts", "output")


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted seconds on one machine: the total, how uncertain (relative), the seconds of each term
    (``TERMS``), and how many merges of its operator the model was fitted to (0: the prior alone)."""

    machine: str
    seconds: float
    uncertainty: float
    merges: int
    terms: dict[str, float]

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
