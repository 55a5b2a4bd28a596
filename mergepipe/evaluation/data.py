"""Evaluation data: what `mergepipe eval --data FILE` scores, and the digest that keys its results.

A file is plain text (each paragraph, text between blank lines, an example)
or JSONL: one object per line, with ``text`` (every token scored) or
``prompt`` and ``completion`` (only the completion's tokens scored, as in
supervised fine-tuning). The digest covers the files' bytes and every setting
that changes the value (``EvalSettings``), so a result stored in the catalog
is found again only for the same data scored the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mergepipe.errors import ConfigError

#: A data file larger than this is refused: evaluation data is a held-out sample, not a corpus.
MAX_DATA_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Example:
    """One scored text: ``prompt`` is context only (its tokens are not scored), ``completion`` is scored."""

    prompt: str
    completion: str


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
    """The examples of one or more files, their name for tables and their digest for the catalog."""

    name: str
    digest: str
    examples: tuple[Example, ...]


def load_data(paths: Sequence[str | Path], settings: EvalSettings) -> EvalData:
    """The examples of ``paths`` (in order) and the digest of their bytes with ``settings``."""
    if not paths:
        raise ConfigError("give the evaluation data: --data FILE (plain text or JSONL)")
    digest = hashlib.sha256(
        f"mergepipe-eval-data/1 max_tokens={settings.max_tokens} batch={settings.batch}"
        f"{settings.tokenizer_key}".encode()
    )
    examples: list[Example] = []
    for raw in paths:
        path = Path(raw)
        data = _read(path)
        digest.update(len(data).to_bytes(8, "little") + data)
        examples.extend(_jsonl(path, data) if path.suffix.lower() in (".jsonl", ".ndjson") else _text(path, data))
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


def _decode(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def _text(path: Path, data: bytes) -> list[Example]:
    paragraphs = (p.strip() for p in _decode(path, data).replace("\r\n", "\n").split("\n\n"))
    return [Example("", p) for p in paragraphs if p]


def _jsonl(path: Path, data: bytes) -> list[Example]:
    examples = []
    for number, line in enumerate(_decode(path, data).splitlines(), start=1):
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
            examples.append(Example("", row["text"]))
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
            examples.append(Example(row["prompt"], row["completion"]))
        else:
            raise ConfigError(f'{path}:{number}: each line needs a string "text", or "prompt" and "completion"')
        try:
            (examples[-1].prompt + examples[-1].completion).encode()
        except UnicodeEncodeError as exc:
            raise ConfigError(f"{path}:{number}: {exc.object[exc.start]!r} is a lone surrogate, not text") from None
    return examples
