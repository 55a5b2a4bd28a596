"""`mergepipe search SEARCH.yml`: the merge parameters that score best, each trial a budgeted merge in memory.

Optuna proposes the parameters (TPE or CMA-ES, seeded): an operator among
those allowed, each expert's weight, and the density and lambda where the
operator takes them (with ``layer_groups``, weight and density are gradients
over the layers, one parameter per point). A trial is a merge request at the
search budget, planned as any merge (reading nothing), merged in memory and
evaluated on the objective's terms (held-out losses, lm-eval scores), whose
results are stored under the plan digest like any evaluation, so a trial
that lands on a merge scored before costs nothing. Its objective is the
weighted sum of the terms (a score negated: minimised); a trial whose running
loss on the first term is worse than the median of earlier trials at the
same point is pruned (Optuna's median-pruner rule).

Trials run in rounds of ``workers``: proposed together (each round's
proposals see the trials finished before it and the round's earlier ones),
then planned here, run by the runner of ``app/trials.py`` (one after another
in this process, or at once on Ray actors) and recorded in trial order. Where
a trial runs changes none of its bits, so a search with the same seed and
workers gives the same trials on either executor.

Each trial has a slot, its place among the trials that ran (complete or
pruned), and is proposed by a sampler seeded from the seed and its slot: its
parameters follow from the seed, the slot and the study's finished trials,
whatever process proposes it. So a search stopped at the end of a round
(``--trials``) or interrupted (Ctrl-C, killed), then continued with
``--resume``, runs the trials the search run in one go runs: the round left
unfinished is marked failed and run again, each proposed trial with its
parameters (and the sampler's notes on it, CMA-ES's generation), a
half-proposed one proposed again; the failed trials stay in the study as a
record and count for nothing, not even ``--trials``. (A run stopped by
``--trials`` within a round, or resumed with other ``workers``, proposes its
rounds otherwise, and so other trials.)

The study lives in the catalog's own database (Optuna's tables beside
MergePipe's: the SQLite file, or the PostgreSQL server of a shared catalog),
named by the file's ``study``, and machines sharing the catalog can work on
one study (their trials then depend on which machine finishes first).
``catalog export`` takes the studies along. At the end, the
best trial's request is planned again at the final budget and published as a
snapshot (``merge``), the same snapshot a plain merge with those parameters
gives; the catalog records which study and trial it came from
(``searches``), which ``explain`` and ``lineage`` show. When the final
budget differs from the search's, the best ``FINALISTS`` trials are first
merged at the final budget and evaluated, and the best of them is published:
parameters that score best on budgeted merges need not be the best in full.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from importlib import import_module
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from mergepipe.app.evaluating import LOSS, PERPLEXITY, merge_subject, store_scores
from mergepipe.app.merging import Execution, Merged, merge
from mergepipe.app.planning import make_plan
from mergepipe.app.integration import read_yaml_mapping
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import SearchRecord
from mergepipe.engine.defaults import DEFAULT_MAX_MEMORY
from mergepipe.engine.engine import Engine, Limits, run_in_memory
from mergepipe.engine.executor import LocalExecutor
from mergepipe.engine.job import Job
from mergepipe.engine.ray_executor import ray_runtime, task_result
from mergepipe.errors import ConfigError
from mergepipe.evaluation.data import EvalData, EvalSettings, load_data
from mergepipe.evaluation.loss import run_tasks, tasks_digest
from mergepipe.evaluation.loss import build_model, load_tokenizer, score
from mergepipe.app.reports import params_text, render_search
from mergepipe.runtime import compute_threads, count_progress
from mergepipe.sizes import parse_size
from mergepipe.spec.operators import canonical_name, get_operator
from mergepipe.spec.plan import Plan
from mergepipe.spec.request import MergeRequest, StrictModel
from mergepipe.txn.outpath import writable_file, write_report

Range = tuple[float, float]


class _Objective(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    data: str | None = Field(None, min_length=1)
    task: str | None = Field(None, min_length=1)
    metric: str = Field("acc", min_length=1)
    include: str | None = Field(None, min_length=1)
    limit: int | None = Field(None, ge=1, strict=True)
    weight: float = Field(1.0, gt=0)


class _SearchFile(StrictModel):
    what: ClassVar[str] = ""

    base: str = Field(min_length=1)
    experts: list[str] = Field(min_length=1)
    operators: list[str] = Field(min_length=1)
    weight: tuple[float, float] | dict[str, tuple[float, float]] = (0.0, 1.0)
    density: tuple[float, float] | None = None
    lambda_: tuple[float, float] | None = Field(None, alias="lambda")
    layer_groups: int = Field(1, ge=1, le=64, strict=True)
    budget: str | int = "25%"
    final_budget: str | int = "100%"
    policy: Literal["energy", "uniform", "full", "entries"] | None = None
    objective: list[_Objective] = Field(min_length=1)
    max_tokens: int = Field(EvalSettings.max_tokens, ge=2, strict=True)
    batch: int = Field(EvalSettings.batch, ge=1, strict=True)
    tokenizer: str | None = Field(None, min_length=1)
    sampler: Literal["tpe", "cmaes"] = "tpe"
    seed: int = Field(0, ge=0, strict=True)
    trials: int = Field(20, ge=1, strict=True)
    study: str | None = Field(None, min_length=1, max_length=200)


@dataclass(frozen=True)
class Term:
    """One term of the objective: a held-out file's loss (``data``, minimised) or an lm-eval task's
    ``metric`` (``task``, maximised: its negative is summed), times ``weight``."""

    weight: float
    data: Path | None = None
    task: str | None = None
    metric: str = "acc"
    include: Path | None = None
    limit: int | None = None

    @property
    def name(self) -> str:
        return self.data.name if self.data is not None else f"{self.task}/{self.metric}"


@dataclass(frozen=True)
class SearchSpec:
    """A search file, parsed: references resolved against its folder, every range checked."""

    path: Path
    study: str
    base: str
    experts: tuple[str, ...]
    names: tuple[str, ...]  # each expert in trial parameters: a folder's name, else as written (unique)
    operators: tuple[str, ...]
    weights: dict[str, Range]  # per expert, as written in ``experts``
    density: Range | None
    lam: Range | None
    layer_groups: int
    budget: str
    final_budget: str
    policy: str | None  # None: the planner's default (entries when every expert has a delta store)
    objective: tuple[Term, ...]
    settings: EvalSettings
    sampler: str
    seed: int
    trials: int

    def takes(self, operator: str, parameter: str) -> bool:
        """Whether ``operator`` has the parameter (global or per expert)."""
        op = get_operator(operator)
        return any(d.name == parameter for d in (*op.global_params.definitions(), *op.expert_params.definitions()))


def load_search(path: str | Path) -> SearchSpec:
    """Parse the search file at ``path``; ConfigError naming the first problem."""
    path = Path(path)
    where = f"search file {path}"
    data = read_yaml_mapping(path, where)
    try:
        written = _SearchFile(**data)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    here = path.resolve().parent
    experts = tuple(_reference(e, here) for e in written.experts)
    if len(set(experts)) != len(experts):
        raise ConfigError(f"{where}: an expert is listed twice")
    names = tuple(Path(e).name if Path(e).is_absolute() else w for w, e in zip(written.experts, experts))
    operators = []
    for name in written.operators:
        try:
            operators.append(canonical_name(name))
        except ConfigError as exc:
            raise ConfigError(f"{where}: operators: {exc}") from None
    if isinstance(written.weight, dict):
        unknown = sorted(set(written.weight) - set(written.experts))
        missing = sorted(set(written.experts) - set(written.weight))
        if unknown or missing:
            problem = f"unknown expert {unknown[0]}" if unknown else f"no range for {missing[0]}"
            raise ConfigError(f"{where}: weight: {problem}")
        weights = {_reference(e, here): written.weight[e] for e in written.experts}
    else:
        weights = {e: written.weight for e in experts}
    for name, value in [
        *((f"weight of {e}", r) for e, r in weights.items()),
        ("density", written.density),
        ("lambda", written.lambda_),
    ]:
        if value is not None and not math.isfinite(value[1] - value[0]):  # what Optuna's samplers draw in
            raise ConfigError(
                f"{where}: {name}: the range [{value[0]}, {value[1]}] is not finite; give finite "
                "bounds less than 1.7e308 apart"
            )
        if value is not None and not value[0] <= value[1]:
            raise ConfigError(f"{where}: {name}: the range [{value[0]}, {value[1]}] is empty (low > high)")
    if written.density is not None and not 0 < written.density[0] <= written.density[1] <= 1:
        raise ConfigError(f"{where}: density must lie in (0, 1], got {list(written.density)}")
    objective = tuple(_term(o, here, where) for o in written.objective)
    tokenizer = None if written.tokenizer is None else _reference(written.tokenizer, here)
    return SearchSpec(
        path=path.resolve(),
        study=written.study or path.stem,
        base=_reference(written.base, here),
        experts=experts,
        names=names if len(set(names)) == len(names) else tuple(written.experts),
        operators=tuple(operators),
        weights=weights,
        density=written.density,
        lam=written.lambda_,
        layer_groups=written.layer_groups,
        budget=str(written.budget),
        final_budget=str(written.final_budget),
        policy=written.policy,
        objective=objective,
        settings=EvalSettings(written.max_tokens, written.batch, tokenizer),
        sampler=written.sampler,
        seed=written.seed,
        trials=written.trials,
    )


def _reference(value: str, here: Path) -> str:
    """A folder relative to the search file, made absolute; an id or a URI as written."""
    candidate = Path(value).expanduser()
    candidate = candidate if candidate.is_absolute() else here / candidate
    return str(candidate) if candidate.is_dir() else value


def _term(written: _Objective, here: Path, where: str) -> Term:
    if (written.data is None) == (written.task is None):
        raise ConfigError(
            f"{where}: objective: each term names either data (a held-out file) or task (an lm-eval task)"
        )
    if written.data is not None:
        if written.include is not None or written.limit is not None:
            raise ConfigError(f"{where}: objective: include and limit go with a task, not with data")
        return Term(written.weight, data=_path(written.data, here, where, "data", Path.is_file, "file"))
    include = None if written.include is None else _path(written.include, here, where, "include", Path.is_dir, "folder")
    return Term(written.weight, task=written.task, metric=written.metric, include=include, limit=written.limit)


def _path(value: str, here: Path, where: str, key: str, exists: Callable[[Path], bool], kind: str) -> Path:
    path = Path(value).expanduser()
    path = path if path.is_absolute() else here / path
    if not exists(path):
        raise ConfigError(f"{where}: objective {key} {value}: no such {kind}")
    return path


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
                results.append(_trials_term(model, tokenizer, term, work, steps))
        except _Pruned:
            return TrialOutcome(work.number, tuple(results), tuple(steps), True, time.perf_counter() - started)
    return TrialOutcome(work.number, tuple(results), tuple(steps), False, time.perf_counter() - started)


def _trials_term(model: Any, tokenizer: Any, part: TermWork, work: TrialWork, steps: list[float]) -> TermResult:
    term = part.term
    if part.data is None:
        assert term.task is not None
        started = time.perf_counter()
        scores = run_tasks(
            model,
            tokenizer,
            [term.task],
            [] if term.include is None else [term.include],
            limit=term.limit,
            batch=work.settings.batch,
            device="cpu",
        )
        return TermResult(part.index, scores, None, time.perf_counter() - started)

    def watch(loss: float, step: int) -> None:
        steps.append(loss * term.weight)
        bar = work.bars.get(step)
        if bar is not None and step >= WARMUP_STEPS and min(steps) > bar:
            raise _Pruned

    result = score(model, tokenizer, part.data, work.settings, "cpu", on_batch=watch if part.index == 0 else None)
    return TermResult(part.index, {LOSS: result.loss, PERPLEXITY: result.perplexity}, result.tokens, result.seconds)


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
            self._ray,
            ref,
            f"trial {work.number}",
            failed="run the search with --executor local for its traceback",
            died="died",
            lost="check the workers' memory and logs (`ray logs`), or run with fewer --workers",
        )
        return outcome

    def close(self) -> None:
        for actor in self._actors:
            self._ray.kill(actor)


@contextmanager
def trial_runner(
    executor: str, workers: int | None, threads: int | None, address: str | None = None
) -> Iterator[Trials]:
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


INSTALL_HINT = "pip install 'mergepipe[search]'"
#: Trials re-evaluated at the final budget before one is published (when it differs from the search's).
FINALISTS = 3
#: A trial's system attribute: [its slot, the first slot of its round, the slot after its round's last].
SLOT = "mergepipe:slot"


@dataclass(frozen=True)
class Trial:
    """One finished trial: its parameters, objective (complete trials only), and what it cost; a pruned trial's
    ``partial_loss``: the running loss of the objective's first term (times its weight) where it stopped."""

    number: int
    state: str  # "complete" | "pruned" | "failed"
    params: dict[str, Any]
    objective: float | None
    partial_loss: float | None
    plan_digest: str | None
    expert_bytes: int | None
    seconds: float | None

    def text(self) -> str:
        """The objective, or the state (and partial loss) of a trial without one."""
        if self.objective is not None:
            return f"{self.objective:.4f}"
        partial = "" if self.partial_loss is None else f" (partial loss {self.partial_loss:.4f})"
        return f"{self.state}{partial}"


