"""Canonical JSON, the Manifest dataclass, hashes and content-derived snapshot ids."""

from mergepipe.manifest.canonical import canonical_json, digest, normalise, sha256_hex
from mergepipe.manifest.manifest import (
    HASH_EXCLUDED_FIELDS,
    MANIFEST_FILENAME,
    MANIFEST_SCHEMA,
    ByteCost,
    Cost,
    ErrorBound,
    ExpertRef,
    FileEntry,
    Manifest,
    ModelRef,
    OperatorSpec,
    RealizedCost,
    SoftwareVersions,
    read_manifest,
    snapshot_id_for,
)
from mergepipe.manifest.ranges import canonical_ranges, compress_indices, expand_ranges

__all__ = [
    "HASH_EXCLUDED_FIELDS",
    "MANIFEST_FILENAME",
    "MANIFEST_SCHEMA",
    "ByteCost",
    "Cost",
    "ErrorBound",
    "ExpertRef",
    "FileEntry",
    "Manifest",
    "ModelRef",
    "OperatorSpec",
    "RealizedCost",
    "SoftwareVersions",
    "canonical_json",
    "canonical_ranges",
    "compress_indices",
    "digest",
    "expand_ranges",
    "normalise",
    "read_manifest",
    "sha256_hex",
    "snapshot_id_for",
]
