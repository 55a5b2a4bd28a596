"""Incremental merges (``--from``), from the catalog alone: the output blocks a previous snapshot already
holds (equal provenance keys); with ``--delta-update`` the blocks updated from its output, and their bound."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from mergepipe.analysis.experts import ReadCost, check_unchanged, layer_count, read_cost
from mergepipe.analysis.provenance import Substitute, output_keys, tensor_mode
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import BlockDelta, BlockRecord, OutputBlock, SnapshotRecord, TensorRecord
from mergepipe.errors import ConfigError, MergePipeError
from mergepipe.sizes import format_bytes
from mergepipe.spec.operators import get_operator
from mergepipe.spec.operators.linear import LinearDef
from mergepipe.spec.plan import Plan, PlanReuse
from mergepipe.spec.settings import family
from mergepipe.storage.format import DTYPE_SIZES

#: Per output dtype: the unit roundoff u of a normal value, and the smallest half-ulp (subnormals).
_ROUNDING = {"BF16": (2.0**-8, 2.0**-134), "F16": (2.0**-11, 2.0**-25), "F32": (2.0**-24, 2.0**-150)}


@dataclass
class DeltaUpdates:
    """The blocks a plan updates from the previous output (``PlanReuse``'s fields of the same names)."""

    blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    output_bytes: int = 0
    replaced: dict[str, str] = field(default_factory=dict)
    saved: dict[str, int] = field(default_factory=dict)  # expert id -> planned bytes not read (may be < 0)
    errors: dict[str, dict[int, float]] = field(default_factory=dict)
    slack: dict[str, dict[int, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def plan_delta_updates(
    catalog: Catalog,
    plan: Plan,
    previous: SnapshotRecord,
    recorded: dict[tuple[str, int], OutputBlock],
    reused: dict[str, tuple[int, ...]],
) -> DeltaUpdates:
    """Which blocks not ``reused`` can be updated from ``previous``: those whose only changed inputs are new
    versions of experts (or added experts), read the same way as before."""
    definition = get_operator(plan.operator)
    if not definition.delta_updatable:
        raise ConfigError(
            f"--delta-update needs a fixed-coefficient operator (linear, avg, task_arithmetic); "
            f"{plan.operator} is not one"
        )
    assert isinstance(definition, LinearDef)  # the delta_updatable operators are linear's family
    earlier = Plan.from_json(catalog.plans.get(previous.plan_id))
    done = DeltaUpdates()
    if earlier.base.id != plan.base.id:
        done.notes.append("delta updates: the previous snapshot has another base; nothing updated")
        return done
    substitute = _replaced(catalog, plan, earlier, done)
    if not substitute:
        return done
    keys = output_keys(catalog, plan, substitute)
    base = plan.base.id
    blocks = catalog.blocks.by_tensor(base)
    norms = {e: catalog.stats.block_deltas(e, base) for e in {*plan.merge.expert_ids, *done.replaced.values()} - {base}}
    num_layers = layer_count(catalog, base)
    cost = read_cost(catalog, plan.merge.expert_ids, base)
    used: set[str] = set()
    for t in catalog.models.tensors(base):
        mode, out_dtype, _ = tensor_mode(plan, t, num_layers)
        if mode != "blocks":
            continue
        coefficients = definition.coefficients(definition.resolve(plan.merge, t.name, num_layers), t.name)
        weights = dict(zip(plan.merge.expert_ids, coefficients))
        for b in blocks[t.name]:
            old = recorded.get((t.name, b.index))
            if b.index in reused.get(t.name, ()) or old is None or old.l2 is None or b.end == b.begin:
                continue
            reading = plan.experts_reading(t.name, b.index)
            swapped = {e: old for e, old in done.replaced.items() if e in reading}  # new version -> the one replaced
            if not swapped or keys[(t.name, b.index)] != old.key:
                continue
            if any(
                (b.index in earlier.reads_of(t.name, old)) != (e in reading)
                for e, old in done.replaced.items()
                if old != base
            ):
                continue
            done.blocks[t.name] = (*done.blocks.get(t.name, ()), b.index)
            used.update(swapped)
            done.output_bytes += (b.end - b.begin) * DTYPE_SIZES[out_dtype] // DTYPE_SIZES[t.dtype]
            for e in reading:  # a replaced expert's two blocks are read; the others' not at all
                if e in swapped:  # its earlier version's block too (an added expert's is the base's: base bytes)
                    saved = 0 if swapped[e] == base else -(b.end - b.begin)
                else:
                    saved = cost.block(e, t.name, b)
                done.saved[e] = done.saved.get(e, 0) + saved
            rounding, arithmetic = _block_bound(t, b, old.l2, out_dtype, swapped, reading, weights, norms)
            done.errors.setdefault(t.name, {})[b.index] = old.error + rounding + arithmetic
            done.slack.setdefault(t.name, {})[b.index] = arithmetic
    done.replaced = {e: old for e, old in done.replaced.items() if e in used}
    return done


def _replaced(catalog: Catalog, plan: Plan, earlier: Plan, done: DeltaUpdates) -> Substitute:
    """The plan's experts that are new versions of ``earlier``'s (added: the base), with what it read of them."""
    previous: dict[str, list[str]] = {}
    for ref in earlier.experts:
        previous.setdefault(family(ref.id), []).append(ref.id)
    substitute: dict[str, tuple[str, Mapping[str, tuple[int, ...]]]] = {}
    for ref in plan.experts:
        olds = previous.get(family(ref.id), [plan.base.id])
        if len(olds) != 1 or olds[0] == ref.id:
            continue
        old = olds[0]
        deltas = [m for m in (ref.id, old) if catalog.models.get(m).kind in ("delta", "lora")]
        if deltas:  # E_new − E_old is not what two delta checkpoints (or adapters) hold; recomputed instead
            what = "a delta checkpoint" if catalog.models.get(deltas[0]).kind == "delta" else "a LoRA adapter"
            done.notes.append(f"delta updates: {deltas[0]} is {what}; the blocks of {ref.id} are recomputed")
            continue
        if old == plan.base.id:  # added: not read by the previous merge
            done.replaced[ref.id] = old
            substitute[ref.id] = (old, {})
            continue
        try:
            check_unchanged(catalog, old)  # its blocks are read again
            catalog.stats.block_deltas(old, plan.base.id)
        except MergePipeError as exc:
            done.notes.append(f"delta updates: cannot update from {old} ({exc}); its blocks are recomputed")
            continue
        done.replaced[ref.id] = old
        substitute[ref.id] = (old, {t: per.get(old, ()) for t, per in earlier.reads.items()})
    return substitute


def _block_bound(
    t: TensorRecord,
    b: BlockRecord,
    old_norm: float,
    dtype: str,
    swapped: Mapping[str, str],
    reading: list[str],
    weights: dict[str, float],
    norms: dict[str, dict[str, list[BlockDelta]]],
) -> tuple[float, float]:
    """The Frobenius bound of one delta update of one block in two terms, rounding and fp32 arithmetic
    (docs/ARCHITECTURE.md); ``swapped``: each expert of the block that is a new version -> the one it replaced."""

    def delta_norm(expert: str) -> float:
        if expert not in norms:  # the base, standing in for an added expert's earlier version
            return 0.0
        stats = norms[expert].get(t.name)
        value = stats[b.index].l2 if stats else None
        return 0.0 if value is None else value

    u, smallest = _ROUNDING[dtype]
    change = sum(abs(weights[e]) * (delta_norm(e) + delta_norm(old)) for e, old in swapped.items())
    results = (1 + u) ** 2 * (old_norm + change)
    partial_sums = 2 * old_norm + change + 2 * sum(abs(weights[e]) * delta_norm(e) for e in reading)
    elements = (b.row_end - b.row_start) * math.prod(t.shape[1:])  # 1-D tensors: one element a row
    arithmetic = 2 * (len(weights) + 3) * (2.0**-24 * partial_sums + math.sqrt(elements) * 2.0**-150)
    return u * (old_norm + 2 * results) + 3 * math.sqrt(elements) * smallest, arithmetic


def committed_snapshot(catalog: Catalog, ref: str, what: str) -> SnapshotRecord:
    """The committed snapshot ``ref`` names (id or prefix, merged model id, ``name@N``); else ConfigError."""
    found = catalog.snapshots.find(ref)
    if found is None:
        model = catalog.models.resolve(ref)  # UnknownModelError names the ref
        if model.kind != "snapshot":
            raise ConfigError(
                f"{what} {ref}: '{model.id}' is a registered checkpoint, not a merged model; "
                "give a snapshot id or a merged model id"
            )
        found = catalog.snapshots.of_model(model.id)
    if found is None or found.status != "committed" or found.id is None or found.manifest is None:
        raise ConfigError(f"{what} {ref}: no committed snapshot by that name; list them with `mergepipe snapshots`")
    return found


def incremental(catalog: Catalog, plan: Plan, previous: str | None, delta_update: bool) -> Plan:
    """``plan`` as an incremental merge from the snapshot ``previous`` names (unchanged without one)."""
    if previous is None:  # MergeRequest refuses --delta-update without --from
        return plan
    return with_reuse(catalog, plan, committed_snapshot(catalog, previous, "--from"), delta_update)


def with_reuse(catalog: Catalog, plan: Plan, previous: SnapshotRecord, delta_update: bool = False) -> Plan:
    """``plan`` with the output blocks it can take from ``previous`` (possibly none: equal provenance keys;
    a tensor merged whole is reused whole or not at all), and with ``delta_update`` those it can update."""
    recorded = catalog.snapshots.outputs(previous.model_id)
    if not recorded and "passthrough" in previous.manifest_data().get("extra", {}):
        raise ConfigError(
            f"--from {previous.model_id}: snapshot {previous.id} is a passthrough (layers copied from "
            "its sources, not merged blocks to reuse); merge without --from"
        )
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
        same = [
            b
            for b in blocks[t.name]
            if b.end > b.begin
            and (t.name, b.index) in recorded
            and recorded[(t.name, b.index)].key == keys[(t.name, b.index)]
            and (delta_update or recorded[(t.name, b.index)].error == 0.0)
        ]
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
    reuse = PlanReuse(
        previous.model_id,
        previous.manifest_hash or "",
        reused,
        output_bytes,
        {e: n for e, n in saved.items() if n},
        updates.blocks,
        updates.output_bytes,
        updates.replaced,
        bound,
        errors,
        updates.slack,
    )
    planned = plan.cost.expert_bytes
    note = (
        f"reuses {reuse.block_count} output blocks ({format_bytes(reuse.output_bytes)}) of snapshot "
        f"'{reuse.snapshot}': {format_bytes(reuse.saved_bytes)} of the {format_bytes(planned)} of planned "
        f"expert reads ({f'{100 * reuse.saved_bytes / planned:.1f}%' if planned else '0%'}) need not be read"
    )
    notes = (*plan.notes, note, *_added_notes(catalog, plan, previous, reused), *updates.notes)
    if updates.blocks:
        changes = ", ".join(
            f"{n} added" if o == plan.base.id else f"{o} -> {n}" for n, o in sorted(updates.replaced.items())
        )
        notes += (
            f"delta-updates {reuse.updated_count} blocks from the previous output ({changes}); not "
            f"bit-identical to a merge from scratch: the bound includes up to {bound:.4g} for the rounding "
            "of updated blocks (now and before)",
        )
    return replace(plan, reuse=reuse, notes=notes, error_bound=plan.error_bound + bound)


def _save_blocks(plan: Plan, cost: ReadCost, tensor: str, same: list[BlockRecord], saved: dict[str, int]) -> None:
    """Add to ``saved`` the expert reads reusing blocks ``same`` of ``tensor`` saves (a LoRA's A with the last)."""
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
        for parts, n in (
            (chunks.get(tensor, []), plan.chunks_of(tensor, expert_id)),
            (stages.get(tensor, []), plan.stages_of(tensor, expert_id)),
        ):
            if n:
                total += parts[n - 1].end - parts[0].begin
    return total


def _added_notes(
    catalog: Catalog, plan: Plan, previous: SnapshotRecord, reused: dict[str, tuple[int, ...]]
) -> list[str]:
    """For a consensus operator, the blocks each expert new to this merge recomputes: every block it changed
    (its signs take part in the election there)."""
    if get_operator(plan.operator).error_bound != "consensus":
        return []
    before = {e.id for e in Plan.from_json(catalog.plans.get(previous.plan_id)).experts}
    notes = []
    for expert in (e.id for e in plan.experts if e.id not in before):
        changed = sum(
            1
            for tensor, norms in catalog.stats.block_norms(expert, plan.base.id).items()
            for index, norm in enumerate(norms)
            if norm is not None and index not in reused.get(tensor, ())
        )
        notes.append(
            f"adding '{expert}' changes the consensus of {changed} blocks ({plan.operator} elects every "
            "entry's sign from all experts): recomputed, as a merge from scratch would"
        )
    return notes
