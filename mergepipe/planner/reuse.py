"""Incremental merges: which output blocks an earlier snapshot already holds.

``merge --from PREVIOUS`` plans the merge exactly as from scratch (same
reads, so the same result and the same error bound), then compares every
output block's provenance key (``analysis/provenance.py``: operator,
resolved parameters, thresholds, seed, and the content hash of every input
block) with the key recorded when the previous snapshot was published.
Equal keys mean equal bytes: those blocks are copied from the previous
snapshot (checked against their recorded hashes) and their base and expert
blocks are not read. Tensors merged whole are reused whole or not at all,
so a tensor-wide input (a TIES threshold) that changed recomputes every
block of it. Nothing here reads a file: the catalog decides.
"""

from __future__ import annotations

import math
from dataclasses import replace

from mergepipe.analysis.expert_format import ReadCost, read_cost
from mergepipe.analysis.layout import layer_count
from mergepipe.analysis.provenance import output_keys, tensor_mode
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import BlockRecord, SnapshotRecord
from mergepipe.errors import ConfigError
from mergepipe.planner.delta_update import DeltaUpdates, plan_delta_updates
from mergepipe.spec.operators import get_operator
from mergepipe.spec.plan import Plan
from mergepipe.spec.plan_reuse import PlanReuse
from mergepipe.storage.format import DTYPE_SIZES
from mergepipe.sizes import format_bytes


def committed_snapshot(catalog: Catalog, ref: str, what: str) -> SnapshotRecord:
    """The committed snapshot ``ref`` names: a snapshot id (or unique prefix), or a merged model
    (``name`` is its latest version, ``name@N`` version N); ConfigError starting with ``what`` (the
    option or command that was given ``ref``) otherwise."""
    found = catalog.snapshots.find(ref)
    if found is None:
        model = catalog.models.resolve(ref)  # UnknownModelError names the ref
        if model.kind != "snapshot":
            raise ConfigError(f"{what} {ref}: '{model.id}' is a registered checkpoint, not a merged model; "
                              "give a snapshot id or a merged model id")
        found = catalog.snapshots.of_model(model.id)
    if found is None or found.status != "committed" or found.id is None or found.manifest is None:
        raise ConfigError(f"{what} {ref}: no committed snapshot by that name; list them with `mergepipe snapshots`")
    return found


def incremental(catalog: Catalog, plan: Plan, previous: str | None, delta_update: bool) -> Plan:
    """``plan`` as an incremental merge from the snapshot ``previous`` names (unchanged without one)."""
    if previous is None:
        if delta_update:
            raise ConfigError("--delta-update updates the output of a previous merge: give --from too")
        return plan
    return with_reuse(catalog, plan, committed_snapshot(catalog, previous, "--from"), delta_update)


def with_reuse(catalog: Catalog, plan: Plan, previous: SnapshotRecord, delta_update: bool = False) -> Plan:
    """``plan`` with the output blocks it can take from ``previous`` (possibly none), and with
    ``delta_update`` those it can update from it (``planner/delta_update.py``)."""
    recorded = catalog.snapshots.outputs(previous.model_id)
    if not recorded and "passthrough" in previous.manifest_data().get("extra", {}):
        raise ConfigError(f"--from {previous.model_id}: snapshot {previous.id} is a passthrough (layers copied from "
                          "its sources, not merged blocks to reuse); merge without --from")
    if not recorded:
        raise ConfigError(
            f"--from {previous.model_id}: snapshot {previous.id} has no recorded output provenance (it was "
            "published by an older MergePipe); merge without --from once, then merge incrementally from that"
        )
    keys, base = output_keys(catalog, plan), plan.base.id
    blocks = catalog.blocks.by_tensor(base)
    stores = {e: (catalog.deltas.chunks(e, base), catalog.deltas.stages(e, base)) for e in plan.stores}
    cost = read_cost(catalog, plan.merge.expert_ids, base)
    reused: dict[str, tuple[int, ...]] = {}
    saved = {e.id: 0 for e in plan.experts}
    output_bytes = 0
    num_layers = layer_count(catalog, base)
    for t in catalog.models.tensors(base):
        mode, out_dtype, copies_unread = tensor_mode(plan, t, num_layers)
        if mode == "copy":  # a base copy costs what a reuse costs
            continue
        # equal keys; a block delta-updated before (error > 0) only when this merge accepts updates too
        same = [b for b in blocks[t.name]
                if b.end > b.begin and (t.name, b.index) in recorded and
                recorded[(t.name, b.index)].key == keys[(t.name, b.index)] and
                (delta_update or recorded[(t.name, b.index)].error == 0.0)]
        if mode == "whole":
            if len(same) < sum(1 for b in blocks[t.name] if b.end > b.begin):
                continue
            for e in plan.merge.expert_ids:
                read = set(plan.reads_of(t.name, e))
                saved[e] += cost.tensor(e, t.name, [b for b in blocks[t.name] if b.index in read])
                saved[e] += _store_bytes(plan, stores, t.name, e)
        else:
            same = [b for b in same if plan.experts_reading(t.name, b.index) or not copies_unread]
            _save_blocks(plan, cost, t.name, same, saved)
        if same:
            reused[t.name] = tuple(b.index for b in same)
            output_bytes += sum(b.end - b.begin for b in same) * DTYPE_SIZES[out_dtype] // DTYPE_SIZES[t.dtype]
    updates = plan_delta_updates(catalog, plan, previous, recorded, reused) if delta_update else DeltaUpdates()
    for e, n in updates.saved.items():
        saved[e] += n
    errors = updates.errors  # updated blocks; and reused blocks keep the bound they were published with
    for name, indices in reused.items():
        for b in indices:
            if recorded[(name, b)].error:
                errors.setdefault(name, {})[b] = recorded[(name, b)].error
    bound = math.sqrt(sum(e * e for per in errors.values() for e in per.values()))
    reuse = PlanReuse(previous.model_id, previous.manifest_hash or "", reused, output_bytes,
                      {e: n for e, n in saved.items() if n}, updates.blocks, updates.output_bytes, updates.replaced,
                      bound, errors, updates.slack)
    notes = (*plan.notes, _note(plan, reuse), *_added_notes(catalog, plan, previous, reused), *updates.notes)
    if updates.blocks:
        changes = ", ".join(f"{n} added" if o == plan.base.id else f"{o} -> {n}"
                            for n, o in sorted(updates.replaced.items()))
        notes += (f"delta-updates {reuse.updated_count} blocks from the previous output ({changes}); not "
                  f"bit-identical to a merge from scratch: the bound includes up to {bound:.4g} for the rounding "
                  "of updated blocks (now and before)",)
    return replace(plan, reuse=reuse, notes=notes, error_bound=plan.error_bound + bound)


