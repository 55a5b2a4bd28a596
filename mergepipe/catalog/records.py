"""Typed rows of the catalog: what callers get back instead of SQL tuples.

Every record is a frozen dataclass; ``to_json`` gives a plain dict for the
CLI's ``--json`` output. Records carry no behaviour beyond derived sizes:
the catalog stores and returns them, analysis builds the ones it writes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from mergepipe.catalog.database import Database
from mergepipe.errors import CatalogError, UnknownModelError
from mergepipe.spec.operators import TrimThreshold

#: What a model's files hold: full weights ("checkpoint"), a published merge ("snapshot"), or
#: Δ = E − B against the base named by ``ModelRecord.delta_base`` ("delta", ``analysis/delta_checkpoint.py``),
#: or a PEFT LoRA adapter of that base ("lora", ``analysis/lora_expert.py``).
MODEL_KINDS = ("checkpoint", "snapshot", "delta", "lora")
#: The kinds that are taken against one base (``ModelRecord.delta_base``).
BASED_KINDS = ("delta", "lora")
#: A merged model's parents: its base and experts; an alias's one parent is the model whose snapshot it
#: publishes under another id (``SAME_SNAPSHOT``).
SAME_SNAPSHOT = "same snapshot"
PARENT_ROLES = ("base", "expert", SAME_SNAPSHOT)


@dataclass(frozen=True)
class ModelRecord:
    """A registered model: a checkpoint directory or a published snapshot.

    ``fingerprint`` is sha256 over the sorted (file name, header sha256,
    size) of its weight files: cheap to compute at registration, and it
    changes whenever a tensor's name, dtype, shape or offsets change.
    ``total_bytes`` counts tensor data only (what a full read costs).
    ``name`` and ``version`` place it in its family of versions: version 1
    has the plain id (``id == name``), later ones ``name@version``.
    ``delta_base`` is the stored id of the base a ``delta`` or ``lora`` model
    was taken against (``None`` for other kinds). ``side_files`` is the
    canonical JSON of its side files' ``FileRecord``s (config, tokenizer: what
    a merge copies from its base; ``header_sha256`` the sha256 of the bytes),
    part of what the version is; ``None`` for a model an earlier release
    registered, which did not record them (and for LoRA adapters, whose
    config is one of their ``files``).
    """

    id: str
    uri: str
    kind: str
    fingerprint: str
    architecture: str | None
    num_layers: int | None
    total_bytes: int
    n_tensors: int
    n_blocks: int
    created_at: str
    name: str = ""
    version: int = 1
    delta_base: str | None = None
    side_files: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.id)

    @property
    def side_records(self) -> tuple[FileRecord, ...] | None:
        """``side_files`` as records (None: not recorded)."""
        return None if self.side_files is None else tuple(FileRecord(**f) for f in json.loads(self.side_files))

    @property
    def side_digests(self) -> dict[str, str] | None:
        """Name -> sha256 of each side file (None: not recorded): what identifies them."""
        records = self.side_records
        return None if records is None else {f.name: f.header_sha256 for f in records}

    @property
    def label(self) -> str:
        """``name@version``: how people name this exact version."""
        return f"{self.name}@{self.version}"

    def ref(self, latest: bool) -> str:
        """What names exactly this version when resolved: its name while it is the ``latest``
        version of its family, else ``name@version``."""
        return self.name if latest else self.label

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelRecord:
        return cls(**data)


@dataclass(frozen=True)
class FileRecord:
    """One weight file of a model as it was at registration. ``etag`` is a remote file's ETag (``None``
    for local files): with size and Last-Modified (``mtime_ns``) it tells a replaced object before any read."""

    name: str
    size: int
    mtime_ns: int
    header_sha256: str
    etag: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


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

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["shape"] = list(self.shape)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TensorRecord:
        return cls(**{**data, "shape": tuple(data["shape"])})


@dataclass(frozen=True)
class BlockRecord:
    """Block ``index`` of ``tensor``: rows ``[row_start, row_end)``, bytes ``[begin, end)``.

    ``hash`` is the blake3 hex digest of the block's bytes, ``None`` until the
    model has been analysed.
    """

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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BlockDelta:
    """Statistics of Δ = expert − base (fp32) over one block.

    ``identical`` means the block's bytes equal the base's (equal content
    hashes); its statistics are then 0 without having been computed. For a
    tensor whose dtype is not mergeable (integers, F64, FP8) only
    ``identical`` is known and ``l2``/``maxabs``/``nnz`` are ``None``: such
    tensors are carried through from the base and never merged.
    """

    tensor: str
    index: int
    l2: float | None
    maxabs: float | None
    nnz: int | None
    identical: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TensorStats:
    """Per-tensor results of one (expert, base) analysis.

    ``thresholds`` holds one exact trim threshold per density of
    ``thresholds.DENSITY_GRID``; it is empty for non-mergeable tensors.
    """

    tensor: str
    numel: int
    mergeable: bool
    identical: bool
    thresholds: Mapping[float, TrimThreshold]  # a dict, or the catalog's StoredThresholds

    def to_json(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "numel": self.numel,
            "mergeable": self.mergeable,
            "identical": self.identical,
            "thresholds": [t.to_json() for t in self.thresholds.values()],
        }


@dataclass(frozen=True)
class AnalysisRecord:
    """That ``expert_id`` has been analysed against ``base_id``, and when."""

    expert_id: str
    base_id: str
    analyzed_at: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ModelStatus:
    """How far analysis of a model has got: hashed blocks, and the bases it
    has delta statistics against (as an expert)."""

    model_id: str
    hashed_blocks: int
    n_blocks: int
    analyzed_against: tuple[str, ...]

    @property
    def fully_hashed(self) -> bool:
        return self.hashed_blocks == self.n_blocks

    def describe(self) -> str:
        """A short human label: 'not analysed', 'hashed', 'Δ vs base', ..."""
        parts = []
        if self.analyzed_against:
            parts.append("Δ vs " + ", ".join(self.analyzed_against))
        elif self.fully_hashed:
            parts.append("hashed")
        elif self.hashed_blocks:
            parts.append(f"hashed {self.hashed_blocks}/{self.n_blocks}")
        else:
            parts.append("not analysed")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["analyzed_against"] = list(self.analyzed_against)
        return data


@dataclass(frozen=True)
class PlanRecord:
    """A stored plan's id (its digest) and when it was first saved."""

    id: str
    created_at: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SnapshotRecord:
    """One publish attempt, from intent to commit (or abort).

    ``intent_id`` is known when publishing starts; ``id`` (content-derived),
    ``manifest_hash`` and ``manifest`` (canonical JSON text) only once it is
    committed. ``out_path`` is where the intent publishes; once committed, where
    the snapshot's bytes are now (its model's ``uri``: a re-materialisation moves
    both when the old directory is gone; ``LocationRecord`` lists every location).
    """

    intent_id: str
    id: str | None
    plan_id: str
    model_id: str
    out_path: str
    staging_path: str
    status: str
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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SnapshotRecord:
        return cls(**data)