@dataclass
class SearchResult:
    study: str
    trials: list[Trial] = field(default_factory=list)
    best: Trial | None = None
    published: Merged | None = None
    # with a final budget other than the search's: the best trials' objectives at the final budget, by trial
    finalists: dict[int, float] = field(default_factory=dict)

    def summary(self) -> dict[str, object]:
        best = self.best
        return {
            "study": self.study,
            "trials": [vars(t) for t in self.trials],
            "best": None if best is None else vars(best),
            "finalists": self.finalists,
            "published": None
            if self.published is None
            else {
                "snapshot_id": self.published.snapshot_id,
                "model_id": self.published.model_id,
                "out": str(self.published.out),
            },
        }


def search(  # noqa: PLR0913
    db: Catalogish,
    path: str | Path,
    *,
    trials: int | None = None,
    resume: bool = False,
    out: str | Path | None = None,
    model_id: str | None = None,
    html: str | Path | None = None,
    force: bool = False,
    executor: str = "local",
    workers: int | None = None,
    threads: int | None = None,
    ray_address: str | None = None,
    tokenizer: str | None = None,
    progress: bool = False,
    reporter: Reporter = SILENT,
) -> SearchResult:
    """Run (or with ``resume``, continue) the study of the search file at ``path``; publish the best trial at
    ``out`` (as ``model_id``, default the folder's name) when given; ``html``: a page of the search.
    ``executor``: where trials run (``local`` or ``ray``), ``workers`` at a time (proposed together: the same
    ``workers`` gives the same trials on either executor), each with ``threads`` compute threads.
    ``tokenizer``: the one to evaluate with, instead of the file's."""
    spec = load_search(path)
    if tokenizer is not None:
        spec = replace(spec, settings=replace(spec.settings, tokenizer=tokenizer))
    total = trials if trials is not None else spec.trials
    if total < 1:
        raise ConfigError(f"--trials must be at least 1, got {total}")
    optuna = _optuna(spec.sampler)
    terms = _Terms(spec)
    with (
        open_catalog(db, writing=True, out=out, reporter=reporter) as catalog,
        trial_runner(executor, workers, threads, ray_address) as runner,
    ):
        page = None if html is None else writable_file(catalog, html, force, "--html")
        study = _study(optuna, catalog, spec, resume)
        slot = len(_ran(optuna, study))
        left = total - slot
        unfinished, again = _unfinished_round(optuna, study, spec, slot)
        rounds = _Rounds(catalog, spec, terms, optuna, runner, threads, progress)
        if left > 0:
            with (
                count_progress("search", left, "trials", progress) as advance,
                _dropped_if_none_ran(optuna, study, catalog, spec, resume),
            ):

                def done(trial: Any) -> None:
                    advance(1)
                    best = _best(optuna, study)
                    reporter.note(
                        f"trial {trial.number}: {_trial(optuna, trial).text()} ({params_text(trial.params)})"
                        + ("" if best is None else f"; best {best.value:.4f} (trial {best.number})")
                    )

                while left > 0:
                    # the round an interruption left unfinished first, as it was: its proposals hang together
                    whole = unfinished if unfinished is not None else range(slot, slot + min(runner.workers, left))
                    slots = range(slot, min(whole.stop, slot + left))
                    rounds.run(study, slots, whole, again, done)
                    unfinished, again = None, {}
                    slot, left = slot + len(slots), left - len(slots)
        result = SearchResult(spec.study, [_trial(optuna, t) for t in study.trials])
        best = _best(optuna, study)
        if best is None:
            raise ConfigError(f"study {spec.study}: no trial completed, so there is no best merge to publish")
        if spec.final_budget != spec.budget:
            best, result.finalists = _rerank(catalog, spec, optuna, study, rounds, reporter)
        result.best = _trial(optuna, best)
        if out is not None:
            result.published = _publish(catalog, spec, best, out, model_id, len(_ran(optuna, study)), reporter)
    if page is not None:
        write_report(page, render_search(result.summary(), _importances(optuna, study)))
    return result


