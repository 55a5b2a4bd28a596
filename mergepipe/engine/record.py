"""What an execution leaves besides the weights: the side files copied from
the base (the index of the output's shards, a chat template where the plan
sets one), the manifest that seals the snapshot (with the seconds the plan
predicted beside those realized), and the merge's row of timings that the
time model learns from (``record_timing``)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergepipe.analysis.lora_expert import LORA, adapter_summary

from mergepipe.catalog import Catalog
from mergepipe.catalog.timings import host_key
from mergepipe.engine.job import Job
from mergepipe.errors import CatalogError, CorruptCheckpointError
from mergepipe.manifest.card import CARD_FORMAT
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
from mergepipe.storage.checkpoint import INDEX_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILES, Checkpoint
from mergepipe.storage.format import DTYPE_SIZES
from mergepipe.storage.location import HUB_COMMIT, RemotePath, location
from mergepipe.storage.remote import RemoteClient, copy_file, read_file
from mergepipe.storage.sharding import OutputLayout, index_text

#: transformers reads a chat template from this file in preference to tokenizer_config.json's.
_CHAT_TEMPLATE_FILE = "chat_template.jinja"


def copy_side_files(inputs: Job, staging: Path) -> None:
    """The side files of a merge (``write_side_files``), whose output has the base's tensors."""
    total = sum(e.numel * DTYPE_SIZES[inputs.output_dtype(e)] for _, e in inputs.base.iter_tensors())
    write_side_files(inputs.plan, inputs.base, inputs.layout, total, staging)


def write_side_files(plan: Plan, base: Checkpoint, layout: OutputLayout, total_bytes: int, staging: Path) -> None:
    """config.json, generation config and tokenizer files from the base (the
    config's dtype rewritten for ``out_dtype`` and a passthrough's layer count for its copy map, the plan's
    chat template set; the tokenizer's files left out when the plan says so); the index of the output's
    shards (``layout``, of ``total_bytes`` of tensor data) when it has one. Not the base's model card: it
    describes another model (the snapshot gets its own, ``manifest/card.py``)."""
    out_dtype = plan.out_dtype
    template = plan.chat_template
    client = RemoteClient() if isinstance(base.root, RemotePath) else None  # one listing of a remote base's files
    for name in base.aux_files:  # not a merged base's card and config: they describe that base
        if not plan.copy_tokenizer and name in TOKENIZER_FILES:
            continue
        source = base.root / name
        if template is not None and name in (TOKENIZER_CONFIG_FILE, _CHAT_TEMPLATE_FILE):
            _write_chat_template(source, staging / name, template, client)
        elif name == "config.json" and (out_dtype is not None or plan.copies is not None):
            config = json.loads(read_file(source, client))  # the base may be remote: read_file fetches it
            for key in ("torch_dtype", "dtype"):
                if key in config and out_dtype is not None:
                    config[key] = DTYPE_NAMES[out_dtype]
            if plan.copies is not None:
                config = plan.copies.output_config(config)
            (staging / name).write_text(json.dumps(config, indent=2) + "\n")
        else:
            copy_file(source, staging / name, client)  # shutil.copyfile for a local base, a download for a remote one
    if layout.indexed:
        (staging / INDEX_FILE).write_text(index_text(layout, total_bytes))


