"""What a registered model is to analysis, the planner and the engine: expert formats (full, delta, LoRA) as
sources of Δ, read costs, the catalog rows registration writes, layout checks and changed-file checks.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import socket
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from mergepipe.catalog import Catalog
from mergepipe.catalog.records import BlockRecord, FileRecord, ModelContent, ModelRecord, TensorRecord
from mergepipe.errors import CatalogError, CheckpointError, ConfigError, LayoutMismatchError, ModelChangedError
from mergepipe.spec.canonical import canonical_json
from mergepipe.spec.settings import count_layers
from mergepipe.storage.checkpoint import Checkpoint, open_checkpoint, side_files
from mergepipe.storage.format import MERGEABLE_DTYPES, BlockSpec, TensorEntry, tensor_blocks
from mergepipe.storage.location import RemotePath, location
from mergepipe.storage.lora import (
    ADAPTER_CONFIG_FILE,
    MERGE_FIRST,
    BaseTensors,
    LoraAdapter,
    LoraTarget,
    SavedTensor,
    open_lora_adapter,
)
from mergepipe.storage.remote import RemoteClient, RemoteStat
from mergepipe.storage.source import ByteRange, CheckpointSource, ReadAhead, WorkItem, block_digest

FULL = "checkpoint"
DELTA = "delta"
LORA = "lora"


@dataclass(frozen=True)
class ExpertFormat:
    """One kind of expert (``ModelRecord.kind``) as a source of Δ."""

    kind: str
    #: Δ of a block needs the base block's values (full weights); a delta holds Δ itself.
    needs_base: bool

    def unchanged_flags(
        self, hashes: Sequence[str | None], base_hashes: Sequence[str | None], blocks: Sequence[BlockRecord]
    ) -> list[bool]:
        """Per block: known from hashes to have Δ = 0 (an unknown hash is not)."""
        if self.needs_base:
            return [h is not None and h == b for h, b in zip(hashes, base_hashes)]
        if self.kind == LORA:  # every hash covers A too: only zero B rows say Δ = 0 (analysis reads them)
            return [False] * len(blocks)
        return [h is not None and h == zero_digest(block.nbytes) for h, block in zip(hashes, blocks)]


_FORMATS = {
    "checkpoint": ExpertFormat(FULL, needs_base=True),
    "snapshot": ExpertFormat(FULL, needs_base=True),
    "delta": ExpertFormat(DELTA, needs_base=False),
    "lora": ExpertFormat(LORA, needs_base=False),
}


def expert_format(kind: str) -> ExpertFormat:
    try:
        return _FORMATS[kind]
    except KeyError:
        raise ValueError(f"no expert format for model kind {kind!r}") from None


@functools.lru_cache(maxsize=64)
def zero_digest(nbytes: int) -> str:
    """The blake3 of ``nbytes`` zero bytes: the hash of an all-(+0.0) delta block of that size."""
    return block_digest(bytes(nbytes))


def aligned_block(entry: TensorEntry, base_block: BlockSpec) -> BlockSpec:
    """The expert's block holding the rows of ``base_block``."""
    return BlockSpec(
        index=base_block.index,
        row_start=base_block.row_start,
        row_end=base_block.row_end,
        begin=entry.begin + base_block.row_start * entry.row_bytes,
        end=entry.begin + base_block.row_end * entry.row_bytes,
        row_numel=entry.row_numel,
    )


def aligned_records(name: str, first: int, row_bytes: int, base_blocks: Sequence[BlockRecord]) -> list[BlockRecord]:
    """The catalog rows of a tensor whose rows start at byte ``first``, on the base's blocks (hashes unknown)."""
    return [
        BlockRecord(
            name, b.index, b.row_start, b.row_end, first + b.row_start * row_bytes, first + b.row_end * row_bytes, None
        )
        for b in base_blocks
    ]


def _lora_costs(tensor: TensorRecord, blocks: Sequence[BlockRecord]) -> tuple[list[int], int]:
    """(what each block of a LoRA tensor costs, what the tensor's reads share)."""
    if all((b.begin, b.end) == (tensor.begin, tensor.end) for b in blocks):
        return [0] * len(blocks), tensor.nbytes
    return [b.nbytes for b in blocks], tensor.nbytes - sum(b.nbytes for b in blocks)


