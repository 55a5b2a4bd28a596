"""`mergepipe eval`, and the one runner of every evaluation (eval, bisect's probes, search's trials).

What is evaluated (a ``Subject``) is keyed by content: a merge by its plan digest (a plan evaluated in
memory and its snapshot share results), any other model by its content fingerprint. Results are stored
per (subject, data digest, metric) and found again unless asked ``again``.
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import load_file

from mergepipe import __version__
from mergepipe.analysis.analyze import analyze
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.app.views import find_snapshot
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import EvaluationRecord
from mergepipe.engine import DEFAULT_MAX_MEMORY
from mergepipe.engine.engine import Engine, Limits, compute_device, run_in_memory
from mergepipe.engine.stream import LocalExecutor
from mergepipe.engine.job import Job
from mergepipe.engine.ray_executor import ray_runtime, task_result
from mergepipe.errors import CatalogError, ConfigError, PlanError
from mergepipe.evaluation import LOSS, PERPLEXITY, EvalData, EvalSettings, Scores, build_model, harness
from mergepipe.evaluation import load_data, load_tokenizer, run_tasks, score, tasks_digest, transformers_module
from mergepipe.runtime import compute_threads
from mergepipe.sizes import parse_size
from mergepipe.spec.plan import Plan
from mergepipe.storage.checkpoint import MANIFEST_FILE, open_checkpoint
from mergepipe.storage.location import RemotePath, location


@dataclass(frozen=True)
class Subject:
    """What an evaluation is of: ``key`` (a plan digest, or a content fingerprint), its name, where its weights
    are (``folder``, else ``plan`` merged in memory), its config and where its tokenizer is looked for."""

    key: str
    kind: str  # "plan" | "model" | "hybrid"
    name: str
    folder: Path | None
    plan: Plan | None
    config_folder: Path
    tokenizers: tuple[Path, ...]  # its own folder, then its base's


@dataclass(frozen=True)
class Term:
    """What a model is scored on: held-out ``data`` (its loss), or lm-eval ``tasks``; ``digest`` keys the
    results, ``name`` names them."""

    digest: str
    name: str
    data: EvalData | None = None
    tasks: tuple[str, ...] = ()
    include: tuple[Path, ...] = ()
    limit: int | None = None

    def score(self, model: Any, tokenizer: Any, work: Work, on_batch: Callable[[float, int], None] | None) -> Scores:
        if self.data is not None:
            return score(model, tokenizer, self.data, work.settings, work.device, work.progress, on_batch)
        batch = work.settings.batch
        return run_tasks(model, tokenizer, self.tasks, self.include, self.limit, batch, work.device, work.progress)


def data_term(data: EvalData) -> Term:
    return Term(data.digest, data.name, data=data)


def tasks_term(tasks: Sequence[str], include: Sequence[Path], limit: int | None, settings: EvalSettings) -> Term:
    digest, name = tasks_digest(tasks, include, limit, settings)
    return Term(digest, name, tasks=tuple(tasks), include=tuple(include), limit=limit)


@dataclass(frozen=True)
class Evaluation:
    """One subject's scores on one term; ``stored``: found in the catalog, nothing computed."""

    subject: Subject
    data: Term
    scores: dict[str, float]
    tokens: int | None
    seconds: float
    stored: bool
    in_memory: bool

    @property
    def loss(self) -> float:
        return self.scores[LOSS]

    @property
    def perplexity(self) -> float:
        return self.scores.get(PERPLEXITY, math.nan)

    @property
    def name(self) -> str:
        return self.data.name

    def summary(self) -> dict[str, object]:
        common = {
            "target": self.subject.name,
            "subject": self.subject.key,
            "data_digest": self.data.digest,
            "seconds": round(self.seconds, 3),
            "stored": self.stored,
        }
        if self.data.data is None:
            return {**common, "tasks": self.name, "scores": self.scores}
        return {
            **common,
            "data": self.name,
            "loss": self.loss,
            "perplexity": self.perplexity,
            "tokens": self.tokens,
            "in_memory": self.in_memory,
        }


def evaluate(
    db: Catalogish,
    target: str,
    data: Sequence[str | Path],
    *,
    settings: EvalSettings | None = None,
    device: str = "cpu",
    again: bool = False,
    progress: bool = False,
    reporter: Reporter = SILENT,
) -> Evaluation:
    """``target``'s mean token loss on ``data`` (a snapshot, merged model, folder, registered model or plan)."""
    settings = settings or EvalSettings()
    term = data_term(load_data(data, settings))
    return _evaluate(db, target, term, settings, device, again, progress, reporter)


