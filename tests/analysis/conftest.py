"""Analysis fixtures: the catalog fixtures of ``tests/catalog`` plus a catalog
analysed once per module."""

from __future__ import annotations

import pytest

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from tests.catalog.conftest import SMALL_BLOCK_BYTES, catalog, catalog_location, family_catalog

__all__ = ["SMALL_BLOCK_BYTES", "analysed", "catalog", "catalog_location", "family_catalog"]


@pytest.fixture
def backend() -> str:
    """The analysis tests' catalogs are SQLite files (``tests/catalog`` runs the stores on both backends)."""
    return "sqlite"


@pytest.fixture(scope="module")
def analysed(tmp_path_factory, tiny_family):
    """A catalog with e1 and e3 analysed against base (built once per module)."""
    path = tmp_path_factory.mktemp("analysed") / "catalog.db"
    cat = Catalog.create(path, block_bytes=SMALL_BLOCK_BYTES)
    for model_id in ("base", "e1", "e3"):
        register_model(cat, model_id, tiny_family[model_id])
    report = analyze(cat, ["e1", "e3"], base_id="base", progress=False)
    yield cat, report
    cat.close()
