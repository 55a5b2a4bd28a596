"""Delta updates (``merge --from PREVIOUS --delta-update``): update a block instead of recomputing it.

For a fixed-coefficient operator (``out = B·s + Σ ci Δi``: linear, avg,
task arithmetic), when the only inputs of an output block that changed since
the previous snapshot are new versions of some experts, ``Δ_new − Δ_old =
E_new − E_old`` and

    new = old + Σ_replaced ci · (E_new − E_old)

needs the previous output block and the replaced experts' two blocks, not
the other experts' blocks or the base. Which blocks qualify is decided from
the catalog alone: the block's provenance key, computed with each replaced
expert's earlier version in its place (``analysis/provenance.py``), must be
the key the previous snapshot recorded, and each replaced expert must be
read for the block in both plans or in neither.

The previous output was rounded to its dtype, so the result is not the
from-scratch merge bit for bit. Per element of a block with recorded
``M = max |old|`` and ``D = Σ |ci| (max|Δi_new| + max|Δi_old|)``:

    |new − scratch| ≤ h(M) + 2 h(M + D) + 2 (K + 3) 2⁻²⁴ S

with ``h(x)`` half a unit in the last place of the output dtype at
magnitude ``x`` (the rounding of the old output, then of both results) and
the last term the fp32 arithmetic of both computations over partial sums no
larger than ``S = M + D + 2 Σ |ci| max|Δi_new|``. The plan's bound adds the
Frobenius norm of that, over the updated blocks, to its omission bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mergepipe.analysis.inputs import check_unchanged
from mergepipe.analysis.provenance import Substitute, output_keys, tensor_mode
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import OutputBlock, SnapshotRecord
from mergepipe.errors import ConfigError, MergePipeError
from mergepipe.spec.operators import get_operator
from mergepipe.spec.plan import Plan
from mergepipe.spec.refs import family
from mergepipe.spec.settings import count_layers
from mergepipe.storage.convert import MERGEABLE_DTYPES
from mergepipe.storage.format import DTYPE_SIZES

#: Significant bits (with the implicit one) of each output dtype, and its smallest half-ulp (subnormals).
_PRECISION = {"BF16": (8, 2.0**-134), "F16": (11, 2.0**-25), "F32": (24, 2.0**-150)}


@dataclass
class DeltaUpdates:
    """The blocks a plan updates from the previous output, and what that costs and risks."""

    blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    output_bytes: int = 0  # previous-output bytes read for them
    replaced: dict[str, str] = field(default_factory=dict)  # expert id -> the version it replaced
    saved: dict[str, int] = field(default_factory=dict)  # expert id -> planned bytes not read (may be < 0)
    bound: float = 0.0
    notes: list[str] = field(default_factory=list)


def half_ulp(x: float, dtype: str) -> float:
    """Half a unit in the last place of ``dtype`` for values of magnitude at most ``x``."""
    bits, smallest = _PRECISION[dtype]
    if x <= 0.0 or not math.isfinite(x):
        return smallest if x == 0.0 else math.inf
    _, exponent = math.frexp(x)  # x = m * 2**exponent, 0.5 <= m < 1
    return max(2.0 ** (exponent - 1 - bits), smallest)


def plan_delta_updates(catalog: Catalog, plan: Plan, previous: SnapshotRecord,
                       recorded: dict[tuple[str, int], OutputBlock], reused: dict[str, tuple[int, ...]]
                       ) -> DeltaUpdates:
    """Which blocks not ``reused`` can be updated from ``previous`` (see the module docstring)."""
    definition = get_operator(plan.operator)
    if not definition.delta_updatable:
        raise ConfigError(f"--delta-update needs a fixed-coefficient operator (linear, avg, task_arithmetic); "
                          f"{plan.operator} is not one")
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
    maxima = {e: catalog.stats.block_deltas(e, base) for e in (*plan.merge.expert_ids, *done.replaced.values())}
    names = [t.name for t in catalog.models.tensors(base) if t.dtype in MERGEABLE_DTYPES]
    num_layers = catalog.models.get(base).num_layers or count_layers(names)
    squares, used = 0.0, set()
    for t in catalog.models.tensors(base):
        mode, out_dtype = tensor_mode(plan, t)
        if mode != "blocks":
            continue
        coefficients = definition.coefficients(definition.resolve(plan.merge, t.name, num_layers), t.name)
        weights = dict(zip(plan.merge.expert_ids, coefficients))
        for b in blocks[t.name]:
            old = recorded.get((t.name, b.index))
            if b.index in reused.get(t.name, ()) or old is None or old.maxabs is None or b.end == b.begin:
                continue
            reading = plan.experts_reading(t.name, b.index)
            swapped = [e for e in done.replaced if e in reading]
            if not swapped or keys[(t.name, b.index)] != old.key:
                continue
            if any((b.index in earlier.reads_of(t.name, done.replaced[e])) != (e in reading) for e in done.replaced):
                continue
            done.blocks[t.name] = (*done.blocks.get(t.name, ()), b.index)
            used.update(swapped)
            done.output_bytes += (b.end - b.begin) * DTYPE_SIZES[out_dtype] // DTYPE_SIZES[t.dtype]
            for e in reading:  # a replaced expert's two blocks are read; the others' not at all
                done.saved[e] = done.saved.get(e, 0) + (-(b.end - b.begin) if e in swapped else b.end - b.begin)
            squares += _block_bound(t, b, old.maxabs, out_dtype, swapped, reading, weights, maxima, done.replaced)
    done.bound = math.sqrt(squares)
    done.replaced = {e: old for e, old in done.replaced.items() if e in used}
    return done


def _replaced(catalog: Catalog, plan: Plan, earlier: Plan, done: DeltaUpdates) -> Substitute:
    """The plan's experts that are new versions of one of ``earlier``'s, with what it read of them."""
    previous = {}
    for ref in earlier.experts:
        previous.setdefault(family(ref.id), []).append(ref.id)
    substitute = {}
    for ref in plan.experts:
        olds = previous.get(family(ref.id), [])
        if len(olds) != 1 or olds[0] == ref.id:
            continue
        old = olds[0]
        try:
            check_unchanged(catalog, old)  # its blocks are read again
            catalog.stats.block_deltas(old, plan.base.id)
        except MergePipeError as exc:
            done.notes.append(f"delta updates: cannot update from {old} ({exc}); its blocks are recomputed")
            continue
        done.replaced[ref.id] = old
        substitute[ref.id] = (old, {t: per.get(old, ()) for t, per in earlier.reads.items()})
    return substitute


def _block_bound(t, b, old_max: float, dtype: str, swapped: list[str], reading: list[str],
                 weights: dict[str, float], maxima: dict, replaced: dict[str, str]) -> float:
    """The squared Frobenius bound of one updated block (module docstring)."""
    def delta_max(expert: str) -> float:
        stats = maxima[expert].get(t.name)
        value = stats[b.index].maxabs if stats else None
        return 0.0 if value is None else value

    change = sum(abs(weights[e]) * (delta_max(e) + delta_max(replaced[e])) for e in swapped)
    total = old_max + change + 2 * sum(abs(weights[e]) * delta_max(e) for e in reading)
    per_element = (half_ulp(old_max, dtype) + 2 * half_ulp(old_max + change, dtype)
                   + 2 * (len(weights) + 3) * 2.0**-24 * total)
    elements = (b.row_end - b.row_start) * math.prod(t.shape[1:])  # 1-D tensors: one element a row
    return elements * per_element**2