def expert_block_bytes(catalog: Catalog, expert_id: str, base_id: str) -> Mapping[str, list[int]] | None:
    """Tensor -> what reading each block of ``expert_id`` costs, for every tensor of ``base_id``."""
    fmt = expert_format(catalog.models.get(expert_id).kind)
    if fmt.needs_base:
        return None
    own = catalog.blocks.by_tensor(expert_id)
    spans = {t.name: t for t in catalog.models.tensors(expert_id)} if fmt.kind == LORA else {}
    sizes = {}
    for name, blocks in catalog.blocks.by_tensor(base_id).items():
        mine = own.get(name)
        if mine is None:
            sizes[name] = [0] * len(blocks)
        else:
            sizes[name] = _lora_costs(spans[name], mine)[0] if name in spans else [b.nbytes for b in mine]
    return sizes


def expert_shared_bytes(catalog: Catalog, expert_id: str) -> Mapping[str, int]:
    """Tensor -> the bytes ``expert_id`` reads once per tensor whenever it reads any block of it."""
    if expert_format(catalog.models.get(expert_id).kind).kind != LORA:
        return {}
    own = catalog.blocks.by_tensor(expert_id)
    return {t.name: _lora_costs(t, own[t.name])[1] for t in catalog.models.tensors(expert_id) if t.name in own}


@dataclass(frozen=True)
class ReadCost:
    """What the engine reads of experts' blocks."""

    own: Mapping[str, Mapping[str, list[int]] | None]
    shared_bytes: Mapping[str, Mapping[str, int]]

    def block(self, expert: str, tensor: str, block: BlockRecord) -> int:
        sizes = self.own.get(expert)
        return block.nbytes if sizes is None else sizes[tensor][block.index]

    def shared(self, expert: str, tensor: str) -> int:
        return self.shared_bytes.get(expert, {}).get(tensor, 0)

    def tensor(self, expert: str, tensor: str, blocks: Sequence[BlockRecord]) -> int:
        """The bytes reading ``blocks`` of one expert's tensor costs: theirs, and the shared part if any."""
        if not blocks:
            return 0
        return sum(self.block(expert, tensor, b) for b in blocks) + self.shared(expert, tensor)


def read_cost(catalog: Catalog, expert_ids: Sequence[str], base_id: str) -> ReadCost:
    """The read costs of ``expert_ids``' blocks against ``base_id``."""
    return ReadCost(
        {e: expert_block_bytes(catalog, e, base_id) for e in expert_ids},
        {e: expert_shared_bytes(catalog, e) for e in expert_ids},
    )


def layout_fingerprint(files: Sequence[FileRecord]) -> str:
    """sha256 over the sorted (name, header sha256, size) of the weight files: the layout's identity."""
    items = sorted([f.name, f.header_sha256, f.size] for f in files)
    return hashlib.sha256(json.dumps(items, separators=(",", ":")).encode()).hexdigest()


def checkpoint_files(checkpoint: Checkpoint) -> tuple[FileRecord, ...]:
    """The weight files as registration records them (a remote file's ETag too; ``None`` for local ones)."""
    return tuple(
        FileRecord(name=f.name, size=f.size, mtime_ns=f.mtime_ns, header_sha256=f.header.header_sha256, etag=f.etag)
        for f in checkpoint.files
    )


