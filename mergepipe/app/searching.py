"""`mergepipe search SEARCH.yml`: the merge parameters that score best, each trial a budgeted merge in memory.

Optuna proposes the parameters (TPE or CMA-ES, seeded): an operator among
those allowed, each expert's weight, and the density and lambda where the
operator takes them. A trial is a merge request at the search budget,
planned as any merge (reading nothing), merged in memory
(``Engine.merge_in_memory``) and evaluated on the objective's data
(``app/evaluating.py``), whose results are stored under the plan digest like
any evaluation, so a trial that lands on a merge scored before costs
nothing. Its objective is the weighted sum of the held-out losses; a trial
whose running loss on the first dataset is clearly worse than the median of
earlier trials at the same point is pruned (``MedianPruner``).

The study lives in the catalog's own SQLite file (Optuna's tables beside
MergePipe's), named by the file's ``study``: a search killed mid-trial is
continued with ``--resume`` (the killed trial is marked failed, the study
runs to its number of trials), and two machines sharing the catalog can work
on one study. At the end, the best trial's request is planned again at the
final budget and published as a snapshot (``merge``), the same snapshot a
plain merge with those parameters gives; the catalog records which study and
trial it came from (``searches``), which ``explain`` and ``lineage`` show.
When the final budget differs from the search's, the best ``FINALISTS``
trials are first merged at the final budget and evaluated, and the best of
them is published: parameters that score best on budgeted merges need not be
the best in full.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mergepipe.app.evaluating import Subject, evaluate_subject, merge_subject
from mergepipe.app.merging import Execution, Merged, merge
from mergepipe.app.planning import make_plan
from mergepipe.app.search_file import SearchSpec, load_search
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import SearchRecord
from mergepipe.errors import ConfigError
from mergepipe.evaluation.data import EvalData, load_data
from mergepipe.planner.evaluations import params_text
from mergepipe.planner.html.search_page import render_search
from mergepipe.progress import count_progress
from mergepipe.spec.request import MergeRequest
from mergepipe.txn.outpath import writable_file, write_report

INSTALL_HINT = "pip install 'mergepipe[search]'"
#: Trials re-evaluated at the final budget before one is published (when it differs from the search's).
FINALISTS = 3


@dataclass(frozen=True)
class Trial:
    """One finished trial: its parameters, objective (None when pruned or failed), and what it cost."""

    number: int
    state: str  # "complete" | "pruned" | "failed"
    params: dict[str, Any]
    objective: float | None
    plan_digest: str | None
    expert_bytes: int | None
    seconds: float | None


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
            "published": None if self.published is None else {
                "snapshot_id": self.published.snapshot_id, "model_id": self.published.model_id,
                "out": str(self.published.out)},
        }


def search(db: Catalogish, path: str | Path, *, trials: int | None = None, resume: bool = False,  # noqa: PLR0913
           out: str | Path | None = None, model_id: str | None = None, html: str | Path | None = None,
           force: bool = False, progress: bool = False, reporter: Reporter = SILENT) -> SearchResult:
    """Run (or with ``resume``, continue) the study of the search file at ``path``; publish the best trial at
    ``out`` (as ``model_id``, default the folder's name) when given; ``html``: a page of the search."""
    spec = load_search(path)
    total = trials if trials is not None else spec.trials
    if total < 1:
        raise ConfigError(f"--trials must be at least 1, got {total}")
    data = [load_data([file], spec.settings) for file, _ in spec.objective]
    optuna = _optuna()
    with open_catalog(db, writing=True, out=out, reporter=reporter) as catalog:
        page = None if html is None else writable_file(catalog, html, force, "--html")
        study = _study(optuna, catalog, spec, resume)
        left = total - sum(t.state.is_finished() for t in study.trials)
        objective = _Objective(catalog, spec, data, optuna, progress)
        if left > 0:
            with count_progress("search", left, "trials", progress) as advance:
                def done(_study: Any, trial: Any) -> None:
                    advance(1)
                    best = _best(optuna, _study)
                    value = "pruned" if trial.value is None else f"{trial.value:.4f}"
                    reporter.note(f"trial {trial.number}: {value} ({params_text(trial.params)})"
                                  + ("" if best is None else f"; best {best.value:.4f} (trial {best.number})"))

                study.optimize(objective, n_trials=left, callbacks=[done], gc_after_trial=True)
        result = SearchResult(spec.study, [_trial(optuna, t) for t in study.trials])
        best = _best(optuna, study)
        if best is None:
            raise ConfigError(f"study {spec.study}: no trial completed, so there is no best merge to publish")
        if spec.final_budget != spec.budget:
            best, result.finalists = _rerank(catalog, spec, optuna, study, objective, reporter)
        result.best = _trial(optuna, best)
        if out is not None:
            result.published = _publish(catalog, spec, best, out, model_id, len(study.trials), reporter)
    if page is not None:
        write_report(page, render_search(result.summary(), _importances(optuna, study)))
    return result


def best_request(spec: SearchSpec, params: dict[str, Any], budget: str, model_id: str | None = None) -> MergeRequest:
    """The merge request a trial's parameters stand for (``budget``: the search's, or the final one)."""
    operator = params.get("operator", spec.operators[0])
    settings = {key: params[key] for key in ("density", "lambda") if key in params}
    weights = tuple(float(params.get(f"weight {i}", spec.weights[e][0])) for i, e in enumerate(spec.experts))
    return MergeRequest(base=spec.base, experts=spec.experts, operator=operator, weights=weights, params=settings,
                        budget=budget, policy=spec.policy, seed=spec.seed, model_id=model_id)


class _Objective:
    """One trial: parameters proposed, request planned and merged in memory, losses summed."""

    def __init__(self, catalog: Catalog, spec: SearchSpec, data: list[EvalData], optuna: Any, progress: bool) -> None:
        self.catalog, self.spec, self.data, self.optuna, self.progress = catalog, spec, data, optuna, progress

    def __call__(self, trial: Any) -> float:
        spec = self.spec
        params: dict[str, Any] = {}
        operator = trial.suggest_categorical("operator", list(spec.operators)) if len(spec.operators) > 1 \
            else spec.operators[0]
        for i, expert in enumerate(spec.experts):
            low, high = spec.weights[expert]
            params[f"weight {i}"] = low if low == high else trial.suggest_float(f"weight {i}", low, high)
        for key, bounds in (("density", spec.density), ("lambda", spec.lam)):
            if bounds is not None and spec.takes(operator, key):
                low, high = bounds
                params[key] = low if low == high else trial.suggest_float(key, low, high)
        started = time.perf_counter()
        request = best_request(spec, {**params, "operator": operator}, spec.budget)
        made = make_plan(self.catalog, request, analyze_missing=True, strict=False, device="cpu",
                         progress=self.progress, reporter=SILENT)
        trial.set_user_attr("plan_digest", made.digest)
        trial.set_user_attr("expert_bytes", made.cost.expert_bytes)
        subject = merge_subject(self.catalog, made, f"trial {trial.number}")
        def prune(loss: float, step: int) -> None:  # on the first dataset's running loss
            trial.report(loss * spec.objective[0][1], step)
            if trial.should_prune():
                raise self.optuna.TrialPruned(f"running loss {loss:.4f} after {step} batches")

        total = self.score(subject, prune)
        trial.set_user_attr("seconds", time.perf_counter() - started)
        return total

    def score(self, subject: Subject, on_first_batch: Callable[[float, int], None] | None = None) -> float:
        """The objective of a merge: its weighted held-out losses, each evaluated (or found stored);
        ``on_first_batch`` sees the first dataset's running loss after each batch."""
        return sum(weight * evaluate_subject(self.catalog, subject, data, self.spec.settings, progress=False,
                                             on_batch=on_first_batch if index == 0 else None).loss
                   for index, ((_, weight), data) in enumerate(zip(self.spec.objective, self.data)))


def _rerank(catalog: Catalog, spec: SearchSpec, optuna: Any, study: Any, objective: _Objective,
            reporter: Reporter) -> tuple[Any, dict[int, float]]:
    """The best of the ``FINALISTS`` best trials once merged at the final budget (each evaluated as a trial,
    its result stored): the parameters that score best on budgeted merges need not be the best in full."""
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    finalists = sorted(complete, key=lambda t: (t.value, t.number))[:FINALISTS]
    scores = {}
    for trial in finalists:
        params = {"operator": spec.operators[0], **trial.params}
        made = make_plan(catalog, best_request(spec, params, spec.final_budget), analyze_missing=True, strict=False,
                         device="cpu", progress=objective.progress, reporter=SILENT)
        subject = merge_subject(catalog, made, f"trial {trial.number} at {spec.final_budget}")
        scores[trial.number] = objective.score(subject)
        reporter.note(f"trial {trial.number} at the final budget {spec.final_budget}: {scores[trial.number]:.4f}")
    chosen = min(finalists, key=lambda t: (scores[t.number], t.number))
    return chosen, scores


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ConfigError(f"search runs on Optuna, which is not installed: {INSTALL_HINT}") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("optuna").setLevel(logging.WARNING)
    return optuna


def _study(optuna: Any, catalog: Catalog, spec: SearchSpec, resume: bool) -> Any:
    """The study in the catalog's file: created, or continued with ``resume`` (its unfinished trials, left by a
    killed run, marked failed); an existing one without ``resume`` is refused."""
    storage = optuna.storages.RDBStorage(f"sqlite:///{catalog.path}",
                                         engine_kwargs={"connect_args": {"timeout": 60}})
    sampler = optuna.samplers.TPESampler(seed=spec.seed) if spec.sampler == "tpe" else \
        optuna.samplers.CmaEsSampler(seed=spec.seed)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=1)
    names = {s.study_name for s in optuna.study.get_all_study_summaries(storage)}
    if spec.study in names and not resume:
        raise ConfigError(f"study '{spec.study}' exists in {catalog.path}: --resume continues it, or name another "
                          "study (study: in the search file)")
    if spec.study not in names and resume:
        raise ConfigError(f"--resume: no study '{spec.study}' in {catalog.path} to continue")
    study = optuna.create_study(study_name=spec.study, storage=storage, sampler=sampler, pruner=pruner,
                                direction="minimize", load_if_exists=resume)
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        storage.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.FAIL)  # killed mid-trial
    return study


