"""The Manifest: the sealed record of a snapshot, its parts, hashes and snapshot ids."""

from mergepipe.manifest.manifest import (
    HASH_EXCLUDED_FIELDS,
    MANIFEST_FILENAME,
    MANIFEST_SCHEMA,
    Manifest,
    read_manifest,
    snapshot_id_for,
)
from mergepipe.manifest.manifest import (
    ByteCost,
    Cost,
    ErrorBound,
    ExpertRef,
    FileEntry,
    OperatorSpec,
    RealizedCost,
    SoftwareVersions,
)

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
    "OperatorSpec",
    "RealizedCost",
    "SoftwareVersions",
    "read_manifest",
    "snapshot_id_for",
]