def evaluate_tasks(  # noqa: PLR0913 - keyword-only options, as the command's flags
    db: Catalogish,
    target: str,
    tasks: Sequence[str],
    *,
    include: Sequence[Path] = (),
    limit: int | None = None,
    batch: int = EvalSettings.batch,
    tokenizer: str | None = None,
    device: str = "cpu",
    again: bool = False,
    progress: bool = False,
    reporter: Reporter = SILENT,
) -> Evaluation:
    """``target``'s lm-evaluation-harness scores on ``tasks``, stored like a loss."""
    if not tasks:
        raise ConfigError("give the lm-eval tasks: --tasks NAME[,NAME]")
    settings = EvalSettings(batch=batch, tokenizer=tokenizer)
    term = tasks_term(tasks, include, limit, settings)
    return _evaluate(db, target, term, settings, device, again, progress, reporter)


def _evaluate(  # noqa: PLR0913
    db: Catalogish,
    target: str,
    term: Term,
    settings: EvalSettings,
    device: str,
    again: bool,
    progress: bool,
    reporter: Reporter,
) -> Evaluation:
    compute_device(device)  # an unusable device is refused before anything is read
    with open_catalog(db, writing=True, reporter=reporter) as catalog:
        subject = resolve_subject(catalog, target)
        return evaluate_subject(catalog, subject, term, settings, device=device, again=again, progress=progress)


def evaluate_subject(  # noqa: PLR0913 - keyword-only options
    catalog: Catalog,
    subject: Subject,
    term: Term,
    settings: EvalSettings,
    *,
    device: str = "cpu",
    again: bool = False,
    progress: bool = False,
    tensors: Callable[[], Mapping[str, torch.Tensor]] | None = None,
) -> Evaluation:
    """``subject``'s scores on ``term``: stored, or computed and stored. ``tensors`` gives its weights when
    they are needed (bisect's tensor probes)."""
    found = None if again else stored(catalog, subject.key, term)
    if found is not None:
        return Evaluation(subject, term, found.values, found.tokens, found.seconds, True, False)
    work = work_for(catalog, subject, (term,), settings, device=device, progress=progress)
    scores = run(work, None if tensors is None else tensors()).scores[0]
    store(catalog, subject, term, scores, device)
    in_memory = tensors is not None or subject.folder is None
    return Evaluation(subject, term, scores.values, scores.tokens, scores.seconds, False, in_memory)


def resolve_subject(catalog: Catalog, target: str) -> Subject:
    """The subject ``target`` names: a folder, snapshot (id or prefix), merged or registered model, or a
    plan (merged in memory); PlanError naming what it could be."""
    path = Path(target)
    if path.is_dir():
        return _folder_subject(catalog, path)
    record, model = find_snapshot(catalog, target)
    if record is not None and record.status == "committed":
        return merge_subject(catalog, Plan.from_json(catalog.plans.get(record.plan_id)), target, Path(record.out_path))
    if model is not None:
        root = location(model.uri)
        if isinstance(root, RemotePath):
            raise ConfigError(f"model '{model.id}' is at {model.uri}: evaluate a local copy (a folder) instead")
        return Subject(_content_key(catalog, model.id), "model", model.id, root, None, root, (root,))
    plan_id = catalog.plans.find(target)  # an ambiguous prefix raises
    if plan_id is None:
        raise PlanError(
            f"'{target}' is not a snapshot, model, plan or folder of {catalog.path}; list them with "
            "`mergepipe snapshots`, `mergepipe models` and `mergepipe plan --save`"
        )
    made = Plan.from_json(catalog.plans.get(plan_id))
    done = catalog.snapshots.committed_for_plan(made.digest)
    return merge_subject(catalog, made, target, None if done is None else Path(done.out_path))


