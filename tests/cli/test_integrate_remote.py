"""`mergepipe integrate` with experts on the Hub and in object storage, and re-registration of remote models: a
model that did not change is told so from its Hub commit or its files' ETags, with no header read; a new commit
or ETag is read and becomes the next version. What each run cost is counted by the servers themselves: the fake
Hub (``tests/fixtures/fake_hub.py``), moto's S3 and the HTTP Range server (``tests/fixtures/remote.py``), all on
127.0.0.1."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml
from huggingface_hub import constants

from mergepipe.app.integration import load_recipe
from mergepipe.catalog import Catalog
from mergepipe.storage.location import RemotePath
from mergepipe.txn.verify import verify_snapshot
from tests.fixtures.checkpoints import make_base, make_expert
from tests.fixtures.cli import invoke, wide_runner
from tests.fixtures.remote import RangeServer, S3Server

if TYPE_CHECKING:
    from tests.fixtures.fake_hub import FakeHub

pytest_plugins = ["tests.fixtures.fake_hub"]  # the fake_hub fixture

#: The first read of a safetensors file (its header, ~2 KiB here): what a header read looks like in the logs.
PROBE_BYTES = 4096
PROBE = f"bytes=0-{PROBE_BYTES - 1}"


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.setenv("MERGEPIPE_REMOTE_HEADER_PROBE_BYTES", str(PROBE_BYTES))
    monkeypatch.setenv("MERGEPIPE_REMOTE_BACKOFF_SECONDS", "0.01")
    return wide_runner(monkeypatch)


@pytest.fixture
def s3(monkeypatch):
    with S3Server() as server:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        yield server


def _retrained(expert: Path, out: Path, seed: int) -> dict[str, bytes]:
    """The files of ``expert`` retrained in its layer 1 only (the rest byte-identical), written to ``out``."""
    make_expert(expert, out, seed=seed, touch=lambda n: ".layers.1." in n)
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def _integrate(runner, db: Path, recipe: Path) -> str:
    return invoke(runner, ["integrate", "--db", db, recipe, "--no-progress"])


def _statuses(text: str) -> dict[str, str]:
    """version -> status, from the inputs table `integrate` prints."""
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]
    return {row[1]: row[2] for row in rows}


def _from_scratch(runner, db: Path, out: Path) -> bytes:
    """The weights `merge` writes from scratch for the recipe's inputs, at their latest versions."""
    invoke(runner, ["merge", "--db", db, "--base", "base", "--experts", "math", "code", "chat", "--operator",
                    "ties", "--density", "0.5", "--budget", "100%", "--out", out, "--model-id", "scratch",
                    "--no-progress"])
    return _weights(out)


def _weights(out: Path) -> bytes:
    return (out / "model.safetensors").read_bytes()


def test_remote_experts_are_rechecked_by_commit_and_etag_and_publish_only_when_they_change(
        fake_hub: FakeHub, s3, tiny_family, tmp_path, runner):
    fake_hub.add_folder("org/base", tiny_family["base"])
    fake_hub.add_folder("org/math", tiny_family["e1"])
    s3.upload(tiny_family["e2"], "models", "code")
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(yaml.safe_dump({
        "base": "org/base",  # mergekit's bare Hub id
        "experts": {"math": "hf://org/math", "code": "s3://models/code", "chat": str(tiny_family["e3"])},
        "operator": "ties", "params": {"density": 0.5},
        "output": {"root": "deploy", "model_id": "merged"},
    }))
    db, deploy = tmp_path / "c.db", tmp_path / "deploy"
    first = _integrate(runner, db, recipe)
    assert "published merged" in first and verify_snapshot(deploy / "merged-v1").ok

    # a CI runner with a fresh Hugging Face cache: nothing of the last run is local any more
    shutil.rmtree(Path(constants.HF_HUB_CACHE))
    fake_hub.clear_log()
    s3.log.clear()
    again = _integrate(runner, db, recipe)
    assert "nothing changed since merged@1" in again and sorted(p.name for p in deploy.iterdir()) == ["merged-v1"]
    assert _statuses(again) == {"base@1": "unchanged", "math@1": "unchanged", "code@1": "unchanged",
                                "chat@1": "unchanged"}
    # registration resolves each Hub branch (one request) to the recorded commit, and lists each S3 directory
    # once: the sizes and ETags recorded; then the plan checks every input is still there (a commit's listing,
    # as huggingface_hub makes it: its revision and tree; an S3 listing). No object, header or block is read.
    commits = {name: fake_hub.commits(f"org/{name}")[0][0] for name in ("base", "math")}
    assert sorted(r.path for r in fake_hub.log) == sorted(
        path for name, commit in commits.items()
        for path in (f"/api/models/org/{name}", f"/api/models/org/{name}/revision/{commit}",
                     f"/api/models/org/{name}/tree/{commit}"))
    assert {(r.host, r.method, r.range) for r in fake_hub.log} == {("hub", "GET", None)}
    assert [(r.method, r.path.split("?")[0], r.range) for r in s3.log.items] == [("GET", "/models", None)] * 2

    # math is retrained and pushed: a new commit, registered as math@2 (its header read); code is unchanged
    fake_hub.move_branch("org/math", "main", _retrained(tiny_family["e1"], tmp_path / "math-new", seed=9))
    fake_hub.clear_log()
    third = _integrate(runner, db, recipe)
    assert _statuses(third) == {"base@1": "unchanged", "math@2": "new version", "code@1": "unchanged",
                                "chat@1": "unchanged"}
    assert "published merged@2" in third and "reused" in third  # incrementally, from merged@1
    assert any(r.host == "cdn" and r.path.startswith("/repos/org/math/") and r.range == PROBE for r in fake_hub.log)
    assert verify_snapshot(deploy / "merged-v2").ok
    assert _from_scratch(runner, db, tmp_path / "scratch-2") == _weights(deploy / "merged-v2")

    # code's object is replaced in S3: another ETag, registered as code@2 and merged incrementally again
    s3.client().put_object(Bucket="models", Key="code/model.safetensors",
                           Body=_retrained(tiny_family["e2"], tmp_path / "code-new", seed=10)["model.safetensors"])
    fourth = _integrate(runner, db, recipe)
    assert _statuses(fourth)["code@2"] == "new version" and _statuses(fourth)["math@2"] == "unchanged"
    assert "published merged@3" in fourth and "reused" in fourth
    assert _from_scratch(runner, db, tmp_path / "scratch-3") == _weights(deploy / "merged-v3")
    with Catalog.open(db) as catalog:
        assert {m.label: m.uri for m in catalog.models.list() if m.name in ("math", "code")} == {
            "math@1": f"hf://org/math@{fake_hub.commits('org/math')[0][0]}",
            "math@2": f"hf://org/math@{fake_hub.commits('org/math')[1][0]}",
            "code@1": "s3://models/code", "code@2": "s3://models/code"}


