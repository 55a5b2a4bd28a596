"""Open a Hugging Face checkpoint directory: one safetensors file or a sharded set.

Which files hold the weights, in order of precedence:

1. ``model.safetensors.index.json`` present: exactly the shards its
   ``weight_map`` names. Other ``*.safetensors`` files beside them (for example
   Mistral's ``consolidated.safetensors`` duplicate) are ignored.
2. ``model.safetensors`` present: that file alone; other ``*.safetensors``
   files are ignored.
3. Neither, but other ``*.safetensors`` files: all of them, as shards of one
   model (a sharded export whose index was lost). Their tensor names must not
   collide.

Every header is validated (``format.read_header``), and the index must agree
with the shards exactly, so code above can trust ``tensor_files``.

A remote directory (``s3://``, ``http(s)://``, ``hf://``;
``storage/location.py``) is opened by the same rules from metadata and
headers only: S3 and the Hub list the prefix (names, sizes, ETags in one
request); an HTTP server cannot list, so the index, ``model.safetensors``
and the usual side files are asked for by name (the third rule, shards
without an index, needs a listing: S3 and the Hub only). Each weight file
costs one small range request for its header (a second only when the header
is longer than the first read), and its ``CheckpointFile`` carries the
server's ETag and Last-Modified, which registration records.

A Hub location is opened at the commit its revision names now
(``RemoteClient.pin``), which becomes the checkpoint's root. When the local
Hugging Face cache holds that commit's folder and it opens as a complete
checkpoint (every weight file there), it is the checkpoint, with no request:
its files keep their ``hf://`` names, which every reader maps back to the
cache (``storage/hub.py``), and its side files are those the cache holds.
Otherwise the commit is listed and read on the Hub (only the cache, with
``HF_HUB_OFFLINE``: a checkpoint it cannot complete is one line naming what
is missing).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
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
# The tokenizer settings a merge may give a chat template (``Plan.chat_template``).
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Written by MergePipe into every snapshot; never copied from an input.
MANIFEST_FILE = "manifest.json"
# Written into every snapshot from its manifest (its model card, its merge as a config): a merged base's
# describe that base, so they are no side files (``verify`` writes them again to check them).
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
SAFETENSORS_SUFFIX = ".safetensors"
# The side files asked for by name where a directory cannot be listed (HTTP): what a Hugging Face model
# folder holds besides its weights (a snapshot copies them from its base), and the files that mark a
# checkpoint as a delta or a LoRA adapter.
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
# PyTorch pickle weights (pytorch_model.bin, its shards): named in the error for a folder that holds only these.
PICKLED_SUFFIXES = (".bin", ".pt", ".pth")
# Weights in any other format are no side file of a merge: a base's pytorch_model.bin or model.gguf copied
# beside the merged safetensors would be the base's weights under the merged model's name.
OTHER_WEIGHT_SUFFIXES = (*PICKLED_SUFFIXES, ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
# Hugging Face shard names: model-00001-of-00003.safetensors
_SHARD_NAME = re.compile(r"^(.*)-(\d+)-of-(\d+)\.safetensors$")

_FIX = "re-download or re-export it"


@dataclass(frozen=True)
class CheckpointFile:
    """One safetensors file of a checkpoint; ``name`` is relative to the root."""

    name: str
    path: Location
    size: int
    mtime_ns: int
    header: SafetensorsHeader
    etag: str | None = None  # a remote file's ETag (local files have none)


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint directory.

    ``tensor_files`` maps each tensor to its file name, in file order then
    offset order. ``aux_files`` are the other regular files a merged snapshot
    copies from its base (config, tokenizer, generation config, ...): every
    regular file in the root except weights (``*.safetensors``, and
    ``OTHER_WEIGHT_SUFFIXES``), the index, the manifest, a snapshot's card and
    config (``DERIVED_FILENAMES``) and hidden (dot) files: its side files, part
    of what a registered model is (``side_files``).
    """

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
        """The file holding tensor ``name``; ``KeyError`` if there is no such tensor."""
        file_name = self.tensor_files.get(name)
        if file_name is None:
            raise KeyError(f"checkpoint {self.root} has no tensor {name!r}")
        return self._by_name[file_name]

    def file(self, file_name: str) -> CheckpointFile:
        """The file called ``file_name`` (relative to the root); ``KeyError`` if absent."""
        try:
            return self._by_name[file_name]
        except KeyError:
            raise KeyError(f"checkpoint {self.root} has no weight file {file_name!r}") from None

    def tensor(self, name: str) -> TensorEntry:
        """The entry of tensor ``name``; ``KeyError`` if there is no such tensor."""
        return self.file_of(name).header.tensors[name]

    def iter_tensors(self) -> Iterator[tuple[CheckpointFile, TensorEntry]]:
        """Every tensor with its file, in file order then offset order."""
        for file in self.files:
            for entry in file.header.tensors.values():
                yield file, entry

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data (what a full read of every tensor costs), headers excluded."""
        return sum(f.header.data_bytes for f in self.files)


def open_checkpoint(path: str | os.PathLike[str] | RemotePath, client: RemoteClient | None = None) -> Checkpoint:
    """Open and validate the checkpoint directory at ``path`` (a local path, a ``file://``, ``s3://`` or
    ``http(s)://`` URI); ``client`` makes a remote directory's requests (a new one by default)."""
    root = location(path)
    if isinstance(root, RemotePath):
        return _open_remote(root, client or RemoteClient())
    if root.is_file():
        raise CheckpointError(
            f"{root} is a file, not a checkpoint directory (give the folder holding model.safetensors)"
        )
    if not root.is_dir():
        raise CheckpointError(f"no such checkpoint directory: {root} (give the folder holding model.safetensors)")
    names = _list_regular_files(root)
    index = _read_json(root / INDEX_FILE, "index") if INDEX_FILE in names else None
    shard_names = _shard_names(root, names, index)
    files = tuple(_open_file(root, name) for name in shard_names)
    config = _read_json(root / CONFIG_FILE, "config") if CONFIG_FILE in names else None
    return _checkpoint(root, names, files, index, config)


def _shard_names(root: Location, names: set[str], index: dict[str, Any] | None) -> list[str]:
    """The weight files, by the rules of the module docstring (every one checked present)."""
    if index is not None:
        weight_map = _weight_map(root / INDEX_FILE, index)
        shard_names = sorted(set(weight_map.values()))
        for shard in shard_names:
            if shard not in names:
                raise CorruptCheckpointError(
                    f"index {root / INDEX_FILE} names shard {shard!r}, which is missing from {root}; {_FIX}"
                )
        _check_no_orphan_shards(root / INDEX_FILE, shard_names, names)
        return shard_names
    if SINGLE_FILE in names:
        return [SINGLE_FILE]
    shard_names = sorted(n for n in names if n.endswith(SAFETENSORS_SUFFIX))
    if not shard_names:
        pickled = sorted(n for n in names if n.endswith(PICKLED_SUFFIXES) and n != "training_args.bin")
        if pickled:
            then = "push them, or give a revision that has them" if _on_hub(root) else "give the converted folder"
            raise CheckpointError(
                f"{root} holds only PyTorch pickle weights ({pickled[0]}), no safetensors: MergePipe reads "
                f"safetensors only; convert them (transformers' save_pretrained writes safetensors) and {then}"
            )
        raise CheckpointError(
            f"no {SINGLE_FILE} or {INDEX_FILE} in {root} (give the folder holding the model's safetensors files)"
        )
    return shard_names


def _on_hub(root: Location) -> bool:
    return isinstance(root, RemotePath) and root.hub is not None


def _checkpoint(
    root: Location,
    names: set[str],
    files: tuple[CheckpointFile, ...],
    index: dict[str, Any] | None,
    config: dict[str, Any] | None,
) -> Checkpoint:
    tensor_files = _tensor_files(root, files)
    if index is not None:
        _check_index_matches(root / INDEX_FILE, _weight_map(root / INDEX_FILE, index), tensor_files)
    return Checkpoint(
        root=root, files=files, tensor_files=tensor_files, config=config, index=index, aux_files=_side_names(names)
    )


def _side_names(names: set[str]) -> tuple[str, ...]:
    """The side files among a directory's file ``names`` (``Checkpoint.aux_files``), sorted."""
    excluded = {INDEX_FILE, MANIFEST_FILE, *DERIVED_FILENAMES}
    return tuple(
        n
        for n in sorted(names)
        if not n.endswith((SAFETENSORS_SUFFIX, *OTHER_WEIGHT_SUFFIXES)) and n not in excluded and not n.startswith(".")
    )


def side_files(checkpoint: Checkpoint) -> dict[str, tuple[RemoteStat, str]]:
    """Each side file's metadata (a remote one's as the server gives it; a local one's size and mtime) and the
    sha256 of its bytes (small: each read whole)."""
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
    """The weight files and the side files of the remote directory ``root``, by the rules of the module
    docstring, with what the server says of each (size, ETag): from its listing (HTTP: HEADs of the index,
    ``model.safetensors``, the usual side files and the shards the index names) and its index, never a header.
    What tells a re-registered model unchanged (``analysis/register.py``) at the cost of metadata."""
    stats, index = _remote_listing(root, client, (INDEX_FILE, SINGLE_FILE, *REMOTE_SIDE_FILES))
    return (
        {name: stats[name] for name in _shard_names(root, set(stats), index)},
        {name: stats[name] for name in _side_names(set(stats))},
    )


def _open_remote(root: RemotePath, client: RemoteClient) -> Checkpoint:
    """``open_checkpoint`` of a remote directory: metadata, JSON files and headers only (a Hub commit: from
    the local cache when it holds all of it, module docstring)."""
    if root.hub is not None:
        root = client.pin(root)
        cached = _open_cached(root)
        if cached is not None:
            return cached
    stats, index = _remote_listing(root, client, (INDEX_FILE, SINGLE_FILE, *REMOTE_SIDE_FILES))
    names = set(stats)
    files = tuple(_open_remote_file(root, name, stats[name], client) for name in _shard_names(root, names, index))
    config = (
        _parse_json(root / CONFIG_FILE, client.read(root / CONFIG_FILE, 0, stats[CONFIG_FILE].size), "config")
        if CONFIG_FILE in stats
        else None
    )
    return _checkpoint(root, names, files, index, config)


def _remote_listing(
    root: RemotePath, client: RemoteClient, candidates: tuple[str, ...]
) -> tuple[dict[str, RemoteStat], dict[str, Any] | None]:
    """The files of the remote directory ``root`` by name, with their metadata (where it cannot be listed:
    ``candidates`` and the shards its index names), and its index (read whole) if it has one."""
    stats = client.list_dir(root, candidates)
    if not stats:
        raise CheckpointError(
            f"nothing found at {root} (give the URI of the folder holding model.safetensors; check the "
            "endpoint and credentials)"
        )
    index = (
        _parse_json(root / INDEX_FILE, client.read(root / INDEX_FILE, 0, stats[INDEX_FILE].size), "index")
        if INDEX_FILE in stats
        else None
    )
    if index is not None and root.scheme not in LISTABLE_SCHEMES:  # the shards the index names are asked for
        wanted = sorted(set(_weight_map(root / INDEX_FILE, index).values()) - set(stats))
        stats.update({p.name: s for p, s in client.stat_many(root / n for n in wanted).items() if s is not None})
    return stats, index


def _open_cached(root: RemotePath) -> Checkpoint | None:
    """The Hub commit ``root`` from the local cache's folder of it, when that opens as a complete checkpoint;
    its files named as on the Hub (size as there, no time: ``storage/remote.py``). None when the cache does
    not hold it all, unless offline mode allows nothing else (then one line naming what is missing)."""
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
        CheckpointFile(
            name=f.name, path=root / f.name, size=f.size, mtime_ns=0, header=replace(f.header, path=root / f.name)
        )
        for f in local.files
    )
    return Checkpoint(
        root=root,
        files=files,
        tensor_files=local.tensor_files,
        config=local.config,
        index=local.index,
        aux_files=local.aux_files,
    )


