"""Incremental merges (``merge --from``): reuse what did not change, bit-identical to from scratch."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.errors import ConfigError, ModelChangedError
from mergepipe.planner.planner import Planner
from mergepipe.storage.source import block_digest
from mergepipe.txn.recover import recover
from mergepipe.txn.verify import verify_snapshot
from mergepipe.spec.request import MergeRequest
from tests.fixtures.checkpoints import make_expert
from tests.planner.support import run_forked

BLOCK_BYTES = 4096
EXPERTS = ("e1", "e2", "e3", "e4")
MERGES = {  # operator -> (params, seed)
    "ties": ({"density": 0.5}, 0),
    "task_arithmetic": ({}, 0),
    "dare_ties": ({"density": 0.6}, 7),
    "linear": ({}, 0),  # normalised weights: every expert enters every block
}


def in_layer1(name: str) -> bool:
    return ".layers.1." in name


@pytest.fixture(scope="module")
def family(tiny_family, tmp_path_factory) -> dict[str, Path]:
    """Four experts, e1 retrained (e1's tensors, other content in layer 1), and a fifth expert."""
    root = tmp_path_factory.mktemp("incremental")
    base = tiny_family["base"]
    return {
        **{name: tiny_family[name] for name in ("base", "e1", "e2", "e3")},
        "e4": make_expert(base, root / "e4", seed=4, scale=0.01),
        "e1-v2": make_expert(tiny_family["e1"], root / "e1-v2", seed=77, touch=in_layer1),
        "e5": make_expert(base, root / "e5", seed=5, touch=lambda n: "mlp" in n),  # an MLP-only expert
    }


@pytest.fixture
def catalog(family, tmp_path):
    with Catalog.create(tmp_path / "c.db", BLOCK_BYTES) as catalog:
        for name in ("base", *EXPERTS):
            register(catalog, name, family[name])
        analyze(catalog, list(EXPERTS), base_id="base", progress=False)
        yield catalog


def merge(catalog, out: Path, model_id: str, experts=EXPERTS, operator="ties", previous=None, params=None):
    default, seed = MERGES[operator]
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=list(experts), operator=operator, params=params or default, seed=seed, previous=previous))
    _, manifest = Engine(catalog).execute(plan, out=out, model_id=model_id)
    return plan, manifest


def weights(out: Path) -> bytes:
    return (out / "model.safetensors").read_bytes()


def planned_bytes(catalog, plan, tensors) -> dict[str, int]:
    """Bytes of each expert's planned blocks in ``tensors``, from the catalog (an independent count)."""
    out = {}
    for expert in plan.merge.expert_ids:
        blocks = catalog.blocks.by_tensor(expert)
        out[expert] = sum(blocks[t][b].end - blocks[t][b].begin
                          for t in tensors for b in plan.reads_of(t, expert))
    return out


@pytest.mark.parametrize("operator", ["dare_ties", "task_arithmetic", "ties"])
def test_a_retrained_expert_recomputes_only_its_changed_tensors(catalog, family, tmp_path, operator):
    merge(catalog, tmp_path / "v1", "merged", operator=operator)
    register(catalog, "e1", family["e1-v2"], new_version=True)
    analyze(catalog, ["e1"], base_id="base", progress=False)

    plan, manifest = merge(catalog, tmp_path / "v2", "merged", operator=operator, previous="merged")
    scratch, _ = merge(catalog, tmp_path / "scratch", "scratch", operator=operator)

    assert weights(tmp_path / "v2") == weights(tmp_path / "scratch")  # bit-identical
    names = [t.name for t in catalog.models.tensors("base")]
    changed = [n for n in names if in_layer1(n)]
    assert set(plan.reuse.blocks) == {n for n in names if not in_layer1(n)}
    assert plan.reads == scratch.reads  # the same plan, less what is reused
    # experts were read for the changed tensors only: exactly their planned blocks
    assert manifest.cost.realized.expert_bytes_by_model == planned_bytes(catalog, plan, changed)
    assert manifest.model_id == "merged@2"
    blocks = catalog.blocks.by_tensor("base")
    reused_bytes = sum(blocks[t][b].end - blocks[t][b].begin for t, ix in plan.reuse.blocks.items() for b in ix)
    assert manifest.extra["reuse"]["bytes"] == plan.reuse.output_bytes == reused_bytes  # bf16 in, bf16 out
    assert manifest.cost.realized.base_bytes == sum(t.nbytes for t in catalog.models.tensors("base")
                                                    if in_layer1(t.name))


