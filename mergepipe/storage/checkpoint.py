"""A Hugging Face checkpoint directory, local or remote (S3, HTTP, a Hub commit), from metadata and headers
only: its weight files, validated headers and index, its side files; the output layout a merge writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Iterator

from mergepipe.errors import CheckpointError, CorruptCheckpointError
from mergepipe.storage import hub
from mergepipe.storage.format import SafetensorsHeader, TensorEntry, header_from, read_header
from mergepipe.storage.location import Location, RemotePath, location
from mergepipe.storage.remote import LISTABLE_SCHEMES, RemoteClient, RemoteStat

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # where a merge may give a chat template
MANIFEST_FILE = "manifest.json"  # written by MergePipe into every snapshot; never copied from an input
# Written into every snapshot from its manifest (its card, its merge as a config): never side files.
CARD_FILENAME = "README.md"
MERGE_CONFIG_FILENAME = "mergepipe_config.yml"
DERIVED_FILENAMES = (CARD_FILENAME, MERGE_CONFIG_FILENAME)
# The tokenizer's files as transformers saves them, which a plan without ``copy_tokenizer`` leaves out.
TOKENIZER_FILES = frozenset(
    {
        TOKENIZER_CONFIG_FILE,
        "tokenizer.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "spiece.model",
        "chat_template.jinja",
        "chat_template.json",
    }
)
# Asked for by name where a directory cannot be listed (HTTP): a model folder's usual side files, and the files
# that mark a delta checkpoint or a LoRA adapter.
REMOTE_SIDE_FILES = (
    CONFIG_FILE,
    "generation_config.json",
    TOKENIZER_CONFIG_FILE,
    "tokenizer.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "adapter_config.json",
    "mergepipe_delta.json",
)
PICKLED_SUFFIXES = (".bin", ".pt", ".pth")
# Weights in other formats are no side file: copied beside the merged safetensors they would be the base's
# weights under the merged model's name.
OTHER_WEIGHT_SUFFIXES = (*PICKLED_SUFFIXES, ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
_SHARD_NAME = re.compile(r"^(.*)-(\d+)-of-(\d+)\.safetensors$")
_FIX = "re-download or re-export it"


@dataclass(frozen=True)
class CheckpointFile:
    """One safetensors file of a checkpoint; ``name`` is relative to the root, ``etag`` a remote file's."""

    name: str
    path: Location
    size: int
    mtime_ns: int
    header: SafetensorsHeader
    etag: str | None = None


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint directory."""

    root: Location
    files: tuple[CheckpointFile, ...]
    tensor_files: dict[str, str]
    config: dict[str, Any] | None
    index: dict[str, Any] | None
    aux_files: tuple[str, ...]
    _by_name: dict[str, CheckpointFile] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {f.name: f for f in self.files})

    def file_of(self, name: str) -> CheckpointFile:
        """The file holding tensor ``name``."""
        if name not in self.tensor_files:
            raise KeyError(f"checkpoint {self.root} has no tensor {name!r}")
        return self._by_name[self.tensor_files[name]]

    def file(self, file_name: str) -> CheckpointFile:
        try:
            return self._by_name[file_name]
        except KeyError:
            raise KeyError(f"checkpoint {self.root} has no weight file {file_name!r}") from None

    def tensor(self, name: str) -> TensorEntry:
        return self.file_of(name).header.tensors[name]

    def iter_tensors(self) -> Iterator[tuple[CheckpointFile, TensorEntry]]:
        for file in self.files:
            for entry in file.header.tensors.values():
                yield file, entry

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data (a full read of every tensor), headers excluded."""
        return sum(f.header.data_bytes for f in self.files)


