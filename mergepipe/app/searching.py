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
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from importlib import import_module
from pathlib import Path
from typing import Any

from mergepipe.app.evaluating import LOSS, merge_subject, store_scores
from mergepipe.app.merging import Execution, Merged, merge
from mergepipe.app.planning import make_plan
from mergepipe.app.search_file import SearchSpec, load_search
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.app.trials import TermWork, TrialOutcome, TrialWork, Trials, prune_bars, trial_runner
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import SearchRecord
from mergepipe.errors import ConfigError
from mergepipe.engine.engine import Engine
from mergepipe.evaluation.data import EvalData, load_data
from mergepipe.evaluation.harness import tasks_digest
from mergepipe.planner.evaluations import params_text
from mergepipe.planner.html.search_page import render_search
from mergepipe.progress import count_progress
from mergepipe.spec.plan import Plan
from mergepipe.spec.request import MergeRequest
from mergepipe.txn.outpath import writable_file, write_report

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
            "published": None if self.published is None else {
                "snapshot_id": self.published.snapshot_id, "model_id": self.published.model_id,
                "out": str(self.published.out)},
        }


def search(db: Catalogish, path: str | Path, *, trials: int | None = None, resume: bool = False,  # noqa: PLR0913
           out: str | Path | None = None, model_id: str | None = None, html: str | Path | None = None,
           force: bool = False, executor: str = "local", workers: int | None = None, threads: int | None = None,
           ray_address: str | None = None, tokenizer: str | None = None, progress: bool = False,
           reporter: Reporter = SILENT) -> SearchResult:
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
    with open_catalog(db, writing=True, out=out, reporter=reporter) as catalog, \
            trial_runner(executor, workers, threads, ray_address) as runner:
        page = None if html is None else writable_file(catalog, html, force, "--html")
        study = _study(optuna, catalog, spec, resume)
        slot = len(_ran(optuna, study))
        left = total - slot
        unfinished, again = _unfinished_round(optuna, study, spec, slot)
        rounds = _Rounds(catalog, spec, terms, optuna, runner, threads, progress)
        if left > 0:
            with count_progress("search", left, "trials", progress) as advance, \
                    _dropped_if_none_ran(optuna, study, catalog, spec, resume):
                def done(trial: Any) -> None:
                    advance(1)
                    best = _best(optuna, study)
                    reporter.note(f"trial {trial.number}: {_trial(optuna, trial).text()} ({params_text(trial.params)})"
                                  + ("" if best is None else f"; best {best.value:.4f} (trial {best.number})"))

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
        return MergeRequest(base=spec.base, experts=spec.experts, operator=operator, weights=weights,
                            params=settings, budget=budget, policy=spec.policy, seed=spec.seed, model_id=model_id)
    if any(f"density group {g}" in params for g in groups):
        settings["density"] = [float(params[f"density group {g}"]) for g in groups]
    per_expert = {e: {"weight": [float(params.get(f"weight {n} group {g}", spec.weights[e][0])) for g in groups]}
                  for e, n in zip(spec.experts, spec.names)}
    return MergeRequest(base=spec.base, experts=spec.experts, operator=operator, params=settings,
                        expert_params=per_expert, budget=budget, policy=spec.policy, seed=spec.seed,
                        model_id=model_id)


def propose(trial: Any, spec: SearchSpec) -> dict[str, Any]:
    """A trial's parameters, suggested in a fixed order (the operator when there is a choice, each expert's
    weight (named by the expert's name in the file), density and lambda where the operator takes them); a
    fixed range is not suggested."""
    params: dict[str, Any] = {}
    operator = trial.suggest_categorical("operator", list(spec.operators)) if len(spec.operators) > 1 \
        else spec.operators[0]
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
                self.keys[index] = tasks_digest([term.task], [] if term.include is None else [term.include],
                                                term.limit, spec.settings)

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
            raise ConfigError(f"lm-eval task {term.task} reports no metric {term.metric!r} (it reports "
                              f"{', '.join(sorted(k.split('/', 1)[1] for k in scores)) or 'none'})")
        return scores[term.name]

    def objective(self, values: dict[int, float]) -> float:
        """Each term's value times its weight, summed; a task's score (maximised) negated."""
        return sum((1.0 if term.data is not None else -1.0) * term.weight * values[index]
                   for index, term in enumerate(self.spec.objective))