def best_request(spec: SearchSpec, params: dict[str, Any], budget: str, model_id: str | None = None) -> MergeRequest:
    """The merge request a trial's parameters stand for (``budget``: the search's, or the final one). With
    layer groups, each expert's weight and the density are gradients over the layers."""
    operator = params.get("operator", spec.operators[0])
    groups = range(spec.layer_groups)
    settings: dict[str, Any] = {}
    if "lambda" in params:
        settings["lambda"] = params["lambda"]
    if spec.layer_groups == 1:
        if "density" in params:
            settings["density"] = params["density"]
        weights = tuple(float(params.get(f"weight {n}", spec.weights[e][0])) for e, n in zip(spec.experts, spec.names))
        return MergeRequest(
            base=spec.base,
            experts=spec.experts,
            operator=operator,
            weights=weights,
            params=settings,
            budget=budget,
            policy=spec.policy,
            seed=spec.seed,
            model_id=model_id,
        )
    if any(f"density group {g}" in params for g in groups):
        settings["density"] = [float(params[f"density group {g}"]) for g in groups]
    per_expert = {
        e: {"weight": [float(params.get(f"weight {n} group {g}", spec.weights[e][0])) for g in groups]}
        for e, n in zip(spec.experts, spec.names)
    }
    return MergeRequest(
        base=spec.base,
        experts=spec.experts,
        operator=operator,
        params=settings,
        expert_params=per_expert,
        budget=budget,
        policy=spec.policy,
        seed=spec.seed,
        model_id=model_id,
    )