def _save_blocks(plan: Plan, cost: ReadCost, tensor: str, same: list[BlockRecord], saved: dict[str, int]) -> None:
    """Add to ``saved`` the expert reads of ``tensor`` that reusing blocks ``same`` saves: each reused
    block's, and an expert's shared part (a LoRA's A) when no block of the tensor is read of it any more."""
    for b in same:
        for e in plan.experts_reading(tensor, b.index):
            saved[e] += cost.block(e, tensor, b)
    kept = {b.index for b in same}
    for e in plan.merge.expert_ids:
        read = plan.reads_of(tensor, e)
        if read and kept.issuperset(read):
            saved[e] += cost.shared(e, tensor)


def _store_bytes(plan: Plan, stores: dict, tensor: str, expert_id: str) -> int:
    """Bytes of the delta-store reads the plan makes for ``tensor`` of ``expert_id`` (one range each)."""
    total = 0
    if expert_id in stores:
        chunks, stages = stores[expert_id]
        for parts, n in ((chunks.get(tensor, []), plan.chunks_of(tensor, expert_id)),
                         (stages.get(tensor, []), plan.stages_of(tensor, expert_id))):
            if n:
                total += parts[n - 1].end - parts[0].begin
    return total


def _added_notes(catalog: Catalog, plan: Plan, previous: SnapshotRecord, reused: dict[str, tuple[int, ...]]
                 ) -> list[str]:
    """For a consensus operator, what each expert new to this merge recomputes: every block it changed, since
    its signs take part in the election there. Such blocks are no reuse miss: a merge from scratch computes them
    the same way, and a bit-identical re-merge must."""
    if get_operator(plan.operator).error_bound != "consensus":
        return []
    before = {e.id for e in Plan.from_json(catalog.plans.get(previous.plan_id)).experts}
    notes = []
    for expert in (e.id for e in plan.experts if e.id not in before):
        changed = sum(1 for tensor, norms in catalog.stats.block_norms(expert, plan.base.id).items()
                      for index, norm in enumerate(norms)
                      if norm is not None and index not in reused.get(tensor, ()))
        notes.append(f"adding '{expert}' changes the consensus of {changed} blocks ({plan.operator} elects every "
                     "entry's sign from all experts): recomputed, as a merge from scratch would")
    return notes


def _note(plan: Plan, reuse: PlanReuse) -> str:
    planned = plan.cost.expert_bytes
    share = f"{100 * reuse.saved_bytes / planned:.1f}%" if planned else "0%"
    return (f"reuses {reuse.block_count} output blocks ({format_bytes(reuse.output_bytes)}) of snapshot "
            f"'{reuse.snapshot}': {format_bytes(reuse.saved_bytes)} of the {format_bytes(planned)} of planned "
            f"expert reads ({share}) need not be read")
