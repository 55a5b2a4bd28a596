"""Typed rows of the catalog: what its stores take and return instead of SQL tuples.

Records a command shows (``--json``: ``model_dump()``) or stores as JSON are frozen pydantic models; rows
that come by the hundred thousand per model (tensors, blocks, delta statistics, output blocks) are frozen
dataclasses, built positionally (docs/ARCHITECTURE.md, "Catalog records").
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


def from_row(cls: type[R], row: Sequence[object]) -> R:
    """A record from a SQL row whose columns are its fields, in order."""
    return cls(**dict(zip(cls.model_fields, row)))


class FileRecord(Record):
    """A weight (or side) file as registered; ``etag``: a remote file's (None for local files)."""

    name: str
    size: int
    mtime_ns: int
    header_sha256: str
    etag: str | None = None


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
    def side_digests(self) -> dict[str, str] | None:
        """Name -> sha256 of each side file (None: not recorded)."""
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
    """One tensor; ``begin``/``end`` are absolute byte offsets in ``file``."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
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
    """Block ``index`` of ``tensor``: rows ``[row_start, row_end)``, bytes ``[begin, end)``; ``hash``: blake3 hex
    of its bytes, None until analysed."""

    tensor: str
    index: int
    row_start: int
    row_end: int
    begin: int
    end: int
    hash: str | None

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class BlockDelta:
    """Statistics of Δ = expert − base (fp32) over one block; ``identical``: the bytes equal the base's (then all
    0). For a tensor that is not mergeable only ``identical`` is known."""

    tensor: str
    index: int
    l2: float | None
    maxabs: float | None
    nnz: int | None
    identical: bool


@dataclass(frozen=True)
class TensorStats:
    """Per-tensor results of an analysis: one trim threshold per density of the grid (none if not mergeable)."""

    tensor: str
    numel: int
    mergeable: bool
    identical: bool
    thresholds: Mapping[float, TrimThreshold]  # a dict, or the catalog's StoredThresholds


@dataclass(frozen=True)
class OutputBlock:
    """A snapshot's output block: provenance key of its inputs, blake3 of its bytes, a bound on its Frobenius norm
    (None: not merged), how far it may be from the from-scratch merge (0 unless delta-updated), and from the fp32
    values that merge computes (as measured when written; None: not measured)."""

    key: str
    hash: str
    l2: float | None
    error: float = 0.0
    drift: float | None = None


@dataclass(frozen=True)
class ModelContent:
    """Everything registering a model writes (``analysis.describe`` builds it from a checkpoint's headers)."""

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
    """How far analysis of a model has got: hashed blocks, and the bases it was analysed against."""

    model_id: str
    hashed_blocks: int
    n_blocks: int
    analyzed_against: tuple[str, ...]

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
    """One publish attempt, from intent to commit (or abort). ``id``, ``manifest_hash`` and ``manifest``
    (canonical JSON) are set once committed; ``out_path`` is then where its bytes are now (its model's ``uri``)."""

    intent_id: str
    id: str | None
    plan_id: str
    model_id: str
    out_path: str
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
    """A directory a committed snapshot was published to, or an attempt (pending, committed, aborted) to publish
    it there; ``removed_at``: when ``mergepipe rm`` deleted it (the row stays)."""

    intent_id: str
    snapshot_id: str
    path: str
    staging_path: str
    status: Literal["pending", "committed", "aborted"]
    created_at: str
    committed_at: str | None
    removed_at: str | None = None


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
    def uri(self) -> str:
        """The commit, which is immutable where a branch moves on."""
        return f"hf://{self.repo_id}@{self.commit}"


class EvaluationSubject(Record):
    """What a model's scores are stored under: ``plan`` (a merge's plan digest) or ``model`` (a fingerprint)."""

    kind: str
    id: str


class EvaluationRecord(Record):
    """One metric of one subject on one set of data. ``subject_kind`` ``hybrid``: a mix of two merges that
    ``bisect`` probes. ``data_digest``: sha256 of the data and every setting that changes the value (rows compare
    only on equal digests). ``value`` may be NaN; ``tokens``: those scored, where the metric counts them."""

    subject: str
    subject_kind: Literal["plan", "model", "hybrid"]
    data_digest: str
    data_name: str
    metric: str  # loss, perplexity, or TASK/METRIC for lm-eval
    value: float
    tokens: int | None
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
