"""A block merged in pieces of rows (the CPU path, ``stream.CPU_PIECE_ELEMENTS``) gives the bytes of
the block merged whole, for every streaming operator, at full and partial budgets, and records an upper
bound on the norm of what it wrote."""

from __future__ import annotations

import pytest
import torch

from mergepipe.catalog import Catalog
from mergepipe.engine import stream as compute
from mergepipe.engine.stream import _Rows
from mergepipe.engine.engine import Engine
from mergepipe.planner.planner import Planner
from mergepipe.storage.source import block_digest
from mergepipe.spec.request import MergeRequest
from tests.planner.support import build_catalog, clone_catalog, snapshot_files

BLOCK_BYTES = 2048
EXPERTS = ["e1", "e2", "e3"]
CASES = {
    "ties": {"density": 0.4},
    "task_arithmetic": {},
    "dare_ties": {"density": 0.5},
    "breadcrumbs_ties": {"density": 0.6, "gamma": 0.1},
    "della": {"density": 0.5, "epsilon": 0.1},
}


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory):
    path = tmp_path_factory.mktemp("pieces") / "template.db"
    return build_catalog(path, BLOCK_BYTES, dict(tiny_family), base="base", experts=EXPERTS)


def spy_pieces(monkeypatch) -> list[bool]:
    """Per piece merged, whether it is less than its whole item (a block, or a tensor read whole)."""
    calls: list[bool] = []
    merged = _Rows.merged

    def spy(self, start, end):
        calls.append((start, end) != (self.item.blocks[0].row_start, self.item.blocks[-1].row_end))
        return merged(self, start, end)

    monkeypatch.setattr(_Rows, "merged", spy)
    return calls


def merged_files(template, root, operator, budget):
    with Catalog.open(clone_catalog(template, root / "c.db")) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=EXPERTS, operator=operator, weights=[1.0, 0.5, 0.8], params=CASES[operator], seed=7, budget=budget))
        Engine(catalog).execute(plan, out=root / "out", model_id="m")
    return snapshot_files(root / "out")


@pytest.mark.parametrize("budget", ["100%", "40%"])
@pytest.mark.parametrize("operator", list(CASES))
def test_pieces_of_rows_give_the_bytes_of_whole_blocks(template, tmp_path, monkeypatch, operator, budget):
    (tmp_path / "whole").mkdir()
    (tmp_path / "pieces").mkdir()
    whole = merged_files(template, tmp_path / "whole", operator, budget)
    calls = spy_pieces(monkeypatch)
    monkeypatch.setattr(compute, "CPU_PIECE_ELEMENTS", 200)  # 3 rows of 64: uneven pieces of every block
    pieces = merged_files(template, tmp_path / "pieces", operator, budget)
    assert any(calls), "no block was split"
    assert pieces == whole


def test_a_block_merged_in_pieces_records_a_bound_on_the_norm_it_wrote(template, tmp_path, monkeypatch):
    monkeypatch.setattr(compute, "CPU_PIECE_ELEMENTS", 200)  # 3 rows of 64 a piece
    with Catalog.open(clone_catalog(template, tmp_path / "c.db")) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=EXPERTS, operator="task_arithmetic", weights=[1.0, 0.5, 0.8], budget="100%"))
        Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
        recorded = catalog.snapshots.outputs("m")
        published = catalog.blocks.by_tensor("m")  # the snapshot's blocks: offsets in its file
    data = (tmp_path / "out" / "model.safetensors").read_bytes()
    merged = 0
    for tensor, blocks in published.items():
        for b in blocks:
            record = recorded[(tensor, b.index)]
            assert record.hash == block_digest(data[b.begin:b.end])
            if record.l2 is None:  # copied from the base, not merged
                continue
            exact = float(torch.frombuffer(bytearray(data[b.begin:b.end]), dtype=torch.bfloat16).double().norm())
            assert exact <= record.l2 <= exact * (1 + 2**-6)
            merged += 1
    assert merged > 10


@pytest.mark.parametrize(("operator", "budget"), [("ties", "30%"), ("task_arithmetic", "10%")])
def test_a_tensor_read_through_delta_stores_merges_in_pieces_to_the_bytes_and_records_of_it_whole(
        template, tmp_path, monkeypatch, operator, budget):
    """Policy ``entries`` merges whole tensors (sketches cover every row); on a CPU in pieces of rows, with the
    same bytes, hashes, and norm and drift records within the reductions' rounding of those of it whole."""
    from mergepipe.analysis.deltastore import build_store

    runs = {}
    calls = spy_pieces(monkeypatch)
    for way, elements in (("whole", 1 << 40), ("pieces", 200)):
        monkeypatch.setattr(compute, "CPU_PIECE_ELEMENTS", elements)
        root = tmp_path / way
        root.mkdir()
        with Catalog.open(clone_catalog(template, root / "c.db")) as catalog:
            for expert in EXPERTS:
                build_store(catalog, expert, "base", root / "stores")
            plan = Planner(catalog).plan(MergeRequest(base="base", experts=EXPERTS, operator=operator,
                                                      weights=[1.0, 0.5, 0.8], params=CASES[operator], seed=7,
                                                      budget=budget, policy="entries"))
            assert plan.sketch_reads
            Engine(catalog).execute(plan, out=root / "out", model_id="m")
            runs[way] = (snapshot_files(root / "out"), catalog.snapshots.outputs("m"))
        assert (way == "pieces") == any(calls), way  # whole: no piece was made
        calls.clear()
    (whole_files, whole), (piece_files, pieces) = runs["whole"], runs["pieces"]
    assert piece_files == whole_files
    assert whole.keys() == pieces.keys()
    merged = 0
    for key, record in whole.items():
        assert pieces[key].hash == record.hash
        for field in ("l2", "drift"):
            a, b = getattr(record, field), getattr(pieces[key], field)
            assert (a is None) == (b is None) and (a is None or b == pytest.approx(a, rel=1e-5, abs=1e-12)), key
        merged += record.l2 is not None
    assert merged > 10