def test_the_recorded_output_blocks_describe_the_published_bytes(catalog, tmp_path):
    merge(catalog, tmp_path / "v1", "merged", operator="task_arithmetic")
    data = weights(tmp_path / "v1")
    recorded = catalog.snapshots.outputs("merged")
    published = catalog.blocks.by_tensor("merged")  # the snapshot's own blocks: absolute offsets in its file
    assert set(recorded) == {(t, b.index) for t, blocks in published.items() for b in blocks}
    for tensor, blocks in published.items():
        for b in blocks:
            assert recorded[(tensor, b.index)].hash == block_digest(data[b.begin:b.end])
            values = torch.frombuffer(bytearray(data[b.begin:b.end]), dtype=torch.bfloat16).float()
            assert float(values.norm()) <= recorded[(tensor, b.index)].l2 <= float(values.norm()) * 1.01  # merged


def test_nothing_changed_reuses_every_merged_block_and_reads_no_expert(catalog, tmp_path):
    merge(catalog, tmp_path / "v1", "merged", operator="task_arithmetic")
    _, manifest = merge(catalog, tmp_path / "v2", "merged", operator="task_arithmetic", previous="merged")
    assert manifest.cost.realized.expert_bytes == 0
    assert weights(tmp_path / "v2") == weights(tmp_path / "v1")


@pytest.mark.parametrize("operator", sorted(MERGES))
def test_a_fifth_expert_recomputes_what_it_takes_part_in(catalog, family, tmp_path, operator):
    merge(catalog, tmp_path / "v1", "merged", operator=operator)
    register(catalog, "e5", family["e5"])
    analyze(catalog, ["e5"], base_id="base", progress=False)
    experts = (*EXPERTS, "e5")
    plan, manifest = merge(catalog, tmp_path / "v2", "merged", experts=experts, operator=operator, previous="merged")
    merge(catalog, tmp_path / "scratch", "scratch", experts=experts, operator=operator)
    assert weights(tmp_path / "v2") == weights(tmp_path / "scratch")
    names = [t.name for t in catalog.models.tensors("base")]
    if operator == "linear":  # Σw changes: every block changes
        assert plan.reuse.blocks == {} and manifest.extra["reuse"]["blocks"] == 0
        return
    # TIES consensus, unnormalised sums: an expert takes no part where it is not read (its MLPs only)
    assert set(plan.reuse.blocks) == {n for n in names if "mlp" not in n}
    # a consensus operator says what the new expert recomputes: every block it changed (counted here from the
    # catalog's block statistics), none of them a reuse miss
    changed = sum(1 for d in catalog.stats.block_deltas("e5", "base").values() for b in d if not b.identical)
    said = [n for n in plan.notes if n.startswith("adding 'e5' changes the consensus of")]
    if operator in ("ties", "dare_ties"):
        assert said == [f"adding 'e5' changes the consensus of {changed} blocks ({operator} elects every entry's "
                        "sign from all experts): recomputed, as a merge from scratch would"]
    else:
        assert said == []
    mlp = [n for n in names if "mlp" in n]
    assert manifest.cost.realized.expert_bytes_by_model == planned_bytes(catalog, plan, mlp)


def test_one_changed_parameter_recomputes_only_the_tensors_it_applies_to(catalog, tmp_path):
    merge(catalog, tmp_path / "v1", "merged")
    params = {"density": [{"filter": "self_attn", "value": 0.3}, {"value": 0.5}]}
    plan, manifest = merge(catalog, tmp_path / "v2", "merged", previous="merged", params=params)
    scratch, _ = merge(catalog, tmp_path / "scratch", "scratch", params=params)
    names = [t.name for t in catalog.models.tensors("base")]
    assert set(plan.reuse.blocks) == {n for n in names if "self_attn" not in n}
    assert weights(tmp_path / "v2") == weights(tmp_path / "scratch")
    attn = [n for n in names if "self_attn" in n]
    assert manifest.cost.realized.expert_bytes_by_model == planned_bytes(catalog, scratch, attn)


def test_a_tampered_previous_snapshot_is_refused_and_nothing_is_written(catalog, family, tmp_path):
    merge(catalog, tmp_path / "v1", "merged")
    register(catalog, "e1", family["e1-v2"], new_version=True)
    analyze(catalog, ["e1"], base_id="base", progress=False)
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=list(EXPERTS), operator="ties", params={"density": 0.5}, previous="merged"))
    path = tmp_path / "v1" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's data; same size
    path.write_bytes(bytes(data))
    with pytest.raises(ModelChangedError, match="previous snapshot changed after it was published"):
        Engine(catalog).execute(plan, out=tmp_path / "v2", model_id="merged")
    assert not (tmp_path / "v2").exists()
    assert [v.id for v in catalog.models.versions("merged")] == ["merged"]
    path.unlink()
    with pytest.raises(ModelChangedError, match="cannot be reused: .*model.safetensors is missing"):
        Engine(catalog).execute(plan, out=tmp_path / "v2", model_id="merged")


