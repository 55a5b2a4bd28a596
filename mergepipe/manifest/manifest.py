"""The manifest: the sealed record of a snapshot, its hash (every field but ``HASH_EXCLUDED_FIELDS``) and
content-derived id, and the files it determines (``README.md``, ``mergepipe_config.yml``)."""

from __future__ import annotations

import json
import platform
from dataclasses import field
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any, Iterable

import yaml
from pydantic import AfterValidator, Field, Strict, ValidationError, model_serializer, model_validator
from pydantic.dataclasses import dataclass

from mergepipe import __version__
from mergepipe.errors import VerifyError
from mergepipe.spec.canonical import (
    STORED,
    Count,
    Number,
    Stored,
    Text,
    canonical_json,
    canonical_ranges,
    one_line,
    sha256_hex,
    when_set,
)
from mergepipe.spec.mergekit import rescale_to_mergekit
from mergepipe.spec.operators import get_operator
from mergepipe.spec.plan import ModelRef
from mergepipe.spec.settings import pinned
from mergepipe.storage.checkpoint import CARD_FILENAME, MERGE_CONFIG_FILENAME
from mergepipe.storage.source import FILE_HASH, FILE_HASHES

MANIFEST_FILENAME = "manifest.json"
#: The schema this version writes: blake3 file hashes. Schema 1 (sha256) is still read and verified.
MANIFEST_SCHEMA = 2
FILE_HASH_OF_SCHEMA = {1: "sha256", 2: FILE_HASH}
#: Dotted paths left out of the hash: a timestamp, timings and predictions, remote requests (retries vary),
#: how an incremental merge's output bytes got there (the filesystem decides), and the hash itself.
HASH_EXCLUDED_FIELDS: tuple[str, ...] = (
    "created_at",
    "manifest_hash",
    "cost.realized.seconds",
    "cost.estimated.seconds",
    "cost.realized.requests_by_model",
    "cost.realized.output_bytes_by_method",
)
#: How an incremental merge's output bytes got there: hard-linked (by an earlier MergePipe) or reflinked
#: from the previous snapshot, copied by the kernel from it, written.
OUTPUT_METHODS = ("linked", "cloned", "copied", "written")
#: Free-form values as plain JSON (tuples as lists; NaN and keys that are not strings refused).
PlainJson = Annotated[dict[str, Any], AfterValidator(lambda v: json.loads(canonical_json(v)))]
Seconds = dict[Text, Number]


@dataclass(frozen=True, config=STORED)
class ExpertRef(Stored):
    """An expert input with its merge weight."""

    id: Text
    fingerprint: Text
    weight: Number


@dataclass(frozen=True, config=STORED)
class OperatorSpec(Stored):
    """The merge operator's registry name and its parameter settings (plain JSON)."""

    name: Text
    params: PlainJson = field(default_factory=dict)


@dataclass(frozen=True, config=STORED)
class ByteCost(Stored):
    """Bytes planned; ``seconds``: the prediction on the machine that merged (``Prediction.flat``; per phase
    in manifests of the former cost model), None when nothing was predicted."""

    base_bytes: Count
    expert_bytes: Count
    output_bytes: Count
    seconds: Seconds | None = None

    _write = when_set(seconds=None)


@dataclass(frozen=True, config=STORED)
class RealizedCost(Stored):
    """Measured cost: exact byte counters, per-expert bytes, seconds per phase; remote requests per model
    (an input was remote) and the output's bytes by ``OUTPUT_METHODS`` (an incremental merge)."""

    base_bytes: Count
    expert_bytes: Count
    output_bytes: Count
    expert_bytes_by_model: dict[Text, Count]
    seconds: Seconds
    requests_by_model: dict[Text, Count] = field(default_factory=dict)
    output_bytes_by_method: dict[str, Count] = field(default_factory=dict)

    _write = when_set(requests_by_model={}, output_bytes_by_method={})

    @model_validator(mode="after")
    def _check_methods(self) -> RealizedCost:
        by_method = self.output_bytes_by_method
        if by_method and (set(by_method) != set(OUTPUT_METHODS) or sum(by_method.values()) != self.output_bytes):
            raise ValueError(f"output_bytes_by_method must give {', '.join(OUTPUT_METHODS)} adding up to output_bytes")
        return self

    @property
    def bytes_made(self) -> int:
        """The output bytes written or copied by the kernel: all but those linked or reflinked."""
        by_method = self.output_bytes_by_method
        return self.output_bytes - by_method.get("linked", 0) - by_method.get("cloned", 0)


