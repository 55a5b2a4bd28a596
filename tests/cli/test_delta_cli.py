"""`export-delta` and `register --kind delta` through the command line: what they print, what they write,
and their one-line refusals (through ``main``, which prints MergePipeErrors without a traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.fixtures.delta_checkpoints import reference_deltas


@pytest.fixture
def db(tmp_path, tiny_family, monkeypatch) -> tuple:
    runner = wide_runner(monkeypatch)
    path = tmp_path / "c.db"
    invoke(runner, ["init-db", "--db", path, "--block-bytes", "1KiB"])
    for model_id in ("base", "e1", "e3"):
        invoke(runner, ["register", "--db", path, "--model-id", model_id, "--uri", tiny_family[model_id]])
    return runner, path


def _models(runner, path: Path) -> dict:
    return {m["id"]: m for m in json.loads(invoke(runner, ["models", "--db", path, "--json"]))}


def test_export_then_register_then_merge(db, tiny_family, tmp_path):
    runner, path = db
    out = tmp_path / "e3-delta"
    text = invoke(runner, ["export-delta", "--db", path, "--model", "e3", "--base", "base", "--out", out,
                           "--no-progress"])
    assert "analysed e3 against 'base' first" in text
    assert f"wrote the delta of 'e3' against 'base' to {out}" in text
    size = sum(p.stat().st_size for p in out.iterdir())
    expert = sum(p.stat().st_size - 8 - int.from_bytes(p.read_bytes()[:8], "little")
                 for p in tiny_family["e3"].glob("*.safetensors"))
    assert f"{100 * size / expert:.1f}% of the full checkpoint" in text
    assert "register it with: mergepipe register --kind delta --base base" in text
    got = load_tensors(out)
    reference = reference_deltas(tiny_family["base"], tiny_family["e3"])
    assert got and all((got[n] == reference[n]).all() for n in got)
    assert (out / "mergepipe_delta.json").stat().st_mode & 0o222 == 0  # published read-only, like snapshots
    text = invoke(runner, ["register", "--db", path, "--model-id", "e3d", "--uri", out, "--kind", "delta",
                           "--base", "base"])
    assert "registered 'e3d'" in text and "a delta against 'base'" in text
    models = _models(runner, path)
    assert (models["e3d"]["kind"], models["e3d"]["delta_base"]) == ("delta", "base")
    assert "e3d (delta against 'base'," in invoke(runner, ["show", "--db", path, "e3d"])
    text = invoke(runner, ["merge", "--db", path, "--base", "base", "--experts", "e1", "e3d", "--operator", "ties",
                           "--density", "0.5", "--out", tmp_path / "merged", "--model-id", "m", "--no-progress"])
    manifest = json.loads((tmp_path / "merged" / "manifest.json").read_text())
    assert manifest["extra"]["expert_kinds"] == {"e3d": "delta"}


def test_export_refuses_an_existing_output(db, tmp_path, capsys):
    _, path = db
    out = tmp_path / "taken"
    out.mkdir()
    code, _, err = run_main(["export-delta", "--db", path, "--model", "e3", "--base", "base", "--out", out], capsys)
    assert code != 0 and err.count("\n") == 1 and "already exists" in err
    assert list(out.iterdir()) == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".taken")]  # no staging left behind


@pytest.mark.parametrize("args, message", [
    (["--kind", "delta", "--base", "e1"], "taken against another base than 'e1'"),
    (["--kind", "delta"], "give --base BASE"),
    ([], "is a delta checkpoint (mergepipe_delta.json): register it with --kind delta"),
])
def test_register_refusals_are_one_line_and_register_nothing(db, tmp_path, capsys, args, message):
    runner, path = db
    out = tmp_path / "d"
    invoke(runner, ["export-delta", "--db", path, "--model", "e3", "--base", "base", "--out", out, "--no-progress"])
    before = _models(runner, path)
    code, _, err = run_main(["register", "--db", path, "--model-id", "d", "--uri", out, *args], capsys)
    assert code != 0 and err.count("\n") == 1 and message in err and "Traceback" not in err
    assert _models(runner, path) == before


def test_a_base_is_for_deltas_only(db, tiny_family, capsys):
    _, path = db
    code, _, err = run_main(["register", "--db", path, "--model-id", "x", "--uri", tiny_family["e1"],
                             "--base", "base"], capsys)
    assert code != 0 and "--base is for delta checkpoints" in err
