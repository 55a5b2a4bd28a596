"""What a model scores, knowing nothing of the catalog: held-out data (plain text, or JSONL ``text`` or
``prompt``/``completion``) and its digest, the causal LM transformers builds from a config folder and
tensors, its mean token loss, and lm-evaluation-harness tasks."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mergepipe.errors import ConfigError
from mergepipe.runtime import count_progress

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
        """What a digest adds for an explicit tokenizer (it changes every loss); nothing for the model's own."""
        return "" if self.tokenizer is None else f" tokenizer={self.tokenizer}"


@dataclass(frozen=True)
class EvalData:
    """The examples of one or more files, their name for tables and their digest (bytes and settings)."""

    name: str
    digest: str
    examples: tuple[tuple[str, str], ...]  # (prompt: context only, completion: scored)


@dataclass(frozen=True)
class Scores:
    """What one evaluation measured: metric -> value (loss and perplexity, or ``TASK/METRIC``), the tokens
    scored (None for tasks) and its seconds."""

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
    """The tokenizer ``named`` (a folder or Hub id), else the first of ``folders`` that has one (one
    transformers makes from no files, with no vocabulary, is none)."""
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
    """Mean token loss and perplexity of ``model`` on ``data``: windows batched in order, padded on the right,
    log-softmax in float32, sums in float64. ``on_batch(loss so far, batches done)`` after each batch."""
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
    """(token ids, whether each is scored) of each window: a text cut into windows of ``max_tokens`` (each
    window's first token context only); a prompt/completion's last ``max_tokens``, its completion scored."""
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
        """HFLM drawing its bars only with ``progress`` (the harness's evaluator asks for them always)."""

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
