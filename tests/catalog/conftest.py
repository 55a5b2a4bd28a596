"""Catalog fixtures: fresh catalogs over the session's tiny checkpoints.

Small blocks (1 KiB) give every tensor of the tiny models several blocks and
an uneven last one (vocab 250 at 8 rows per block). The analysis tests use
these fixtures too (``tests/analysis/conftest.py`` imports them).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog

SMALL_BLOCK_BYTES = 1024


@pytest.fixture
def catalog(tmp_path: Path):
    cat = Catalog.create(tmp_path / "catalog.db", block_bytes=SMALL_BLOCK_BYTES)
    yield cat
    cat.close()


@pytest.fixture
def family_catalog(catalog, tiny_family):
    """``catalog`` with base, e1, e2, e3 of ``tiny_family`` registered, not analysed."""
    for model_id in ("base", "e1", "e2", "e3"):
        register_model(catalog, model_id, tiny_family[model_id])
    return catalog
