"""Incremental merges without rewriting: an output shard that is wholly the previous snapshot's is placed by
a reflink or a kernel copy — a file of its own, read back and checked against the hash recorded when it was
published before it is sealed — and the reused runs of the others are copied by the kernel and checked; the
snapshots stay independent, removable and verifiable one by one, and no file is read through a symbolic link.

The chain: v1 merges e1 and e2 into 40 KB shards; e1 is retrained in layer 0 only (a new version); v2
merges again ``--from`` v1. What is expected comes from outside the engine: a shard is wholly reused
exactly when it holds no layer-0 tensor (the output's own index says which tensors each shard holds), and
every output byte must equal a merge from scratch. This machine's filesystem (ext4) has no reflinks: they
are simulated (``FICLONE`` done as a copy that says it shared the extents), and the kernel copy is what runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest

from mergepipe.catalog import Catalog
from mergepipe.planner.planner import Planner
from mergepipe.spec.request import MergeRequest
from mergepipe.storage import writer as linking
from mergepipe.txn.recover import recover
from mergepipe.txn.publish import STAGING_INFIX
from mergepipe.txn.verify import verify_snapshot
from tests.fixtures.checkpoints import make_expert
from tests.fixtures.cli import invoke, one_line_error, run_main, wide_runner
from tests.planner.support import build_catalog, raw_layout, run_forked, snapshot_files

BLOCK_BYTES = 2048
MERGE = ["--base", "base", "--experts", "e1", "e2", "--operator", "ties", "--density", "0.5",
         "--out-shard-size", "40KB", "--quiet"]


def in_layer0(name: str) -> bool:
    return ".layers.0." in name


@dataclass
class Chain:
    db: Path
    root: Path
    runner: object

    def merge(self, out: str, *extra) -> dict:
        """`merge` into ``root/out`` (``extra``: ``--from merged``...); its JSON summary."""
        summary = self.root / f"{out}.json"
        invoke(self.runner, ["merge", "--db", self.db, *MERGE, "--out", self.root / out, "--json-summary", summary,
                             *extra])
        return json.loads(summary.read_text())

    def shards(self, out: str) -> dict[str, list[str]]:
        """Each weight file of ``root/out`` -> its tensors, from the output's own index."""
        index = json.loads((self.root / out / "model.safetensors.index.json").read_text())
        by_file: dict[str, list[str]] = {}
        for tensor, file in index["weight_map"].items():
            by_file.setdefault(file, []).append(tensor)
        return by_file


@pytest.fixture
def chain(tiny_family, tmp_path, monkeypatch) -> Chain:
    """v1 published as 'merged', and e1 retrained in layer 0 registered as e1@2."""
    db = build_catalog(tmp_path / "c.db", BLOCK_BYTES, {m: tiny_family[m] for m in ("base", "e1", "e2")})
    retrained = make_expert(tiny_family["e1"], tmp_path / "e1-v2", seed=5, touch=in_layer0)
    chain = Chain(db, tmp_path, wide_runner(monkeypatch))
    chain.merge("v1", "--model-id", "merged")
    invoke(chain.runner, ["register", "--db", db, "--model-id", "e1", "--uri", retrained, "--new-version"])
    invoke(chain.runner, ["analyze", "--db", db, "--base", "base", "e1", "--no-progress"])
    return chain


def wholly_reused(chain: Chain) -> list[str]:
    """The shards without a layer-0 tensor: those e1's retraining left alone."""
    return sorted(f for f, tensors in chain.shards("v1").items() if not any(in_layer0(t) for t in tensors))


def same_inode(a: Path, b: Path) -> bool:
    return (os.stat(a).st_dev, os.stat(a).st_ino) == (os.stat(b).st_dev, os.stat(b).st_ino)


@pytest.fixture(params=["reflink", "kernel copy"])
def placing(request, monkeypatch) -> str:
    """How the filesystem lets a whole file be placed: a reflink (simulated: this disk has none), or not."""
    def cloned(source_fd, target_fd):  # FICLONE as a copy: the same bytes in a file of its own
        linking.copy_range(source_fd, target_fd, 0, 0, os.fstat(source_fd).st_size)
        return True

    monkeypatch.setattr(linking, "_clone", cloned if request.param == "reflink" else lambda s, t: False)
    return request.param


def edit_one_byte(path: Path, offset: int) -> None:
    """A stray write into a published file, its size and header intact (``chmod u+w`` first, as a user would)."""
    path.chmod(0o644)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x01]))
    path.chmod(0o444)


def first_tensor(chain: Chain, name: str):
    return next(t for t in raw_layout(chain.root / "v1").values() if t.file.name == name)