@dataclass(frozen=True)
class LocationRecord:
    """A directory a committed snapshot was published to, or an attempt to publish it there.

    The same plan always gives the same bytes, so executing it again re-materialises the *same*
    snapshot elsewhere (after its output was deleted, say) instead of making a new one. Each
    attempt moves ``pending`` -> ``committed`` or ``aborted`` like a snapshot intent; only
    committed rows are locations. The first location shares the snapshot's intent id.
    ``removed_at``: when ``mergepipe rm`` deleted the directory (the row stays: it is history).
    """

    intent_id: str
    snapshot_id: str
    path: str
    staging_path: str
    status: str
    created_at: str
    committed_at: str | None
    removed_at: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class HubPush:
    """A Hugging Face Hub commit holding a committed snapshot's files (``mergepipe push``): repository
    ``repo_id``, the branch pushed to (``revision``), the commit's sha, whether the repository was private
    when pushed, and when. The commit is immutable where a branch moves on, so ``uri`` names it:
    ``hf://ORG/NAME@SHA``."""

    snapshot_id: str
    repo_id: str
    revision: str
    commit: str
    private: bool
    pushed_at: str

    @property
    def uri(self) -> str:
        return f"hf://{self.repo_id}@{self.commit}"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "uri": self.uri}


@dataclass(frozen=True)
class OutputBlock:
    """What a snapshot recorded of one output block: the provenance key of its inputs
    (``analysis/provenance.py``), the blake3 of its bytes, an upper bound on the Frobenius norm of its
    values (None where the block was not merged), how far (Frobenius) it may be from the from-scratch
    merge: 0 unless it was delta-updated (``planner/delta_update.py``), and how far it may be from the
    fp32 values a from-scratch merge computes for it, as measured when it was written (None: not measured).
    """

    key: str
    hash: str
    l2: float | None
    error: float = 0.0
    drift: float | None = None


