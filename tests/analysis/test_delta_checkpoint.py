"""Delta checkpoints as experts: registration (geometry, refusals), analysis, and schema migration 7.

Deltas are written here with torch and safetensors (tests/fixtures/delta_checkpoints.py); expected
geometry comes from the block contract (tests/catalog/helpers.py), expected unchanged blocks from the
raw bytes of the delta files, and expected statistics from a full-expert analysis of the same expert.
"""

from __future__ import annotations

import sqlite3

import pytest
import torch

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.experts import delta_info
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog, schema
from mergepipe.errors import CheckpointError, MergePipeError
from mergepipe.storage.checkpoint import Checkpoint
from mergepipe.storage.location import RemotePath
from tests.catalog.helpers import block_rows
from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.delta_checkpoints import reference_deltas, write_delta
from tests.planner.support import raw_layout

BLOCK = 1024


@pytest.fixture
def delta_catalog(tmp_path, tiny_family):
    """A catalog with base (hashed) and e1 registered; (catalog, base fingerprint)."""
    with Catalog.create(tmp_path / "c.db", block_bytes=BLOCK) as catalog:
        register_model(catalog, "base", tiny_family["base"])
        register_model(catalog, "e1", tiny_family["e1"])
        analyze(catalog, ["base"], progress=False)
        yield catalog, catalog.blocks.content_fingerprint("base")


def _rows_of(catalog: Catalog, model_id: str) -> dict:
    return {name: [(b.row_start, b.row_end, b.begin, b.end) for b in blocks]
            for name, blocks in catalog.blocks.by_tensor(model_id).items()}


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_a_delta_has_the_base_rows_and_its_own_byte_offsets(delta_catalog, tiny_family, tmp_path, dtype):
    catalog, fingerprint = delta_catalog
    d = write_delta(tiny_family["base"], tiny_family["e1"], tmp_path / "d", fingerprint, BLOCK, dtype=dtype)
    record = register_model(catalog, "d", d, kind="delta", base="base")
    assert (record.kind, record.delta_base) == ("delta", "base")
    base_layout, delta_layout = raw_layout(tiny_family["base"]), raw_layout(d)
    got = _rows_of(catalog, "d")
    assert set(got) == set(delta_layout)
    for name, t in delta_layout.items():
        rows = block_rows(list(base_layout[name].shape), 2, BLOCK)  # the bf16 base's row ranges
        row_bytes = t.nbytes // max(1, t.shape[0] if len(t.shape) >= 2 else 1)
        assert got[name] == [(r0, r1, t.begin + r0 * row_bytes, t.begin + r1 * row_bytes) for r0, r1 in rows]


def test_analysis_of_an_f32_delta_equals_the_full_experts(delta_catalog, tiny_family, tmp_path):
    """Same Δ bits, so the same statistics; the base is not read for it; unchanged = all-zero bytes."""
    catalog, fingerprint = delta_catalog
    d = write_delta(tiny_family["base"], tiny_family["e3"], tmp_path / "d", fingerprint, BLOCK)
    register_model(catalog, "e3", tiny_family["e3"])
    register_model(catalog, "d", d, kind="delta", base="base")
    analyze(catalog, ["e3"], base_id="base", progress=False)
    report = analyze(catalog, ["d"], base_id="base", progress=False)
    assert set(report.bytes_by_model) == {"d"}  # Δ is read directly
    assert catalog.stats.block_deltas("d", "base") == catalog.stats.block_deltas("e3", "base")
    assert catalog.stats.tensor_stats("d", "base") == catalog.stats.tensor_stats("e3", "base")
    deltas = catalog.stats.block_deltas("d", "base")
    for name, t in raw_layout(d).items():
        data = t.file.read_bytes()
        zero = [not any(data[b.begin:b.end]) for b in catalog.blocks.by_tensor("d")[name]]
        assert [x.identical for x in deltas[name]] == zero


def test_left_out_tensors_have_no_delta_and_cost_nothing(delta_catalog, tiny_family, tmp_path):
    catalog, fingerprint = delta_catalog
    d = write_delta(tiny_family["base"], tiny_family["e1"], tmp_path / "d", fingerprint, BLOCK,
                    keep=lambda n: "mlp" in n)
    register_model(catalog, "d", d, kind="delta", base="base")
    report = analyze(catalog, base_id="base", progress=False)  # every checkpoint, and the deltas of this base
    assert set(report.analyzed) == {"e1", "d"}
    deltas = catalog.stats.block_deltas("d", "base")
    stats = catalog.stats.tensor_stats("d", "base")
    assert set(deltas) == set(stats) == set(raw_layout(tiny_family["base"]))
    for name in deltas:
        assert all(x.identical for x in deltas[name]) == ("mlp" not in name)
        assert stats[name].identical == ("mlp" not in name)