def propose(trial: Any, spec: SearchSpec) -> dict[str, Any]:
    """A trial's parameters, suggested in a fixed order (the operator when there is a choice, each expert's
    weight (named by the expert's name in the file), density and lambda where the operator takes them); a
    fixed range is not suggested."""
    params: dict[str, Any] = {}
    operator = (
        trial.suggest_categorical("operator", list(spec.operators)) if len(spec.operators) > 1 else spec.operators[0]
    )
    groups = [""] if spec.layer_groups == 1 else [f" group {g}" for g in range(spec.layer_groups)]
    for expert, name in zip(spec.experts, spec.names):
        low, high = spec.weights[expert]
        for group in groups:
            if low != high:
                params[f"weight {name}{group}"] = trial.suggest_float(f"weight {name}{group}", low, high)
    for key, bounds, grouped in (("density", spec.density, True), ("lambda", spec.lam, False)):
        if bounds is not None and spec.takes(operator, key):
            low, high = bounds
            for group in groups if grouped else [""]:
                name = f"{key}{group}"
                params[name] = low if low == high else trial.suggest_float(name, low, high)
    return {**params, "operator": operator}


class _Terms:
    """The objective's terms, loaded once: each loss term's data, each task term's digest."""

    def __init__(self, spec: SearchSpec) -> None:
        self.spec = spec
        self.data: dict[int, EvalData] = {}
        self.keys: dict[int, tuple[str, str]] = {}  # term -> (data digest, name) its results are stored under
        for index, term in enumerate(spec.objective):
            if term.data is not None:
                self.data[index] = load_data([term.data], spec.settings)
                self.keys[index] = (self.data[index].digest, self.data[index].name)
            else:
                assert term.task is not None
                self.keys[index] = tasks_digest(
                    [term.task], [] if term.include is None else [term.include], term.limit, spec.settings
                )

    def stored(self, catalog: Catalog, subject: str) -> dict[int, float]:
        """The term values the catalog holds for ``subject`` (a plan digest)."""
        found = {}
        for index, term in enumerate(self.spec.objective):
            rows = {r.metric: r.value for r in catalog.evaluations.get(subject, self.keys[index][0])}
            metric = LOSS if term.data is not None else term.name
            if metric in rows:
                found[index] = rows[metric]
        return found

    def work(self, index: int) -> TermWork:
        return TermWork(index, self.spec.objective[index], self.data.get(index))

    def value(self, index: int, scores: dict[str, float]) -> float:
        term = self.spec.objective[index]
        if term.data is not None:
            return scores[LOSS]
        if term.name not in scores:
            raise ConfigError(
                f"lm-eval task {term.task} reports no metric {term.metric!r} (it reports "
                f"{', '.join(sorted(k.split('/', 1)[1] for k in scores)) or 'none'})"
            )
        return scores[term.name]

    def objective(self, values: dict[int, float]) -> float:
        """Each term's value times its weight, summed; a task's score (maximised) negated."""
        return sum(
            (1.0 if term.data is not None else -1.0) * term.weight * values[index]
            for index, term in enumerate(self.spec.objective)
        )


