"""Catalog fixtures: fresh catalogs over the session's tiny checkpoints.

Small blocks (1 KiB) give every tensor of the tiny models several blocks and
an uneven last one (vocab 250 at 8 rows per block).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mergepipe.catalog.analyze import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.register import register_model

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