@dataclass(frozen=True, config=STORED)
class Cost(Stored):
    estimated: ByteCost
    realized: RealizedCost


@dataclass(frozen=True, config=STORED)
class ErrorBound(Stored):
    """Merge error vs the full-read merge, planned and realized (None: not known), and what it measures."""

    estimated: Number | None
    realized: Number | None
    kind: Text


@dataclass(frozen=True, config=STORED)
class FileEntry(Stored):
    """One output file: its path in the snapshot (posix), its hash under ``algorithm`` (blake3 since schema
    2, sha256 before), its size; stored as ``{name, ALGORITHM: hash, size}``."""

    name: Text
    digest: Annotated[str, Field(pattern="^[0-9a-f]{64}$")]
    size: Count
    algorithm: str = FILE_HASH

    @model_validator(mode="before")
    @classmethod
    def _read(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        given = [a for a in FILE_HASHES if a in data]
        if len(given) != 1:
            raise ValueError(f"a manifest file entry needs exactly one hash ({' or '.join(FILE_HASHES)})")
        data = dict(data)
        data["digest"], data["algorithm"] = data.pop(given[0]), given[0]
        return data

    @model_validator(mode="after")
    def _check(self) -> FileEntry:
        parts = self.name.split("/")
        if self.name.startswith("/") or "\\" in self.name or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"file name must be a plain relative path inside the snapshot, got {self.name!r}")
        if self.name == MANIFEST_FILENAME:
            raise ValueError(f"{MANIFEST_FILENAME} cannot list itself among the snapshot files")
        if self.algorithm not in FILE_HASHES:
            raise ValueError(f"hash of {self.name} must be one of {', '.join(FILE_HASHES)}, got {self.algorithm!r}")
        return self

    @model_serializer
    def _write(self) -> dict[str, Any]:
        return {"name": self.name, self.algorithm: self.digest, "size": self.size}


@dataclass(frozen=True, config=STORED)
class SoftwareVersions(Stored):
    """Versions that produced the snapshot (they can change results, so they are hashed)."""

    mergepipe: Text
    torch: Text
    safetensors: Text
    python: Text

    @classmethod
    def current(cls) -> SoftwareVersions:

        def version(dist: str) -> str:
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                return "not installed"

        return cls(__version__, version("torch"), version("safetensors"), platform.python_version())


def _files(files: tuple[FileEntry, ...]) -> tuple[FileEntry, ...]:
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise ValueError("manifest lists a file name twice")
    return tuple(sorted(files, key=lambda f: f.name))


def _check_schema(schema: Any) -> int:
    if isinstance(schema, bool) or schema not in FILE_HASH_OF_SCHEMA:
        raise ValueError(
            f"manifest schema {schema!r} is not supported (this mergepipe reads schemas "
            f"{', '.join(map(str, FILE_HASH_OF_SCHEMA))}); upgrade mergepipe to read it"
        )
    return int(schema)


