"""Model versions: a retrained expert is a new version of its id; names mean the latest version."""

from __future__ import annotations

import pytest

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.export_delta import export_delta
from mergepipe.analysis.register import register
from mergepipe.analysis.register import changes, drop, droppable
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.errors import CatalogError, ConfigError, UnknownModelError
from mergepipe.planner.planner import Planner
from mergepipe.spec.request import MergeRequest
from tests.fixtures.checkpoints import make_expert

BLOCK_BYTES = 4096


@pytest.fixture
def catalog(tiny_family, tmp_path):
    with Catalog.create(tmp_path / "c.db", BLOCK_BYTES) as catalog:
        for name in ("base", "e1", "e2"):
            register(catalog, name, tiny_family[name])
        yield catalog


@pytest.fixture(scope="module")
def retrained(tiny_family, tmp_path_factory):
    """e1 retrained: other content in its layer-1 tensors only."""
    root = tmp_path_factory.mktemp("retrained")
    return make_expert(tiny_family["e1"], root / "e1-v2", seed=77, touch=lambda n: ".layers.1." in n)


def test_other_content_needs_new_version_and_nothing_is_written_without_it(catalog, retrained):
    with pytest.raises(CatalogError, match="register it as version 2 with --new-version"):
        register(catalog, "e1", retrained)
    assert [v.id for v in catalog.models.versions("e1")] == ["e1"]
    done = register(catalog, "e1", retrained, new_version=True)
    assert done.status == "new version"
    assert (done.record.id, done.record.name, done.record.version) == ("e1@2", "e1", 2)
    assert [v.label for v in catalog.models.versions("e1")] == ["e1@1", "e1@2"]


def test_identical_content_is_a_no_op_that_says_so(catalog, tiny_family, retrained):
    assert register(catalog, "e1", tiny_family["e1"]).status == "unchanged"
    register(catalog, "e1", retrained, new_version=True)
    again = register(catalog, "e1", retrained, new_version=True)
    assert again.status == "unchanged" and again.record.id == "e1@2"
    assert len(catalog.models.versions("e1")) == 2


def test_names_resolve_to_the_latest_version_and_name_at_n_to_that_version(catalog, retrained):
    register(catalog, "e1", retrained, new_version=True)
    assert catalog.models.resolve("e1").id == "e1@2"
    assert catalog.models.resolve("e1@1").id == "e1"
    assert catalog.models.resolve("e1@2").id == "e1@2"
    assert catalog.models.resolve("e2").id == "e2"
    for ref in ("e1@3", "e9", "e1@0"):
        with pytest.raises(UnknownModelError, match=f"unknown model '{ref}'"):
            catalog.models.resolve(ref)
    with pytest.raises(ConfigError, match="names a version"):
        register(catalog, "e7@2", retrained)


def test_plans_and_analyses_name_exact_versions(catalog, retrained):
    register(catalog, "e1", retrained, new_version=True)
    report = analyze(catalog, ["e1", "e1@1", "e2"], base_id="base", progress=False)
    assert set(report.analyzed) == {"e1@2", "e1", "e2"}
    latest = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", params={"density": 0.5}, expert_params={"e1": {"weight": 0.5}}))
    first = Planner(catalog).plan(MergeRequest(base="base", experts=["e1@1", "e2"], operator="ties", params={"density": 0.5}))
    assert [e.id for e in latest.experts] == ["e1@2", "e2"]
    assert (latest.merge.experts[0].expert_id, latest.merge.experts[0].params) == ("e1@2", {"weight": 0.5})
    assert [e.id for e in first.experts] == ["e1", "e2"]
    assert latest.digest != first.digest


def test_changes_between_versions_count_tensors_and_blocks(catalog, retrained):
    register(catalog, "e1", retrained, new_version=True)
    v1, v2 = catalog.models.versions("e1")
    before = changes(catalog, v1, v2)
    assert before.blocks_changed is None and "not hashed" in before.describe()
    analyze(catalog, ["e1", "e1@1"], progress=False)  # hashes only
    after = changes(catalog, v1, v2)
    layer1 = [t for t in catalog.models.tensors("e1") if ".layers.1." in t.name]
    assert after.tensors_changed == len(layer1)
    blocks = catalog.blocks.by_tensor("e1")
    assert after.blocks_changed == sum(len(blocks[t.name]) for t in layer1)  # dense changes: every block


def test_merging_under_a_published_name_publishes_its_next_version(catalog, tmp_path):
    analyze(catalog, ["e1", "e2"], base_id="base", progress=False)
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="task_arithmetic"))
    first, _ = Engine(catalog).execute(plan, out=tmp_path / "m1", model_id="merged")
    plan2 = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="task_arithmetic", weights=[0.3, 0.7]))
    second, manifest = Engine(catalog).execute(plan2, out=tmp_path / "m2", model_id="merged")
    assert [v.id for v in catalog.models.versions("merged")] == ["merged", "merged@2"]
    assert manifest.model_id == "merged@2"
    assert catalog.snapshots.of_model("merged@2").id == second
    assert catalog.snapshots.of_model("merged").id == first  # version 1 keeps its snapshot
    # a plan never executed (plan2 again would re-materialise its snapshot, tests/cli/test_rerun.py)
    plan3 = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="task_arithmetic", weights=[0.6, 0.4]))
    with pytest.raises(CatalogError, match="registered checkpoint, not a merged model"):
        Engine(catalog).execute(plan3, out=tmp_path / "m3", model_id="e1")
    with pytest.raises(CatalogError, match="names a version"):
        Engine(catalog).execute(plan3, out=tmp_path / "m3", model_id="merged@3")
    assert not (tmp_path / "m3").exists()


