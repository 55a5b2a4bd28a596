"""MergePipe driven through its command line, as the benchmark suite runs it.

The contract coded against (``mergepipe <command> --help`` must exit 0):

    mergepipe init-db  --db DB --block-bytes 1MiB
    mergepipe register --db DB --model-id ID --uri DIR
    mergepipe analyze  --db DB --base BASE_ID ID [ID ...]
    mergepipe merge    --db DB --base ID --experts ID [ID ...] --out DIR --model-id ID
                       --operator ties|task_arithmetic [--density D] [--lambda L]
                       [--weights W [W ...]] --budget 10%|BYTES --policy energy|uniform|full
                       --json-summary PATH
    mergepipe merge    --db DB --config MERGEKIT_YAML --out DIR --model-id ID
                       --budget 10%|BYTES --policy energy|uniform|full --json-summary PATH

``--json-summary PATH`` writes a JSON object with at least ``snapshot_id``,
``budget_bytes``, ``error_bound``, ``planned.expert_bytes``,
``realized.expert_bytes``, ``realized.base_bytes``, ``realized.output_bytes``
and ``seconds`` (by phase). ``--lambda`` and ``--weights`` are passed only
when they differ from 1.0, so the defaults of the CLI are relied on otherwise.
"""

from __future__ import annotations

import compileall
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

COMMANDS = ("init-db", "register", "analyze", "merge")
NOT_AVAILABLE = "mergepipe merge not available yet"
# Set to a command line (e.g. "/opt/other-venv/bin/mergepipe") to benchmark another build.
CLI_OVERRIDE_ENV = "MERGEPIPE_BENCH_CLI"


def compile_package(package: Path | None = None) -> Path | None:
    """Byte-compile MergePipe's modules (``package``, else the one this interpreter imports) into their
    ``__pycache__``, as ``pip install`` does for an installed package; the package compiled, None where there
    is none to compile (a build given by ``$MERGEPIPE_BENCH_CLI``, or a package without its sources).

    Why: with ``PYTHONDONTWRITEBYTECODE`` set an editable install writes no bytecode, so every benchmarked
    process would compile every MergePipe module it imports again, a start-up that neither an installed
    MergePipe nor mergekit (installed by pip, compiled) pays. A module edited after this is compiled again in
    memory, as before: never stale."""
    if package is None:
        if os.environ.get(CLI_OVERRIDE_ENV):
            return None
        spec = importlib.util.find_spec("mergepipe")
        package = Path(spec.origin).parent if spec is not None and spec.origin else None
    if package is None or not package.is_dir():
        return None
    compileall.compile_dir(package, quiet=1)
    return package


def executable() -> list[str]:
    """$MERGEPIPE_BENCH_CLI, else the ``mergepipe`` script beside this interpreter, else ``python -m
    mergepipe``."""
    if os.environ.get(CLI_OVERRIDE_ENV):
        return shlex.split(os.environ[CLI_OVERRIDE_ENV])
    if (Path(sys.executable).parent / "mergepipe").exists():
        return [str(Path(sys.executable).parent / "mergepipe")]
    return [sys.executable, "-m", "mergepipe"]


@dataclass(frozen=True)
class Availability:
    missing: tuple[str, ...]  # commands (or the merge summary flag) that are not there yet
    detail: str  # first line of the failure, for the report

    @property
    def ok(self) -> bool:
        return not self.missing

    @property
    def reason(self) -> str:
        return f"{NOT_AVAILABLE} (missing: {', '.join(self.missing)}; {self.detail})"


def probe() -> Availability:
    """Which parts of the contract the installed CLI offers."""
    missing: list[str] = []
    detail = ""
    for command in COMMANDS:
        proc = subprocess.run([*executable(), command, "--help"], capture_output=True, text=True)
        if proc.returncode != 0:
            missing.append(command)
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            detail = detail or (lines[-1] if lines else f"exit {proc.returncode}")
        elif command == "merge" and "--json-summary" not in proc.stdout:
            missing.append("merge --json-summary")
    return Availability(tuple(missing), detail or "see `mergepipe merge --help`")