@dataclass(frozen=True, config=STORED)
class Manifest(Stored):
    """The sealed record of one snapshot (reads as canonical ranges, files sorted: equal values hash alike)."""

    snapshot_id: Text
    model_id: Text
    plan_digest: Text
    base: ModelRef
    experts: tuple[ExpertRef, ...]
    operator: OperatorSpec
    seed: Annotated[int, Strict()]
    budget_bytes: Count | None
    cost: Cost
    error_bound: ErrorBound
    reads: Annotated[
        dict[Text, dict[Text, list[Any]]],
        AfterValidator(lambda r: {t: {e: canonical_ranges(x) for e, x in per.items()} for t, per in r.items()}),
    ]
    files: Annotated[tuple[FileEntry, ...], AfterValidator(_files)]
    software: SoftwareVersions
    created_at: Text
    extra: PlainJson = field(default_factory=dict)
    schema: Annotated[int, AfterValidator(_check_schema)] = MANIFEST_SCHEMA

    @model_validator(mode="before")
    @classmethod
    def _read(cls, data: Any) -> Any:
        """A stored manifest: its schema first (a later one may have other keys), its hash dropped (derived)."""
        if isinstance(data, dict):
            _check_schema(data.get("schema"))
            data = {k: v for k, v in data.items() if k != "manifest_hash"}
        return data

    @model_validator(mode="after")
    def _check_hashes(self) -> Manifest:
        algorithm = FILE_HASH_OF_SCHEMA[self.schema]
        if any(f.algorithm != algorithm for f in self.files):
            raise ValueError(f"manifest schema {self.schema} records {algorithm} file hashes, and only those")
        return self

    def to_json(self) -> dict[str, Any]:
        """What ``manifest.json`` holds, ``manifest_hash`` included."""
        return {**super().to_json(), "manifest_hash": self.manifest_hash}

    def canonical_bytes(self) -> bytes:
        data = super().to_json()
        for dotted in HASH_EXCLUDED_FIELDS:
            *parents, leaf = dotted.split(".")
            node = data
            for key in parents:
                node = node.get(key, {})
            node.pop(leaf, None)
        return canonical_json(data)

    @property
    def manifest_hash(self) -> str:
        return sha256_hex(self.canonical_bytes())

    def write(self, directory: str | Path) -> Path:
        """Write ``manifest.json`` into ``directory``, never over one."""
        path = Path(directory) / MANIFEST_FILENAME
        with open(path, "xb") as fh:
            fh.write(canonical_json(self.to_json()))
        return path

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        """``directory/manifest.json``, its stored hash checked; VerifyError if missing, malformed or edited."""
        manifest, stored = read_manifest(directory)
        if stored != manifest.manifest_hash:
            raise VerifyError(
                f"{Path(directory) / MANIFEST_FILENAME}: stored manifest_hash {stored} does not match "
                f"its fields ({manifest.manifest_hash}); the manifest was edited — restore or re-run the merge"
            )
        return manifest


def read_manifest(directory: str | Path) -> tuple[Manifest, str | None]:
    """``directory/manifest.json`` and its stored hash (None if absent), unchecked; else VerifyError."""
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
        reason = one_line(exc) if isinstance(exc, ValidationError) else str(exc)
        raise VerifyError(f"{path}: not a valid manifest ({reason}); the snapshot is damaged") from None
    stored = data.get("manifest_hash")
    return manifest, stored if isinstance(stored, str) else None


def snapshot_id_for(plan_digest: str, files: Iterable[FileEntry]) -> str:
    """``snap-`` + 16 hex digits of the sha256 of the plan digest and the output files' (name, hash) pairs."""
    pairs = sorted([f.name, f.digest] for f in files)
    return "snap-" + sha256_hex(canonical_json({"plan_digest": plan_digest, "files": pairs}))[:16]


# -- the files a manifest determines ------------------------------------------------------------------

#: Output dtypes as config files (this one, mergekit's, transformers' config.json) spell them.
DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
#: The dtype every merge computes in, as ``dtype:`` says it.
COMPUTE_DTYPE = DTYPE_NAMES["F32"]
#: The text ``derived_files`` writes, recorded in each manifest's ``extra.card_format``: raised with any change
#: to it, so that ``verify`` writes again only the files of this one (1: manifests before it was recorded).
CARD_FORMAT = 2


