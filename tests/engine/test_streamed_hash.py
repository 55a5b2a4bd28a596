"""The manifest's file hashes are streamed as units write (no second pass over the weights), and each equals
the blake3 library's hash of the file on disk (what ``b3sum`` prints): copied and merged blocks, sharded
output, another dtype, units on several threads (out of order), an incremental merge that reuses blocks."""

from __future__ import annotations

import threading
from pathlib import Path

import blake3
import pytest

import mergepipe.engine.engine as engine_module
import mergepipe.txn.verify as verify_module
from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.engine.stream import LocalExecutor
from mergepipe.planner.planner import Planner
from mergepipe.storage.source import FileHash
from mergepipe.txn.verify import verify_snapshot
from mergepipe.spec.request import MergeRequest
from tests.fixtures.checkpoints import make_expert
from tests.planner.support import build_catalog, clone_catalog

BLOCK_BYTES = 4096
#: Small units: the tiny base's one file is cut into many, so several threads write it at once.
UNIT_BYTES = 8192


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("streamed-hash")
    return build_catalog(root / "template.db", BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2"])


@pytest.fixture
def catalog(template, tmp_path):
    with Catalog.open(clone_catalog(template, tmp_path / "c.db")) as catalog:
        yield catalog


@pytest.fixture
def hashed_by_reading(monkeypatch) -> list[str]:
    """Names of the files the seal hashed by reading them back."""
    names: list[str] = []
    real = verify_module.file_digest

    def spy(path, *args, **kwargs):
        if not isinstance(path, int):  # a descriptor is verify's read, after the seal
            names.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(verify_module, "file_digest", spy)
    return names


def assert_streamed(manifest, out: Path, hashed_by_reading: list[str]) -> None:
    weights = [f for f in manifest.files if f.name.endswith(".safetensors")]
    assert weights
    for entry in manifest.files:
        data = (out / entry.name).read_bytes()
        assert (entry.algorithm, entry.digest) == ("blake3", blake3.blake3(data).hexdigest()), entry.name
        assert entry.size == len(data)
    assert not [n for n in hashed_by_reading if n.endswith(".safetensors")]  # no second pass over the weights
    assert {f.name for f in manifest.files} - {f.name for f in weights} <= set(hashed_by_reading)
    assert verify_snapshot(out).ok


MERGES = {  # name -> planner options
    "copies and merged blocks": dict(operator="ties", params={"density": 0.5}, budget="40%"),
    "every block merged": dict(operator="task_arithmetic", params={}, budget=None),
    "sharded": dict(operator="ties", params={"density": 0.5}, budget="60%", out_shard_bytes=20_000),
    "another dtype": dict(operator="task_arithmetic", params={}, budget="50%", out_dtype="F32"),
    "float16, sharded": dict(operator="dare_ties", params={"density": 0.5}, budget="70%", out_dtype="F16",
                             out_shard_bytes=50_000),
}


@pytest.mark.parametrize("merge", sorted(MERGES))
def test_the_streamed_hash_of_every_file_is_the_hash_on_disk(catalog, tmp_path, hashed_by_reading, merge):
    options = dict(MERGES[merge])
    operator, params = options.pop("operator"), options.pop("params")
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator=operator, weights=[1.0, 0.6], params=params, seed=3, **options))
    _, manifest = Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
    assert_streamed(manifest, tmp_path / "out", hashed_by_reading)
    if "out_shard_bytes" in options:
        assert len([f for f in manifest.files if f.name.endswith(".safetensors")]) > 1


@pytest.mark.parametrize("reorder_bytes", [0, 1 << 20])
def test_units_on_several_threads_out_of_order_hash_the_file_on_disk(catalog, tmp_path, monkeypatch,
                                                                      hashed_by_reading, reorder_bytes):
    """Unit 0 waits until unit 1 has written everything, so unit 1's bytes all arrive ahead of their turn:
    kept in memory, or (no room) read back from the file when unit 0 catches up."""
    hashers: list[FileHash] = []

    def hasher(path, size):
        hashers.append(FileHash(path, size, reorder_bytes=reorder_bytes))
        return hashers[-1]

    unit1_done = threading.Event()
    real_run_unit = engine_module.run_unit

    def run_unit(unit, job, advance):
        if unit.index == 0:
            assert unit1_done.wait(30)
        record = real_run_unit(unit, job, advance)
        if unit.index == 1:
            unit1_done.set()
        return record

    monkeypatch.setattr(engine_module, "FileHash", hasher)
    monkeypatch.setattr(engine_module, "run_unit", run_unit)
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", params={"density": 0.5}, budget="60%"))
    engine = Engine(catalog, executor=LocalExecutor(3), unit_bytes=UNIT_BYTES)
    _, manifest = engine.execute(plan, out=tmp_path / "out", model_id="m")
    assert_streamed(manifest, tmp_path / "out", hashed_by_reading)
    (only,) = hashers
    if reorder_bytes == 0:
        assert only.read_back_bytes > 0
    else:
        assert only.read_back_bytes == _header_bytes(tmp_path / "out" / "model.safetensors")  # the rest waited


def _header_bytes(path: Path) -> int:
    """Bytes before the data section of a safetensors file, from its 8-byte length prefix."""
    with open(path, "rb") as handle:
        return 8 + int.from_bytes(handle.read(8), "little")


def test_an_incremental_merge_that_reuses_blocks(tiny_family, tmp_path, hashed_by_reading):
    with Catalog.create(tmp_path / "c.db", BLOCK_BYTES) as catalog:
        for name in ("base", "e1", "e2"):
            register(catalog, name, tiny_family[name])
        analyze(catalog, ["e1", "e2"], base_id="base", progress=False)
        def merge(previous: str | None = None):
            return Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties",
                                                      params={"density": 0.5}, previous=previous))
        Engine(catalog).execute(merge(), out=tmp_path / "v1", model_id="merged")
        retrained = make_expert(tiny_family["e1"], tmp_path / "e1-v2", seed=77, touch=lambda n: ".layers.1." in n)
        register(catalog, "e1", retrained, new_version=True)
        analyze(catalog, ["e1"], base_id="base", progress=False)
        hashed_by_reading.clear()
        plan = merge(previous="merged")
        assert plan.reuse is not None and plan.reuse.output_bytes > 0
        _, manifest = Engine(catalog).execute(plan, out=tmp_path / "v2", model_id="merged")
    assert manifest.extra["reuse"]["bytes"] > 0
    assert_streamed(manifest, tmp_path / "v2", hashed_by_reading)


class ElsewhereExecutor(LocalExecutor):
    """Runs units here, but says they run elsewhere (as a cluster's executor would): no shared hashes."""

    in_process = False


def test_units_run_elsewhere_have_their_files_hashed_after(catalog, tmp_path, hashed_by_reading):
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="ties", params={"density": 0.5}, budget="40%"))
    _, manifest = Engine(catalog, executor=ElsewhereExecutor()).execute(plan, out=tmp_path / "out", model_id="m")
    assert "model.safetensors" in hashed_by_reading
    for entry in manifest.files:
        assert entry.digest == blake3.blake3((tmp_path / "out" / entry.name).read_bytes()).hexdigest()

