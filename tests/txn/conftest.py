"""A real catalog with a tiny base and expert registered and one plan saved."""

from __future__ import annotations

from pathlib import Path

import pytest

from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.manifest import ExpertRef
from mergepipe.spec.plan import ModelRef
from tests.txn.helpers import PLAN, write_checkpoint


def make_catalog(root: Path) -> Catalog:
    """``root/catalog.db`` with models ``base`` and ``e1`` (under ``root/models``) and plan ``PLAN``."""
    cat = Catalog.create(root / "catalog.db")
    register_model(cat, "base", write_checkpoint(root / "models" / "base", seed=0))
    register_model(cat, "e1", write_checkpoint(root / "models" / "e1", seed=100))
    cat.plans.save(PLAN, "{}")
    return cat


def catalog_parents(catalog: Catalog) -> tuple[ModelRef, ExpertRef]:
    base, expert = catalog.models.get("base"), catalog.models.get("e1")
    return ModelRef(base.id, base.fingerprint), ExpertRef(expert.id, expert.fingerprint, 1.0)


@pytest.fixture
def catalog(tmp_path: Path):
    cat = make_catalog(tmp_path)
    yield cat
    cat.close()


@pytest.fixture
def parents(catalog):
    return catalog_parents(catalog)