def merge_subject(catalog: Catalog, made: Plan, name: str, folder: Path | None = None) -> Subject:
    """A merge as a subject: read from ``folder`` while it holds the snapshot, else merged in memory (its
    config and tokenizer then the base's, which must be local)."""
    folder = folder if folder is not None and (folder / MANIFEST_FILE).is_file() else None
    base = catalog.models.get(made.base.id)
    root = location(base.uri)
    config_folder = folder if folder is not None else root
    if isinstance(config_folder, RemotePath):
        raise ConfigError(
            f"the base '{base.id}' is at {base.uri}: evaluating a merge in memory needs its config "
            "and tokenizer in a local folder; execute the plan and evaluate the snapshot"
        )
    tokenizers = (config_folder,) if isinstance(root, RemotePath) else (config_folder, root)
    return Subject(made.digest, "plan", name, folder, made, config_folder, tokenizers)


def _folder_subject(catalog: Catalog, path: Path) -> Subject:
    manifest = path / MANIFEST_FILE
    if manifest.is_file():
        try:
            digest = json.loads(manifest.read_text())["plan_digest"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{manifest}: not a MergePipe manifest (no plan_digest)") from None
        plan_id = catalog.plans.find(digest)
        if plan_id is None:
            raise ConfigError(
                f"{path} was merged with another catalog (plan {digest[:12]} is not in "
                f"{catalog.path}); give that catalog with --db"
            )
        return merge_subject(catalog, Plan.from_json(catalog.plans.get(plan_id)), str(path), path)
    resolved = path.resolve()
    for model in catalog.models.list():
        if not isinstance(location(model.uri), RemotePath) and Path(model.uri).resolve() == resolved:
            return Subject(_content_key(catalog, model.id), "model", model.id, path, None, path, (path,))
    raise ConfigError(
        f"{path} is no snapshot and no registered model of {catalog.path}; register it first "
        f"(`mergepipe register --model-id NAME --uri {path}`), so its result has an identity"
    )


def _content_key(catalog: Catalog, model_id: str) -> str:
    """A registered model's content fingerprint (its blocks hashed first if they were not)."""
    try:
        return catalog.blocks.content_fingerprint(model_id)
    except CatalogError:
        analyze(catalog, [model_id], progress=False)
        return catalog.blocks.content_fingerprint(model_id)


def stored(catalog: Catalog, key: str, term: Term) -> Scores | None:
    """The scores the catalog holds for subject ``key`` on ``term``, or None."""
    rows = catalog.evaluations.get(key, term.digest)
    values = {r.metric: r.value for r in rows}
    if not rows or (term.data is not None and LOSS not in values):
        return None
    row = next((r for r in rows if r.metric == LOSS), rows[0])
    return Scores(values, row.tokens, row.seconds)


def store(catalog: Catalog, subject: Subject, term: Term, scores: Scores, device: str = "cpu") -> None:
    """One row per metric, measured now, replacing what the catalog held for them."""
    versions = {
        "mergepipe": __version__,
        "torch": torch.__version__,
        "transformers": transformers_module().__version__,
        "python": platform.python_version(),
    }
    if term.data is None:
        versions["lm_eval"] = harness().__version__
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    rows = [
        EvaluationRecord(
            subject=subject.key,
            subject_kind=subject.kind,
            data_digest=term.digest,
            data_name=term.name,
            metric=metric,
            value=value,
            tokens=scores.tokens,
            versions=versions,
            device=device,
            seconds=scores.seconds,
            created_at=now,
        )
        for metric, value in scores.values.items()
    ]
    catalog.evaluations.add(rows)


# ---------------------------------------------------------------------- the runner


@dataclass(frozen=True)
class Work:
    """One evaluation as plain data (a Ray worker can be sent it): its weights (a merge run in memory, a
    folder's files, or None: given to ``run``), config and tokenizer folders, terms, and ``prune(step,
    running loss of the first term)``, which stops it (a search's pruner)."""

    weights: Job | Path | None
    config_folder: Path
    tokenizers: tuple[Path, ...]
    terms: tuple[Term, ...]
    settings: EvalSettings
    device: str = "cpu"
    threads: int | None = None  # compute threads (None: torch's default)
    progress: bool = False
    prune: Callable[[int, float], bool] | None = None


@dataclass(frozen=True)
class Outcome:
    scores: tuple[Scores, ...]  # of the terms, in order, up to where it was pruned
    steps: tuple[float, ...]  # the first term's running loss after each batch
    pruned: bool
    seconds: float


class _Pruned(Exception):
    pass


def work_for(
    catalog: Catalog, subject: Subject, terms: tuple[Term, ...], settings: EvalSettings, **options: Any
) -> Work:
    """The work of evaluating ``subject`` on ``terms`` (``options``: ``Work``'s own)."""
    weights = subject.folder or (None if subject.plan is None else Engine(catalog).in_memory_job(subject.plan))
    return Work(weights, subject.config_folder, subject.tokenizers, terms, settings, **options)


def run(
    work: Work, tensors: Mapping[str, torch.Tensor] | None = None, tokenizers: dict[Any, Any] | None = None
) -> Outcome:
    """Build the model once and score each term in order, until pruned. ``tensors``: the weights, when
    ``work`` has none; ``tokenizers``: loaded ones to reuse."""
    started = time.perf_counter()
    tokenizers = {} if tokenizers is None else tokenizers
    key = (work.settings.tokenizer, work.tokenizers)
    if key not in tokenizers:  # first: a missing tokenizer is refused before any merge
        tokenizers[key] = load_tokenizer(work.tokenizers, work.settings.tokenizer)
    steps: list[float] = []
    done: list[Scores] = []

    prune = work.prune

    def on_batch(loss: float, step: int) -> None:
        steps.append(loss)
        if prune is not None and prune(step, loss):
            raise _Pruned

    with compute_threads(work.threads) if work.threads is not None else nullcontext():
        model = build_model(work.config_folder, _weights(work) if tensors is None else tensors, work.device)
        try:
            for i, term in enumerate(work.terms):
                done.append(term.score(model, tokenizers[key], work, on_batch if i == 0 and prune else None))
        except _Pruned:
            return Outcome(tuple(done), tuple(steps), True, time.perf_counter() - started)
    return Outcome(tuple(done), tuple(steps), False, time.perf_counter() - started)


def subject_tensors(catalog: Catalog, subject: Subject, progress: bool = False) -> dict[str, torch.Tensor]:
    """The subject's weights: read from its folder, or its plan merged in memory."""
    return _weights(work_for(catalog, subject, (), EvalSettings(), progress=progress))


def _weights(work: Work) -> dict[str, torch.Tensor]:
    if isinstance(work.weights, Path):
        files = open_checkpoint(work.weights).files
        return {name: tensor for file in files for name, tensor in load_file(str(file.path)).items()}
    if work.weights is None:
        raise ConfigError("an evaluation without weights")  # a probe's are given to run
    limits = Limits(None, parse_size(DEFAULT_MAX_MEMORY), threads=work.threads, progress=work.progress)
    held = run_in_memory(work.weights, LocalExecutor(), limits)
    return {name: tensor for file in held.values() for name, tensor in file.items()}


class LocalRunner:
    """Evaluations one after another in this process, tokenizers kept between them."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = workers
        self._tokenizers: dict[Any, Any] = {}

    def run(self, works: Sequence[Work]) -> list[Outcome]:
        return [run(work, tokenizers=self._tokenizers) for work in works]


class RayRunner:
    """Evaluations at once, one per Ray actor (``workers`` actors of ``threads`` cores each)."""

    def __init__(self, ray: ModuleType, workers: int, threads: int) -> None:
        self.workers, self._ray = workers, ray
        self.actors = [ray.remote(num_cpus=threads)(LocalRunner).remote() for _ in range(workers)]

    def run(self, works: Sequence[Work]) -> list[Outcome]:
        refs = [self.actors[i % self.workers].run.remote([work]) for i, work in enumerate(works)]
        failed = "run the search with --executor local for its traceback"
        lost = "check the workers' memory and logs (`ray logs`), or run with fewer --workers"
        return [task_result(self._ray, ref, "a trial", failed=failed, died="died", lost=lost)[0] for ref in refs]


@contextmanager
def runner(
    executor: str, workers: int | None, threads: int | None, address: str | None = None
) -> Iterator[LocalRunner | RayRunner]:
    """Where evaluations run: here (``workers`` per round, default 1), or on Ray (default: the cluster's cores
    over ``threads``). A failure or Ctrl-C kills the Ray actors, and their work with them (no ``ray.cancel``:
    a cancel that races a task's completion aborts this process inside Ray)."""
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    if executor == "local":
        if address is not None:
            raise ConfigError("--ray-address needs --executor ray")
        yield LocalRunner(workers or 1)
        return
    cores = threads or 1
    with ray_runtime(address, None if workers is None else workers * cores) as ray:
        found = RayRunner(ray, workers or max(1, int(ray.cluster_resources().get("CPU", 1)) // cores), cores)
        try:
            yield found
        finally:
            for actor in found.actors:
                ray.kill(actor)