def merge_config_yaml(manifest: Manifest) -> str:
    """``mergepipe_config.yml``: the snapshot's merge as a mergekit-style config that reruns to the same bytes."""
    m = manifest
    method, params = _method_and_params(m)
    experts = m.operator.params.get("experts", {})
    models = [
        {"model": pinned(e.id), **({"parameters": dict(experts[e.id])} if experts.get(e.id) else {})} for e in m.experts
    ]
    if method == "slerp":
        models.insert(0, {"model": pinned(m.base.id)})  # mergekit lists both ends of the interpolation
    if method == "linear":  # mergekit averages its base_model: listed with its weight, else out (base_weight 0)
        if "base_weight" in params:
            models.insert(0, {"model": pinned(m.base.id), "parameters": {"weight": params.pop("base_weight")}})
        else:
            params["base_weight"] = 0
    # nuslerp and multislerp of the models themselves: mergekit's form has no base_model, the base is the first model
    baseless = method in ("nuslerp", "multislerp") and params.get("task_vectors", True) is False
    if baseless:
        params.pop("task_vectors")
        weight = params.pop("base_weight", None)
        models.insert(
            0, {"model": pinned(m.base.id), **({"parameters": {"weight": weight}} if weight is not None else {})}
        )
    config: dict[str, Any] = {
        "merge_method": method,
        **({} if baseless else {"base_model": pinned(m.base.id)}),
        "models": models,
    }
    if "passthrough" in m.extra:  # a frankenmerge states its slices, one model each, and no parameters
        slices = [
            {"sources": [{"model": pinned(s["model"]), "layer_range": s["layer_range"]}]}
            for s in m.extra["passthrough"]["slices"]
        ]
        config = {"merge_method": method, "base_model": pinned(m.base.id), "slices": slices}
    if params:
        config["parameters"] = params
    config["dtype"] = COMPUTE_DTYPE
    if m.extra.get("out_dtype"):
        config["out_dtype"] = DTYPE_NAMES[m.extra["out_dtype"]]
    if m.extra.get("chat_template"):
        config["chat_template"] = m.extra["chat_template"]
    config["mergepipe"] = _mergepipe_section(m)
    header = [
        f"# Snapshot {m.snapshot_id} of '{m.model_id}' (manifest {m.manifest_hash[:16]}) as a mergekit-style",
        "# config. `model:` entries are MergePipe catalog ids of the exact versions merged (mergekit needs",
        "# paths there). Rerun: mergepipe merge --db CATALOG --config mergepipe_config.yml --out DIR",
        f"# dtype: {COMPUTE_DTYPE} is what MergePipe computed in, so that mergekit computes the same.",
    ]
    if not m.extra.get("out_dtype"):
        header.append(
            "# mergepipe.out_dtype: base kept each tensor's dtype (mergekit writes float32 without out_dtype)."
        )
    if m.operator.name == "avg":
        header.append("# MergePipe's avg is written as mergekit's linear with equal weights: the same mean.")
    if method == "linear" and params.get("base_weight") == 0:
        header.append("# base_weight: 0 (MergePipe's) keeps base_model out of the average; mergekit would add it.")
    return "\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False, allow_unicode=True)


def _method_and_params(m: Manifest) -> tuple[str, dict[str, Any]]:
    params = dict(m.operator.params.get("global", {}))
    if "passthrough" in m.extra:  # no operator: tensors copied as they are
        return m.operator.name, params
    if m.operator.name == "avg":
        return "linear", params
    names = get_operator(m.operator.name).global_params().to_dict()
    if "rescale" in names:
        params["rescale"] = rescale_to_mergekit(params.get("rescale", names["rescale"]))
    return m.operator.name, params


def _mergepipe_section(m: Manifest) -> dict[str, Any]:
    written = "none" if m.budget_bytes is None else f"{m.budget_bytes}B"  # a manifest without the text
    section: dict[str, Any] = {
        "budget": m.extra.get("budget") or written,
        "policy": m.extra.get("policy", "energy"),
        "seed": m.seed,
        "block_bytes": m.extra.get("block_bytes"),
        "model_id": m.model_id.split("@")[0],
    }
    if m.extra.get("out_shard_bytes"):
        section["out_shard_size"] = exact_size(m.extra["out_shard_bytes"])
    if not m.extra.get("out_dtype"):
        section["out_dtype"] = "base"
    return {k: v for k, v in section.items() if v is not None}


def exact_size(n: int) -> str:
    """``n`` bytes in the largest unit that states it exactly (``40KB``, ``5GiB``, else ``123B``)."""
    for unit, factor in (("GB", 10**9), ("GiB", 1 << 30), ("MB", 10**6), ("MiB", 1 << 20), ("KB", 1000), ("KiB", 1024)):
        if n % factor == 0:
            return f"{n // factor}{unit}"
    return f"{n}B"


def derived_files(manifest: Manifest) -> dict[str, str]:
    """``{file name: text}`` of the files a snapshot's manifest determines."""
    return {CARD_FILENAME: model_card(manifest), MERGE_CONFIG_FILENAME: merge_config_yaml(manifest)}