def describe_checkpoint(
    checkpoint: Checkpoint,
    model_id: str,
    kind: str,
    block_bytes: int,
    created_at: str,
    geometry: Mapping[str, Sequence[BlockRecord]] | None = None,
    delta_base: str | None = None,
) -> ModelContent:
    """The catalog rows of an opened checkpoint."""
    files = checkpoint_files(checkpoint)
    tensors: list[TensorRecord] = []
    blocks: list[BlockRecord] = []
    for ordinal, (file, entry) in enumerate(checkpoint.iter_tensors()):
        tensors.append(
            TensorRecord(
                name=entry.name,
                file=file.name,
                dtype=entry.dtype,
                shape=tuple(entry.shape),
                begin=entry.begin,
                end=entry.end,
                ordinal=ordinal,
            )
        )
        if geometry is not None:
            blocks.extend(aligned_records(entry.name, entry.begin, entry.row_bytes, geometry[entry.name]))
            continue
        blocks.extend(
            BlockRecord(entry.name, b.index, b.row_start, b.row_end, b.begin, b.end, None)
            for b in tensor_blocks(entry, block_bytes)
        )
    architecture, num_layers = _architecture(checkpoint.config)
    record = ModelRecord(
        id=model_id,
        uri=str(root) if isinstance(root := checkpoint.root, RemotePath) else str(Path(root).resolve()),
        kind=kind,
        fingerprint=layout_fingerprint(files),
        architecture=architecture,
        num_layers=num_layers,
        total_bytes=checkpoint.total_bytes,
        n_tensors=len(tensors),
        n_blocks=len(blocks),
        created_at=created_at,
        delta_base=delta_base,
        side_files=canonical_json(
            [
                FileRecord(
                    name=name, size=stat.size, mtime_ns=stat.mtime_ns, header_sha256=sha256, etag=stat.etag
                ).model_dump()
                for name, (stat, sha256) in side_files(checkpoint).items()
            ]
        ).decode("utf-8"),
    )
    return ModelContent(record=record, files=files, tensors=tuple(tensors), blocks=tuple(blocks))


def side_changes(recorded: Mapping[str, str], found: Mapping[str, str]) -> str:
    """How side files ``found`` differ from the ``recorded`` ones, in words ("tokenizer.json added")."""
    words = [
        f"{n} {'added' if n not in recorded else 'removed' if n not in found else 'changed'}"
        for n in sorted(recorded.keys() | found.keys())
        if recorded.get(n) != found.get(n)
    ]
    return ", ".join(words)


def _architecture(config: dict[str, Any] | None) -> tuple[str | None, int | None]:
    """(architecture, layer count) from config.json; ``None`` where it does not say."""
    if not config:
        return None, None
    architecture = None
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        architecture = archs[0]
    elif isinstance(config.get("model_type"), str):
        architecture = config["model_type"]
    # Multimodal configs keep the language model's depth in text_config.
    for source in (config, config.get("text_config") or {}):
        if not isinstance(source, dict):
            continue
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return architecture, value
    return architecture, None


# Layout differences listed in a mismatch message.
_MAX_DIFFERENCES = 5


def summarise(problems: list[str], noun: str = "difference") -> str:
    """``N differences: first; second; …; … K more`` for a one-line mismatch message."""
    shown = "; ".join(problems[:_MAX_DIFFERENCES])
    more = f"; … {len(problems) - _MAX_DIFFERENCES} more" if len(problems) > _MAX_DIFFERENCES else ""
    return f"{len(problems)} {noun}{'s' if len(problems) > 1 else ''}: {shown}{more}"


def check_layout(expert: str, expert_tensors: list[TensorRecord], base: str, base_tensors: list[TensorRecord]) -> None:
    """LayoutMismatchError naming the first differences unless the expert has the base's layout."""
    mine = {t.name: t for t in expert_tensors}
    theirs = {t.name: t for t in base_tensors}
    problems = []
    for name, b in theirs.items():
        e = mine.get(name)
        if e is None:
            problems.append(f"tensor '{name}' is missing")
        elif e.shape != b.shape:
            problems.append(f"'{name}' has shape {list(e.shape)}, base {list(b.shape)}")
        elif e.dtype != b.dtype:
            problems.append(f"'{name}' is {e.dtype}, base {b.dtype}")
    problems.extend(f"extra tensor '{name}'" for name in mine if name not in theirs)
    if problems:
        raise LayoutMismatchError(
            f"expert '{expert}' does not match the layout of base '{base}' ({summarise(problems)}); "
            "analyse it against a base of the same architecture and size"
        )


def check_delta_base(expert: ModelRecord, base: ModelRecord) -> None:
    """LayoutMismatchError unless ``expert`` (a delta checkpoint or adapter) was registered against ``base``."""
    if expert.delta_base != base.id:
        raise LayoutMismatchError(
            f"'{expert.id}' is a delta checkpoint taken against '{expert.delta_base}', not '{base.id}'; "
            f"analyse and merge it with --base {expert.delta_base}"
        )


def layer_count(catalog: Catalog, base_id: str) -> int:
    """The base's layer count: its config's, else counted from the names of its merged tensors."""
    names = [t.name for t in catalog.models.tensors(base_id) if t.dtype in MERGEABLE_DTYPES]
    return catalog.models.get(base_id).num_layers or count_layers(names)


