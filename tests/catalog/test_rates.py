"""The rates table (catalog/rates.py) and its migration to rates that may be 0 (schema migration 10)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mergepipe.catalog import Catalog, schema
from mergepipe.errors import CatalogError
from mergepipe.spec.seconds import Rates

RATES = Rates(1.5, 0.1, 0.05, 800e6, 900e6, 700e6, 2e9, 1.3, {"ties": (600e6, 800e6)})


def test_a_version_9_catalog_keeps_its_rates_and_then_takes_a_zero_steal(tmp_path: Path, monkeypatch):
    path = tmp_path / "c.db"
    version_9 = tuple(m for m in schema.MIGRATIONS if m.version <= 9)
    monkeypatch.setattr(schema, "MIGRATIONS", version_9)
    with Catalog.create(path) as catalog:
        catalog.rates.calibrated("m", replace(RATES, steal=0.3e-9))
        with pytest.raises(CatalogError, match="CHECK constraint"):  # the old table refuses a 0
            catalog.rates.refined("m", {"steal": 0.0})
    monkeypatch.undo()
    with Catalog.open(path) as catalog:
        assert catalog.schema_version >= 10
        assert catalog.rates.get("m") == replace(RATES, steal=0.3e-9)  # every value kept
        catalog.rates.refined("m", {"steal": 0.0})
        rates = catalog.rates.get("m")
        assert rates is not None and rates.steal == 0.0
        assert [r.samples for r in catalog.rates.records("m") if r.name == "steal"] == [1]
        with pytest.raises(CatalogError, match="CHECK constraint"):  # negative values stay refused
            catalog.rates.refined("m", {"steal": -1.0})


def test_rates_calibrated_before_steal_was_kept_read_as_zero_steal(tmp_path: Path):
    with Catalog.create(tmp_path / "c.db") as catalog:
        catalog.rates.calibrated("m", RATES)
        with catalog._db.transaction():
            catalog._db.write("DELETE FROM rates WHERE name = 'steal'", ())
        assert catalog.rates.get("m") == RATES  # steal defaults to 0
