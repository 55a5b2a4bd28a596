"""``Plan.out_shard_bytes``: the output written as Hugging Face shards of a size, from any base layout.

What is expected comes from outside the engine: tensor sizes and shard
contents from the raw safetensors headers (tests/planner/support.py), the
packing from its defining properties (base order, each shard within the
limit unless it holds one tensor, each shard closed only when the next tensor
would not fit), values through the safetensors library and transformers.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.errors import ConfigError
from mergepipe.planner.planner import Planner
from mergepipe.txn.recover import recover
from mergepipe.txn.verify import verify_snapshot
from mergepipe.spec.request import MergeRequest
from tests.fixtures.checkpoints import load_tensors, make_expert
from tests.planner.support import build_catalog, clone_catalog, raw_layout, run_forked, snapshot_files

BLOCK_BYTES = 4096
INDEX = "model.safetensors.index.json"
#: shard limits for the tiny Llama (embeddings and lm_head 32000 bytes, MLP matrices 15360, norms 128):
#: every tensor alone, big tensors alone among packed ones, a few shards, one file
LIMITS = (1, 20_000, 70_000, 10**9)


def merge(catalog: Catalog, out: Path, model_id: str, experts=("e1", "e2"), **options):
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=list(experts), operator="ties", weights=[1.0, 0.6], params={"density": 0.5}, budget="60%", **options))
    _, manifest = Engine(catalog).execute(plan, out=out, model_id=model_id)
    return plan, manifest


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sharding")
    return build_catalog(root / "template.db", BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2"])


@pytest.fixture
def catalog(template, tmp_path):
    with Catalog.open(clone_catalog(template, tmp_path / "c.db")) as catalog:
        yield catalog


@pytest.fixture(scope="module")
def unsharded(template, tmp_path_factory) -> Path:
    """The same merge, written in the base's layout (one model.safetensors)."""
    root = tmp_path_factory.mktemp("unsharded")
    with Catalog.open(clone_catalog(template, root / "c.db")) as catalog:
        merge(catalog, root / "out", "plain")
    return root / "out"


def shards_of(directory: Path) -> dict[str, list[tuple[str, int]]]:
    """File name -> its tensors (name, bytes) in data order, from the raw headers."""
    out: dict[str, list[tuple[int, str, int]]] = {}
    for t in raw_layout(directory).values():
        out.setdefault(t.file.name, []).append((t.begin, t.name, t.nbytes))
    return {name: [(n, size) for _, n, size in sorted(entries)] for name, entries in out.items()}


def assert_greedy_shards(directory: Path, order: list[tuple[str, int]], limit: int) -> None:
    """The shards in ``directory`` are the greedy packing of ``order`` (name, output bytes) under ``limit``,
    with Hugging Face's names and index."""
    found = shards_of(directory)
    count = len(found)
    names = ["model.safetensors"] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors"
                                                      for i in range(1, count + 1)]
    assert sorted(found) == names
    shards = [found[name] for name in names]
    assert [t for shard in shards for t in shard] == order  # the base's tensors, in its order
    for i, shard in enumerate(shards):
        size = sum(n for _, n in shard)
        assert size <= limit or len(shard) == 1, (names[i], size)
        if i + 1 < count:  # closed only because the next tensor did not fit
            assert size + shards[i + 1][0][1] > limit, (names[i], size)
    if count == 1:
        assert not (directory / INDEX).exists()
        return
    index = json.loads((directory / INDEX).read_text())
    assert index == {"metadata": {"total_size": sum(n for _, n in order)},
                     "weight_map": {t: name for name in names for t, _ in found[name]}}
    assert list(index["weight_map"]) == sorted(index["weight_map"])


def merged_files(directory: Path) -> dict[str, bytes]:
    """The weights, the index and the side files (not those naming the snapshot: manifest, card, config YAML)."""
    return {name: data for name, data in snapshot_files(directory).items() if name.endswith((".safetensors", ".json"))}


def base_order(directory: Path) -> list[tuple[str, int]]:
    return [t for shard in sorted(shards_of(directory).items()) for t in shard[1]]


@pytest.mark.parametrize("limit", LIMITS)
def test_a_sharded_output_holds_the_same_tensors_in_greedy_shards(catalog, tiny_family, unsharded, tmp_path, limit):
    plan, manifest = merge(catalog, tmp_path / "out", "sharded", out_shard_bytes=limit)
    assert plan.out_shard_bytes == limit
    assert_greedy_shards(tmp_path / "out", base_order(tiny_family["base"]), limit)
    got, want = load_tensors(tmp_path / "out"), load_tensors(unsharded)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)
    # the manifest lists (and verify checks) every shard and the index
    assert {f.name for f in manifest.files} >= set(shards_of(tmp_path / "out"))
    assert (INDEX in {f.name for f in manifest.files}) == (len(shards_of(tmp_path / "out")) > 1)
    report = verify_snapshot(tmp_path / "out")
    assert report.ok, report.problems
    # other files are the base's, copied as they are
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tiny_family["base"] / name).read_bytes()


