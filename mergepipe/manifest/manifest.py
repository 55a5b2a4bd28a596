"""The manifest: an immutable record of what a merge did, why, and at what cost.

A manifest lives in every snapshot as ``manifest.json``. Its hash seals the
snapshot and is stored in the catalog; the snapshot id is derived from the plan
digest and the output file hashes, so the same inputs and plan always give the
same id.

What the hash covers. ``manifest_hash`` is sha256 over the canonical JSON of
every field except those in ``HASH_EXCLUDED_FIELDS``:

- ``created_at``: a wall-clock timestamp; it does not decide the result.
- ``cost.realized.seconds``: per-phase timings differ on every run; they are
  worth recording but must not make two identical merges hash differently.
- ``cost.estimated.seconds``: the seconds predicted from the catalog's
  timings on the machine that ran the merge (``spec/time_model.py``); another
  machine, or the same one after more merges, predicts others.
- ``cost.realized.requests_by_model``: remote requests per model (present
  only when an input was remote); retries of transient errors vary from run
  to run, and the same merge from local copies makes none.
- ``cost.realized.output_bytes_by_method``: how an incremental merge's
  output bytes got there (reflinked, copied by the kernel, written;
  hard-linked by an earlier MergePipe); the filesystem decides (a reflink
  where it has none is a copy), not the plan. ``output_bytes`` itself, their sum, is hashed.
- ``manifest_hash``: the hash itself (it is written into the file for people
  and tools to read, and is always recomputed from the fields).

Everything else (ids, fingerprints, operator and parameters, seed, budget,
estimated and realized *bytes*, reads, error bound, file hashes, software
versions, ``extra``) is deterministic for a given plan and enters the hash.
Volatile values must therefore never be put in ``extra``.

Formatting never matters: the hash is recomputed from parsed fields, so a
pretty-printed ``manifest.json`` hashes the same as the canonical one we write.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from mergepipe.errors import VerifyError
from mergepipe.manifest.parts import (
    MANIFEST_FILENAME,
    Cost,
    ErrorBound,
    ExpertRef,
    FileEntry,
    OperatorSpec,
    SoftwareVersions,
    _set,
)
from mergepipe.spec import fields
from mergepipe.spec.canonical import canonical_json, normalise, sha256_hex
from mergepipe.spec.plan import ModelRef
from mergepipe.spec.ranges import canonical_ranges
from mergepipe.storage.hashing import FILE_HASH

#: The schema this version writes. Schema 2 records blake3 file hashes; schema 1 (sha256) is still read,
#: so snapshots made before it verify and serve as ``--from`` for incremental merges.
MANIFEST_SCHEMA = 2
#: Every schema this version reads, with the file hash its entries carry.
FILE_HASH_OF_SCHEMA = {1: "sha256", 2: FILE_HASH}
# Dotted paths removed from the JSON before hashing; see the module docstring.
HASH_EXCLUDED_FIELDS: tuple[str, ...] = (
    "created_at", "manifest_hash", "cost.realized.seconds", "cost.estimated.seconds",
    "cost.realized.requests_by_model", "cost.realized.output_bytes_by_method",
)

Reads = dict[str, dict[str, list[list[int]]]]


def _normalise_reads(reads: Any) -> Reads:
    if not isinstance(reads, Mapping):
        raise ValueError("manifest reads must map tensor -> expert -> block ranges")
    out: Reads = {}
    for tensor, by_expert in reads.items():
        fields.text(tensor, "tensor name in reads")
        if not isinstance(by_expert, Mapping):
            raise ValueError(f"reads[{tensor}] must map expert id -> block ranges")
        out[tensor] = {
            fields.text(expert, f"expert id in reads[{tensor}]"): canonical_ranges(ranges)
            for expert, ranges in by_expert.items()
        }
    return out


# -- the manifest ----------------------------------------------------------------------------


_MANIFEST_FIELDS = (
    "schema", "snapshot_id", "model_id", "plan_digest", "base", "experts", "operator", "seed",
    "budget_bytes", "cost", "error_bound", "reads", "files", "software", "created_at", "extra",
)


@dataclass(frozen=True)
class Manifest:
    """The sealed record of one snapshot. See the module docstring for what is hashed.

    Construction normalises: weights and timings become floats, reads become
    canonical ranges, files are sorted by name, ``params``/``extra`` become
    plain JSON. So ``Manifest.from_json(m.to_json()) == m`` always holds.
    """

    snapshot_id: str
    model_id: str
    plan_digest: str
    base: ModelRef
    experts: tuple[ExpertRef, ...]
    operator: OperatorSpec
    seed: int
    budget_bytes: int | None
    cost: Cost
    error_bound: ErrorBound
    reads: Reads
    files: tuple[FileEntry, ...]
    software: SoftwareVersions
    created_at: str
    extra: dict[str, Any] = field(default_factory=dict)
    schema: int = MANIFEST_SCHEMA

    def __post_init__(self) -> None:
        _check_schema(self.schema)
        for name in ("snapshot_id", "model_id", "plan_digest", "created_at"):
            fields.text(getattr(self, name), name)
        fields.integer(self.seed, "seed", minimum=None)
        if self.budget_bytes is not None:
            fields.integer(self.budget_bytes, "budget_bytes")
        for name, kind in (("base", ModelRef), ("operator", OperatorSpec), ("cost", Cost),
                           ("error_bound", ErrorBound), ("software", SoftwareVersions)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"manifest {name} must be a {kind.__name__}")
        experts = tuple(self.experts)
        if not all(isinstance(e, ExpertRef) for e in experts):
            raise ValueError("manifest experts must be ExpertRef values")
        if not all(isinstance(f, FileEntry) for f in self.files):
            raise ValueError("manifest files must be FileEntry values")
        algorithm = FILE_HASH_OF_SCHEMA[self.schema]
        if any(f.algorithm != algorithm for f in self.files):
            raise ValueError(f"manifest schema {self.schema} records {algorithm} file hashes, and only those")
        files = tuple(sorted(self.files, key=lambda f: f.name))
        names = [f.name for f in files]
        if len(set(names)) != len(names):
            raise ValueError("manifest lists a file name twice")
        _set(self, "experts", experts)
        _set(self, "files", files)
        _set(self, "reads", _normalise_reads(self.reads))
        if not isinstance(self.extra, Mapping):
            raise ValueError("manifest extra must be a mapping")
        _set(self, "extra", normalise(dict(self.extra)))

    # -- JSON -----------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The full JSON object written to ``manifest.json``, ``manifest_hash`` included."""
        out = self._fields_json()
        out["manifest_hash"] = sha256_hex(canonical_json(_without_excluded(out)))
        return out

    def _fields_json(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "snapshot_id": self.snapshot_id,
            "model_id": self.model_id,
            "plan_digest": self.plan_digest,
            "base": self.base.to_json(),
            "experts": [e.to_json() for e in self.experts],
            "operator": self.operator.to_json(),
            "seed": self.seed,
            "budget_bytes": self.budget_bytes,
            "cost": self.cost.to_json(),
            "error_bound": self.error_bound.to_json(),
            "reads": {t: {e: [list(r) for r in rs] for e, rs in by.items()} for t, by in self.reads.items()},
            "files": [f.to_json() for f in self.files],
            "software": self.software.to_json(),
            "created_at": self.created_at,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """Parse a manifest object. A ``manifest_hash`` key is accepted and ignored
        (it is derived; compare it with ``read_manifest``/``Manifest.load``)."""
        if isinstance(data, dict) and "schema" in data:
            _check_schema(data["schema"])
        d = fields.keys(data, _MANIFEST_FIELDS, "manifest", optional=("manifest_hash",))
        for name in ("experts", "files"):
            if not isinstance(d[name], list):
                raise ValueError(f"manifest {name} must be a JSON list")
        return cls(
            schema=d["schema"],
            snapshot_id=d["snapshot_id"],
            model_id=d["model_id"],
            plan_digest=d["plan_digest"],
            base=ModelRef.from_json(d["base"]),
            experts=tuple(ExpertRef.from_json(e) for e in d["experts"]),
            operator=OperatorSpec.from_json(d["operator"]),
            seed=d["seed"],
            budget_bytes=d["budget_bytes"],
            cost=Cost.from_json(d["cost"]),
            error_bound=ErrorBound.from_json(d["error_bound"]),
            reads=d["reads"],
            files=tuple(FileEntry.from_json(f) for f in d["files"]),
            software=SoftwareVersions.from_json(d["software"]),
            created_at=d["created_at"],
            extra=d["extra"],
        )

    # -- hashing ----------------------------------------------------------------

    def canonical_bytes(self) -> bytes:
        """Canonical JSON of the hashed fields (everything but ``HASH_EXCLUDED_FIELDS``)."""
        return canonical_json(_without_excluded(self._fields_json()))

    @property
    def manifest_hash(self) -> str:
        """sha256 hex of ``canonical_bytes()``: seals the snapshot."""
        return sha256_hex(self.canonical_bytes())

    # -- files ------------------------------------------------------------------

    def write(self, directory: str | Path) -> Path:
        """Write ``manifest.json`` (canonical JSON of ``to_json()``) into ``directory``.

        Refuses to overwrite: a manifest is written once, into a staging directory.
        """
        path = Path(directory) / MANIFEST_FILENAME
        with open(path, "xb") as fh:
            fh.write(canonical_json(self.to_json()))
        return path

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        """Read ``directory/manifest.json`` and check its stored hash against its fields.

        Raises ``VerifyError`` if the file is missing, malformed or was edited.
        """
        manifest, stored = read_manifest(directory)
        if stored != manifest.manifest_hash:
            raise VerifyError(
                f"{Path(directory) / MANIFEST_FILENAME}: stored manifest_hash {stored} does not match "
                f"its fields ({manifest.manifest_hash}); the manifest was edited — restore or re-run the merge"
            )
        return manifest


def _check_schema(schema: Any) -> None:
    if isinstance(schema, bool) or schema not in FILE_HASH_OF_SCHEMA:
        readable = ", ".join(str(s) for s in FILE_HASH_OF_SCHEMA)
        raise ValueError(f"manifest schema {schema!r} is not supported (this mergepipe reads schemas "
                         f"{readable}); upgrade mergepipe to read it")


def _without_excluded(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``data`` minus the dotted paths in ``HASH_EXCLUDED_FIELDS``."""
    out = json.loads(json.dumps(data))  # cheap deep copy of plain JSON
    for dotted in HASH_EXCLUDED_FIELDS:
        *parents, leaf = dotted.split(".")
        node = out
        for key in parents:
            node = node.get(key, {})
        node.pop(leaf, None)
    return out


def read_manifest(directory: str | Path) -> tuple[Manifest, str | None]:
    """Parse ``directory/manifest.json`` without checking it: (manifest, stored hash or None).

    Raises ``VerifyError`` naming the file when it is missing or not a valid manifest.
    """
    path = Path(directory) / MANIFEST_FILENAME
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise VerifyError(f"{path}: missing; {directory} is not a MergePipe snapshot") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise VerifyError(f"{path}: cannot be read as JSON ({exc}); the snapshot is damaged") from None
    try:
        manifest = Manifest.from_json(data)
    except (ValueError, TypeError) as exc:
        raise VerifyError(f"{path}: not a valid manifest ({exc}); the snapshot is damaged") from None
    stored = data.get("manifest_hash")
    return manifest, stored if isinstance(stored, str) else None


def snapshot_id_for(plan_digest: str, files: Iterable[FileEntry]) -> str:
    """Content-derived snapshot id: the same plan and output bytes give the same id.

    ``"snap-"`` + the first 16 hex digits of sha256 over the canonical JSON of
    the plan digest and the sorted ``(name, hash)`` pairs of the output files (the manifest's schema says
    which hash).
    """
    pairs = sorted([f.name, f.digest] for f in files)
    return "snap-" + sha256_hex(canonical_json({"plan_digest": plan_digest, "files": pairs}))[:16]
