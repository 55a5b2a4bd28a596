"""`mergepipe search SEARCH.yml`: the merge parameters that score best, each trial a budgeted merge evaluated
in memory (here or on Ray); Optuna's study kept in the catalog's database, the best published at the final budget."""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import import_module
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mergepipe.app.evaluating import Outcome, data_term, merge_subject, runner, store, stored, tasks_term
from mergepipe.app.evaluating import LOSS, EvalSettings, Work, load_data, work_for
from mergepipe.app.integration import read_yaml_model
from mergepipe.app.merging import Execution, Merged, merge
from mergepipe.app.planning import make_plan
from mergepipe.app.reports import params_text, render
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import SearchRecord
from mergepipe.errors import ConfigError
from mergepipe.runtime import count_progress
from mergepipe.spec.operators import canonical_name, get_operator
from mergepipe.spec.plan import Plan
from mergepipe.spec.request import Budget, BudgetField, MergeRequest, parse_budget
from mergepipe.txn.outpath import writable_file, write_report

INSTALL_HINT = "pip install 'mergepipe[search]'"
#: Trials re-evaluated at the final budget before one is published (when it differs from the search's).
FINALISTS = 3
#: Optuna's ``MedianPruner``: trials complete before any is pruned, and the first batch one may be pruned at.
STARTUP_TRIALS, WARMUP_STEPS = 5, 1

Range = tuple[float, float]


def _reference(value: Any, folder: Path) -> Any:
    """A folder relative to the search file made absolute; an id or URI as written."""
    if not isinstance(value, str):
        return value
    candidate = Path(value).expanduser()
    candidate = candidate if candidate.is_absolute() else folder / candidate
    return str(candidate) if candidate.is_dir() else value


class Objective(BaseModel):
    """One term of the objective: a held-out file's loss (``data``, minimised) or a task's ``metric`` (maximised)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data: Path | None = None
    task: str | None = Field(None, min_length=1)
    metric: str = Field("acc", min_length=1)
    include: Path | None = None
    limit: int | None = Field(None, ge=1, strict=True)
    weight: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _one_kind(self) -> Objective:
        if (self.data is None) == (self.task is None):
            raise ConfigError("objective: each term names either data (a held-out file) or task (an lm-eval task)")
        if self.data is not None and (self.include is not None or self.limit is not None):
            raise ConfigError("objective: include and limit go with a task, not with data")
        return self

    @property
    def name(self) -> str:
        return f"{self.task}/{self.metric}"


class SearchFile(MergeRequest):
    """A search file: the merge request every trial shares, the space its trials search, objective and study."""

    what: ClassVar[str] = ""

    path: Path
    experts: tuple[str, ...] = Field(min_length=1)
    budget: BudgetField = Field(default_factory=lambda: parse_budget("25%"))
    operators: tuple[str, ...] = Field(min_length=1)
    weight: Range | dict[str, Range] = (0.0, 1.0)
    density: Range | None = None
    lambda_: Range | None = Field(None, alias="lambda")
    layer_groups: int = Field(1, ge=1, le=64, strict=True)
    final_budget: BudgetField = Field(default_factory=lambda: parse_budget("100%"))
    objective: tuple[Objective, ...] = Field(min_length=1)
    max_tokens: int = Field(EvalSettings.max_tokens, ge=2, strict=True)
    batch: int = Field(EvalSettings.batch, ge=1, strict=True)
    tokenizer: str | None = Field(None, min_length=1)
    sampler: Literal["tpe", "cmaes"] = "tpe"
    trials: int = Field(20, ge=1, strict=True)
    study: str | None = Field(None, min_length=1, max_length=200)

    @model_validator(mode="before")
    @classmethod
    def _relative(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("path"), Path):
            return data
        here, out = data["path"].parent, dict(data)
        for key in ("base", "tokenizer"):
            out[key] = _reference(data.get(key), here)
        if isinstance(data.get("experts"), list):
            out["experts"] = [_reference(e, here) for e in data["experts"]]
        if isinstance(data.get("weight"), dict):
            out["weight"] = {_reference(k, here): v for k, v in data["weight"].items()}
        return out

    @field_validator("operators")
    @classmethod
    def _operators(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(canonical_name(name) for name in value)

    @model_validator(mode="after")
    def _ranges(self) -> SearchFile:
        if isinstance(self.weight, dict) and set(self.weight) != set(self.experts):
            unknown = sorted(set(self.weight) - set(self.experts))
            missing = sorted(set(self.experts) - set(self.weight))
            raise ConfigError(
                f"weight: unknown expert {unknown[0]}" if unknown else f"weight: no range for {missing[0]}"
            )
        ranges = [(f"weight of {e}", r) for e, r in self.ranges.items()]
        for name, value in [*ranges, ("density", self.density), ("lambda", self.lambda_)]:
            if value is not None and not math.isfinite(value[1] - value[0]):  # what Optuna's samplers draw in
                raise ConfigError(
                    f"{name}: the range [{value[0]}, {value[1]}] is not finite; give finite bounds less than "
                    "1.7e308 apart"
                )
            if value is not None and not value[0] <= value[1]:
                raise ConfigError(f"{name}: the range [{value[0]}, {value[1]}] is empty (low > high)")
        if self.density is not None and not 0 < self.density[0] <= self.density[1] <= 1:
            raise ConfigError(f"density must lie in (0, 1], got {list(self.density)}")
        for o in self.objective:
            if o.data is not None and not self.here(o.data).is_file():
                raise ConfigError(f"objective data {o.data}: no such file")
            if o.include is not None and not self.here(o.include).is_dir():
                raise ConfigError(f"objective include {o.include}: no such folder")
        return self

    def here(self, path: Path) -> Path:
        return self.path.parent / path.expanduser()

    @property
    def study_name(self) -> str:
        return self.study or self.path.stem

    @property
    def ranges(self) -> dict[str, Range]:
        return {e: self.weight[e] if isinstance(self.weight, dict) else self.weight for e in self.experts}

    @property
    def names(self) -> tuple[str, ...]:
        """Each expert as trial parameters name it: a folder's name, else as written."""
        names = tuple(Path(e).name if Path(e).is_absolute() else e for e in self.experts)
        return names if len(set(names)) == len(names) else self.experts

    def takes(self, operator: str, parameter: str) -> bool:
        op = get_operator(operator)
        return any(d.name == parameter for d in (*op.global_params.definitions(), *op.expert_params.definitions()))


