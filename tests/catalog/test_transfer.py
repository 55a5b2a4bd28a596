"""Copying a catalog (``catalog.copy_catalog``): one consistent view of a source others write to, read a batch
at a time."""

from __future__ import annotations

from pathlib import Path

from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.catalog.catalog import copy_catalog


def _ids(catalog: Catalog) -> list[str]:
    return sorted(m.id for m in catalog.models.list())


def test_a_copy_is_the_source_as_it_was_when_it_began_whoever_writes_meanwhile(family_catalog, catalog_location,
                                                                              tiny_family, tmp_path: Path):
    """Another process registers a model while the copy runs (after the models table, before its blocks): the
    copy holds the catalog as it was when it began, every foreign key whole, and the source keeps the model."""
    source = family_catalog
    before = _ids(source)
    writer = Catalog.open(catalog_location)  # another connection: what another process on the team does
    seen = []

    def progress(table: str, rows: int) -> None:
        seen.append((table, rows))
        if table == "models":
            register_model(writer, "late", tiny_family["e1"])

    with Catalog.create(tmp_path / "copy.db", source.block_bytes) as target:
        copied = copy_catalog(source, target, progress)
        assert _ids(target) == before
        blocks = target._db.query_row("SELECT count(*) FROM blocks")[0]
    writer.close()
    assert "late" in _ids(source) and "late" not in before
    assert copied["models"] == len(before) == 4
    expected_blocks = source._db.query_row("SELECT count(*) FROM blocks WHERE model_id != 'late'")[0]
    assert blocks == copied["blocks"] == expected_blocks


def test_a_long_read_streams_from_a_server_side_cursor(postgres_url, tiny_family):
    """On PostgreSQL the rows stay on the server until fetched: the stream reads through a cursor the server
    holds (a client-side one would have fetched the whole result at the first batch)."""
    with Catalog.create(postgres_url) as catalog:
        register_model(catalog, "base", tiny_family["base"])
        total = catalog._db.query_row("SELECT count(*) FROM blocks")[0]
        batches = catalog._db.stream("SELECT * FROM blocks ORDER BY model_id, tensor, idx", batch_rows=5)
        names, first = next(batches)
        assert len(first) == 5 and "hash" in names
        assert catalog._db.query("SELECT name FROM pg_cursors WHERE name <> ''") == [("mergepipe_stream",)]
        rest = sum(len(rows) for _, rows in batches)
        assert len(first) + rest == total > 5
        assert catalog._db.query("SELECT name FROM pg_cursors WHERE name <> ''") == []
