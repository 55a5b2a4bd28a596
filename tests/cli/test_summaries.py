"""Summaries that add up (issue 35, item 9), each through the command a user types.

One catalog holds three versions of a task-arithmetic merge ``merged`` of e1 (weight 1) and e2 (weight
0.5) at budgets 25%, 50% and 75%. Every number a summary prints is computed here again from the
checkpoints, the published files and the plan's block reads: delta energies from the tensors
(Σ over blocks of (w‖E_b − B_b‖)²), tensors and blocks that changed from the output bytes, files from
the folder. For task arithmetic the planner's error-bound multipliers are the weights, so the share
of the weighted norm left out is √(1 − the share of the energy kept).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from mergepipe.catalog import Catalog
from mergepipe.spec.plan import Plan
from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.cli import invoke, run_main
from tests.planner.support import build_catalog, clone_catalog

BLOCK_BYTES = 2048
WEIGHTS = {"e1": 1.0, "e2": 0.5}
MERGE = ["--base", "base", "--experts", "e1", "e2", "--operator", "task_arithmetic", "--weights", "1", "0.5",
         "--model-id", "merged", "--no-progress"]
BUDGETS = ("25%", "50%", "75%")
SHOWN = "layers.1"


@pytest.fixture(scope="module")
def versions(tiny_family, tmp_path_factory) -> dict:
    """merged@1..3 published at v1..v3 (budgets 25%, 50%, 75%), with each merge's printed summary and its
    --json-summary."""
    root = tmp_path_factory.mktemp("summaries")
    db = build_catalog(root / "c.db", BLOCK_BYTES, {m: tiny_family[m] for m in ("base", "e1", "e2")},
                       base="base", experts=["e1", "e2"])
    printed, summaries = [], []
    for i, budget in enumerate(BUDGETS, 1):
        printed.append(invoke(CliRunner(), ["merge", "--db", db, *MERGE, "--budget", budget, "--out", root / f"v{i}",
                                            "--json-summary", root / f"s{i}.json"]))
        summaries.append(json.loads((root / f"s{i}.json").read_text()))
    manifests = [json.loads((root / f"v{i}" / "manifest.json").read_text()) for i in (1, 2, 3)]
    return {"root": root, "db": db, "printed": printed, "summaries": summaries, "manifests": manifests}


def cells(text: str, label: str) -> list[str]:
    """The cells of the table row whose first cell is ``label``, a cell wrapped over lines joined by spaces."""
    found: list[str] | None = None
    for line in text.splitlines():
        parts = [p.strip() for p in line.split("│")[1:-1]]
        if found is not None and parts and not parts[0]:  # the row goes on: its cells wrapped
            found = [f"{a} {b}".strip() for a, b in zip(found, parts)]
        elif found is not None:
            return found
        elif parts and parts[0] == label:
            found = parts
    if found is not None:
        return found
    raise AssertionError(f"no row {label!r} in:\n{text}")


def kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB"


def percent(text: str, pattern: str) -> float:
    match = re.search(pattern, text)
    assert match is not None, text
    return float(match[1])


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as blocks cut it: rows of its first dimension; a 0-d or 1-D tensor is one row."""
    return tensor if tensor.dim() >= 2 else tensor.reshape(1, -1)


def block_energies(family: dict[str, Path], catalog: Catalog) -> dict[tuple[str, str], list[float]]:
    """(tensor, expert) -> w²‖E_b − B_b‖² of each block b (the base's row blocks), in float64."""
    base = load_tensors(family["base"])
    blocks = catalog.blocks.by_tensor("base")
    out = {}
    for expert, weight in WEIGHTS.items():
        for name, value in load_tensors(family[expert]).items():
            rows = as_rows(value.double() - base[name].double())
            out[name, expert] = [weight ** 2 * float(rows[b.row_start:b.row_end].pow(2).sum()) for b in blocks[name]]
    return out


def kept_share(plan: Plan, energies: dict[tuple[str, str], list[float]], names: list[str]) -> float:
    kept = total = 0.0
    for name in names:
        for expert in WEIGHTS:
            per_block = energies[name, expert]
            total += sum(per_block)
            kept += sum(per_block[i] for i in plan.reads_of(name, expert))
    return kept / total


