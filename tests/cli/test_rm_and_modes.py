"""Outputs a user can delete: `mergepipe rm`, and the modes a snapshot is published with.

`mergepipe rm DIR|SNAPSHOT|MODEL` deletes what MergePipe wrote into a snapshot's directory and
records the location as removed: the catalog keeps the snapshot and its lineage, `snapshots` and
`verify` say it is missing, and the `execute --plan` command `verify` gives brings back every byte.
A file the user added stays, with its folder, and is named; a directory that is not a snapshot of
the catalog is refused in one line and left as it was. Published files are read-only; directories
stay their owner's, so a plain `rm -rf` (no chmod first) deletes a snapshot: checked as an
unprivileged user where the test can switch to one (as root), as the current user otherwise.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.fixtures.checkpoints import make_writable_tree
from tests.fixtures.cli import all_files, invoke, one_line_error, run_main, wide_runner
from tests.planner.support import build_catalog, clone_catalog

BLOCK_BYTES = 2048
MERGE = ["--base", "base", "--experts", "e1", "e2", "--operator", "ties", "--density", "0.5", "--budget", "60%",
         "--no-progress"]
#: Unprivileged users a root test run switches to, the first one this machine has.
UNPRIVILEGED = ("nobody", "postgres")




@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory) -> Path:
    """A catalog with base, e1 and e2 registered and the experts analysed; nothing merged."""
    root = tmp_path_factory.mktemp("rmcli")
    return build_catalog(root / "catalog.db", BLOCK_BYTES, dict(tiny_family), base="base", experts=["e1", "e2"])


@pytest.fixture
def db(template, tmp_path) -> Path:
    return clone_catalog(template, tmp_path / "catalog.db")


@pytest.fixture
def runner(monkeypatch):
    return wide_runner(monkeypatch)


def merge(runner, db: Path, out: Path, model_id: str = "merged") -> dict:
    """Merge the module's TIES merge into ``out`` through the CLI; its manifest."""
    invoke(runner, ["merge", "--db", db, *MERGE, "--out", out, "--model-id", model_id])
    return json.loads((out / "manifest.json").read_text())


def location(runner, db: Path, path: Path) -> dict:
    """The location at ``path`` of the catalog's only snapshot, from `snapshots --json`."""
    (record,) = json.loads(invoke(runner, ["snapshots", "--db", db, "--json"]))
    (found,) = [loc for loc in record["locations"] if loc["path"] == str(path)]
    return found


# ----------------------------------------------------------------------------- rm and re-materialise


@pytest.mark.parametrize("target", ["directory", "snapshot id", "snapshot id prefix", "model", "model@1"])
def test_rm_removes_the_directory_and_the_plan_brings_it_back(db, runner, tmp_path, monkeypatch, capsys, target):
    out = tmp_path / "out"
    manifest = merge(runner, db, out)
    files = all_files(out)
    snapshot_id, plan = manifest["snapshot_id"], manifest["plan_digest"][:12]
    monkeypatch.chdir(tmp_path)  # a directory as a user types it, relative to where they are
    given = {"directory": "./out", "snapshot id": snapshot_id, "snapshot id prefix": snapshot_id[:10],
             "model": "merged", "model@1": "merged@1"}[target]
    execute = f"`mergepipe execute --db {db} --plan {plan} --out DIR`"

    output = invoke(runner, ["rm", "--db", db, given])
    assert output.splitlines() == [
        f"rm: removed {out} (snapshot {snapshot_id} ('merged'))",
        f"rm: the catalog keeps snapshot {snapshot_id} ('merged') and its lineage; re-materialise it with {execute}",
    ]
    assert not os.path.lexists(out)
    removed = location(runner, db, out)
    assert removed["exists"] is False and removed["removed_at"] is not None
    listed = invoke(runner, ["snapshots", "--db", db])
    assert f"{out} (missing: removed with `mergepipe rm` {removed['removed_at']})" in listed and plan in listed
    code, _, err = run_main(["verify", "--db", db, "merged"], capsys)
    assert one_line_error(code, err) == (
        f"error: snapshot {snapshot_id} (model 'merged') is missing: {out} was removed with `mergepipe rm` "
        f"({removed['removed_at']}); re-materialise it with {execute}\n")
    # the lineage stays: the snapshot's parents are still recorded
    lineage = json.loads(invoke(runner, ["lineage", "--db", db, "merged", "--format", "json"]))
    assert [(p["id"], p["role"]) for p in lineage["parents"]] == [("base", "base"), ("e1", "expert"),
                                                                   ("e2", "expert")]

    # the command verify gave, at the same place: every byte back, the location live again
    invoke(runner, ["execute", "--db", db, "--plan", plan, "--out", out, "--no-progress"])
    assert all_files(out) == files
    back = location(runner, db, out)
    assert back["exists"] is True and back["removed_at"] is None
    assert f"OK {out}:" in invoke(runner, ["verify", "--db", db, "merged"])


