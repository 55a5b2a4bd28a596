"""``Engine.merge_in_memory``: a plan's output held in memory is, byte for byte, the files ``execute`` writes.

The reference is the executed snapshot's files on disk, read back through the
safetensors library (values) and as raw bytes (the buffers are the files).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.planner.planner import Planner
from mergepipe.spec.request import MergeRequest
from tests.planner.support import build_catalog, clone_catalog

BLOCK_BYTES = 4096


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory):
    root = tmp_path_factory.mktemp("in-memory")
    return build_catalog(root / "template.db", BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2"])


@pytest.fixture
def catalog(template, tmp_path):
    with Catalog.open(clone_catalog(template, tmp_path / "c.db")) as catalog:
        yield catalog


@pytest.mark.parametrize(("operator", "budget", "shard"), [("ties", "100%", None), ("dare_ties", "30%", None),
                                                           ("task_arithmetic", "60%", 20_000)])
def test_a_plan_merged_in_memory_holds_the_tensors_and_bytes_its_execution_writes(catalog, tmp_path, operator,
                                                                                   budget, shard):
    request = MergeRequest(base="base", experts=["e1", "e2"], operator=operator, weights=[1.0, 0.6],
                           params={"density": 0.5} if operator != "task_arithmetic" else {}, budget=budget, out_shard_bytes=shard)
    plan = Planner(catalog).plan(request)
    held = Engine(catalog).merge_in_memory(plan)
    assert catalog.snapshots.committed_for_plan(plan.digest) is None  # nothing published, nothing recorded

    out = tmp_path / "out"
    Engine(catalog).execute(plan, out=out, model_id="m")
    written = sorted(p.name for p in out.glob("*.safetensors"))
    assert sorted(held) == written
    for name, tensors in held.items():
        on_disk = load_file(out / name)
        assert sorted(tensors) == sorted(on_disk)
        for tensor, values in tensors.items():
            assert values.dtype == on_disk[tensor].dtype and values.shape == on_disk[tensor].shape
            assert torch.equal(values.view(torch.uint8) if values.numel() else values,
                               on_disk[tensor].view(torch.uint8) if values.numel() else on_disk[tensor])
