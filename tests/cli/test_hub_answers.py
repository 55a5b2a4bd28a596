"""A Hub that answers wrongly, through the CLI as a user types it: other bytes than the commit's, a commit that is
not one, answers of the wrong shape, no answer at all, a revision no branch can have, a wrong token. Each is one
``error:`` line saying what is wrong, and nothing is registered, merged or left in the cache. The Hub is the
loopback fake (``tests/fixtures/fake_hub.py``) read by huggingface_hub itself."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml
from huggingface_hub import constants, try_to_load_from_cache

from mergepipe.catalog import Catalog
from tests.fixtures.cli import refused, run_main

if TYPE_CHECKING:
    from tests.fixtures.fake_hub import FakeHub

pytest_plugins = ["tests.fixtures.fake_hub"]  # the fake_hub fixture

MODELS = ("base", "e1", "e2")


@pytest.fixture
def commits(fake_hub: FakeHub, tiny_family) -> dict[str, str]:
    return {name: fake_hub.add_folder(f"org/{name}", tiny_family[name]) for name in MODELS}


def _registered(db: Path) -> list[str]:
    if not db.exists():
        return []
    with Catalog.open(db) as catalog:
        return [m.id for m in catalog.models.list()]


def _merge_config(tmp_path: Path) -> Path:
    config = tmp_path / "m.yml"
    config.write_text(yaml.safe_dump({
        "merge_method": "ties", "base_model": "org/base", "dtype": "bfloat16",
        "models": [{"model": f"org/{e}", "parameters": {"weight": 0.5, "density": 0.5}} for e in ("e1", "e2")],
        "mergepipe": {"model_id": "m", "block_bytes": "4KiB"}}))
    return config


@pytest.mark.parametrize("model, name", [("e1", "model.safetensors"), ("base", "config.json")])
def test_bytes_other_than_the_commits_are_refused_and_not_kept_in_the_cache(commits, fake_hub, tiny_family, tmp_path,
                                                                           capsys, model, name):
    """The download server sends other bytes of the same size (a weight file's last values, a config's one
    letter): the commit's tree lists the file's sha256 (LFS) or git blob id, and what was read is checked."""
    good = (tiny_family[model] / name).read_bytes()
    fake_hub.tamper(f"org/{model}", name, good[:-3] + bytes(3) if name.endswith("safetensors") else
                    good.replace(b"llama", b"llamb"))
    out = tmp_path / "out"
    line = refused(["merge", "--db", tmp_path / "c.db", "--config", _merge_config(tmp_path), "--out", out,
                    "--no-progress"], capsys, name, f"org/{model}@{commits[model]}", "do not match")
    assert not out.exists()
    cached = try_to_load_from_cache(f"org/{model}", name, cache_dir=constants.HF_HUB_CACHE, revision=commits[model])
    assert not isinstance(cached, str), line  # a rerun downloads it again rather than trusting what came


@pytest.mark.parametrize("sha", ["main", "v1.0", "0123456789abcdef0123456789abcdef0123456", "A" * 40])
def test_a_commit_the_hub_names_is_recorded_only_if_it_is_a_full_commit_hash(fake_hub, tiny_family, tmp_path,
                                                                            capsys, sha):
    fake_hub.add_folder("org/m", tiny_family["e1"])
    fake_hub.answer(r"/api/models/org/m(/revision/.*)?", json.dumps({"id": "org/m", "sha": sha}).encode())
    db = tmp_path / "c.db"
    refused(["register", "--db", db, "--model-id", "m", "--uri", "hf://org/m"], capsys, fake_hub.endpoint,
            "not a Hub answer", "sha")
    assert _registered(db) == []


@pytest.mark.parametrize("path, body", [
    ("info", b'{"id": "org/m", "sha": 123}'),
    ("info", b'{"id": "org/m", "sha": ["0123456789abcdef0123456789abcdef01234567"]}'),
    ("info", json.dumps({"id": "org/m", "sha": "a" * 100_000}).encode()),
    ("info", b"null"),
    ("info", b"[]"),
    ("info", b"[" * 100_000 + b"]" * 100_000),
    ("tree", b"null"),
    ("tree", b'{"type": "file"}'),
    ("tree", b'[{"type": "file", "path": "model.safetensors", "size": "big", "oid": "x"}]'),
    ("tree", b"[" * 100_000 + b"]" * 100_000),
], ids=["sha int", "sha list", "sha 100 kB", "null", "[]", "nested", "tree null", "tree object", "tree size text",
        "tree nested"])
def test_hub_answers_of_the_wrong_shape_are_one_line(fake_hub, tiny_family, tmp_path, capsys, path, body):
    commit = fake_hub.add_folder("org/m", tiny_family["e1"])
    pattern = r"/api/models/org/m(/revision/.*)?" if path == "info" else r"/api/models/org/m/tree/.*"
    fake_hub.answer(pattern, body)
    uri = "hf://org/m" if path == "info" else f"hf://org/m@{commit}"  # a commit: no revision to resolve
    db = tmp_path / "c.db"
    line = refused(["register", "--db", db, "--model-id", "m", "--uri", uri], capsys, fake_hub.endpoint,
                   "not a Hub answer", "HF_ENDPOINT")
    assert len(line) < 600
    assert _registered(db) == []


def test_a_hub_that_never_answers_is_given_up_in_seconds_naming_it(fake_hub, tiny_family, tmp_path, capsys,
                                                                    monkeypatch):
    """huggingface_hub's own metadata timeout (HF_HUB_ETAG_TIMEOUT, read at its import) bounds every request
    that has none of its own."""
    fake_hub.add_folder("org/m", tiny_family["e1"])
    fake_hub.hang()
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
    done: list[tuple[object, str, str]] = []
    began = time.monotonic()
    command = threading.Thread(target=lambda: done.append(run_main(
        ["register", "--db", tmp_path / "c.db", "--model-id", "m", "--uri", "hf://org/m"], capsys)), daemon=True)
    command.start()
    command.join(30)
    assert done, "register still waits on a Hub that never answers"
    code, _, err = done[0]
    assert code not in (0, None) and len(err.strip().splitlines()) == 1, err
    assert fake_hub.endpoint in err and "did not answer within 1 s" in err and "HF_HUB_ETAG_TIMEOUT" in err
    assert time.monotonic() - began < 10


@pytest.mark.parametrize("revision", ["%00", "a%0Ab", "a\nb", "a b", "x..y"])
def test_a_revision_no_branch_can_have_is_refused_as_such(fake_hub, tiny_family, tmp_path, capsys, revision):
    fake_hub.add_folder("org/m", tiny_family["e1"])
    line = refused(["register", "--db", tmp_path / "c.db", "--model-id", "m", "--uri", f"hf://org/m@{revision}"],
                   capsys, "revision", "not a branch, tag or commit")
    assert "reach" not in line and "connection" not in line
    assert fake_hub.log == []  # decided before asking


def test_a_wrong_token_is_named_as_the_problem(fake_hub, tiny_family, tmp_path, capsys, monkeypatch):
    fake_hub.add_folder("org/m", tiny_family["e1"])
    monkeypatch.setenv("HF_TOKEN", "hf_not_the_right_one")
    line = refused(["register", "--db", tmp_path / "c.db", "--model-id", "m", "--uri", "hf://org/m"], capsys,
                   "refused the token", "HF_TOKEN")
    assert "try again later" not in line and "hf_not_the_right_one" not in line
