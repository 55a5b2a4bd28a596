"""Execute a Plan: stream the merge into a staging directory, seal it with a
manifest, publish it atomically and commit it to the catalog.

The order of events, each a contract (docs/ARCHITECTURE.md, "Publish"):

1. refuse a stale plan (input fingerprints or files changed), an existing
   output path and a taken model id — before anything is written;
2. stage beside the output and record the intent in the catalog;
3. create every output shard with its header (fixed offsets), cut the plan
   into work units and run them on the executor; check every unit's record
   against the plan; copy config, generation config and tokenizer files. An
   incremental merge first places each output file that is wholly the
   previous snapshot's (``place_reused``: a reflink or a kernel copy, read
   back and checked), and makes only the others;
4. hash the files, write ``manifest.json``: a weight file's hash (blake3) is
   fed with its bytes as units write them (``storage/hashing.py``), a placed
   file's is the one the previous manifest records, so only the small side
   files are read again;
5. fsync, rename into place, fsync the parent, commit the snapshot row (the
   snapshot is registered as a model whose parents are its inputs).

A failure before the rename removes the staging directory; after it the
snapshot is complete and ``recover`` finishes an interrupted commit.

Re-runs. The same plan always gives the same snapshot, so executing a plan
that was executed before re-materialises *that* snapshot at the new output
(after its directory was deleted, or as a copy): the same steps, with a
location intent instead of a snapshot intent; before publishing, the
snapshot id and manifest hash must be the recorded ones (else EngineError,
nothing published), and the recorded manifest is written, so the directory
is byte-identical to the first. The commit adds the location; if the
snapshot's current directory no longer exists, the new one becomes current
(its model's ``uri``: ``verify MODEL``, ``--from`` and ``diff`` read it).

Aliases. A re-run under another model id publishes the same snapshot under
that id too: the same location steps, and the commit registers the new id as
an alias (a snapshot model whose one parent, role ``same snapshot``, is the
snapshot's own model; ``catalog/snapshots.py``). The bytes, the manifest
(which names the snapshot's own model) and the snapshot id are the
snapshot's: identities stay content-derived.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from mergepipe.analysis.experts import (
    LORA,
    adapter_summary,
    check_unchanged,
    checkpoint_files,
    describe_checkpoint,
    open_registered,
)
from mergepipe.analysis.provenance import BlockOutput, OutputRow, output_rows
from mergepipe.analysis.register import check_model_id
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import FileRecord, ModelRecord, SnapshotRecord, Timing
from mergepipe.catalog.snapshots import host_key
from mergepipe.engine.defaults import DEFAULT_MAX_MEMORY, device_name
from mergepipe.engine.executor import Executor, LocalExecutor, UnitTask
from mergepipe.engine.job import WholeFile, whole_file
from mergepipe.engine.job import BASE_TAG, REUSE_TAG, Job, load_job, load_store, output_dtype
from mergepipe.engine.stream import (
    UnitJob,
    UnitRecord,
    file_digests,
    file_hashers,
    process_seconds,
    requests_by_model,
    run_unit,
)
from mergepipe.engine.job import balanced_target, cut_units
from mergepipe.errors import (
    ConfigError,
    CorruptCheckpointError,
    EngineError,
    InterruptedAfterPublish,
    ModelChangedError,
    PreviousChangedError,
    StalePlanError,
    UnknownModelError,
)
from mergepipe.manifest.manifest import CARD_FORMAT, derived_files
from mergepipe.manifest.manifest import DTYPE_NAMES
from mergepipe.manifest.manifest import FILE_HASH_OF_SCHEMA, MANIFEST_SCHEMA, Manifest, read_manifest, snapshot_id_for
from mergepipe.manifest.manifest import (
    ByteCost,
    Cost,
    ErrorBound,
    ExpertRef,
    FileEntry,
    OperatorSpec,
    RealizedCost,
    SoftwareVersions,
)
from mergepipe.runtime import Advance, byte_progress, compute_threads
from mergepipe.sizes import parse_size
from mergepipe.spec.canonical import canonical_json, compress_indices
from mergepipe.spec.copy_map import TensorCopy
from mergepipe.spec.plan import Plan
from mergepipe.storage.checkpoint import (
    INDEX_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILES,
    Checkpoint,
    OutputLayout,
    index_text,
    open_checkpoint,
    packed_layout,
)
from mergepipe.storage.format import DTYPE_SIZES, BlockSpec, TensorEntry, tensor_blocks
from mergepipe.storage.writer import CLONED, COPIED, LINKED, place_file
from mergepipe.storage.location import HUB_COMMIT, RemotePath, location
from mergepipe.storage.remote import RemoteClient, TransferMeter, copy_file, read_file
from mergepipe.storage.source import (
    FILE_HASH,
    BlockCheck,
    ByteRange,
    CheckpointSource,
    Fetched,
    FileHash,
    ReadAhead,
    WorkItem,
    block_digest,
    file_digest,
)
from mergepipe.storage.writer import (
    ShardLayout,
    ShardWriter,
    WriteBehind,
    create_shard,
    has_header,
    memory_shard,
    shard_header,
    to_bytes,
    to_float32,
)
from mergepipe.storage.writer import tensors as memory_tensors
from mergepipe.txn.outpath import refuse_inside_models
from mergepipe.txn.publish import StagingArea, TransactionManager, refuse_existing, resolve_output, write_failure
from mergepipe.txn.recover import current_files
from mergepipe.txn.verify import file_entries, file_stamps

#: transformers reads a chat template from this file in preference to tokenizer_config.json's.
_CHAT_TEMPLATE_FILE = "chat_template.jinja"


def copy_side_files(inputs: Job, staging: Path) -> None:
    """The side files of a merge (``write_side_files``), whose output has the base's tensors."""
    total = sum(e.numel * DTYPE_SIZES[inputs.output_dtype(e)] for _, e in inputs.base.iter_tensors())
    write_side_files(inputs.plan, inputs.base, inputs.layout, total, staging)