def open_checkpoint(path: str | os.PathLike[str] | RemotePath, client: RemoteClient | None = None) -> Checkpoint:
    """Open and validate the checkpoint directory at ``path`` (local, ``file://``, ``s3://``, ``http(s)://`` or
    ``hf://``); ``client`` makes a remote directory's requests."""
    root = location(path)
    if isinstance(root, RemotePath):
        return _open_remote(root, client or RemoteClient())
    if root.is_file():
        raise CheckpointError(
            f"{root} is a file, not a checkpoint directory (give the folder holding model.safetensors)"
        )
    if not root.is_dir():
        raise CheckpointError(f"no such checkpoint directory: {root} (give the folder holding model.safetensors)")
    try:  # is_file() follows symlinks: Hugging Face cache snapshots are symlinks to blobs
        names = {p.name for p in root.iterdir() if p.is_file()}
    except OSError as exc:
        raise CheckpointError(f"cannot list checkpoint directory {root}: {exc.strerror}") from None
    index = _local_json(root / INDEX_FILE, "index") if INDEX_FILE in names else None
    files = []
    for name in _shard_names(root, names, index):
        header = read_header(root / name)
        try:
            st = os.stat(root / name)
        except OSError as exc:
            raise CheckpointError(f"cannot stat {root / name}: {exc.strerror}") from None
        if st.st_size != header.file_size:
            raise CheckpointError(
                f"{root / name} changed while it was being opened; try again once nothing writes to it"
            )
        files.append(CheckpointFile(name, root / name, st.st_size, st.st_mtime_ns, header))
    config = _local_json(root / CONFIG_FILE, "config") if CONFIG_FILE in names else None
    return _checkpoint(root, names, tuple(files), index, config)


def _shard_names(root: Location, names: set[str], index: dict[str, Any] | None) -> list[str]:
    """The weight files: the index's shards, else ``model.safetensors``, else every ``*.safetensors``."""
    if index is not None:
        shard_names = sorted(set(_weight_map(root / INDEX_FILE, index).values()))
        for shard in shard_names:
            if shard not in names:
                raise CorruptCheckpointError(
                    f"index {root / INDEX_FILE} names shard {shard!r}, which is missing from {root}; {_FIX}"
                )
        series = {(m.group(1), m.group(3)) for m in map(_SHARD_NAME.match, shard_names) if m}
        for name in sorted(names - set(shard_names)):
            match = _SHARD_NAME.match(name)
            if match and (match.group(1), match.group(3)) in series:
                raise CorruptCheckpointError(
                    f"index {root / INDEX_FILE} does not name shard {name!r}, so its tensors are missing "
                    f"from the weight_map; {_FIX}"
                )
        return shard_names
    if SINGLE_FILE in names:
        return [SINGLE_FILE]
    shard_names = sorted(n for n in names if n.endswith(".safetensors"))
    if not shard_names:
        pickled = sorted(n for n in names if n.endswith(PICKLED_SUFFIXES) and n != "training_args.bin")
        if pickled:
            on_hub = isinstance(root, RemotePath) and root.hub is not None
            then = "push them, or give a revision that has them" if on_hub else "give the converted folder"
            raise CheckpointError(
                f"{root} holds only PyTorch pickle weights ({pickled[0]}), no safetensors: MergePipe reads "
                f"safetensors only; convert them (transformers' save_pretrained writes safetensors) and {then}"
            )
        raise CheckpointError(
            f"no {SINGLE_FILE} or {INDEX_FILE} in {root} (give the folder holding the model's safetensors files)"
        )
    return shard_names


def _checkpoint(
    root: Location,
    names: set[str],
    files: tuple[CheckpointFile, ...],
    index: dict[str, Any] | None,
    config: dict[str, Any] | None,
) -> Checkpoint:
    tensor_files: dict[str, str] = {}
    for file in files:
        for tensor in file.header.tensors:
            if tensor in tensor_files:
                raise CorruptCheckpointError(
                    f"checkpoint {root}: tensor {tensor!r} is in both {tensor_files[tensor]} and {file.name}; {_FIX}"
                )
            tensor_files[tensor] = file.name
    if index is not None:
        weight_map = _weight_map(root / INDEX_FILE, index)
        for tensor, shard in weight_map.items():
            if tensor_files.get(tensor) != shard:
                raise CorruptCheckpointError(
                    f"index {root / INDEX_FILE}: tensor {tensor!r} is listed in shard {shard} but is not in that "
                    f"file; {_FIX}"
                )
        for tensor, file_name in tensor_files.items():
            if tensor not in weight_map:
                raise CorruptCheckpointError(
                    f"index {root / INDEX_FILE}: tensor {tensor!r} in shard {file_name} is missing from the "
                    f"weight_map; {_FIX}"
                )
    return Checkpoint(root, files, tensor_files, config, index, _side_names(names))