def check_unchanged(catalog: Catalog, model_id: str, client: RemoteClient | None = None) -> None:
    """ModelChangedError if a weight file of ``model_id`` is gone or its size, mtime or ETag moved."""
    record = catalog.models.get(model_id)
    root = location(record.uri)
    files = catalog.models.files(model_id)
    if isinstance(root, RemotePath):
        client = client or RemoteClient()
        if root.scheme == "s3":  # one listing gives every file's metadata
            listed = client.list_dir(root, ())
            _check_remote(catalog, model_id, root, {f.name: listed.get(f.name) for f in files})
        else:
            _check_remote(
                catalog, model_id, root, {p.name: s for p, s in client.stat_many(root / f.name for f in files).items()}
            )
        return
    if catalog.shared and not os.path.isdir(root):
        raise unreachable(catalog, model_id)
    for file in files:
        path = root / file.name
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise changed(catalog, model_id, f"{path} is missing") from None
        except OSError as exc:
            raise changed(catalog, model_id, f"{path}: {exc.strerror}") from None
        if st.st_size != file.size or st.st_mtime_ns != file.mtime_ns:
            raise changed(catalog, model_id, f"{path}")


def _check_remote(catalog: Catalog, model_id: str, root: RemotePath, stats: Mapping[str, RemoteStat | None]) -> None:
    """ModelChangedError unless every registered weight file has a remote ``stat`` that matches it."""
    for file in catalog.models.files(model_id):
        stat = stats.get(file.name)
        if stat is None:
            raise changed(catalog, model_id, f"{root / file.name} is missing")
        if not remote_matches(file, stat):
            raise changed(catalog, model_id, f"{root / file.name}: its ETag, size or Last-Modified differ")


def remote_matches(file: FileRecord, stat: RemoteStat) -> bool:
    """Whether a remote file is still the registered one."""
    if stat.size != file.size:
        return False
    if file.etag is not None and stat.etag is not None:
        return stat.etag == file.etag
    return stat.mtime_ns == file.mtime_ns


def open_registered(catalog: Catalog, model_id: str, sides: bool = False) -> Checkpoint:
    """The model's checkpoint, opened and checked against its registration."""
    record = catalog.models.get(model_id)
    root = location(record.uri)
    if isinstance(root, RemotePath):
        checkpoint = open_checkpoint(root)
        opened = {f.name: RemoteStat(f.size, f.etag, f.mtime_ns) for f in checkpoint_files(checkpoint)}
        _check_remote(catalog, model_id, root, opened)
    else:
        check_unchanged(catalog, model_id)
        checkpoint = open_checkpoint(record.uri)
    if layout_fingerprint(checkpoint_files(checkpoint)) != record.fingerprint:
        raise changed(catalog, model_id, f"headers in {record.uri}")
    recorded = record.side_digests
    if sides and recorded is not None and (found := {n: h for n, (_, h) in side_files(checkpoint).items()}) != recorded:
        raise changed(catalog, model_id, f"in {record.uri}: {side_changes(recorded, found)}", "side files")
    return checkpoint


def unreachable(catalog: Catalog, model_id: str) -> ModelChangedError:
    """The error for a model of a shared catalog whose directory this machine does not have."""
    record = catalog.models.get(model_id)
    shown = record.label if len(catalog.models.versions(record.name)) > 1 else model_id
    return ModelChangedError(
        f"model '{shown}' is registered at {record.uri} in shared catalog {catalog.path}, and this machine "
        f"({socket.gethostname()}) has no such directory: a catalog several machines share needs each model under "
        "the same path on all of them (a shared filesystem) or in an object store (s3://, https://)"
    )


#: Items (of the largest) a read-ahead may hold ahead of their use.
WINDOWS_AHEAD = 3


def read_ahead(
    source: CheckpointSource, items: Sequence[WorkItem], on_read: Callable[[WorkItem, list[memoryview]], Any]
) -> ReadAhead:
    """The shared read-ahead (``storage/source.py``) over ``items``, ``on_read`` on its reading thread."""
    window = WINDOWS_AHEAD * max((item.nbytes for item in items), default=1)
    return ReadAhead(source, 1, window, on_read)


