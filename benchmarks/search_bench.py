"""`mergepipe search` on a real model: SmolLM2-135M and four fully fine-tuned experts (the quality benchmark's).

Usage: ``python -m benchmarks.search_bench [--trials 16] [--chunks 1]``

Side by side, in one run, on held-out text of the four domains (``--chunks``
JSONL lines of 2,000 characters per corpus, windows of 256 tokens):

- a search over task arithmetic and TIES (each expert's weight in [0, 1],
  density in [0.3, 0.9]) with every trial at a 25% budget, the best published
  at 100%;
- the same search with every trial at 100%;
- uniform weights (task arithmetic, each 0.25: the mean of the deltas);
- a mergekit-evolve-style trial, for its wall: a full merge written to disk
  (``merge``), then loaded from disk and evaluated (``eval DIR``), for the
  first ``--baseline`` parameter sets the 25% search tried.

Reported: the published model's held-out loss, wall per trial, and the expert
bytes the trials' plans read in total.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from benchmarks.eval_bench import _data
from benchmarks.quality.__main__ import CACHE, prepare
from mergepipe.app.evaluating import evaluate
from mergepipe.app.merging import merge
from mergepipe.app.registering import register
from mergepipe.app.searching import SearchResult, best_request, search
from mergepipe.app.searching import load_search
from mergepipe.spec.request import MergeRequest

MB = 1e6


def _search_file(path: Path, base: Path, experts: dict[str, Path], data: Path, budget: str, trials: int) -> Path:
    names = "".join(f"\n  - {p}" for p in experts.values())
    path.write_text(f"base: {base}\nexperts:{names}\noperators: [task_arithmetic, ties]\nweight: [0.0, 1.0]\n"
                    f"density: [0.3, 0.9]\nbudget: {budget}\nfinal_budget: 100%\nobjective:\n  - data: {data}\n"
                    f"max_tokens: 256\nbatch: 8\nsampler: tpe\nseed: 0\ntrials: {trials}\nstudy: {path.stem}\n")
    return path


def _row(label: str, result: SearchResult, wall: float, loss: float) -> str:
    seconds = [t.seconds for t in result.trials if t.seconds is not None]
    read = sum(t.expert_bytes or 0 for t in result.trials)
    return (f"| {label} | {loss:.4f} | {len(result.trials)} | {statistics.median(seconds):.1f} | "
            f"{wall / len(result.trials):.1f} | {read / MB:.0f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--baseline", type=int, default=3, help="mergekit-evolve-style trials timed")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--cache", type=Path, default=CACHE)
    args = parser.parse_args(argv)
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", flush=True)

    base, experts, _, _ = prepare(args.cache, args.steps, 1, log)
    work = args.cache / "search-bench"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    db = work / "catalog.db"
    data = _data(args.cache, args.chunks, work / "held-out.jsonl")
    register(db, "base", base)
    for name, path in experts.items():
        register(db, name, path)
    rows = []
    results = {}
    for budget in ("25%", "100%"):
        log(f"search at {budget}")
        spec = _search_file(work / f"search-{budget.rstrip('%')}.yml", base, experts, data, budget, args.trials)
        began = time.perf_counter()
        result = search(db, spec, out=work / f"best-{budget.rstrip('%')}", model_id=f"best-{budget.rstrip('%')}")
        wall = time.perf_counter() - began
        assert result.published is not None
        loss = evaluate(db, str(result.published.out), [data]).loss
        results[budget] = result
        rows.append(_row(f"search, trials at {budget}", result, wall, loss))
    log("uniform weights")
    uniform = merge(MergeRequest(base=str(base), experts=tuple(map(str, experts.values())), operator="task_arithmetic",
                                 weights=(0.25,) * len(experts), model_id="uniform"), db, work / "uniform")
    uniform_loss = evaluate(db, str(uniform.out), [data]).loss
    rows.append(f"| uniform (task arithmetic, 0.25 each) | {uniform_loss:.4f} | - | - | - | - |")

    log("mergekit-evolve-style trials: merge to disk, load, evaluate")
    spec = load_search(work / "search-25.yml")
    walls = []
    for trial in results["25%"].trials[: args.baseline]:
        params = {"operator": spec.operators[0], **trial.params}
        began = time.perf_counter()
        out = work / f"evolve-{trial.number}"
        merge(best_request(spec, params, "100%", model_id=f"evolve-{trial.number}"), db, out)
        evaluate(db, str(out), [data], again=True)
        walls.append(time.perf_counter() - began)
        shutil.rmtree(out)
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print("| run | held-out loss of the published model | trials | median s per trial (merge + eval) | "
          "wall s per trial (all) | expert MB read by the trials |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"| mergekit-evolve-style trial (full merge to disk, load, eval) | - | {len(walls)} | "
          f"{statistics.median(walls):.1f} | {statistics.mean(walls):.1f} | - |")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