def _side_names(names: set[str]) -> tuple[str, ...]:
    excluded = {INDEX_FILE, MANIFEST_FILE, *DERIVED_FILENAMES}
    weights = (".safetensors", *OTHER_WEIGHT_SUFFIXES)
    return tuple(n for n in sorted(names) if not n.endswith(weights) and n not in excluded and not n.startswith("."))


def side_files(checkpoint: Checkpoint) -> dict[str, tuple[RemoteStat, str]]:
    """Each side file's metadata (a local one's size and mtime) and the sha256 of its bytes (each read whole)."""
    client: RemoteClient | None = None
    out = {}
    for name in checkpoint.aux_files:
        path = checkpoint.root / name
        if isinstance(path, RemotePath):
            client = client or RemoteClient()
            stat = client.stat(path)
            if stat is None:
                raise CheckpointError(f"{path} is not there (404); re-register the model if its files moved")
            data = client.read(path, 0, stat.size)
        else:
            try:
                st, data = os.stat(path), path.read_bytes()
            except OSError as exc:
                raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
            stat = RemoteStat(st.st_size, None, st.st_mtime_ns)
        out[name] = (stat, hashlib.sha256(data).hexdigest())
    return out


def remote_files(root: RemotePath, client: RemoteClient) -> tuple[dict[str, RemoteStat], dict[str, RemoteStat]]:
    """The weight files and side files of the remote directory ``root`` with their metadata."""
    stats, index = _remote_listing(root, client)
    shards = _shard_names(root, set(stats), index)
    return {name: stats[name] for name in shards}, {name: stats[name] for name in _side_names(set(stats))}


def _open_remote(root: RemotePath, client: RemoteClient) -> Checkpoint:
    """``open_checkpoint`` of a remote directory."""
    if root.hub is not None:
        root = client.pin(root)
        cached = _open_cached(root)
        if cached is not None:
            return cached
    stats, index = _remote_listing(root, client)
    files = []
    for name in _shard_names(root, set(stats), index):
        path, stat = root / name, stats[name]
        header = header_from(path, stat.size, partial(client.read, path), client.options.header_probe_bytes)
        files.append(CheckpointFile(name, path, stat.size, stat.mtime_ns, header, stat.etag))
    config = None
    if CONFIG_FILE in stats:
        config = _json(root / CONFIG_FILE, "config", client.read(root / CONFIG_FILE, 0, stats[CONFIG_FILE].size))
    return _checkpoint(root, set(stats), tuple(files), index, config)


def _remote_listing(root: RemotePath, client: RemoteClient) -> tuple[dict[str, RemoteStat], dict[str, Any] | None]:
    """The files of ``root`` by name with their metadata."""
    stats = client.list_dir(root, (INDEX_FILE, SINGLE_FILE, *REMOTE_SIDE_FILES))
    if not stats:
        raise CheckpointError(
            f"nothing found at {root} (give the URI of the folder holding model.safetensors; check the "
            "endpoint and credentials)"
        )
    index = None
    if INDEX_FILE in stats:
        index = _json(root / INDEX_FILE, "index", client.read(root / INDEX_FILE, 0, stats[INDEX_FILE].size))
    if index is not None and root.scheme not in LISTABLE_SCHEMES:
        wanted = sorted(set(_weight_map(root / INDEX_FILE, index).values()) - set(stats))
        stats.update({p.name: s for p, s in client.stat_many(root / n for n in wanted).items() if s is not None})
    return stats, index