def check_blocks(item: WorkItem, views: list[memoryview]) -> None:
    """A read-ahead's ``on_read``: every block of the reads (tagged with their model) must still have its hash."""
    for read, view in zip(item.reads, views):
        for check in read.checks:
            if block_digest(view[check.begin - read.begin : check.end - read.begin]) != check.digest:
                raise ModelChangedError(
                    f"model '{read.tag}' changed on disk since it was analysed: block {check.index} of tensor "
                    f"'{read.tensor}' in {read.path} no longer matches its recorded hash; re-register and analyse it"
                )


def changed(catalog: Catalog, model_id: str, what: str, files: str = "file") -> ModelChangedError:
    """The error for a model whose ``files`` are no longer those registered, with what can be done about it."""
    record = catalog.models.get(model_id)
    shown = record.label if len(catalog.models.versions(record.name)) > 1 else model_id
    return ModelChangedError(
        f"model '{shown}' changed on disk since registration ({files} {what}); {what_now(catalog, model_id)}"
    )


def what_now(catalog: Catalog, model_id: str) -> str:
    """What a user can do about a registered model whose files changed, true for this model."""
    record = catalog.models.get(model_id)
    db = catalog.path
    if record.kind == "snapshot":
        return (
            f"'{record.label}' is a snapshot MergePipe published: put its files back (`mergepipe verify --db "
            f"{db} {record.label}` lists what differs), or re-materialise it into another directory by "
            "executing its plan again (`mergepipe snapshots` shows the plan)"
        )
    latest = catalog.models.latest(record.name)
    users = catalog.models.children(model_id) + catalog.models.deltas_of(model_id)
    if latest is not None and latest.id == record.id and not users:
        return (
            "re-register it with `mergepipe register --force`, or register the new files as its next "
            "version with --new-version"
        )
    newer = next(
        (v for v in catalog.models.versions(record.name) if v.version > record.version and v.uri == record.uri), None
    )
    if newer is not None:
        new_files = (
            f"the new files are registered already, as {newer.label} (from the same directory): "
            f"merge with {newer.label} instead"
        )
    else:
        version = 1 + (latest.version if latest is not None else record.version)
        new_files = (
            f"register the new files as {record.name}@{version} (`mergepipe register --db {db} --model-id "
            f"{record.name} --uri {record.uri} --new-version`) and merge with that"
        )
    labels = [found.label if (found := catalog.models.find(user)) is not None else user for user in users]
    why = (
        f"{record.label} is an input of {', '.join(labels)}"
        if users
        else f"{record.label} is not the latest version of '{record.name}'"
    )
    return (
        f"{why}, so it cannot be replaced: put back the files it was registered with (with their modification "
        f"times, as `cp -p` restores them: sizes and times are what is checked), or {new_files}"
    )


#: The file that names a delta's base, beside its weights.
DELTA_FILE = "mergepipe_delta.json"
#: The safetensors metadata key that may hold the same object (as JSON text) instead.
DELTA_METADATA_KEY = "mergepipe_delta"
#: The only storage of Δ this version reads and writes: dense tensors (zeros where trimmed).
DENSE = "dense"
FORMAT_VERSION = 1


def is_delta_dir(root: Path) -> bool:
    """Whether ``root`` holds a delta checkpoint's description file."""
    return (Path(root) / DELTA_FILE).is_file()


def delta_info(checkpoint: Checkpoint) -> dict[str, Any]:
    """The delta's description (``DELTA_FILE``, else its metadata key), validated."""
    if not isinstance(checkpoint.root, Path):
        raise CheckpointError(
            f"{checkpoint.root}: delta checkpoints are read from a local directory; download it and use the copy"
        )
    path = checkpoint.root / DELTA_FILE
    if path.is_file():
        where = str(path)
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"cannot read {where}: {exc}; export the delta again") from None
    else:
        metadata = checkpoint.files[0].header.metadata or {}
        where = f"the '{DELTA_METADATA_KEY}' metadata of {checkpoint.files[0].path}"
        if DELTA_METADATA_KEY not in metadata:
            raise CheckpointError(
                f"{checkpoint.root} has no {DELTA_FILE} (nor '{DELTA_METADATA_KEY}' safetensors metadata) naming the "
                "base it was taken against; write one (see docs) or export it with `mergepipe export-delta`"
            )
        try:
            info = json.loads(metadata[DELTA_METADATA_KEY])
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{where} is not valid JSON ({exc.msg}); export the delta again") from None
    if not isinstance(info, dict):
        raise CheckpointError(f"{where} is not a JSON object; export the delta again")
    if info.get("format") != DENSE:
        raise CheckpointError(
            f"{where}: format {info.get('format')!r} is not supported (MergePipe reads "
            f"{DENSE!r}: dense tensors, zeros where trimmed)"
        )
    fingerprint, block_bytes = info.get("base_fingerprint"), info.get("block_bytes")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise CheckpointError(f"{where} has no base_fingerprint naming the base it was taken against")
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
        raise CheckpointError(
            f"{where}: block_bytes must be the positive block size its base_fingerprint was "
            f"computed at, got {block_bytes!r}"
        )
    return info


