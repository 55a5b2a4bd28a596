"""Catalog fixtures: fresh catalogs over the session's tiny checkpoints.

Small blocks (1 KiB) give every tensor of the tiny models several blocks and
an uneven last one (vocab 250 at 8 rows per block). The analysis tests use
these fixtures too (``tests/analysis/conftest.py`` imports them).

``catalog`` runs each test on both backends: a SQLite file and a database of
a throwaway PostgreSQL server (``tests/fixtures/postgres.py``). Tests that
read the file with plain sqlite3 ask for ``sqlite_catalog`` instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from tests.fixtures.postgres import postgres_server, postgres_url  # noqa: F401 (fixtures)

SMALL_BLOCK_BYTES = 1024


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request) -> str:
    """The catalog backend a test runs on."""
    return request.param


@pytest.fixture
def catalog_location(backend: str, tmp_path: Path, request) -> str:
    """Where a new catalog goes: a file path, or a fresh PostgreSQL database's URL."""
    if backend == "sqlite":
        return str(tmp_path / "catalog.db")
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def catalog(catalog_location: str):
    cat = Catalog.create(catalog_location, block_bytes=SMALL_BLOCK_BYTES)
    yield cat
    cat.close()


@pytest.fixture
def sqlite_catalog(tmp_path: Path):
    """A SQLite catalog: for tests that look at its file with sqlite3."""
    cat = Catalog.create(tmp_path / "catalog.db", block_bytes=SMALL_BLOCK_BYTES)
    yield cat
    cat.close()


@pytest.fixture
def family_catalog(catalog, tiny_family):
    """``catalog`` with base, e1, e2, e3 of ``tiny_family`` registered, not analysed."""
    for model_id in ("base", "e1", "e2", "e3"):
        register_model(catalog, model_id, tiny_family[model_id])
    return catalog
