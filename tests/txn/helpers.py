"""Snapshot payloads and a complete publish, shared by the txn tests and the crash child."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

from mergepipe.analysis.experts import describe_checkpoint
from mergepipe.manifest.manifest import ExpertRef, Manifest, snapshot_id_for
from mergepipe.spec.canonical import canonical_json
from mergepipe.spec.plan import ModelRef
from mergepipe.storage.checkpoint import open_checkpoint
from mergepipe.txn.publish import TransactionManager
from mergepipe.txn.verify import file_entries
from tests.manifest.factories import make_manifest, sha

PLAN = sha("the plan")
CREATED_AT = "2025-01-02T03:04:05Z"


def safetensors_bytes(values: list[float]) -> bytes:
    """A valid one-tensor F32 safetensors file, written by hand (no MergePipe, no torch)."""
    data = struct.pack(f"<{len(values)}f", *values)
    header = json.dumps({"w": {"dtype": "F32", "shape": [len(values)], "data_offsets": [0, len(data)]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def write_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A tiny HF-style checkpoint: config.json, model.safetensors, tokenizer.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"model_type": "tiny"}')
    (directory / "model.safetensors").write_bytes(safetensors_bytes([float(seed + i) for i in range(64)]))
    (directory / "tokenizer.json").write_text('{"vocab": {}}')
    return directory


def finish_snapshot(directory: Path, model_id: str, plan_digest: str = PLAN,
                    parents: tuple[ModelRef, ExpertRef] | None = None) -> Manifest:
    """Write the manifest of the files already in ``directory``; return it."""
    files = file_entries(directory)
    base, expert = parents or (ModelRef("base", sha("base")), ExpertRef("e1", sha("e1"), 1.0))
    manifest = make_manifest(
        snapshot_id=snapshot_id_for(plan_digest, files), plan_digest=plan_digest, files=files,
        model_id=model_id, base=base, experts=(expert,), created_at=CREATED_AT,
    )
    manifest.write(directory)
    return manifest


def publish_snapshot(catalog, out: Path, model_id: str, parents: tuple[ModelRef, ExpertRef],
                     on_step: Callable[[str], None] | None = None, plan: str = PLAN) -> Manifest:
    """The whole protocol against a real catalog, as the engine does it:
    the published directory is described after the rename, since the catalog
    no longer opens directories itself. ``plan``: a saved plan's digest."""
    tm = TransactionManager(on_step=on_step)
    with tm.staged(
        out,
        record_intent=lambda a: catalog.snapshots.add_intent(
            a.intent_id, plan, catalog.plans.get(plan), model_id, a.out_path, a.path
        ),
        on_abort=lambda a: catalog.snapshots.abort(a.intent_id),
    ) as area:
        write_checkpoint(area.path, seed=1)
        manifest = finish_snapshot(area.path, model_id, plan_digest=plan, parents=parents)
        tm.publish(area, commit=lambda: catalog.snapshots.commit(
            area.intent_id, manifest.snapshot_id, manifest.manifest_hash,
            canonical_json(manifest.to_json()).decode(), published_content(catalog, area.out_path, model_id),
            [(parents[0].id, "base"), (parents[1].id, "expert")],
        ))
    return manifest


def published_content(catalog, out: Path, model_id: str):
    """The catalog rows of the snapshot at ``out``, described as the engine does."""
    return describe_checkpoint(open_checkpoint(out), model_id, "snapshot", catalog.block_bytes, catalog.now())
