"""docs/CLI.md is the commands' own help (`mergepipe-yaml`'s too): regenerate it when a command changes."""

from __future__ import annotations

from pathlib import Path

from mergepipe.cli import COMMANDS
from scripts.cli_reference import render_reference
from tests.fixtures.cli import run_main

DOC = Path(__file__).resolve().parents[2] / "docs" / "CLI.md"


def test_the_cli_reference_matches_the_help():
    rendered = render_reference()
    assert DOC.read_text() == rendered, "docs/CLI.md is stale: python -m scripts.cli_reference > docs/CLI.md"
    for name in COMMANDS:
        assert f"## mergepipe {name}\n" in rendered and f"Usage: mergepipe {name}" in rendered


def test_mergepipe_help_and_the_cli_reference_name_mergepipe_yaml(capsys):
    """A mergekit user finds the one command where they look: `mergepipe --help`, docs/CLI.md."""
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0 and "mergepipe-yaml config.yml ./out" in out and "`mergepipe-yaml --help`" in out
    text = DOC.read_text()
    assert "## mergepipe-yaml\n" in text and "Usage: mergepipe-yaml [OPTIONS] CONFIG OUT" in text
    assert "--allow-crimes / --no-allow-crimes" in text  # its options, all of them