def card_format(manifest: Manifest) -> int:
    value = manifest.extra.get("card_format", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def as_written(manifest: Manifest, text: str | None, written: str) -> bool:
    """Whether ``text`` (a derived file's; None: unreadable) is what MergePipe wrote: ``written`` itself, or for
    a card of an earlier format (which this release cannot write again) a text naming the snapshot."""
    if text is None:
        return False
    return text == written if card_format(manifest) == CARD_FORMAT else manifest.snapshot_id in text


def read_text(path: Path) -> str | None:
    """A derived file's text; None when it cannot be read as UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def model_card(manifest: Manifest) -> str:
    """``README.md``: what was merged, how, at what cost, and how to redo it; its front matter is the Hub's
    for a merge (``base_model``: the models merged as people know them, ``base_model_relation: merge``)."""
    m = manifest
    realized, estimated = m.cost.realized, m.cost.estimated
    budget = "none" if m.budget_bytes is None else f"{m.budget_bytes:,} bytes"
    if m.extra.get("budget") and m.budget_bytes is not None:
        budget = f"{m.extra['budget']} ({budget})"
    bound = "-" if m.error_bound.estimated is None else f"{m.error_bound.estimated:.6g} ({m.error_bound.kind})"
    names: dict[str, str] = m.extra.get("expert_names", {})  # as people know them: a Hub id, a folder's name
    merged = [m.extra.get("base_name") or m.base.id, *(names.get(e.id, e.id) for e in m.experts)]
    front = {
        "base_model": list(dict.fromkeys(merged)),
        "base_model_relation": "merge",
        "library_name": "transformers",
        "tags": ["merge", "mergepipe"],
    }
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False, allow_unicode=True, default_flow_style=None, width=1 << 16).rstrip(),
        "---",
        f"# {m.model_id}",
        "",
        f"A merge of `{m.base.id}` with {len(m.experts)} expert(s) by **{m.operator.name}**, made by MergePipe "
        f"{m.software.mergepipe}. Check the files with `mergepipe verify DIR`.",
        "",
        "| | |",
        "|---|---|",
        f"| snapshot | `{m.snapshot_id}` |",
        f"| manifest hash | `{m.manifest_hash}` |",
        f"| plan digest | `{m.plan_digest}` |",
        f"| operator | {m.operator.name}, seed {m.seed} |",
        f"| expert-I/O budget | {budget} |",
        f"| expert bytes | {estimated.expert_bytes:,} planned, {realized.expert_bytes:,} read |",
        f"| error bound vs the full-read merge | {bound} |",
        f"| output dtype, policy | {m.extra.get('out_dtype') or 'as the base'}, {m.extra.get('policy', '-')} |",
        "",
        "## Inputs",
        "",
        "| role | model | weight | content fingerprint |",
        "|---|---|---|---|",
        f"| base | `{m.base.id}` | | `{m.base.fingerprint[:16]}` |",
        *(f"| expert | `{e.id}` | {_weight(m, e.id, e.weight)} | `{e.fingerprint[:16]}` |" for e in m.experts),
        "",
        "## Reproduce",
        "",
        f"`{MERGE_CONFIG_FILENAME}` beside this card states the merge as a mergekit-style config (the `model:` "
        "entries are catalog ids of the exact versions merged):",
        "",
        "```yaml",
        "\n".join(line for line in merge_config_yaml(m).splitlines() if not line.startswith("#")).rstrip(),
        "```",
        "",
        "In a catalog with these inputs registered under these ids:",
        "",
        "```bash",
        f"mergepipe merge --db CATALOG --config {MERGE_CONFIG_FILENAME} --out DIR",
        "```",
        "",
    ]
    return "\n".join(lines)


def _weight(m: Manifest, expert_id: str, number: float) -> str:
    """The expert's ``weight`` as the merge stated it (a gradient or filter rules in YAML's flow style), else
    ``number``, the manifest's."""
    params = m.operator.params
    own: dict[str, Any] = params.get("experts", {}).get(expert_id, {})
    value = own.get("weight", params.get("global", {}).get("weight"))
    if value is None:
        return f"{number:g}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g}"
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
    return text.removesuffix("...").strip().replace("|", "\\|")  # a bar would end the table's cell