def write_side_files(plan: Plan, base: Checkpoint, layout: OutputLayout, total_bytes: int, staging: Path) -> None:
    """config.json, generation config and tokenizer files from the base (the
    config's dtype rewritten for ``out_dtype`` and a passthrough's layer count for its copy map, the plan's
    chat template set; the tokenizer's files left out when the plan says so); the index of the output's
    shards (``layout``, of ``total_bytes`` of tensor data) when it has one. Not the base's model card: it
    describes another model (the snapshot gets its own, ``manifest/manifest.py``)."""
    out_dtype = plan.out_dtype
    template = plan.chat_template
    client = RemoteClient() if isinstance(base.root, RemotePath) else None  # one listing of a remote base's files
    for name in base.aux_files:  # not a merged base's card and config: they describe that base
        if not plan.copy_tokenizer and name in TOKENIZER_FILES:
            continue
        source = base.root / name
        if template is not None and name in (TOKENIZER_CONFIG_FILE, _CHAT_TEMPLATE_FILE):
            _write_chat_template(source, staging / name, template, client)
        elif name == "config.json" and (out_dtype is not None or plan.copies is not None):
            config = json.loads(read_file(source, client))  # the base may be remote: read_file fetches it
            for key in ("torch_dtype", "dtype"):
                if key in config and out_dtype is not None:
                    config[key] = DTYPE_NAMES[out_dtype]
            if plan.copies is not None:
                config = plan.copies.output_config(config)
            (staging / name).write_text(json.dumps(config, indent=2) + "\n")
        else:
            copy_file(source, staging / name, client)  # shutil.copyfile for a local base, a download for a remote one
    if layout.indexed:
        (staging / INDEX_FILE).write_text(index_text(layout, total_bytes))


