"""A/B two checkouts of MergePipe on the same merge, alternating runs, cold cache.

Usage: ``python -m benchmarks.ab_checkouts BEFORE_DIR AFTER_DIR [--operator task_arithmetic]
[--density D] [--budget 100%] [--k 8] [--runs 3] [--before-args "..."] [--after-args "..."] [--serve]`` where each
directory is a checkout of the repository (e.g. ``git worktree add /tmp/a COMMIT``); ``--after-args``
(``--before-args``) adds options to that side's merges, so one checkout can be A/B'd against itself with
another setting (``. . --after-args "--workers 2"``); ``--serve`` times served merges (each checkout's own
`mergepipe serve`, started before the timed runs). Each checkout gets its own catalog
(registered and analysed once, untimed); then the same merge (100% budget unless ``--budget``)
runs ``--runs`` times per checkout, alternating, every input evicted from the page cache first,
each as its own CLI process run in that checkout (its directory first on ``sys.path``). Prints
the times and the ratio of medians: a regression check that machine noise affects both sides alike.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.coldcache import drop_cache
from benchmarks.mergepipe_runner import SERVER_ENV, Server, compile_package
from benchmarks.workloads import ensure_workload

RESULTS = Path(__file__).with_name("results")


def _env(tree: Path, server: Path | None = None) -> dict[str, str]:
    """The checkout first on the path; the command in its own process, or served by ``server``."""
    return dict(os.environ, PYTHONPATH=str(tree), **{SERVER_ENV: str(server or "off")})


def _command() -> list[str]:
    # `python -c`, not the venv's script: the checkout on PYTHONPATH must be the mergepipe it imports
    return [sys.executable, "-c", "from mergepipe.launch import main; main()"]


def cli(tree: Path, *args, server: Path | None = None) -> None:
    # cwd=tree: `python -c` puts the working directory first on sys.path, before PYTHONPATH, so run from
    # elsewhere (say the other checkout) the child would import that directory's mergepipe
    proc = subprocess.run([*_command(), *map(str, args)], env=_env(tree, server), capture_output=True, text=True,
                          cwd=tree)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: mergepipe {args[0]} failed:\n{proc.stderr[-2000:]}")


def serve(tree: Path, directory: Path) -> Server:
    """A `mergepipe serve` of the checkout ``tree``, logging into ``directory``, listening when returned."""
    try:
        return Server.start(directory, lambda _: None, _command(), _env(tree), tree)
    except RuntimeError as exc:
        raise SystemExit(f"{tree}: {exc}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--layout", default="qwen3-0.6b")
    parser.add_argument("--operator", default="task_arithmetic")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--density", type=float, default=None, help="for ties, breadcrumbs, dare, della")
    parser.add_argument("--budget", default="100%")
    parser.add_argument("--before-args", default="", help="more `merge` options for the before side")
    parser.add_argument("--after-args", default="", help="more `merge` options for the after side")
    parser.add_argument("--serve", action="store_true", help="time the merges as served commands: each checkout "
                        "runs its own `mergepipe serve`, started before the timed runs")
    args = parser.parse_args()
    workload = ensure_workload(args.layout, num_experts=args.k)
    names = [p.name for p in workload.experts]
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    extra = {"before": shlex.split(args.before_args), "after": shlex.split(args.after_args)}
    RESULTS.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ab-work-", dir=RESULTS))
    servers: dict[str, Server] = {}
    try:
        for label, tree in trees.items():
            compile_package(tree)
            db = work / f"{label}.db"
            cli(tree, "init-db", "--db", db, "--block-bytes", "1MiB")
            cli(tree, "register", "--db", db, "--model-id", "base", "--uri", workload.base)
            for name, directory in zip(names, workload.experts):
                cli(tree, "register", "--db", db, "--model-id", name, "--uri", directory)
            cli(tree, "analyze", "--db", db, "--base", "base", *names)
        if args.serve:
            servers = {label: serve(tree, work / f"serve-{label}") for label, tree in trees.items()}
        times: dict[str, list[float]] = {label: [] for label in trees}
        for run in range(args.runs):
            for label, tree in trees.items():
                out = work / f"{label}-{run}"
                os.sync()
                drop_cache([workload.base, *workload.experts])
                started = time.perf_counter()
                cli(tree, "merge", "--db", work / f"{label}.db", "--base", "base", "--experts", *names,
                    "--operator", args.operator, "--seed", run, "--out", out, "--model-id", f"m{run}",
                    "--budget", args.budget, "--no-progress",
                    *(["--density", args.density] if args.density is not None else []), *extra[label],
                    server=servers[label].socket if servers else None)
                times[label].append(time.perf_counter() - started)
                shutil.rmtree(out)
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    for label, values in times.items():
        print(f"{label:6} {trees[label]} {' '.join(extra[label])}: {', '.join(f'{v:.2f}' for v in values)} s (median "
              f"{statistics.median(values):.2f})")
    print(f"after / before (medians): {statistics.median(times['after']) / statistics.median(times['before']):.3f}")


if __name__ == "__main__":
    main()
