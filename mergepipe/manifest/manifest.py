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
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Mapping

from mergepipe import __version__
from mergepipe.errors import VerifyError
from mergepipe.spec import canonical as fields
from mergepipe.spec.canonical import canonical_json, canonical_ranges, normalise, sha256_hex
from mergepipe.spec.plan import ModelRef
from mergepipe.storage.source import FILE_HASH, FILE_HASHES

MANIFEST_FILENAME = "manifest.json"


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # normalising a frozen dataclass in __post_init__


# -- parts ------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertRef:
    """An expert input with its merge weight."""

    id: str
    fingerprint: str
    weight: float

    def __post_init__(self) -> None:
        fields.text(self.id, "expert id")
        fields.text(self.fingerprint, f"fingerprint of {self.id}")
        _set(self, "weight", fields.number(self.weight, f"weight of {self.id}"))

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "fingerprint": self.fingerprint, "weight": self.weight}

    @classmethod
    def from_json(cls, data: Any) -> ExpertRef:
        d = fields.keys(data, ("id", "fingerprint", "weight"), "manifest expert")
        return cls(id=d["id"], fingerprint=d["fingerprint"], weight=d["weight"])


@dataclass(frozen=True)
class OperatorSpec:
    """The merge operator's registry name and its resolved parameters (plain JSON)."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        fields.text(self.name, "operator name")
        if not isinstance(self.params, Mapping):
            raise ValueError(f"operator params must be a mapping, got {type(self.params).__name__}")
        _set(self, "params", normalise(dict(self.params)))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "params": self.params}

    @classmethod
    def from_json(cls, data: Any) -> OperatorSpec:
        d = fields.keys(data, ("name", "params"), "manifest operator")
        return cls(name=d["name"], params=d["params"])


_BYTE_FIELDS = ("base_bytes", "expert_bytes", "output_bytes")


@dataclass(frozen=True)
class ByteCost:
    """Bytes read from the base and experts and written to the output; ``seconds``: the ``total`` predicted on
    the machine that ran the merge, its uncertainty and terms (``spec/seconds.Prediction.flat``; per phase in
    manifests sealed by the former cost model), when it was predicted."""

    base_bytes: int
    expert_bytes: int
    output_bytes: int
    seconds: dict[str, float] | None = None

    def __post_init__(self) -> None:
        for name in _BYTE_FIELDS:
            fields.integer(getattr(self, name), name)
        if self.seconds is not None:
            _set(
                self,
                "seconds",
                {
                    fields.text(k, "phase name"): fields.number(v, f"estimated seconds[{k}]")
                    for k, v in dict(self.seconds).items()
                },
            )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in _BYTE_FIELDS}
        if self.seconds is not None:  # only when predicted: other manifests are as they were
            out["seconds"] = dict(self.seconds)
        return out

    @classmethod
    def from_json(cls, data: Any) -> ByteCost:
        d = fields.keys(data, _BYTE_FIELDS, "manifest cost.estimated", optional=("seconds",))
        if "seconds" in d and not isinstance(d["seconds"], dict):
            raise ValueError("manifest cost.estimated.seconds must be a JSON object")
        return cls(**{name: d[name] for name in _BYTE_FIELDS}, seconds=d.get("seconds"))


#: How an incremental merge's output bytes got there (``RealizedCost.output_bytes_by_method``): files
#: hard-linked (by an earlier MergePipe) or reflinked from the previous snapshot, bytes copied by the kernel
#: from it, bytes written.
OUTPUT_METHODS = ("linked", "cloned", "copied", "written")


@dataclass(frozen=True)
class RealizedCost:
    """Measured cost: exact byte counters, per-expert bytes, seconds per phase; ``requests_by_model``:
    remote requests per model id (each try), present only when an input was remote;
    ``output_bytes_by_method``: the output's bytes by ``OUTPUT_METHODS`` (they add up to ``output_bytes``),
    present only for an incremental merge (what the filesystem allowed, so outside the manifest hash)."""

    base_bytes: int
    expert_bytes: int
    output_bytes: int
    expert_bytes_by_model: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    requests_by_model: dict[str, int] = field(default_factory=dict)
    output_bytes_by_method: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in _BYTE_FIELDS:
            fields.integer(getattr(self, name), name)
        _set(
            self,
            "expert_bytes_by_model",
            {
                fields.text(k, "expert id"): fields.integer(v, f"expert_bytes_by_model[{k}]")
                for k, v in dict(self.expert_bytes_by_model).items()
            },
        )
        _set(
            self,
            "seconds",
            {fields.text(k, "phase name"): fields.number(v, f"seconds[{k}]") for k, v in dict(self.seconds).items()},
        )
        _set(
            self,
            "requests_by_model",
            {
                fields.text(k, "model id"): fields.integer(v, f"requests_by_model[{k}]")
                for k, v in dict(self.requests_by_model).items()
            },
        )
        by_method = dict(self.output_bytes_by_method)
        if by_method and (set(by_method) != set(OUTPUT_METHODS) or sum(by_method.values()) != self.output_bytes):
            raise ValueError(
                f"manifest cost.realized.output_bytes_by_method must give {', '.join(OUTPUT_METHODS)} "
                "adding up to output_bytes"
            )
        _set(
            self,
            "output_bytes_by_method",
            {k: fields.integer(by_method[k], f"output_bytes_by_method[{k}]") for k in OUTPUT_METHODS if by_method},
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in _BYTE_FIELDS}
        out["expert_bytes_by_model"] = dict(self.expert_bytes_by_model)
        out["seconds"] = dict(self.seconds)
        if self.requests_by_model:  # remote inputs only: other manifests are as they were
            out["requests_by_model"] = dict(self.requests_by_model)
        if self.output_bytes_by_method:  # incremental merges only: other manifests are as they were
            out["output_bytes_by_method"] = dict(self.output_bytes_by_method)
        return out

    @property
    def bytes_made(self) -> int:
        """The output bytes this merge wrote or had the kernel copy: all of them, but for files linked or
        reflinked from the previous snapshot (nothing was written for those)."""
        by_method = self.output_bytes_by_method
        return self.output_bytes - by_method.get("linked", 0) - by_method.get("cloned", 0)

    @classmethod
    def from_json(cls, data: Any) -> RealizedCost:
        names = (*_BYTE_FIELDS, "expert_bytes_by_model", "seconds")
        optional = ("requests_by_model", "output_bytes_by_method")
        d = fields.keys(data, names, "manifest cost.realized", optional=optional)
        for name in (*names[-2:], *optional):
            if not isinstance(d.get(name, {}), dict):
                raise ValueError(f"manifest cost.realized.{name} must be a JSON object")
        return cls(
            **{name: d[name] for name in names},
            requests_by_model=d.get("requests_by_model", {}),
            output_bytes_by_method=d.get("output_bytes_by_method", {}),
        )


@dataclass(frozen=True)
class Cost:
    """Estimated (by the planner) and realized (by the engine) cost."""

    estimated: ByteCost
    realized: RealizedCost

    def to_json(self) -> dict[str, Any]:
        return {"estimated": self.estimated.to_json(), "realized": self.realized.to_json()}

    @classmethod
    def from_json(cls, data: Any) -> Cost:
        d = fields.keys(data, ("estimated", "realized"), "manifest cost")
        return cls(estimated=ByteCost.from_json(d["estimated"]), realized=RealizedCost.from_json(d["realized"]))


@dataclass(frozen=True)
class ErrorBound:
    """Merge error vs the full-read merge: planned bound, realized value, and what it measures.

    ``kind`` says what the numbers are (e.g. "frobenius bound of omitted
    w_i*||delta_i_b||"); ``None`` means not known for this operator/run.
    """

    estimated: float | None
    realized: float | None
    kind: str

    def __post_init__(self) -> None:
        _set(self, "estimated", fields.optional_number(self.estimated, "error_bound.estimated"))
        _set(self, "realized", fields.optional_number(self.realized, "error_bound.realized"))
        fields.text(self.kind, "error_bound.kind")

    def to_json(self) -> dict[str, Any]:
        return {"estimated": self.estimated, "realized": self.realized, "kind": self.kind}

    @classmethod
    def from_json(cls, data: Any) -> ErrorBound:
        d = fields.keys(data, ("estimated", "realized", "kind"), "manifest error_bound")
        return cls(estimated=d["estimated"], realized=d["realized"], kind=d["kind"])


@dataclass(frozen=True)
class FileEntry:
    """One output file: path relative to the snapshot (posix), its hash (hex), size in bytes.

    ``algorithm`` names the hash: blake3 (``b3sum``) since manifest schema 2, sha256 in schema 1
    (``storage/hashing.py`` says why it changed). In JSON the hash is keyed by its algorithm.
    """

    name: str
    digest: str
    size: int
    algorithm: str = FILE_HASH

    def __post_init__(self) -> None:
        fields.text(self.name, "file name")
        parts = self.name.split("/")
        if self.name.startswith("/") or "\\" in self.name or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"file name must be a plain relative path inside the snapshot, got {self.name!r}")
        if self.name == MANIFEST_FILENAME:
            raise ValueError(f"{MANIFEST_FILENAME} cannot list itself among the snapshot files")
        if self.algorithm not in FILE_HASHES:
            raise ValueError(f"hash of {self.name} must be one of {', '.join(FILE_HASHES)}, got {self.algorithm!r}")
        if not (len(self.digest) == 64 and all(c in "0123456789abcdef" for c in self.digest)):
            raise ValueError(f"{self.algorithm} of {self.name} must be 64 lower-case hex digits, got {self.digest!r}")
        fields.integer(self.size, f"size of {self.name}")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, self.algorithm: self.digest, "size": self.size}

    @classmethod
    def from_json(cls, data: Any) -> FileEntry:
        given = [a for a in FILE_HASHES if isinstance(data, Mapping) and a in data]
        if len(given) != 1:
            raise ValueError(f"a manifest file entry needs exactly one hash ({' or '.join(FILE_HASHES)})")
        d = fields.keys(data, ("name", given[0], "size"), "manifest file entry")
        return cls(name=d["name"], digest=d[given[0]], size=d["size"], algorithm=given[0])


_SOFTWARE_FIELDS = ("mergepipe", "torch", "safetensors", "python")


@dataclass(frozen=True)
class SoftwareVersions:
    """Versions that produced the snapshot (they can change results, so they are hashed)."""

    mergepipe: str
    torch: str
    safetensors: str
    python: str

    def __post_init__(self) -> None:
        for name in _SOFTWARE_FIELDS:
            fields.text(getattr(self, name), f"software.{name}")

    @classmethod
    def current(cls) -> SoftwareVersions:
        """The versions installed in this interpreter (read from package metadata, no imports)."""

        def version(dist: str) -> str:
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                return "not installed"

        return cls(
            mergepipe=__version__,
            torch=version("torch"),
            safetensors=version("safetensors"),
            python=platform.python_version(),
        )

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SOFTWARE_FIELDS}

    @classmethod
    def from_json(cls, data: Any) -> SoftwareVersions:
        d = fields.keys(data, _SOFTWARE_FIELDS, "manifest software")
        return cls(**{name: d[name] for name in _SOFTWARE_FIELDS})


#: The schema this version writes. Schema 2 records blake3 file hashes; schema 1 (sha256) is still read,
#: so snapshots made before it verify and serve as ``--from`` for incremental merges.
MANIFEST_SCHEMA = 2
#: Every schema this version reads, with the file hash its entries carry.
FILE_HASH_OF_SCHEMA = {1: "sha256", 2: FILE_HASH}
# Dotted paths removed from the JSON before hashing; see the module docstring.
HASH_EXCLUDED_FIELDS: tuple[str, ...] = (
    "created_at",
    "manifest_hash",
    "cost.realized.seconds",
    "cost.estimated.seconds",
    "cost.realized.requests_by_model",
    "cost.realized.output_bytes_by_method",
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
    "schema",
    "snapshot_id",
    "model_id",
    "plan_digest",
    "base",
    "experts",
    "operator",
    "seed",
    "budget_bytes",
    "cost",
    "error_bound",
    "reads",
    "files",
    "software",
    "created_at",
    "extra",
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
        for name, kind in (
            ("base", ModelRef),
            ("operator", OperatorSpec),
            ("cost", Cost),
            ("error_bound", ErrorBound),
            ("software", SoftwareVersions),
        ):
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
        raise ValueError(
            f"manifest schema {schema!r} is not supported (this mergepipe reads schemas "
            f"{readable}); upgrade mergepipe to read it"
        )


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
