"""How the benchmarks start MergePipe (benchmarks/mergepipe_runner.py), and what they read back from a merge
summary."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchmarks import mergepipe_runner


def test_another_build_is_run_as_the_environment_names_it(monkeypatch):
    monkeypatch.setenv(mergepipe_runner.CLI_OVERRIDE_ENV, "/opt/mp/bin/mergepipe --flag")
    assert mergepipe_runner.executable() == ["/opt/mp/bin/mergepipe", "--flag"]
    merge = mergepipe_runner.merge(Path("c.db"), "base", ["a"], Path("out"), "m", "ties", "10%", "energy",
                                   Path("s.json"))
    assert merge[:3] == ["/opt/mp/bin/mergepipe", "--flag", "merge"]


def test_the_command_runs_as_written(monkeypatch):
    monkeypatch.delenv(mergepipe_runner.CLI_OVERRIDE_ENV, raising=False)
    out = subprocess.run([*mergepipe_runner.executable(), "--version"], capture_output=True, text=True, check=True)
    assert "mergepipe" in out.stdout and out.stderr == ""


def test_a_summary_s_process_usage_is_read_and_optional(tmp_path):
    summary = {"snapshot_id": "snap-1", "budget_bytes": 10, "planned": {"expert_bytes": 8}, "error_bound": 0.5,
               "realized": {"expert_bytes": 7, "base_bytes": 3, "output_bytes": 4}, "seconds": {"compute": 1.0}}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(summary))
    old = mergepipe_runner.MergeSummary.from_json(path)  # written before commands reported their usage
    assert old.process == {} and old.missing == () and old.budget_respected()
    usage = {"cpu_seconds": 2.5, "peak_rss_bytes": 600_000_000, "read_bytes": 1_000, "write_bytes": None}
    path.write_text(json.dumps({**summary, "process": usage}))
    assert mergepipe_runner.MergeSummary.from_json(path).process == usage


def test_a_package_is_byte_compiled_as_pip_would(tmp_path, monkeypatch):
    """Bytecode is written even where PYTHONDONTWRITEBYTECODE keeps imports from writing it; nothing is compiled
    for a build named by $MERGEPIPE_BENCH_CLI (not this interpreter's) or where there is no package."""
    package = tmp_path / "mergepipe"
    (package / "cli").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "cli" / "merge.py").write_text("VALUE = 1\n")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert mergepipe_runner.compile_package(package) == package
    compiled = sorted(p.relative_to(package).parts[:-1] + (p.name.split(".")[0],)
                      for p in package.rglob("*.pyc"))
    assert compiled == [("__pycache__", "__init__"), ("cli", "__pycache__", "merge")]
    assert mergepipe_runner.compile_package(tmp_path / "elsewhere") is None
    monkeypatch.setenv(mergepipe_runner.CLI_OVERRIDE_ENV, "/opt/mp/bin/mergepipe")
    assert mergepipe_runner.compile_package() is None