def test_a_description_in_safetensors_metadata_is_read(delta_catalog, tiny_family, tmp_path):
    catalog, fingerprint = delta_catalog
    d = write_delta(tiny_family["base"], tiny_family["e1"], tmp_path / "d", fingerprint, BLOCK, in_metadata=True)
    assert register_model(catalog, "d", d, kind="delta", base="base").delta_base == "base"


def test_another_block_size_checks_the_fingerprint_from_the_base_files(delta_catalog, tiny_family, tmp_path):
    """A delta exported from a catalog with 1 KiB blocks registers in one with 4 KiB blocks, and a
    fingerprint of another base is still refused there."""
    _, fingerprint = delta_catalog
    good = write_delta(tiny_family["base"], tiny_family["e1"], tmp_path / "good", fingerprint, BLOCK)
    bad = write_delta(tiny_family["base"], tiny_family["e1"], tmp_path / "bad", "0" * 64, BLOCK)
    with Catalog.create(tmp_path / "other.db", block_bytes=4096) as other:
        register_model(other, "base", tiny_family["base"])
        assert register_model(other, "d", good, kind="delta", base="base").kind == "delta"
        with pytest.raises(MergePipeError, match="taken against another base"):
            register_model(other, "bad", bad, kind="delta", base="base")


def _extra(tensors: dict) -> None:
    tensors["model.extra.weight"] = torch.zeros(4)


def _reshaped(tensors: dict) -> None:
    name = next(n for n in tensors if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name].t().contiguous()[:, :32].contiguous()


def _integer(tensors: dict) -> None:
    name = next(n for n in tensors if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name].to(torch.int32)


@pytest.mark.parametrize("case, kwargs, message", [
    ("wrong fingerprint", {"fingerprint": "0" * 64}, "taken against another base than 'base'"),
    ("extra tensor", {"edit": _extra}, "extra tensor 'model.extra.weight'"),
    ("wrong shape", {"edit": _reshaped}, r"q_proj.weight' has shape \[64, 32\], base \[64, 64\]"),
    ("integer delta", {"edit": _integer}, "q_proj.weight' is I32, not a float delta"),
    ("unknown format", {"description": {"format": "sparse"}}, "format 'sparse' is not supported"),
])
def test_refusals_are_one_line_and_register_nothing(delta_catalog, tiny_family, tmp_path, case, kwargs, message):
    catalog, fingerprint = delta_catalog
    args = {"fingerprint": fingerprint, **kwargs}
    d = write_delta(tiny_family["base"], tiny_family["e1"], tmp_path / "d", block_bytes=BLOCK, **args)
    before = [m.id for m in catalog.models.list()]
    with pytest.raises(MergePipeError, match=message) as error:
        register_model(catalog, "d", d, kind="delta", base="base")
    assert "\n" not in str(error.value)
    assert [m.id for m in catalog.models.list()] == before


def test_a_remote_delta_description_is_refused_by_name():
    """Delta checkpoints are read from local directories (register refuses a remote one before this)."""
    remote = Checkpoint(RemotePath("s3://bucket/delta"), (), {}, None, None, ())
    with pytest.raises(CheckpointError, match="s3://bucket/delta: delta checkpoints are read from a local directory"):
        delta_info(remote)


def test_the_base_must_be_the_one_the_delta_was_taken_against(delta_catalog, tiny_family, tmp_path):
    catalog, fingerprint = delta_catalog
    d = write_delta(tiny_family["base"], tiny_family["e1"], tmp_path / "d", fingerprint, BLOCK)
    with pytest.raises(MergePipeError, match="taken against another base than 'e1'"):
        register_model(catalog, "d", d, kind="delta", base="e1")
    (d / "mergepipe_delta.json").unlink()
    with pytest.raises(MergePipeError, match="has no mergepipe_delta.json"):
        register_model(catalog, "d", d, kind="delta", base="base")
    assert catalog.models.find("d") is None


def test_kinds_are_not_mixed_up(delta_catalog, tiny_family, tmp_path):
    catalog, fingerprint = delta_catalog
    d = write_delta(tiny_family["base"], tiny_family["e1"], tmp_path / "d", fingerprint, BLOCK)
    with pytest.raises(MergePipeError, match="is a delta checkpoint .*register it with --kind delta"):
        register_model(catalog, "d", d)
    with pytest.raises(MergePipeError, match="give --base BASE"):
        register_model(catalog, "d", d, kind="delta")
    register_model(catalog, "d", d, kind="delta", base="base")
    register_model(catalog, "e2", tiny_family["e2"])
    with pytest.raises(MergePipeError, match="'d' is a delta checkpoint taken against 'base', not 'e2'"):
        analyze(catalog, ["d"], base_id="e2", progress=False)
    with pytest.raises(MergePipeError, match="is the base of delta checkpoint"):
        register_model(catalog, "base", tiny_family["e2"], force=True)


