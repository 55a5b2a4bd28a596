"""A search's trials as plain work, run in this process or on Ray workers.

The search (``app/searching.py``) is the only user of the catalog: it plans a
trial, looks up which of its objective terms the catalog already holds, and
hands the rest over as a ``TrialWork``: the in-memory merge's job
(``Engine.in_memory_job``: opened headers, recorded hashes, thresholds; no
catalog, no open file), the base's config folder, the terms to compute and
the pruning bars. ``run_trial`` does that work in whatever process it lands
in: merge in memory, build the model, score each term (a held-out loss, or
an lm-eval task), and stop early when the first term's running loss passes
its bar (``prune_bars``: the rule of Optuna's median pruner, applied to the
trials finished before the round).

``LocalTrials`` runs a round of trials one after another in this process;
``RayTrials`` runs them at once on Ray actors, one per worker, which live as
long as the search. Each actor keeps the tokenizer it loaded; the files a
trial reads stay in its node's page cache for the next. With the same compute
threads a trial gives the same bits wherever it runs, and a round's bars
depend only on earlier rounds, so a search's trials do not depend on where
they ran.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from mergepipe.app.evaluating import LOSS, PERPLEXITY
from mergepipe.app.search_file import Term
from mergepipe.engine.defaults import DEFAULT_MAX_MEMORY
from mergepipe.engine.engine import Limits, run_in_memory
from mergepipe.engine.executor import LocalExecutor
from mergepipe.engine.job import Job
from mergepipe.engine.ray_executor import ray_runtime, task_result
from mergepipe.errors import ConfigError
from mergepipe.evaluation.data import EvalData, EvalSettings
from mergepipe.evaluation.harness import run_tasks
from mergepipe.evaluation.loss import build_model, load_tokenizer, score
from mergepipe.sizes import parse_size
from mergepipe.threads import compute_threads

#: Trials that must have finished before any is pruned, and the first batch at which one may be (Optuna's
#: ``MedianPruner(n_startup_trials=5, n_warmup_steps=1)``).
STARTUP_TRIALS = 5
WARMUP_STEPS = 1


@dataclass(frozen=True)
class TermWork:
    """One objective term to compute: its file's loss (``data``: the file, loaded), or its lm-eval task (all
    the task's metrics)."""

    index: int  # in the search file's objective
    term: Term
    data: EvalData | None = None


@dataclass(frozen=True)
class TrialWork:
    """What one trial computes, as plain data a Ray worker can be sent."""

    number: int
    job: Job
    config_folder: Path
    tokenizers: tuple[Path, ...]  # where the tokenizer is looked for (``settings.tokenizer``: the one named)
    terms: tuple[TermWork, ...]
    settings: EvalSettings
    # batch -> bar: a trial whose best weighted running loss on objective term 0 is above it is pruned
    bars: Mapping[int, float]
    threads: int | None  # compute threads of the merge and the evaluation (None: as `merge` and `eval` use)


@dataclass(frozen=True)
class TermResult:
    index: int
    scores: dict[str, float]  # loss and perplexity, or TASK/METRIC -> value
    tokens: int | None
    seconds: float


@dataclass(frozen=True)
class TrialOutcome:
    number: int
    results: tuple[TermResult, ...]  # the terms computed before the trial ended
    steps: tuple[float, ...]  # objective term 0's weighted running loss after each batch
    pruned: bool
    seconds: float


class _Pruned(Exception):
    pass


def prune_bars(finished: Sequence[Mapping[int, float]]) -> dict[int, float]:
    """Per batch, the median of the finished trials' reported values there: the bars of the next round
    (none before ``STARTUP_TRIALS`` trials finished)."""
    if len(finished) < STARTUP_TRIALS:
        return {}
    steps = sorted({step for values in finished for step in values})
    return {step: float(statistics.median(v[step] for v in finished if step in v)) for step in steps}


