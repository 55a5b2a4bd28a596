"""The budget is a promise about the disk, not only about a counter.

After dropping an expert file from the page cache, a budgeted merge may
leave in the cache (i.e. have read from disk) only the planned blocks, the
file's header, and the partial pages at the ends of each read — never the
kernel's readahead of unplanned bytes. Checked with ``mincore`` on a
checkpoint large enough for readahead to matter.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.coldcache import drop_cache, resident_bytes
from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.planner.planner import Planner
from mergepipe.storage.format import read_header
from mergepipe.spec.request import MergeRequest

PAGE = os.sysconf("SC_PAGE_SIZE")
BLOCK_BYTES = 64 * 1024
SHAPES = {f"model.layers.{i}.mlp.{p}.weight": (1024, 1024) for i in range(2) for p in ("up_proj", "down_proj")}
SHAPES["model.norm.weight"] = (1024,)


def _write(root: Path, tensors: dict[str, torch.Tensor]) -> Path:
    root.mkdir(parents=True)
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "model_type": "llama"}))
    return root


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A 8 MiB bf16 base and an expert that changes every tensor."""
    root = tmp_path_factory.mktemp("physical")
    gen = torch.Generator().manual_seed(5)
    base = {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in SHAPES.items()}
    expert = {n: (t.float() + torch.randn(t.shape, generator=gen) * 0.002).to(torch.bfloat16) for n, t in base.items()}
    return _write(root / "base", base), _write(root / "expert", expert)


@pytest.mark.parametrize("budget", ["5%", "13%", "40%"])
def test_physical_expert_reads_stay_within_the_budget(pair, tmp_path, budget):
    base_dir, expert_dir = pair
    expert_file = expert_dir / "model.safetensors"
    os.sync()  # dirty pages cannot be dropped from the cache
    with Catalog.create(tmp_path / "c.db", BLOCK_BYTES) as catalog:
        register_model(catalog, "base", base_dir)
        register_model(catalog, "expert", expert_dir)
        analyze(catalog, ["expert"], base_id="base", progress=False)
        drop_cache([expert_file])
        assert resident_bytes([expert_file]) == 0, "the page cache could not be dropped on this filesystem"
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["expert"], operator="task_arithmetic", budget=budget))
        _, manifest = Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    reads = sum(len(ix) for per in plan.reads.values() for ix in per.values())
    header_pages = math.ceil((8 + read_header(expert_file).header_len) / PAGE) * PAGE
    allowance = header_pages + 2 * PAGE * reads  # each read may touch one partial page at each end
    physical = resident_bytes([expert_file])
    assert manifest.cost.realized.expert_bytes <= plan.budget_bytes
    assert physical <= plan.budget_bytes + allowance, (
        f"{physical} bytes of the expert were read from disk for a {plan.budget_bytes}-byte budget"
    )