def test_explain_tensor_totals_the_rows_it_shows(versions, tiny_family, capsys):
    """The header's line on the tensors shown is their own total, not the whole plan's."""
    db = versions["db"]
    code, text, err = run_main(["explain", "--db", db, "merged@1", "--tensor", SHOWN], capsys)
    assert code == 0, err
    with Catalog.open(db) as catalog:
        plan = Plan.from_json(catalog.plans.get(versions["manifests"][0]["plan_digest"]))
        energies = block_energies(tiny_family, catalog)
        blocks = catalog.blocks.by_tensor("base")
        names = [t.name for t in catalog.models.tensors("base")]
    shown = [n for n in names if SHOWN in n]
    planned = sum(blocks[n][i].nbytes for n in shown for e in WEIGHTS for i in plan.reads_of(n, e))
    expected = kept_share(plan, energies, shown)
    row = cells(text, "tensors shown")[1]
    assert row.startswith(f"{len(shown)} of {len(names)} (name contains '{SHOWN}'): {kib(planned)} planned; ")
    assert abs(percent(row, r"delta energy \(‖Δ‖²\) kept ([\d.]+)%$") - 100 * expected) < 0.051
    assert "the summary is the whole plan's" in text.splitlines()[0]
    # each row's own share, from the same block energies
    for name in shown:
        mine = kept_share(plan, energies, [name])
        assert abs(float(cells(text, name)[-1].rstrip("%")) - 100 * mine) <= 0.5, name
    code, out, err = run_main(["explain", "--db", db, "merged@1", "--tensor", SHOWN, "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["shown_planned_bytes"] == planned
    assert expected != pytest.approx(kept_share(plan, energies, names), abs=1e-3)  # the rows are not the whole plan


def test_delta_energy_and_norm_left_out_are_labelled_as_such(versions, tiny_family, capsys):
    db = versions["db"]
    code, text, err = run_main(["explain", "--db", db, "merged@1"], capsys)
    assert code == 0, err
    with Catalog.open(db) as catalog:
        plan = Plan.from_json(catalog.plans.get(versions["manifests"][0]["plan_digest"]))
        energies = block_energies(tiny_family, catalog)
        names = [t.name for t in catalog.models.tensors("base")]
    kept = kept_share(plan, energies, names)
    energy = cells(text, "delta energy (‖Δ‖²) kept")[1]
    assert abs(percent(energy, r"^([\d.]+)% of the weighted delta energy Σ \(w‖Δ‖\)² is read") - 100 * kept) < 0.051
    norm = cells(text, "weighted norm (‖Δ‖) left out")[1]
    left_out = percent(norm, r"^([\d.]+)% of the weighted task vectors' norm √Σ \(β‖Δ‖\)² is not read")
    assert abs(left_out - 100 * math.sqrt(1 - kept)) < 0.051
    assert "retained delta energy" not in text


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(name for name in a if not torch.equal(a[name], b[name]))


def test_diff_lists_only_changed_tensors_and_budgets_as_written(versions, tiny_family, capsys):
    root, db = versions["root"], versions["db"]
    code, text, err = run_main(["diff", "--db", db, "merged@1", "merged@2"], capsys)
    assert code == 0, err
    one, two = load_tensors(root / "v1"), load_tensors(root / "v2")
    changed = _differing(one, two)
    assert 0 < len(changed) < len(one)  # some tensors hold the same values in both
    listed = [line.split("│")[1].strip() for line in text.splitlines() if re.match(r"^│ \S", line)]
    assert sorted(listed) == changed
    assert "0.000e+00" not in text
    assert (f"all {len(changed)} changed; {len(one) - len(changed)} of {len(one)} tensors hold the same values "
            "in both") in text
    # the budgets as written, each with its size: a share of the experts' changed bytes (all of them here)
    full = sum(t.numel() * t.element_size() for e in WEIGHTS for t in load_tensors(tiny_family[e]).values())
    assert f"  budget: 25% = {kib(full / 4)} -> 50% = {kib(full / 2)}" in text.splitlines()
    for manifest in versions["manifests"][:2]:
        assert str(manifest["budget_bytes"]) not in text
    code, out, _ = run_main(["diff", "--db", db, "merged@1", "merged@2", "--json"], capsys)
    assert json.loads(out)["unchanged"] == len(one) - len(changed)


def test_diff_names_each_side_by_its_exact_version(versions, capsys):
    """After a third version `merged` means merged@3: a side is named by its version, never by `merged`."""
    snaps = [m["snapshot_id"] for m in versions["manifests"]]
    code, text, err = run_main(["diff", "--db", versions["db"], "merged", "merged@2"], capsys)
    assert code == 0, err
    assert text.splitlines()[0] == f"merged@3 ({snaps[2]}) -> merged@2 ({snaps[1]})"
    code, text, err = run_main(["diff", "--db", versions["db"], "merged@1", "merged"], capsys)
    assert code == 0, err
    assert text.splitlines()[0] == f"merged@1 ({snaps[0]}) -> merged@3 ({snaps[2]})"


def _seconds(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"([\d.]+) s\b", text)]


def test_merge_summary_total_is_the_sum_of_its_parts_and_start_up_apart(versions):
    printed, seconds = versions["printed"][0], versions["summaries"][0]["seconds"]
    time_row = cells(printed, "time")[1]
    total, streaming, hashing, publishing = _seconds(time_row)
    assert time_row.startswith("total ") and round(total * 1000) == round(streaming * 1000) + round(hashing * 1000) \
        + round(publishing * 1000)
    assert (total, hashing, publishing) == tuple(round(seconds[k], 3) for k in ("total", "hash", "publish"))
    streaming_row = cells(printed, "streaming")[1]
    parts = _seconds(streaming_row.split(";")[0])  # read wait, compute, write wait, set-up (writing runs beside)
    assert "set-up" in streaming_row and round(sum(parts) * 1000) == round(streaming * 1000)
    startup = cells(printed, "start-up")[1]
    assert startup.startswith(f"{seconds['startup']:.3f} s from process start") and "shown apart" in startup
    assert seconds["startup"] > seconds["total"]  # the process's age: it holds the merge, so it is not one more part


def test_verify_counts_the_files_it_checked(versions, capsys):
    directory = versions["root"] / "v1"
    on_disk = sorted(p.name for p in directory.rglob("*") if p.is_file())
    code, out, err = run_main(["verify", directory], capsys)
    assert code == 0, err
    assert out.startswith(f"OK {directory}: {len(on_disk)} files verified: ")
    code, out, err = run_main(["verify", directory, "--json"], capsys)
    assert code == 0, err
    assert sorted(json.loads(out)["checked"]) == on_disk


def _fingerprints(text: str) -> tuple[str | None, str]:
    """(content fingerprint or None when not computed, layout fingerprint) as `show` labels them."""
    content = re.search(r"^content fingerprint ([0-9a-f]{64}) \(its bytes: what plans and manifests record\)$",
                        text, re.M)
    layout = re.search(r"^layout fingerprint ([0-9a-f]{64}) \(file names, headers and sizes", text, re.M)
    assert layout is not None, text
    return (None if content is None else content[1]), layout[1]


def test_show_labels_the_content_and_the_layout_fingerprint(versions, capsys):
    code, text, err = run_main(["show", "--db", versions["db"], "e1"], capsys)
    assert code == 0, err
    content, layout = _fingerprints(text)
    (recorded,) = [e["fingerprint"] for e in versions["manifests"][0]["experts"] if e["id"] == "e1"]
    assert content == recorded != layout  # the one manifests record, and the other one, apart
    for ref in ("merged@1", "merged@2"):  # published, not hashed yet: said, not shown as something else
        code, text, err = run_main(["show", "--db", versions["db"], ref], capsys)
        assert code == 0, err
        assert _fingerprints(text) == (None, layout)  # the layout is the same for every version
        assert "content fingerprint not computed yet" in text


def _version_changes(text: str) -> dict[str, str]:
    """Version -> its 'changes from the previous version' cell in `show`'s versions table."""
    rows = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split("│")[1:-1]]
        if len(parts) == 4 and parts[0].isdigit():
            rows[parts[0]] = parts[3]
    return rows


