"""Delta updates (``merge --from PREVIOUS --delta-update``): update a block instead of recomputing it.

For a fixed-coefficient operator (``out = B·s + Σ ci Δi``: linear, avg,
task arithmetic), when the only inputs of an output block that changed since
the previous snapshot are new versions of some experts, ``Δ_new − Δ_old =
E_new − E_old`` and

    new = old + Σ_replaced ci · (E_new − E_old)

needs the previous output block and the replaced experts' two blocks, not
the other experts' blocks or the base. An expert the previous merge did not
have is a replaced one whose earlier version is the base itself (``E_old =
B``, ``Δ_old = 0``): where the operator leaves absent experts out of a block
(``absent_neutral``: unnormalised sums), adding it is ``old + c·(E_new − B)``.
Which blocks qualify is decided from the catalog alone: the block's
provenance key, computed with each replaced expert's earlier version in its
place (an added expert: not read), must be the key the previous snapshot
recorded, and each replaced expert must be read for the block in both plans
or in neither.

The previous output was rounded to its dtype, so the result is not the
from-scratch merge bit for bit. Rounding to nearest moves a (normal) value
by at most ``u |x|`` (``u = 2⁻⁸`` for BF16, ``2⁻¹¹`` for F16, ``2⁻²⁴`` for
F32), so over a block, with ``P`` the recorded bound on the old block's norm
and ``C = Σ |ci| (‖Δi_new‖ + ‖Δi_old‖)`` from the catalog's statistics:

    ‖new − scratch‖ ≤ u (P + 2 Q) + 2 (K + 3) 2⁻²⁴ S + 3 √n h₀

where ``Q = (1 + u)² (P + C)`` bounds the norms of both rounded results
(the old output's rounding, then each result's), the second term is the
fp32 arithmetic of both computations over partial sums of norm at most
``S = 2 P + C + 2 Σ |ci| ‖Δi_new‖``, and the last the subnormal range
(``h₀`` the dtype's smallest half-ulp, ``n`` elements). A block updated
before adds the bound it carries (triangle inequality); the plan's bound
adds the Frobenius norm of these, over all such blocks, to its omission
bound.

That bound holds before anything is read, for every element at once, so
it is a worst case. After the update the engine knows more, and records a
tighter one (the a-posteriori bound): every block of a fixed-coefficient
merge records, as it is written, its *drift* ``R`` — a bound on ``‖w − z‖``,
the block as written against the fp32 values ``z`` a from-scratch merge
computes for it (from scratch: ``R = ‖w − z‖``, measured). An update
computes ``y = w_old + Σ ci (E_new − E_old)`` in fp32 and writes ``w =
round(y)``; with ``ρ = ‖w − y‖`` (measured) and ``A`` the fp32 arithmetic
term above (``slack``, per block, kept in the plan),

    ‖y − z‖ ≤ R_old + A,        ‖z − round(z)‖ ≤ ‖z − w‖   (round to nearest)

so ``‖w − round(z)‖ ≤ ρ + ‖y − z‖ + ‖z − w‖ ≤ 2 (ρ + R_old + A)``, and the
block's drift becomes ``ρ + R_old + A``. The engine records the smaller of
the two bounds per block (both hold), and the merge reports the realized
one. Only blocks an update changes carry any.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from mergepipe.analysis.expert_format import read_cost
from mergepipe.analysis.opening import check_unchanged
from mergepipe.analysis.layout import layer_count
from mergepipe.analysis.provenance import Substitute, output_keys, tensor_mode
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import BlockDelta, BlockRecord, OutputBlock, SnapshotRecord, TensorRecord
from mergepipe.errors import ConfigError, MergePipeError
from mergepipe.spec.operators import LinearDef, get_operator
from mergepipe.spec.plan import Plan
from mergepipe.spec.refs import family
from mergepipe.storage.format import DTYPE_SIZES

#: Per output dtype: the largest relative move of rounding a normal value to it (u), and its smallest
#: half-ulp (subnormals).
_ROUNDING = {"BF16": (2.0**-8, 2.0**-134), "F16": (2.0**-11, 2.0**-25), "F32": (2.0**-24, 2.0**-150)}


@dataclass
class DeltaUpdates:
    """The blocks a plan updates from the previous output, and what that costs and risks."""

    blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    output_bytes: int = 0  # previous-output bytes read for them
    replaced: dict[str, str] = field(default_factory=dict)  # expert id -> the version it replaced
    saved: dict[str, int] = field(default_factory=dict)  # expert id -> planned bytes not read (may be < 0)
    # tensor -> block -> how far it may be from the from-scratch merge: what the previous block carried,
    # plus this update's rounding
    errors: dict[str, dict[int, float]] = field(default_factory=dict)
    # tensor -> block -> the fp32 arithmetic term of its bound (``A``), for the a-posteriori bound
    slack: dict[str, dict[int, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def plan_delta_updates(catalog: Catalog, plan: Plan, previous: SnapshotRecord,
                       recorded: dict[tuple[str, int], OutputBlock], reused: dict[str, tuple[int, ...]]
                       ) -> DeltaUpdates:
    """Which blocks not ``reused`` can be updated from ``previous`` (see the module docstring)."""
    definition = get_operator(plan.operator)
    if not definition.delta_updatable:
        raise ConfigError(f"--delta-update needs a fixed-coefficient operator (linear, avg, task_arithmetic); "
                          f"{plan.operator} is not one")
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
            if any((b.index in earlier.reads_of(t.name, old)) != (e in reading)
                   for e, old in done.replaced.items() if old != base):
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
    """The plan's experts that are new versions of one of ``earlier``'s (or new: their earlier version is
    the base), with what ``earlier`` read of them."""
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


def _block_bound(t: TensorRecord, b: BlockRecord, old_norm: float, dtype: str, swapped: Mapping[str, str],
                 reading: list[str], weights: dict[str, float], norms: dict[str, dict[str, list[BlockDelta]]]
                 ) -> tuple[float, float]:
    """The Frobenius bound of one delta update of one block (module docstring) in two terms, rounding and
    fp32 arithmetic (with the subnormal range): ``swapped`` maps each expert of the block that is a new
    version to the version it replaced."""
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
