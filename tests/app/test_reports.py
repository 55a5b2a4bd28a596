"""The reports' text: explain's line on how an incremental snapshot's output bytes got there, where a merge
through the CLI cannot take it (a reflinking filesystem, a previous snapshot the catalog no longer holds; the
figures through a real `merge --from` are checked against the files on disk in tests/cli/test_incremental_cli.py);
its time rows; stored scores compared only on the same data and metric, and the data a lineage shows."""

from __future__ import annotations

import importlib.resources
import tomllib
from fnmatch import fnmatch
from dataclasses import replace
from pathlib import Path

from mergepipe.app.reports import EvaluatedData, Explanation, changes, compact, most_shared_data, output_text, time_rows
from mergepipe.catalog.records import EvaluationRecord
from mergepipe.sizes import format_bytes

BY_METHOD = {"linked": 0, "cloned": 3 * 2**20, "copied": 0, "written": 2**20 + 5}


def _explanation(**fields) -> Explanation:
    return Explanation(plan_id="f" * 64, snapshot_id="snap-0123456789abcdef", operator="ties", policy="energy",
                       budget_bytes=100, planned_expert_bytes=100, realized_expert_bytes=40, full_expert_bytes=400,
                       error_bound=0.0, error_bound_kind="bound", error_share=0.0, retained_energy=1.0, tensors=(),
                       experts=(), **fields)


def _output(result: Explanation) -> str | None:
    return output_text(result.output_bytes_by_method, result.reused_snapshot, result.reused_from)


def test_reflinked_bytes_and_a_previous_snapshot_no_longer_in_the_catalog():
    result = _explanation(reused_from="merged", output_bytes_by_method=BY_METHOD)
    assert _output(result) == (f"{format_bytes(4 * 2**20 + 5)}: 3.0 MiB reflinked and 0 B copied by the kernel "
                                   "from the previous snapshot of 'merged', each checked against its recorded hash, "
                                   "1.0 MiB written")
    earlier = _explanation(reused_from="merged", output_bytes_by_method={**BY_METHOD, "linked": 3 * 2**20, "cloned": 0})
    assert (_output(earlier) or "").startswith(f"{format_bytes(4 * 2**20 + 5)}: 3.0 MiB linked, 0 B reflinked")
    # nothing copied by the kernel: writing is writing alone
    assert not any("kernel" in text for _, text in time_rows({"write": 0.5}, result.output_bytes_by_method))
    named = replace(result, reused_snapshot="snap-fedcba9876543210")
    assert "from snapshot snap-fedcba9876543210," in (_output(named) or "")
    assert result.to_json()["output_bytes_by_method"] == BY_METHOD


def test_nothing_said_for_a_merge_from_scratch():
    result = _explanation(seconds={"write": 0.5})
    assert _output(result) is None
    assert result.to_json()["output_bytes_by_method"] == {}
    assert not any("kernel" in text for _, text in time_rows(result.seconds, result.output_bytes_by_method))


def test_writing_says_it_includes_the_kernels_copies():
    result = _explanation(reused_from="merged", output_bytes_by_method={**BY_METHOD, "copied": 7, "written": 2**20 - 2})
    (row,) = [text for label, text in time_rows({"write": 0.25, "compute": 1.0}, result.output_bytes_by_method)
              if label == "time"]
    assert "writing 0.250 s (including any kernel copies of reused blocks) ran alongside" in row


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


def test_every_template_ships_as_package_data():
    """A pip install ships what [tool.setuptools.package-data] names: every page's template, found by importlib."""
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["mergepipe.app"]
    names = {t.name for t in importlib.resources.files("mergepipe.app").joinpath("templates").iterdir()}
    assert {"explain.html", "diff.html", "search.html", "bisect.html"} <= names
    assert all(any(fnmatch(f"templates/{name}", p) for p in patterns) for name in names)
