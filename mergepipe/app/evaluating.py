"""`mergepipe eval`: a model's loss on held-out data, computed once and kept in the catalog.

What is evaluated is named the ways the other commands name things: a
snapshot id or prefix, a merged model id (``name@N`` too), a snapshot's
output folder, a registered model, or a plan id that was never executed. A
merge is keyed by its plan digest (the same plan gives the same bytes, so a
plan evaluated in memory and its executed snapshot share one result); any
other model by its content fingerprint. A merge whose snapshot folder is
there is read from it; otherwise (a plan never executed, a snapshot removed)
it is merged in memory (``Engine.merge_in_memory``) and evaluated without
writing anything but the result. A result stored for the same subject and
data digest (``evaluation/data.py``) is returned as it is unless ``again``.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from mergepipe import __version__
from mergepipe.analysis.analyze import analyze
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import EvaluationRecord
from mergepipe.engine.engine import Engine, compute_device
from mergepipe.errors import CatalogError, ConfigError, PlanError, UnknownModelError
from mergepipe.evaluation.data import EvalData, EvalSettings, load_data
from mergepipe.evaluation.loss import harness, run_tasks, tasks_digest
from mergepipe.evaluation.loss import build_model, load_tokenizer, score, transformers_module
from mergepipe.spec.plan import Plan
from mergepipe.storage.checkpoint import MANIFEST_FILE, open_checkpoint
from mergepipe.storage.location import RemotePath, location

LOSS, PERPLEXITY = "loss", "perplexity"


@dataclass(frozen=True)
class Subject:
    """What one evaluation is of: ``key`` (a plan digest, or a model's content fingerprint), how to name it,
    and where its weights come from (a folder, else ``plan`` merged in memory)."""

    key: str
    kind: str  # "plan" | "model"
    name: str
    folder: Path | None
    plan: Plan | None
    config_folder: Path  # config.json
    tokenizers: tuple[Path, ...]  # where its tokenizer is looked for: its own folder, then its base's


@dataclass(frozen=True)
class Evaluation:
    """One target's results on one dataset; ``stored``: found in the catalog, nothing computed."""

    subject: Subject
    data: EvalData
    loss: float
    perplexity: float
    tokens: int
    seconds: float
    stored: bool
    in_memory: bool

    def summary(self) -> dict[str, object]:
        return {
            "target": self.subject.name,
            "subject": self.subject.key,
            "data": self.data.name,
            "data_digest": self.data.digest,
            "loss": self.loss,
            "perplexity": self.perplexity,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "stored": self.stored,
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
    """``target``'s mean token loss on ``data`` (module docstring)."""
    settings = settings or EvalSettings()
    loaded = load_data(data, settings)
    compute_device(device)  # an unusable device is refused before anything is read
    with open_catalog(db, writing=True, reporter=reporter) as catalog:
        subject = resolve_subject(catalog, target)
        return evaluate_subject(catalog, subject, loaded, settings, device=device, again=again, progress=progress)


def evaluate_subject(  # noqa: PLR0913 - keyword-only options
    catalog: Catalog,
    subject: Subject,
    data: EvalData,
    settings: EvalSettings,
    *,
    device: str = "cpu",
    again: bool = False,
    progress: bool = False,
    tensors: Callable[[], Mapping[str, torch.Tensor]] | None = None,
    on_batch: Callable[[float, int], None] | None = None,
) -> Evaluation:
    """``subject``'s loss on ``data``: the stored one, or computed and stored. ``tensors``: gives its weights
    when they are needed (bisect's tensor probes, assembled from two merges in memory)."""
    if not again:
        stored = {r.metric: r for r in catalog.evaluations.get(subject.key, data.digest)}
        if LOSS in stored:
            loss = stored[LOSS]
            return Evaluation(
                subject,
                data,
                loss.value,
                stored[PERPLEXITY].value if PERPLEXITY in stored else float("nan"),
                loss.tokens or 0,
                loss.seconds,
                stored=True,
                in_memory=False,
            )
    in_memory = tensors is not None or subject.folder is None
    weights = tensors() if tensors is not None else subject_tensors(catalog, subject, progress)
    model = build_model(subject.config_folder, weights, device)
    tokenizer = load_tokenizer(subject.tokenizers, settings.tokenizer)
    result = score(model, tokenizer, data, settings, device, progress, on_batch)
    del model, weights
    store_scores(
        catalog,
        subject,
        data.digest,
        data.name,
        {LOSS: result.loss, PERPLEXITY: result.perplexity},
        tokens=result.tokens,
        device=device,
        seconds=result.seconds,
    )
    return Evaluation(
        subject, data, result.loss, result.perplexity, result.tokens, result.seconds, stored=False, in_memory=in_memory
    )


@dataclass(frozen=True)
class TaskEvaluation:
    """One target's lm-eval scores (``TASK/METRIC`` -> value); ``stored``: found in the catalog."""

    subject: Subject
    name: str
    digest: str
    scores: dict[str, float]
    seconds: float
    stored: bool

    def summary(self) -> dict[str, object]:
        return {
            "target": self.subject.name,
            "subject": self.subject.key,
            "tasks": self.name,
            "data_digest": self.digest,
            "scores": self.scores,
            "seconds": round(self.seconds, 3),
            "stored": self.stored,
        }


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
) -> TaskEvaluation:
    """``target``'s lm-evaluation-harness scores on ``tasks`` (``evaluation/harness.py``), stored like a loss."""
    if not tasks:
        raise ConfigError("give the lm-eval tasks: --tasks NAME[,NAME]")
    settings = EvalSettings(batch=batch, tokenizer=tokenizer)
    digest, name = tasks_digest(tasks, include, limit, settings)
    compute_device(device)
    with open_catalog(db, writing=True, reporter=reporter) as catalog:
        subject = resolve_subject(catalog, target)
        stored = catalog.evaluations.get(subject.key, digest)
        if stored and not again:
            return TaskEvaluation(
                subject, name, digest, {r.metric: r.value for r in stored}, sum(r.seconds for r in stored), stored=True
            )
        started = time.perf_counter()
        model = build_model(subject.config_folder, subject_tensors(catalog, subject, progress), device)
        scores = run_tasks(
            model,
            load_tokenizer(subject.tokenizers, settings.tokenizer),
            tasks,
            include,
            limit=limit,
            batch=batch,
            device=device,
            progress=progress,
        )
        seconds = time.perf_counter() - started
        store_scores(catalog, subject, digest, name, scores, tokens=None, device=device, seconds=seconds, task=True)
        return TaskEvaluation(subject, name, digest, scores, seconds, stored=False)


def resolve_subject(catalog: Catalog, target: str) -> Subject:
    """The subject ``target`` names (module docstring), or one line saying what it could be."""
    path = Path(target)
    if path.is_dir():
        return _folder_subject(catalog, path)
    record = catalog.snapshots.find(target)  # an ambiguous prefix raises
    model = None
    if record is None:
        try:
            model = catalog.models.resolve(target)
        except UnknownModelError:
            model = None
        if model is not None:
            record = catalog.snapshots.of_model(model.id)
    if record is not None and record.status == "committed":
        made = Plan.from_json(catalog.plans.get(record.plan_id))
        folder = Path(record.out_path)
        return _merge_subject(catalog, made, target, folder if (folder / MANIFEST_FILE).is_file() else None)
    if model is not None:
        root = location(model.uri)
        if isinstance(root, RemotePath):
            raise ConfigError(f"model '{model.id}' is at {model.uri}: evaluate a local copy (a folder) instead")
        return Subject(_content_key(catalog, model.id), "model", model.id, Path(root), None, Path(root), (Path(root),))
    plan_id = catalog.plans.find(target)  # an ambiguous prefix raises
    if plan_id is None:
        raise PlanError(
            f"'{target}' is not a snapshot, model, plan or folder of {catalog.path}; list them with "
            "`mergepipe snapshots`, `mergepipe models` and `mergepipe plan --save`"
        )
    made = Plan.from_json(catalog.plans.get(plan_id))
    done = catalog.snapshots.committed_for_plan(made.digest)
    written = Path(done.out_path) if done is not None else None
    return _merge_subject(catalog, made, target, written if written and (written / MANIFEST_FILE).is_file() else None)


def merge_subject(catalog: Catalog, made: Plan, name: str) -> Subject:
    """A plan as a subject merged in memory (bisect's hybrids)."""
    return _merge_subject(catalog, made, name, None)


def subject_tensors(catalog: Catalog, subject: Subject, progress: bool = False) -> dict[str, torch.Tensor]:
    """The subject's weights: read from its folder, or its plan merged in memory."""
    if subject.folder is not None:
        from safetensors.torch import load_file

        checkpoint = open_checkpoint(subject.folder)
        return {name: tensor for file in checkpoint.files for name, tensor in load_file(str(file.path)).items()}
    assert subject.plan is not None
    held = Engine(catalog, progress=progress).merge_in_memory(subject.plan)
    return {name: tensor for tensors in held.values() for name, tensor in tensors.items()}


def _merge_subject(catalog: Catalog, made: Plan, name: str, folder: Path | None) -> Subject:
    base = catalog.models.get(made.base.id)
    root = location(base.uri)
    config_folder = folder if folder is not None else root
    if isinstance(config_folder, RemotePath):
        raise ConfigError(
            f"the base '{base.id}' is at {base.uri}: evaluating a merge in memory needs its config "
            "and tokenizer in a local folder; execute the plan and evaluate the snapshot"
        )
    tokenizers = (Path(config_folder),) if isinstance(root, RemotePath) else (Path(config_folder), Path(root))
    return Subject(made.digest, "plan", name, folder, made, Path(config_folder), tokenizers)


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
        return _merge_subject(catalog, Plan.from_json(catalog.plans.get(plan_id)), str(path), path)
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


def store_scores(  # noqa: PLR0913
    catalog: Catalog,
    subject: Subject,
    digest: str,
    name: str,
    scores: Mapping[str, float],
    *,
    tokens: int | None,
    seconds: float,
    task: bool = False,
    device: str = "cpu",
) -> None:
    """One row per metric of ``scores``, measured now (``task``: by lm-eval), replacing what the catalog held
    for them."""
    versions = {**_versions(), "lm_eval": harness().__version__} if task else _versions()
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    catalog.evaluations.add(
        [
            EvaluationRecord(
                subject=subject.key,
                subject_kind=subject.kind,
                data_digest=digest,
                data_name=name,
                metric=metric,
                value=value,
                tokens=tokens,
                versions=versions,
                device=device,
                seconds=seconds,
                created_at=now,
            )
            for metric, value in scores.items()
        ]
    )


def _versions() -> dict[str, str]:
    return {
        "mergepipe": __version__,
        "torch": torch.__version__,
        "transformers": transformers_module().__version__,
        "python": platform.python_version(),
    }