class _Rounds:
    """Trials in rounds: asked and proposed together (each proposal sees the trials finished before the round
    and the round's earlier ones), then planned here, run by the runner, recorded here in trial order."""

    def __init__(
        self,
        catalog: Catalog,
        spec: SearchSpec,
        terms: _Terms,
        optuna: Any,
        runner: Trials,
        threads: int | None,
        progress: bool,
    ) -> None:
        self.catalog, self.spec, self.terms, self.optuna = catalog, spec, terms, optuna
        self.runner, self.threads, self.progress = runner, threads, progress

    def run(self, study: Any, slots: range, whole: range, again: dict[int, Any], done: Callable[[Any], None]) -> None:
        """The trials of ``slots``, of the round ``whole`` (the rest of it ran before an interruption); a slot
        in ``again`` runs that failed trial again, as it was proposed."""
        # the pruning bars of the trials complete before the round (not of its first ones, done before an
        # interruption: the round run in one go did not see them)
        finished = study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.COMPLETE,))
        bars = prune_bars([t.intermediate_values for t in finished if t.system_attrs.get(SLOT, [-1])[0] < whole.start])
        asked: list[Any] = []
        try:
            for slot in slots:
                asked.append(self._ask(study, slot, whole, again.get(slot)))
            proposed = []
            for slot, trial in zip(slots, asked):
                study.sampler = _sampler(self.optuna, self.spec, slot)
                proposed.append(propose(trial, self.spec))
            prepared = [self._prepare(trial, params, bars) for trial, params in zip(asked, proposed)]
            outcomes = iter(self.runner.run([work for _, _, work in prepared if work is not None]))
            for trial, (made, stored, work) in zip(asked, prepared):
                self._finish(study, trial, made, stored, None if work is None else next(outcomes))
                done(study.trials[trial.number])
        except BaseException:
            for trial in asked:
                if not study.trials[trial.number].state.is_finished():
                    study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
            raise

    def _ask(self, study: Any, slot: int, whole: range, failed: Any) -> Any:
        """A new trial at ``slot``, its place written with it (one write, so a trial never lacks it); with the
        ``failed`` trial of that slot, that trial's parameters, fixed, and the sampler's notes on it (CMA-ES
        keeps its generation and state in them)."""
        attrs: dict[str, Any] = {}
        if failed is not None:
            attrs = {k: v for k, v in failed.system_attrs.items() if k not in (SLOT, "fixed_params")}
            attrs["fixed_params"] = dict(failed.params)
        attrs[SLOT] = [slot, whole.start, whole.stop]
        study.add_trial(self.optuna.trial.create_trial(state=self.optuna.trial.TrialState.WAITING, system_attrs=attrs))
        study.sampler = _sampler(self.optuna, self.spec, slot)  # Optuna versions that sample at ask use this one
        return study.ask()  # the trial just added (a killed run's waiting ones were marked failed)

    def _prepare(
        self, trial: Any, params: dict[str, Any], bars: dict[int, float]
    ) -> tuple[Plan, dict[int, float], TrialWork | None]:
        """The trial's plan; the term values stored, and the work left (None: all stored)."""
        started = time.perf_counter()
        made = self.plan(params, self.spec.budget)
        trial.set_user_attr("plan_digest", made.digest)
        trial.set_user_attr("expert_bytes", made.cost.expert_bytes)
        trial.set_user_attr("plan_seconds", time.perf_counter() - started)
        stored = self.terms.stored(self.catalog, made.digest)
        return made, stored, self.work(trial.number, made, stored, bars)

    def plan(self, params: dict[str, Any], budget: str) -> Plan:
        """The plan of a trial's parameters at ``budget`` (the search's, or the final one)."""
        return make_plan(
            self.catalog,
            best_request(self.spec, params, budget),
            analyze_missing=True,
            strict=False,
            device="cpu",
            progress=self.progress,
            reporter=SILENT,
        )

    def work(self, number: int, made: Plan, stored: dict[int, float], bars: dict[int, float]) -> TrialWork | None:
        missing = [i for i in range(len(self.spec.objective)) if i not in stored]
        if not missing:
            return None
        subject = merge_subject(self.catalog, made, f"trial {number}")
        job = Engine(self.catalog).in_memory_job(made)
        return TrialWork(
            number,
            job,
            subject.config_folder,
            subject.tokenizers,
            tuple(self.terms.work(i) for i in missing),
            self.spec.settings,
            bars if 0 in missing else {},
            self.threads,
        )

    def values(self, stored: dict[int, float], outcome: TrialOutcome | None) -> dict[int, float]:
        """The term values of a trial: those stored, and those computed now."""
        computed = () if outcome is None else outcome.results
        return {**stored, **{r.index: self.terms.value(r.index, r.scores) for r in computed}}

    def store(self, made: Plan, outcome: TrialOutcome | None) -> None:
        """The scores computed now, stored in the catalog under the trial's plan."""
        if outcome is None or not outcome.results:
            return
        subject = merge_subject(self.catalog, made, "trial")
        for result in outcome.results:
            term = self.spec.objective[result.index]
            digest, name = self.terms.keys[result.index]
            store_scores(
                self.catalog,
                subject,
                digest,
                name,
                result.scores,
                tokens=result.tokens,
                seconds=result.seconds,
                task=term.task is not None,
            )

    def _finish(
        self, study: Any, trial: Any, made: Plan, stored: dict[int, float], outcome: TrialOutcome | None
    ) -> None:
        values = self.values(stored, outcome)
        for step, value in enumerate(outcome.steps if outcome is not None else (), start=1):
            trial.report(value, step)
        seconds = trial.user_attrs["plan_seconds"] + (outcome.seconds if outcome is not None else 0.0)
        trial.set_user_attr("seconds", seconds)
        if outcome is not None and outcome.pruned:
            study.tell(trial, state=self.optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, self.terms.objective(values))
        # stored only once told: a trial interrupted before is run again on resume, and must run, not find its
        # scores stored and report no running losses (the next rounds' pruning bars)
        self.store(made, outcome)

    def evaluate(self, made: Plan, number: int) -> float:
        """The objective of one merge, every term computed unless stored (the finalists' re-ranking)."""
        stored = self.terms.stored(self.catalog, made.digest)
        work = self.work(number, made, stored, {})
        outcome = None if work is None else self.runner.run([work])[0]
        self.store(made, outcome)
        return self.terms.objective(self.values(stored, outcome))


