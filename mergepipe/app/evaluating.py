"""`mergepipe eval` and the one runner of every evaluation (eval, bisect's probes, search's trials): held-out
data and its digest, the model and tokenizer, mean token loss, lm-eval tasks; results stored per (subject
keyed by content, data digest, metric)."""

from __future__ import annotations

import hashlib
import json
import logging
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
from mergepipe.runtime import compute_threads, count_progress
from mergepipe.sizes import parse_size
from mergepipe.spec.plan import Plan
from mergepipe.storage.checkpoint import MANIFEST_FILE, open_checkpoint
from mergepipe.storage.location import RemotePath, location


#: A data file larger than this is refused: evaluation data is a held-out sample, not a corpus.
MAX_DATA_BYTES = 256 * 1024 * 1024
INSTALL_HINT = "pip install 'mergepipe[eval]'"
LOSS, PERPLEXITY = "loss", "perplexity"
#: What the harness reports beside its metrics.
NOT_SCORES = {"alias", "sample_len", "samples"}


@dataclass(frozen=True)
class EvalSettings:
    """What changes a loss besides the model and the data."""

    max_tokens: int = 512  # tokens per sequence: longer examples are cut into windows of this many
    batch: int = 8  # sequences per forward pass (padding changes the last bits of a loss)
    tokenizer: str | None = None  # a folder or Hub id (None: the model's own files, else its base's)

    def __post_init__(self) -> None:
        if self.max_tokens < 2:
            raise ConfigError(f"--max-tokens must be at least 2, got {self.max_tokens}")
        if self.batch < 1:
            raise ConfigError(f"--batch must be at least 1, got {self.batch}")
        if self.tokenizer is not None and Path(self.tokenizer).expanduser().is_dir():  # keyed by where it is
            object.__setattr__(self, "tokenizer", str(Path(self.tokenizer).expanduser().resolve()))

    @property
    def tokenizer_key(self) -> str:
        return "" if self.tokenizer is None else f" tokenizer={self.tokenizer}"


@dataclass(frozen=True)
class EvalData:
    """The examples of one or more files, their name for tables and their digest (bytes and settings)."""

    name: str
    digest: str
    examples: tuple[tuple[str, str], ...]  # (prompt: context only, completion: scored)


@dataclass(frozen=True)
class Scores:
    """Metric -> value (loss and perplexity, or ``TASK/METRIC``), tokens scored (None for tasks), seconds."""

    values: dict[str, float]
    tokens: int | None
    seconds: float


def load_data(paths: Sequence[str | Path], settings: EvalSettings) -> EvalData:
    """The examples of ``paths`` (in order) and the digest of their bytes with ``settings``."""
    if not paths:
        raise ConfigError("give the evaluation data: --data FILE (plain text or JSONL)")
    digest = hashlib.sha256(
        f"mergepipe-eval-data/1 max_tokens={settings.max_tokens} batch={settings.batch}"
        f"{settings.tokenizer_key}".encode()
    )
    examples: list[tuple[str, str]] = []
    for raw in paths:
        path = Path(raw)
        data = _read(path)
        digest.update(len(data).to_bytes(8, "little") + data)
        examples.extend(_examples(path, data))
    if not examples:
        raise ConfigError(f"{', '.join(str(p) for p in paths)}: no text to evaluate")
    return EvalData(", ".join(Path(p).name for p in paths), digest.hexdigest(), tuple(examples))


def _read(path: Path) -> bytes:
    try:
        with path.open("rb") as stream:  # counted as read: stat() says 0 bytes for a pipe or /dev/zero
            data = stream.read(MAX_DATA_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such data file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory; give a text or JSONL file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror})") from None
    if len(data) > MAX_DATA_BYTES:
        raise ConfigError(f"{path}: more than {MAX_DATA_BYTES // 2**20} MiB; evaluation data is a held-out sample")
    return data


