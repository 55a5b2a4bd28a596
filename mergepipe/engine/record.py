"""What an execution leaves besides the weights: the side files copied from
the base (the index of the output's shards, a chat template where the plan
sets one), the manifest that seals the snapshot (with the seconds the plan
predicted beside those realized), and the merge's row of timings that the
time model learns from (``record_timing``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergepipe.analysis.lora_expert import LORA, adapter_summary

from mergepipe.catalog import Catalog
from mergepipe.catalog.timings import host_key
from mergepipe.engine.job import Job
from mergepipe.errors import CatalogError, CorruptCheckpointError
from mergepipe.manifest.card import DERIVED_FILENAMES
from mergepipe.manifest.config_file import DTYPE_NAMES
from mergepipe.manifest.manifest import MANIFEST_SCHEMA, Manifest
from mergepipe.manifest.parts import (
    ByteCost,
    Cost,
    ErrorBound,
    ExpertRef,
    FileEntry,
    OperatorSpec,
    RealizedCost,
    SoftwareVersions,
)
from mergepipe.spec.plan import Plan
from mergepipe.spec.ranges import compress_indices
from mergepipe.catalog.records import Timing
from mergepipe.storage.checkpoint import INDEX_FILE, TOKENIZER_CONFIG_FILE
from mergepipe.storage.format import DTYPE_SIZES
from mergepipe.storage.location import RemotePath
from mergepipe.storage.remote import copy_file, read_file
from mergepipe.storage.sharding import index_text

#: transformers reads a chat template from this file in preference to tokenizer_config.json's.
_CHAT_TEMPLATE_FILE = "chat_template.jinja"


def copy_side_files(inputs: Job, staging: Path) -> None:
    """config.json, generation config and tokenizer files from the base (the
    config's dtype rewritten for ``out_dtype``, the plan's chat template set); the index of the output's
    shards when it has one (``inputs.layout``). Not the base's model card: it describes another model (the
    snapshot gets its own, ``manifest/card.py``)."""
    base = inputs.base
    out_dtype = inputs.plan.out_dtype
    template = inputs.plan.chat_template
    for name in base.aux_files:
        if name in DERIVED_FILENAMES:  # a merged base's card and config describe that base
            continue
        source = base.root / name
        if template is not None and name in (TOKENIZER_CONFIG_FILE, _CHAT_TEMPLATE_FILE):
            _write_chat_template(source, staging / name, template)
        elif name == "config.json" and out_dtype is not None:
            config = json.loads(read_file(source))  # the base may be remote: read_file fetches it
            for key in ("torch_dtype", "dtype"):
                if key in config:
                    config[key] = DTYPE_NAMES[out_dtype]
            (staging / name).write_text(json.dumps(config, indent=2) + "\n")
        else:
            copy_file(source, staging / name)  # shutil.copyfile for a local base, a download for a remote one
    if inputs.layout.indexed:
        total = sum(e.numel * DTYPE_SIZES[inputs.output_dtype(e)] for _, e in base.iter_tensors())
        (staging / INDEX_FILE).write_text(index_text(inputs.layout, total))


def _write_chat_template(source: Path | RemotePath, target: Path, template: str) -> None:
    """``template`` as the output's chat template: tokenizer_config.json is the base's with ``chat_template``
    set (its keys in the base file's order; re-serialised as transformers writes it); a
    ``chat_template.jinja``, which transformers prefers to the config's entry, becomes the template itself."""
    if source.name == _CHAT_TEMPLATE_FILE:
        target.write_text(template, encoding="utf-8")
        return
    try:
        config = json.loads(read_file(source).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        config = None
    if not isinstance(config, dict):
        raise CorruptCheckpointError(f"{source} is not a JSON object, so the plan's chat template cannot be set "
                                     "in it; fix or restore the file")
    config["chat_template"] = template
    target.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class ExpertFormats:
    """What a manifest records of the experts that are not full checkpoints: ``kinds``, each one's kind
    (``delta``, ``lora``); ``adapters``, per LoRA expert its config hash, rank, scale and factor bytes read.
    Both are empty when every expert holds full weights (those manifests, and their hashes, stay as they were)."""

    kinds: dict[str, str] = field(default_factory=dict)
    adapters: dict[str, dict] = field(default_factory=dict)


def expert_formats(catalog: Catalog, plan: Plan, realized: RealizedCost) -> ExpertFormats:
    """The ``ExpertFormats`` of ``plan``'s experts, with the factor bytes ``realized`` read of each adapter."""
    kinds = {e.id: k for e in plan.experts  # full weights are the default: only other formats are named
             if (k := catalog.models.get(e.id).kind) not in ("checkpoint", "snapshot")}
    read = realized.expert_bytes_by_model
    adapters = {e: {**adapter_summary(catalog, e), "factor_bytes_read": read.get(e, 0)}
                for e, k in kinds.items() if k == LORA}
    return ExpertFormats(kinds, adapters)


def build_manifest(
    plan: Plan,
    model_id: str,
    snapshot_id: str,
    files: tuple[FileEntry, ...],
    realized: RealizedCost,
    created_at: str,
    formats: ExpertFormats | None = None,
    schema: int = MANIFEST_SCHEMA,
) -> Manifest:
    """The manifest of a snapshot made from ``plan`` (timings in ``realized.seconds``); ``formats``: its
    experts that are not full checkpoints (none by default); ``schema``: the current one, or an older one
    when re-making a snapshot an older version sealed (``files`` then carry that schema's hashes)."""
    spec = plan.merge
    # every changed block read (and none updated from a rounded previous output): the full-read merge
    everything_read = plan.cost.expert_bytes == plan.cost.full_expert_bytes and not (plan.reuse and plan.reuse.updated)
    return Manifest(
        snapshot_id=snapshot_id,
        model_id=model_id,
        plan_digest=plan.digest,
        base=plan.base,
        experts=tuple(ExpertRef(e.id, e.fingerprint, spec.scalar_weight(e.id)) for e in plan.experts),
        operator=OperatorSpec(
            spec.operator,
            {"global": dict(spec.params), "experts": {e.expert_id: dict(e.params) for e in spec.experts}},
        ),
        seed=spec.seed,
        budget_bytes=plan.budget_bytes,
        cost=Cost(
            estimated=ByteCost(plan.cost.base_bytes, plan.cost.expert_bytes, plan.cost.output_bytes,
                               None if plan.seconds is None else plan.seconds.flat()),
            realized=realized,
        ),
        error_bound=ErrorBound(
            estimated=plan.error_bound,
            # every changed block read: the result is the full-read merge
            realized=0.0 if everything_read else None,
            kind=f"{plan.error_bound_kind}: frobenius norm of the fp32 merged delta omitted vs the full-read merge",
        ),
        reads={t: {e: compress_indices(ix) for e, ix in per.items() if ix} for t, per in plan.reads.items()},
        files=files,
        software=SoftwareVersions.current(),
        created_at=created_at,
        extra=_extra(plan, formats or ExpertFormats()),
        schema=schema,
    )


def _extra(plan: Plan, formats: ExpertFormats) -> dict:
    """The manifest's ``extra``: planning choices, and the plan's warnings when it has any."""
    extra: dict[str, Any] = {"policy": plan.policy, "out_dtype": plan.out_dtype, "block_bytes": plan.block_bytes}
    if formats.kinds:  # only when an expert is not a full checkpoint (other manifests keep their hashes)
        extra["expert_kinds"] = dict(sorted(formats.kinds.items()))
    if formats.adapters:  # only when an expert is a LoRA adapter
        extra["lora"] = dict(sorted(formats.adapters.items()))
    # output options, only when set (so that other manifests, and their hashes, stay as they were)
    if plan.out_shard_bytes is not None:
        extra["out_shard_bytes"] = plan.out_shard_bytes
    if plan.chat_template is not None:
        extra["chat_template"] = plan.chat_template
    warnings = [note for note in plan.notes if note.startswith("warning: ")]
    if warnings:
        extra["warnings"] = warnings
    if plan.reuse is not None:  # an incremental merge: what it took from the previous snapshot
        extra["reuse"] = {
            "snapshot": plan.reuse.snapshot,
            "manifest": plan.reuse.manifest_hash,
            "blocks": plan.reuse.block_count,
            "bytes": plan.reuse.output_bytes,
            "expert_bytes_saved": dict(sorted(plan.reuse.saved.items())),
        }
        if plan.reuse.updated:  # delta updates: not the from-scratch bytes, within the bound
            extra["reuse"]["delta_updated"] = {
                "blocks": {t: compress_indices(ix) for t, ix in sorted(plan.reuse.updated.items())},
                "replaced": dict(sorted(plan.reuse.replaced.items())),
                "bound": plan.reuse.bound,
            }
    return extra


def record_timing(catalog: Catalog, intent_id: str, plan: Plan, realized: RealizedCost, device: str) -> None:
    """Record what this merge took on ``device`` here (the engine's ``total``, for the expert bytes it read and
    the output bytes it wrote): the row the time model of its operator is fitted to (``spec/time_model.py``).

    The snapshot is committed by then, so a catalog that cannot take the row (locked, disk full) goes without
    it rather than fail the merge."""
    timing = Timing(realized.expert_bytes, realized.output_bytes, realized.seconds.get("total", 0.0))
    if timing.seconds <= 0:
        return
    try:
        catalog.timings.add_merge(intent_id, host_key(), device, plan.operator, timing)
    except CatalogError:
        pass