def check_delta_tensors(
    name: str, checkpoint: Checkpoint, base: ModelRecord, base_tensors: Sequence[TensorRecord]
) -> None:
    """LayoutMismatchError naming the first problems unless every tensor of the delta is a float delta of
    a merged base tensor of the same shape."""
    theirs = {t.name: t for t in base_tensors}
    problems = []
    for _, entry in checkpoint.iter_tensors():
        b = theirs.get(entry.name)
        if b is None:
            problems.append(f"extra tensor '{entry.name}' (not in the base)")
        elif tuple(entry.shape) != b.shape:
            problems.append(f"'{entry.name}' has shape {list(entry.shape)}, base {list(b.shape)}")
        elif entry.dtype not in MERGEABLE_DTYPES:
            problems.append(f"'{entry.name}' is {entry.dtype}, not a float delta (F32, F16 or BF16)")
        elif b.dtype not in MERGEABLE_DTYPES:
            problems.append(f"'{entry.name}' is {b.dtype} in the base, which is never merged: leave it out")
    if problems:
        raise LayoutMismatchError(
            f"delta '{name}' does not fit base '{base.id}' ({summarise(problems, 'problem')}); nothing was "
            "registered. Export the delta against this base"
        )


def base_fingerprint(catalog: Catalog, base: ModelRecord, block_bytes: int) -> tuple[str, list[tuple[str, int, str]]]:
    """The content fingerprint of ``base`` at ``block_bytes``."""
    if block_bytes == catalog.block_bytes and catalog.blocks.hashed_count(base.id) == base.n_blocks:
        return catalog.blocks.content_fingerprint(base.id), []
    checkpoint = open_registered(catalog, base.id)
    items = [
        WorkItem((e.name, b.index), [ByteRange(checkpoint.file_of(e.name).path, b.begin, b.end, base.id)])
        for e in sorted((e for _, e in checkpoint.iter_tensors()), key=lambda e: e.name)
        for b in tensor_blocks(e, block_bytes)
    ]
    hashes = []
    with CheckpointSource() as source:  # the base may be remote
        for fetched in read_ahead(source, items, lambda _, views: block_digest(views[0])).run(items):
            hashes.append((*fetched.item.payload, fetched.result))
            fetched.release()
    digest = hashlib.sha256(base.fingerprint.encode())
    digest.update("".join(f"{tensor}\0{index}\0{h}\n" for tensor, index, h in hashes).encode())
    return digest.hexdigest(), hashes if block_bytes == catalog.block_bytes else []


def describe_delta(
    catalog: Catalog, name: str, checkpoint: Checkpoint, base_ref: str | None
) -> tuple[ModelContent, list[tuple[str, int, str]]]:
    """The catalog rows of delta checkpoint ``checkpoint`` against ``base_ref``, after every check."""
    if base_ref is None:
        raise ConfigError("a delta checkpoint is registered against its base: give --base BASE")
    base = catalog.models.resolve(base_ref)
    if base.kind == "delta":
        raise ConfigError(f"'{base.id}' is a delta checkpoint, not a base; give the model the delta was taken against")
    info = delta_info(checkpoint)
    base_tensors = catalog.models.tensors(base.id)
    check_delta_tensors(name, checkpoint, base, base_tensors)
    fingerprint, base_hashes = base_fingerprint(catalog, base, info["block_bytes"])
    if fingerprint != info["base_fingerprint"]:
        raise CatalogError(
            f"delta '{name}' was taken against another base than '{base.id}' (its {DELTA_FILE} names base "
            f"fingerprint {info['base_fingerprint'][:12]}…, '{base.id}' has another); nothing was registered. "
            "Give the base it was exported from"
        )
    geometry = catalog.blocks.by_tensor(base.id)
    content = describe_checkpoint(checkpoint, name, "delta", catalog.block_bytes, catalog.now(), geometry, base.id)
    return content, base_hashes


