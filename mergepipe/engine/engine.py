"""Execute a plan (``Engine.execute``): refuse a stale plan or a taken output, stage, place the previous
snapshot's wholly reused files, create the shards with their headers, run the units on an executor, check
their records against the plan, copy the side files, seal the manifest, publish and commit (the order is
docs/ARCHITECTURE.md's "Publish"). A plan executed before gives its snapshot again, byte for byte.
``merge_in_memory`` runs the same units into shards held in memory."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mergepipe.analysis.experts import LORA, adapter_summary, check_unchanged, checkpoint_files, describe_checkpoint
from mergepipe.analysis.provenance import BlockOutput, OutputRow, output_rows
from mergepipe.analysis.register import check_model_id
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import FileRecord, ModelRecord, SnapshotRecord, Timing
from mergepipe.catalog.snapshots import host_key
from mergepipe.engine import DEFAULT_MAX_MEMORY, device_name
from mergepipe.engine.job import BASE_TAG, REUSE_TAG, Job, balanced_target, cut_units, load_job, load_store, whole_file
from mergepipe.engine.stream import Executor, LocalExecutor, UnitJob, UnitRecord, UnitTask, process_seconds, run_unit
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
from mergepipe.manifest.manifest import (
    CARD_FORMAT,
    DTYPE_NAMES,
    FILE_HASH_OF_SCHEMA,
    MANIFEST_SCHEMA,
    ByteCost,
    Cost,
    ErrorBound,
    ExpertRef,
    FileEntry,
    Manifest,
    OperatorSpec,
    RealizedCost,
    SoftwareVersions,
    read_manifest,
    derived_files,
    snapshot_id_for,
)
from mergepipe.runtime import byte_progress, compute_threads
from mergepipe.sizes import parse_size
from mergepipe.spec.canonical import canonical_json, compress_indices
from mergepipe.spec.plan import Plan
from mergepipe.storage.checkpoint import INDEX_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILES, index_text, open_checkpoint
from mergepipe.storage.format import DTYPE_SIZES
from mergepipe.storage.location import HUB_COMMIT, RemotePath, location
from mergepipe.storage.remote import RemoteClient, copy_file, read_file
from mergepipe.storage.source import FILE_HASH, FileHash, file_digest
from mergepipe.storage.writer import (
    CLONED,
    COPIED,
    LINKED,
    ShardLayout,
    create_shard,
    has_header,
    memory_shard,
    open_inside,
    place_file,
    shard_header,
)
from mergepipe.storage.writer import tensors as memory_tensors
from mergepipe.txn.outpath import refuse_inside_models
from mergepipe.txn.publish import StagingArea, TransactionManager, refuse_existing, resolve_output, write_failure
from mergepipe.txn.recover import current_files
from mergepipe.txn.verify import file_entries, file_stamps

#: Reads in flight per worker at most, whatever the memory bound allows: further ahead the disk is no faster,
#: and every buffer is memory first touched and held.
MAX_READ_AHEAD_BYTES = 256 * 1024 * 1024
#: The smallest memory bound that leaves room for a few 1 MiB blocks per expert.
MIN_MAX_MEMORY = 16 * 1024 * 1024
#: transformers reads a chat template from this file in preference to tokenizer_config.json's.
_CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: A Hugging Face Hub repository id, and the folder the Hub's cache keeps a repository in.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_HUB_CACHE = re.compile(r"^models--([A-Za-z0-9][A-Za-z0-9._-]*)--([A-Za-z0-9][A-Za-z0-9._-]*)$")
Outputs = dict[tuple[str, int], BlockOutput]  # (tensor, block) -> what the units measured of each output block


class Engine:
    """Runs plans: ``Engine(catalog).execute(plan, out, model_id)`` returns ``(snapshot_id, manifest)``."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        device: str = "cpu",
        max_memory: str | int = DEFAULT_MAX_MEMORY,
        threads: int | None = None,
        executor: Executor | None = None,
        unit_bytes: int | None = None,
        progress: bool = False,
        on_step: Callable[[str], None] | None = None,
    ) -> None:
        self.catalog = catalog
        self.device = compute_device(device)
        max_memory_bytes = parse_size(max_memory, what="--max-memory")
        if max_memory_bytes < MIN_MAX_MEMORY:
            raise ConfigError(f"--max-memory must be at least 16MiB, got {max_memory}")
        self.executor = executor or LocalExecutor()
        self.limits = Limits(unit_bytes, max_memory_bytes, threads, progress)
        self.txn = TransactionManager(on_step=on_step)

    def execute(
        self, plan: Plan, out: str | os.PathLike[str], model_id: str | None = None, replace: bool = False
    ) -> tuple[str, Manifest]:
        """Execute ``plan`` into ``out`` as ``model_id``, publish and commit (``replace``: swap ``out`` for it)."""
        out_path = resolve_output(out) if replace else refuse_existing(out)  # before any work; stage() checks again
        done = self.catalog.snapshots.committed_for_plan(plan.digest)  # a committed snapshot: it has an id
        refuse_inside_models(
            self.catalog, out_path, may_restore=() if done is None else (str(done.id),), replacing=replace
        )
        alias = None
        if done is not None:
            alias = self._alias_of(done, model_id)
            model_id = done.model_id  # the manifest, as recorded, names the snapshot's own model
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
        snapshots, plan_json = self.catalog.snapshots, plan.to_json_str()

        def record(area: StagingArea) -> None:
            if done is None:
                snapshots.add_intent(area.intent_id, plan.digest, plan_json, model_id, out_path, area.path)
            else:
                snapshots.add_location_intent(area.intent_id, str(done.id), out_path, area.path, alias)

        def abort(area: StagingArea) -> None:
            (snapshots.abort if done is None else snapshots.abort_location)(area.intent_id)

        started = time.perf_counter()
        area: StagingArea | None = None
        try:
            with self.txn.staged(out_path, record_intent=record, on_abort=abort, replace=replace) as area:
                try:
                    manifest, provenance, seconds = self._seal(plan, area, model_id, done)
                    snapshot_id = manifest.snapshot_id
                except OSError as exc:  # disk full, permissions: the staging area is removed on the way out
                    raise write_failure(out_path, exc) from None
                publish_started = time.perf_counter()

                def commit(staged: StagingArea = area) -> None:  # its timing row commits with it, or neither does
                    with self.catalog.transaction():
                        self._commit(staged, manifest, provenance, done, alias)
                        seconds["total"] = time.perf_counter() - started
                        if self.executor.in_process:  # this machine's timings: a merge it ran (not Ray workers)
                            realized = dataclasses.replace(manifest.cost.realized, seconds=seconds)
                            record_timing(self.catalog, staged.intent_id, plan, realized, str(self.device))

                self.txn.publish(area, commit=commit)
                seconds["publish"] = time.perf_counter() - publish_started
            # this run's timings (outside the hash): the file keeps the pre-publish ones, a re-run's its first run's
            realized = dataclasses.replace(manifest.cost.realized, seconds=seconds)
            manifest = dataclasses.replace(manifest, cost=dataclasses.replace(manifest.cost, realized=realized))
        except KeyboardInterrupt:  # once renamed into place the snapshot exists: say so, not "aborted"
            if area is None or area.state not in ("published", "committed"):
                raise
            raise InterruptedAfterPublish(out_path, snapshot_id if area.state == "committed" else None) from None
        return snapshot_id, manifest

    def _seal(
        self, plan: Plan, area: StagingArea, model_id: str, done: SnapshotRecord | None
    ) -> tuple[Manifest, list[OutputRow], dict[str, float]]:
        inputs = load_job(self.catalog, plan, self.device)
        placed = place_reused(inputs, area.path)  # the previous snapshot's files, as they are
        layouts = {
            f.name: create_shard(area.path / f.name, inputs.output_entries(f), f.metadata)
            for f in inputs.layout.files
            if f.name not in placed
        }
        realized, outputs, streamed = _run_units(inputs, layouts, self.executor, self.limits, placed)
        copy_side_files(inputs, area.path)
        provenance = output_rows(self.catalog, plan, outputs) if done is None and plan.copies is None else []
        hashing = time.perf_counter()
        # a re-run re-makes its snapshot in the schema it was sealed in (schema 1: sha256 file hashes, read
        # again); otherwise the weight files were hashed as they were written and only the rest is read here
        rerun = None if done is None else Manifest.from_json(done.manifest_data())
        schema = MANIFEST_SCHEMA if rerun is None else rerun.schema
        algorithm = FILE_HASH_OF_SCHEMA[schema]
        files = file_entries(area.path, known=streamed if algorithm == FILE_HASH else None, algorithm=algorithm)
        seconds = {**realized.seconds, "hash": time.perf_counter() - hashing}
        realized = dataclasses.replace(realized, seconds=seconds)
        manifest = _manifest(self.catalog, plan, model_id, files, realized, schema)
        if done is not None and rerun is not None:
            manifest = _reproduced(plan, done, rerun, manifest)
        manifest.write(area.path)
        # the card and config file name the snapshot: written from the manifest as stored (txn/verify.py)
        for name, text in derived_files(read_manifest(area.path)[0]).items():
            (area.path / name).write_text(text, encoding="utf-8")
        return manifest, provenance, seconds

    def _commit(
        self,
        area: StagingArea,
        manifest: Manifest,
        rows: list[OutputRow],
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
            open_checkpoint(area.out_path), manifest.model_id, "snapshot", self.catalog.block_bytes, self.catalog.now()
        )
        parents = [(manifest.base.id, "base")] + [(e.id, "expert") for e in manifest.experts]
        manifest_json = canonical_json(manifest.to_json()).decode("utf-8")
        self.catalog.snapshots.commit(
            area.intent_id, manifest.snapshot_id, manifest.manifest_hash, manifest_json, content, parents, rows, stamps
        )

    def _check_fresh(self, plan: Plan) -> None:
        """StalePlanError when the catalog or the files moved on since planning."""
        catalog, stale = self.catalog, f"plan {plan.digest[:12]} is stale"
        if plan.block_bytes != catalog.block_bytes:
            raise StalePlanError(
                f"plan {plan.digest[:12]} was made for {plan.block_bytes}-byte blocks, the catalog uses "
                f"{catalog.block_bytes}; re-plan it"
            )
        for ref in plan.experts if plan.copies is None else ():  # a passthrough's sources are only hashed
            if not catalog.stats.is_analyzed(ref.id, plan.base.id):
                raise StalePlanError(
                    f"{stale}: '{ref.id}' is no longer analysed against '{plan.base.id}'; run `mergepipe plan` again"
                )
        for ref in (plan.base, *plan.experts):
            check_unchanged(catalog, ref.id)
            sides = plan.side_files if ref is plan.base else None  # None: planned before side files were recorded
            if catalog.blocks.content_fingerprint(ref.id) != ref.fingerprint or (
                sides is not None and catalog.models.get(ref.id).side_digests != sides
            ):
                raise StalePlanError(
                    f"{stale}: model '{ref.id}' was re-registered with other content since it was planned; "
                    "run `mergepipe plan` again"
                )
        for expert_id in plan.stores:
            load_store(catalog, plan, expert_id)

    def _alias_of(self, done: SnapshotRecord, model_id: str | None) -> str | None:
        """The alias a re-run publishes as: None for the snapshot's own model, else a known or a new alias."""
        models = self.catalog.models
        owner = models.get(done.model_id)
        if model_id is None or model_id in (owner.id, owner.name):
            return None
        try:
            known: ModelRecord | None = models.resolve(model_id)
        except UnknownModelError:
            known = None
        if known is not None and owner.id in (known.id, models.same_snapshot_as(known.id)):
            return None if known.id == owner.id else known.id
        check_model_id(model_id)
        return models.next_snapshot_id(model_id)

    def merge_in_memory(self, plan: Plan) -> dict[str, dict[str, torch.Tensor]]:
        """Per output file, tensors viewing a buffer of the bytes ``execute`` would write; published nowhere."""
        return run_in_memory(self.in_memory_job(plan), self.executor, self.limits)

    def in_memory_job(self, plan: Plan) -> Job:
        """What a merge held in memory needs, checked against the catalog: plain data another process can run."""
        self._check_fresh(plan)
        if not self.executor.in_process:
            raise ConfigError("a merge held in memory runs in this process: use the local executor")
        if plan.copies is not None:
            raise ConfigError(
                f"plan {plan.digest[:12]} is a passthrough (layers copied, nothing computed): "
                "execute it and give its snapshot instead"
            )
        return load_job(self.catalog, plan, self.device)


