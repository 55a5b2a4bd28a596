"""docs/CLI.md is the commands' own help: regenerate it when a command changes."""

from __future__ import annotations

from pathlib import Path

from mergepipe.cli import COMMANDS
from mergepipe.cli.reference import render_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "CLI.md"


def test_the_cli_reference_matches_the_help():
    rendered = render_reference()
    assert DOC.read_text() == rendered, "docs/CLI.md is stale: python -m mergepipe.cli.reference > docs/CLI.md"
    for name in COMMANDS:
        assert f"## mergepipe {name}\n" in rendered and f"Usage: mergepipe {name}" in rendered