def _examples(path: Path, data: bytes) -> list[tuple[str, str]]:
    """Each paragraph of a text file; each line of a JSONL file (``.jsonl``, ``.ndjson``)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    if path.suffix.lower() not in (".jsonl", ".ndjson"):
        return [("", p.strip()) for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]
    examples = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc.msg})") from None
        except RecursionError:
            raise ConfigError(f"{path}:{number}: nested too deeply to read") from None
        except ValueError as exc:  # an integer of more than 4300 digits
            raise ConfigError(f"{path}:{number}: a value cannot be read ({str(exc).split(';')[0]})") from None
        if isinstance(row, dict) and isinstance(row.get("text"), str):
            examples.append(("", row["text"]))
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
            examples.append((row["prompt"], row["completion"]))
        else:
            raise ConfigError(f'{path}:{number}: each line needs a string "text", or "prompt" and "completion"')
        try:
            "".join(examples[-1]).encode()
        except UnicodeEncodeError as exc:
            raise ConfigError(f"{path}:{number}: {exc.object[exc.start]!r} is a lone surrogate, not text") from None
    return examples


def transformers_module() -> Any:
    """transformers, or the one line naming the extra that installs it."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"evaluation needs transformers: {INSTALL_HINT}") from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers


def build_model(folder: Path, tensors: Mapping[str, torch.Tensor], device: str = "cpu") -> Any:
    """The causal LM of ``folder``'s config with ``tensors`` as its weights (assigned, not copied, on CPU)."""
    transformers = transformers_module()
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{folder}: no usable config.json for evaluation ({str(exc).splitlines()[0]})") from None
    mapping = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
    if type(config) not in mapping:
        raise ConfigError(f"{folder}: transformers has no causal LM for model_type {config.model_type!r}")
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    model = mapping[type(config)].from_pretrained(None, config=config, state_dict=dict(tensors), dtype=dtype)
    return model.to(device).eval()


def load_tokenizer(folders: Sequence[Path], named: str | None = None) -> Any:
    """The tokenizer ``named`` (a folder or Hub id), else the first of ``folders`` with a vocabulary."""
    transformers = transformers_module()
    why = "it holds no tokenizer files"
    for source in (named,) if named is not None else dict.fromkeys(folders):
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as exc:
            why = why if Path(source).is_dir() else str(exc).splitlines()[0]  # a folder's: a list of no files
            continue
        if set(tokenizer.get_vocab()) - set(tokenizer.all_special_tokens):
            return tokenizer
    if named is not None:
        raise ConfigError(
            f"--tokenizer {named}: no tokenizer there ({why}); give a folder holding tokenizer files or a Hub model id"
        )
    raise ConfigError(
        f"{' or '.join(str(f) for f in dict.fromkeys(folders))}: no tokenizer files to tokenise the "
        "evaluation data; name one with --tokenizer PATH_OR_HUB_ID"
    )