def _open_cached(root: RemotePath) -> Checkpoint | None:
    """The Hub commit ``root`` from the cache's folder of it, when that opens as a complete checkpoint."""
    folder = hub.cached_folder(root, (INDEX_FILE, SINGLE_FILE))
    if folder is None:
        if hub.offline():
            raise hub.offline_error(root, f"{INDEX_FILE} or {SINGLE_FILE}")
        return None
    try:
        local = open_checkpoint(folder)
    except CheckpointError as exc:  # a shard or a file not downloaded: the Hub has the rest
        if hub.offline():
            raise CheckpointError(
                f"HF_HUB_OFFLINE is set and the Hugging Face cache holds only part of {root}: "
                f"{exc}; download the rest while online, or unset HF_HUB_OFFLINE"
            ) from None
        return None
    files = tuple(
        CheckpointFile(f.name, root / f.name, f.size, 0, replace(f.header, path=root / f.name)) for f in local.files
    )
    return replace(local, root=root, files=files)


def _local_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return _json(path, what, path.read_bytes())
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None


def _json(path: Location, what: str, raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise CorruptCheckpointError(f"{what} file {path} is not UTF-8 text; {_FIX}") from None
    except json.JSONDecodeError as exc:
        raise CorruptCheckpointError(
            f"{what} file {path} is not valid JSON ({exc.msg} at line {exc.lineno}); {_FIX}"
        ) from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{what} file {path} is a JSON {type(doc).__name__}, not an object; {_FIX}")
    return doc


def _weight_map(path: Location, index: dict[str, Any]) -> dict[str, str]:
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(f"index {path} has no weight_map object; {_FIX}")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or shard != Path(shard).name or shard in (".", ".."):
            raise CorruptCheckpointError(
                f"index {path}: tensor {tensor!r} maps to {shard!r}, not a file name in the checkpoint folder; {_FIX}"
            )
    return weight_map


@dataclass(frozen=True)
class OutputFile:
    """One weight file to write: its name, its tensors in data order, its header's ``__metadata__``."""

    name: str
    tensors: tuple[str, ...]
    metadata: dict[str, str] | None = None


@dataclass(frozen=True)
class OutputLayout:
    """The weight files of an output, in order, and whether ``model.safetensors.index.json`` lists them."""

    files: tuple[OutputFile, ...]
    indexed: bool

    def weight_map(self) -> dict[str, str]:
        """Tensor name -> the file holding it, sorted by tensor name (as transformers writes its index)."""
        return dict(sorted((tensor, f.name) for f in self.files for tensor in f.tensors))


def mirror_layout(checkpoint: Checkpoint) -> OutputLayout:
    """The layout of ``checkpoint`` itself: its files, tensors and metadata, indexed when it is."""
    files = tuple(OutputFile(f.name, tuple(f.header.tensors), f.header.metadata) for f in checkpoint.files)
    return OutputLayout(files, checkpoint.index is not None)


def pack_shards(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """``(tensor name, bytes)`` in order, cut greedily into shards of at most ``max_bytes``."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be at least 1, got {max_bytes}")
    shards: list[list[str]] = [[]]
    filled = 0
    for name, nbytes in sizes:
        if shards[-1] and filled + nbytes > max_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += nbytes
    return shards


def shard_name(number: int, count: int) -> str:
    """Shard ``number`` (1-based) of ``count``: Hugging Face's five-digit pattern, or the single file's name."""
    return SINGLE_FILE if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"


def packed_layout(
    sizes: Sequence[tuple[str, int]], max_bytes: int, metadata: dict[str, str] | None = None
) -> OutputLayout:
    """Shards of at most ``max_bytes`` of tensor data, each with header ``metadata``; indexed when several."""
    shards = pack_shards(sizes, max_bytes)
    files = tuple(OutputFile(shard_name(i + 1, len(shards)), tuple(names), metadata) for i, names in enumerate(shards))
    return OutputLayout(files, len(files) > 1)


def index_text(layout: OutputLayout, total_size: int) -> str:
    """``model.safetensors.index.json``: ``metadata.total_size`` (bytes of tensor data) and the weight map."""
    return json.dumps({"metadata": {"total_size": total_size}, "weight_map": layout.weight_map()}, indent=2) + "\n"
