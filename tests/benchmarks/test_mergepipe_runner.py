"""How the benchmarks start MergePipe (benchmarks/mergepipe_runner.py): in its own process unless a run
names a server, whatever `mergepipe serve` the user has running."""

from __future__ import annotations

import subprocess
from pathlib import Path

from benchmarks import mergepipe_runner


def test_every_command_names_its_server_or_none(monkeypatch):
    monkeypatch.setenv(mergepipe_runner.CLI_OVERRIDE_ENV, "/opt/mp/bin/mergepipe --flag")
    assert mergepipe_runner.executable() == ["env", "MERGEPIPE_SERVER=off", "/opt/mp/bin/mergepipe", "--flag"]
    merge = mergepipe_runner.merge(Path("c.db"), "base", ["a"], Path("out"), "m", "ties", "10%", "energy",
                                   Path("s.json"), server=Path("/run/s.sock"))
    assert merge[:3] == ["env", "MERGEPIPE_SERVER=/run/s.sock", "/opt/mp/bin/mergepipe"] and "merge" in merge


def test_the_command_runs_as_written(monkeypatch):
    monkeypatch.delenv(mergepipe_runner.CLI_OVERRIDE_ENV, raising=False)
    out = subprocess.run([*mergepipe_runner.executable(), "--version"], capture_output=True, text=True, check=True)
    assert "mergepipe" in out.stdout and out.stderr == ""