@dataclass(frozen=True)
class Limits:
    """How units run: size (None: balanced), memory bound, compute threads (None: default), progress bar."""

    unit_bytes: int | None
    max_memory_bytes: int
    threads: int | None = None
    progress: bool = False


def run_in_memory(inputs: Job, executor: Executor, limits: Limits) -> dict[str, dict[str, torch.Tensor]]:
    """``Engine.merge_in_memory`` of a job ``Engine.in_memory_job`` made, in any process (no catalog)."""
    layouts = {f.name: memory_shard(f.name, inputs.output_entries(f), f.metadata) for f in inputs.layout.files}
    _run_units(inputs, layouts, executor, limits, {})
    return {name: memory_tensors(layout) for name, layout in layouts.items()}


@dataclass(frozen=True)
class Placed:
    """An output file placed from the previous snapshot (``digest``: None when recorded in another hash)."""

    method: str
    size: int
    header_bytes: int
    digest: str | None
    outputs: Outputs
    reused_bytes: int


def place_reused(inputs: Job, staging: Path) -> dict[str, Placed]:
    """Each output file wholly the previous snapshot's, placed by a reflink or a kernel copy and checked."""
    previous = inputs.previous
    placed: dict[str, Placed] = {}
    for file in inputs.layout.files:
        if previous is None:
            break
        whole, published = whole_file(inputs, file), previous.files.get(file.name)
        if whole is None or published is None:
            continue
        header, size = shard_header(inputs.output_entries(file), file.metadata)
        fd = open_inside(previous.root, file.name)  # through no symbolic link
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
        placed[file.name] = Placed(method, size, len(header), digest, *whole)
    return placed