def _write_chat_template(source: Path | RemotePath, target: Path, template: str,
                         client: RemoteClient | None = None) -> None:
    """``template`` as the output's chat template: tokenizer_config.json is the base's with ``chat_template``
    set (its keys in the base file's order; re-serialised as transformers writes it); a
    ``chat_template.jinja``, which transformers prefers to the config's entry, becomes the template itself."""
    if source.name == _CHAT_TEMPLATE_FILE:
        target.write_text(template, encoding="utf-8")
        return
    try:
        config = json.loads(read_file(source, client).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        config = None
    if not isinstance(config, dict):
        raise CorruptCheckpointError(f"{source} is not a JSON object, so the plan's chat template cannot be set "
                                     "in it; fix or restore the file")
    config["chat_template"] = template
    target.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class InputRecords:
    """What a manifest records of the inputs beyond their ids and fingerprints: ``base_name``, the base as
    people know it (the model card's first ``base_model``, ``base_name`` below); ``expert_names``, the experts
    known by another name than their catalog id (the card's other ``base_model`` entries, ``location_name``
    below); of the experts that are not full checkpoints, ``kinds``, each one's kind (``delta``, ``lora``),
    and ``adapters``, per LoRA expert its config hash, rank, scale and factor bytes read; ``hub_commits``, of
    the inputs read from the Hugging Face Hub, the commit each was (``ORG/NAME@COMMIT``: never a branch, which
    moves). The last four are empty when every expert holds full weights in a folder named as its id and
    nothing came from the Hub (those manifests stay as they were)."""

    base_name: str | None = None
    kinds: dict[str, str] = field(default_factory=dict)
    adapters: dict[str, dict] = field(default_factory=dict)
    expert_names: dict[str, str] = field(default_factory=dict)
    hub_commits: dict[str, str] = field(default_factory=dict)


def input_records(catalog: Catalog, plan: Plan, realized: RealizedCost) -> InputRecords:
    """The ``InputRecords`` of ``plan``'s inputs, with the factor bytes ``realized`` read of each adapter."""
    kinds = {e.id: k for e in plan.experts  # full weights are the default: only other formats are named
             if (k := catalog.models.get(e.id).kind) not in ("checkpoint", "snapshot")}
    read = realized.expert_bytes_by_model
    adapters = {e: {**adapter_summary(catalog, e), "factor_bytes_read": read.get(e, 0)}
                for e, k in kinds.items() if k == LORA}
    names = {e.id: name for e in plan.experts if (name := location_name(catalog, e.id)) != e.id}
    commits = {m.id: commit for m in (plan.base, *plan.experts) if (commit := hub_commit(catalog, m.id)) is not None}
    return InputRecords(base_name(catalog, plan.base.id), kinds, adapters, names, commits)


def hub_commit(catalog: Catalog, model_id: str) -> str | None:
    """``ORG/NAME@COMMIT`` of a model read from the Hub: an ``hf://`` input (registered at a commit), or a
    folder of the Hub's cache (``models--ORG--NAME/snapshots/COMMIT``: a Hub adapter's download); None for
    any other."""
    root = location(catalog.models.get(model_id).uri)
    if isinstance(root, RemotePath):
        hub = root.hub
        return None if hub is None or hub.commit is None else f"{hub.repo_id}@{hub.commit}"
    cached = _HUB_CACHE.match(root.parent.parent.name) if root.parent.name == "snapshots" else None
    return f"{cached[1]}/{cached[2]}@{root.name}" if cached and HUB_COMMIT.match(root.name) else None


def base_name(catalog: Catalog, base_id: str) -> str:
    """The base as people know it, never the catalog's id (which means nothing outside the catalog): the
    Hub id its config.json's ``_name_or_path`` gives (a model loaded from the Hub and saved keeps it there),
    else its ``location_name``. A merged base's config.json is its own base's, so only its location names it."""
    record = catalog.models.get(base_id)
    root = location(record.uri)
    if record.kind != "snapshot" and not isinstance(root, RemotePath):
        named = _name_or_path(root / "config.json")
        if named is not None:
            return named
    return location_name(catalog, base_id)


def location_name(catalog: Catalog, model_id: str) -> str:
    """A model as people know it from where it is: the Hub id of an ``hf://`` input or of a folder in the
    Hub's cache (``models--ORG--NAME/snapshots/REVISION``), else its folder's (or object prefix's) name.
    Not its config.json's ``_name_or_path``: a fine-tune saved by transformers keeps there the id of the
    model it was trained from, its base."""
    root = location(catalog.models.get(model_id).uri)
    if isinstance(root, RemotePath):
        return root.name if root.hub is None else root.hub.repo_id
    cached = _HUB_CACHE.match(root.parent.parent.name) if root.parent.name == "snapshots" else None
    return f"{cached[1]}/{cached[2]}" if cached else root.name


#: A Hugging Face Hub repository id, ``ORG/NAME``.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
#: The folder the Hub's cache keeps a repository in.
_HUB_CACHE = re.compile(r"^models--([A-Za-z0-9][A-Za-z0-9._-]*)--([A-Za-z0-9][A-Za-z0-9._-]*)$")


def _name_or_path(config_path: Path) -> str | None:
    """``_name_or_path`` of a config.json when it is a Hub id (not a local path); None otherwise."""
    try:
        config = json.loads(config_path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    value = config.get("_name_or_path") if isinstance(config, dict) else None
    return value if isinstance(value, str) and _HUB_ID.match(value) and ".." not in value else None


def build_manifest(
    plan: Plan,
    model_id: str,
    snapshot_id: str,
    files: tuple[FileEntry, ...],
    realized: RealizedCost,
    created_at: str,
    inputs: InputRecords | None = None,
    schema: int = MANIFEST_SCHEMA,
) -> Manifest:
    """The manifest of a snapshot made from ``plan`` (timings in ``realized.seconds``); ``inputs``: what it
    records of the inputs beyond ids and fingerprints (nothing by default); ``schema``: the current one, or an
    older one when re-making a snapshot an older version sealed (``files`` then carry that schema's hashes)."""
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
        extra=_extra(plan, inputs or InputRecords()),
        schema=schema,
    )


def _extra(plan: Plan, inputs: InputRecords) -> dict:
    """The manifest's ``extra``: planning choices (the budget as it was written: the plan's digest holds
    the text, so a config file rerunning the merge must say it so), the format of the card and config file
    written beside it (``manifest/card.py``), the base's name, and the plan's warnings when it has any."""
    extra: dict[str, Any] = {"policy": plan.policy, "out_dtype": plan.out_dtype, "block_bytes": plan.block_bytes,
                             "budget": plan.budget_text, "card_format": CARD_FORMAT}
    if inputs.base_name is not None:
        extra["base_name"] = inputs.base_name
    if inputs.expert_names:  # only when an expert's name is not its id (other manifests keep their hashes)
        extra["expert_names"] = dict(sorted(inputs.expert_names.items()))
    if inputs.kinds:  # only when an expert is not a full checkpoint (other manifests keep their hashes)
        extra["expert_kinds"] = dict(sorted(inputs.kinds.items()))
    if inputs.adapters:  # only when an expert is a LoRA adapter
        extra["lora"] = dict(sorted(inputs.adapters.items()))
    if inputs.hub_commits:  # only when an input came from the Hub
        extra["hub_commits"] = dict(sorted(inputs.hub_commits.items()))
    # output options, only when set (so that other manifests, and their hashes, stay as they were)
    if plan.out_shard_bytes is not None:
        extra["out_shard_bytes"] = plan.out_shard_bytes
    if plan.chat_template is not None:
        extra["chat_template"] = plan.chat_template
    if not plan.copy_tokenizer:
        extra["copy_tokenizer"] = False
    if plan.copies is not None:  # a passthrough: its slices and every output tensor's source
        extra["passthrough"] = plan.copies.to_json()
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
    the output bytes it wrote, which leaves out files an incremental merge reflinked from its previous snapshot):
    the row the time model of its operator is fitted to (``spec/time_model.py``).

    The snapshot is committed by then, so a catalog that cannot take the row (locked, disk full) goes without
    it rather than fail the merge."""
    timing = Timing(realized.expert_bytes, realized.bytes_made, realized.seconds.get("total", 0.0))
    if timing.seconds <= 0:
        return
    try:
        catalog.timings.add_merge(intent_id, host_key(), device, plan.operator, timing)
    except CatalogError:
        pass