def _best(optuna: Any, study: Any) -> Any:
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return min(complete, key=lambda t: (t.value, t.number)) if complete else None


def _trial(optuna: Any, trial: Any) -> Trial:
    states = {optuna.trial.TrialState.COMPLETE: "complete", optuna.trial.TrialState.PRUNED: "pruned"}
    return Trial(trial.number, states.get(trial.state, "failed"), dict(trial.params), trial.value,
                 trial.user_attrs.get("plan_digest"), trial.user_attrs.get("expert_bytes"),
                 trial.user_attrs.get("seconds"))


def _publish(catalog: Catalog, spec: SearchSpec, best: Any, out: str | Path, model_id: str | None, trials: int,
             reporter: Reporter) -> Merged:
    params = dict(best.params)
    params.setdefault("operator", spec.operators[0])
    request = best_request(spec, params, spec.final_budget, model_id)
    reporter.note(f"publishing trial {best.number} ({params_text(best.params)}) at budget {spec.final_budget}")
    merged = merge(request, catalog, out, execution=Execution(), reporter=reporter)
    catalog.searches.add(SearchRecord(
        snapshot_id=merged.snapshot_id, study=spec.study, trial=best.number, trials=trials,
        objective=float(best.value), params=params, search_budget=spec.budget,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds")))
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