def _open_remote_file(root: RemotePath, name: str, stat: RemoteStat, client: RemoteClient) -> CheckpointFile:
    path = root / name
    probe = client.options.header_probe_bytes
    header = header_from(path, stat.size, lambda begin, end: client.read(path, begin, end), probe)
    return CheckpointFile(name=name, path=path, size=stat.size, mtime_ns=stat.mtime_ns, header=header, etag=stat.etag)


def _list_regular_files(root: Path) -> set[str]:
    # is_file() follows symlinks: Hugging Face cache snapshots are symlinks to blobs.
    try:
        return {p.name for p in root.iterdir() if p.is_file()}
    except OSError as exc:
        raise CheckpointError(f"cannot list checkpoint directory {root}: {exc.strerror}") from None


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    return _parse_json(path, raw, what)


def _parse_json(path: Location, raw: bytes, what: str) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptCheckpointError(f"{what} file {path} is not UTF-8 text; {_FIX}") from None
    try:
        doc = json.loads(text)
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


def _check_no_orphan_shards(index_path: Location, shard_names: list[str], names: set[str]) -> None:
    """A file named like a sibling shard (same prefix and count) must be in the index."""
    series = {(m.group(1), m.group(3)) for m in map(_SHARD_NAME.match, shard_names) if m}
    for name in sorted(names - set(shard_names)):
        match = _SHARD_NAME.match(name)
        if match and (match.group(1), match.group(3)) in series:
            raise CorruptCheckpointError(
                f"index {index_path} does not name shard {name!r}, so its tensors are missing "
                f"from the weight_map; {_FIX}"
            )