def _rerank(
    catalog: Catalog, spec: SearchSpec, optuna: Any, study: Any, rounds: _Rounds, reporter: Reporter
) -> tuple[Any, dict[int, float]]:
    """The best of the ``FINALISTS`` best trials once merged at the final budget (each evaluated as a trial,
    its result stored): the parameters that score best on budgeted merges need not be the best in full."""
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    finalists = sorted(complete, key=lambda t: (t.value, t.number))[:FINALISTS]
    scores = {}
    for trial in finalists:
        made = rounds.plan({"operator": spec.operators[0], **trial.params}, spec.final_budget)
        scores[trial.number] = rounds.evaluate(made, trial.number)
        reporter.note(f"trial {trial.number} at the final budget {spec.final_budget}: {scores[trial.number]:.4f}")
    chosen = min(finalists, key=lambda t: (scores[t.number], t.number))
    return chosen, scores


def _optuna(sampler: str) -> Any:
    """Optuna (and cmaes for its CMA-ES sampler, which imports it only once it samples), or the one line naming
    the extra that installs them."""
    try:
        import optuna

        if sampler == "cmaes":
            import_module("cmaes")
    except ImportError as exc:
        raise ConfigError(f"search needs {exc.name or 'Optuna'}, which is not installed: {INSTALL_HINT}") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("optuna").setLevel(logging.WARNING)
    return optuna