def test_without_the_option_the_output_mirrors_the_base(catalog, unsharded):
    assert sorted(shards_of(unsharded)) == ["model.safetensors"] and not (unsharded / INDEX).exists()
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", params={"density": 0.5}, budget="60%"))
    sharded = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", params={"density": 0.5}, budget="60%", out_shard_bytes=10**9))
    assert "out_shard_bytes" not in plan.to_json() and plan.out_shard_bytes is None
    assert sharded.digest != plan.digest  # the same tensors, other files: another plan


def test_transformers_loads_a_sharded_output(catalog, unsharded, tmp_path):
    from transformers import AutoModelForCausalLM

    merge(catalog, tmp_path / "out", "sharded", out_shard_bytes=20_000)
    assert len(shards_of(tmp_path / "out")) > 3

    def logits(directory: Path) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(directory).eval()
        with torch.no_grad():
            return model(torch.tensor([[1, 5, 9, 200, 3, 17]])).logits

    assert torch.equal(logits(tmp_path / "out"), logits(unsharded))


def test_a_sharded_base_is_resharded_by_output_bytes(sharded_family, tmp_path):
    """A Qwen3 base in 40 KB shards, merged into f32 (twice its bytes): one file, or shards of f32 sizes."""
    db = build_catalog(tmp_path / "c.db", BLOCK_BYTES, dict(sharded_family), base="base", experts=["e1", "e2"])
    outputs = {}
    for label, limit in (("mirror", None), ("one", 10**9), ("many", 50_000)):
        with Catalog.open(clone_catalog(db, tmp_path / f"{label}.db")) as catalog:
            merge(catalog, tmp_path / label, label, out_dtype="f32", out_shard_bytes=limit)
        outputs[label] = load_tensors(tmp_path / label)
    assert sorted(shards_of(tmp_path / "mirror")) == sorted(shards_of(sharded_family["base"]))
    order = [(name, size * 2) for name, size in base_order(sharded_family["base"])]  # bf16 -> f32
    assert_greedy_shards(tmp_path / "one", order, 10**9)
    assert_greedy_shards(tmp_path / "many", order, 50_000)
    for label in ("one", "many"):
        assert outputs[label].keys() == outputs["mirror"].keys()
        assert all(torch.equal(outputs[label][k], v) and v.dtype == torch.float32
                   for k, v in outputs["mirror"].items())


@pytest.mark.parametrize("value", [0, -1, True, 2.5, "5"])
def test_a_bad_shard_size_is_refused_when_planning(catalog, value):
    with pytest.raises(ConfigError, match="output shard size"):
        Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", params={"density": 0.5}, out_shard_bytes=value))


def test_recover_commits_a_sharded_snapshot_killed_after_its_rename(catalog, template, tmp_path):
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", params={"density": 0.5}, budget="60%", out_shard_bytes=20_000))
    (tmp_path / "plan.json").write_text(plan.to_json_str())
    _, reference = Engine(catalog).execute(plan, out=tmp_path / "reference", model_id="m")
    reference_outputs = catalog.snapshots.outputs("m")
    (tmp_path / "parent").mkdir()
    db = clone_catalog(template, tmp_path / "crash.db")
    job = {"db": str(db), "plan": str(tmp_path / "plan.json"), "out": str(tmp_path / "parent" / "out"),
           "model_id": "m", "mode": "step:renamed"}
    (status,) = run_forked([job], tmp_path / "runner")
    assert status["signal"] == signal.SIGKILL, status
    with Catalog.open(db) as crashed:
        assert not recover(crashed).problems
        (record,) = [s for s in crashed.snapshots.list() if s.status == "committed"]
        assert record.manifest_hash == reference.manifest_hash
        recovered = crashed.snapshots.outputs("m")
        assert {k: (v.key, v.hash) for k, v in recovered.items()} == {
            k: (v.key, v.hash) for k, v in reference_outputs.items()}
    assert verify_snapshot(tmp_path / "parent" / "out").ok
    assert snapshot_files(tmp_path / "parent" / "out") == snapshot_files(tmp_path / "reference")


# ------------------------------------------------------------------ incremental merges


def in_layer1(name: str) -> bool:
    return ".layers.1." in name


@pytest.mark.parametrize("before, after", [(20_000, 20_000), (None, 20_000), (70_000, None), (20_000, 70_000)])
def test_an_incremental_merge_across_shardings_is_the_from_scratch_merge(catalog, tiny_family, tmp_path,
                                                                          before, after):
    """v1 in one layout; e1 retrained in layer 1; v2 --from v1 in another layout == v2 from scratch."""
    merge(catalog, tmp_path / "v1", "merged", out_shard_bytes=before)
    retrained = make_expert(tiny_family["e1"], tmp_path / "e1-v2", seed=77, touch=in_layer1)
    register(catalog, "e1", retrained, new_version=True)
    analyze(catalog, ["e1"], base_id="base", progress=False)
    plan, manifest = merge(catalog, tmp_path / "v2", "merged", previous="merged", out_shard_bytes=after)
    scratch, from_scratch = merge(catalog, tmp_path / "scratch", "scratch", out_shard_bytes=after)
    assert plan.reuse.blocks and not any(in_layer1(t) for t in plan.reuse.blocks)  # layer 1 is recomputed
    assert manifest.cost.realized.expert_bytes < from_scratch.cost.realized.expert_bytes
    assert merged_files(tmp_path / "v2") == merged_files(tmp_path / "scratch")  # bit-identical
    assert verify_snapshot(tmp_path / "v2").ok