def test_registering_an_unchanged_sharded_s3_model_lists_it_and_reads_its_index_only(
        s3, sharded_family, tmp_path, runner):
    uri = s3.upload(sharded_family["e1"], "models", "sharded")
    db = tmp_path / "c.db"
    invoke(runner, ["register", "--db", db, "--model-id", "m", "--uri", uri])
    s3.log.clear()
    assert "nothing to do" in invoke(runner, ["register", "--db", db, "--model-id", "m", "--uri", uri])
    index = sharded_family["e1"] / "model.safetensors.index.json"
    assert [(r.method, r.path.split("?")[0], r.range) for r in s3.log.items] == [
        ("GET", "/models", None), ("GET", f"/models/sharded/{index.name}", (0, index.stat().st_size))]


def test_registering_an_unchanged_http_model_heads_its_files_and_a_replaced_file_is_its_next_version(
        tmp_path, runner):
    served = tmp_path / "served"
    make_expert(make_base(tmp_path / "base", arch="llama", dtype="bf16"), served / "m", seed=1)
    db = tmp_path / "c.db"
    with RangeServer(served) as server:
        uri = f"{server.url}/m"
        invoke(runner, ["register", "--db", db, "--model-id", "m", "--uri", uri])
        server.log.clear()
        assert "nothing to do" in invoke(runner, ["register", "--db", db, "--model-id", "m", "--uri", uri])
        heads = {(r.method, r.path, r.status) for r in server.log.items}  # metadata only: no body read
        # (fsspec's HTTP info asks an absent file again by GET: a 404, without a body)
        assert all(m == "HEAD" or s == 404 for m, _, s in heads) and len(heads) == len(server.log.items)
        assert {("HEAD", "/m/model.safetensors", 200), ("HEAD", "/m/model.safetensors.index.json", 404)} <= heads
        assert {("HEAD", f"/m/{p.name}", 200) for p in (served / "m").iterdir() if p.suffix == ".json"} <= heads

        retrained = _retrained(served / "m", tmp_path / "m-new", seed=2)["model.safetensors"]
        (served / "m" / "model.safetensors").write_bytes(retrained)  # another size-and-time ETag
        server.log.clear()
        out = invoke(runner, ["register", "--db", db, "--model-id", "m", "--uri", uri, "--new-version"])
        assert "version 2 of 'm'" in out
        assert any(r.method == "GET" and r.range == (0, PROBE_BYTES) for r in server.log.items)  # its header read


def test_a_recipe_reads_bare_hub_ids_as_merge_does_and_a_local_folder_of_that_spelling_wins(tmp_path):
    (tmp_path / "experts" / "code").mkdir(parents=True)
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump({
        "base": {"id": "qwen", "uri": "Qwen/Qwen3-0.6B@main"},
        "experts": {"math": "org/math", "code": "experts/code", "chat": "hf://org/chat@v2", "new": "./org/new"},
        "operator": "ties", "output": {"root": "deploy", "model_id": "merged"}}))
    assert load_recipe(path).locations == {
        "qwen": RemotePath("hf://Qwen/Qwen3-0.6B@main"), "math": RemotePath("hf://org/math"),
        "code": tmp_path / "experts" / "code", "chat": RemotePath("hf://org/chat@v2"),
        "new": tmp_path / "org" / "new"}  # ./ says it is a path


def test_tokenizer_files_added_to_an_s3_model_are_its_next_version(s3, tiny_family, tmp_path, runner):
    """Side files are part of a model: the metadata check of an unchanged S3 model sees them added."""
    from examples.demo_models import write_tokenizer

    uri = s3.upload(tiny_family["e1"], "models", "m")
    db = tmp_path / "c.db"
    invoke(runner, ["register", "--db", db, "--model-id", "m", "--uri", uri])
    for path in write_tokenizer(tmp_path / "tokenizer").iterdir():
        s3.client().put_object(Bucket="models", Key=f"m/{path.name}", Body=path.read_bytes())
    out = invoke(runner, ["register", "--db", db, "--model-id", "m", "--uri", uri, "--new-version"])
    assert "version 2 of 'm'" in out
    with Catalog.open(db) as catalog:
        assert "tokenizer.json" in (catalog.models.get("m@2").side_digests or {})