def _study(optuna: Any, catalog: Catalog, spec: SearchSpec, resume: bool) -> Any:
    """The study in the catalog's file: created, or continued with ``resume`` (its unfinished trials, left by a
    killed run, marked failed); an existing one without ``resume`` is refused, and so is one whose stored trials
    cannot be read back. No other study is read: a damaged one leaves the others usable."""
    # the catalog's own database: its SQLite file, or its PostgreSQL server (a team's searches are shared)
    storage = optuna.storages.RDBStorage(
        catalog.url, engine_kwargs={"connect_args": {"timeout": 60}} if not catalog.shared else {}
    )
    complete = optuna.trial.TrialState.COMPLETE
    try:  # what Optuna raises on a study's rows it cannot read back (edited or damaged)
        try:
            study = (
                optuna.load_study(study_name=spec.study, storage=storage, sampler=_sampler(optuna, spec, 0))
                if resume
                else optuna.create_study(
                    study_name=spec.study, storage=storage, sampler=_sampler(optuna, spec, 0), direction="minimize"
                )
            )
        except optuna.exceptions.DuplicatedStudyError:
            raise ConfigError(
                f"study '{spec.study}' exists in {catalog.path}: --resume continues it, or name "
                "another study (study: in the search file)"
            ) from None
        except KeyError:
            raise ConfigError(f"--resume: no study '{spec.study}' in {catalog.path} to continue") from None
        if any(t.state == complete and t.value is None for t in study.get_trials(deepcopy=False)):
            raise ValueError("a complete trial has no value")
    except (LookupError, ValueError, TypeError, AssertionError) as exc:
        raise ConfigError(
            f"study '{spec.study}' in {catalog.path} is damaged: its stored trials cannot be read "
            f"({exc!r}); delete it (optuna delete-study) or name another study (study: in the "
            "search file)"
        ) from None
    unfinished = (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)
    for trial in study.get_trials(deepcopy=False, states=unfinished):
        storage.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.FAIL)  # killed mid-trial
    return study


@contextmanager
def _dropped_if_none_ran(optuna: Any, study: Any, catalog: Catalog, spec: SearchSpec, resume: bool) -> Iterator[None]:
    """A new study none of whose trials ran is not kept when the search fails (a missing tokenizer, Ctrl-C in
    the first round): the command, fixed, runs again as typed, without --resume."""
    try:
        yield
    except BaseException:
        if not resume and not _ran(optuna, study):
            optuna.delete_study(study_name=spec.study, storage=catalog.url)
        raise