#: Bytes compared at a time when checking an embedding copy against the base.
_COMPARE_CHUNK = 16 << 20


def is_lora_dir(root: Path) -> bool:
    """Whether ``root`` holds a PEFT adapter (its ``adapter_config.json``)."""
    return (Path(root) / ADAPTER_CONFIG_FILE).is_file()


def base_tensors(catalog: Catalog, base_id: str) -> BaseTensors:
    """The base's tensors as ``storage/lora.py`` checks an adapter against them, in the base's order."""
    return {t.name: (t.dtype, t.shape) for t in catalog.models.tensors(base_id)}


def adapter_files(adapter: LoraAdapter) -> tuple[FileRecord, ...]:
    """The files that decide ΔW: the weights (header hash) and the config (hash of its bytes)."""
    out = []
    for path, digest in ((adapter.weights, adapter.header.header_sha256), (adapter.config.path, adapter.config.sha256)):
        st = path.stat()
        out.append(FileRecord(name=path.name, size=st.st_size, mtime_ns=st.st_mtime_ns, header_sha256=digest))
    return tuple(out)


def _check_supported(name: str, adapter: LoraAdapter, base: Checkpoint) -> None:
    """CheckpointError naming the first part of the adapter MergePipe does not merge."""
    for target in adapter.targets.values():
        copy = adapter.saved.get(target.tensor)
        if copy is not None and not _same_bytes(copy, base):
            raise CheckpointError(
                f"adapter '{name}': the copy of {target.tensor!r} it saves (peft's save_embedding_layers) differs "
                f"from the base's (a resized or retrained embedding), which MergePipe does not merge from an "
                f"adapter; nothing was registered. {MERGE_FIRST}"
            )
        if target.b.end != target.a.begin and target.a.end != target.b.begin:
            raise CheckpointError(
                f"adapter '{name}': the factors of {target.module!r} are not next to each other in "
                f"{target.path.name}; nothing was registered. Re-save it with peft's save_pretrained"
            )


def _same_bytes(copy: SavedTensor, base: Checkpoint) -> bool:
    """Whether an adapter's saved copy of a base tensor holds the base's exact bytes (read in chunks)."""
    entry = base.tensor(copy.tensor)
    if (copy.entry.dtype, copy.entry.shape) != (entry.dtype, entry.shape):
        return False
    starts = [(copy.path, copy.entry.begin), (base.file_of(copy.tensor).path, entry.begin)]
    items = [
        WorkItem(
            None, [ByteRange(p, first + at, first + min(entry.nbytes, at + _COMPARE_CHUNK), "") for p, first in starts]
        )
        for at in range(0, entry.nbytes, _COMPARE_CHUNK)
    ]
    with CheckpointSource() as source, closing(read_ahead(source, items, lambda _, v: v[0] == v[1]).run(items)) as same:
        return all(fetched.result for fetched in same)


def merged_parts(adapter: LoraAdapter) -> LoraAdapter:
    """``adapter`` less the saved copies of its LoRA targets (equal to the base's: they add nothing to Δ)."""
    saved = {name: s for name, s in adapter.saved.items() if name not in adapter.targets}
    return adapter if saved == adapter.saved else dataclasses.replace(adapter, saved=saved)