def test_from_must_name_a_committed_merge(catalog, tmp_path):
    with pytest.raises(ConfigError, match="'e1' is a registered checkpoint, not a merged model"):
        Planner(catalog).plan(MergeRequest(base="base", experts=list(EXPERTS), operator="ties", previous="e1"))
    with pytest.raises(Exception, match="unknown model 'nothing'"):
        Planner(catalog).plan(MergeRequest(base="base", experts=list(EXPERTS), operator="ties", previous="nothing"))
    merge(catalog, tmp_path / "v1", "merged")
    snapshot = catalog.snapshots.of_model("merged").id
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=list(EXPERTS), operator="ties", params={"density": 0.5}, previous=snapshot))
    assert plan.reuse.snapshot == "merged" and plan.reuse.block_count > 0


@pytest.mark.parametrize("mode", ["read:3", "write:2", "step:fsynced"])
def test_a_killed_incremental_merge_leaves_the_previous_version_and_no_partial_new_one(family, tmp_path, mode):
    db = tmp_path / "c.db"
    with Catalog.create(db, BLOCK_BYTES) as catalog:
        for name in ("base", *EXPERTS):
            register(catalog, name, family[name])
        analyze(catalog, list(EXPERTS), base_id="base", progress=False)
        merge(catalog, tmp_path / "v1", "merged")
        before = catalog.snapshots.of_model("merged").manifest_hash
        register(catalog, "e1", family["e1-v2"], new_version=True)
        analyze(catalog, ["e1"], base_id="base", progress=False)
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=list(EXPERTS), operator="ties", params={"density": 0.5}, previous="merged"))
    assert plan.reuse.block_count > 0
    (tmp_path / "plan.json").write_text(plan.to_json_str())
    (status,) = run_forked([{"db": str(db), "plan": str(tmp_path / "plan.json"), "out": str(tmp_path / "v2"),
                             "model_id": "merged", "mode": mode}], tmp_path / "runner")
    assert status["signal"] == signal.SIGKILL, status
    assert not (tmp_path / "v2").exists()
    with Catalog.open(db) as catalog:
        recover(catalog)
        assert [v.id for v in catalog.models.versions("merged")] == ["merged"]
        check = verify_snapshot(tmp_path / "v1")
        assert check.ok and check.manifest.manifest_hash == before
        # and the same plan still runs to the from-scratch bytes
        Engine(catalog).execute(plan, out=tmp_path / "v2", model_id="merged")
        scratch = Planner(catalog).plan(MergeRequest(base="base", experts=list(EXPERTS), operator="ties", params={"density": 0.5}))
        Engine(catalog).execute(scratch, out=tmp_path / "scratch", model_id="scratch")
    assert weights(tmp_path / "v2") == weights(tmp_path / "scratch")


def frobenius_difference(a: Path, b: Path) -> float:
    from safetensors import safe_open
    total = 0.0
    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb:
        for name in fa.keys():
            total += float(((fa.get_tensor(name).double() - fb.get_tensor(name).double()) ** 2).sum())
    return total ** 0.5


@pytest.mark.parametrize("operator", ["task_arithmetic", "linear"])
def test_delta_updates_read_only_the_replaced_expert_and_stay_within_the_bound(catalog, family, tmp_path, operator):
    merge(catalog, tmp_path / "v1", "merged", operator=operator)
    register(catalog, "e1", family["e1-v2"], new_version=True)
    analyze(catalog, ["e1"], base_id="base", progress=False)
    default, _ = MERGES[operator]
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=list(EXPERTS), operator=operator, params=default, previous="merged", delta_update=True))
    _, manifest = Engine(catalog).execute(plan, out=tmp_path / "v2", model_id="merged")
    merge(catalog, tmp_path / "scratch", "scratch", operator=operator)

    names = [t.name for t in catalog.models.tensors("base")]
    changed = [n for n in names if in_layer1(n)]
    assert set(plan.reuse.updated) == set(changed) and set(plan.reuse.blocks) == set(names) - set(changed)
    assert plan.reuse.replaced == {"e1@2": "e1"}
    # only e1's two versions were read, for the changed tensors: its new blocks and as many old ones
    twice = 2 * planned_bytes(catalog, plan, changed)["e1@2"]
    assert manifest.cost.realized.expert_bytes_by_model == {"e1@2": twice, "e2": 0, "e3": 0, "e4": 0}
    assert manifest.cost.realized.base_bytes == 0
    assert manifest.extra["reuse"]["delta_updated"]["bound"] == plan.reuse.bound > 0
    assert manifest.error_bound.realized is None and plan.error_bound == pytest.approx(plan.reuse.bound)
    measured = frobenius_difference(tmp_path / "v2", tmp_path / "scratch")
    assert 0 <= measured <= plan.reuse.bound
    # an updated block is never reused as if it were computed: merging again recomputes it exactly
    again = Planner(catalog).plan(MergeRequest(base="base", experts=list(EXPERTS), operator=operator, params=default, previous="merged"))
    assert set(again.reuse.blocks) == set(names) - set(changed)
    Engine(catalog).execute(again, out=tmp_path / "v3", model_id="merged")
    assert weights(tmp_path / "v3") == weights(tmp_path / "scratch")