def _run_units(
    inputs: Job, layouts: dict[str, ShardLayout], executor: Executor, limits: Limits, placed: Mapping[str, Placed]
) -> tuple[RealizedCost, Outputs, dict[str, str]]:
    """Run the plan's units into ``layouts``; the realized cost, the output blocks and the streamed file hashes."""
    # each file's hash streamed as units in this process write it (its header is in the file already)
    local = executor.in_process and all(layout.buffer is None for layout in layouts.values())
    hashers = {name: FileHash(layout.path, layout.file_size) for name, layout in layouts.items()} if local else {}
    for name, hasher in hashers.items():
        hasher.add(0, length=layouts[name].data_start)
    files = [f for f in inputs.layout.files if f.name not in placed]
    total = sum(inputs.tensor(name).nbytes for f in files for name in f.tensors)
    units = cut_units(inputs, limits.unit_bytes or balanced_target(total, executor.workers), files)
    # half the memory bound for reads in flight, shared by the workers; the rest is working tensors
    window = min(limits.max_memory_bytes // 2 // executor.workers, MAX_READ_AHEAD_BYTES)
    # reused runs copied by the kernel where units run beside the staged files (Ray's workers read them)
    job = UnitJob(inputs, layouts, window, hashers, copy_reused=local)
    # beside the bar: remote MB/s and requests; a distributed executor's units done and per-worker rates
    statuses = [s for s in (inputs.meter.status if inputs.meter else None, executor.status) if s is not None]

    def status() -> str:
        return " · ".join(text for line in statuses if (text := line()))

    label = "copy" if inputs.copies else "merge"
    bar = byte_progress(label, inputs.plan.cost.output_bytes, limits.progress, status)
    with compute_threads(limits.threads), bar as advance:
        startup = process_seconds()  # process start to the first read: interpreter, imports, catalog, plan
        for name, file in placed.items():
            advance(file.size - file.header_bytes, name)
        records = executor.run(units, UnitTask(job, advance, run_unit)) if units else []
    outputs = {key: value for record in records for key, value in record.outputs.items()}
    for file in placed.values():
        outputs.update(file.outputs)
    header_bytes = sum(layout.data_start for layout in layouts.values())
    realized = _realized(inputs, records, len(units), header_bytes, placed)
    if startup is not None:
        realized = dataclasses.replace(realized, seconds={**realized.seconds, "startup": startup})
    try:
        digests = {name: hasher.hexdigest() for name, hasher in hashers.items()}
    except ValueError as exc:  # every unit finished, so every byte was written: a bug, never a user error
        raise EngineError(f"internal error: {exc}; please report it") from None
    digests.update({name: file.digest for name, file in placed.items() if file.digest is not None})
    return realized, outputs, digests


def _realized(
    inputs: Job, records: list[UnitRecord], n_units: int, header_bytes: int, placed: Mapping[str, Placed]
) -> RealizedCost:
    """The realized cost, checked against the plan: no expert read beyond it (a passthrough: exactly it)."""
    plan = inputs.plan
    if sorted(r.index for r in records) != list(range(n_units)):
        raise EngineError(f"internal error: {len(records)} unit records for {n_units} units; please report it")
    by_tag: Counter[str] = Counter()
    seconds: Counter[str] = Counter()
    requests: Counter[str] = Counter()
    for record in records:
        by_tag.update(record.bytes_by_tag)
        seconds.update(record.seconds)
        requests.update({plan.base.id if tag == BASE_TAG else tag: n for tag, n in record.requests_by_tag.items()})
    expert_by_model = {e.id: by_tag.get(e.id, 0) for e in plan.experts}
    checked = [(f"expert '{e}'", n, plan.expert_bytes_to_read(e)) for e, n in expert_by_model.items()]
    if plan.copies is not None:  # a copy reads exactly what its map names, of the base too
        checked.append(("the base", by_tag.get(BASE_TAG, 0), plan.cost.base_bytes))
    for what, n, planned in checked:
        if n > planned or (plan.copies is not None and n != planned):  # the hard guarantee: a bug, never the user's
            more = "more than" if n > planned else "not"
            raise EngineError(
                f"internal error: read {n} bytes of {what}, {more} the planned {planned}; please report it"
            )
    copied = sum(r.copied_bytes for r in records)  # reused runs the kernel copied (not read)
    reused = by_tag.get(REUSE_TAG, 0) + copied + sum(file.reused_bytes for file in placed.values())
    planned_reuse = plan.reuse.output_bytes + plan.reuse.updated_bytes if plan.reuse else 0
    if reused != planned_reuse:
        raise EngineError(
            f"internal error: took {reused} bytes of the previous snapshot, not the planned {planned_reuse}; "
            "please report it"
        )
    output_bytes = header_bytes + sum(r.bytes_written for r in records) + sum(f.size for f in placed.values())
    by_method = {}
    if plan.reuse is not None:  # an incremental merge: how its output got there
        by_method = {m: sum(f.size for f in placed.values() if f.method == m) for m in (LINKED, CLONED)}
        by_method[COPIED] = copied + sum(f.size for f in placed.values() if f.method == COPIED)
        by_method["written"] = output_bytes - sum(by_method.values())
    return RealizedCost(
        base_bytes=by_tag.get(BASE_TAG, 0),
        expert_bytes=sum(expert_by_model.values()),
        output_bytes=output_bytes,
        expert_bytes_by_model=expert_by_model,
        seconds=dict(seconds),
        requests_by_model=dict(requests),
        output_bytes_by_method=by_method,
    )


def _reproduced(plan: Plan, done: SnapshotRecord, recorded: Manifest, manifest: Manifest) -> Manifest:
    """``done``'s recorded manifest when this run reproduced it; EngineError (nothing published) otherwise."""
    snapshot_id = manifest.snapshot_id
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


def compute_device(name: str) -> torch.device:
    """The torch device ``--device`` names; ConfigError unless it is cpu or cuda[:N] and there."""
    if device_name(name).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    return torch.device(name)


def record_timing(catalog: Catalog, intent_id: str, plan: Plan, realized: RealizedCost, device: str) -> None:
    """The row the time model is fitted to (``planner/planner.py``), in the commit's transaction."""
    timing = Timing(realized.expert_bytes, realized.bytes_made, realized.seconds.get("total", 0.0))
    if timing.seconds > 0:
        catalog.timings.add_merge(intent_id, host_key(), device, plan.operator, timing)


# ------------------------------------------------------------------ what a snapshot holds besides tensors


def copy_side_files(inputs: Job, staging: Path) -> None:
    """The base's side files (not its card; config and chat template as the plan says), the shards' index."""
    plan, base = inputs.plan, inputs.base
    out_dtype, template = plan.out_dtype, plan.chat_template
    client = RemoteClient() if isinstance(base.root, RemotePath) else None  # one listing of a remote base's files
    for name in base.aux_files:
        if not plan.copy_tokenizer and name in TOKENIZER_FILES:
            continue
        source = base.root / name
        if template is not None and name in (TOKENIZER_CONFIG_FILE, _CHAT_TEMPLATE_FILE):
            _write_chat_template(source, staging / name, template, client)
        elif name == "config.json" and (out_dtype is not None or plan.copies is not None):
            config = json.loads(read_file(source, client))
            for key in ("torch_dtype", "dtype"):
                if key in config and out_dtype is not None:
                    config[key] = DTYPE_NAMES[out_dtype]
            if plan.copies is not None:
                config = plan.copies.output_config(config)
            (staging / name).write_text(json.dumps(config, indent=2) + "\n")
        else:
            copy_file(source, staging / name, client)
    if inputs.layout.indexed:
        sizes = (
            e.numel * DTYPE_SIZES[inputs.output_dtype(e)]
            for f in inputs.layout.files
            for n in f.tensors
            for e in (inputs.tensor(n),)
        )
        (staging / INDEX_FILE).write_text(index_text(inputs.layout, sum(sizes)))


def _write_chat_template(source: Path | RemotePath, target: Path, template: str, client: RemoteClient | None) -> None:
    """``template`` in tokenizer_config.json (keys in the base's order) or ``chat_template.jinja``."""
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


def _manifest(
    catalog: Catalog, plan: Plan, model_id: str, files: tuple[FileEntry, ...], realized: RealizedCost, schema: int
) -> Manifest:
    """The manifest of a snapshot of ``plan``; optional ``extra`` keys only where they apply (hashes stay)."""
    spec, cost, reuse = plan.merge, plan.cost, plan.reuse
    names = {m.id: _known_as(catalog, m.id) for m in (plan.base, *plan.experts)}
    kinds = {e.id: k for e in plan.experts if (k := catalog.models.get(e.id).kind) not in ("checkpoint", "snapshot")}
    read = realized.expert_bytes_by_model
    extra: dict[str, Any] = {
        "policy": plan.policy,
        "out_dtype": plan.out_dtype,
        "block_bytes": plan.block_bytes,
        "budget": plan.budget_text,  # as written: a config file rerunning the merge must say it so
        "card_format": CARD_FORMAT,
        "base_name": _base_name(catalog, plan.base.id) or names[plan.base.id][0],
    }
    optional: dict[str, dict[str, Any]] = {
        "expert_names": {e.id: names[e.id][0] for e in plan.experts if names[e.id][0] != e.id},
        "expert_kinds": kinds,
        "lora": {
            e: {**adapter_summary(catalog, e), "factor_bytes_read": read.get(e, 0)} for e in kinds if kinds[e] == LORA
        },
        "hub_commits": {m: f"{name}@{commit}" for m, (name, commit) in names.items() if commit is not None},
    }
    extra.update({key: dict(sorted(value.items())) for key, value in optional.items() if value})
    options = {
        "out_shard_bytes": plan.out_shard_bytes,
        "chat_template": plan.chat_template,
        "copy_tokenizer": None if plan.copy_tokenizer else False,
        "passthrough": None if plan.copies is None else plan.copies.to_json(),
        "warnings": [note for note in plan.notes if note.startswith("warning: ")] or None,
    }
    extra.update({key: value for key, value in options.items() if value is not None})
    if reuse is not None:
        extra["reuse"] = {
            "snapshot": reuse.snapshot,
            "manifest": reuse.manifest_hash,
            "blocks": reuse.block_count,
            "bytes": reuse.output_bytes,
            "expert_bytes_saved": dict(sorted(reuse.saved.items())),
        }
        if reuse.updated:  # delta updates: not the from-scratch bytes, within the bound
            extra["reuse"]["delta_updated"] = {
                "blocks": {t: compress_indices(ix) for t, ix in sorted(reuse.updated.items())},
                "replaced": dict(sorted(reuse.replaced.items())),
                "bound": reuse.bound,
            }
    # every changed block read (none updated from a rounded previous output): the full-read merge
    everything_read = cost.expert_bytes == cost.full_expert_bytes and not (reuse and reuse.updated)
    seconds = None if plan.seconds is None else plan.seconds.flat()
    params = {"global": dict(spec.params), "experts": {e.expert_id: dict(e.params) for e in spec.experts}}
    return Manifest(
        snapshot_id=snapshot_id_for(plan.digest, files),
        model_id=model_id,
        plan_digest=plan.digest,
        base=plan.base,
        experts=tuple(ExpertRef(e.id, e.fingerprint, spec.scalar_weight(e.id)) for e in plan.experts),
        operator=OperatorSpec(spec.operator, params),
        seed=spec.seed,
        budget_bytes=plan.budget_bytes,
        cost=Cost(
            estimated=ByteCost(cost.base_bytes, cost.expert_bytes, cost.output_bytes, seconds), realized=realized
        ),
        error_bound=ErrorBound(
            estimated=plan.error_bound,
            realized=0.0 if everything_read else None,
            kind=f"{plan.error_bound_kind}: frobenius norm of the fp32 merged delta omitted vs the full-read merge",
        ),
        reads={t: {e: compress_indices(ix) for e, ix in per.items() if ix} for t, per in plan.reads.items()},
        files=files,
        software=SoftwareVersions.current(),
        created_at=catalog.now(),
        extra=extra,
        schema=schema,
    )


def _base_name(catalog: Catalog, base_id: str) -> str | None:
    """The Hub id a base's config.json keeps as ``_name_or_path``; None for a merged base or another value."""
    record = catalog.models.get(base_id)
    root = location(record.uri)
    if record.kind == "snapshot" or isinstance(root, RemotePath):
        return None
    try:
        config = json.loads((root / "config.json").read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    named = config.get("_name_or_path") if isinstance(config, dict) else None
    return named if isinstance(named, str) and _HUB_ID.match(named) and ".." not in named else None


def _known_as(catalog: Catalog, model_id: str) -> tuple[str, str | None]:
    """A model's name from where it is (a Hub id, a folder or prefix name) and its Hub commit, if any."""
    root = location(catalog.models.get(model_id).uri)
    if isinstance(root, RemotePath):
        return (root.name, None) if root.hub is None else (root.hub.repo_id, root.hub.commit)
    cached = _HUB_CACHE.match(root.parent.parent.name) if root.parent.name == "snapshots" else None
    if cached is None:
        return root.name, None
    return f"{cached[1]}/{cached[2]}", root.name if HUB_COMMIT.match(root.name) else None
