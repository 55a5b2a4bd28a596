"""Remote checkpoints through the CLI: `register --uri s3://…`, `analyze`, `merge`, `verify`, and the one-line
errors (a missing object, a missing extra). moto's S3 and the test HTTP server run on 127.0.0.1 only."""

from __future__ import annotations

import json
import sys

import pytest

from mergepipe.txn.verify import verify_snapshot
from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.fixtures.remote import RangeServer, S3Server


@pytest.fixture(scope="module")
def s3(tiny_family):
    with S3Server() as server:
        for name in ("base", "e1", "e2"):
            server.upload(tiny_family[name], "models", name)
        yield server


@pytest.fixture(autouse=True)
def _env(s3, monkeypatch):
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MERGEPIPE_REMOTE_BACKOFF_SECONDS", "0.01")


def test_register_analyze_merge_from_s3_gives_the_local_merge(tiny_family, tmp_path, monkeypatch):
    runner = wide_runner(monkeypatch)
    remote_db, local_db = tmp_path / "remote.db", tmp_path / "local.db"
    for db, where in ((remote_db, lambda m: f"s3://models/{m}"), (local_db, lambda m: tiny_family[m])):
        invoke(runner, ["init-db", "--db", db, "--block-bytes", "4KiB"])
        for model in ("base", "e1", "e2"):
            out = invoke(runner, ["register", "--db", db, "--model-id", model, "--uri", where(model)])
            assert f"registered '{model}'" in out
        invoke(runner, ["analyze", "--db", db, "--base", "base", "e1", "e2"])
        invoke(runner, ["merge", "--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "ties",
                        "--density", "0.5", "--budget", "30%", "--out", tmp_path / db.stem, "--model-id", "m"])
    shown = json.loads(invoke(runner, ["show", "--db", remote_db, "e1", "--json"]))
    assert json.dumps(shown).count("s3://models/e1") >= 1 and "testing" not in json.dumps(shown)  # no credentials
    remote, local = load_tensors(tmp_path / "remote"), load_tensors(tmp_path / "local")
    assert remote.keys() == local.keys() and all(remote[k].equal(local[k]) for k in remote)
    manifest = json.loads((tmp_path / "remote" / "manifest.json").read_text())
    assert manifest["manifest_hash"] == json.loads((tmp_path / "local" / "manifest.json").read_text())["manifest_hash"]
    assert manifest["cost"]["realized"]["requests_by_model"]["e1"] >= 1
    assert verify_snapshot(tmp_path / "remote").ok


def test_the_one_line_form_registers_an_http_uri_on_the_fly(tiny_family, tmp_path, capsys):
    with RangeServer(tiny_family["base"].parent) as server:
        code, out, err = run_main(["--db", tmp_path / "c.db", "--base", f"{server.url}/base", "--experts",
                                   f"{server.url}/e1", "--out", tmp_path / "out", "--model-id", "m", "--budget",
                                   "100%", "--no-progress"], capsys)
    assert code == 0, err
    assert load_tensors(tmp_path / "out").keys() == load_tensors(tiny_family["base"]).keys()


def test_a_missing_object_and_a_missing_extra_are_one_line_errors(tiny_family, tmp_path, capsys, monkeypatch):
    db = tmp_path / "c.db"
    run_main(["init-db", "--db", db], capsys)
    code, _, err = run_main(["register", "--db", db, "--model-id", "x", "--uri", "s3://models/no-such-model"], capsys)
    assert code != 0 and err.startswith("error:") and err.count("\n") == 1 and "s3://models/no-such-model" in err
    monkeypatch.setitem(sys.modules, "s3fs", None)
    code, _, err = run_main(["register", "--db", db, "--model-id", "x", "--uri", "s3://models/base"], capsys)
    assert code != 0 and "pip install 'mergepipe[remote]'" in err and err.count("\n") == 1
    code, _, err = run_main(["register", "--db", db, "--model-id", "x", "--uri", "gs://b/m"], capsys)
    assert code != 0 and "unsupported location" in err and err.count("\n") == 1
