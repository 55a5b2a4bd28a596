"""Evaluations (catalog/snapshots.py, EvaluationStore): rows round-trip, evaluating again replaces them, subjects are content, and
the migration that adds the table to an older catalog."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

import pytest
from pydantic import ValidationError

from mergepipe.catalog import Catalog, schema
from mergepipe.catalog.records import EvaluationRecord, EvaluationSubject
from tests.catalog.test_locations import committed  # noqa: F401 - the fixture
from tests.catalog.test_snapshots import hash_blocks

PLAN, MODEL = "a" * 64, "b" * 64
WIKI, CODE = "1" * 64, "2" * 64


def row(subject: str = PLAN, data: str = WIKI, metric: str = "loss", value: float = 2.5, **changes) -> EvaluationRecord:
    values = dict(subject=subject, subject_kind="plan" if subject == PLAN else "model", data_digest=data,
                  data_name="wiki.txt" if data == WIKI else "code.txt", metric=metric, value=value, tokens=4096,
                  versions={"mergepipe": "1.0", "torch": "2.5.1"}, device="cpu", seconds=1.25,
                  created_at="2026-12-06T10:00:00+00:00")
    return EvaluationRecord(**{**values, **changes})


@pytest.fixture
def catalog(tmp_path: Path):
    with Catalog.create(tmp_path / "c.db") as cat:
        yield cat


def test_rows_round_trip_by_subject_and_data(catalog, tmp_path):
    rows = [row(), row(metric="perplexity", value=12.25), row(data=CODE, value=1.75, tokens=None),
            row(subject=MODEL, value=3.0, versions={}, device="cuda:1", seconds=0.5),
            row(subject=MODEL, data=CODE, metric="hellaswag/acc", value=math.nan)]
    catalog.evaluations.add(rows)
    assert catalog.evaluations.get(PLAN, WIKI) == [rows[0], rows[1]]  # by metric
    assert catalog.evaluations.get(PLAN, CODE) == [rows[2]] and catalog.evaluations.get(PLAN, "3" * 64) == []
    found = catalog.evaluations.for_subjects([MODEL, PLAN, "c" * 64, PLAN])
    assert list(found) == [PLAN, MODEL]  # a subject without rows is left out
    assert found[PLAN] == [rows[2], rows[0], rows[1]]  # by data name (code.txt first), then metric
    (nan,) = [r for r in found[MODEL] if r.metric == "hellaswag/acc"]
    assert math.isnan(nan.value) and nan.model_copy(update={"value": 0.0}) == rows[4].model_copy(update={"value": 0.0})
    assert [r for r in found[MODEL] if r.metric == "loss"] == [rows[3]]
    with Catalog.open(tmp_path / "c.db") as again:  # what another process reads
        assert again.evaluations.get(PLAN, WIKI) == [rows[0], rows[1]]
        assert again.evaluations.for_subjects([]) == {}


def test_evaluating_again_replaces_the_rows_of_that_subject_data_and_metric(catalog):
    catalog.evaluations.add([row(), row(metric="perplexity", value=12.25), row(data=CODE)])
    newer = row(value=2.0, tokens=8192, versions={"mergepipe": "1.1"}, device="cuda", seconds=0.75,
                created_at="2026-12-07T10:00:00+00:00")
    catalog.evaluations.add([newer])
    assert catalog.evaluations.get(PLAN, WIKI) == [newer, row(metric="perplexity", value=12.25)]
    assert catalog.evaluations.get(PLAN, CODE) == [row(data=CODE)]
    assert len(catalog._db.query("SELECT * FROM evaluations")) == 3


def test_an_unknown_subject_kind_is_refused():
    with pytest.raises(ValidationError, match="subject_kind\n.*'plan', 'model' or 'hybrid'"):
        row(subject_kind="snapshot")


def test_a_merged_model_is_its_plan_and_any_other_its_content(committed):  # noqa: F811
    catalog, _ = committed  # 'merged': snapshot 'snap-1' of plan 'plan1'; base, e1, e3 hashed, e2 not
    models = {m: catalog.models.get(m) for m in ("merged", "base", "e2")}
    assert catalog.evaluations.subject_of(models["merged"]) == EvaluationSubject(kind="plan", id="plan1")
    assert catalog.evaluations.subject_of(models["base"]) == EvaluationSubject(
        kind="model", id=catalog.blocks.content_fingerprint("base"))
    assert catalog.evaluations.subject_of(models["e2"]) is None  # no content fingerprint yet, so no rows
    hash_blocks(catalog, "e2")
    e2 = catalog.evaluations.subject_of(models["e2"])
    assert e2 is not None and e2.id == catalog.blocks.content_fingerprint("e2") != models["e2"].fingerprint


def test_migration_15_adds_the_table_to_an_older_catalog(tmp_path: Path, monkeypatch):
    path = tmp_path / "c.db"
    monkeypatch.setattr(schema, "MIGRATIONS", tuple(m for m in schema.MIGRATIONS if m.version <= 14))
    with Catalog.create(path) as old:
        assert old.schema_version == 14
    monkeypatch.undo()
    conn = sqlite3.connect(path)
    assert "evaluations" not in {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    conn.close()
    with Catalog.open(path) as catalog:
        assert catalog.schema_version == schema.MIGRATIONS[-1].version >= 15
        catalog.evaluations.add([row()])
        assert catalog.evaluations.get(PLAN, WIKI) == [row()]
    conn = sqlite3.connect(path)
    try:
        version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        assert version == (str(schema.MIGRATIONS[-1].version),)
        with pytest.raises(sqlite3.IntegrityError):  # the table's own CHECK, beside the store's
            conn.execute("INSERT INTO evaluations VALUES ('s', 'snapshot', 'd', 'n', 'loss', 1, NULL, '{}', 'cpu', "
                         "1, 't')")
    finally:
        conn.close()
