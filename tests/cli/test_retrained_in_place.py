"""An expert retrained in place after a merge: every command says so, and only what still works.

A user registers a base and an expert from folders, merges, deletes the output with `rm -rf`, then
overwrites the expert's weights in its folder (a retrain). The snapshot's plan needs the old
weights, which are gone, and `--force` may not replace a model a snapshot was made from. `verify`,
`execute --plan` and `register --force` must each say in one line that the inputs changed on disk
and name the two ways out: putting the files back (then the plan re-materialises the snapshot byte
for byte) or registering the new files with `--new-version` (then merging again works). Each way
is followed here as the message words it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil

import pytest
import torch

from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.cli import all_files, invoke, one_line_error, run_main, wide_runner
from tests.planner.support import deltas_of, ref_task_arithmetic

MERGE = ["--base", "base", "--experts", "e1", "--operator", "task_arithmetic", "--no-progress"]
WEIGHTS = "model.safetensors"




@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


@pytest.fixture
def retrained(tiny_family, runner, tmp_path):
    """The user's story up to the retrain: what was merged, and a copy of the old weights with their times."""
    base, expert = tmp_path / "base", tmp_path / "e1"
    shutil.copytree(tiny_family["base"], base)
    shutil.copytree(tiny_family["e1"], expert)
    db, out = tmp_path / "cat.db", tmp_path / "merged"
    invoke(runner, ["register", "--db", db, "--model-id", "base", "--uri", base])
    invoke(runner, ["register", "--db", db, "--model-id", "e1", "--uri", expert])
    invoke(runner, ["merge", "--db", db, *MERGE, "--out", out, "--model-id", "merged"])
    files = all_files(out)
    manifest = json.loads(files["manifest.json"])
    backup = tmp_path / "backup"
    backup.mkdir()
    shutil.copy2(expert / WEIGHTS, backup / WEIGHTS)  # as `cp -p` keeps it: bytes and modification time

    shutil.rmtree(out)  # a plain rm -rf: the folder is its owner's
    old = os.stat(expert / WEIGHTS)
    shutil.copyfile(tiny_family["e2"] / WEIGHTS, expert / WEIGHTS)  # the retrain: other weights, same layout
    os.utime(expert / WEIGHTS, ns=(old.st_atime_ns, old.st_mtime_ns + 1_000_000_000))  # written later
    assert (expert / WEIGHTS).read_bytes() != (backup / WEIGHTS).read_bytes()
    return {"db": db, "out": out, "expert": expert, "base": base, "files": files, "backup": backup,
            "snapshot_id": manifest["snapshot_id"], "plan": manifest["plan_digest"][:12]}


def advice(story) -> str:
    """What each command must say can still be done: both ways out, each as it is done."""
    db, expert = story["db"], story["expert"]
    return ("e1@1 is an input of merged@1, so it cannot be replaced: put back the files it was registered with "
            "(with their modification times, as `cp -p` restores them: sizes and times are what is checked), or "
            f"register the new files as e1@2 (`mergepipe register --db {db} --model-id e1 --uri {expert} "
            "--new-version`) and merge with that")


def dead_end_messages(story, capsys) -> dict[str, str]:
    """The one-line error of each command a user tries first, by command."""
    db, new = story["db"], story["out"].parent / "again"
    tries = {
        "verify": ["verify", "--db", db, "merged@1"],
        "execute": ["execute", "--db", db, "--plan", story["plan"], "--out", new, "--no-progress"],
        "register --force": ["register", "--db", db, "--model-id", "e1", "--uri", story["expert"], "--force"],
    }
    errors = {name: one_line_error(*run_main(argv, capsys)[::2]) for name, argv in tries.items()}
    assert not new.exists()
    return errors


def test_every_command_says_the_inputs_changed_and_what_can_still_be_done(retrained, capsys):
    story = retrained
    changed = f"model 'e1' changed on disk since registration (file {story['expert'] / WEIGHTS})"
    errors = dead_end_messages(story, capsys)
    assert errors == {
        "verify": (f"error: snapshot {story['snapshot_id']} (model 'merged') is missing: {story['out']} no longer "
                   f"exists; `mergepipe execute --db {story['db']} --plan {story['plan']} --out DIR` would "
                   f"re-materialise it from the exact inputs it records, but {changed}; {advice(story)}\n"),
        "execute": (f"error: snapshot {story['snapshot_id']} cannot be re-materialised: {changed}; "
                    f"{advice(story)}\n"),
        "register --force": ("error: model 'e1' (e1@1) changed on disk since registration (file sizes or times "
                             f"differ); {advice(story)}\n"),
    }
    for message in errors.values():  # no advice to run `--force`, which is refused, nor the plan alone
        assert "--force" not in message and "re-materialise it with" not in message


def test_putting_the_files_back_lets_the_plan_rematerialise_the_snapshot(retrained, runner, capsys):
    story = retrained
    shutil.copy2(story["backup"] / WEIGHTS, story["expert"] / WEIGHTS)  # as `cp -p` puts them back
    code, _, err = run_main(["verify", "--db", story["db"], "merged@1"], capsys)
    assert one_line_error(code, err) == (
        f"error: snapshot {story['snapshot_id']} (model 'merged') is missing: {story['out']} no longer exists; "
        f"re-materialise it with `mergepipe execute --db {story['db']} --plan {story['plan']} --out DIR`\n")
    invoke(runner, ["execute", "--db", story["db"], "--plan", story["plan"], "--out", story["out"], "--no-progress"])
    assert all_files(story["out"]) == story["files"]


def test_registering_the_new_files_as_a_new_version_merges_again(retrained, runner, tiny_family, capsys):
    story = retrained
    (command,) = re.findall(r"`(mergepipe register [^`]*)`", dead_end_messages(story, capsys)["verify"])
    output = invoke(runner, shlex.split(command)[1:])  # as the message words it
    assert output.startswith("registered 'e1@2' (version 2 of 'e1')")

    out = story["out"].parent / "merged-v2"
    invoke(runner, ["merge", "--db", story["db"], *MERGE, "--out", out, "--model-id", "merged"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model_id"] == "merged@2" and [e["id"] for e in manifest["experts"]] == ["e1@2"]
    assert f"OK {out}:" in invoke(runner, ["verify", "--db", story["db"], "merged"])
    base, new = load_tensors(tiny_family["base"]), load_tensors(tiny_family["e2"])  # e2's weights are e1's now
    merged = load_tensors(out)
    for name, value in merged.items():
        expected = ref_task_arithmetic(*deltas_of(base, [new], name), [1.0]).to(value.dtype)
        assert torch.equal(value, expected), name

    # the old snapshot's advice now points at the version that exists
    code, _, err = run_main(["verify", "--db", story["db"], "merged@1"], capsys)
    assert one_line_error(code, err).endswith(
        "e1@1 is an input of merged@1, so it cannot be replaced: put back the files it was registered "
        "with (with their modification times, as `cp -p` restores them: sizes and times are what is checked), or "
        "the new files are registered already, as e1@2 (from the same directory): merge with e1@2 instead\n")