def test_reference_deltas_are_what_the_files_hold(delta_catalog, tiny_family, tmp_path):
    """The fixture's own sanity: an f32 delta file holds fp32(E) − fp32(B) exactly."""
    _, fingerprint = delta_catalog
    d = write_delta(tiny_family["base"], tiny_family["e2"], tmp_path / "d", fingerprint, BLOCK)
    on_disk = load_tensors(d)
    for name, delta in reference_deltas(tiny_family["base"], tiny_family["e2"]).items():
        assert torch.equal(on_disk[name], delta)


# ------------------------------------------------------------------------------------------- migration 7

_TABLES = ("files", "tensors", "blocks")
# The columns a version-6 catalog has (later migrations add some: files.etag in 9).
_COLUMNS = {"files": "model_id, name, position, size, mtime_ns, header_sha256"}


def test_migration_7_keeps_every_model_and_row(tmp_path, tiny_family, monkeypatch):
    """A catalog as version 6 left it (kind checked against checkpoint/snapshot, no delta_base) keeps its
    models and their rows, and then accepts deltas."""
    current = tmp_path / "v7.db"
    with Catalog.create(current, block_bytes=BLOCK) as catalog:
        register_model(catalog, "base", tiny_family["base"])
        register_model(catalog, "e1", tiny_family["e1"])
        expected = [m.model_copy(update={"side_files": None}) for m in catalog.models.list()]  # recorded since migration 19
    old = tmp_path / "v6.db"
    with monkeypatch.context() as patch:
        patch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:6])
        Catalog.create(old, block_bytes=BLOCK).close()
    conn = sqlite3.connect(old)
    with conn:
        conn.execute("ATTACH DATABASE ? AS v7", (str(current),))
        conn.execute("INSERT INTO models (id, uri, kind, fingerprint, architecture, num_layers, total_bytes, "
                     "n_tensors, n_blocks, created_at, name, version) SELECT id, uri, kind, fingerprint, "
                     "architecture, num_layers, total_bytes, n_tensors, n_blocks, created_at, name, version "
                     "FROM v7.models")
        for table in _TABLES:
            conn.execute(f"INSERT INTO {table} SELECT {_COLUMNS.get(table, '*')} FROM v7.{table}")
        rows = {t: conn.execute(f"SELECT {_COLUMNS.get(t, '*')} FROM {t} ORDER BY 1, 2").fetchall() for t in _TABLES}
    conn.execute("DETACH DATABASE v7")
    conn.close()
    with Catalog.open(old) as migrated:
        assert migrated.schema_version == schema.MIGRATIONS[-1].version
        assert migrated.models.list() == expected
        assert all(m.kind == "checkpoint" and m.delta_base is None for m in migrated.models.list())
    conn = sqlite3.connect(old)
    try:
        assert {t: conn.execute(f"SELECT {_COLUMNS.get(t, '*')} FROM {t} ORDER BY 1, 2").fetchall()
                for t in _TABLES} == rows
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
            conn.execute("UPDATE models SET kind = 'other' WHERE id = 'e1'")
        conn.execute("UPDATE models SET kind = 'delta', delta_base = 'base' WHERE id = 'e1'")  # now allowed
    finally:
        conn.close()


def test_an_unhashed_base_is_hashed_with_the_delta_and_a_refusal_writes_nothing(tmp_path, tiny_family, delta_catalog):
    _, fingerprint = delta_catalog  # the base's fingerprint, from a catalog that hashed it
    good = write_delta(tiny_family["base"], tiny_family["e1"], tmp_path / "good", fingerprint, BLOCK)
    bad = write_delta(tiny_family["base"], tiny_family["e1"], tmp_path / "bad", "0" * 64, BLOCK)
    with Catalog.create(tmp_path / "fresh.db", block_bytes=BLOCK) as catalog:
        base = register_model(catalog, "base", tiny_family["base"])
        with pytest.raises(MergePipeError, match="taken against another base"):
            register_model(catalog, "bad", bad, kind="delta", base="base")
        assert catalog.blocks.hashed_count("base") == 0
        register_model(catalog, "good", good, kind="delta", base="base")
        assert catalog.blocks.hashed_count("base") == base.n_blocks
        assert catalog.blocks.content_fingerprint("base") == fingerprint
