"""Everything fixed for one execution of a plan, shared by all its work units.

Built once by the coordinator from the catalog (opened checkpoints, checked
against their registration; thresholds; layer count; the output's weight
files) and read by every unit. It holds no open files and no catalog: a unit
opens what it needs. A checkpoint may be remote (``s3://``, ``http(s)://``):
its files' paths are then ``RemotePath`` values, which the units' source reads
by ranged requests, and ``meter`` counts that traffic for the whole execution.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mergepipe.analysis.expert_format import ExpertFormat, expert_format
from mergepipe.analysis.opening import open_registered
from mergepipe.analysis.layout import layer_count
from mergepipe.analysis.lora_expert import LORA, open_lora
from mergepipe.catalog import Catalog
from mergepipe.catalog.deltas import DeltaChunk, DeltaStage
from mergepipe.engine.previous import PreviousSnapshot, load_previous
from mergepipe.errors import ModelChangedError, StalePlanError
from mergepipe.spec.operator import OperatorDef
from mergepipe.spec.operators import get_operator
from mergepipe.spec.plan import Plan
from mergepipe.spec.trim import TrimThreshold
from mergepipe.storage.checkpoint import TOKENIZER_CONFIG_FILE, Checkpoint
from mergepipe.storage.format import DTYPE_SIZES, MERGEABLE_DTYPES, TensorEntry
from mergepipe.storage.location import RemotePath
from mergepipe.storage.lora import LoraAdapter
from mergepipe.storage.remote import TransferMeter
from mergepipe.storage.sharding import OutputFile, OutputLayout, mirror_layout, packed_layout

#: Tag of base reads in the source's counters (experts are tagged with their ids).
BASE_TAG = "base"
#: Tag of reads of reused blocks from the previous snapshot (``merge --from``).
REUSE_TAG = "previous snapshot"


@dataclass(frozen=True)
class StoreInput:
    """An expert's delta store as the plan reads it: the file, each tensor's chunks and sketch stages."""

    path: Path
    chunks: Mapping[str, Sequence[DeltaChunk]]
    stages: Mapping[str, Sequence[DeltaStage]]


@dataclass(frozen=True)
class Job:
    """The plan with its operator, the opened checkpoints and per-tensor thresholds."""

    plan: Plan
    definition: OperatorDef
    base: Checkpoint
    experts: Mapping[str, Checkpoint]
    thresholds: Mapping[str, Sequence[Mapping[float, TrimThreshold] | None]]
    num_layers: int
    device: torch.device
    # model id -> tensor -> block index -> recorded content hash: every block
    # of the base, the planned blocks of each expert
    hashes: Mapping[str, Mapping[str, Mapping[int, str]]]
    # the output's weight files and the tensors each holds (the base's, or shards of plan.out_shard_bytes)
    layout: OutputLayout
    # expert id -> its delta store, for the experts the plan reads entries of
    stores: Mapping[str, StoreInput] = field(default_factory=dict)
    # the snapshot reused blocks are copied from (incremental merges only)
    previous: PreviousSnapshot | None = None
    # expert id -> its format (analysis/expert_format.py): full weights unless listed
    formats: Mapping[str, ExpertFormat] = field(default_factory=dict)
    # expert id -> its opened adapter, for the LoRA experts (not in ``experts``)
    loras: Mapping[str, LoraAdapter] = field(default_factory=dict)
    # the execution's remote traffic (bytes, requests) when the base or an expert is remote, else None: units
    # then coalesce their planned reads, and the progress bar shows the remote rate (storage/remote_source.py)
    meter: TransferMeter | None = None

    @property
    def expert_ids(self) -> tuple[str, ...]:
        return self.plan.merge.expert_ids

    def expert_format(self, expert_id: str) -> ExpertFormat:
        """How an expert's bytes become Δ: full weights (minus the base) or a delta checkpoint."""
        return self.formats.get(expert_id) or expert_format("checkpoint")

    def expert_dtype(self, expert_id: str, tensor: str) -> str:
        """The dtype an expert stores ``tensor`` in (a delta checkpoint's may differ from the base's)."""
        return self.experts[expert_id].tensor(tensor).dtype

    @property
    def measures_drift(self) -> bool:
        """Whether output blocks record their drift (``planner/delta_update.py``): for the operators a later
        merge can delta-update."""
        return self.definition.delta_updatable

    def output_dtype(self, entry: TensorEntry) -> str:
        """The dtype a tensor is written in: ``out_dtype`` for merged dtypes, else the base's."""
        return output_dtype(self.plan, entry)

    def output_row_bytes(self, entry: TensorEntry) -> int:
        """Bytes of one row of a tensor as written (in its output dtype)."""
        return entry.row_numel * DTYPE_SIZES[self.output_dtype(entry)]

    def output_entries(self, file: OutputFile) -> list[tuple[str, str, tuple[int, ...]]]:
        """An output file's tensors, in its order, with their output dtypes and the base's shapes."""
        entries = [self.base.tensor(name) for name in file.tensors]
        return [(e.name, self.output_dtype(e), e.shape) for e in entries]


