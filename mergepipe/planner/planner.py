"""Plan a merge under an expert-I/O budget, before reading any expert byte.

The planner works only from the catalog: block geometry, per-block delta
norms ``||Δi_b||`` and identical-to-base flags, recorded by ``analyze``. It
never analyses on its own: a missing analysis is an error naming the command
that makes it. Steps: validate the spec (before any I/O), describe each
mergeable tensor (``units.TensorPlan``), build the units, let the policy
choose under the budget (``policies.py``), compute the error bound
(``bound.py``), and assemble the ``Plan``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

import numpy as np

from mergepipe.analysis.inputs import check_unchanged
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import ModelRecord, TensorRecord
from mergepipe.errors import BudgetError, CatalogError, ConfigError
from mergepipe.planner.bound import error_bound
from mergepipe.planner.budget import Budget, parse_budget
from mergepipe.planner.policies import POLICIES, choose
from mergepipe.planner.units import TensorPlan, Units, build_units, unit_reads
from mergepipe.spec.merge_spec import MergeSpec
from mergepipe.spec.operator import OperatorDef
from mergepipe.spec.operators import canonical_name, validate_spec
from mergepipe.spec.plan import ModelRef, Plan, PlanCost
from mergepipe.spec.settings import count_layers
from mergepipe.spec.thresholds import find_threshold
from mergepipe.storage.convert import MERGEABLE_DTYPES
from mergepipe.storage.format import DTYPE_SIZES

__all__ = ["POLICIES", "Planner", "parse_out_dtype"]

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


class Planner:
    """Turns a merge request into a :class:`Plan` using only the catalog."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

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
        spec = merge_spec(experts, operator, weights, params, expert_params, seed)
        parsed_budget = _budget(budget, budget_mb)
        if policy not in POLICIES:
            raise ConfigError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        dtype = parse_out_dtype(out_dtype)
        catalog = self.catalog
        base = catalog.models.get(base_model)
        expert_records = [catalog.models.get(e) for e in spec.expert_ids]
        if base_model in spec.expert_ids:
            raise ConfigError(f"model {base_model!r} is both the base and an expert; list it once")
        tensors = catalog.models.tensors(base.id)
        names = [t.name for t in tensors if t.dtype in MERGEABLE_DTYPES]
        num_layers = base.num_layers or count_layers(names)
        definition = validate_spec(spec, names, num_layers)  # ConfigError before any I/O
        for model_id in (base.id, *spec.expert_ids):
            check_unchanged(catalog, model_id)
        self._require_analyzed(base.id, spec.expert_ids)

        norms = [self.catalog.stats.block_norms(e, base.id) for e in spec.expert_ids]
        plans = self._tensor_plans(definition, spec, base.id, tensors, num_layers, norms)
        units = build_units(plans)
        budget_bytes = parsed_budget.resolve(units.total_cost)
        if policy == "full" and budget_bytes < units.total_cost:
            raise ConfigError(
                f"policy 'full' reads every changed expert block ({units.total_cost} bytes) but the budget "
                f"is {parsed_budget.text}; use --budget 100% or the energy/uniform policy"
            )
        chosen = choose(units, budget_bytes, policy, [p.record.name for p in plans])
        plan = self._assemble(spec, base, expert_records, tensors, plans, units, chosen,
                              parsed_budget, budget_bytes, policy, dtype)
        return replace(plan, notes=plan.notes + _unmerged_differences(spec, tensors, norms))

    # ------------------------------------------------------------------ inputs

    def _require_analyzed(self, base_id: str, expert_ids: Sequence[str]) -> None:
        missing = [e for e in expert_ids if not self.catalog.stats.is_analyzed(e, base_id)]
        if missing:
            raise CatalogError(
                f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} not been analysed against "
                f"'{base_id}'; run `mergepipe analyze --db {self.catalog.path} --base {base_id} "
                f"{' '.join(missing)}` first (the CLI's --analyze-missing does it for you)"
            )

    def _tensor_plans(
        self, definition: OperatorDef, spec: MergeSpec, base_id: str, tensors: list[TensorRecord], num_layers: int,
        norms: list[dict[str, list[float | None]]],
    ) -> list[TensorPlan]:
        catalog = self.catalog
        blocks = catalog.blocks.by_tensor(base_id)
        stats = [catalog.stats.tensor_stats(e, base_id) for e in spec.expert_ids]
        plans = []
        for t in tensors:
            if t.dtype not in MERGEABLE_DTYPES:
                continue  # carried through from the base, never merged
            params = definition.resolve(spec, t.name, num_layers)
            # None (identical to the base) becomes NaN
            l2 = np.array([per[t.name] for per in norms], dtype=np.float64).reshape(len(norms), len(blocks[t.name]))
            expert_streams = [
                all(find_threshold(stats[i][t.name].thresholds, d) is not None
                    for d in definition.needs_thresholds(p))
                for i, p in enumerate(params.experts)
            ]
            plans.append(
                TensorPlan(
                    record=t,
                    block_bytes=np.array([b.nbytes for b in blocks[t.name]], dtype=np.int64),
                    l2=l2,
                    beta=[abs(b) for b in definition.beta(params)],
                    bound_kind=definition.error_bound,
                    tensor_level=not definition.streaming,
                    streams=definition.streams_with(params, all(expert_streams)),
                    expert_streams=expert_streams,
                )
            )
        return plans

    # ------------------------------------------------------------------ output

    def _assemble(
        self, spec: MergeSpec, base: ModelRecord, expert_records: list[ModelRecord], tensors: list[TensorRecord],
        plans: list[TensorPlan], units: Units, chosen: np.ndarray, parsed_budget: Budget, budget_bytes: int,
        policy: str, dtype: str | None,
    ) -> Plan:
        ids = spec.expert_ids
        picked = unit_reads(units, chosen, plans)
        reads: dict[str, dict[str, tuple[int, ...]]] = {}
        by_model = {e: 0 for e in ids}
        for t, per in picked.items():
            name = plans[t].record.name
            for i, blocks in per.items():
                reads.setdefault(name, {})[ids[i]] = tuple(int(b) for b in blocks)
                by_model[ids[i]] += int(plans[t].block_bytes[blocks].sum())
        expert_bytes = sum(by_model.values())
        full_bytes = units.total_cost
        out_bytes = sum(
            (t.numel * DTYPE_SIZES[dtype]) if (dtype and t.dtype in MERGEABLE_DTYPES) else t.nbytes for t in tensors
        )
        bound, kind = error_bound(plans, picked)
        notes = []
        if full_bytes and expert_bytes == 0:
            notes.append(
                f"the budget ({parsed_budget.text}) is below the cheapest useful read; "
                "this plan reads nothing from the experts and the output equals the base"
            )
        if budget_bytes >= full_bytes:
            notes.append("the budget covers every changed expert block: the result equals the full-read merge")
        return Plan(
            base=ModelRef(base.id, self.catalog.blocks.content_fingerprint(base.id)),
            experts=tuple(ModelRef(r.id, self.catalog.blocks.content_fingerprint(r.id)) for r in expert_records),
            merge=spec,
            block_bytes=self.catalog.block_bytes,
            budget_text=parsed_budget.text,
            budget_bytes=budget_bytes,
            policy=policy,
            out_dtype=dtype,
            reads=reads,
            tensor_level=tuple(sorted(p.record.name for p in plans if not p.streams)),
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


def _unmerged_differences(
    spec: MergeSpec, tensors: list[TensorRecord], norms: list[dict[str, list[float | None]]]
) -> tuple[str, ...]:
    """Warnings for tensors that are never merged (integer, F64, FP8 dtypes) but
    differ in an expert: the output keeps the base's value, which may surprise."""
    warnings = []
    for t in tensors:
        if t.dtype in MERGEABLE_DTYPES:
            continue
        differ = [e for e, per in zip(spec.expert_ids, norms) if any(v is not None for v in per.get(t.name, ()))]
        if differ:
            warnings.append(
                f"warning: {t.dtype} tensor '{t.name}' differs in {', '.join(differ)}; {t.dtype} tensors are not "
                "merged: the output keeps the base's value"
            )
    return tuple(warnings)


def merge_spec(
    experts: Sequence[str],
    operator: str,
    weights: Sequence[float] | None,
    params: Mapping[str, Any] | None,
    expert_params: Mapping[str, Mapping[str, Any]] | None,
    seed: int,
) -> MergeSpec:
    """The MergeSpec of a merge request (weights become per-expert ``weight`` settings)."""
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


def _budget(budget: str | int | None, budget_mb: float | None) -> Budget:
    if budget is not None and budget_mb is not None:
        raise ConfigError("give either budget or budget_mb, not both")
    if budget_mb is not None:
        if budget_mb < 0:
            raise BudgetError(f"budget_mb must not be negative, got {budget_mb}")
        return parse_budget(int(budget_mb * 1024 * 1024))
    return parse_budget(budget)
