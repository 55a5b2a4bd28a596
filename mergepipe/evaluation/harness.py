"""lm-evaluation-harness tasks (`mergepipe eval --tasks`) on a model MergePipe built or read.

The harness is optional (``pip install 'mergepipe[eval]'``) and is given the
model object itself (its ``HFLM`` wrapper takes a ``PreTrainedModel``), so a
merge held in memory is scored without a checkpoint written. Tasks are the
harness's registered ones, or YAML files in ``include`` folders (a task over
a local data file needs no network). Each metric of each task is one result,
named ``TASK/METRIC`` (standard errors left out); the digest that keys them
covers the task names, the YAML files of the include folders, the harness
version and the settings, since a registered task's data cannot be hashed
here.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, redirect_stderr
from pathlib import Path
from typing import Any

from mergepipe.errors import ConfigError
from mergepipe.evaluation.data import EvalSettings
from mergepipe.evaluation.loss import INSTALL_HINT

#: What the harness reports beside its metrics.
NOT_SCORES = {"alias", "sample_len", "samples"}


def harness() -> Any:
    """The ``lm_eval`` package, or the one line naming the extra that installs it."""
    try:
        import lm_eval
    except ImportError:
        raise ConfigError(f"--tasks runs lm-evaluation-harness, which is not installed: {INSTALL_HINT}") from None
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return lm_eval


def tasks_digest(tasks: Sequence[str], include: Sequence[Path], limit: int | None, settings: EvalSettings
                 ) -> tuple[str, str]:
    """(digest, name) of a task run: what keys its results in the catalog, and how tables name it."""
    lm_eval = harness()
    digest = hashlib.sha256(f"mergepipe-eval-tasks/1 lm_eval={lm_eval.__version__} limit={limit} "
                            f"batch={settings.batch}{settings.tokenizer_key}\n".encode())
    for task in sorted(tasks):
        digest.update(f"task {task}\n".encode())
    for folder in include:
        if not folder.is_dir():
            raise ConfigError(f"--include {folder}: no such folder of task YAML files")
        for path in sorted(folder.rglob("*.y*ml")):
            data = path.read_bytes()
            digest.update(f"yaml {path.relative_to(folder).as_posix()} {len(data)}\n".encode() + data)
    return digest.hexdigest(), "lm-eval: " + ", ".join(tasks)


def run_tasks(model: Any, tokenizer: Any, tasks: Sequence[str], include: Sequence[Path], *, limit: int | None,
              batch: int, device: str, progress: bool = False) -> dict[str, float]:
    """``TASK/METRIC`` -> value for every task and metric the harness reports; without ``progress``, the
    harness's and datasets' bars are not drawn."""
    with _bars(progress):
        return _run_tasks(model, tokenizer, tasks, include, limit=limit, batch=batch, device=device)


@contextmanager
def _bars(shown: bool) -> Iterator[None]:
    """The harness draws its bars on stderr whatever it is told (``disable=False`` given explicitly); hidden,
    they go nowhere for the run (errors still raise)."""
    if shown:
        yield
        return
    with open(os.devnull, "w") as sink, redirect_stderr(sink):
        yield


def _run_tasks(model: Any, tokenizer: Any, tasks: Sequence[str], include: Sequence[Path], *, limit: int | None,
               batch: int, device: str) -> dict[str, float]:
    lm_eval = harness()
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=[str(p) for p in include] or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or in {', '.join(str(p) for p in include)}" if include else " (give --include DIR for local YAML)"
        raise ConfigError(f"unknown lm-eval task(s) {', '.join(unknown)}: not registered{where}")
    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch, device=device)
    results = lm_eval.simple_evaluate(model=wrapped, tasks=list(tasks), task_manager=manager, limit=limit,
                                      log_samples=False, verbosity="ERROR")
    if results is None:
        raise ConfigError("lm-eval returned no results")
    scores: dict[str, float] = {}
    for task, metrics in sorted(results["results"].items()):
        for key, value in metrics.items():
            metric = key.split(",")[0]  # "acc,none" -> "acc"
            if metric.endswith("_stderr") or metric in NOT_SCORES or not isinstance(value, (int, float)):
                continue
            scores[f"{task}/{metric}"] = float(value)
    return scores