class _Rounds:
    """Trials in rounds: asked and proposed together (each proposal sees the trials finished before the round
    and the round's earlier ones), then planned here, run by the runner, recorded here in trial order."""

    def __init__(self, catalog: Catalog, spec: SearchSpec, terms: _Terms, optuna: Any, runner: Trials,  # noqa: PLR0913
                 threads: int | None, progress: bool) -> None:
        self.catalog, self.spec, self.terms, self.optuna = catalog, spec, terms, optuna
        self.runner, self.threads, self.progress = runner, threads, progress

    def run(self, study: Any, slots: range, whole: range, again: dict[int, Any], done: Callable[[Any], None]
            ) -> None:
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
        study.add_trial(self.optuna.trial.create_trial(state=self.optuna.trial.TrialState.WAITING,
                                                       system_attrs=attrs))
        study.sampler = _sampler(self.optuna, self.spec, slot)  # Optuna versions that sample at ask use this one
        return study.ask()  # the trial just added (a killed run's waiting ones were marked failed)

    def _prepare(self, trial: Any, params: dict[str, Any], bars: dict[int, float]
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
        return make_plan(self.catalog, best_request(self.spec, params, budget), analyze_missing=True,
                         strict=False, device="cpu", progress=self.progress, reporter=SILENT)

    def work(self, number: int, made: Plan, stored: dict[int, float], bars: dict[int, float]) -> TrialWork | None:
        missing = [i for i in range(len(self.spec.objective)) if i not in stored]
        if not missing:
            return None
        subject = merge_subject(self.catalog, made, f"trial {number}")
        job = Engine(self.catalog).in_memory_job(made)
        return TrialWork(number, job, subject.config_folder, subject.tokenizers,
                         tuple(self.terms.work(i) for i in missing), self.spec.settings, bars if 0 in missing else {},
                         self.threads)

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
            store_scores(self.catalog, subject, digest, name, result.scores, tokens=result.tokens,
                         seconds=result.seconds, task=term.task is not None)

    def _finish(self, study: Any, trial: Any, made: Plan, stored: dict[int, float], outcome: TrialOutcome | None
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


def _rerank(catalog: Catalog, spec: SearchSpec, optuna: Any, study: Any, rounds: _Rounds,
            reporter: Reporter) -> tuple[Any, dict[int, float]]:
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
        catalog.url, engine_kwargs={"connect_args": {"timeout": 60}} if not catalog.shared else {})
    complete = optuna.trial.TrialState.COMPLETE
    try:  # what Optuna raises on a study's rows it cannot read back (edited or damaged)
        try:
            study = (optuna.load_study(study_name=spec.study, storage=storage, sampler=_sampler(optuna, spec, 0))
                     if resume else optuna.create_study(study_name=spec.study, storage=storage,
                                                        sampler=_sampler(optuna, spec, 0), direction="minimize"))
        except optuna.exceptions.DuplicatedStudyError:
            raise ConfigError(f"study '{spec.study}' exists in {catalog.path}: --resume continues it, or name "
                              "another study (study: in the search file)") from None
        except KeyError:
            raise ConfigError(f"--resume: no study '{spec.study}' in {catalog.path} to continue") from None
        if any(t.state == complete and t.value is None for t in study.get_trials(deepcopy=False)):
            raise ValueError("a complete trial has no value")
    except (LookupError, ValueError, TypeError, AssertionError) as exc:
        raise ConfigError(f"study '{spec.study}' in {catalog.path} is damaged: its stored trials cannot be read "
                          f"({exc!r}); delete it (optuna delete-study) or name another study (study: in the "
                          "search file)") from None
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
    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,
                                                    optuna.trial.TrialState.PRUNED))


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
    return Trial(trial.number, state, dict(trial.params), trial.value if state == "complete" else None,
                 trial.value if state == "pruned" else None, trial.user_attrs.get("plan_digest"),
                 trial.user_attrs.get("expert_bytes"), trial.user_attrs.get("seconds"))


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