def _open_file(root: Path, name: str) -> CheckpointFile:
    path = root / name
    header = read_header(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CheckpointError(f"cannot stat {path}: {exc.strerror}") from None
    if st.st_size != header.file_size:
        raise CheckpointError(f"{path} changed while it was being opened; try again once nothing writes to it")
    return CheckpointFile(name=name, path=path, size=st.st_size, mtime_ns=st.st_mtime_ns, header=header)


def _tensor_files(root: Location, files: tuple[CheckpointFile, ...]) -> dict[str, str]:
    tensor_files: dict[str, str] = {}
    for file in files:
        for tensor in file.header.tensors:
            other = tensor_files.get(tensor)
            if other is not None:
                raise CorruptCheckpointError(
                    f"checkpoint {root}: tensor {tensor!r} is in both {other} and {file.name}; {_FIX}"
                )
            tensor_files[tensor] = file.name
    return tensor_files


def _check_index_matches(
    index_path: Location,
    weight_map: dict[str, str],
    tensor_files: dict[str, str],
) -> None:
    for tensor, shard in weight_map.items():
        actual = tensor_files.get(tensor)
        if actual != shard:
            raise CorruptCheckpointError(
                f"index {index_path}: tensor {tensor!r} is listed in shard {shard} but is not in that file; {_FIX}"
            )
    for tensor, file_name in tensor_files.items():
        if tensor not in weight_map:
            raise CorruptCheckpointError(
                f"index {index_path}: tensor {tensor!r} in shard {file_name} is missing from the weight_map; {_FIX}"
            )


@dataclass(frozen=True)
class OutputFile:
    """One weight file to write: its name in the output folder, its tensors in data order, and the
    ``__metadata__`` of its safetensors header."""

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
    """``(tensor name, bytes)`` in order, cut greedily into shards of at most ``max_bytes`` each (a
    tensor larger than that alone in its shard); at least one shard, empty when there are no tensors."""
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
    """The file name of shard ``number`` (1-based) of ``count``: Hugging Face's five-digit pattern."""
    if count == 1:
        return SINGLE_FILE
    return f"model-{number:05d}-of-{count:05d}.safetensors"


def packed_layout(
    sizes: Sequence[tuple[str, int]], max_bytes: int, metadata: dict[str, str] | None = None
) -> OutputLayout:
    """Shards of at most ``max_bytes`` of tensor data (``pack_shards``), each with header ``metadata``;
    indexed when there is more than one."""
    shards = pack_shards(sizes, max_bytes)
    files = tuple(OutputFile(shard_name(i + 1, len(shards)), tuple(names), metadata) for i, names in enumerate(shards))
    return OutputLayout(files, len(files) > 1)


def index_text(layout: OutputLayout, total_size: int) -> str:
    """The text of ``model.safetensors.index.json``: ``metadata.total_size`` (bytes of tensor data) and
    the weight map."""
    index = {"metadata": {"total_size": total_size}, "weight_map": layout.weight_map()}
    return json.dumps(index, indent=2) + "\n"