def test_show_versions_says_changes_are_unknown_until_hashed(versions, tmp_path, capsys):
    db = clone_catalog(versions["db"], tmp_path / "c.db")  # hashing below must not change the other tests'
    code, text, err = run_main(["show", "--db", db, "merged"], capsys)
    assert code == 0, err
    unknown = "which tensors changed is not known until `mergepipe analyze` hashes the blocks (not hashed yet)"
    assert _version_changes(text) == {"1": "-", "2": unknown, "3": unknown}
    assert "0 of" not in text
    code, _, err = run_main(["analyze", "--db", db, "--no-progress", "merged@1", "merged@2"], capsys)
    assert code == 0, err
    code, text, err = run_main(["show", "--db", db, "merged"], capsys)
    assert code == 0, err
    one, two = load_tensors(versions["root"] / "v1"), load_tensors(versions["root"] / "v2")
    with Catalog.open(db) as catalog:
        blocks = catalog.blocks.by_tensor("merged@2")
    changed_blocks = sum(1 for name, per in blocks.items() for b in per
                         if not torch.equal(as_rows(one[name])[b.row_start:b.row_end],
                                            as_rows(two[name])[b.row_start:b.row_end]))
    n_blocks = sum(len(per) for per in blocks.values())
    assert _version_changes(text) == {
        "1": "-", "2": f"{len(_differing(one, two))} of {len(one)} tensors changed, {changed_blocks} of {n_blocks} "
                        "blocks", "3": unknown}
    code, text, err = run_main(["show", "--db", db, "merged@2"], capsys)
    assert code == 0, err
    second = _fingerprints(text)
    code, text, err = run_main(["show", "--db", db, "merged@1"], capsys)
    first = _fingerprints(text)
    assert None not in (first[0], second[0]) and first[0] != second[0] and first[1] == second[1]