def test_delta_updates_need_a_fixed_coefficient_operator_and_a_previous_merge(catalog, tmp_path):
    with pytest.raises(ConfigError, match="give --from"):
        Planner(catalog).plan(MergeRequest(base="base", experts=list(EXPERTS), operator="task_arithmetic", delta_update=True))
    merge(catalog, tmp_path / "v1", "merged")
    with pytest.raises(ConfigError, match="fixed-coefficient operator .* ties is not one"):
        Planner(catalog).plan(MergeRequest(base="base", experts=list(EXPERTS), operator="ties", params={"density": 0.5}, previous="merged", delta_update=True))


@pytest.mark.parametrize("operator", ["task_arithmetic", "linear"])
def test_an_added_expert_is_a_delta_update_where_absent_experts_take_no_part(catalog, family, tmp_path, operator):
    merge(catalog, tmp_path / "v1", "merged", operator=operator)
    register(catalog, "e5", family["e5"])
    analyze(catalog, ["e5"], base_id="base", progress=False)
    experts = [*EXPERTS, "e5"]
    default, _ = MERGES[operator]
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=experts, operator=operator, params=default, previous="merged", delta_update=True))
    _, manifest = Engine(catalog).execute(plan, out=tmp_path / "v2", model_id="merged")
    merge(catalog, tmp_path / "scratch", "scratch", experts=experts, operator=operator)
    if operator == "linear":  # Σw changed: nothing reused, nothing updated, the from-scratch bytes
        assert plan.reuse.updated == {} and plan.reuse.blocks == {}
        assert weights(tmp_path / "v2") == weights(tmp_path / "scratch")
        return
    names = [t.name for t in catalog.models.tensors("base")]
    mlp = [n for n in names if "mlp" in n]
    assert set(plan.reuse.updated) == set(mlp) and plan.reuse.replaced == {"e5": "base"}
    # e5's blocks and the base's under them (base bytes); no other expert
    assert manifest.cost.realized.expert_bytes_by_model == {
        "e1": 0, "e2": 0, "e3": 0, "e4": 0, "e5": planned_bytes(catalog, plan, mlp)["e5"]}
    assert manifest.cost.realized.base_bytes == planned_bytes(catalog, plan, mlp)["e5"]  # same dtype as the base
    assert 0 < frobenius_difference(tmp_path / "v2", tmp_path / "scratch") <= plan.reuse.bound


def test_delta_updates_chain_and_carry_their_bound_and_a_plain_merge_makes_them_exact(catalog, family, tmp_path):
    ta = {"params": {}, "previous": "merged", "delta_update": True}
    merge(catalog, tmp_path / "v1", "merged", operator="task_arithmetic")
    register(catalog, "e1", family["e1-v2"], new_version=True)
    analyze(catalog, ["e1"], base_id="base", progress=False)
    Engine(catalog).execute(Planner(catalog).plan(MergeRequest(base="base", experts=list(EXPERTS), operator="task_arithmetic", **ta)),
                            out=tmp_path / "v2", model_id="merged")
    register(catalog, "e5", family["e5"])
    analyze(catalog, ["e5"], base_id="base", progress=False)
    experts = [*EXPERTS, "e5"]
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=experts, operator="task_arithmetic", **ta))
    Engine(catalog).execute(plan, out=tmp_path / "v3", model_id="merged")
    merge(catalog, tmp_path / "scratch", "scratch", experts=experts, operator="task_arithmetic")

    names = [t.name for t in catalog.models.tensors("base")]
    layer1 = {n for n in names if in_layer1(n)}
    assert set(plan.reuse.updated) == {n for n in names if "mlp" in n}  # e5's tensors, again for layer 1's
    assert set(plan.reuse.errors) == layer1 | set(plan.reuse.updated)  # layer 1 carries iteration 2's bound
    assert 0 < frobenius_difference(tmp_path / "v3", tmp_path / "scratch") <= plan.reuse.bound
    exact = Planner(catalog).plan(MergeRequest(base="base", experts=experts, operator="task_arithmetic", previous="merged"))
    assert not set(exact.reuse.blocks) & (layer1 | set(plan.reuse.updated))  # never reused without updates
    Engine(catalog).execute(exact, out=tmp_path / "v4", model_id="merged")
    assert weights(tmp_path / "v4") == weights(tmp_path / "scratch")
