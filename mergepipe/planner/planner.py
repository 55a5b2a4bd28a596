"""Plan a merge under an expert-I/O budget, before reading any expert byte.

The planner works only from the catalog: block geometry, per-block delta
norms ``||Δi_b||`` and identical-to-base flags. Each candidate read is a
*unit* with a byte cost and a value:

* streaming operators: one unit per (expert, block) — value ``beta_i*||Δi_b||``;
* tensor-level operators (SLERP, model stock): one unit per tensor covering
  every expert's changed blocks (all or nothing);
* a streaming operator whose trim thresholds are not in the catalog (a
  density off the analysed grid) merges that tensor whole: one unit per
  (expert, tensor), since thresholds computed from part of a tensor would be
  wrong.

Blocks identical to the base are never units: they cost nothing and are never
read. Policies choose units: ``energy`` greedily by value per byte,
``uniform`` by a deterministic hash of (tensor, block) that ignores the
catalog's statistics (a baseline), ``full`` everything.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from mergepipe.catalog.analyze import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.register import content_fingerprint
from mergepipe.catalog.records import TensorRecord
from mergepipe.catalog.thresholds import find_threshold
from mergepipe.engine.operators.base import Operator
from mergepipe.engine.operators.registry import canonical_name, validate_spec
from mergepipe.engine.params import MergeSpec, count_layers, layer_index, resolve_for_tensor
from mergepipe.errors import BudgetError, ConfigError
from mergepipe.planner.budget import Budget, parse_budget
from mergepipe.manifest.parts import ModelRef
from mergepipe.planner.plan import Plan, PlanCost
from mergepipe.storage.convert import MERGEABLE_DTYPES
from mergepipe.storage.format import DTYPE_SIZES

POLICIES = ("energy", "uniform", "full")

_DTYPE_ALIASES = {
    "bf16": "BF16", "bfloat16": "BF16",
    "f16": "F16", "fp16": "F16", "float16": "F16", "half": "F16",
    "f32": "F32", "fp32": "F32", "float32": "F32", "float": "F32",
}


def parse_out_dtype(value: str | None) -> str | None:
    """``--out-dtype`` as a safetensors dtype string (None = base dtype)."""
    if value is None:
        return None
    key = str(value).strip()
    dtype = _DTYPE_ALIASES.get(key.lower(), key.upper())
    if dtype not in MERGEABLE_DTYPES:
        raise ConfigError(f"--out-dtype must be one of bf16, f16, f32, got {value!r}")
    return dtype


@dataclass(frozen=True)
class _Unit:
    """One all-or-nothing choice of the planner."""

    tensor: str
    ordinal: int
    reads: tuple[tuple[int, int], ...]  # (expert position, block index)
    cost: int
    value: float
    hash_rank: int


@dataclass
class _TensorPlan:
    """What the planner knows about one mergeable tensor."""

    record: TensorRecord
    block_bytes: list[int]
    # per expert: per block l2 (None = identical to base)
    l2: list[list[float | None]]
    beta: list[float]
    bound_kind: str
    tensor_level: bool  # the operator needs whole tensors: plan all or nothing
    streams: bool  # the engine can merge block by block
    expert_streams: list[bool]  # the catalog has this expert's thresholds


class Planner:
    """Turns a merge request into a :class:`Plan` using only the catalog."""

    def __init__(self, catalog: Catalog, progress: bool = False) -> None:
        self.catalog = catalog
        self.progress = progress

    def plan(
        self,
        base_model: str,
        experts: Sequence[str],
        operator: str = "ties",
        *,
        weights: Sequence[float] | None = None,
        params: Mapping[str, Any] | None = None,
        expert_params: Mapping[str, Mapping[str, Any]] | None = None,
        seed: int = 0,
        budget: str | int | None = None,
        budget_mb: float | None = None,
        policy: str = "energy",
        out_dtype: str | None = None,
    ) -> Plan:
        """Plan a merge of ``experts`` into ``base_model``.

        ``budget`` is bytes, a size string ("906MB"), a percentage ("25%") or
        None/"none" (no limit); ``budget_mb`` is the same in MiB, for the
        Python API. ``params`` are global operator parameters (``density``
        there is every expert's default), ``expert_params`` per-expert ones.
        """
        spec = self._spec(experts, operator, weights, params, expert_params, seed)
        parsed_budget = self._budget(budget, budget_mb)
        if policy not in POLICIES:
            raise ConfigError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        dtype = parse_out_dtype(out_dtype)
        catalog = self.catalog
        base = catalog.get_model(base_model)
        expert_records = [catalog.get_model(e) for e in spec.expert_ids]
        if base_model in spec.expert_ids:
            raise ConfigError(f"model {base_model!r} is both the base and an expert; list it once")
        tensors = catalog.tensors(base.id)
        names = [t.name for t in tensors if t.dtype in MERGEABLE_DTYPES]
        num_layers = base.num_layers or count_layers(names)
        op = validate_spec(spec, names, num_layers)  # ConfigError before any I/O
        for model_id in (base.id, *spec.expert_ids):
            catalog.check_unchanged(model_id)
        self._ensure_analyzed(base.id, spec.expert_ids)

        tensor_plans = self._tensor_plans(op, spec, base.id, tensors, num_layers)
        units = _units(tensor_plans)
        full_bytes = sum(u.cost for u in units)
        budget_bytes = parsed_budget.resolve(full_bytes)
        if policy == "full":
            if budget_bytes < full_bytes:
                raise ConfigError(
                    f"policy 'full' reads every changed expert block ({full_bytes} bytes) but the budget "
                    f"is {parsed_budget.text}; use --budget 100% or the energy/uniform policy"
                )
            chosen = units
        else:
            chosen = _choose(units, budget_bytes, policy)
        return self._assemble(
            spec, op, base, expert_records, tensors, tensor_plans, units, chosen,
            parsed_budget, budget_bytes, policy, dtype,
        )

    # ------------------------------------------------------------------ inputs

    @staticmethod
    def _spec(experts, operator, weights, params, expert_params, seed) -> MergeSpec:
        experts = list(experts)
        if not experts:
            raise ConfigError("a merge needs at least one expert (--experts ID [ID ...])")
        if weights is not None and len(weights) != len(experts):
            raise ConfigError(f"got {len(weights)} weights for {len(experts)} experts; give one per expert")
        unknown = set(expert_params or {}) - set(experts)
        if unknown:
            raise ConfigError(f"parameters given for {sorted(unknown)}, which are not among the experts")
        per_expert = []
        for i, expert_id in enumerate(experts):
            own = dict((expert_params or {}).get(expert_id, {}))
            if weights is not None:
                own["weight"] = float(weights[i])
            per_expert.append((expert_id, own))
        return MergeSpec(canonical_name(operator), tuple(per_expert), dict(params or {}), int(seed))

    @staticmethod
    def _budget(budget, budget_mb) -> Budget:
        if budget is not None and budget_mb is not None:
            raise ConfigError("give either budget or budget_mb, not both")
        if budget_mb is not None:
            if budget_mb < 0:
                raise BudgetError(f"budget_mb must not be negative, got {budget_mb}")
            return parse_budget(int(budget_mb * 1024 * 1024))
        return parse_budget(budget)

    def _ensure_analyzed(self, base_id: str, expert_ids: Sequence[str]) -> None:
        missing = [e for e in expert_ids if not self.catalog.is_analyzed(e, base_id)]
        if missing:
            analyze(self.catalog, missing, base_id=base_id, progress=self.progress)

    def _tensor_plans(
        self, op: Operator, spec: MergeSpec, base_id: str, tensors: list[TensorRecord], num_layers: int
    ) -> list[_TensorPlan]:
        catalog = self.catalog
        blocks = catalog.blocks(base_id)
        deltas = [catalog.block_deltas(e, base_id) for e in spec.expert_ids]
        stats = [catalog.tensor_stats(e, base_id) for e in spec.expert_ids]
        plans = []
        for t in tensors:
            if t.dtype not in MERGEABLE_DTYPES:
                continue  # carried through from the base, never merged
            per_expert, global_ = resolve_for_tensor(spec, t.name, layer_index(t.name), num_layers)
            l2 = [
                [None if d.identical else float(d.l2 or 0.0) for d in deltas[i][t.name]]
                for i in range(len(spec.expert_ids))
            ]
            expert_streams = []
            for i, params_i in enumerate(per_expert):
                wanted = op.needs_thresholds(params_i)
                have = stats[i][t.name].thresholds
                expert_streams.append(all(find_threshold(have, d) is not None for d in wanted))
            streams = op.streams_with(per_expert, global_, all(expert_streams))
            beta = [abs(b) for b in op.coefficient(per_expert, global_)]
            plans.append(
                _TensorPlan(
                    record=t,
                    block_bytes=[b.nbytes for b in blocks[t.name]],
                    l2=l2,
                    beta=beta,
                    bound_kind=op.error_bound,
                    tensor_level=not op.streaming,
                    streams=streams,
                    expert_streams=expert_streams,
                )
            )
        return plans

    # ------------------------------------------------------------------ output

    def _assemble(
        self, spec, op, base, expert_records, tensors, tensor_plans, units, chosen,
        parsed_budget, budget_bytes, policy, dtype,
    ) -> Plan:
        ids = spec.expert_ids
        reads: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        by_model = {e: 0 for e in ids}
        for unit in chosen:
            for expert_pos, index in unit.reads:
                reads[unit.tensor][ids[expert_pos]].append(index)
        block_sizes = {p.record.name: p.block_bytes for p in tensor_plans}
        for tensor, per in reads.items():
            for expert_id, indices in per.items():
                by_model[expert_id] += sum(block_sizes[tensor][i] for i in indices)
        expert_bytes = sum(by_model.values())
        full_bytes = sum(u.cost for u in units)
        out_bytes = sum(
            (t.numel * DTYPE_SIZES[dtype]) if (dtype and t.dtype in MERGEABLE_DTYPES) else t.nbytes
            for t in tensors
        )
        bound, kind = _error_bound(tensor_plans, reads, ids)
        tensor_level = tuple(sorted(p.record.name for p in tensor_plans if not p.streams))
        notes = []
        if full_bytes and expert_bytes == 0:
            notes.append(
                f"the budget ({parsed_budget.text}) is below the cheapest useful read; "
                "this plan reads nothing from the experts and the output equals the base"
            )
        if budget_bytes >= full_bytes:
            notes.append("the budget covers every changed expert block: the result equals the full-read merge")
        return Plan(
            base=ModelRef(base.id, content_fingerprint(self.catalog, base.id)),
            experts=tuple(ModelRef(r.id, content_fingerprint(self.catalog, r.id)) for r in expert_records),
            merge=spec.to_dict(),
            block_bytes=self.catalog.block_bytes,
            budget_text=parsed_budget.text,
            budget_bytes=budget_bytes,
            policy=policy,
            out_dtype=dtype,
            reads={t: {e: tuple(sorted(ix)) for e, ix in per.items()} for t, per in reads.items()},
            tensor_level=tensor_level,
            cost=PlanCost(
                base_bytes=sum(t.nbytes for t in tensors),
                expert_bytes=expert_bytes,
                output_bytes=out_bytes,
                full_expert_bytes=full_bytes,
                expert_bytes_by_model=by_model,
            ),
            error_bound=bound,
            error_bound_kind=kind,
            notes=tuple(notes),
            created_at=self.catalog.now(),
        )


def _hash_rank(tensor: str, index: int) -> int:
    """A deterministic pseudo-random rank of a block, the same for every expert."""
    h = hashlib.sha256(f"{tensor}\0{index}".encode()).digest()
    return int.from_bytes(h[:8], "big")


def _units(tensor_plans: list[_TensorPlan]) -> list[_Unit]:
    units: list[_Unit] = []
    for tp in tensor_plans:
        name = tp.record.name
        changed = [[(i, b) for b, v in enumerate(l2) if v is not None] for i, l2 in enumerate(tp.l2)]
        if tp.tensor_level:
            reads = tuple(r for per in changed for r in per)
            if reads:
                units.append(_unit(tp, reads, _hash_rank(name, -1)))
            continue
        for i, per in enumerate(changed):
            if not per:
                continue
            if tp.expert_streams[i]:
                units.extend(_unit(tp, (read,), _hash_rank(name, read[1])) for read in per)
            else:  # thresholds must come from this expert's whole tensor
                units.append(_unit(tp, tuple(per), _hash_rank(name, -1)))
    return units


def _unit(tp: _TensorPlan, reads: tuple[tuple[int, int], ...], rank: int) -> _Unit:
    cost = sum(tp.block_bytes[b] for _, b in reads)
    value = sum(_finite(tp.beta[i]) * (tp.l2[i][b] or 0.0) for i, b in reads)
    return _Unit(tensor=tp.record.name, ordinal=tp.record.ordinal, reads=reads, cost=cost, value=value, hash_rank=rank)


def _finite(beta: float) -> float:
    """Tensor-level operators have no per-expert bound (beta = inf): rank
    their reads by plain delta norm."""
    return beta if math.isfinite(beta) else 1.0


def _choose(units: list[_Unit], budget_bytes: int, policy: str) -> list[_Unit]:
    """Select units under the budget.

    ``energy``: greedy by value per byte; a unit that does not fit is skipped
    and the scan goes on, so smaller valuable units still use what is left.
    ``uniform``: first the same fraction f = budget / full of every tensor's
    units, picked by hash rank (the catalog's statistics are ignored), then
    whatever budget is left, by hash rank across tensors.
    """
    if policy == "energy":
        ranked = sorted(units, key=lambda u: (-(u.value / u.cost) if u.cost else -math.inf, u.ordinal, u.reads))
        return _fill(ranked, budget_bytes, [], 0)
    by_hash = lambda u: (u.hash_rank, u.ordinal, u.reads)
    total = sum(u.cost for u in units)
    fraction = min(1.0, budget_bytes / total) if total else 0.0
    per_tensor: dict[str, list[_Unit]] = defaultdict(list)
    for unit in units:
        per_tensor[unit.tensor].append(unit)
    chosen: list[_Unit] = []
    taken: dict[str, int] = defaultdict(int)
    spent = 0
    for tensor, tensor_units in per_tensor.items():
        tensor_units.sort(key=by_hash)
        for unit in tensor_units[: int(fraction * len(tensor_units))]:
            if spent + unit.cost <= budget_bytes:
                chosen.append(unit)
                spent += unit.cost
                taken[tensor] += 1
    # What floors left of the budget goes to the tensors furthest below the
    # fraction, at most one more unit each: every tensor stays within one
    # unit of f * its units.
    picked = set(map(id, chosen))
    deficit = {t: fraction * len(us) - taken[t] for t, us in per_tensor.items()}
    for tensor in sorted(per_tensor, key=lambda t: (-deficit[t], t)):
        if deficit[tensor] <= 0:
            continue
        for unit in per_tensor[tensor]:
            if id(unit) not in picked and spent + unit.cost <= budget_bytes:
                chosen.append(unit)
                spent += unit.cost
                break
    return chosen


def _fill(ranked: list[_Unit], budget_bytes: int, chosen: list[_Unit], spent: int) -> list[_Unit]:
    """Add units in rank order while they fit in the budget."""
    for unit in ranked:
        if spent + unit.cost <= budget_bytes:
            chosen.append(unit)
            spent += unit.cost
    return chosen


def _error_bound(
    tensor_plans: list[_TensorPlan], reads: Mapping[str, Mapping[str, list[int]]], ids: Sequence[str]
) -> tuple[float, str]:
    """Frobenius bound over blocks of the omitted part of the merged delta.

    Per block b: ``exact``/``separable`` operators change by at most
    ``Σ_omitted beta_i ||Δi_b||``; ``consensus`` operators (TIES family) by
    at most ``Σ_all beta_i ||Δi_b|| + Σ_read beta_i ||Δi_b||`` when anything
    is omitted. Tensor-level operators have no such bound: their figure is an
    estimate, ``Σ_omitted ||Δi_b||``. The bound is on the fp32 merge, before
    rounding to the output dtype.
    """
    total = 0.0
    kinds = set()
    for tp in tensor_plans:
        kinds.add(tp.bound_kind)
        read_sets = [set(reads.get(tp.record.name, {}).get(e, ())) for e in ids]
        beta = [_finite(b) for b in tp.beta]
        for b in range(len(tp.block_bytes)):
            omitted = read = everything = 0.0
            for i in range(len(ids)):
                v = tp.l2[i][b]
                if v is None:
                    continue
                part = beta[i] * v
                everything += part
                if b in read_sets[i]:
                    read += part
                else:
                    omitted += part
            if omitted == 0.0:
                continue
            if tp.bound_kind == "consensus":
                total += (everything + read) ** 2
            else:
                total += omitted**2
    return math.sqrt(total), "estimate" if "none" in kinds else "bound"