@dataclass(frozen=True)
class ModelContent:
    """Everything registering a model writes: its record, files, tensors and
    block geometry (``analysis.describe`` builds it from a checkpoint's headers)."""

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


#: What an evaluation is of: a merge, named by its plan digest, or a registered model that is no merge, named
#: by its content fingerprint (``EvaluationSubject``); or a tensor-level mix of two merges that ``bisect`` probes,
#: named by a digest of both and the tensors taken (no model is one, so no view shows it).
SUBJECT_KINDS = ("plan", "model", "hybrid")


@dataclass(frozen=True)
class EvaluationSubject:
    """What rows of ``evaluations`` a model's scores are under: ``kind`` ``plan`` (a merged model: its plan
    digest) or ``model`` (any other: its content fingerprint), and ``id``, that digest."""

    kind: str
    id: str


@dataclass(frozen=True)
class EvaluationRecord:
    """One metric of one subject on one set of data (``catalog/evaluations.py``).

    ``data_digest`` is sha256 hex of the data's bytes and every setting that changes the value (the
    evaluation computes it; two rows compare only on equal digests); ``data_name`` is how people name the data
    (file names, lm-eval task names). ``metric``: ``loss``, ``perplexity``, or ``TASK/METRIC`` for lm-eval;
    ``value`` may be NaN (a diverged model). ``tokens``: the tokens scored, where the metric counts them.
    ``versions`` (software -> version), ``device`` and ``seconds`` say how it was measured, ``created_at`` when.
    """

    subject: str
    subject_kind: str
    data_digest: str
    data_name: str
    metric: str
    value: float
    tokens: int | None
    versions: dict[str, str]
    device: str
    seconds: float
    created_at: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SearchRecord:
    """A snapshot published as the best trial of a `mergepipe search` study (``catalog/searches.py``)."""

    snapshot_id: str
    study: str
    trial: int
    trials: int  # trials in the study when it was published
    objective: float
    params: dict[str, Any]
    search_budget: str
    created_at: str


# How many registered ids an "unknown model" message lists.
_MAX_IDS_IN_MESSAGE = 10


def unknown_model(db: Database, model_id: str) -> UnknownModelError:
    ids = [r[0] for r in db.query("SELECT id FROM models ORDER BY id")]
    if not ids:
        known = "none registered yet"
    else:
        known = "registered: " + ", ".join(ids[:_MAX_IDS_IN_MESSAGE])
        if len(ids) > _MAX_IDS_IN_MESSAGE:
            known += f" … ({len(ids)} in all)"
    return UnknownModelError(f"unknown model '{model_id}'; {known} (register it with `mergepipe register`)")


def require_model(db: Database, model_id: str) -> None:
    """UnknownModelError unless ``model_id`` is registered."""
    if db.query_one("SELECT 1 FROM models WHERE id = ?", (model_id,)) is None:
        raise unknown_model(db, model_id)
