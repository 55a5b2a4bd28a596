"""Execute a Plan: stream the merge into a staging directory, seal it with a
manifest, publish it atomically and commit it to the catalog.

The order of events, each a contract (DESIGN.md "Snapshot"):

1. refuse a stale plan (input fingerprints or files changed) and an existing
   output path — before anything is written;
2. stage beside the output and record the intent in the catalog;
3. stream every base shard through the operator into a mirrored shard;
   copy config, generation config and tokenizer files from the base;
4. hash the files, write ``manifest.json``;
5. fsync, rename into place, fsync the parent, commit the snapshot row (the
   snapshot is registered as a model whose parents are its inputs).

A failure before the rename removes the staging directory; after it the
snapshot is complete and ``recover`` finishes an interrupted commit.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.register import check_model_id, content_fingerprint
from mergepipe.engine.operators.registry import get_operator
from mergepipe.engine.params import MergeSpec, count_layers
from mergepipe.engine.prefetch import Prefetcher
from mergepipe.engine.stream import BASE_TAG, MergeInputs, StreamStats, output_entries, stream_shard
from mergepipe.errors import ConfigError, EngineError, PublishError, StalePlanError
from mergepipe.manifest.canonical import canonical_json
from mergepipe.manifest.manifest import (
    ByteCost,
    Cost,
    ErrorBound,
    ExpertRef,
    Manifest,
    ModelRef,
    OperatorSpec,
    RealizedCost,
    SoftwareVersions,
    snapshot_id_for,
)
from mergepipe.manifest.ranges import compress_indices
from mergepipe.planner.plan import Plan
from mergepipe.storage.convert import MERGEABLE_DTYPES
from mergepipe.storage.format import DTYPE_SIZES
from mergepipe.storage.reader import BlockReader
from mergepipe.storage.writer import StreamingSafetensorsWriter
from mergepipe.threads import compute_threads
from mergepipe.txn.publish import StagingArea, TransactionManager, refuse_existing
from mergepipe.txn.verify import file_entries
from mergepipe.units import parse_size

#: Default bound on the engine's buffers: reads in flight plus working
#: tensors. Streaming operators never need more than a few blocks per expert.
DEFAULT_MAX_MEMORY = "2GiB"
#: Reads in flight at once: enough to keep one disk busy while two cores compute.
DEFAULT_IO_THREADS = 2
_INDEX_NAME = "model.safetensors.index.json"
_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


@dataclass(frozen=True)
class ExecutionResult:
    """What ``Engine.execute`` returns besides the manifest (for the CLI)."""

    snapshot_id: str
    manifest: Manifest
    out_path: Path
    peak_inflight_bytes: int


class Engine:
    """Runs plans. ``Engine(catalog, out=..., model_id=...).execute(plan)``
    returns ``(snapshot_id, manifest)``."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        out: str | os.PathLike[str] | None = None,
        model_id: str | None = None,
        device: str = "cpu",
        max_memory: str | int = DEFAULT_MAX_MEMORY,
        io_threads: int = DEFAULT_IO_THREADS,
        progress: bool = False,
        on_step: Callable[[str], None] | None = None,
    ) -> None:
        self.catalog = catalog
        self.out = out
        self.model_id = model_id
        self.device = _device(device)
        self.max_memory_bytes = parse_size(max_memory, what="--max-memory")
        if self.max_memory_bytes < 16 * 1024 * 1024:
            raise ConfigError(f"--max-memory must be at least 16MiB, got {max_memory}")
        self.io_threads = io_threads
        self.progress = progress
        self.txn = TransactionManager(on_step=on_step)
        self.last_result: ExecutionResult | None = None

    # ------------------------------------------------------------------ API

    def execute(
        self, plan: Plan, out: str | os.PathLike[str] | None = None, model_id: str | None = None
    ) -> tuple[str, Manifest]:
        """Execute ``plan`` into ``out`` as model ``model_id``; publish and commit."""
        out = out if out is not None else self.out
        model_id = model_id if model_id is not None else self.model_id
        if out is None or model_id is None:
            raise ConfigError("execute needs an output directory (--out) and a model id (--model-id)")
        out_path = refuse_existing(out)  # before any work; stage() checks again
        if self.catalog.model_exists(model_id):
            raise ConfigError(f"model id '{model_id}' is already registered; choose another --model-id")
        check_model_id(model_id)
        self._check_fresh(plan)
        self._check_not_done(plan)
        spec = MergeSpec.from_dict(plan.merge)
        op = get_operator(spec.operator)
        self.catalog.save_plan(plan.digest, plan.to_json_str())
        started = time.perf_counter()
        with self.txn.staged(
            out_path,
            record_intent=lambda area: self.catalog.add_snapshot_intent(
                area.intent_id, plan.digest, model_id, out_path, area.path
            ),
            on_abort=lambda area: self.catalog.abort_snapshot(area.intent_id),
        ) as area:
            realized, stats, peak = self._write_snapshot(plan, spec, op, area)
            hashing = time.perf_counter()
            files = file_entries(area.path)
            snapshot_id = snapshot_id_for(plan.digest, files)
            seconds = dict(stats.seconds)
            seconds["hash"] = time.perf_counter() - hashing
            manifest = self._manifest(plan, spec, model_id, snapshot_id, files, realized, seconds)
            manifest.write(area.path)
            publish_started = time.perf_counter()
            parents = [(plan.base.id, "base")] + [(e.id, "expert") for e in plan.experts]
            self.txn.publish(
                area,
                commit=lambda: self.catalog.commit_snapshot(
                    area.intent_id,
                    snapshot_id,
                    manifest.manifest_hash,
                    canonical_json(manifest.to_json()).decode("utf-8"),
                    parents,
                ),
            )
            seconds["publish"] = time.perf_counter() - publish_started
            seconds["total"] = time.perf_counter() - started
        # timings are outside the manifest hash; the file on disk keeps the
        # pre-publish ones, the returned object carries the complete set
        manifest = _with_seconds(manifest, seconds)
        self.last_result = ExecutionResult(snapshot_id, manifest, out_path, peak)
        return snapshot_id, manifest

    # ------------------------------------------------------------------ steps

    def _check_fresh(self, plan: Plan) -> None:
        """StalePlanError when the catalog or the files moved on since planning."""
        catalog = self.catalog
        if plan.block_bytes != catalog.block_bytes:
            raise StalePlanError(
                f"plan {plan.digest[:12]} was made for {plan.block_bytes}-byte blocks, the catalog uses "
                f"{catalog.block_bytes}; re-plan it"
            )
        for ref in plan.experts:
            if not catalog.is_analyzed(ref.id, plan.base.id):
                raise StalePlanError(
                    f"plan {plan.digest[:12]} is stale: '{ref.id}' is no longer analysed against "
                    f"'{plan.base.id}'; run `mergepipe plan` again"
                )
        for ref in (plan.base, *plan.experts):
            catalog.check_unchanged(ref.id)
            if content_fingerprint(catalog, ref.id) != ref.fingerprint:
                raise StalePlanError(
                    f"plan {plan.digest[:12]} is stale: model '{ref.id}' was re-registered with other "
                    "content since it was planned; run `mergepipe plan` again"
                )

    def _check_not_done(self, plan: Plan) -> None:
        """The same plan always gives the same snapshot: refuse to make it twice."""
        for record in self.catalog.list_snapshots():
            if record.plan_id == plan.digest and record.status == "committed":
                raise PublishError(
                    f"plan {plan.digest[:12]} was already executed: snapshot {record.id} (model "
                    f"'{record.model_id}') at {record.out_path} is its result; use it, or re-plan"
                )

    def _inputs(self, plan: Plan, spec: MergeSpec, op) -> MergeInputs:
        catalog = self.catalog
        base = catalog.open_checkpoint(plan.base.id)
        experts = {e.id: catalog.open_checkpoint(e.id) for e in plan.experts}
        stats = [catalog.tensor_stats(e.id, plan.base.id) for e in plan.experts]
        thresholds = {}
        for _, entry in base.iter_tensors():
            if entry.dtype in MERGEABLE_DTYPES:
                thresholds[entry.name] = [s[entry.name].thresholds if entry.name in s else None for s in stats]
        names = [e.name for _, e in base.iter_tensors() if e.dtype in MERGEABLE_DTYPES]
        num_layers = catalog.get_model(plan.base.id).num_layers or count_layers(names)
        return MergeInputs(
            spec=spec,
            op=op,
            base=base,
            experts=experts,
            reads=plan.reads,
            tensor_level=frozenset(plan.tensor_level),
            thresholds=thresholds,
            block_bytes=plan.block_bytes,
            num_layers=num_layers,
            out_dtype=plan.out_dtype,
            device=self.device,
        )

    def _write_snapshot(self, plan: Plan, spec: MergeSpec, op, area: StagingArea):
        inputs = self._inputs(plan, spec, op)
        stats = StreamStats()
        # half the memory bound for reads in flight; the rest is working tensors
        window = self.max_memory_bytes // 2
        with BlockReader() as reader, compute_threads(), _progress(self.progress, plan.cost.output_bytes) as (bar, task):
            prefetcher = Prefetcher(reader, self.io_threads, window)
            for ckpt in inputs.experts.values():
                for file in ckpt.files:
                    reader.advise_random(file.path)

            def on_bytes(n: int, tensor: str) -> None:
                if bar is not None:
                    bar.update(task, advance=n, description=_short(tensor))

            written = 0
            for file in inputs.base.files:
                entries = output_entries(inputs, file)
                fd = os.open(file.path, os.O_RDONLY)
                try:
                    with StreamingSafetensorsWriter(area.path / file.name, entries, file.header.metadata) as writer:
                        stream_shard(inputs, file, writer, prefetcher, fd, stats, on_bytes)
                        writer.close(fsync=False)  # the publish step fsyncs the whole tree
                        written += writer.bytes_written
                finally:
                    os.close(fd)
            by_tag = reader.bytes_by_tag()
        self._copy_side_files(inputs, area.path)
        expert_by_model = {e.id: by_tag.get(e.id, 0) for e in plan.experts}
        expert_bytes = sum(expert_by_model.values())
        if expert_bytes > plan.cost.expert_bytes:
            # the hard guarantee; reaching this is a bug, never a user error
            raise EngineError(
                f"internal error: read {expert_bytes} expert bytes, more than the planned "
                f"{plan.cost.expert_bytes}; please report it"
            )
        realized = RealizedCost(
            base_bytes=by_tag.get(BASE_TAG, 0) + stats.copied_base_bytes,
            expert_bytes=expert_bytes,
            output_bytes=written,
            expert_bytes_by_model=expert_by_model,
            seconds={},
        )
        return realized, stats, prefetcher.peak_inflight_bytes

    def _copy_side_files(self, inputs: MergeInputs, staging: Path) -> None:
        """config.json, generation config and tokenizer files from the base;
        an index when the base is sharded."""
        base = inputs.base
        for name in base.aux_files:
            source = base.root / name
            if name == "config.json" and inputs.out_dtype is not None:
                config = json.loads(source.read_text())
                for key in ("torch_dtype", "dtype"):
                    if key in config:
                        config[key] = _DTYPE_NAMES[inputs.out_dtype]
                (staging / name).write_text(json.dumps(config, indent=2) + "\n")
            else:
                shutil.copyfile(source, staging / name)
        if base.index is not None:
            total = sum(
                e.numel * DTYPE_SIZES[inputs.output_dtype(e)] for _, e in base.iter_tensors()
            )
            index = {
                "metadata": {"total_size": total},
                "weight_map": {name: file for name, file in sorted(base.tensor_files.items())},
            }
            (staging / _INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

    def _manifest(self, plan, spec, model_id, snapshot_id, files, realized, seconds) -> Manifest:
        weights = {e: spec.scalar_weight(e) for e in spec.expert_ids}
        everything_read = plan.cost.expert_bytes == plan.cost.full_expert_bytes
        return Manifest(
            snapshot_id=snapshot_id,
            model_id=model_id,
            plan_digest=plan.digest,
            base=ModelRef(plan.base.id, plan.base.fingerprint),
            experts=tuple(ExpertRef(e.id, e.fingerprint, weights[e.id]) for e in plan.experts),
            operator=OperatorSpec(
                spec.operator,
                {"global": dict(spec.params), "experts": {e.expert_id: dict(e.params) for e in spec.experts}},
            ),
            seed=spec.seed,
            budget_bytes=plan.budget_bytes,
            cost=Cost(
                estimated=ByteCost(plan.cost.base_bytes, plan.cost.expert_bytes, plan.cost.output_bytes),
                realized=RealizedCost(
                    base_bytes=realized.base_bytes,
                    expert_bytes=realized.expert_bytes,
                    output_bytes=realized.output_bytes,
                    expert_bytes_by_model=realized.expert_bytes_by_model,
                    seconds=seconds,
                ),
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
            created_at=self.catalog.now(),
            extra={"policy": plan.policy, "out_dtype": plan.out_dtype, "block_bytes": plan.block_bytes},
        )


def _with_seconds(manifest: Manifest, seconds: dict[str, float]) -> Manifest:
    realized = replace(manifest.cost.realized, seconds=seconds)
    return replace(manifest, cost=replace(manifest.cost, realized=realized))


def _device(name: str) -> torch.device:
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ConfigError(f"--device must be cpu or cuda, got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    return torch.device(name)


def _short(name: str, width: int = 40) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1):]


class _progress:
    """A rich progress bar over output bytes with MB/s, or nothing."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled = enabled
        self.total = total
        self.bar: Progress | None = None

    def __enter__(self):
        if not self.enabled:
            return None, None
        self.bar = Progress(
            TextColumn("merge {task.description:<40}"),
            BarColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            transient=True,
        )
        self.bar.__enter__()
        return self.bar, self.bar.add_task("", total=self.total)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