def load_search(path: str | Path) -> SearchFile:
    return read_yaml_model(SearchFile, path, f"search file {path}")


@dataclass(frozen=True)
class Trial:
    """One trial as the search reports it; a pruned one's ``partial_loss``: its running loss where it stopped."""

    number: int
    state: str  # "complete" | "pruned" | "failed"
    params: dict[str, Any]
    objective: float | None
    partial_loss: float | None
    plan_digest: str | None
    expert_bytes: int | None
    seconds: float | None

    @classmethod
    def of(cls, trial: Any) -> Trial:
        state = {"COMPLETE": "complete", "PRUNED": "pruned"}.get(trial.state.name, "failed")
        objective = trial.value if state == "complete" else None
        partial = trial.value if state == "pruned" else None
        attrs = trial.user_attrs
        digest, size, seconds = attrs.get("plan_digest"), attrs.get("expert_bytes"), attrs.get("seconds")
        return cls(trial.number, state, dict(trial.params), objective, partial, digest, size, seconds)

    def text(self) -> str:
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
        published = self.published
        return {
            "study": self.study,
            "trials": [vars(t) for t in self.trials],
            "best": None if self.best is None else vars(self.best),
            "finalists": self.finalists,
            "published": None
            if published is None
            else {"snapshot_id": published.snapshot_id, "model_id": published.model_id, "out": str(published.out)},
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
    """Run (``resume``: continue) the study of the search file at ``path``; publish the best at ``out`` if given."""
    spec = load_search(path)
    if tokenizer is not None:
        spec = spec.model_copy(update={"tokenizer": tokenizer})
    total = trials if trials is not None else spec.trials
    if total < 1:
        raise ConfigError(f"--trials must be at least 1, got {total}")
    optuna = _optuna(spec.sampler)
    with (
        open_catalog(db, writing=True, out=out, reporter=reporter) as catalog,
        runner(executor, workers, threads, ray_address) as pool,
    ):
        page = None if html is None else writable_file(catalog, html, force, "--html")
        study = _study(optuna, catalog, spec, resume)
        searcher = _Trials(catalog, spec, optuna, study, pool, threads, progress)
        left = total - len(searcher.ran())
        try:
            with count_progress("search", max(left, 0), "trials", progress) as advance:
                while left > 0:
                    for trial in searcher.round(min(pool.workers, left)):
                        advance(1)
                        best = searcher.best()
                        reporter.note(
                            f"trial {trial.number}: {Trial.of(trial).text()} ({params_text(trial.params)})"
                            + ("" if best is None else f"; best {best.value:.4f} (trial {best.number})")
                        )
                    left = total - len(searcher.ran())
        except BaseException:  # a new study none of whose trials ran is dropped: the command runs again as typed
            if not resume and not searcher.ran():
                optuna.delete_study(study_name=spec.study_name, storage=catalog.url)
            raise
        result = SearchResult(spec.study_name, [Trial.of(t) for t in study.trials])
        best = searcher.best()
        if best is None:
            raise ConfigError(f"study {spec.study_name}: no trial completed, so there is no best merge to publish")
        if spec.final_budget != spec.budget:
            best, result.finalists = searcher.rerank(reporter)
        result.best = Trial.of(best)
        if out is not None:
            result.published = searcher.publish(best, out, model_id, reporter)
    if page is not None:
        importances = _importances(optuna, study)
        write_report(
            page,
            render(
                "search",
                title="MergePipe search",
                subtitle=spec.study_name,
                s=result.summary(),
                importances=importances,
            ),
        )
    return result


def trial_request(
    spec: SearchFile, params: dict[str, Any], budget: Budget, model_id: str | None = None
) -> MergeRequest:
    """The merge request a trial's parameters stand for at ``budget`` (layer groups: gradients over layers)."""
    groups = range(spec.layer_groups)
    settings: dict[str, Any] = {"lambda": params["lambda"]} if "lambda" in params else {}
    update = {"operator": params.get("operator", spec.operators[0]), "budget": budget, "model_id": model_id}
    experts = list(zip(spec.experts, spec.names))
    if spec.layer_groups == 1:
        if "density" in params:
            settings["density"] = params["density"]
        weights = tuple(float(params.get(f"weight {n}", spec.ranges[e][0])) for e, n in experts)
        return MergeRequest(**_request_fields(spec), **update, weights=weights, params=settings)
    if any(f"density group {g}" in params for g in groups):
        settings["density"] = [float(params[f"density group {g}"]) for g in groups]
    per_expert = {
        e: {"weight": [float(params.get(f"weight {n} group {g}", spec.ranges[e][0])) for g in groups]}
        for e, n in experts
    }
    return MergeRequest(**_request_fields(spec), **update, params=settings, expert_params=per_expert)


def _request_fields(spec: SearchFile) -> dict[str, Any]:
    return {"base": spec.base, "experts": spec.experts, "policy": spec.policy, "seed": spec.seed}


def propose(trial: Any, spec: SearchFile) -> dict[str, Any]:
    """A trial's parameters, suggested in a fixed order (a fixed range is not suggested)."""
    params: dict[str, Any] = {}
    operators = list(spec.operators)
    operator = trial.suggest_categorical("operator", operators) if len(operators) > 1 else operators[0]
    groups = [""] if spec.layer_groups == 1 else [f" group {g}" for g in range(spec.layer_groups)]
    for (low, high), name in zip(spec.ranges.values(), spec.names):
        for group in groups:
            if low != high:
                params[f"weight {name}{group}"] = trial.suggest_float(f"weight {name}{group}", low, high)
    for key, bounds, grouped in (("density", spec.density, True), ("lambda", spec.lambda_, False)):
        if bounds is not None and spec.takes(operator, key):
            low, high = bounds
            for group in groups if grouped else [""]:
                name = f"{key}{group}"
                params[name] = low if low == high else trial.suggest_float(name, low, high)
    return {**params, "operator": operator}


@dataclass
class _Pruner:
    """Optuna's median pruner over the trials complete before a round, as plain data (a Ray worker runs it)."""

    finished: list[Any]  # optuna FrozenTrials
    weight: float

    @functools.cached_property
    def _trial(self) -> Any:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        mirror = optuna.create_study(pruner=optuna.pruners.MedianPruner(STARTUP_TRIALS, WARMUP_STEPS))
        mirror.add_trials(self.finished)
        return mirror.ask()

    def __call__(self, step: int, loss: float) -> bool:
        self._trial.report(loss * self.weight, step)
        return bool(self._trial.should_prune())


@dataclass
class _Trials:
    """A search's trials: proposed in rounds, planned here, run on the pool, told to the study, scores stored."""

    catalog: Catalog
    spec: SearchFile
    optuna: Any
    study: Any
    pool: Any
    threads: int | None
    progress: bool

    def __post_init__(self) -> None:
        spec, self.settings = self.spec, EvalSettings(self.spec.max_tokens, self.spec.batch, self.spec.tokenizer)
        self.terms = [
            data_term(load_data([spec.here(o.data)], self.settings))
            if o.data is not None
            else tasks_term([str(o.task)], [] if o.include is None else [spec.here(o.include)], o.limit, self.settings)
            for o in spec.objective
        ]

    def round(self, count: int) -> list[Any]:
        """``count`` trials asked together, then planned, run and told; interrupted, the rest are told failed."""
        states = self.optuna.trial.TrialState
        pruner = _Pruner(
            self.study.get_trials(deepcopy=False, states=(states.COMPLETE,)), self.spec.objective[0].weight
        )
        asked = [self.study.ask() for _ in range(count)]
        try:
            made = [self.plan(propose(trial, self.spec), self.spec.budget, trial) for trial in asked]
            for trial, (values, outcome) in zip(asked, self.evaluate(made, pruner)):
                for step, loss in enumerate(() if outcome is None else outcome.steps, start=1):
                    trial.report(loss * pruner.weight, step)
                seconds = trial.user_attrs["plan_seconds"] + (0.0 if outcome is None else outcome.seconds)
                trial.set_user_attr("seconds", seconds)
                if outcome is not None and outcome.pruned:
                    self.study.tell(trial, state=states.PRUNED)
                else:
                    self.study.tell(trial, self.objective(values))
        except BaseException:
            for trial in asked:
                self.study.tell(trial, state=states.FAIL, skip_if_finished=True)
            raise
        return [self.study.trials[t.number] for t in asked]

    def plan(self, params: dict[str, Any], budget: Budget, trial: Any = None) -> Plan:
        started = time.perf_counter()
        made = make_plan(self.catalog, trial_request(self.spec, params, budget), progress=self.progress)
        if trial is not None:
            trial.set_user_attr("plan_digest", made.digest)
            trial.set_user_attr("expert_bytes", made.cost.expert_bytes)
            trial.set_user_attr("plan_seconds", time.perf_counter() - started)
        return made

    def evaluate(self, made: list[Plan], pruner: _Pruner | None) -> list[tuple[dict[int, float], Outcome | None]]:
        """Each plan's term values: stored ones, the others computed on the pool (the first term pruned) and stored."""
        found = [{i: stored(self.catalog, m.digest, term) for i, term in enumerate(self.terms)} for m in made]
        works: list[Work | None] = []
        for plan, known in zip(made, found):
            missing = tuple(term for i, term in enumerate(self.terms) if known[i] is None)
            if not missing:
                works.append(None)
                continue
            fresh = None if pruner is None else _Pruner(pruner.finished, pruner.weight)  # a mirror trial of its own
            prune = fresh if known[0] is None and self.terms[0].data is not None else None
            subject = merge_subject(self.catalog, plan, "trial")
            works.append(work_for(self.catalog, subject, missing, self.settings, threads=self.threads, prune=prune))
        outcomes = iter(self.pool.run([w for w in works if w is not None]))
        results = []
        for plan, known, work in zip(made, found, works):
            outcome = None if work is None else next(outcomes)
            for index, scores in zip(
                [i for i, s in known.items() if s is None], () if outcome is None else outcome.scores
            ):
                store(self.catalog, merge_subject(self.catalog, plan, "trial"), self.terms[index], scores)
                known[index] = scores
            results.append(({i: self.value(i, s.values) for i, s in known.items() if s is not None}, outcome))
        return results

    def value(self, index: int, scores: dict[str, float]) -> float:
        objective = self.spec.objective[index]
        if objective.data is not None:
            return scores[LOSS]
        if objective.name not in scores:
            reported = ", ".join(sorted(k.split("/", 1)[1] for k in scores)) or "none"
            raise ConfigError(
                f"lm-eval task {objective.task} reports no metric {objective.metric!r} (it reports {reported})"
            )
        return scores[objective.name]

    def objective(self, values: dict[int, float]) -> float:
        """Each term's value times its weight, summed; a task's score (maximised) negated."""
        return sum(
            (1.0 if o.data is not None else -1.0) * o.weight * values[i] for i, o in enumerate(self.spec.objective)
        )

    def rerank(self, reporter: Reporter) -> tuple[Any, dict[int, float]]:
        """The best of the ``FINALISTS`` best trials, each merged and evaluated at the final budget."""
        complete = self.study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.COMPLETE,))
        finalists = sorted(complete, key=lambda t: (t.value, t.number))[:FINALISTS]
        scores = {}
        for trial in finalists:
            made = self.plan({"operator": self.spec.operators[0], **trial.params}, self.spec.final_budget)
            scores[trial.number] = self.objective(self.evaluate([made], None)[0][0])
            reporter.note(
                f"trial {trial.number} at the final budget {self.spec.final_budget.text}: {scores[trial.number]:.4f}"
            )
        return min(finalists, key=lambda t: (scores[t.number], t.number)), scores

    def publish(self, best: Any, out: str | Path, model_id: str | None, reporter: Reporter) -> Merged:
        params = {"operator": self.spec.operators[0], **best.params}
        request = trial_request(self.spec, params, self.spec.final_budget, model_id)
        reporter.note(
            f"publishing trial {best.number} ({params_text(best.params)}) at budget {self.spec.final_budget.text}"
        )
        merged = merge(request, self.catalog, out, execution=Execution(), reporter=reporter)
        record = SearchRecord(
            snapshot_id=merged.snapshot_id,
            study=self.spec.study_name,
            trial=best.number,
            trials=len(self.ran()),
            objective=float(best.value),
            params=params,
            search_budget=self.spec.budget.text,
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
        self.catalog.searches.add(record)
        return merged

    def ran(self) -> list[Any]:
        """The trials that ran: complete or pruned."""
        states = self.optuna.trial.TrialState
        return self.study.get_trials(deepcopy=False, states=(states.COMPLETE, states.PRUNED))

    def best(self) -> Any:
        complete = self.study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.COMPLETE,))
        return min(complete, key=lambda t: (t.value, t.number)) if complete else None