def run_trial(work: TrialWork, tokenizers: dict[Any, Any] | None = None) -> TrialOutcome:
    """Merge in memory, evaluate the terms in order; stops when pruned. ``tokenizers``: loaded ones to reuse
    (an actor's, kept between trials)."""
    started = time.perf_counter()
    steps: list[float] = []
    results: list[TermResult] = []
    held = run_in_memory(work.job, LocalExecutor(), Limits(None, parse_size(DEFAULT_MAX_MEMORY), threads=work.threads))
    tensors = {name: tensor for file in held.values() for name, tensor in file.items()}
    tokenizers = {} if tokenizers is None else tokenizers
    key = (work.settings.tokenizer, work.tokenizers)
    if key not in tokenizers:
        tokenizers[key] = load_tokenizer(work.tokenizers, work.settings.tokenizer)
    tokenizer = tokenizers[key]
    with compute_threads(work.threads) if work.threads is not None else nullcontext():
        model = build_model(work.config_folder, tensors, "cpu")
        try:
            for term in work.terms:
                results.append(_term(model, tokenizer, term, work, steps))
        except _Pruned:
            return TrialOutcome(work.number, tuple(results), tuple(steps), True, time.perf_counter() - started)
    return TrialOutcome(work.number, tuple(results), tuple(steps), False, time.perf_counter() - started)


def _term(model: Any, tokenizer: Any, part: TermWork, work: TrialWork, steps: list[float]) -> TermResult:
    term = part.term
    if part.data is None:
        assert term.task is not None
        started = time.perf_counter()
        scores = run_tasks(model, tokenizer, [term.task], [] if term.include is None else [term.include],
                           limit=term.limit, batch=work.settings.batch, device="cpu")
        return TermResult(part.index, scores, None, time.perf_counter() - started)

    def watch(loss: float, step: int) -> None:
        steps.append(loss * term.weight)
        bar = work.bars.get(step)
        if bar is not None and step >= WARMUP_STEPS and min(steps) > bar:
            raise _Pruned

    result = score(model, tokenizer, part.data, work.settings, "cpu", on_batch=watch if part.index == 0 else None)
    return TermResult(part.index, {LOSS: result.loss, PERPLEXITY: result.perplexity}, result.tokens,
                      result.seconds)


class Trials(Protocol):
    """Runs a round of trials; the outcomes in the order given."""

    workers: int

    def run(self, works: Sequence[TrialWork]) -> list[TrialOutcome]: ...


class LocalTrials:
    """A round's trials one after another, in this process."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = workers
        self._tokenizers: dict[Any, Any] = {}

    def run(self, works: Sequence[TrialWork]) -> list[TrialOutcome]:
        return [run_trial(work, self._tokenizers) for work in works]


class _TrialActor:
    """A Ray worker of a search: runs one trial at a time, keeping its tokenizers between trials."""

    def __init__(self) -> None:
        self._tokenizers: dict[Any, Any] = {}

    def run(self, work: TrialWork) -> TrialOutcome:
        return run_trial(work, self._tokenizers)


class RayTrials:
    """A round's trials at once, one per Ray actor (``workers`` actors of ``threads`` cores each)."""

    def __init__(self, ray: ModuleType, workers: int, threads: int) -> None:
        self.workers = workers
        self._ray = ray
        actor = ray.remote(num_cpus=threads)(_TrialActor)
        self._actors = [actor.remote() for _ in range(workers)]

    def run(self, works: Sequence[TrialWork]) -> list[TrialOutcome]:
        refs = [self._actors[i % self.workers].run.remote(work) for i, work in enumerate(works)]
        # a failed trial or Ctrl-C ends the search: ``close`` kills the actors, and their trials with them (no
        # ray.cancel: a cancel that races a task's completion aborts this process inside Ray, ray_executor.py)
        return [self._get(ref, work) for ref, work in zip(refs, works)]

    def _get(self, ref: Any, work: TrialWork) -> TrialOutcome:
        outcome: TrialOutcome = task_result(
            self._ray, ref, f"trial {work.number}",
            failed="run the search with --executor local for its traceback", died="died",
            lost="check the workers' memory and logs (`ray logs`), or run with fewer --workers")
        return outcome

    def close(self) -> None:
        for actor in self._actors:
            self._ray.kill(actor)


@contextmanager
def trial_runner(executor: str, workers: int | None, threads: int | None,
                 address: str | None = None) -> Iterator[Trials]:
    """The runner of a search's rounds: ``workers`` trials each (default 1 locally, the cluster's cores over
    ``threads`` on Ray)."""
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    if executor == "local":
        if address is not None:
            raise ConfigError("--ray-address needs --executor ray")
        yield LocalTrials(workers or 1)
        return
    cores = threads or 1
    with ray_runtime(address, None if workers is None else workers * cores) as ray:
        count = workers or max(1, int(ray.cluster_resources().get("CPU", 1)) // cores)
        runner = RayTrials(ray, count, cores)
        try:
            yield runner
        finally:
            runner.close()
