"""Typed rows of the catalog: frozen pydantic models, and frozen dataclasses for the rows that come by the
hundred thousand per model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, computed_field, model_validator

from mergepipe.errors import CatalogError
from mergepipe.spec.operators import TrimThreshold

#: What a model's files hold: full weights, a published merge, Δ = E − B against a base, or a LoRA adapter of it.
MODEL_KINDS = ("checkpoint", "snapshot", "delta", "lora")
#: The kinds of model taken against one base (``ModelRecord.delta_base``).
BASED_KINDS = ("delta", "lora")
#: The role of an alias's one parent: the model whose snapshot it publishes under another id.
SAME_SNAPSHOT = "same snapshot"
PARENT_ROLES = ("base", "expert", SAME_SNAPSHOT)


class Record(BaseModel):
    model_config = ConfigDict(frozen=True)


R = TypeVar("R", bound=Record)


def from_row(cls: type[R], row: Sequence[object]) -> R:  # a SQL row whose columns are its fields, in order
    return cls(**dict(zip(cls.model_fields, row)))


class FileRecord(Record):
    """A weight (or side) file as registered."""

    name: str
    size: int
    mtime_ns: int
    header_sha256: str
    etag: str | None = None  # a remote file's (None for local files)


_FILES = TypeAdapter(tuple[FileRecord, ...])


class ModelRecord(Record):
    """A registered model: a checkpoint, a published snapshot, a delta (Δ = E − B) or a LoRA adapter."""

    id: str
    uri: str
    kind: str  # one of MODEL_KINDS
    fingerprint: str  # sha256 over the weight files' sorted (name, header sha256, size): the layout
    architecture: str | None
    num_layers: int | None
    total_bytes: int  # tensor data only: what a full read costs
    n_tensors: int
    n_blocks: int
    created_at: str
    name: str = Field(default_factory=lambda data: data["id"])  # version 1's id is its name, later ones name@N
    version: int = 1
    delta_base: str | None = None  # the base a delta or LoRA model was taken against
    side_files: str | None = None  # canonical JSON of its side files' records (None: registered before)

    @model_validator(mode="after")
    def _check_kind(self) -> ModelRecord:
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"model kind must be one of {MODEL_KINDS}, got {self.kind!r}")
        if (self.kind in BASED_KINDS) != (self.delta_base is not None):
            raise ValueError(f"a model of kind 'delta' or 'lora' (and only those) names its base, got {self.kind!r}")
        return self

    @property
    def side_records(self) -> tuple[FileRecord, ...] | None:
        return None if self.side_files is None else _FILES.validate_json(self.side_files)

    @property
    def side_digests(self) -> dict[str, str] | None:  # name -> sha256 (None: not recorded)
        records = self.side_records
        return None if records is None else {f.name: f.header_sha256 for f in records}

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"

    def ref(self, latest: bool) -> str:
        """What resolves to exactly this version: its name while it is the latest, else ``name@N``."""
        return self.name if latest else self.label


@dataclass(frozen=True)
class TensorRecord:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in ``file``
    end: int
    ordinal: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BlockRecord:
    tensor: str
    index: int
    row_start: int  # rows [row_start, row_end), bytes [begin, end)
    row_end: int
    begin: int
    end: int
    hash: str | None  # blake3 hex of its bytes; None until analysed

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class BlockDelta:
    """Statistics of Δ = expert − base (fp32) over one block (of a tensor that is not mergeable: None)."""

    tensor: str
    index: int
    l2: float | None
    maxabs: float | None
    nnz: int | None
    identical: bool  # the bytes equal the base's: all 0


@dataclass(frozen=True)
class TensorStats:
    tensor: str
    numel: int
    mergeable: bool
    identical: bool
    thresholds: Mapping[float, TrimThreshold]  # per density of the grid (none if not mergeable); StoredThresholds


@dataclass(frozen=True)
class OutputBlock:
    """What a snapshot recorded of one output block."""

    key: str  # provenance key of its inputs
    hash: str  # blake3 of its bytes
    l2: float | None  # a bound on its Frobenius norm (None: not merged)
    error: float = 0.0  # how far it may be from the from-scratch merge (0 unless delta-updated)
    drift: float | None = None  # ... from the fp32 values that merge computes, measured when written


@dataclass(frozen=True)
class ModelContent:
    """Everything registering a model writes."""

    record: ModelRecord
    files: tuple[FileRecord, ...]
    tensors: tuple[TensorRecord, ...]
    blocks: tuple[BlockRecord, ...]


@dataclass(frozen=True)
class Timing:
    """One past merge: the expert bytes it read, the output bytes it wrote, the engine's seconds."""

    expert_bytes: int
    output_bytes: int
    seconds: float


