"""The models store: lookups, the "unknown model" message, adding and deleting."""

from __future__ import annotations


import pytest

from mergepipe.analysis.experts import describe_checkpoint
from mergepipe.errors import CatalogError, UnknownModelError
from mergepipe.storage.checkpoint import open_checkpoint
from tests.catalog.helpers import db_dump, raw_db, row_count


def content_of(catalog, checkpoint_dir, model_id: str, kind: str = "checkpoint"):
    return describe_checkpoint(open_checkpoint(checkpoint_dir), model_id, kind, catalog.block_bytes, catalog.now())


def test_unknown_model_lists_registered(family_catalog):
    with pytest.raises(
        UnknownModelError,
        match=r"unknown model 'zz'; registered: base, e1, e2, e3 \(register it with `mergepipe register`\)",
    ):
        family_catalog.models.get("zz")
    for query in (
        family_catalog.models.tensors,
        family_catalog.blocks.by_tensor,
        family_catalog.models.files,
        family_catalog.models.parents,
        family_catalog.models.require,
        family_catalog.blocks.content_fingerprint,
        family_catalog.model_status,
    ):
        with pytest.raises(UnknownModelError, match="unknown model 'zz'"):
            query("zz")
    assert family_catalog.models.find("zz") is None
    assert family_catalog.models.find("e1") == family_catalog.models.get("e1")
    assert family_catalog.models.exists("e1") and not family_catalog.models.exists("zz")
    assert [m.id for m in family_catalog.models.list()] == ["base", "e1", "e2", "e3"]
    assert family_catalog.models.children("zz") == []


def test_unknown_model_in_empty_catalog(catalog):
    with pytest.raises(UnknownModelError, match="none registered yet"):
        catalog.models.get("x")


def test_long_list_of_ids_is_cut(catalog, tiny_family):
    for i in range(12):
        catalog.models.add(content_of(catalog, tiny_family["base"], f"m{i:02d}"))
    with pytest.raises(UnknownModelError, match=r"registered: m00, m01, .*, m09 … \(12 in all\)"):
        catalog.models.get("zz")


def test_add_writes_every_row(catalog, tiny_family):
    content = content_of(catalog, tiny_family["base"], "m")
    catalog.models.add(content)
    assert catalog.models.get("m") == content.record
    assert tuple(catalog.models.files("m")) == content.files
    assert tuple(catalog.models.tensors("m")) == content.tensors
    assert tuple(b for bs in catalog.blocks.by_tensor("m").values() for b in bs) == content.blocks
    assert catalog.models.parents("m") == []
    assert row_count(catalog.path, "blocks") == len(content.blocks)


def test_add_refuses_a_taken_id_and_bad_values(catalog, tiny_family):
    content = content_of(catalog, tiny_family["base"], "m")
    catalog.models.add(content)
    before = db_dump(catalog.path)
    with pytest.raises(CatalogError, match="model 'm' is already registered"):
        catalog.models.add(content)
    with pytest.raises(ValueError, match="model kind"):
        catalog.models.add(content_of(catalog, tiny_family["base"], "k", kind="other"))
    with pytest.raises(ValueError, match="parent role"):
        catalog.models.add(content_of(catalog, tiny_family["base"], "n"), [("m", "uncle")])
    with pytest.raises(UnknownModelError, match="unknown model 'ghost'"):
        catalog.models.add(content_of(catalog, tiny_family["base"], "n"), [("ghost", "base")])
    assert db_dump(catalog.path) == before


def test_parents_and_children(catalog, tiny_family):
    for model_id in ("base", "e1"):
        catalog.models.add(content_of(catalog, tiny_family[model_id], model_id))
    parents = [("base", "base"), ("e1", "expert")]
    catalog.models.add(content_of(catalog, tiny_family["e2"], "merged", kind="snapshot"), parents)
    assert catalog.models.parents("merged") == parents
    assert catalog.models.children("base") == catalog.models.children("e1") == ["merged"]
    assert catalog.models.children("merged") == []


def test_delete_cascades_and_protects_lineage(catalog, tiny_family):
    for model_id in ("base", "e1"):
        catalog.models.add(content_of(catalog, tiny_family[model_id], model_id))
    catalog.models.add(content_of(catalog, tiny_family["e2"], "merged", kind="snapshot"), [("base", "base")])
    before = db_dump(catalog.path)
    with pytest.raises(CatalogError, match="parent of snapshot"):
        catalog.models.delete("base")
    with pytest.raises(CatalogError, match="published snapshot"):
        catalog.models.delete("merged")
    assert db_dump(catalog.path) == before
    catalog.models.delete("e1")
    assert not catalog.models.exists("e1")
    for table in ("files", "tensors", "blocks"):  # nothing of e1 is left anywhere
        assert rows_of(catalog.path, table, "e1") == 0, table
    assert rows_of(catalog.path, "tensors", "base") > 0


def rows_of(path, table: str, model_id: str) -> int:
    """Rows of ``model_id`` in ``table``, counted with a plain connection."""
    with raw_db(path) as conn:
        return conn.execute(f"SELECT count(*) FROM {table} WHERE model_id = ?", (model_id,))[0][0]