def test_a_wholly_reused_shard_is_a_checked_file_of_its_own_and_the_output_is_the_from_scratch_one(chain, placing):
    summary = chain.merge("v2", "--from", "merged", "--model-id", "merged")
    chain.merge("scratch", "--model-id", "scratch")
    assert snapshot_files(chain.root / "v2") == snapshot_files(chain.root / "scratch")  # bit-identical

    whole = wholly_reused(chain)
    shards = chain.shards("v2")
    assert whole and set(shards) - set(whole)  # some shards placed, some made
    for name in shards:
        v2 = chain.root / "v2" / name
        assert not same_inode(chain.root / "v1" / name, v2) and os.stat(v2).st_nlink == 1, name
        assert stat.S_IMODE(os.stat(v2).st_mode) == 0o444  # published read-only, placed or not
    # the reused tensors of the shards that were made: copied from v1 by the kernel (all but layer 0)
    layout = raw_layout(chain.root / "v2")
    copied = sum(t.end - t.begin for t in layout.values() if t.file.name not in whole and not in_layer0(t.name))
    sizes = {name: os.stat(chain.root / "v2" / name).st_size for name in shards}
    placed = sum(sizes[n] for n in whole)
    realized = summary["realized"]
    cloned = placed if placing == "reflink" else 0
    assert realized["output_bytes_by_method"] == {
        "linked": 0, "cloned": cloned, "copied": copied + placed - cloned,
        "written": realized["output_bytes"] - placed - copied}
    assert realized["output_bytes"] == sum(sizes.values())  # as before: the output's bytes, however they got there
    manifests = [json.loads((chain.root / v / "manifest.json").read_text()) for v in ("v1", "v2")]
    assert manifests[1]["cost"]["realized"]["output_bytes_by_method"] == realized["output_bytes_by_method"]
    hashes = [{f["name"]: f["blake3"] for f in m["files"]} for m in manifests]
    assert all(hashes[1][n] == hashes[0][n] for n in whole)
    assert "output_bytes_by_method" not in manifests[0]["cost"]["realized"]  # only for --from merges


def test_a_wholly_reused_shard_edited_in_place_refuses_the_merge(chain, placing, capsys):
    """Same size, header intact, one byte of a tensor changed: the placed file is read back and checked, so
    the edit is never sealed into the new snapshot (before: merge exited 0 and only `verify` found it)."""
    name = wholly_reused(chain)[0]
    edit_one_byte(chain.root / "v1" / name, first_tensor(chain, name).begin)
    code, _, err = run_main(["merge", "--db", chain.db, *MERGE, "--from", "merged", "--out", chain.root / "v2",
                             "--model-id", "merged"], capsys)
    line = one_line_error(code, err)
    assert "previous snapshot changed after it was published" in line and name in line, line
    assert "no longer matches its recorded hash" in line and "nothing was published" in line
    assert not (chain.root / "v2").exists() and not list(chain.root.glob(f".v2{STAGING_INFIX}*"))
    with Catalog.open(chain.db) as catalog:
        assert [v.id for v in catalog.models.versions("merged")] == ["merged"]


def test_an_edit_to_one_snapshot_never_changes_the_other(chain, capsys):
    chain.merge("v2", "--from", "merged", "--model-id", "merged")
    name = wholly_reused(chain)[0]
    before = (chain.root / "v2" / name).read_bytes()
    edit_one_byte(chain.root / "v1" / name, first_tensor(chain, name).begin)
    assert (chain.root / "v2" / name).read_bytes() == before
    code, _, err = run_main(["verify", "--db", chain.db, chain.root / "v1"], capsys)
    line = one_line_error(code, err)
    assert f"{name}: blake3" in line and "differs from manifest" in line, line
    code, out, err = run_main(["verify", "--db", chain.db, chain.root / "v2"], capsys)
    assert code == 0 and f"OK {chain.root / 'v2'}" in out, err


def test_a_reused_shard_that_became_a_symbolic_link_is_never_followed(chain, capsys):
    """v1's shard swapped for a link to a user-writable copy outside the snapshot (same bytes): `verify` of the
    snapshot says so, and `merge --from` refuses before anything is written (before: verify said OK and v2
    published the link). A copy's folder may hold links (the Hub's cache does): verified through, and noted."""
    name = wholly_reused(chain)[0]
    shard = chain.root / "v1" / name
    outside = chain.root / "elsewhere.safetensors"
    shutil.copyfile(shard, outside)
    (chain.root / "v1").chmod(0o755)
    shard.unlink()
    shard.symlink_to(outside)
    code, _, err = run_main(["verify", "--db", chain.db, "merged"], capsys)  # where MergePipe published it
    assert f"{name}: a symbolic link or not a plain file" in one_line_error(code, err), err
    code, out, err = run_main(["verify", chain.root / "v1"], capsys)  # a folder as any other: read through
    assert code == 0 and f"note: {name}: read through symbolic links" in out, (out, err)
    code, _, err = run_main(["merge", "--db", chain.db, *MERGE, "--from", "merged", "--out", chain.root / "v2",
                             "--model-id", "merged"], capsys)
    line = one_line_error(code, err)
    assert "cannot be reused" in line and f"{name} is a symbolic link" in line and "nothing was written" in line
    assert not (chain.root / "v2").exists() and not list(chain.root.glob(f".v2{STAGING_INFIX}*"))