class AnalysisRecord(Record):
    expert_id: str
    base_id: str
    analyzed_at: str


class ModelStatus(Record):
    model_id: str
    hashed_blocks: int
    n_blocks: int
    analyzed_against: tuple[str, ...]  # bases

    @property
    def fully_hashed(self) -> bool:
        return self.hashed_blocks == self.n_blocks

    def describe(self) -> str:
        if self.analyzed_against:
            return "Δ vs " + ", ".join(self.analyzed_against)
        if self.fully_hashed:
            return "hashed"
        return f"hashed {self.hashed_blocks}/{self.n_blocks}" if self.hashed_blocks else "not analysed"


class PlanRecord(Record):
    id: str  # the plan's digest
    created_at: str


class SnapshotRecord(Record):
    """One publish attempt, from intent to commit (or abort)."""

    intent_id: str
    id: str | None  # with manifest_hash and manifest (canonical JSON), set once committed
    plan_id: str
    model_id: str
    out_path: str  # once committed, where its bytes are now (its model's uri)
    staging_path: str
    status: Literal["pending", "committed", "aborted"]
    manifest_hash: str | None
    manifest: str | None
    created_at: str
    committed_at: str | None

    def manifest_data(self) -> dict[str, Any]:
        """The manifest (a JSON object), which a committed snapshot has; CatalogError for any other."""
        if self.manifest is None:
            raise CatalogError(
                f"snapshot {self.id or self.intent_id} is {self.status}: it has no manifest; "
                "list snapshots with `mergepipe snapshots`"
            )
        data: dict[str, Any] = json.loads(self.manifest)
        return data


class LocationRecord(Record):
    """A directory a committed snapshot was published to, or an attempt to publish it there."""

    intent_id: str
    snapshot_id: str
    path: str
    staging_path: str
    status: Literal["pending", "committed", "aborted"]
    created_at: str
    committed_at: str | None
    removed_at: str | None = None  # when `mergepipe rm` deleted it


class HubPush(Record):
    """A Hugging Face Hub commit holding a committed snapshot's files (``mergepipe push``)."""

    snapshot_id: str
    repo_id: str
    revision: str  # the branch pushed to
    commit: str
    private: bool  # when pushed
    pushed_at: str

    @computed_field  # type: ignore[prop-decorator]
    @property
    def uri(self) -> str:  # the commit, immutable where a branch moves on
        return f"hf://{self.repo_id}@{self.commit}"


class EvaluationSubject(Record):
    kind: str  # "plan" (a merge's plan digest) or "model" (a content fingerprint)
    id: str


class EvaluationRecord(Record):
    """One metric of one subject on one set of data."""

    subject: str
    subject_kind: Literal["plan", "model", "hybrid"]  # hybrid: a mix of two merges that `bisect` probes
    data_digest: str  # sha256 of the data and every setting that changes the value
    data_name: str
    metric: str  # loss, perplexity, or TASK/METRIC for lm-eval
    value: float  # may be NaN
    tokens: int | None  # those scored, where the metric counts them
    versions: dict[str, str]  # software -> version
    device: str
    seconds: float
    created_at: str


class SearchRecord(Record):
    """A snapshot published as the best trial of a `mergepipe search` study."""

    snapshot_id: str
    study: str
    trial: int
    trials: int  # trials in the study when it was published
    objective: float
    params: dict[str, Any]
    search_budget: str
    created_at: str