def test_files_the_user_added_or_edited_stay_with_the_folder(db, runner, tmp_path, capsys):
    out = tmp_path / "out"
    manifest = merge(runner, db, out)
    files = all_files(out)
    (out / "notes.txt").write_text("my eval notes\n")  # the folder is its owner's: they may add files
    (out / "eval").mkdir()
    (out / "eval" / "results.json").write_text('{"score": 1}\n')
    (out / "config.json").chmod(0o644)
    edited = (out / "config.json").read_bytes() + b"\n"
    (out / "config.json").write_bytes(edited)  # no longer the file MergePipe wrote

    output = invoke(runner, ["rm", "--db", db, out])
    snapshot_id = manifest["snapshot_id"]
    assert output.splitlines()[0] == (
        f"rm: removed snapshot {snapshot_id} ('merged')'s files from {out}; kept the folder, which holds 3 file(s) "
        "MergePipe did not write: config.json, eval/results.json, notes.txt")
    assert all_files(out) == {"config.json": edited, "eval/results.json": b'{"score": 1}\n',
                              "notes.txt": b"my eval notes\n"}
    assert location(runner, db, out)["removed_at"] is not None
    code, _, err = run_main(["verify", "--db", db, snapshot_id], capsys)
    assert f"is missing: {out} was removed with `mergepipe rm`" in one_line_error(code, err)

    again = tmp_path / "again"  # the folder is the user's now: the snapshot comes back elsewhere
    invoke(runner, ["execute", "--db", db, "--plan", manifest["plan_digest"], "--out", again, "--no-progress"])
    assert all_files(again) == files


#: The end of the error for a directory `mergepipe rm` refuses.
REFUSED = "mergepipe rm deletes only directories of snapshots MergePipe published, and nothing was removed"


def _not_a_snapshot(case: str, tmp_path: Path, out: Path, base: Path) -> tuple[Path, str]:
    """A directory `rm` must refuse, made for ``case``, and the error it must give (``{db}`` to fill)."""
    if case == "a folder of the user's":
        path = tmp_path / "mine"
        path.mkdir()
        (path / "weights.bin").write_bytes(b"\x00" * 64)
    elif case == "a copy of the snapshot":  # every byte, manifest included, where the catalog never published it
        path = tmp_path / "copy"
        shutil.copytree(out, path)
    elif case == "a folder inside the snapshot's":
        path = out / "extra"
        path.mkdir()
        (path / "a.txt").write_text("mine\n")
        return path, f"error: {path} is inside the directory of snapshot {{snapshot_id}}: give {out} to remove it"
    else:
        path = base.resolve()
        return path, (f"error: {path} is the directory of registered model 'base' (a checkpoint you registered), "
                      f"not a snapshot: {REFUSED}")
    return path, (f"error: {path} is not the directory of a snapshot of catalog {{db}} (`mergepipe snapshots`): "
                  f"{REFUSED}")


@pytest.mark.parametrize("case", ["a folder of the user's", "a copy of the snapshot", "a folder inside the snapshot's",
                                  "the registered base's folder"])
def test_a_directory_that_is_not_a_snapshot_is_refused_and_untouched(db, runner, tmp_path, tiny_family, capsys, case):
    out = tmp_path / "out"
    manifest = merge(runner, db, out)
    path, expected = _not_a_snapshot(case, tmp_path, out, tiny_family["base"])
    before, snapshot_before = all_files(path), all_files(out)
    code, _, err = run_main(["rm", "--db", db, path], capsys)
    assert one_line_error(code, err) == expected.format(db=db, snapshot_id=manifest["snapshot_id"]) + "\n"
    assert all_files(path) == before and all_files(out) == snapshot_before
    assert location(runner, db, out)["removed_at"] is None


@pytest.mark.parametrize("target, expected", [
    ("e1", "error: 'e1' is a registered checkpoint (your files at {e1}), not a snapshot MergePipe published: "
           "`mergepipe rm` never deletes them"),
    ("snap-0000", "error: snap-0000: no such directory, and no snapshot or merged model of {db} has that name; "
                  "`mergepipe snapshots` lists them"),
])
def test_a_name_that_is_not_a_snapshot_is_refused(db, runner, tmp_path, tiny_family, capsys, target, expected):
    out = tmp_path / "out"
    merge(runner, db, out)
    code, _, err = run_main(["rm", "--db", db, target], capsys)
    assert one_line_error(code, err) == expected.format(e1=tiny_family["e1"], db=db) + "\n"
    assert location(runner, db, out)["removed_at"] is None and (out / "manifest.json").is_file()