def output_dtype(plan: Plan, entry: TensorEntry) -> str:
    """The dtype ``plan`` writes a base tensor in: ``out_dtype`` for merged dtypes, else the base's."""
    if plan.out_dtype is not None and entry.dtype in MERGEABLE_DTYPES:
        return plan.out_dtype
    return entry.dtype


def output_layout(base: Checkpoint, plan: Plan) -> OutputLayout:
    """The output's weight files: the base's (names, tensors, header metadata), or with
    ``plan.out_shard_bytes`` shards of at most that many bytes of output tensors, in the base's tensor
    order. Every shard carries the first base file's header metadata: Hugging Face writes the same
    (``{"format": "pt"}``) into each of its files."""
    if plan.out_shard_bytes is None:
        return mirror_layout(base)
    sizes = [(e.name, e.numel * DTYPE_SIZES[output_dtype(plan, e)]) for _, e in base.iter_tensors()]
    return packed_layout(sizes, plan.out_shard_bytes, base.files[0].header.metadata)


def load_job(catalog: Catalog, plan: Plan, device: torch.device) -> Job:
    """Open the plan's checkpoints (checked against their registration) and
    fetch the thresholds its tensors need."""
    base = open_registered(catalog, plan.base.id, sides=True)  # the output gets its side files
    if plan.chat_template is not None and TOKENIZER_CONFIG_FILE not in base.aux_files:
        raise ModelChangedError(
            f"plan {plan.digest[:12]} sets a chat template in {TOKENIZER_CONFIG_FILE}, but the base '{plan.base.id}' "
            f"at {base.root} no longer has that file; nothing was published. Restore it, or plan without a chat "
            "template"
        )
    formats = {e.id: expert_format(catalog.models.get(e.id).kind) for e in plan.experts}
    loras = {e.id: open_lora(catalog, e.id) for e in plan.experts if formats[e.id].kind == LORA}
    experts = {e.id: open_registered(catalog, e.id) for e in plan.experts if e.id not in loras}
    stats = [catalog.stats.tensor_stats(e.id, plan.base.id) for e in plan.experts]
    thresholds = {}
    for _, entry in base.iter_tensors():
        if entry.dtype in MERGEABLE_DTYPES:
            thresholds[entry.name] = [s[entry.name].thresholds if entry.name in s else None for s in stats]
    num_layers = layer_count(catalog, plan.base.id)
    hashes = {plan.base.id: _recorded(catalog, plan.base.id, None)}
    for e in plan.experts:
        hashes[e.id] = _recorded(catalog, e.id, {t: per.get(e.id, ()) for t, per in plan.reads.items()})
    return Job(
        plan=plan,
        definition=get_operator(plan.operator),
        base=base,
        experts=experts,
        thresholds=thresholds,
        num_layers=num_layers,
        device=device,
        hashes=hashes,
        layout=output_layout(base, plan),
        stores={e: load_store(catalog, plan, e) for e in plan.stores},
        previous=load_previous(catalog, plan),
        formats=formats,
        loras=loras,
        meter=TransferMeter() if any(isinstance(c.root, RemotePath) for c in (base, *experts.values())) else None,
    )


def load_store(catalog: Catalog, plan: Plan, expert_id: str) -> StoreInput:
    """The delta store the plan was made on; StalePlanError / ModelChangedError if it moved on."""
    record = catalog.deltas.find(expert_id, plan.base.id)
    if record is None or record.digest != plan.stores[expert_id]:
        raise StalePlanError(
            f"plan {plan.digest[:12]} is stale: the delta store of '{expert_id}' was rebuilt or dropped since it "
            "was planned; run `mergepipe plan` again"
        )
    path = Path(record.path)
    size = path.stat().st_size if path.is_file() else None
    if size != record.file_size:
        found = "is missing" if size is None else f"holds {size} bytes, {record.file_size} were recorded"
        raise ModelChangedError(
            f"the delta store of '{expert_id}' at {path} {found}; rebuild it with "
            f"`mergepipe analyze --base {plan.base.id} --store-deltas DIR {expert_id}`"
        )
    base_id = plan.base.id
    return StoreInput(path, catalog.deltas.chunks(expert_id, base_id), catalog.deltas.stages(expert_id, base_id))


def _recorded(
    catalog: Catalog, model_id: str, wanted: Mapping[str, Sequence[int]] | None
) -> dict[str, dict[int, str]]:
    """The recorded block hashes of a model: all, or only the ``wanted`` blocks."""
    out: dict[str, dict[int, str]] = {}
    for tensor, digests in catalog.blocks.hashes(model_id).items():
        indices = range(len(digests)) if wanted is None else wanted.get(tensor, ())
        out[tensor] = {i: digest for i in indices if (digest := digests[i]) is not None}
    return out
