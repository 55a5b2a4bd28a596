"""`--db postgresql://...` and `MERGEPIPE_DB`: a catalog several machines share, as a user types it.

The reference for every value is the same session against a SQLite file: a
server catalog must give the same plans, snapshots and bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.fixtures.cli import all_files, refused, run_main, wide_runner
from tests.fixtures.cli import invoke as run
from tests.fixtures.postgres import postgres_server, postgres_url  # noqa: F401 (fixtures)

MERGE = ["--operator", "ties", "--density", "0.5", "--budget", "60%"]


def session(runner, db: str, family: dict[str, Path], out: Path) -> dict:
    """init-db, register, analyze, plan, merge, explain, verify: what a user runs, and what it gave."""
    run(runner, ["init-db", "--db", db, "--block-bytes", "1KiB"])
    for model_id in ("base", "e1", "e2"):
        run(runner, ["register", "--db", db, "--model-id", model_id, "--uri", family[model_id]])
    run(runner, ["analyze", "--db", db, "--base", "base", "e1", "e2", "--no-progress"])
    plan = json.loads(run(runner, ["plan", "--db", db, "--base", "base", "--experts", "e1", "e2", *MERGE, "--json"]))
    run(runner, ["merge", "--db", db, "--base", "base", "--experts", "e1", "e2", *MERGE, "--out", out,
                 "--model-id", "merged", "--no-progress"])
    snapshots = json.loads(run(runner, ["snapshots", "--db", db, "--json"]))
    explained = run(runner, ["explain", "--db", db, "merged"])
    run(runner, ["verify", "--db", db, "merged"])
    models = json.loads(run(runner, ["models", "--db", db, "--json"]))
    return {"plan": plan["digest"], "snapshots": [(s["id"], s["status"], s["model_id"]) for s in snapshots],
            "explained": [line.replace(db, "DB").replace(str(out), "OUT") for line in explained.splitlines()
                          if "±" not in line and " s " not in line],  # seconds: this run's own timings
            "models": sorted((m["id"], m["kind"], m["total_bytes"]) for m in models), "files": all_files(out)}


def test_a_server_catalog_gives_what_a_file_catalog_gives(tmp_path, tiny_family, postgres_url, monkeypatch):
    runner = wide_runner(monkeypatch)
    on_file = session(runner, str(tmp_path / "catalog.db"), tiny_family, tmp_path / "file-out")
    on_server = session(runner, postgres_url, tiny_family, tmp_path / "server-out")
    assert on_server["plan"] == on_file["plan"]
    assert on_server["snapshots"] == on_file["snapshots"] and on_file["snapshots"][0][1] == "committed"
    assert on_server["models"] == on_file["models"]
    manifests = [json.loads(run["files"].pop("manifest.json")) for run in (on_server, on_file)]
    assert manifests[0]["manifest_hash"] == manifests[1]["manifest_hash"]  # all but timestamps and timings
    assert on_server["files"] == on_file["files"]  # card and weights: byte for byte
    assert on_server["explained"] == on_file["explained"]


def test_analyze_refreshes_the_servers_planner_statistics(tmp_path, tiny_family, postgres_url, monkeypatch):
    """After analyze's bulk writes the server's query planner knows the new rows (an explicit ANALYZE), so the
    next plan reads the statistics through their index, not a scan and sort."""
    import psycopg

    def analysed() -> object:
        with psycopg.connect(postgres_url) as conn:
            return conn.execute("SELECT last_analyze FROM pg_stat_user_tables WHERE relname = 'block_deltas'"
                                ).fetchone()[0]

    runner = wide_runner(monkeypatch)
    run(runner, ["init-db", "--db", postgres_url, "--block-bytes", "1KiB"])
    for model_id in ("base", "e1"):
        run(runner, ["register", "--db", postgres_url, "--model-id", model_id, "--uri", tiny_family[model_id]])
    assert analysed() is None
    run(runner, ["analyze", "--db", postgres_url, "--base", "base", "e1", "--no-progress"])
    assert analysed() is not None


def test_mergepipe_db_names_a_server_catalog_without_its_password(postgres_server, capsys, monkeypatch):  # noqa: F811
    url = postgres_server.new_database()
    postgres_server.execute(f"ALTER ROLE mergepipe PASSWORD 'sesame'")
    with_password = url.replace("mergepipe@", "mergepipe:sesame@")
    monkeypatch.setenv("MERGEPIPE_DB", with_password)
    code, out, err = run_main(["init-db", "--block-bytes", "4KiB"], capsys)
    assert code == 0 and "sesame" not in out + err
    assert f"catalog: {url} (from $MERGEPIPE_DB)" in err
    assert f"catalog {url} ready: schema version" in out and "blocks of 4.0 KiB" in out
    code, out, err = run_main(["models", "--json"], capsys)
    assert code == 0 and json.loads(out) == [] and "sesame" not in err


def test_an_unreachable_server_is_one_line_naming_the_url_not_the_password(capsys):
    line = refused(["models", "--db", "postgresql://ana:sesame@127.0.0.1:1/team"], capsys,
                   "cannot reach catalog postgresql://ana@127.0.0.1:1/team: ", "Connection refused")
    assert "sesame" not in line


@pytest.mark.parametrize("url, words", [
    ("postgresql://ana:s3cr%zzet@127.0.0.1:1/team", ("catalog postgresql://ana@127.0.0.1:1/team", "as %25")),
    ("postgresql://ana:s3cret@[::1/team", ("not a valid URL (Invalid IPv6 URL)",)),
    ("postgresql://ana:s3cret@team\u202eserver/team", ("U+202E", "type the host again")),
])
def test_a_malformed_server_url_is_one_line_without_its_password(capsys, url, words):
    line = refused(["models", "--db", url], capsys, *words)
    assert "s3cr" not in line


def test_a_database_without_the_schema_says_init_db(postgres_url, capsys):
    refused(["models", "--db", postgres_url], capsys, f"no catalog at {postgres_url}; run `mergepipe init-db --db "
            f"{postgres_url}`")
    refused(["models", "--db", "mysql://host/db"], capsys, "a catalog is a SQLite file path or a postgresql:// URL")


def test_a_model_another_machine_registered_from_its_own_disk_is_named_by_its_uri(tmp_path, tiny_family,
                                                                                   postgres_url, capsys):
    local = tmp_path / "only-on-machine-a" / "e1"
    shutil.copytree(tiny_family["e1"], local)
    for model_id, uri in (("base", tiny_family["base"]), ("e1", local)):
        assert run_main(["register", "--db", postgres_url, "--model-id", model_id, "--uri", uri], capsys)[0] == 0
    shutil.rmtree(local.parent)  # machine B: the directory is not there
    refused(["analyze", "--db", postgres_url, "--base", "base", "e1", "--no-progress"], capsys,
            f"model 'e1' is registered at {local} in shared catalog {postgres_url}", "has no such directory",
            "(a shared filesystem) or in an object store")