def _sampler(optuna: Any, spec: SearchSpec, slot: int) -> Any:
    """The sampler that proposes the trial at ``slot``, seeded from the search's seed and the slot: a
    trial's proposal depends on no other trial's draws, so a resumed search proposes what a search run in
    one go does. (The samplers keep nothing else between trials: TPE and CMA-ES read the study.)"""
    digest = hashlib.sha256(f"mergepipe search {spec.seed} {slot}".encode()).digest()
    seed = int.from_bytes(digest[:4], "little")  # NumPy's RandomState takes seeds below 2**32
    if spec.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    return _slot_cmaes(optuna)(slot, seed=seed)


@functools.cache
def _slot_cmaes(optuna: Any) -> Any:
    """Optuna's CMA-ES sampler, shown each trial with its slot for its number: it seeds each proposal with
    the trial number, which the failed trials of an interruption push on."""

    class SlotCmaEs(optuna.samplers.CmaEsSampler):
        def __init__(self, slot: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.slot = slot

        def sample_relative(self, study: Any, trial: Any, search_space: dict[str, Any]) -> Any:
            if trial.number != self.slot:
                trial = copy.copy(trial)
                trial.number = self.slot
            return super().sample_relative(study, trial, search_space)

    return SlotCmaEs


def _ran(optuna: Any, study: Any) -> list[Any]:
    """The trials that ran: complete or pruned (a failed one was interrupted, and runs again on resume)."""
    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED))


def _unfinished_round(optuna: Any, study: Any, spec: SearchSpec, slot: int) -> tuple[range | None, dict[int, Any]]:
    """The round an interruption left unfinished, when the study's last trial is one of its failed ones and
    ``slot`` (the next) lies in it; and by slot, the latest failed trial proposed in full (run again as it
    was: re-proposed, a trial would be the same, but one that ran had the sampler note things on it)."""
    placed = [t for t in study.get_trials(deepcopy=False) if SLOT in t.system_attrs]
    if not placed or placed[-1].state != optuna.trial.TrialState.FAIL:
        return None, {}
    _, start, stop = placed[-1].system_attrs[SLOT]
    if not start <= slot < stop:
        return None, {}
    failed = [t for t in placed if t.state == optuna.trial.TrialState.FAIL and slot <= t.system_attrs[SLOT][0] < stop]
    return range(start, stop), {t.system_attrs[SLOT][0]: t for t in failed if _proposed(optuna, spec, t)}


def _proposed(optuna: Any, spec: SearchSpec, trial: Any) -> bool:
    """Whether every parameter of the trial was suggested before it was interrupted."""
    try:
        propose(optuna.trial.FixedTrial(trial.params), spec)
    except ValueError:  # FixedTrial: a parameter it was not given
        return False
    return True


def _best(optuna: Any, study: Any) -> Any:
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return min(complete, key=lambda t: (t.value, t.number)) if complete else None


def _trial(optuna: Any, trial: Any) -> Trial:
    """A study's trial as the search reports it (Optuna gives a pruned trial its last running loss as value)."""
    states = {optuna.trial.TrialState.COMPLETE: "complete", optuna.trial.TrialState.PRUNED: "pruned"}
    state = states.get(trial.state, "failed")
    return Trial(
        trial.number,
        state,
        dict(trial.params),
        trial.value if state == "complete" else None,
        trial.value if state == "pruned" else None,
        trial.user_attrs.get("plan_digest"),
        trial.user_attrs.get("expert_bytes"),
        trial.user_attrs.get("seconds"),
    )


def _publish(
    catalog: Catalog,
    spec: SearchSpec,
    best: Any,
    out: str | Path,
    model_id: str | None,
    trials: int,
    reporter: Reporter,
) -> Merged:
    params = dict(best.params)
    params.setdefault("operator", spec.operators[0])
    request = best_request(spec, params, spec.final_budget, model_id)
    reporter.note(f"publishing trial {best.number} ({params_text(best.params)}) at budget {spec.final_budget}")
    merged = merge(request, catalog, out, execution=Execution(), reporter=reporter)
    catalog.searches.add(
        SearchRecord(
            snapshot_id=merged.snapshot_id,
            study=spec.study,
            trial=best.number,
            trials=trials,
            objective=float(best.value),
            params=params,
            search_budget=spec.budget,
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
    )
    return merged


def _importances(optuna: Any, study: Any) -> dict[str, float]:
    """Parameter importances (fANOVA) once enough trials completed; empty otherwise."""
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(complete) < 4 or not any(t.params for t in complete):
        return {}
    try:
        return {k: float(v) for k, v in optuna.importance.get_param_importances(study).items()}
    except (RuntimeError, ValueError):  # too little variation to attribute
        return {}
