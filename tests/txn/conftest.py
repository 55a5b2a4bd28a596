"""A real catalog with a tiny base and expert registered and one plan saved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.manifest.manifest import ExpertRef
from mergepipe.spec.plan import ModelRef
from tests.txn.helpers import PLAN, write_checkpoint


def make_catalog(root: Path, location: str | None = None) -> Catalog:
    """``root/catalog.db`` (or the database at ``location``, a postgresql:// URL) with models ``base`` and
    ``e1`` (under ``root/models``) and plan ``PLAN``."""
    cat = Catalog.create(location or root / "catalog.db")
    register_model(cat, "base", write_checkpoint(root / "models" / "base", seed=0))
    register_model(cat, "e1", write_checkpoint(root / "models" / "e1", seed=100))
    for model_id in ("base", "e1"):  # made-up hashes: the plan below only needs content fingerprints
        blocks = cat.blocks.by_tensor(model_id)
        cat.blocks.set_hashes(model_id, [(t, b.index, f"{model_id}:{t}:{b.index}") for t, per in blocks.items()
                                         for b in per])
    refs = [{"id": m, "fingerprint": cat.blocks.content_fingerprint(m)} for m in ("base", "e1")]
    cat.plans.save(PLAN, json.dumps({"base": refs[0], "experts": refs[1:]}))
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
