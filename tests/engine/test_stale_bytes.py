"""Bytes that changed behind the catalog's back are never merged silently.

Change detection before a merge is size + mtime (cheap); a change that keeps
both (``os.utime`` restores the mtime) is caught as the engine streams: every
block it reads must hash to what analysis recorded. A mismatch aborts the
transaction: nothing is published, the intent is aborted, and the error names
the model, file, tensor and block.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.errors import ModelChangedError
from mergepipe.planner.planner import Planner
from mergepipe.spec.plan import Plan
from mergepipe.spec.request import MergeRequest
from tests.planner.support import block_ranges, load_tensors, raw_layout, snapshot_files

BLOCK_BYTES = 4096


@pytest.fixture
def family(tiny_family, tmp_path) -> dict[str, Path]:
    """Private copies (the tests damage files) of the base and two experts, registered and analysed."""
    paths = {name: Path(shutil.copytree(tiny_family[name], tmp_path / name)) for name in ("base", "e1", "e3")}
    with Catalog.create(tmp_path / "c.db", BLOCK_BYTES) as catalog:
        for name, path in paths.items():
            register_model(catalog, name, path)
        analyze(catalog, ["e1", "e3"], base_id="base", progress=False)
    return paths


def flip(model_dir: Path, tensor: str, block: int, length: int = 4096) -> Path:
    """Invert ``length`` bytes at the start of a block, keeping size and mtime."""
    t = raw_layout(model_dir)[tensor]
    begin, end = block_ranges(t, BLOCK_BYTES)[block]
    st = os.stat(t.file)
    with open(t.file, "r+b") as fh:
        fh.seek(begin)
        data = fh.read(min(length, end - begin))
        fh.seek(begin)
        fh.write(bytes(b ^ 0xFF for b in data))
    os.utime(t.file, ns=(st.st_atime_ns, st.st_mtime_ns))
    return t.file


def plan_for(catalog: Catalog, budget: str = "100%") -> Plan:
    return Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e3"], operator="ties", params={"density": 0.5}, budget=budget))


def assert_refused(catalog: Catalog, plan: Plan, out: Path, *needles: str) -> None:
    with pytest.raises(ModelChangedError) as info:
        Engine(catalog).execute(plan, out=out, model_id="merged")
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if "staging" in p.name] == []
    assert [s.status for s in catalog.snapshots.list()] == ["aborted"]
    assert not catalog.models.exists("merged")


def test_a_changed_expert_block_aborts_the_merge(family, tmp_path):
    with Catalog.open(tmp_path / "c.db") as catalog:
        plan = plan_for(catalog)
        tensor = "model.layers.1.mlp.down_proj.weight"
        block = plan.reads[tensor]["e1"][0]
        path = flip(family["e1"], tensor, block)
        assert_refused(catalog, plan, tmp_path / "out", "'e1'", str(path), tensor, f"block {block}")


@pytest.mark.parametrize("tensor", ["model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.q_proj.weight"])
def test_a_changed_base_block_aborts_the_merge(family, tmp_path, tensor):
    """Copied blocks (a norm no expert changes) and merged ones are both checked."""
    with Catalog.open(tmp_path / "c.db") as catalog:
        plan = plan_for(catalog)
        path = flip(family["base"], tensor, 0, length=64)
        assert_refused(catalog, plan, tmp_path / "out", "'base'", str(path), tensor, "block 0")


def test_a_change_after_plan_save_is_caught_at_execute(family, tmp_path):
    with Catalog.open(tmp_path / "c.db") as catalog:
        plan = plan_for(catalog, "40%")
        catalog.plans.save(plan.digest, plan.to_json_str())
        stored = Plan.from_json(catalog.plans.get(plan.digest[:12]))
        tensor, per = next((t, per) for t, per in stored.reads.items() if per.get("e3"))
        flip(family["e3"], tensor, per["e3"][-1])
        assert_refused(catalog, stored, tmp_path / "out", "'e3'", tensor)


def test_an_unread_block_recorded_identical_to_the_base_stays_the_base(family, tmp_path):
    """e3 leaves the embedding untouched (recorded identical): a later change
    there is never read, and the merge uses the recorded content — the base's
    block, which the base's own check covers."""
    with Catalog.open(tmp_path / "c.db") as catalog:
        plan = plan_for(catalog)
        assert "e3" not in plan.reads.get("model.embed_tokens.weight", {})
        reference = tmp_path / "reference"
        Engine(catalog).execute(plan, out=reference, model_id="reference")
    with Catalog.open(tmp_path / "c.db") as catalog:
        flip(family["e3"], "model.embed_tokens.weight", 0)
        Engine(catalog).execute(plan_for(catalog, "99%"), out=tmp_path / "out", model_id="merged")
    want, got = load_tensors(reference), load_tensors(tmp_path / "out")
    assert want["model.embed_tokens.weight"].equal(got["model.embed_tokens.weight"])
    assert set(snapshot_files(tmp_path / "out")) == set(snapshot_files(reference))
