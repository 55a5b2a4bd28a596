"""planner/evaluations.py: scores compare only on the same data and metric; the data a lineage shows."""

from __future__ import annotations

from mergepipe.catalog.records import EvaluationRecord
from mergepipe.planner.explain import EvaluatedData, changes, compact, most_shared_data


def row(subject: str, data: str, metric: str, value: float, when: str = "2026-12-06T10:00") -> EvaluationRecord:
    return EvaluationRecord(subject=subject, subject_kind="plan", data_digest=data, data_name=f"{data}.txt",
                            metric=metric, value=value, tokens=None, versions={}, device="cpu", seconds=1.0,
                            created_at=when)


def test_changes_pair_metrics_on_the_same_data_only():
    a = [row("a", "d1", "loss", 2.0), row("a", "d1", "perplexity", 7.5), row("a", "d2", "loss", 1.0)]
    b = [row("b", "d1", "loss", 2.5), row("b", "d2", "acc", 0.5), row("b", "d3", "loss", 1.0)]
    (only,) = changes(a, b)
    assert (only.data_digest, only.metric, only.a, only.b, only.delta) == ("d1", "loss", 2.0, 2.5, 0.5)
    assert changes(a, []) == [] and changes([], b) == []


def test_the_data_shown_is_the_one_most_subjects_share_then_the_most_recent():
    old, new = "2026-12-06T10:00", "2026-12-07T10:00"
    assert most_shared_data([]) is None and most_shared_data([[], []]) is None
    shared = [[row("a", "d1", "loss", 1.0, old), row("a", "d2", "loss", 1.0, new)], [row("b", "d1", "loss", 1.0, old)]]
    assert most_shared_data(shared) == EvaluatedData("d1", "d1.txt")
    tied = [[row("a", "d1", "loss", 1.0, old), row("a", "d2", "loss", 1.0, old)], [row("b", "d2", "loss", 1.0, new)],
            [row("c", "d1", "loss", 1.0, old)]]
    assert most_shared_data(tied) == EvaluatedData("d2", "d2.txt")  # two subjects each; d2 evaluated last


def test_compact_lists_the_metrics_on_that_data_by_name():
    rows = [row("a", "d1", "perplexity", 12.25), row("a", "d1", "loss", 2.5), row("a", "d2", "loss", 9.0)]
    assert compact(rows, EvaluatedData("d1", "d1.txt")) == "loss=2.5 perplexity=12.25"
    assert compact(rows, EvaluatedData("d3", "d3.txt")) == ""
