"""The typed parts of a manifest: inputs, operator, costs, error bound, files, software.

Each is a frozen dataclass with strict ``from_json`` (missing or unknown keys
are errors, so a typo never passes silently) and normalising construction
(weights and timings become floats), so JSON round trips are exact.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Mapping

from mergepipe import __version__
from mergepipe.spec import fields
from mergepipe.spec.canonical import normalise
from mergepipe.storage.hashing import FILE_HASH, FILE_HASHES

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
            _set(self, "seconds", {fields.text(k, "phase name"): fields.number(v, f"estimated seconds[{k}]")
                                   for k, v in dict(self.seconds).items()})

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
        _set(self, "expert_bytes_by_model", {
            fields.text(k, "expert id"): fields.integer(v, f"expert_bytes_by_model[{k}]")
            for k, v in dict(self.expert_bytes_by_model).items()
        })
        _set(self, "seconds", {
            fields.text(k, "phase name"): fields.number(v, f"seconds[{k}]") for k, v in dict(self.seconds).items()
        })
        _set(self, "requests_by_model", {
            fields.text(k, "model id"): fields.integer(v, f"requests_by_model[{k}]")
            for k, v in dict(self.requests_by_model).items()
        })
        by_method = dict(self.output_bytes_by_method)
        if by_method and (set(by_method) != set(OUTPUT_METHODS) or sum(by_method.values()) != self.output_bytes):
            raise ValueError(f"manifest cost.realized.output_bytes_by_method must give {', '.join(OUTPUT_METHODS)} "
                             "adding up to output_bytes")
        _set(self, "output_bytes_by_method", {
            k: fields.integer(by_method[k], f"output_bytes_by_method[{k}]") for k in OUTPUT_METHODS if by_method})

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
        return cls(**{name: d[name] for name in names}, requests_by_model=d.get("requests_by_model", {}),
                   output_bytes_by_method=d.get("output_bytes_by_method", {}))


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

        return cls(mergepipe=__version__, torch=version("torch"), safetensors=version("safetensors"),
                   python=platform.python_version())

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SOFTWARE_FIELDS}

    @classmethod
    def from_json(cls, data: Any) -> SoftwareVersions:
        d = fields.keys(data, _SOFTWARE_FIELDS, "manifest software")
        return cls(**{name: d[name] for name in _SOFTWARE_FIELDS})