def _write_chat_template(
    source: Path | RemotePath, target: Path, template: str, client: RemoteClient | None = None
) -> None:
    """``template`` as the output's chat template: tokenizer_config.json is the base's with ``chat_template``
    set (its keys in the base file's order; re-serialised as transformers writes it); a
    ``chat_template.jinja``, which transformers prefers to the config's entry, becomes the template itself."""
    if source.name == _CHAT_TEMPLATE_FILE:
        target.write_text(template, encoding="utf-8")
        return
    try:
        config = json.loads(read_file(source, client).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        config = None
    if not isinstance(config, dict):
        raise CorruptCheckpointError(
            f"{source} is not a JSON object, so the plan's chat template cannot be set in it; fix or restore the file"
        )
    config["chat_template"] = template
    target.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class InputRecords:
    """What a manifest records of the inputs beyond their ids and fingerprints: ``base_name``, the base as
    people know it (the model card's first ``base_model``, ``base_name`` below); ``expert_names``, the experts
    known by another name than their catalog id (the card's other ``base_model`` entries, ``location_name``
    below); of the experts that are not full checkpoints, ``kinds``, each one's kind (``delta``, ``lora``),
    and ``adapters``, per LoRA expert its config hash, rank, scale and factor bytes read; ``hub_commits``, of
    the inputs read from the Hugging Face Hub, the commit each was (``ORG/NAME@COMMIT``: never a branch, which
    moves). The last four are empty when every expert holds full weights in a folder named as its id and
    nothing came from the Hub (those manifests stay as they were)."""

    base_name: str | None = None
    kinds: dict[str, str] = field(default_factory=dict)
    adapters: dict[str, dict] = field(default_factory=dict)
    expert_names: dict[str, str] = field(default_factory=dict)
    hub_commits: dict[str, str] = field(default_factory=dict)


def input_records(catalog: Catalog, plan: Plan, realized: RealizedCost) -> InputRecords:
    """The ``InputRecords`` of ``plan``'s inputs, with the factor bytes ``realized`` read of each adapter."""
    kinds = {
        e.id: k
        for e in plan.experts  # full weights are the default: only other formats are named
        if (k := catalog.models.get(e.id).kind) not in ("checkpoint", "snapshot")
    }
    read = realized.expert_bytes_by_model
    adapters = {
        e: {**adapter_summary(catalog, e), "factor_bytes_read": read.get(e, 0)} for e, k in kinds.items() if k == LORA
    }
    names = {e.id: name for e in plan.experts if (name := location_name(catalog, e.id)) != e.id}
    commits = {m.id: commit for m in (plan.base, *plan.experts) if (commit := hub_commit(catalog, m.id)) is not None}
    return InputRecords(base_name(catalog, plan.base.id), kinds, adapters, names, commits)


def hub_commit(catalog: Catalog, model_id: str) -> str | None:
    """``ORG/NAME@COMMIT`` of a model read from the Hub: an ``hf://`` input (registered at a commit), or a
    folder of the Hub's cache (``models--ORG--NAME/snapshots/COMMIT``: a Hub adapter's download); None for
    any other."""
    root = location(catalog.models.get(model_id).uri)
    if isinstance(root, RemotePath):
        hub = root.hub
        return None if hub is None or hub.commit is None else f"{hub.repo_id}@{hub.commit}"
    cached = _HUB_CACHE.match(root.parent.parent.name) if root.parent.name == "snapshots" else None
    return f"{cached[1]}/{cached[2]}@{root.name}" if cached and HUB_COMMIT.match(root.name) else None


def base_name(catalog: Catalog, base_id: str) -> str:
    """The base as people know it, never the catalog's id (which means nothing outside the catalog): the
    Hub id its config.json's ``_name_or_path`` gives (a model loaded from the Hub and saved keeps it there),
    else its ``location_name``. A merged base's config.json is its own base's, so only its location names it."""
    record = catalog.models.get(base_id)
    root = location(record.uri)
    if record.kind != "snapshot" and not isinstance(root, RemotePath):
        named = _name_or_path(root / "config.json")
        if named is not None:
            return named
    return location_name(catalog, base_id)


def location_name(catalog: Catalog, model_id: str) -> str:
    """A model as people know it from where it is: the Hub id of an ``hf://`` input or of a folder in the
    Hub's cache (``models--ORG--NAME/snapshots/REVISION``), else its folder's (or object prefix's) name.
    Not its config.json's ``_name_or_path``: a fine-tune saved by transformers keeps there the id of the
    model it was trained from, its base."""
    root = location(catalog.models.get(model_id).uri)
    if isinstance(root, RemotePath):
        return root.name if root.hub is None else root.hub.repo_id
    cached = _HUB_CACHE.match(root.parent.parent.name) if root.parent.name == "snapshots" else None
    return f"{cached[1]}/{cached[2]}" if cached else root.name


#: A Hugging Face Hub repository id, ``ORG/NAME``.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
#: The folder the Hub's cache keeps a repository in.
_HUB_CACHE = re.compile(r"^models--([A-Za-z0-9][A-Za-z0-9._-]*)--([A-Za-z0-9][A-Za-z0-9._-]*)$")


def _name_or_path(config_path: Path) -> str | None:
    """``_name_or_path`` of a config.json when it is a Hub id (not a local path); None otherwise."""
    try:
        config = json.loads(config_path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    value = config.get("_name_or_path") if isinstance(config, dict) else None
    return value if isinstance(value, str) and _HUB_ID.match(value) and ".." not in value else None


def build_manifest(
    plan: Plan,
    model_id: str,
    snapshot_id: str,
    files: tuple[FileEntry, ...],
    realized: RealizedCost,
    created_at: str,
    inputs: InputRecords | None = None,
    schema: int = MANIFEST_SCHEMA,
) -> Manifest:
    """The manifest of a snapshot made from ``plan`` (timings in ``realized.seconds``); ``inputs``: what it
    records of the inputs beyond ids and fingerprints (nothing by default); ``schema``: the current one, or an
    older one when re-making a snapshot an older version sealed (``files`` then carry that schema's hashes)."""
    spec = plan.merge
    # every changed block read (and none updated from a rounded previous output): the full-read merge
    everything_read = plan.cost.expert_bytes == plan.cost.full_expert_bytes and not (plan.reuse and plan.reuse.updated)
    return Manifest(
        snapshot_id=snapshot_id,
        model_id=model_id,
        plan_digest=plan.digest,
        base=plan.base,
        experts=tuple(ExpertRef(e.id, e.fingerprint, spec.scalar_weight(e.id)) for e in plan.experts),
        operator=OperatorSpec(
            spec.operator,
            {"global": dict(spec.params), "experts": {e.expert_id: dict(e.params) for e in spec.experts}},
        ),
        seed=spec.seed,
        budget_bytes=plan.budget_bytes,
        cost=Cost(
            estimated=ByteCost(
                plan.cost.base_bytes,
                plan.cost.expert_bytes,
                plan.cost.output_bytes,
                None if plan.seconds is None else plan.seconds.flat(),
            ),
            realized=realized,
        ),
        error_bound=ErrorBound(
            estimated=plan.error_bound,
            # every changed block read: the result is the full-read merge
            realized=0.0 if everything_read else None,
            kind=f"{plan.error_bound_kind}: frobenius norm of the fp32 merged delta omitted vs the full-read merge",
        ),
        reads={t: {e: compress_indices(ix) for e, ix in per.items() if ix} for t, per in plan.reads.items()},
        files=files,
        software=SoftwareVersions.current(),
        created_at=created_at,
        extra=_extra(plan, inputs or InputRecords()),
        schema=schema,
    )


def _extra(plan: Plan, inputs: InputRecords) -> dict:
    """The manifest's ``extra``: planning choices (the budget as it was written: the plan's digest holds
    the text, so a config file rerunning the merge must say it so), the format of the card and config file
    written beside it (``manifest/manifest.py``), the base's name, and the plan's warnings when it has any."""
    extra: dict[str, Any] = {
        "policy": plan.policy,
        "out_dtype": plan.out_dtype,
        "block_bytes": plan.block_bytes,
        "budget": plan.budget_text,
        "card_format": CARD_FORMAT,
    }
    if inputs.base_name is not None:
        extra["base_name"] = inputs.base_name
    if inputs.expert_names:  # only when an expert's name is not its id (other manifests keep their hashes)
        extra["expert_names"] = dict(sorted(inputs.expert_names.items()))
    if inputs.kinds:  # only when an expert is not a full checkpoint (other manifests keep their hashes)
        extra["expert_kinds"] = dict(sorted(inputs.kinds.items()))
    if inputs.adapters:  # only when an expert is a LoRA adapter
        extra["lora"] = dict(sorted(inputs.adapters.items()))
    if inputs.hub_commits:  # only when an input came from the Hub
        extra["hub_commits"] = dict(sorted(inputs.hub_commits.items()))
    # output options, only when set (so that other manifests, and their hashes, stay as they were)
    if plan.out_shard_bytes is not None:
        extra["out_shard_bytes"] = plan.out_shard_bytes
    if plan.chat_template is not None:
        extra["chat_template"] = plan.chat_template
    if not plan.copy_tokenizer:
        extra["copy_tokenizer"] = False
    if plan.copies is not None:  # a passthrough: its slices and every output tensor's source
        extra["passthrough"] = plan.copies.to_json()
    warnings = [note for note in plan.notes if note.startswith("warning: ")]
    if warnings:
        extra["warnings"] = warnings
    if plan.reuse is not None:  # an incremental merge: what it took from the previous snapshot
        extra["reuse"] = {
            "snapshot": plan.reuse.snapshot,
            "manifest": plan.reuse.manifest_hash,
            "blocks": plan.reuse.block_count,
            "bytes": plan.reuse.output_bytes,
            "expert_bytes_saved": dict(sorted(plan.reuse.saved.items())),
        }
        if plan.reuse.updated:  # delta updates: not the from-scratch bytes, within the bound
            extra["reuse"]["delta_updated"] = {
                "blocks": {t: compress_indices(ix) for t, ix in sorted(plan.reuse.updated.items())},
                "replaced": dict(sorted(plan.reuse.replaced.items())),
                "bound": plan.reuse.bound,
            }
    return extra


def record_timing(catalog: Catalog, intent_id: str, plan: Plan, realized: RealizedCost, device: str) -> None:
    """Record what this merge took on ``device`` here (the engine's ``total``, for the expert bytes it read and
    the output bytes it wrote, which leaves out files an incremental merge reflinked from its previous snapshot):
    the row the time model of its operator is fitted to (``planner/planner.py``), in the commit's transaction."""
    timing = Timing(realized.expert_bytes, realized.bytes_made, realized.seconds.get("total", 0.0))
    if timing.seconds > 0:
        catalog.timings.add_merge(intent_id, host_key(), device, plan.operator, timing)


#: The largest output shard when the plan sets none: mergekit's and transformers' default (5 GB).
DEFAULT_SHARD_BYTES = 5 * 10**9


@dataclass(frozen=True)
class _Piece:
    """One block of a source tensor, and the output tensor it goes to."""

    copy: TensorCopy
    entry: TensorEntry
    block: BlockSpec


@dataclass(frozen=True)
class _Sources:
    """The plan's opened sources, the tag each one's reads are counted under and its recorded hashes."""

    checkpoints: Mapping[str, Checkpoint]
    tags: Mapping[str, str]
    hashes: Mapping[str, Mapping[str, list[str | None]]]

    def entry(self, copy: TensorCopy) -> TensorEntry:
        return self.checkpoints[copy.model].tensor(copy.tensor)


def copy_snapshot(
    catalog: Catalog, plan: Plan, staging: Path, window_bytes: int, io_threads: int, progress: bool
) -> tuple[RealizedCost, dict[str, str]]:
    """Write the copy plan ``plan``'s weight files and side files into ``staging``; the realized cost
    (checked against the plan) and each weight file's hash, streamed as it was written."""
    copies = plan.copies
    assert copies is not None, "copy_snapshot executes copy plans"
    models = list(dict.fromkeys([plan.base.id, *copies.models]))
    # each checked against its registration; the base's side files too: the output gets them
    checkpoints = {m: open_registered(catalog, m, sides=m == plan.base.id) for m in models}
    sources = _Sources(
        checkpoints,
        {m: BASE_TAG if m == plan.base.id else m for m in models},
        {m: catalog.blocks.hashes(m) for m in models},
    )
    entries = {c.output: sources.entry(c) for c in copies.copies}
    base = checkpoints[plan.base.id]
    layout = packed_layout(
        [(name, _out_bytes(plan, e)) for name, e in entries.items()],
        plan.out_shard_bytes or DEFAULT_SHARD_BYTES,
        base.files[0].header.metadata,
    )
    shards = {
        f.name: create_shard(
            staging / f.name, [(n, output_dtype(plan, entries[n]), entries[n].shape) for n in f.tensors], f.metadata
        )
        for f in layout.files
    }
    hashers = file_hashers(shards)
    remote = any(isinstance(c.root, RemotePath) for c in checkpoints.values())
    seconds = {"read_wait": 0.0, "compute": 0.0, "write": 0.0, "write_wait": 0.0}
    written = 0
    bar = byte_progress("copy", plan.cost.output_bytes, progress)
    with CheckpointSource(TransferMeter() if remote else None) as source, bar as advance:
        readahead = ReadAhead(source, io_threads, window_bytes, on_read=_verifier(sources))
        by_name = {c.output: c for c in copies.copies}
        for file in layout.files:
            items = _items(plan, sources, [by_name[n] for n in file.tensors])
            written += _write_file(plan, shards[file.name], hashers, readahead.run(items), seconds, advance)
        by_tag, requests = source.bytes_by_tag(), source.requests_by_tag()
    write_side_files(plan, base, layout, sum(_out_bytes(plan, e) for e in entries.values()), staging)
    header_bytes = sum(shard.data_start for shard in shards.values())
    return _copying_realized(plan, by_tag, requests, header_bytes + written, seconds), file_digests(hashers)


def _out_bytes(plan: Plan, entry: TensorEntry) -> int:
    return entry.numel * DTYPE_SIZES[output_dtype(plan, entry)]


def _items(plan: Plan, sources: _Sources, copies: list[TensorCopy]) -> Iterator[WorkItem]:
    """A read per block of each source tensor, with the check of its recorded hash."""
    for copy in copies:
        entry = sources.entry(copy)
        recorded = sources.hashes[copy.model][copy.tensor]
        path = sources.checkpoints[copy.model].file_of(copy.tensor).path
        for block in tensor_blocks(entry, plan.block_bytes):
            if not block.nbytes:  # an empty tensor needs no bytes
                continue
            digest = recorded[block.index]
            assert digest is not None, "a copy plan is made only once its sources are hashed (copy_plan.py)"
            check = BlockCheck(block.index, block.begin, block.end, digest)
            read = ByteRange(path, block.begin, block.end, sources.tags[copy.model], copy.tensor, (check,))
            yield WorkItem(_Piece(copy, entry, block), [read])


def _write_file(
    plan: Plan,
    shard: ShardLayout,
    hashers: Mapping[str, FileHash],
    fetches: Iterator[Fetched],
    seconds: dict[str, float],
    advance: Advance,
) -> int:
    """Write one output shard from its fetched source blocks; the data bytes written."""
    writer = ShardWriter(shard, hasher=hashers[shard.path.name])
    with writer:
        with WriteBehind() as behind:  # written (and hashed) on its own thread while the next block is read
            while True:
                started = time.perf_counter()
                fetched = next(fetches, None)
                seconds["read_wait"] += time.perf_counter() - started
                if fetched is None:
                    break
                piece: _Piece = fetched.item.payload
                entry, block, dtype = piece.entry, piece.block, output_dtype(plan, piece.entry)
                offset = block.row_start * entry.row_numel * DTYPE_SIZES[dtype]
                if dtype == entry.dtype:  # the source's bytes as they are: the buffer goes back once written
                    behind.write(writer, piece.copy.output, offset, fetched.views[0], fetched.release)
                    advance(block.nbytes, piece.copy.output)
                    continue
                started = time.perf_counter()
                shape = (block.num_rows, *entry.shape[1:]) if len(entry.shape) >= 2 else entry.shape
                data = to_bytes(to_float32(fetched.views[0], entry.dtype, shape), dtype)
                fetched.release()
                seconds["compute"] += time.perf_counter() - started
                behind.write(writer, piece.copy.output, offset, data)
                advance(len(data), piece.copy.output)
        seconds["write"] += behind.write_seconds
        seconds["write_wait"] += behind.wait_seconds
        writer.finish()
        return writer.bytes_written


def _verifier(sources: _Sources) -> Callable[[WorkItem, list[memoryview]], None]:
    """The read-ahead's ``on_read``: every block must hash to what analysis recorded."""
    model_of = {tag: model for model, tag in sources.tags.items()}

    def verify(item: WorkItem, views: list[memoryview]) -> None:
        for read, view in zip(item.reads, views):
            for check in read.checks:
                if block_digest(view[check.begin - read.begin : check.end - read.begin]) != check.digest:
                    raise ModelChangedError(
                        f"model '{model_of[read.tag]}' changed on disk since it was analysed: block {check.index} "
                        f"of tensor '{read.tensor}' in {read.path} no longer matches its recorded hash; nothing "
                        "was published. Re-register it (`mergepipe register --force`), analyse it and plan again"
                    )

    return verify


def _copying_realized(
    plan: Plan, by_tag: Mapping[str, int], requests: Mapping[str, int], output_bytes: int, seconds: dict[str, float]
) -> RealizedCost:
    """The realized cost, which must be the plan's: a copy reads exactly what its map names."""
    experts = {e.id: by_tag.get(e.id, 0) for e in plan.experts}
    base_bytes = by_tag.get(BASE_TAG, 0)
    if experts != plan.cost.expert_bytes_by_model or base_bytes != plan.cost.base_bytes:
        raise EngineError(
            f"internal error: the copy read {base_bytes} base bytes and {experts} of the other "
            f"sources, not the planned {plan.cost.base_bytes} and {plan.cost.expert_bytes_by_model}; "
            "please report it"
        )
    return RealizedCost(
        base_bytes=base_bytes,
        expert_bytes=sum(experts.values()),
        output_bytes=output_bytes,
        expert_bytes_by_model=experts,
        seconds=seconds,
        requests_by_model={plan.base.id if tag == BASE_TAG else tag: n for tag, n in requests.items()},
    )


#: Reads in flight at once: enough to keep one disk busy while two cores compute.
DEFAULT_IO_THREADS = 2
#: Reads in flight per worker at most, whatever the memory bound allows: further ahead the disk is no faster,
#: and every buffer is memory first touched (page faults) and held.
MAX_READ_AHEAD_BYTES = 256 * 1024 * 1024
#: The smallest memory bound that leaves room for a few 1 MiB blocks per expert.
MIN_MAX_MEMORY = 16 * 1024 * 1024
#: (tensor, block) -> what the units measured of each output block.
Outputs = dict[tuple[str, int], BlockOutput]


class Engine:
    """Runs plans. ``Engine(catalog, out=..., model_id=...).execute(plan)``
    returns ``(snapshot_id, manifest)``."""

    # keyword-only options with defaults, each set alone by its callers (PLR0913); the app layer's
    # `Execution` is their user-facing form
    def __init__(  # noqa: PLR0913
        self,
        catalog: Catalog,
        *,
        out: str | os.PathLike[str] | None = None,
        model_id: str | None = None,
        device: str = "cpu",
        max_memory: str | int = DEFAULT_MAX_MEMORY,
        io_threads: int = DEFAULT_IO_THREADS,
        threads: int | None = None,
        executor: Executor | None = None,
        unit_bytes: int | None = None,
        progress: bool = False,
        on_step: Callable[[str], None] | None = None,
    ) -> None:
        self.catalog = catalog
        self.out = out
        self.model_id = model_id
        self.device = compute_device(device)
        self.max_memory_bytes = parse_size(max_memory, what="--max-memory")
        if self.max_memory_bytes < MIN_MAX_MEMORY:
            raise ConfigError(f"--max-memory must be at least 16MiB, got {max_memory}")
        self.io_threads = io_threads
        self.threads = threads
        self.executor = executor or LocalExecutor()
        self.unit_bytes = unit_bytes  # None: balanced for the executor's workers (workunits.balanced_target)
        self.progress = progress
        self.txn = TransactionManager(on_step=on_step)

    # ------------------------------------------------------------------ API

    def execute(
        self,
        plan: Plan,
        out: str | os.PathLike[str] | None = None,
        model_id: str | None = None,
        replace: bool = False,
    ) -> tuple[str, Manifest]:
        """Execute ``plan`` into ``out`` as model ``model_id``; publish and commit.

        A plan executed before re-materialises its snapshot at ``out`` (module docstring): as the
        snapshot's own model when ``model_id`` is omitted or names it (or its family), else as the alias
        ``model_id``. ``replace``: ``out`` may exist (the caller checked what it holds) and is swapped for
        the snapshot atomically (``txn/publish.py``)."""
        out = out if out is not None else self.out
        model_id = model_id if model_id is not None else self.model_id
        if out is None:
            raise ConfigError("execute needs an output directory (--out)")
        out_path = resolve_output(out) if replace else refuse_existing(out)  # before any work; stage() checks again
        done = self.catalog.snapshots.committed_for_plan(plan.digest)
        refuse_inside_models(
            self.catalog, out_path, may_restore=() if done is None else (_committed_id(done),), replacing=replace
        )
        alias = None
        if done is not None:
            alias = self._alias_of(done, model_id)
            model_id = done.model_id  # the manifest, rewritten as recorded, names the snapshot's own model
        elif model_id is None:
            raise ConfigError(f"plan {plan.digest[:12]} was never executed: give the merged model's id (--model-id)")
        else:
            check_model_id(model_id)
            model_id = self.catalog.models.next_snapshot_id(model_id)  # "merged", then "merged@2", ...
        try:
            self._check_fresh(plan)
        except ModelChangedError as exc:  # a snapshot is made only from the exact inputs it records
            if done is None:
                raise
            raise ModelChangedError(f"snapshot {done.id} cannot be re-materialised: {exc}") from None
        return self._publish(plan, out_path, model_id, done, alias, replace)

    def _publish(
        self,
        plan: Plan,
        out_path: Path,
        model_id: str,
        done: SnapshotRecord | None,
        alias: str | None = None,
        replace: bool = False,
    ) -> tuple[str, Manifest]:
        """Stage, write, seal, publish and commit: a new snapshot, or (``done``) another location of it,
        published as ``alias`` when given."""
        snapshots = self.catalog.snapshots
        if done is None:
            plan_json = plan.to_json_str()

            def record(area: StagingArea) -> None:
                snapshots.add_intent(area.intent_id, plan.digest, plan_json, model_id, out_path, area.path)

            def abort(area: StagingArea) -> None:
                snapshots.abort(area.intent_id)
        else:
            existing = _committed_id(done)

            def record(area: StagingArea) -> None:
                snapshots.add_location_intent(area.intent_id, existing, out_path, area.path, alias)

            def abort(area: StagingArea) -> None:
                snapshots.abort_location(area.intent_id)

        started = time.perf_counter()
        area: StagingArea | None = None
        try:
            with self.txn.staged(out_path, record_intent=record, on_abort=abort, replace=replace) as area:
                try:
                    snapshot_id, manifest, provenance, seconds = self._seal(plan, area, model_id, done)
                except OSError as exc:  # disk full, permissions: the staging area is removed on the way out
                    raise write_failure(out_path, exc) from None
                publish_started = time.perf_counter()

                def commit(staged: StagingArea = area) -> None:  # its timing row commits with it, or neither does
                    with self.catalog.transaction():
                        self._commit(plan, staged, snapshot_id, manifest, model_id, provenance, done, alias)
                        seconds["total"] = time.perf_counter() - started
                        if self.executor.in_process:  # this machine's timings: a merge it ran (not Ray workers)
                            realized = _with_seconds(manifest, seconds).cost.realized
                            record_timing(self.catalog, staged.intent_id, plan, realized, str(self.device))

                self.txn.publish(area, commit=commit)
                seconds["publish"] = time.perf_counter() - publish_started
        except KeyboardInterrupt:  # once renamed into place the snapshot exists: say so, not "aborted"
            if area is None or area.state not in ("published", "committed"):
                raise
            raise InterruptedAfterPublish(out_path, snapshot_id if area.state == "committed" else None) from None
        # timings are outside the manifest hash; the file on disk keeps the
        # pre-publish ones, the returned object carries the complete set
        return snapshot_id, _with_seconds(manifest, seconds)

    def _seal(
        self, plan: Plan, area: StagingArea, model_id: str, done: SnapshotRecord | None
    ) -> tuple[str, Manifest, list[OutputRow], dict[str, float]]:
        """Write every file into the staging area; the snapshot id, the manifest written, the output
        provenance (none for a re-run: it is recorded already) and the phase seconds."""
        realized, outputs, streamed = self._write_snapshot(plan, area)
        # a passthrough's blocks are its sources' (no merge to reuse them from): it records none
        provenance = output_rows(self.catalog, plan, outputs) if done is None and plan.copies is None else []
        hashing = time.perf_counter()
        # a re-run re-makes its snapshot in the schema it was sealed in: one made before blake3 file hashes
        # (schema 1) is hashed again with sha256 so that it can be reproduced; otherwise the weight files were
        # hashed as they were written, and only the small rest is read here
        rerun = None if done is None else (done, Manifest.from_json(done.manifest_data()))  # done is committed
        schema = MANIFEST_SCHEMA if rerun is None else rerun[1].schema
        algorithm = FILE_HASH_OF_SCHEMA[schema]
        files = file_entries(area.path, known=streamed if algorithm == FILE_HASH else None, algorithm=algorithm)
        snapshot_id = snapshot_id_for(plan.digest, files)
        seconds = {**realized.seconds, "hash": time.perf_counter() - hashing}
        realized = replace(realized, seconds=seconds)
        inputs = input_records(self.catalog, plan, realized)
        manifest = build_manifest(plan, model_id, snapshot_id, files, realized, self.catalog.now(), inputs, schema)
        if rerun is not None:
            manifest = _reproduced(plan, *rerun, snapshot_id, manifest)
        manifest.write(area.path)
        # the card and config file name the snapshot: written from the manifest as stored (txn/verify.py)
        for name, text in derived_files(read_manifest(area.path)[0]).items():
            (area.path / name).write_text(text, encoding="utf-8")
        return snapshot_id, manifest, provenance, seconds

    # ------------------------------------------------------------------ steps

    def _check_fresh(self, plan: Plan) -> None:
        """StalePlanError when the catalog or the files moved on since planning."""
        catalog = self.catalog
        if plan.block_bytes != catalog.block_bytes:
            raise StalePlanError(
                f"plan {plan.digest[:12]} was made for {plan.block_bytes}-byte blocks, the catalog uses "
                f"{catalog.block_bytes}; re-plan it"
            )
        for ref in plan.experts if plan.copies is None else ():  # a passthrough's sources are only hashed
            if not catalog.stats.is_analyzed(ref.id, plan.base.id):
                raise StalePlanError(
                    f"plan {plan.digest[:12]} is stale: '{ref.id}' is no longer analysed against "
                    f"'{plan.base.id}'; run `mergepipe plan` again"
                )
        for ref in (plan.base, *plan.experts):
            check_unchanged(catalog, ref.id)
            other_side_files = (
                ref is plan.base
                and plan.side_files is not None  # None: planned before they were
                and catalog.models.get(ref.id).side_digests != plan.side_files
            )  # recorded
            if catalog.blocks.content_fingerprint(ref.id) != ref.fingerprint or other_side_files:
                raise StalePlanError(
                    f"plan {plan.digest[:12]} is stale: model '{ref.id}' was re-registered with other "
                    "content since it was planned; run `mergepipe plan` again"
                )
        for expert_id in plan.stores:
            load_store(catalog, plan, expert_id)

    def _alias_of(self, done: SnapshotRecord, model_id: str | None) -> str | None:
        """The alias a re-run publishes the snapshot as: None for the snapshot's own model (``model_id``
        omitted, or naming it: its stored id, its family's name or its ``name@N``); an alias of this
        snapshot registered before, if ``model_id`` names one; else the new alias ``model_id`` (or, after
        a merged family's versions, its next version ``name@N``)."""
        owner = self.catalog.models.get(done.model_id)
        if model_id is None or model_id in (owner.id, owner.name):
            return None
        try:
            known: ModelRecord | None = self.catalog.models.resolve(model_id)
        except UnknownModelError:
            known = None
        if known is not None and known.id == owner.id:
            return None
        if known is not None and self.catalog.models.same_snapshot_as(known.id) == owner.id:
            return known.id
        check_model_id(model_id)
        return self.catalog.models.next_snapshot_id(model_id)

    def _write_snapshot(self, plan: Plan, area: StagingArea) -> tuple[RealizedCost, Outputs, dict[str, str]]:
        """Every output file in the staging area; the realized cost (phase seconds summed), the output
        blocks' hashes and the hash of each weight file, streamed as it was written (none when the units run
        in other processes: the files are hashed after). A passthrough copies its map instead (``copying.py``)."""
        if plan.copies is not None:
            window = min(self.max_memory_bytes // 2, MAX_READ_AHEAD_BYTES)
            with compute_threads(self.threads):
                startup = process_seconds()
                realized, digests = copy_snapshot(self.catalog, plan, area.path, window, self.io_threads, self.progress)
            if startup is not None:
                realized = replace(realized, seconds={**realized.seconds, "startup": startup})
            return realized, {}, digests
        inputs = load_job(self.catalog, plan, self.device)
        placed = place_reused(inputs, area.path)  # the previous snapshot's files, as they are
        layouts = {
            f.name: create_shard(area.path / f.name, inputs.output_entries(f), f.metadata)
            for f in inputs.layout.files
            if f.name not in placed
        }  # the base's, or of plan.out_shard_bytes
        realized, outputs, digests = _run_units(inputs, layouts, self.executor, self._limits, placed)
        copy_side_files(inputs, area.path)
        return realized, outputs, digests

    def merge_in_memory(self, plan: Plan) -> dict[str, dict[str, torch.Tensor]]:
        """The tensors executing ``plan`` would write, per output file, held in memory and published nowhere
        (``mergepipe eval`` of a plan, ``bisect``'s hybrids): each file's buffer is the bytes ``execute``
        would write (the same units, operators and hashes), and the tensors view it. Memory: one copy of
        the output, plus the bounded buffers of a merge."""
        return run_in_memory(self.in_memory_job(plan), self.executor, self._limits)

    def in_memory_job(self, plan: Plan) -> Job:
        """What a merge held in memory needs, checked against the catalog: plain data (no catalog, no open
        file), so another process can run it (``run_in_memory``; a search's trials on Ray workers)."""
        self._check_fresh(plan)
        if not self.executor.in_process:
            raise ConfigError("a merge held in memory runs in this process: use the local executor")
        if plan.copies is not None:
            raise ConfigError(
                f"plan {plan.digest[:12]} is a passthrough (layers copied, nothing computed): "
                "execute it and give its snapshot instead"
            )
        return load_job(self.catalog, plan, self.device)

    @property
    def _limits(self) -> Limits:
        return Limits(self.unit_bytes, self.max_memory_bytes, self.io_threads, self.threads, self.progress)

    def _commit(
        self,
        plan: Plan,
        area: StagingArea,
        snapshot_id: str,
        manifest: Manifest,
        model_id: str,
        provenance: list[OutputRow],
        done: SnapshotRecord | None,
        alias: str | None,
    ) -> None:
        stamps = file_stamps(area.out_path, (f.name for f in manifest.files))  # what `rm` proves files by
        if done is not None:  # another location (of the alias); its current one if the current directory is gone
            if alias is not None and not self.catalog.models.exists(alias):  # a new alias: registered with these
                files: tuple[FileRecord, ...] | None = checkpoint_files(open_checkpoint(area.out_path))
            else:
                files = current_files(self.catalog, alias or done.model_id, area.out_path)
            self.catalog.snapshots.commit_location(area.intent_id, files, stamps)
            return
        content = describe_checkpoint(
            open_checkpoint(area.out_path), model_id, "snapshot", self.catalog.block_bytes, self.catalog.now()
        )
        parents = [(plan.base.id, "base")] + [(e.id, "expert") for e in plan.experts]
        self.catalog.snapshots.commit(
            area.intent_id,
            snapshot_id,
            manifest.manifest_hash,
            canonical_json(manifest.to_json()).decode("utf-8"),
            content,
            parents,
            provenance,
            stamps,
        )


@dataclass(frozen=True)
class Limits:
    """How an execution runs its units: unit size (None: balanced for the workers), memory bound, read
    threads per unit, compute threads (None: torch's default), and whether a bar is drawn."""

    unit_bytes: int | None
    max_memory_bytes: int
    io_threads: int = DEFAULT_IO_THREADS
    threads: int | None = None
    progress: bool = False


def run_in_memory(inputs: Job, executor: Executor, limits: Limits) -> dict[str, dict[str, torch.Tensor]]:
    """``Engine.merge_in_memory`` of a job ``Engine.in_memory_job`` made, in any process: it reads the
    inputs, never the catalog. ``executor`` must run units in this process."""
    layouts = {f.name: memory_shard(f.name, inputs.output_entries(f), f.metadata) for f in inputs.layout.files}
    _run_units(inputs, layouts, executor, limits)
    return {name: memory_tensors(layout) for name, layout in layouts.items()}


@dataclass(frozen=True)
class Placed:
    """An output file placed from the previous snapshot (``place_reused``): how (``storage/writer.py``:
    cloned or copied), its size, its header's bytes, its hash as the previous manifest records it (None when
    that manifest used another algorithm: hashed from disk then), and its blocks."""

    method: str
    size: int
    header_bytes: int
    digest: str | None
    whole: WholeFile


def place_reused(inputs: Job, staging: Path) -> dict[str, Placed]:
    """Each output file that is wholly the previous snapshot's file of the same name, placed into
    ``staging`` instead of being made: every block the previous snapshot's (``items.whole_file``), and the
    header ``create_shard`` would write (so every tensor at the same offsets) byte for byte that file's, at
    the size its manifest records. A reflink, else a copy by the kernel (a file of its own, never a hard
    link), then read back once: PreviousChangedError unless it hashes to what the previous manifest records,
    so no byte edited since it was published is sealed again. Done here, not in units: the staging area
    and the previous snapshot are on this machine's filesystem, wherever the units run."""
    previous = inputs.previous
    placed: dict[str, Placed] = {}
    for file in inputs.layout.files if previous is not None else ():
        assert previous is not None
        whole, published = whole_file(inputs, file), previous.files.get(file.name)
        if whole is None or published is None:
            continue
        header, size = shard_header(inputs.output_entries(file), file.metadata)
        fd = previous.open(file.name)  # through no symbolic link
        try:
            if not size == published.size == os.fstat(fd).st_size or not has_header(fd, header):
                continue
            method = place_file(fd, staging / file.name)
        finally:
            os.close(fd)
        if file_digest(staging / file.name, published.algorithm) != published.digest:
            changed = f"{previous.checkpoint.root}/{file.name} no longer matches its recorded hash"
            raise PreviousChangedError(
                f"the previous snapshot changed after it was published: {changed}; nothing "
                "was published. Merge without --from, or restore the snapshot",
                reason=changed,
            )
        digest = published.digest if published.algorithm == FILE_HASH else None
        placed[file.name] = Placed(method, size, len(header), digest, whole)
    return placed


def _run_units(
    inputs: Job,
    layouts: dict[str, ShardLayout],
    executor: Executor,
    limits: Limits,
    placed: Mapping[str, Placed] | None = None,
) -> tuple[RealizedCost, Outputs, dict[str, str]]:
    """Cut the plan into work units and run them on the executor, writing into ``layouts``; the files
    ``placed`` from the previous snapshot need none."""
    placed = placed or {}
    # each file's hash streamed as it is written; none when the units run in other processes (the files
    # are hashed after) or for a merge held in memory (no file)
    in_memory = any(layout.buffer is not None for layout in layouts.values())
    local = executor.in_process and not in_memory
    hashers = file_hashers(layouts) if local else {}
    files = [f for f in inputs.layout.files if f.name not in placed]
    total = sum(inputs.base.tensor(name).nbytes for f in files for name in f.tensors)
    target = limits.unit_bytes or balanced_target(total, executor.workers)
    units = cut_units(inputs.base, target, files)
    # half the memory bound for reads in flight, shared by the workers; the rest is working tensors
    window = min(limits.max_memory_bytes // 2 // executor.workers, MAX_READ_AHEAD_BYTES)
    # reused runs copied in the kernel by units beside the staged files (Ray's workers read and write them)
    job = UnitJob(inputs, layouts, window, limits.io_threads, hashers, copy_reused=local)
    # beside the bar: remote MB/s and requests; a distributed executor's units done and per-worker rates
    status = _joined(inputs.meter.status if inputs.meter else None, executor.status)
    bar = byte_progress("merge", inputs.plan.cost.output_bytes, limits.progress, status)
    with compute_threads(limits.threads), bar as advance:
        startup = process_seconds()  # process start to the first read: interpreter, imports, catalog, plan
        for name, file in placed.items():
            advance(file.size - file.header_bytes, name)
        records = executor.run(units, UnitTask(job, advance, run_unit)) if units else []
    header_bytes = sum(layout.data_start for layout in layouts.values())
    outputs = {key: value for record in records for key, value in record.outputs.items()}
    for file in placed.values():
        outputs.update(file.whole.outputs)
    realized = _realized(inputs, records, len(units), header_bytes, placed)
    if startup is not None:
        realized = replace(realized, seconds={**realized.seconds, "startup": startup})
    digests = file_digests(hashers)
    digests.update({name: file.digest for name, file in placed.items() if file.digest is not None})
    return realized, outputs, digests


def _realized(
    inputs: Job, records: list[UnitRecord], n_units: int, header_bytes: int, placed: Mapping[str, Placed]
) -> RealizedCost:
    """The realized cost from the units' records and the placed files, checked against the plan."""
    plan = inputs.plan
    if sorted(r.index for r in records) != list(range(n_units)):
        raise EngineError(f"internal error: {len(records)} unit records for {n_units} units; please report it")
    by_tag: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for record in records:
        for tag, n in record.bytes_by_tag.items():
            by_tag[tag] = by_tag.get(tag, 0) + n
        for phase, s in record.seconds.items():
            seconds[phase] = seconds.get(phase, 0.0) + s
    expert_by_model = {e.id: by_tag.get(e.id, 0) for e in plan.experts}
    for expert_id, n in expert_by_model.items():
        if n > plan.expert_bytes_to_read(expert_id):
            # the hard guarantee; reaching this is a bug, never a user error
            raise EngineError(
                f"internal error: read {n} bytes of expert '{expert_id}', more than the planned "
                f"{plan.expert_bytes_to_read(expert_id)}; please report it"
            )
    copied = sum(r.copied_bytes for r in records)  # reused runs the kernel copied (not read)
    reused = by_tag.get(REUSE_TAG, 0) + copied + sum(file.whole.reused_bytes for file in placed.values())
    planned = plan.reuse.output_bytes + plan.reuse.updated_bytes if plan.reuse else 0
    if reused != planned:
        raise EngineError(
            f"internal error: took {reused} bytes of the previous snapshot, not the planned {planned}; please report it"
        )
    output_bytes = header_bytes + sum(r.bytes_written for r in records) + sum(f.size for f in placed.values())
    by_method = {}
    if plan.reuse is not None:  # an incremental merge: how its output got there
        by_method = {method: sum(f.size for f in placed.values() if f.method == method) for method in (LINKED, CLONED)}
        by_method[COPIED] = copied + sum(f.size for f in placed.values() if f.method == COPIED)
        by_method["written"] = output_bytes - sum(by_method.values())
    return RealizedCost(
        base_bytes=by_tag.get(BASE_TAG, 0),
        expert_bytes=sum(expert_by_model.values()),
        output_bytes=output_bytes,
        expert_bytes_by_model=expert_by_model,
        seconds=seconds,
        requests_by_model=requests_by_model(records, plan.base.id),
        output_bytes_by_method=by_method,
    )


def _committed_id(snapshot: SnapshotRecord) -> str:
    """The id of a committed snapshot (what ``committed_for_plan`` returns): set once it is committed."""
    assert snapshot.id is not None, f"snapshot intent {snapshot.intent_id} is not committed"
    return snapshot.id


def _reproduced(plan: Plan, done: SnapshotRecord, recorded: Manifest, snapshot_id: str, manifest: Manifest) -> Manifest:
    """The recorded manifest of ``done`` when this run reproduced it (snapshot id and manifest hash);
    EngineError otherwise: a re-run that differs must never pass for the same snapshot."""
    if snapshot_id == done.id and manifest.manifest_hash == done.manifest_hash == recorded.manifest_hash:
        return recorded
    if snapshot_id != done.id:
        what = f"the output files differ (snapshot id {snapshot_id})"
    else:
        now, then = json.loads(manifest.canonical_bytes()), json.loads(recorded.canonical_bytes())
        what = "the manifest differs in " + ", ".join(
            sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))
        )
    raise EngineError(
        f"re-executing plan {plan.digest[:12]} did not reproduce its snapshot {done.id}: {what}; nothing was "
        "published. An input's bytes or the software changed since; re-plan to make a new merge (a base an earlier "
        "release registered records its side files only once registered again: run `mergepipe register` on it "
        "first), or report it"
    )


def _joined(*statuses: Callable[[], str] | None) -> Callable[[], str]:
    """One status line for the progress bar from several sources (the empty ones left out)."""
    return lambda: " · ".join(text for status in statuses if status and (text := status()))


def _with_seconds(manifest: Manifest, seconds: dict[str, float]) -> Manifest:
    realized = replace(manifest.cost.realized, seconds=seconds)
    return replace(manifest, cost=replace(manifest.cost, realized=realized))


def compute_device(name: str) -> torch.device:
    """The torch device ``--device`` names; ConfigError when it is not cpu or cuda[:N], or when no CUDA device is
    there (the app layer asks first, before any I/O)."""
    if device_name(name).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    return torch.device(name)