def score(
    model: Any,
    tokenizer: Any,
    data: EvalData,
    settings: EvalSettings,
    device: str = "cpu",
    progress: bool = False,
    on_batch: Callable[[float, int], None] | None = None,
) -> Scores:
    """Mean token loss and perplexity of ``model`` on ``data``; ``on_batch(loss so far, batches done)``."""
    started = time.perf_counter()
    sequences = [s for prompt, text in data.examples for s in _windows(tokenizer, prompt, text, settings.max_tokens)]
    if not sequences:
        raise ConfigError(f"{data.name}: no token to score (every example is one token or its prompt only)")
    pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    total, tokens = 0.0, 0
    with torch.inference_mode(), count_progress("eval", len(sequences), "sequences", progress) as advance:
        for done, start in enumerate(range(0, len(sequences), settings.batch), start=1):
            batch = sequences[start : start + settings.batch]
            width = max(len(ids) for ids, _ in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            scored = torch.zeros((len(batch), width), dtype=torch.bool)
            for row, (seq, mask) in enumerate(batch):
                ids[row, : len(seq)] = torch.tensor(seq)
                attention[row, : len(seq)] = 1
                scored[row, : len(mask)] = torch.tensor(mask)
            logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits
            for row in range(len(batch)):  # one row's float32 log-softmax at a time: bounded memory
                targets = ids[row, 1:].to(device)
                keep = scored[row, 1:].to(device)
                logp = torch.log_softmax(logits[row, :-1].float(), dim=-1)
                nll = -logp.gather(1, targets.unsqueeze(1)).squeeze(1)
                total += float(nll[keep].double().sum())
                tokens += int(keep.sum())
            advance(len(batch))
            if on_batch is not None and tokens:
                on_batch(total / tokens, done)
    loss = total / tokens
    perplexity = math.exp(loss) if loss < 700 else math.inf
    return Scores({LOSS: loss, PERPLEXITY: perplexity}, tokens, time.perf_counter() - started)


def _windows(tokenizer: Any, prompt: str, text: str, max_tokens: int) -> Iterator[tuple[list[int], list[bool]]]:
    """(token ids, whether each is scored) per window: a text cut every ``max_tokens``; a prompt/completion's tail."""
    ids = list(tokenizer(prompt + text)["input_ids"])
    if prompt:
        context = len(tokenizer(prompt)["input_ids"])
        mask = [i >= context for i in range(len(ids))][-max_tokens:]
        mask[0] = False  # the first token of a window has no context in it
        if any(mask):
            yield ids[-max_tokens:], mask
        return
    for start in range(0, len(ids), max_tokens):
        window = ids[start : start + max_tokens]
        if len(window) > 1:
            yield window, [False] + [True] * (len(window) - 1)


def harness() -> Any:
    """The ``lm_eval`` package, or the one line naming the extra that installs it."""
    try:
        import lm_eval
    except ImportError:
        raise ConfigError(f"--tasks runs lm-evaluation-harness, which is not installed: {INSTALL_HINT}") from None
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return lm_eval


def tasks_digest(
    tasks: Sequence[str], include: Sequence[Path], limit: int | None, settings: EvalSettings
) -> tuple[str, str]:
    """(digest, name) of a task run: what keys its results in the catalog, and how tables name it."""
    lm_eval = harness()
    digest = hashlib.sha256(
        f"mergepipe-eval-tasks/1 lm_eval={lm_eval.__version__} limit={limit} "
        f"batch={settings.batch}{settings.tokenizer_key}\n".encode()
    )
    for task in sorted(tasks):
        digest.update(f"task {task}\n".encode())
    for folder in include:
        if not folder.is_dir():
            raise ConfigError(f"--include {folder}: no such folder of task YAML files")
        for path in sorted(folder.rglob("*.y*ml")):
            data = path.read_bytes()
            digest.update(f"yaml {path.relative_to(folder).as_posix()} {len(data)}\n".encode() + data)
    return digest.hexdigest(), "lm-eval: " + ", ".join(tasks)


def run_tasks(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[str],
    include: Sequence[Path],
    limit: int | None,
    batch: int,
    device: str,
    progress: bool = False,
) -> Scores:
    """``TASK/METRIC`` -> value for every task and metric the harness reports; its bars only with ``progress``."""
    started = time.perf_counter()
    lm_eval = harness()
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    class Model(HFLM):
        def loglikelihood(self, requests: Any, disable_tqdm: bool = False) -> Any:
            return super().loglikelihood(requests, disable_tqdm=not progress)

        def loglikelihood_rolling(self, requests: Any, disable_tqdm: bool = False) -> Any:
            return super().loglikelihood_rolling(requests, disable_tqdm=not progress)

        def generate_until(self, requests: Any, disable_tqdm: bool = False) -> Any:
            return super().generate_until(requests, disable_tqdm=not progress)

    manager = TaskManager(include_path=[str(p) for p in include] or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or in {', '.join(str(p) for p in include)}" if include else " (give --include DIR for local YAML)"
        raise ConfigError(f"unknown lm-eval task(s) {', '.join(unknown)}: not registered{where}")
    wrapped = Model(pretrained=model, tokenizer=tokenizer, batch_size=batch, device=device)
    results = lm_eval.simple_evaluate(
        model=wrapped, tasks=list(tasks), task_manager=manager, limit=limit, log_samples=False, verbosity="ERROR"
    )
    if results is None:
        raise ConfigError("lm-eval returned no results")
    scores: dict[str, float] = {}
    for task, metrics in sorted(results["results"].items()):
        for key, value in metrics.items():
            metric = key.split(",")[0]  # "acc,none" -> "acc"
            if metric.endswith("_stderr") or metric in NOT_SCORES or not isinstance(value, (int, float)):
                continue
            scores[f"{task}/{metric}"] = float(value)
    return Scores(scores, None, time.perf_counter() - started)


@dataclass(frozen=True)
class Subject:
    """What is evaluated: ``key`` (plan digest or content fingerprint), its weights (``folder``, else ``plan``)."""

    key: str
    kind: str  # "plan" | "model" | "hybrid"
    name: str
    folder: Path | None
    plan: Plan | None
    config_folder: Path
    tokenizers: tuple[Path, ...]  # its own folder, then its base's


@dataclass(frozen=True)
class Term:
    """What a model is scored on: held-out ``data`` (its loss), or lm-eval ``tasks``."""

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
    compute_device(device)  # an unusable device is refused before anything is read
    with open_catalog(db, writing=True, reporter=reporter) as catalog:
        subject = resolve_subject(catalog, target)
        return evaluate_subject(catalog, subject, term, settings, device=device, again=again, progress=progress)


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
    """``subject``'s scores on ``term``: stored, or computed and stored; ``tensors``: its weights (bisect's)."""
    found = None if again else stored(catalog, subject.key, term)
    if found is not None:
        return Evaluation(subject, term, found.values, found.tokens, found.seconds, True, False)
    work = work_for(catalog, subject, (term,), settings, device=device, progress=progress)
    scores = run(work, None if tensors is None else tensors()).scores[0]
    store(catalog, subject, term, scores, device)
    in_memory = tensors is not None or subject.folder is None
    return Evaluation(subject, term, scores.values, scores.tokens, scores.seconds, False, in_memory)


def resolve_subject(catalog: Catalog, target: str) -> Subject:
    """The subject ``target`` names: a folder, snapshot, merged or registered model, or a plan."""
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
    """A merge as a subject: read from ``folder`` while it holds the snapshot, else merged in memory."""
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
    """A registered model's content fingerprint (hashed first if it was not)."""
    try:
        return catalog.blocks.content_fingerprint(model_id)
    except CatalogError:
        analyze(catalog, [model_id], progress=False)
        return catalog.blocks.content_fingerprint(model_id)


def stored(catalog: Catalog, key: str, term: Term) -> Scores | None:
    rows = catalog.evaluations.get(key, term.digest)
    values = {r.metric: r.value for r in rows}
    if not rows or (term.data is not None and LOSS not in values):
        return None
    row = next((r for r in rows if r.metric == LOSS), rows[0])
    return Scores(values, row.tokens, row.seconds)


def store(catalog: Catalog, subject: Subject, term: Term, scores: Scores, device: str = "cpu") -> None:
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
    """One evaluation as plain data (a Ray worker can be sent it); ``prune(step, running loss)`` stops it."""

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
    weights = subject.folder or (None if subject.plan is None else Engine(catalog).in_memory_job(subject.plan))
    return Work(weights, subject.config_folder, subject.tokenizers, terms, settings, **options)


def run(
    work: Work, tensors: Mapping[str, torch.Tensor] | None = None, tokenizers: dict[Any, Any] | None = None
) -> Outcome:
    """Build the model once and score each term in order, until pruned."""
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
    """Where evaluations run: here, or on Ray actors (killed on failure or Ctrl-C; ``ray.cancel`` can abort us)."""
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