def init_db(db: Path, block_bytes: str = "1MiB") -> list[str]:
    return [*executable(), "init-db", "--db", str(db), "--block-bytes", block_bytes]


def register(db: Path, model_id: str, uri: Path) -> list[str]:
    return [*executable(), "register", "--db", str(db), "--model-id", model_id, "--uri", str(uri)]


def analyze(db: Path, base_id: str, expert_ids: Sequence[str]) -> list[str]:
    return [*executable(), "analyze", "--db", str(db), "--base", base_id, *expert_ids]


def merge(
    db: Path,
    base_id: str,
    expert_ids: Sequence[str],
    out: Path,
    model_id: str,
    operator: str,
    budget: str,
    policy: str,
    summary: Path,
    density: float = 0.5,
    lam: float = 1.0,
    weights: Sequence[float] | None = None,
    device: str = "cpu",
) -> list[str]:
    cmd = [*executable(), "merge", "--db", str(db), "--base", base_id, "--experts", *expert_ids,
           "--out", str(out), "--model-id", model_id, "--operator", operator,
           "--budget", budget, "--policy", policy, "--json-summary", str(summary)]
    if operator == "ties":
        cmd += ["--density", str(density)]
    if lam != 1.0:
        cmd += ["--lambda", str(lam)]
    if weights is not None and any(w != 1.0 for w in weights):
        cmd += ["--weights", *map(str, weights)]
    if device != "cpu":
        cmd += ["--device", device]
    return cmd


def merge_config(
    db: Path,
    config: Path,
    out: Path,
    model_id: str,
    budget: str,
    policy: str,
    summary: Path,
    device: str = "cpu",
) -> list[str]:
    """The merge a mergekit YAML states (the one mergekit runs, its paths the registered checkpoints'),
    under ``budget`` and ``policy``."""
    cmd = [*executable(), "merge", "--db", str(db), "--config", str(config), "--out", str(out),
           "--model-id", model_id, "--budget", budget, "--policy", policy, "--json-summary", str(summary)]
    if device != "cpu":
        cmd += ["--device", device]
    return cmd


@dataclass(frozen=True)
class MergeSummary:
    """What MergePipe says it did: its own byte counters and plan figures."""

    snapshot_id: str | None
    budget_bytes: int | None
    planned_expert_bytes: int | None
    realized_expert_bytes: int | None
    realized_base_bytes: int | None
    realized_output_bytes: int | None
    error_bound: float | None
    seconds: dict = field(default_factory=dict)
    missing: tuple[str, ...] = ()  # contract keys the summary lacked
    process: dict = field(default_factory=dict)  # the command's own CPU, peak RSS and I/O (not a contract key)
    predicted_seconds: dict = field(default_factory=dict)  # the plan's prediction (not a contract key)
    update_bound: float | None = None  # a delta-update merge's bound measured after it (not a contract key)

    @classmethod
    def from_json(cls, path: Path) -> "MergeSummary":
        data = json.loads(Path(path).read_text())
        missing: list[str] = []

        def get(dotted: str):
            node = data
            for key in dotted.split("."):
                if not isinstance(node, dict) or key not in node:
                    missing.append(dotted)
                    return None
                node = node[key]
            return node

        return cls(
            snapshot_id=get("snapshot_id"),
            budget_bytes=get("budget_bytes"),
            planned_expert_bytes=get("planned.expert_bytes"),
            realized_expert_bytes=get("realized.expert_bytes"),
            realized_base_bytes=get("realized.base_bytes"),
            realized_output_bytes=get("realized.output_bytes"),
            error_bound=get("error_bound"),
            seconds=get("seconds") or {},
            missing=tuple(missing),
            process=data.get("process") or {},
            predicted_seconds=data.get("predicted_seconds") or {},
            update_bound=data.get("update_bound"),
        )

    def budget_respected(self) -> bool | None:
        """realized <= planned <= budget, or None when a figure is missing."""
        figures = (self.realized_expert_bytes, self.planned_expert_bytes, self.budget_bytes)
        if any(f is None for f in figures):
            return None
        return figures[0] <= figures[1] <= figures[2]