@pytest.mark.parametrize("target, gone, kept", [
    ("second directory", "second", "first"),
    ("other", "second", "first"),  # the alias: its directory only
    ("first directory", "first", "second"),
    ("merged", "first", "second"),  # the snapshot's own model: its directory only, not the alias's
])
def test_rm_of_one_location_leaves_the_other(db, runner, tmp_path, target, gone, kept):
    """The same merge under another --model-id publishes the same snapshot at a second place, as 'other'."""
    dirs = {"first": tmp_path / "first", "second": tmp_path / "second"}
    manifest = merge(runner, db, dirs["first"], "merged")
    assert merge(runner, db, dirs["second"], "other")["snapshot_id"] == manifest["snapshot_id"]
    files = all_files(dirs["first"])
    owner = {"first": "merged", "second": "other"}
    given = str(dirs[target.split()[0]]) if target.endswith("directory") else target

    output = invoke(runner, ["rm", "--db", db, given])
    assert output.splitlines() == [
        f"rm: removed {dirs[gone]} (snapshot {manifest['snapshot_id']} ('{owner[gone]}'))",
        f"rm: snapshot {manifest['snapshot_id']} ('{owner[gone]}') is still at {dirs[kept]}",
    ]
    assert not os.path.lexists(dirs[gone]) and all_files(dirs[kept]) == files
    assert location(runner, db, dirs[gone])["removed_at"] is not None
    assert location(runner, db, dirs[kept])["removed_at"] is None
    assert f"OK {dirs[kept]}:" in invoke(runner, ["verify", "--db", db, owner[kept]])


