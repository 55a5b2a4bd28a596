"""`integrate` never stuck, never lying: a previous version that is gone or changed is merged from scratch
(and said), a half-pruned old version is pruned without failing the run, Ctrl-C after the publish says what
was published, and a second run on the same recipe while one is publishing names that run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from mergepipe.app import integration
from mergepipe.app.integration import integrate
from mergepipe.app.integration import load_recipe
from mergepipe.errors import InterruptedAfterPublish
from mergepipe.txn.verify import verify_snapshot
from tests.fixtures.checkpoints import make_expert
from tests.fixtures.cli import invoke, run_main, wide_runner


@pytest.fixture
def pipeline(tiny_family, tmp_path):
    """Copies of two experts (retrained in place by ``retrain``) and a recipe without `keep`."""
    for name in ("e1", "e2"):
        shutil.copytree(tiny_family[name], tmp_path / "experts" / name)
    recipe = {"base": str(tiny_family["base"]), "experts": {n: f"experts/{n}" for n in ("e1", "e2")},
              "operator": "ties", "params": {"density": 0.5}, "output": {"root": "deploy", "model_id": "merged"}}
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def retrain(tmp_path: Path, seed: int) -> None:
    """e1 retrained in place, in its layer 1."""
    new = make_expert(tmp_path / "experts" / "e1", tmp_path / f"e1-{seed}", seed=seed, touch=lambda n: ".layers.1." in n)
    shutil.copy(new / "model.safetensors", tmp_path / "experts" / "e1" / "model.safetensors")


def set_keep(recipe: Path, keep: int) -> None:
    data = yaml.safe_load(recipe.read_text())
    data["output"]["keep"] = keep
    recipe.write_text(yaml.safe_dump(data))


def weights(directory: Path) -> bytes:
    return (directory / "model.safetensors").read_bytes()


def scratch_merge(runner, tiny_family, tmp_path: Path) -> bytes:
    """The same merge from scratch in a catalog of its own."""
    experts = [tmp_path / "experts" / n for n in ("e1", "e2")]
    invoke(runner, ["merge", "--db", tmp_path / "fresh.db", "--base", tiny_family["base"], "--experts", *experts,
                    "--operator", "ties", "--density", "0.5", "--out", tmp_path / "scratch", "--model-id", "scratch",
                    "--no-progress"])
    return weights(tmp_path / "scratch")


@pytest.mark.parametrize("damage", ["deleted", "tampered"])
def test_a_previous_version_that_is_gone_or_changed_is_merged_from_scratch(pipeline, tiny_family, tmp_path, monkeypatch,
                                                                           damage):
    runner = wide_runner(monkeypatch)
    db, deploy = tmp_path / "c.db", tmp_path / "deploy"
    invoke(runner, ["integrate", "--db", db, pipeline, "--no-progress"])
    v1 = deploy / "merged-v1"
    if damage == "deleted":
        shutil.rmtree(v1)
    else:  # same size, one byte of a reused block flipped
        data = bytearray(weights(v1))
        data[-3] ^= 0xFF
        (v1 / "model.safetensors").chmod(0o644)
        (v1 / "model.safetensors").write_bytes(bytes(data))
    retrain(tmp_path, 9)
    out = invoke(runner, ["integrate", "--db", db, pipeline, "--no-progress"])
    assert "merged from scratch (the same bytes as incrementally): merged@1 cannot be reused: " in out
    assert "published merged@2" in out
    assert weights(deploy / "merged-v2") == scratch_merge(runner, tiny_family, tmp_path)
    assert verify_snapshot(deploy / "merged-v2").ok
    retrain(tmp_path, 10)  # and the run after that merges incrementally again
    out = invoke(runner, ["integrate", "--db", db, pipeline, "--no-progress"])
    assert "published merged@3" in out and "reused" in out and "from scratch" not in out


def test_a_half_pruned_version_is_pruned_and_a_foreign_one_is_left_with_a_warning(pipeline, tmp_path, monkeypatch,
                                                                                    capsys):
    runner = wide_runner(monkeypatch)
    db, deploy = tmp_path / "c.db", tmp_path / "deploy"
    invoke(runner, ["integrate", "--db", db, pipeline, "--no-progress"])
    retrain(tmp_path, 9)
    invoke(runner, ["integrate", "--db", db, pipeline, "--no-progress"])
    # a prune killed half-way through v1, and a file of the user's own in v2
    (deploy / "merged-v1").chmod(0o755)
    for name in ("manifest.json", "model.safetensors"):
        (deploy / "merged-v1" / name).unlink()
    (deploy / "merged-v2").chmod(0o755)
    (deploy / "merged-v2" / "notes.txt").write_text("mine")
    set_keep(pipeline, 1)
    retrain(tmp_path, 10)
    code, out, err = run_main(["integrate", "--db", str(db), str(pipeline), "--no-progress"], capsys)
    assert code in (0, None), err
    assert "published merged@3" in out and f"removed {deploy / 'merged-v1'}" in out
    assert f"warning: not pruned: {deploy / 'merged-v2'} holds files that are not merged@2's (notes.txt)" in err
    assert sorted(p.name for p in deploy.iterdir()) == ["merged-v2", "merged-v3"]
    # a run that publishes nothing still prunes, once the user's file is gone
    (deploy / "merged-v2" / "notes.txt").unlink()
    again = invoke(runner, ["integrate", "--db", db, pipeline, "--no-progress"])
    assert "nothing changed" in again and f"removed {deploy / 'merged-v2'}" in again
    assert sorted(p.name for p in deploy.iterdir()) == ["merged-v3"]


def test_ctrl_c_after_the_commit_reports_what_was_published(pipeline, tmp_path, monkeypatch, capsys):
    runner = wide_runner(monkeypatch)
    db, deploy = tmp_path / "c.db", tmp_path / "deploy"

    def interrupted(path, published=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(integration, "verify_or_raise", interrupted)  # Ctrl-C while verifying
    code, out, err = run_main(["integrate", "--db", str(db), str(pipeline), "--no-progress"], capsys)
    assert code == 130 and err.count("\n") == 1 and "aborted" not in err, err
    assert f"interrupted after publishing {deploy / 'merged-v1'} (committed as snapshot " in err
    assert f"not verified: run `mergepipe verify {deploy / 'merged-v1'}`" in err
    monkeypatch.undo()
    assert verify_snapshot(deploy / "merged-v1").ok
    assert "nothing changed since merged" in invoke(runner, ["integrate", "--db", db, pipeline, "--no-progress"])


@pytest.mark.parametrize("step", ["renamed", "committed"])
def test_ctrl_c_at_the_last_publish_steps_is_reported_as_published(pipeline, tmp_path, step):
    def on_step(name: str) -> None:
        if name == step:
            raise KeyboardInterrupt

    with pytest.raises(InterruptedAfterPublish) as info:
        integrate(load_recipe(pipeline), tmp_path / "c.db", on_step=on_step)
    message = str(info.value)
    assert message.startswith(f"interrupted after publishing {tmp_path / 'deploy' / 'merged-v1'} (")
    assert ("committed as snapshot" in message) == (step == "committed")
    assert "run `mergepipe verify" in message


def test_a_second_run_while_one_publishes_names_the_other_run(pipeline, tmp_path, capsys):
    outcome = {}

    def on_step(name: str) -> None:
        if name == "staged":
            outcome["second"] = run_main(["integrate", "--db", str(tmp_path / "c.db"), str(pipeline),
                                          "--no-progress"], capsys)

    done = integrate(load_recipe(pipeline), tmp_path / "c.db", on_step=on_step)
    assert done.published is not None
    code, _, err = outcome["second"]
    assert code not in (0, None) and err.count("\n") == 1, err
    assert "is being published by another merge, in progress since" in err and "model 'merged'" in err