def test_removing_the_older_snapshot_leaves_the_newer_whole(chain, capsys):
    chain.merge("v2", "--from", "merged", "--model-id", "merged")
    assert verify_snapshot(chain.root / "v1").ok and verify_snapshot(chain.root / "v2").ok
    before, whole = snapshot_files(chain.root / "v2"), wholly_reused(chain)
    invoke(chain.runner, ["rm", "--db", chain.db, chain.root / "v1"])
    invoke(chain.runner, ["gc", "--db", chain.db, "--versions", "--yes"])
    assert not (chain.root / "v1").exists()
    for name in whole:
        found = os.stat(chain.root / "v2" / name)
        assert found.st_nlink == 1 and stat.S_IMODE(found.st_mode) == 0o444
    assert snapshot_files(chain.root / "v2") == before
    code, out, err = run_main(["verify", "--db", chain.db, chain.root / "v2"], capsys)
    assert code == 0, err


def test_a_tampered_reused_block_of_a_made_shard_refuses_the_merge(chain, capsys):
    whole = wholly_reused(chain)
    layout = raw_layout(chain.root / "v1")
    tensor = next(t for t in layout.values() if t.file.name not in whole and not in_layer0(t.name))
    path = tensor.file
    edit_one_byte(path, tensor.end - 1)  # a reused block of a shard that is made anew (same size)
    code, _, err = run_main(["merge", "--db", chain.db, *MERGE, "--from", "merged", "--out", chain.root / "v2",
                             "--model-id", "merged", "--quiet"], capsys)
    line = one_line_error(code, err)
    assert "previous snapshot changed after it was published" in line and f"tensor '{tensor.name}'" in line, line
    assert path.name in line and "nothing was published" in line
    assert not (chain.root / "v2").exists()
    assert not list(chain.root.glob(f".v2{STAGING_INFIX}*"))
    with Catalog.open(chain.db) as catalog:
        assert [v.id for v in catalog.models.versions("merged")] == ["merged"]


@pytest.mark.parametrize("mode", ["step:written", "step:fsynced", "step:renamed"])
def test_a_merge_killed_after_placing_leaves_the_previous_snapshot_intact(chain, mode):
    with Catalog.open(chain.db) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties",
                                                  params={"density": 0.5}, previous="merged",
                                                  out_shard_bytes=40_000))
        before = catalog.snapshots.of_model("merged").manifest_hash
    assert plan.reuse is not None and plan.reuse.block_count > 0
    (chain.root / "plan.json").write_text(plan.to_json_str())
    (status,) = run_forked([{"db": str(chain.db), "plan": str(chain.root / "plan.json"),
                             "out": str(chain.root / "v2"), "model_id": "merged", "mode": mode}],
                           chain.root / "runner")
    assert status["signal"] == signal.SIGKILL, status
    with Catalog.open(chain.db) as catalog:
        recover(catalog)
        published = [v.id for v in catalog.models.versions("merged")]
    assert published == (["merged", "merged@2"] if mode == "step:renamed" else ["merged"])
    assert not list(chain.root.glob(f".v2{STAGING_INFIX}*"))
    check = verify_snapshot(chain.root / "v1")
    assert check.ok and check.manifest.manifest_hash == before
    for name in wholly_reused(chain):  # its files: read-only as published, shared with no other snapshot
        found = os.stat(chain.root / "v1" / name)
        assert stat.S_IMODE(found.st_mode) == 0o444 and found.st_nlink == 1
    if mode == "step:renamed":
        assert verify_snapshot(chain.root / "v2").ok


def test_on_ray_the_coordinator_places_and_the_workers_write_the_rest(chain):
    """Units on Ray workers may run on other machines: the coordinator places the wholly reused shards (no unit
    runs for them) and the workers read, check and write the reused runs of the others, as before."""
    ray = pytest.importorskip("ray")
    from tests.fixtures.ray_tasks import ray_instance

    with ray_instance(ray):
        summary = chain.merge("v2", "--from", "merged", "--model-id", "merged", "--executor", "ray",
                              "--workers", "2")
    chain.merge("scratch", "--model-id", "scratch")
    assert snapshot_files(chain.root / "v2") == snapshot_files(chain.root / "scratch")
    whole = wholly_reused(chain)
    assert not any(same_inode(chain.root / "v1" / name, chain.root / "v2" / name) for name in whole)
    by_method = summary["realized"]["output_bytes_by_method"]
    placed = sum(os.stat(chain.root / "v2" / name).st_size for name in whole)
    assert by_method["linked"] == 0 and by_method["cloned"] + by_method["copied"] == placed > 0
    assert verify_snapshot(chain.root / "v2").ok