def test_gc_drops_only_old_versions_no_snapshot_used(catalog, tiny_family, retrained, tmp_path):
    register(catalog, "e2", retrained, new_version=True)  # e2@1 will be used by a snapshot
    register(catalog, "e1", retrained, new_version=True)  # e1@1 will not
    analyze(catalog, ["e2@1", "e1"], base_id="base", progress=False)
    Engine(catalog).execute(Planner(catalog).plan(MergeRequest(base="base", experts=["e2@1", "e1"], operator="task_arithmetic")),
                            out=tmp_path / "m", model_id="m")
    assert [r.id for r in droppable(catalog)] == ["e1"]
    drop(catalog, droppable(catalog))
    assert [v.id for v in catalog.models.versions("e1")] == ["e1@2"]
    assert catalog.models.resolve("e1").id == "e1@2" and catalog.models.find("e2") is not None
    assert (tiny_family["e1"] / "model.safetensors").exists()  # user files stay


def test_a_new_version_inherits_the_statistics_of_its_unchanged_tensors(catalog, tiny_family, retrained, tmp_path):
    analyze(catalog, ["e1"], base_id="base", progress=False)
    register(catalog, "e1", retrained, new_version=True)
    report = analyze(catalog, ["e1"], base_id="base", progress=False)
    layer1 = {t.name for t in catalog.models.tensors("e1@2") if ".layers.1." in t.name}
    total = len(catalog.models.tensors("e1@2"))
    assert report.analyzed == ("e1@2",) and report.inherited == {"e1@2": (total - len(layer1), total)}
    # the changed tensors were read twice (hashing, then with the base), the others once, the base only for them
    sizes = {t.name: t.nbytes for t in catalog.models.tensors("e1@2")}
    assert report.bytes_by_model["e1@2"] == sum(sizes.values()) + sum(sizes[n] for n in layer1)
    assert report.bytes_by_model["base"] == sum(sizes[n] for n in layer1)
    # the result equals a from-scratch analysis of the same files in a fresh catalog
    with Catalog.create(tmp_path / "fresh.db", BLOCK_BYTES) as fresh:
        register(fresh, "base", tiny_family["base"])
        register(fresh, "x", retrained)
        analyze(fresh, ["x"], base_id="base", progress=False)
        assert catalog.stats.block_deltas("e1@2", "base") == fresh.stats.block_deltas("x", "base")
        assert catalog.stats.tensor_stats("e1@2", "base") == fresh.stats.tensor_stats("x", "base")
        assert catalog.blocks.hashes("e1@2") == fresh.blocks.hashes("x")


def test_a_failed_read_of_a_new_version_stops_its_analysis_and_records_nothing(catalog, retrained, monkeypatch):
    """The new version is hashed first, in a call of its own: its failure is the analysis's, and nothing of
    the version is recorded."""
    import mergepipe.analysis.analyze as incremental

    analyze(catalog, ["e1"], base_id="base", progress=False)
    register(catalog, "e1", retrained, new_version=True)
    calls, hash_window = [], incremental.hash_window

    def failing(item, views):
        calls.append(item)
        if len(calls) == 3:
            raise OSError(5, "Input/output error")
        return hash_window(item, views)

    monkeypatch.setattr(incremental, "hash_window", failing)
    with pytest.raises(OSError, match="Input/output error"):
        analyze(catalog, ["e1"], base_id="base", progress=False)
    assert not catalog.stats.is_analyzed("e1@2", "base") and catalog.blocks.hashed_count("e1@2") == 0
    monkeypatch.undo()
    assert analyze(catalog, ["e1"], base_id="base", progress=False).analyzed == ("e1@2",)


def test_gc_drops_old_versions_of_a_delta_checkpoint_too(catalog, tiny_family, retrained, tmp_path):
    """Delta checkpoints (and LoRA adapters) are versioned like checkpoints, and gc drops their old versions."""
    register(catalog, "e1-new", retrained)
    export_delta(catalog, "e1", tmp_path / "d1", base="base")
    export_delta(catalog, "e1-new", tmp_path / "d2", base="base")
    register(catalog, "e1d", tmp_path / "d1", kind="delta", base="base")
    register(catalog, "e1d", tmp_path / "d2", kind="delta", base="base", new_version=True)
    assert [r.id for r in droppable(catalog)] == ["e1d"]  # version 1, which no snapshot used
    drop(catalog, droppable(catalog))
    assert [v.id for v in catalog.models.versions("e1d")] == ["e1d@2"]
    assert (tmp_path / "d1" / "mergepipe_delta.json").exists()  # the files stay: gc removes catalog rows
