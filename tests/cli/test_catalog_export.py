"""`mergepipe catalog export`: a catalog copied between backends keeps every row and every plan digest."""

from __future__ import annotations

import json

from mergepipe.catalog.database import ServerURL, catalog_location
from mergepipe.catalog.catalog import TABLES
from mergepipe.spec.plan import Plan
from tests.catalog.helpers import db_dump, raw_db
from tests.fixtures.cli import invoke, refused, wide_runner
from tests.fixtures.postgres import postgres_server, postgres_url  # noqa: F401 (fixtures)

MERGE = ["--base", "base", "--experts", "e1", "e2", "--operator", "ties", "--density", "0.5", "--budget", "60%"]


def every_row(location: str) -> dict[str, list[tuple]]:
    """table -> its rows, sorted, read with a plain connection (meta included)."""
    with raw_db(catalog_location(location)) as conn:
        return {table: sorted(conn.execute(f"SELECT * FROM {table}"), key=repr) for table in (*TABLES, "meta")}


def test_sqlite_to_postgresql_and_back_keeps_every_row_and_plan_digest(tmp_path, tiny_family, postgres_url,
                                                                       monkeypatch):
    runner = wide_runner(monkeypatch)
    laptop = str(tmp_path / "laptop.db")
    invoke(runner, ["init-db", "--db", laptop, "--block-bytes", "1KiB"])
    for model_id in ("base", "e1", "e2"):
        invoke(runner, ["register", "--db", laptop, "--model-id", model_id, "--uri", tiny_family[model_id]])
    invoke(runner, ["analyze", "--db", laptop, "--base", "base", "e1", "e2", "--no-progress",
                    "--store-deltas", tmp_path / "stores"])
    saved = json.loads(invoke(runner, ["plan", "--db", laptop, *MERGE, "--policy", "entries", "--save", "--json"]))
    invoke(runner, ["merge", "--db", laptop, *MERGE, "--out", tmp_path / "merged", "--model-id", "merged",
                    "--no-progress"])
    original = every_row(laptop)
    assert all(original[t] for t in ("models", "blocks", "block_deltas", "delta_chunks", "plans", "snapshots",
                                     "output_blocks", "merge_timings"))

    out = invoke(runner, ["catalog", "export", "--db", laptop, "--to", postgres_url])
    total = sum(len(original[t]) for t in TABLES)
    assert f"exported {laptop} to {postgres_url}: {total} rows in" in out
    assert f"({len(original['models'])} models, {len(original['plans'])} plans, 1 snapshots)" in out
    assert every_row(postgres_url) == original  # each value as it was: text, integers, doubles, NULLs

    back = str(tmp_path / "back.db")
    invoke(runner, ["catalog", "export", "--db", postgres_url, "--to", back])
    assert every_row(back) == original
    for plan_id, text, _ in original["plans"]:
        assert Plan.from_json(text).digest == plan_id
    # the team's catalog plans without analysing again: the same plan as on the laptop
    again = json.loads(invoke(runner, ["plan", "--db", postgres_url, *MERGE, "--policy", "entries", "--json"]))
    assert again["digest"] == saved["digest"]


def test_export_into_a_catalog_that_holds_records_is_refused_and_changes_nothing(tmp_path, tiny_family,
                                                                                  postgres_url, capsys, monkeypatch):
    runner = wide_runner(monkeypatch)
    source = str(tmp_path / "a.db")
    invoke(runner, ["register", "--db", source, "--model-id", "base", "--uri", tiny_family["base"]])
    invoke(runner, ["register", "--db", postgres_url, "--model-id", "other", "--uri", tiny_family["e1"]])
    before = db_dump(ServerURL(postgres_url))
    refused(["catalog", "export", "--db", source, "--to", postgres_url], capsys,
            f"catalog {postgres_url} is not empty (1 models, ", "export into a new catalog")
    assert db_dump(ServerURL(postgres_url)) == before
    refused(["catalog", "export", "--db", source, "--to", source], capsys, "is the catalog", "or one of its files")
