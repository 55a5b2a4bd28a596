"""Stored evaluations as the reports show them: explain lists a merge's, diff compares two, lineage picks one data.

Scores compare only on the same data, meaning the same ``data_digest`` (the
same bytes and the settings that change a value), metric by metric: a loss
on other data, or with another context length, is another number. Pure
functions of catalog records; the catalog finds the rows
(``catalog.evaluations``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from mergepipe.catalog.records import EvaluationRecord

#: How many characters of a data digest a report shows: enough to tell data sets apart by eye.
DIGEST_CHARS = 12


@dataclass(frozen=True)
class MetricChange:
    """One metric of two subjects on the same data: ``a``, ``b`` and ``delta`` = b − a."""

    data_name: str
    data_digest: str
    metric: str
    a: float
    b: float

    @property
    def delta(self) -> float:
        return self.b - self.a

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "delta": self.delta}


@dataclass(frozen=True)
class EvaluatedData:
    """A data set as rows name it: its digest, and what people call it."""

    digest: str
    name: str

    def to_json(self) -> dict[str, str]:
        return {"data_digest": self.digest, "data_name": self.name}


def changes(a: Sequence[EvaluationRecord], b: Sequence[EvaluationRecord]) -> list[MetricChange]:
    """Every metric measured for both ``a`` and ``b`` on data both were evaluated on, by data name and metric."""
    before = {(r.data_digest, r.metric): r for r in a}
    out = []
    for r in sorted(b, key=lambda r: (r.data_name, r.data_digest, r.metric)):
        old = before.get((r.data_digest, r.metric))
        if old is not None:
            out.append(MetricChange(r.data_name, r.data_digest, r.metric, old.value, r.value))
    return out


def most_shared_data(per_subject: Iterable[Sequence[EvaluationRecord]]) -> EvaluatedData | None:
    """The data that compares the most subjects: evaluated for the most of them, the most recently evaluated
    among ties; None when none was evaluated."""
    subjects: dict[str, set[str]] = {}
    latest: dict[str, EvaluationRecord] = {}
    for rows in per_subject:
        for r in rows:
            subjects.setdefault(r.data_digest, set()).add(r.subject)
            if r.data_digest not in latest or r.created_at > latest[r.data_digest].created_at:
                latest[r.data_digest] = r
    if not latest:
        return None
    digest = max(latest, key=lambda d: (len(subjects[d]), latest[d].created_at, d))
    return EvaluatedData(digest, latest[digest].data_name)


def value_text(value: float) -> str:
    """A score as reports print it: six significant digits (``nan`` for a diverged model)."""
    return f"{value:.6g}"


def delta_text(value: float) -> str:
    """A difference of scores, always signed."""
    return f"{value:+.6g}"


def compact(rows: Sequence[EvaluationRecord], data: EvaluatedData) -> str:
    """``loss=2.5 perplexity=12.1825``: the metrics of ``rows`` on ``data``, by metric; empty if none."""
    return " ".join(f"{r.metric}={value_text(r.value)}"
                    for r in sorted(rows, key=lambda r: r.metric) if r.data_digest == data.digest)


def params_text(params: Mapping[str, Any], digits: int = 3) -> str:
    """A search trial's parameters in one line (``weight math=0.603, density=0.5``), floats to ``digits``
    significant digits."""
    return ", ".join(f"{k}={v:.{digits}g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
