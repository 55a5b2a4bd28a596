"""`mergepipe bench`: run the benchmark suite of a source checkout.

The suite (workload generator, naive and mergekit baselines, cold-cache
runner) lives in the repository's ``benchmarks/`` package, not in the
installed library, because it needs mergekit and writes gigabytes of
generated checkpoints. This command runs it with the current interpreter.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

from mergepipe.errors import ConfigError


@click.command("bench", context_settings={"ignore_unknown_options": True})
@click.option("--quick", is_flag=True, help="The small suite (a few minutes) instead of the standard one.")
@click.argument("suite_args", nargs=-1, type=click.UNPROCESSED)
def bench_cmd(quick: bool, suite_args: tuple[str, ...]) -> None:
    """Run the benchmark suite (same as `make bench` / `make bench-quick`)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "suite.py").exists():
        raise ConfigError(
            "the benchmark suite ships with the source repository, not the installed package; "
            "run `make bench` from a checkout"
        )
    args = [sys.executable, "-m", "benchmarks.suite", *(["--quick"] if quick else []), *suite_args]
    raise SystemExit(subprocess.call(args, cwd=root))


COMMANDS = [bench_cmd]
