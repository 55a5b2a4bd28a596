"""The catalog commands, driven through click's runner and through ``main``."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from mergepipe.cli import cli, main
from mergepipe.cli.catalog_cmds import COMMANDS


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors are latency-bound; see tests/catalog/conftest.py."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """Run the console entry point; return (exit code, stdout, stderr)."""
    code = 0
    try:
        main(list(args))
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "catalog.db")
    run("init-db", "--db", path, "--block-bytes", "1KiB")
    return path


@pytest.mark.parametrize("command", [c for c in COMMANDS if not isinstance(c, click.Group)], ids=lambda c: c.name)
def test_every_command_has_help(command):
    assert command.help and command.help.strip()
    output = run(command.name, "--help")
    assert "--db" in output
    for param in command.params:
        if isinstance(param, click.Option):
            assert param.help, f"{command.name} {param.name} has no help"


def test_commands_are_attached():
    assert {c.name for c in COMMANDS} <= set(cli.commands)
    assert {"init-db", "register", "analyze", "models", "show"} <= set(cli.commands)


def test_init_db_is_idempotent(tmp_path: Path):
    path = str(tmp_path / "c.db")
    assert "blocks of 4.0 KiB" in run("init-db", "--db", path, "--block-bytes", "4KiB")
    assert "blocks of 4.0 KiB" in run("init-db", "--db", path)
    assert "blocks of 4.0 KiB" in run("init-db", "--db", path, "--block-bytes", "4096")
    assert "blocks of 1.0 MiB" in run("init-db", "--db", str(tmp_path / "d.db"))


def test_register_analyze_models_show(db, tiny_family):
    for model_id in ("base", "e1", "e3"):
        out = run("register", "--db", db, "--model-id", model_id, "--uri", str(tiny_family[model_id]))
        assert f"registered '{model_id}': 21 tensors" in out and "LlamaForCausalLM, 2 layers" in out
    before = json.loads(run("models", "--db", db, "--json"))
    assert [m["status"]["hashed_blocks"] for m in before] == [0, 0, 0]

    out = run("analyze", "--db", db, "--base", "base", "--no-progress")
    assert "analysed e1, e3 against 'base'" in out
    assert "hashed blocks of base, e1, e3" in out
    out = run("analyze", "--db", db, "--base", "base")
    assert "already analysed against 'base': e1, e3" in out and "read 0 B" in out

    models = json.loads(run("models", "--db", db, "--json"))
    assert [m["id"] for m in models] == ["base", "e1", "e3"]
    assert models[1]["status"]["analyzed_against"] == ["base"]
    assert models[0]["status"]["hashed_blocks"] == models[0]["n_blocks"]
    table = run("models", "--db", db)
    assert "hashed" in table and "e3" in table and "base" in table

    shown = json.loads(run("show", "--db", db, "e3", "--json"))
    assert shown["id"] == "e3" and shown["kind"] == "checkpoint"
    assert len(shown["tensors"]) == 21
    embed = next(t for t in shown["tensors"] if t["name"] == "model.embed_tokens.weight")
    assert embed["shape"] == [250, 64] and embed["blocks"] == 32
    assert shown["analyses"][0]["base_id"] == "base"
    text = run("show", "--db", db, "e3")
    assert "e3" in text and "Δ vs base" in text and "model.embed_tokens" in text


def test_analyze_without_base_hashes_everything(db, tiny_family):
    run("register", "--db", db, "--model-id", "e2", "--uri", str(tiny_family["e2"]))
    out = run("analyze", "--db", db, "--no-progress")
    assert "hashed blocks of e2" in out
    assert "nothing to do" in run("analyze", "--db", db, "--no-progress")


def test_empty_models_listing(db):
    assert "no models registered yet" in run("models", "--db", db)
    assert json.loads(run("models", "--db", db, "--json")) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["models", "--db", "{tmp}/nope.db"], "error: no catalog at {tmp}/nope.db; run `mergepipe init-db --db {tmp}/nope.db`"),
        (["init-db", "--db", "{tmp}/text.db"], "error: {tmp}/text.db is not a MergePipe catalog"),
        (["init-db", "--db", "{db}", "--block-bytes", "2KiB"], "error: catalog {db} already exists with block size 1024"),
        (["init-db", "--db", "{tmp}/x.db", "--block-bytes", "lots"], "error: --block-bytes: cannot parse 'lots'"),
        (["register", "--db", "{db}", "--model-id", "m", "--uri", "{tmp}/missing"], "error: no such checkpoint directory"),
        (["show", "--db", "{db}", "ghost"], "error: unknown model 'ghost'; none registered yet"),
        (["analyze", "--db", "{db}", "--base", "ghost"], "error: unknown model 'ghost'"),
    ],
)
def test_errors_are_one_line_without_traceback(capsys, tmp_path, db, args, message):
    (tmp_path / "text.db").write_text("not a database at all\n" * 10)
    fill = {"tmp": str(tmp_path), "db": db}
    code, out, err = run_main(capsys, *[a.format(**fill) for a in args])
    assert code != 0
    assert err.startswith(message.format(**fill))
    assert err.count("\n") == 1 and "Traceback" not in err


def test_register_conflict_and_force(capsys, db, tiny_family, sharded_family):
    run("register", "--db", db, "--model-id", "m", "--uri", str(tiny_family["base"]))
    code, _, err = run_main(capsys, "register", "--db", db, "--model-id", "m", "--uri", str(sharded_family["base"]))
    assert code == 1
    assert err == ("error: model 'm' (m@1) is already registered with different content; register it as version 2 "
                   "with --new-version, or replace it with --force\n")
    out = run("register", "--db", db, "--model-id", "m", "--uri", str(sharded_family["base"]), "--force")
    assert "Qwen3ForCausalLM" in out


def test_layout_mismatch_is_one_line(capsys, db, tiny_family, sharded_family):
    run("register", "--db", db, "--model-id", "llama", "--uri", str(tiny_family["base"]))
    run("register", "--db", db, "--model-id", "qwen", "--uri", str(sharded_family["base"]))
    code, _, err = run_main(capsys, "analyze", "--db", db, "--base", "llama", "qwen", "--no-progress")
    assert code == 1
    assert err.startswith("error: expert 'qwen' does not match the layout of base 'llama'")
    assert err.count("\n") == 1
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT count(*) FROM analyses").fetchone()[0] == 0
    conn.close()
