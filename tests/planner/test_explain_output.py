"""explain's line on how an incremental snapshot's output bytes got there, where a merge through the CLI
cannot take it: a reflinking filesystem, a previous snapshot the catalog no longer holds. The figures
through a real `merge --from` are checked against the files on disk in tests/cli/test_incremental_cli.py."""

from __future__ import annotations

from dataclasses import replace

from mergepipe.planner.explain import Explanation, copies_in_write, output_text, time_rows
from mergepipe.sizes import format_bytes

BY_METHOD = {"linked": 0, "cloned": 3 * 2**20, "copied": 0, "written": 2**20 + 5}


def _explanation(**fields) -> Explanation:
    return Explanation(plan_id="f" * 64, snapshot_id="snap-0123456789abcdef", operator="ties", policy="energy",
                       budget_bytes=100, planned_expert_bytes=100, realized_expert_bytes=40, full_expert_bytes=400,
                       error_bound=0.0, error_bound_kind="bound", error_share=0.0, retained_energy=1.0, tensors=(),
                       experts=(), **fields)


def test_reflinked_bytes_and_a_previous_snapshot_no_longer_in_the_catalog():
    result = _explanation(reused_from="merged", output_bytes_by_method=BY_METHOD)
    assert output_text(result) == (f"{format_bytes(4 * 2**20 + 5)}: 3.0 MiB reflinked and 0 B copied by the kernel "
                                   "from the previous snapshot of 'merged', each checked against its recorded hash, "
                                   "1.0 MiB written")
    earlier = _explanation(reused_from="merged", output_bytes_by_method={**BY_METHOD, "linked": 3 * 2**20, "cloned": 0})
    assert (output_text(earlier) or "").startswith(f"{format_bytes(4 * 2**20 + 5)}: 3.0 MiB linked, 0 B reflinked")
    assert not copies_in_write(result.output_bytes_by_method)  # nothing copied by the kernel: writing is writing alone
    named = replace(result, reused_snapshot="snap-fedcba9876543210")
    assert "from snapshot snap-fedcba9876543210," in (output_text(named) or "")
    assert result.to_json()["output_bytes_by_method"] == BY_METHOD


def test_nothing_said_for_a_merge_from_scratch():
    result = _explanation(seconds={"write": 0.5})
    assert output_text(result) is None and not copies_in_write(result.output_bytes_by_method)
    assert result.to_json()["output_bytes_by_method"] == {}
    assert not any("kernel" in text for _, text in time_rows(result.seconds, kernel_copies=copies_in_write(result.output_bytes_by_method)))


def test_writing_says_it_includes_the_kernels_copies():
    result = _explanation(reused_from="merged", output_bytes_by_method={**BY_METHOD, "copied": 7, "written": 2**20 - 2})
    assert copies_in_write(result.output_bytes_by_method)
    (row,) = [text for label, text in time_rows({"write": 0.25, "compute": 1.0}, kernel_copies=True)
              if label == "time"]
    assert "writing 0.250 s (including any kernel copies of reused blocks) ran alongside" in row