def _optuna(sampler: str) -> Any:
    """Optuna (and cmaes for CMA-ES), or the one line naming the extra that installs them."""
    try:
        import optuna

        if sampler == "cmaes":
            import_module("cmaes")
    except ImportError as exc:
        raise ConfigError(f"search needs {exc.name or 'Optuna'}, which is not installed: {INSTALL_HINT}") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("optuna").setLevel(logging.WARNING)
    return optuna


def _study(optuna: Any, catalog: Catalog, spec: SearchFile, resume: bool) -> Any:
    """The study in the catalog's database, created or resumed (a killed run's trials told failed), seeded."""
    storage = optuna.storages.RDBStorage(
        catalog.url, engine_kwargs={"connect_args": {"timeout": 60}} if not catalog.shared else {}
    )
    try:  # what Optuna raises on a study's rows it cannot read back (edited or damaged)
        try:
            if resume:
                study = optuna.load_study(study_name=spec.study_name, storage=storage)
            else:
                study = optuna.create_study(study_name=spec.study_name, storage=storage, direction="minimize")
        except optuna.exceptions.DuplicatedStudyError:
            raise ConfigError(
                f"study '{spec.study_name}' exists in {catalog.path}: --resume continues it, or name "
                "another study (study: in the search file)"
            ) from None
        except KeyError:
            raise ConfigError(f"--resume: no study '{spec.study_name}' in {catalog.path} to continue") from None
        held = study.get_trials(deepcopy=False)
        if any(t.state == optuna.trial.TrialState.COMPLETE and t.value is None for t in held):
            raise ValueError("a complete trial has no value")
    except (LookupError, ValueError, TypeError, AssertionError) as exc:
        raise ConfigError(
            f"study '{spec.study_name}' in {catalog.path} is damaged: its stored trials cannot be read "
            f"({exc!r}); delete it (optuna delete-study) or name another study (study: in the "
            "search file)"
        ) from None
    seed = spec.seed + len(held)
    samplers = {"tpe": optuna.samplers.TPESampler, "cmaes": optuna.samplers.CmaEsSampler}
    study.sampler = samplers[spec.sampler](seed=seed)
    for trial in held:
        if trial.state == optuna.trial.TrialState.RUNNING:  # a killed run's
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
    return study


def _importances(optuna: Any, study: Any) -> dict[str, float]:
    """Parameter importances (fANOVA) once enough trials completed; empty otherwise."""
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(complete) < 4 or not any(t.params for t in complete):
        return {}
    try:
        return {k: float(v) for k, v in optuna.importance.get_param_importances(study).items()}
    except (RuntimeError, ValueError):  # too little variation to attribute
        return {}
