"""Mean token loss of a causal LM on evaluation data, from tensors held in memory or read from a folder.

The model is built by transformers from the folder's ``config.json`` and the
given tensors, assigned without a copy (``from_pretrained(state_dict=...)``),
so a merge held in memory (``Engine.merge_in_memory``) is evaluated without a
safetensors write and read: memory is one copy of the weights plus
activations. The same function scores a snapshot read from disk, so a plan
evaluated in memory and its executed snapshot give the same loss to the bit.

Scoring: each example is tokenised with the model's tokenizer, or the one
named (special tokens as it adds them); a text's tokens are cut into windows of
``max_tokens``, each window's first token being context only; a
prompt/completion example keeps its last ``max_tokens`` tokens and scores the
completion's. Windows are batched in order, padded on the right; log-softmax
is taken in float32 whatever the weights' dtype, and the negative
log-likelihoods are summed in float64. Loss = sum / tokens scored;
perplexity = exp(loss).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mergepipe.errors import ConfigError
from mergepipe.evaluation.data import EvalData, EvalSettings, Example
from mergepipe.runtime import count_progress

INSTALL_HINT = "pip install 'mergepipe[eval]'"


@dataclass(frozen=True)
class LossResult:
    loss: float
    tokens: int
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf


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
    """The tokenizer ``named`` (a folder or Hub id), else the first of ``folders`` that has one."""
    transformers = transformers_module()
    why = "it holds no tokenizer files"
    for source in (named,) if named is not None else dict.fromkeys(folders):
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as exc:
            why = why if Path(source).is_dir() else str(exc).splitlines()[0]  # a folder's: a list of no files
            continue
        if set(tokenizer.get_vocab()) - set(tokenizer.all_special_tokens):  # not one made from no files
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
) -> LossResult:
    """Mean token loss of ``model`` on ``data`` (module docstring). ``on_batch(loss so far, batches done)``
    after each batch: a search's pruner stops a trial there by raising."""
    started = time.perf_counter()
    sequences = [s for example in data.examples for s in _sequences(tokenizer, example, settings.max_tokens)]
    if not sequences:
        raise ConfigError(f"{data.name}: no token to score (every example is one token or its prompt only)")
    pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    total, tokens = 0.0, 0
    with torch.inference_mode(), count_progress("eval", len(sequences), "sequences", progress) as advance:
        for done, batch in enumerate(_batches(sequences, settings.batch), start=1):
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
    return LossResult(total / tokens, tokens, time.perf_counter() - started)


def _sequences(tokenizer: Any, example: Example, max_tokens: int) -> Iterator[tuple[list[int], list[bool]]]:
    """(token ids, whether each token is scored) of each window of ``example``."""
    ids = list(tokenizer(example.prompt + example.completion)["input_ids"])
    if example.prompt:
        context = len(tokenizer(example.prompt)["input_ids"])
        mask = [i >= context for i in range(len(ids))]
        ids, mask = ids[-max_tokens:], mask[-max_tokens:]
        mask[0] = False  # the first token of a window has no context in it
        if any(mask):
            yield ids, mask
        return
    for start in range(0, len(ids), max_tokens):
        window = ids[start : start + max_tokens]
        if len(window) > 1:
            yield window, [False] + [True] * (len(window) - 1)


def _batches(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


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
    *,
    limit: int | None,
    batch: int,
    device: str,
    progress: bool = False,
) -> dict[str, float]:
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


def _run_tasks(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[str],
    include: Sequence[Path],
    *,
    limit: int | None,
    batch: int,
    device: str,
) -> dict[str, float]:
    lm_eval = harness()
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=[str(p) for p in include] or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or in {', '.join(str(p) for p in include)}" if include else " (give --include DIR for local YAML)"
        raise ConfigError(f"unknown lm-eval task(s) {', '.join(unknown)}: not registered{where}")
    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch, device=device)
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
    return scores
