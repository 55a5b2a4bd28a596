"""Merges published to the Hugging Face Hub: `merge|execute|mergepipe-yaml --push-to-hub` and `mergepipe push`,
against the loopback fake Hub (huggingface_hub itself is the client).

A push is one commit holding every file of the snapshot, byte for byte (a download of that commit verifies);
it is recorded as a location of the snapshot (`snapshots`, `lineage`); pushing the same snapshot again makes no
commit; a push cut mid-upload makes none either, leaves the local snapshot intact and prints the command that
retries it, which works; `--private` makes a private repository; the token is in no file MergePipe writes and in
no message.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import RepositoryNotFoundError

from mergepipe.txn.verify import verify_snapshot
from tests.fixtures.cli import all_files, invoke, mergepipe_yaml, refused, run_main, wide_runner
from tests.planner.support import build_catalog, clone_catalog

pytest_plugins = ["tests.fixtures.fake_hub"]  # the fake_hub fixture

BLOCK_BYTES = 2048
MERGE = ["--base", "base", "--experts", "e1", "e2", "--operator", "ties", "--density", "0.5", "--budget", "60%",
         "--no-progress"]
#: The location a push records, as `snapshots` and `lineage` print it.
HUB_URI = re.compile(r"hf://([\w.-]+/[\w.-]+)@([0-9a-f]{40})")



def front_matter(card: bytes) -> dict:
    match = re.match(r"---\n(.*?)\n---\n", card.decode(), re.S)
    assert match, card[:200]
    return yaml.safe_load(match.group(1))


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory) -> Path:
    """A catalog with base, e1 and e2 registered and the experts analysed; nothing merged."""
    root = tmp_path_factory.mktemp("pushcli")
    return build_catalog(root / "catalog.db", BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2"])


@pytest.fixture
def db(template, tmp_path) -> Path:
    return clone_catalog(template, tmp_path / "catalog.db")


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


@pytest.fixture
def hub(fake_hub, monkeypatch):
    """The fake Hub, with the token that may write to it in HF_TOKEN (as a user exports it)."""
    monkeypatch.setenv("HF_TOKEN", fake_hub.token)
    return fake_hub


def token_in_files(root: Path, token: str) -> list[str]:
    """Files under ``root`` whose bytes contain ``token``."""
    return [str(p) for p in root.rglob("*") if p.is_file() and token.encode() in p.read_bytes()]


def test_merge_pushes_every_file_as_one_commit_recorded_as_a_location(hub, db, tmp_path, runner):
    out = tmp_path / "merged"
    printed = invoke(runner, ["merge", "--db", db, *MERGE, "--out", out, "--model-id", "m",
                              "--push-to-hub", "org/merged"])

    # one commit, holding exactly the snapshot's files with the same bytes
    ((sha, message, files),) = hub.commits("org/merged")
    local = all_files(out)
    assert files == local
    assert {"manifest.json", "README.md", "mergepipe_config.yml", "config.json", "model.safetensors"} <= set(files)
    manifest = verify_snapshot(out).manifest
    assert manifest.snapshot_id[:12] in message
    assert f"hf://org/merged@{sha}" in printed and "branch main" in printed
    # a download of that commit (into the Hub's cache) is the snapshot: it verifies
    downloaded = Path(snapshot_download("org/merged", revision=sha))
    assert verify_snapshot(downloaded).ok and verify_snapshot(downloaded).manifest == manifest
    # the card's front matter is the Hub's for a merge: the base and every expert, by folder name
    assert front_matter(files["README.md"]) == {"base_model": ["base", "e1", "e2"], "base_model_relation": "merge",
                                                "library_name": "transformers", "tags": ["merge", "mergepipe"]}
    assert HfApi().model_info("org/merged").private is False

    # the commit is a location of the snapshot: `snapshots` and `lineage` show it, with its time
    (view,) = json.loads(invoke(runner, ["snapshots", "--db", db, "--json"]))
    (location,) = view["hub_locations"]
    assert (location["uri"], location["repo_id"], location["revision"], location["commit"], location["private"]) == (
        f"hf://org/merged@{sha}", "org/merged", "main", sha, False)
    assert location["snapshot_id"] == manifest.snapshot_id and location["pushed_at"]
    table = invoke(runner, ["snapshots", "--db", db])
    assert f"hf://org/merged@{sha} (pushed {location['pushed_at']} to branch main)" in table
    assert str(out) in table  # the directory stays a location too
    tree = invoke(runner, ["lineage", "--db", db, "m"])
    assert f"on the Hub: hf://org/merged@{sha}" in tree and "e1 (expert)" in tree
    assert json.loads(invoke(runner, ["lineage", "--db", db, "m", "--format", "json"]))["hub_locations"] == [location]
    dot = invoke(runner, ["lineage", "--db", db, "m", "--format", "dot"])
    assert f'"m" -> "hf://org/merged@{sha}" [label="pushed"];' in dot

    # the token is in no file MergePipe wrote (catalog, snapshot) nor in anything it printed
    assert token_in_files(tmp_path, hub.token) == []
    assert hub.token not in printed + table + tree


def test_pushing_again_makes_no_commit_and_a_new_snapshot_replaces_the_files(hub, db, tmp_path, runner):
    out = tmp_path / "merged"
    invoke(runner, ["merge", "--db", db, *MERGE, "--out", out, "--model-id", "m", "--push-to-hub", "org/m"])
    ((first, _, _),) = hub.commits("org/m")
    snapshot_id = verify_snapshot(out).manifest.snapshot_id

    # the same snapshot again, by id and by directory: the repository holds it already, so no commit
    for target in (snapshot_id[:10], out):
        printed = invoke(runner, ["push", "--db", db, target, "org/m"])
        assert f"is on the Hub already: hf://org/m@{first}" in printed and "no commit was made" in printed
    assert len(hub.commits("org/m")) == 1
    (view,) = json.loads(invoke(runner, ["snapshots", "--db", db, "--json"]))
    assert [h["commit"] for h in view["hub_locations"]] == [first]

    # another merge into the same repository, sharded otherwise: its commit holds its files and nothing else
    # (a stale model.safetensors beside new shards would be loaded instead of them)
    sharded = tmp_path / "sharded"
    printed = invoke(runner, ["merge", "--db", db, *MERGE, "--budget", "100%", "--out-shard-size", "20KB",
                              "--out", sharded, "--model-id", "m2", "--push-to-hub", "org/m"])
    commits = hub.commits("org/m")
    assert len(commits) == 2 and commits[1][2] == all_files(sharded)
    assert "model.safetensors" not in commits[1][2] and "model.safetensors.index.json" in commits[1][2]
    assert "removed 1 file(s) the snapshot does not have" in printed
    assert commits[0][2] == all_files(out)  # the first commit is still the first snapshot


def test_a_push_cut_mid_upload_makes_no_commit_and_its_retry_works(hub, db, tmp_path, capsys):
    out = tmp_path / "merged"
    hub.fail_upload_after(1000)  # the weights' upload is cut after 1000 bytes
    code, stdout, err = run_main(["merge", "--db", db, *MERGE, "--out", out, "--model-id", "m",
                                  "--push-to-hub", "org/cut"], capsys)
    assert code == 1 and "Traceback" not in err
    line = err[err.index("error: "):].strip()  # after huggingface_hub's upload bar, which ends in \r
    assert "\n" not in line
    assert line.startswith("error: pushing snapshot ") and "no commit was made there" in line
    assert f"the local snapshot at {out} is intact" in line
    assert hub.commits("org/cut") == []  # the repository was created, and shows nothing
    assert any(r.status == 0 for r in hub.log)  # the cut connection
    # the merge was published all the same, and its files are intact
    report = verify_snapshot(out)
    assert report.ok
    local = all_files(out)
    code, listed, _ = run_main(["snapshots", "--db", db, "--json"], capsys)
    (view,) = json.loads(listed)
    assert view["status"] == "committed" and view["hub_locations"] == []

    # the command the line gives retries the push, and it goes through
    retry = re.search(r"retry with `(mergepipe push [^`]+)`", line).group(1)
    assert retry == f"mergepipe push {report.manifest.snapshot_id} org/cut --db {db}"
    code, printed, err = run_main(shlex.split(retry)[1:], capsys)
    assert code == 0, err
    ((sha, _, files),) = hub.commits("org/cut")
    assert files == local == all_files(out)
    assert f"hf://org/cut@{sha}" in printed


def test_private_creates_a_private_repository_and_refuses_a_public_one(hub, db, tmp_path, runner, capsys, monkeypatch):
    out = tmp_path / "merged"
    invoke(runner, ["merge", "--db", db, *MERGE, "--out", out, "--model-id", "m"])
    printed = invoke(runner, ["push", "--db", db, "m", "org/secret", "--private"])
    assert ", private;" in printed
    assert HfApi().model_info("org/secret").private is True
    (view,) = json.loads(invoke(runner, ["snapshots", "--db", db, "--json"]))
    assert view["hub_locations"][0]["private"] is True
    assert ", private)" in invoke(runner, ["snapshots", "--db", db])
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(RepositoryNotFoundError):  # nobody without the token sees it
        HfApi().model_info("org/secret")

    # --private to a repository that exists and is public: refused before any upload
    monkeypatch.setenv("HF_TOKEN", hub.token)
    hub.add_repo("org/public", {"README.md": b"# public\n"})
    refused(["push", "--db", db, "m", "org/public", "--private"], capsys,
            "org/public exists and is public, and --private was asked", "retry with `mergepipe push")
    assert len(hub.commits("org/public")) == 1


def test_a_push_to_a_new_branch_creates_it_from_main(hub, db, tmp_path, runner):
    main = hub.add_repo("org/c", {"README.md": b"# main\n"})
    out = tmp_path / "merged"
    invoke(runner, ["merge", "--db", db, *MERGE, "--out", out, "--model-id", "m"])
    printed = invoke(runner, ["push", "--db", db, out, "org/c", "--revision", "experiment"])
    sha = HUB_URI.search(printed).group(2)
    assert HfApi().model_info("org/c", revision="experiment").sha == sha
    assert HfApi().model_info("org/c", revision="main").sha == main  # main untouched
    assert [c[0] for c in hub.commits("org/c")] == [main, sha]  # one commit, made on the new branch
    assert hub.commits("org/c")[-1][2] == all_files(out)


def test_a_push_to_a_branch_leaves_main_as_it_was(hub, db, tmp_path, runner):
    main = hub.add_repo("org/b", {"README.md": b"# main\n"})
    hub.add_repo("org/b", {"README.md": b"# dev\n"}, revision="dev")
    out = tmp_path / "merged"
    invoke(runner, ["merge", "--db", db, *MERGE, "--out", out, "--model-id", "m"])
    printed = invoke(runner, ["push", "--db", db, out, "org/b", "--revision", "dev"])
    sha = HUB_URI.search(printed).group(2)
    assert HfApi().model_info("org/b", revision="dev").sha == sha
    assert HfApi().model_info("org/b", revision="main").sha == main
    assert hub.commits("org/b")[-1][2] == all_files(out)
    (view,) = json.loads(invoke(runner, ["snapshots", "--db", db, "--json"]))
    assert view["hub_locations"][0]["revision"] == "dev"


def test_execute_and_mergepipe_yaml_push_too(hub, db, tmp_path, runner, capsys, tiny_family):
    plan_id = invoke(runner, ["plan", "--db", db, *MERGE, "--save"]).strip().splitlines()[-1].split()[-1]
    out = tmp_path / "executed"
    printed = invoke(runner, ["execute", "--db", db, "--plan", plan_id, "--out", out, "--model-id", "x",
                              "--push-to-hub", "org/executed", "--revision", "main"])
    ((sha, _, files),) = hub.commits("org/executed")
    assert files == all_files(out) and f"hf://org/executed@{sha}" in printed

    config = tmp_path / "merge.yml"
    config.write_text(yaml.safe_dump({"merge_method": "task_arithmetic", "base_model": str(tiny_family["base"]),
                                      "models": [{"model": str(tiny_family["e1"])}]}))
    yaml_out = tmp_path / "from-yaml"
    code, printed, err = mergepipe_yaml([config, yaml_out, "--db", tmp_path / "yaml.db", "--push-to-hub",
                                         "org/yaml", "--private"], capsys)
    assert code == 0, err
    ((sha, _, files),) = hub.commits("org/yaml")
    assert files == all_files(yaml_out) and f"hf://org/yaml@{sha}" in printed
    assert HfApi().model_info("org/yaml").private is True


def test_push_failures_are_one_line_and_the_token_is_never_printed(fake_hub, template, db, tmp_path, runner, capsys,
                                                                   monkeypatch):
    out = tmp_path / "merged"
    invoke(runner, ["merge", "--db", db, *MERGE, "--out", out, "--model-id", "m"])
    # no credentials, and a wrong token: nothing is created or committed, and the token is not echoed
    refused(["push", "--db", db, "m", "org/nope"], capsys, "(401)", "HF_TOKEN", "no commit was made",
            f"retry with `mergepipe push {verify_snapshot(out).manifest.snapshot_id} org/nope")
    secret = "hf_not_the_right_secret"
    monkeypatch.setenv("HF_TOKEN", secret)
    line = refused(["push", "--db", db, "m", "org/nope"], capsys, "(401)")
    assert secret not in line and fake_hub.commits("org/nope") == []
    monkeypatch.setenv("HF_TOKEN", fake_hub.token)

    # what is refused before any upload (and, for a merge, before any work)
    refused(["push", "--db", db, "m", "not-a-repo-id"], capsys, "org/name")
    refused(["push", "--db", db, "nothing-such", "org/x"], capsys, "nothing-such")
    refused(["merge", "--db", db, *MERGE, "--out", tmp_path / "o1", "--private"], capsys,
            "--private needs --push-to-hub")
    refused(["merge", "--db", db, *MERGE, "--out", tmp_path / "o2", "--push-to-hub", "org/x", "--revision",
             "0" * 40], capsys, "--revision names the branch")
    other = clone_catalog(template, tmp_path / "other.db")  # the same inputs, but it did not publish the snapshot
    refused(["push", "--db", other, out, "org/x"], capsys, "which catalog", "does not have", "--db")
    # the Hub unreachable: the connection's failure, and the retry
    fake_hub.stop()
    refused(["push", "--db", db, "m", "org/x"], capsys, "the connection to the Hub", "failed",
            "the local snapshot at", "is intact", "retry with `mergepipe push")
    # a damaged snapshot is not pushed
    damaged = out / "config.json"
    damaged.chmod(0o644)
    damaged.write_text(damaged.read_text() + " ")
    refused(["push", "--db", db, "m", "org/x"], capsys, "failed verification", "config.json", "nothing was pushed")
    # offline: nothing can be pushed, and a merge asking to push does not start
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    refused(["merge", "--db", db, *MERGE, "--out", tmp_path / "o3", "--push-to-hub", "org/x"], capsys,
            "HF_HUB_OFFLINE")
    assert not (tmp_path / "o3").exists()
    assert fake_hub.commits("org/x") == []
    assert token_in_files(tmp_path, fake_hub.token) == [] and token_in_files(tmp_path, secret) == []


def test_ctrl_c_during_a_push_leaves_the_snapshot_and_says_how_to_retry(hub, db, tmp_path, runner, capsys):
    out = tmp_path / "merged"
    invoke(runner, ["merge", "--db", db, *MERGE, "--out", out, "--model-id", "m"])
    local = all_files(out)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as ctrl_c:  # Ctrl-C as the commit is being made
        ctrl_c.setattr("huggingface_hub.HfApi.create_commit", interrupted)
        code, _, err = run_main(["push", "--db", db, "m", "org/ctrl-c"], capsys)
    assert code == 130 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: interrupted while pushing snapshot ") and "retry with `mergepipe push" in err
    assert hub.commits("org/ctrl-c") == [] and all_files(out) == local and verify_snapshot(out).ok
    retry = re.search(r"retry with `(mergepipe push [^`]+)`", err).group(1)
    code, _, err = run_main(shlex.split(retry)[1:], capsys)
    assert code == 0, err
    assert [files for _, _, files in hub.commits("org/ctrl-c")] == [local]


def test_a_merge_of_hub_models_names_them_by_repository_in_the_card_it_pushes(hub, tiny_family, tmp_path, runner):
    """The model tree the Hub draws from the pushed card: the base and each expert by their Hub ids."""
    hub.add_folder("org/base", tiny_family["base"])
    hub.add_folder("org/e1", tiny_family["e1"])
    out = tmp_path / "merged"
    invoke(runner, ["merge", "--db", tmp_path / "c.db", "--base", "hf://org/base", "--experts", "hf://org/e1",
                    tiny_family["e2"], "--operator", "task_arithmetic", "--out", out, "--model-id", "m",
                    "--no-progress", "--push-to-hub", "org/merged"])
    ((_, _, files),) = hub.commits("org/merged")
    assert files == all_files(out)
    assert front_matter(files["README.md"])["base_model"] == ["org/base", "org/e1", "e2"]