def test_rm_of_the_snapshot_id_removes_every_location(db, runner, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    snapshot_id = merge(runner, db, first)["snapshot_id"]
    merge(runner, db, second, "other")
    lines = invoke(runner, ["rm", "--db", db, snapshot_id]).splitlines()
    assert lines[:2] == [f"rm: removed {first} (snapshot {snapshot_id} ('merged'))",
                         f"rm: removed {second} (snapshot {snapshot_id} ('merged'))"]
    assert lines[2].startswith(f"rm: the catalog keeps snapshot {snapshot_id} ('merged') and its lineage")
    assert not first.exists() and not second.exists()


# ----------------------------------------------------------------------------- publish modes and rm -rf


def _umask() -> int:
    """This process's umask (setting it is the only way to read it; set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_published_files_are_read_only_and_folders_stay_their_owners(db, runner, tmp_path):
    """Files lose every write bit; directories keep their owner's rwx and lose group and other write:
    with the usual umask 022, files 0o444 and folders 0o755."""
    out = tmp_path / "out"
    merge(runner, db, out)
    mask = _umask()
    file_mode, dir_mode = 0o666 & ~mask & ~0o222, (0o777 & ~mask | 0o700) & ~0o022
    if mask == 0o022:
        assert (file_mode, dir_mode) == (0o444, 0o755)
    modes = {p.relative_to(out).as_posix() or ".": stat.S_IMODE(p.lstat().st_mode) for p in [out, *out.rglob("*")]}
    assert modes == {name: dir_mode if (out / name).is_dir() else file_mode for name in modes}
    assert {"model.safetensors", "manifest.json", "README.md", "config.json"} <= set(modes)


def _unprivileged_user() -> pwd.struct_passwd | None:
    for name in UNPRIVILEGED:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    return None


def _chown_tree(root: Path, user: pwd.struct_passwd) -> None:
    for path in [root, *root.rglob("*")]:
        os.chown(path, user.pw_uid, user.pw_gid, follow_symlinks=False)


def _rm_rf_as(user: pwd.struct_passwd, where: Path, name: str) -> subprocess.CompletedProcess:
    rm = shutil.which("rm")
    assert rm is not None
    return subprocess.run([rm, "-rf", name], cwd=where, user=user.pw_uid, group=user.pw_gid, extra_groups=[],
                          capture_output=True, text=True, check=False, timeout=60)


def test_the_owner_deletes_a_snapshot_with_a_plain_rm_rf(db, runner, tmp_path):
    """As root (who ignores permissions) the snapshot is published into a folder handed to an unprivileged
    user, as if they had published it (modes and owner; the test's interpreter may not be theirs to run),
    and `rm -rf` runs as that user. A control tree with the old modes (read-only folders) must fail the
    same way, or the switch would prove nothing. As anyone else, the current user deletes it in-process."""
    if os.geteuid() != 0:
        out = tmp_path / "out"
        merge(runner, db, out)
        shutil.rmtree(out)  # no chmod first
        assert not out.exists()
        return
    user = _unprivileged_user()
    if user is None:
        pytest.skip(f"running as root and none of the users {', '.join(UNPRIVILEGED)} exists to switch to; "
                    "the publish modes are checked by test_published_files_are_read_only_and_folders_stay_their_owners")
    home = Path(tempfile.mkdtemp(prefix="mergepipe-rm-"))  # outside pytest's root-only tmp folders
    try:
        merge(runner, db, home / "merged")
        shutil.copytree(home / "merged", home / "old-modes")
        os.chmod(home / "old-modes", 0o555)  # what publishing did before: a folder nobody may delete from
        _chown_tree(home, user)

        done = _rm_rf_as(user, home, "merged")
        assert done.returncode == 0, done.stderr
        assert not (home / "merged").exists()
        control = _rm_rf_as(user, home, "old-modes")
        assert control.returncode != 0 and "Permission denied" in control.stderr
        assert (home / "old-modes" / "manifest.json").is_file()
    finally:
        make_writable_tree(home)
        shutil.rmtree(home)


def test_weights_a_user_saved_into_the_folder_at_the_same_size_are_kept(tmp_path, monkeypatch, capsys):
    """Weight files of 16 MiB and more were compared by size alone, so `rm` deleted weights a user re-saved
    there at the same size. A file is deleted only when it is the inode published and unchanged since, or
    has the manifest's hash (then even one whose times moved is MergePipe's)."""
    gen = torch.Generator().manual_seed(0)
    big = {"big.weight": torch.randn(4160, 1024, generator=gen), "norm.weight": torch.ones(1024)}  # 17 MB of fp32
    for name, shift in (("base", 0.0), ("e1", 0.01)):
        (tmp_path / name).mkdir()
        save_file({k: v + shift for k, v in big.items()}, str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "config.json").write_text('{"model_type": "custom"}')
    db = build_catalog(tmp_path / "c.db", 1 << 20, {"base": tmp_path / "base", "e1": tmp_path / "e1"})
    runner = wide_runner(monkeypatch)
    out, again = tmp_path / "out", tmp_path / "again"
    invoke(runner, ["merge", "--db", db, "--base", "base", "--experts", "e1", "--operator", "task_arithmetic",
                    "--out", out, "--model-id", "m", "--no-progress"])
    weights = out / "model.safetensors"
    assert weights.stat().st_size >= 16 << 20
    resaved = bytearray(weights.read_bytes())
    resaved[-1] ^= 0x01  # the user's own weights, saved over the published file: same name, same size
    weights.unlink()
    weights.write_bytes(resaved)

    output = invoke(runner, ["rm", "--db", db, out])
    assert "kept the folder, which holds 1 file(s) MergePipe did not write: model.safetensors" in output, output
    assert weights.read_bytes() == resaved

    plan = json.loads(invoke(runner, ["snapshots", "--db", db, "--json"]))[0]["plan_id"]
    invoke(runner, ["execute", "--db", db, "--plan", plan, "--out", again, "--no-progress"])
    os.utime(again / "model.safetensors", ns=(0, 0))  # the published bytes, their times moved (a backup restore)
    output = invoke(runner, ["rm", "--db", db, again])
    assert output.startswith(f"rm: removed {again} ") and not again.exists(), output


def test_rm_never_follows_a_symbolic_link_above_the_snapshot(db, runner, tmp_path, capsys):
    """`mv out out.old; ln -s backup out`: the snapshot's recorded directory now leads into the user's backup;
    `rm` deleted the files there. It is refused, as a snapshot directory that is itself a link is."""
    (tmp_path / "out").mkdir()
    merge(runner, db, tmp_path / "out" / "snap")
    backup = tmp_path / "backup"
    shutil.copytree(tmp_path / "out", backup)
    (tmp_path / "out").rename(tmp_path / "out.old")
    (tmp_path / "out").symlink_to(backup)
    before = all_files(backup)
    code, _, err = run_main(["rm", "--db", db, "merged"], capsys)
    line = one_line_error(code, err)
    assert "is reached through a symbolic link" in line and "nothing was removed" in line, line
    assert all_files(backup) == before