def describe_lora(catalog: Catalog, name: str, root: Path, base_ref: str | None) -> ModelContent:
    """The catalog rows of the adapter at ``root`` against ``base_ref``, after every check; nothing is written."""
    if base_ref is None:
        raise ConfigError("a LoRA adapter is registered against its base: give --base BASE")
    base = catalog.models.resolve(base_ref)
    if base.kind in ("delta", LORA):
        raise ConfigError(f"'{base.id}' is a {base.kind} expert, not a base; give the model the adapter was trained on")
    adapter = open_lora_adapter(root, base_tensors(catalog, base.id))
    _check_supported(name, adapter, open_registered(catalog, base.id))
    adapter = merged_parts(adapter)
    tensors, blocks = _rows(adapter, catalog.blocks.by_tensor(base.id))
    files = adapter_files(adapter)
    record = ModelRecord(
        id=name,
        uri=str(Path(root).resolve()),
        kind=LORA,
        fingerprint=layout_fingerprint(files),
        architecture=base.architecture,
        num_layers=base.num_layers,
        n_tensors=len(tensors),
        n_blocks=len(blocks),
        total_bytes=adapter.factor_bytes + adapter.saved_bytes,
        created_at=catalog.now(),
        delta_base=base.id,
    )
    return ModelContent(record=record, files=files, tensors=tuple(tensors), blocks=tuple(blocks))


def _rows(adapter: LoraAdapter, geometry: dict[str, list[BlockRecord]]) -> tuple[list[TensorRecord], list[BlockRecord]]:
    """Tensor and block rows in the base's tensor order."""
    order = {name: i for i, name in enumerate(geometry)}
    tensors: list[TensorRecord] = []
    blocks: list[BlockRecord] = []
    for ordinal, name in enumerate(sorted([*adapter.targets, *adapter.saved], key=order.__getitem__)):
        if name in adapter.saved:  # a replacement: its own rows, like a full expert's tensor
            entry, first = adapter.saved[name].entry, adapter.saved[name].entry.begin
            tensors.append(
                TensorRecord(
                    name, adapter.weights.name, entry.dtype, tuple(entry.shape), entry.begin, entry.end, ordinal
                )
            )
        else:
            target = adapter.targets[name]
            entry, first = target.b, target.b.begin
            span = (min(target.a.begin, first), max(target.a.end, entry.end))
            tensors.append(TensorRecord(name, target.path.name, entry.dtype, tuple(target.shape), *span, ordinal))
            if target.transposed:  # every block reads the whole span
                blocks.extend(BlockRecord(name, b.index, b.row_start, b.row_end, *span, None) for b in geometry[name])
                continue
        blocks.extend(aligned_records(name, first, entry.row_bytes, geometry[name]))
    return tensors, blocks


def open_lora(catalog: Catalog, model_id: str) -> LoraAdapter:
    """The registered adapter ``model_id``, opened against its base and checked against its registration."""
    check_unchanged(catalog, model_id)
    record = catalog.models.get(model_id)
    adapter = open_lora_adapter(record.uri, base_tensors(catalog, str(record.delta_base)))
    if layout_fingerprint(adapter_files(adapter)) != record.fingerprint:
        raise changed(catalog, model_id, f"headers or config in {record.uri}")
    return merged_parts(adapter)


def adapter_summary(catalog: Catalog, model_id: str) -> dict[str, Any]:
    """What a manifest records of a LoRA expert."""
    adapter = open_lora(catalog, model_id)
    config = adapter.config
    ranks = sorted({t.rank for t in adapter.targets.values()})
    scales = sorted({t.scale for t in adapter.targets.values()})
    scale = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)
    summary: dict[str, Any] = {
        "config_sha256": config.sha256,
        "rank": config.r,
        "scale": scale,
        "targets": len(adapter.targets),
    }
    if ranks != [config.r] or len(scales) > 1:
        summary["ranks"], summary["scales"] = ranks, scales
    return summary


def block_ranges(target: LoraTarget, row_start: int, row_end: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The byte ranges a run of rows reads: (B's rows, all of A), absolute in the adapter file."""
    row = target.b.row_bytes
    return (target.b.begin + row_start * row, target.b.begin + row_end * row), (target.a.begin, target.a.end)


def block_hash(b_rows: bytes | memoryview, a: bytes | memoryview) -> str:
    """A LoRA block's content hash: blake3 of its B rows followed by A (the bytes it reads)."""
    return block_digest(bytes(b_rows) + bytes(a))


def span_hashes(target: LoraTarget, view: memoryview, span_begin: int, blocks: Sequence[BlockRecord]) -> list[str]:
    """Every block's hash from the factors' span as read whole (analysis reads a tensor at once)."""
    if target.transposed:  # each block reads the whole span
        return [block_digest(view)] * len(blocks)
    a = view[target.a.begin - span_begin : target.a.end - span_begin]
    return [block_hash(view[b.begin - span_begin : b.end - span_begin], a) for b in blocks]
