"""Plan a merge under an expert-I/O budget from the catalog alone (a passthrough's plan is its copy map);
the time model (``a + b·expert_bytes + c·output_bytes`` fitted to past merges): predicted seconds and time
budgets as bytes."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mergepipe.analysis.experts import check_unchanged, expert_block_bytes, expert_shared_bytes
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import ModelRecord, TensorRecord, Timing
from mergepipe.catalog.snapshots import host_key
from mergepipe.errors import BudgetError, CatalogError, ConfigError, PlanError, UnknownModelError
from mergepipe.planner.policies import EntryChoice, Store, TensorPlan, Units, build_units, choose, error_bound
from mergepipe.planner.policies import plan_entries, unit_reads
from mergepipe.planner.reuse import incremental
from mergepipe.sizes import format_bytes
from mergepipe.spec.copy_map import CopyMap, build_copy_map
from mergepipe.spec.operators import MergeSpec, OperatorDef, find_threshold, kept_count, validate_spec
from mergepipe.spec.plan import TERMS, ModelRef, Plan, PlanCost, Prediction
from mergepipe.spec.request import MergeRequest
from mergepipe.spec.settings import count_layers
from mergepipe.storage.checkpoint import TOKENIZER_CONFIG_FILE
from mergepipe.storage.format import DTYPE_SIZES, MERGEABLE_DTYPES
from mergepipe.storage.location import location
from mergepipe.storage.remote import is_file

#: The most recent merges a time model is fitted to.
HISTORY = 50
#: How far a merge's seconds stray from a perfect model, relative (run to run: the page cache, other work).
NOISE = 0.1
#: How far a prior's coefficients may be off, relative.
PRIOR_SPREAD = 0.5
#: How much the prior's spread weighs in a prediction's uncertainty, in merges.
PRIOR_MERGES = 1.0
#: The prior's fixed part: staging, opening the inputs, the manifest, rename and commit of a small merge.
PRIOR_FIXED_SECONDS = 0.1
#: The read rate of a machine analysis never ran on (a cloud volume's or a SATA disk's), with twice the spread.
UNMEASURED_READ_RATE = 200e6
#: Gauss-Newton steps of a fit at most (it converges in a few; a step moves a coefficient by a factor e at most).
MAX_STEPS = 50


@dataclass(frozen=True)
class Prior:
    """What a merge is expected to cost before any was timed here, and how far to trust it (relative)."""

    fixed_seconds: float
    seconds_per_expert_byte: float
    seconds_per_output_byte: float
    spread: float = PRIOR_SPREAD

    @classmethod
    def measured(
        cls, read_bytes_per_second: float | None, kernel_seconds_per_element: float | None, element_bytes: float
    ) -> Prior:
        """An expert byte costs its read (None: never analysed here) and its share of the kernel (None: never
        probed); an output byte the read of its base byte (the output is written by a thread of its own)."""
        spread = PRIOR_SPREAD if read_bytes_per_second else 2 * PRIOR_SPREAD
        read = 1 / (read_bytes_per_second or UNMEASURED_READ_RATE)
        kernel = (kernel_seconds_per_element or 0.0) / element_bytes
        return cls(PRIOR_FIXED_SECONDS, read + kernel, read, spread)

    @property
    def coefficients(self) -> np.ndarray:
        return np.array([self.fixed_seconds, self.seconds_per_expert_byte, self.seconds_per_output_byte])


@dataclass(frozen=True)
class TimeModel:
    """``seconds ≈ a + b·expert_bytes + c·output_bytes`` for one machine and operator, and how uncertain."""

    coefficients: tuple[float, float, float]
    uncertainty: float  # relative, e.g. 0.35 for ±35%
    merges: int  # the merges it was fitted to (0: the prior alone)

    def terms(self, expert_bytes: int, output_bytes: int) -> dict[str, float]:
        return dict(zip(TERMS, (c * x for c, x in zip(self.coefficients, (1, expert_bytes, output_bytes)))))

    def predict(self, machine: str, expert_bytes: int, output_bytes: int) -> Prediction:
        terms = self.terms(expert_bytes, output_bytes)
        return Prediction(machine, sum(terms.values()), self.uncertainty, self.merges, terms)

    def seconds(self, expert_bytes: int, output_bytes: int) -> float:
        return sum(self.terms(expert_bytes, output_bytes).values())

    def expert_bytes_within(self, seconds: float, output_bytes: int) -> float:
        """The most expert bytes a merge writing ``output_bytes`` may read within ``seconds``; negative when
        reading none already takes longer."""
        fixed, per_expert, per_output = self.coefficients
        left = seconds - fixed - per_output * output_bytes
        if left < 0:
            return -1.0
        return left / per_expert if per_expert > 0 else math.inf


def fit(prior: Prior, history: Sequence[Timing]) -> TimeModel:
    """The model of ``history`` (one operator, one machine): each coefficient ``prior × e^δ``, the δ minimising
    ``Σ ((seconds − predicted) / seconds)² + (NOISE / spread)² · Σ δ²`` by Gauss-Newton steps."""
    rows = [t for t in history if t.seconds > 0]
    if not rows:
        f, e, o = (float(v) for v in prior.coefficients)
        return TimeModel((f, e, o), prior.spread, 0)
    x = np.array([(1.0, t.expert_bytes, t.output_bytes) for t in rows])
    y = np.array([t.seconds for t in rows])
    shares = x * prior.coefficients / y[:, None]  # each term's prior seconds over the merge's seconds
    ridge = NOISE / prior.spread
    delta = np.zeros(3)
    for _ in range(MAX_STEPS):
        scaled = shares * np.exp(delta)  # each term's seconds over the merge's seconds, at δ
        residuals = 1.0 - scaled.sum(axis=1)
        a = np.vstack([scaled, ridge * np.eye(3)])
        b = np.concatenate([residuals, -ridge * delta])
        step = np.clip(np.linalg.lstsq(a, b, rcond=None)[0], -1.0, 1.0)  # at most a factor e per step
        delta += step
        if np.abs(step).max() < 1e-9:
            break
    coefficients = prior.coefficients * np.exp(delta)
    residuals = 1.0 - (x @ coefficients) / y
    uncertainty = math.sqrt((PRIOR_MERGES * prior.spread**2 + float(residuals @ residuals)) / (PRIOR_MERGES + len(y)))
    f, e, o = (float(v) for v in coefficients)
    return TimeModel((f, e, o), uncertainty, len(y))


def output_options(base: ModelRecord, request: MergeRequest) -> dict[str, Any]:
    """The plan fields of the output (shard size, chat template, tokenizer, side files), checked against the base."""
    if request.chat_template is not None and not request.copy_tokenizer:
        raise ConfigError(
            "a chat template is written into the output's tokenizer files, which "
            "--no-copy-tokenizer leaves out; keep the tokenizer, or drop chat_template"
        )
    if request.chat_template is not None and not is_file(location(base.uri) / TOKENIZER_CONFIG_FILE):
        raise ConfigError(  # a local stat, or a HEAD for a remote base
            f"a chat template is written into the base's {TOKENIZER_CONFIG_FILE}, and base '{base.id}' "
            f"({base.uri}) has none; give a base with tokenizer files, or merge without a chat template"
        )
    return {
        "out_shard_bytes": request.out_shard_bytes,
        "chat_template": request.chat_template,
        "copy_tokenizer": request.copy_tokenizer,
        "side_files": base.side_digests,
    }


def output_bytes(tensors: Sequence[TensorRecord], out_dtype: str | None) -> int:
    """The bytes a merge of ``tensors`` writes: mergeable ones in ``out_dtype`` (theirs when None)."""
    return sum(
        t.numel * DTYPE_SIZES[out_dtype] if (out_dtype and t.dtype in MERGEABLE_DTYPES) else t.nbytes for t in tensors
    )


def time_model(catalog: Catalog, operator: str, device: str, tensors: Sequence[TensorRecord]) -> tuple[str, TimeModel]:
    """``(machine, model)`` of ``operator`` merges on ``device`` here, for a base of ``tensors``."""
    if device != "cpu" and device != "cuda" and not re.fullmatch(r"cuda:\d+", device):
        raise ConfigError(f"--device must be cpu or cuda, got {device!r}")
    host = host_key()
    mergeable = [t for t in tensors if t.dtype in MERGEABLE_DTYPES and t.numel]
    element_bytes = sum(t.nbytes for t in mergeable) / sum(t.numel for t in mergeable) if mergeable else 4.0
    prior = Prior.measured(
        catalog.timings.read_rate(host), catalog.timings.kernel_seconds(host, device).get(operator), element_bytes
    )
    return f"{host}/{device}", fit(prior, catalog.timings.merges(host, device, operator, HISTORY))


def with_prediction(catalog: Catalog, plan: Plan, device: str = "cpu") -> Plan:
    """``plan`` carrying its predicted seconds on ``device`` here (reused bytes left out); the digest stays."""
    machine, model = time_model(catalog, plan.operator, device, catalog.models.tensors(plan.base.id))
    expert_bytes = sum(plan.expert_bytes_to_read(e.id) for e in plan.experts)
    return replace(plan, seconds=model.predict(machine, expert_bytes, plan.cost.output_bytes))


def resolve_budget(
    catalog: Catalog, request: MergeRequest, full_bytes: int, tensors: Sequence[TensorRecord], device: str
) -> int:
    """The budget in bytes: its byte part, and with a time part the expert bytes predicted to fit (the tighter)."""
    budget = request.budget
    budget_bytes = budget.resolve(full_bytes)
    if budget.seconds is None:
        return budget_bytes
    _, model = time_model(catalog, request.operator, device, tensors)
    output = output_bytes(tensors, request.out_dtype)
    within = model.expert_bytes_within(budget.seconds, output)
    if within < 0:
        raise BudgetError(
            f"--budget {budget.text}: even reading no expert byte this merge is predicted to take "
            f"{model.seconds(0, output):.1f} s ± {100 * model.uncertainty:.0f}% here (reading the base, writing and "
            "publishing the output; start-up not included); give more time"
        )
    return min(budget_bytes, full_bytes, math.floor(within) if math.isfinite(within) else full_bytes)


def check_copies(
    catalog: Catalog, request: MergeRequest
) -> tuple[ModelRecord, dict[str, ModelRecord], CopyMap, list[TensorRecord], dict[str, int], int]:
    """``(base, records, copy map, source tensor of each output tensor, bytes read per source, budget)`` of
    the passthrough ``request`` from the catalog's records alone, so that a refusal reads nothing."""
    base = catalog.models.resolve(request.base)
    slices = tuple(replace(s, model=catalog.models.resolve(s.model).id) for s in request.slices or ())
    records = {base.id: base, **{s.model: catalog.models.get(s.model) for s in slices}}
    for record in records.values():
        if record.kind not in ("checkpoint", "snapshot"):
            raise ConfigError(
                f"'{record.id}' is a {record.kind} checkpoint, not a model: a passthrough copies "
                "the tensors of full checkpoints; merge it into its base first"
            )
    tensors = {m: catalog.models.tensors(m) for m in records}
    copies = build_copy_map(slices, base.id, {m: [(t.name, t.shape) for t in ts] for m, ts in tensors.items()})
    if request.budget.seconds is not None:
        raise BudgetError(
            f"--budget {request.budget.text}: a passthrough copies every tensor its slices name, so a "
            "time budget has nothing to buy; give a byte budget, 100% or none"
        )
    by_name = {m: {t.name: t for t in ts} for m, ts in tensors.items()}
    sources = [by_name[c.model][c.tensor] for c in copies.copies]
    by_model: dict[str, int] = {}
    for c, t in zip(copies.copies, sources):  # a tensor copied twice (a self-stack) is read twice
        by_model[c.model] = by_model.get(c.model, 0) + t.nbytes
    needed = sum(by_model.values())
    budget_bytes = request.budget.resolve(needed)
    if budget_bytes < needed:
        raise BudgetError(
            f"budget {request.budget.text} ({format_bytes(budget_bytes)}) is below the "
            f"{format_bytes(needed)} this passthrough copies; it has no partial result (a tensor left "
            "out is a hole in the model): give --budget 100%, or none"
        )
    return base, records, copies, sources, by_model, budget_bytes


def plan_copies(catalog: Catalog, request: MergeRequest, device: str = "cpu") -> Plan:
    """The plan of the passthrough ``request``: its copy map, every byte read, error 0."""
    base, records, copies, sources, by_model, budget_bytes = check_copies(catalog, request)
    output = output_options(base, request)
    for model_id in records:
        check_unchanged(catalog, model_id)
    missing = [r.id for r in records.values() if catalog.blocks.hashed_count(r.id) < r.n_blocks]
    if missing:
        raise CatalogError(
            f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} not been analysed: a passthrough checks "
            f"every block it copies against its hash; run `mergepipe analyze --db {catalog.path} "
            f"{' '.join(missing)}` first (the CLI's --analyze-missing does it for you)"
        )
    experts = [catalog.models.resolve(e).id for e in request.experts]
    expert_bytes = {e: by_model.get(e, 0) for e in experts}
    stacked = ", ".join(f"[{s.first}, {s.end}) of '{s.model}'" for s in copies.slices)
    plan = Plan(
        base=ModelRef(base.id, catalog.blocks.content_fingerprint(base.id)),
        experts=tuple(ModelRef(e, catalog.blocks.content_fingerprint(e)) for e in experts),
        merge=request.spec(dict(zip(request.experts, experts))),
        block_bytes=catalog.block_bytes,
        budget_text=request.budget.text,
        budget_bytes=budget_bytes,
        policy=request.policy or "energy",
        out_dtype=request.out_dtype,
        reads={},
        tensor_level=(),
        cost=PlanCost(
            base_bytes=by_model.get(base.id, 0),
            expert_bytes=sum(expert_bytes.values()),
            output_bytes=output_bytes(sources, request.out_dtype),
            full_expert_bytes=sum(expert_bytes.values()),
            expert_bytes_by_model=expert_bytes,
        ),
        error_bound=0.0,
        error_bound_kind="exact",
        error_share=0.0,
        notes=(
            f"passthrough: {copies.layers} layers, {len(copies.copies)} tensors copied as they are: layers "
            f"{stacked}; embeddings from '{copies.slices[0].model}', the other tensors outside the layers from "
            f"'{copies.slices[-1].model}'; config.json and tokenizer from '{base.id}' (layer count rewritten)",
        ),
        created_at=catalog.now(),
        copies=copies,
        request=request.pinned(
            {request.base: base.id, **{a.model: b.model for a, b in zip(request.slices or (), copies.slices)}}
        ),
        **output,
    )
    return with_prediction(catalog, plan, device)


class Planner:
    """Turns a merge request into a :class:`Plan` using only the catalog."""

    def __init__(self, catalog: Catalog, device: str = "cpu") -> None:
        self.catalog = catalog
        self.device = device  # where its plans will run: their predicted seconds, a time budget

    def plan(self, request: MergeRequest) -> Plan:
        """Plan the merge ``request`` asks for (a name means its latest version; the plan records exact ones)."""
        catalog = self.catalog
        if request.slices is not None:
            return plan_copies(catalog, request, self.device)
        base = catalog.models.resolve(request.base)
        output = output_options(base, request)
        exact = {ref: catalog.models.resolve(ref).id for ref in request.experts}
        for key in request.expert_params:  # another spelling of an expert: `name` for `name@N`, N the latest
            if key not in exact:
                try:
                    exact[key] = catalog.models.resolve(key).id
                except UnknownModelError:
                    exact[key] = key
        spec = request.spec(exact)
        if base.id in spec.expert_ids:
            raise ConfigError(f"model {base.id!r} is both the base and an expert; list it once")
        tensors = catalog.models.tensors(base.id)
        names = [t.name for t in tensors if t.dtype in MERGEABLE_DTYPES]
        num_layers = base.num_layers or count_layers(names)
        definition = validate_spec(spec, names, num_layers)  # ConfigError before any I/O
        for model_id in (base.id, *spec.expert_ids):
            check_unchanged(catalog, model_id)
        missing = [e for e in spec.expert_ids if not catalog.stats.is_analyzed(e, base.id)]
        if missing:
            raise CatalogError(
                f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} not been analysed against "
                f"'{base.id}'; run `mergepipe analyze --db {catalog.path} --base {base.id} "
                f"{' '.join(missing)}` first (the CLI's --analyze-missing does it for you)"
            )
        norms = [catalog.stats.block_norms(e, base.id) for e in spec.expert_ids]
        plans = self._tensor_plans(definition, spec, base.id, tensors, num_layers, norms)
        units = build_units(plans)
        budget_bytes = resolve_budget(catalog, request, units.total_cost, tensors, self.device)
        budgeted = budget_bytes < units.total_cost
        # no policy named: entries when a budget leaves something unread, the operator merges entry by entry
        # and every expert has a delta store against the base; else energy
        unstored = (
            []
            if request.policy is not None
            else [e for e in spec.expert_ids if catalog.deltas.find(e, base.id) is None]
        )
        policy = request.policy or ("entries" if budgeted and definition.streaming and not unstored else "energy")
        if policy == "full" and budgeted:
            raise ConfigError(
                f"policy 'full' reads every changed expert block ({units.total_cost} bytes) but the budget "
                f"is {request.budget.text}; use --budget 100% or the energy/uniform policy"
            )
        if policy == "entries" and not definition.streaming:
            raise ConfigError(
                f"policy 'entries' needs an operator that merges entry by entry; {definition.name} needs "
                "whole tensors: use the energy or uniform policy"
            )
        plan = self._assemble(request, spec, base.id, tensors, plans, units, budget_bytes, policy)
        notes = list(plan.notes)
        if definition.budget_note and plan.cost.expert_bytes < plan.cost.full_expert_bytes:
            notes.append(definition.budget_note)
        if request.policy is None and budgeted and policy == "entries":
            notes.append(
                "policy entries (the default: every expert has a delta store): the budget buys sketches and "
                "exact deltas, the most quality per byte"
            )
        elif request.policy is None and budgeted and definition.streaming and unstored:
            notes.append(
                "policy energy (the default without delta stores); delta stores would keep more quality at this "
                f"budget: `mergepipe analyze --base {base.id} --store-deltas DIR {' '.join(unstored)}` (on disk "
                "1.1-1.3x the experts' size), then plans use policy entries"
            )
        pinned = request.pinned({**exact, request.base: base.id})
        plan = replace(plan, notes=(*notes, *_unmerged_differences(spec, tensors, norms)), request=pinned, **output)
        return with_prediction(catalog, incremental(catalog, plan, request.previous, request.delta_update), self.device)

    def _tensor_plans(
        self,
        definition: OperatorDef,
        spec: MergeSpec,
        base_id: str,
        tensors: list[TensorRecord],
        num_layers: int,
        norms: list[dict[str, list[float | None]]],
    ) -> list[TensorPlan]:
        catalog = self.catalog
        blocks = catalog.blocks.by_tensor(base_id)
        stats = [catalog.stats.tensor_stats(e, base_id) for e in spec.expert_ids]
        own_bytes = [expert_block_bytes(catalog, e, base_id) for e in spec.expert_ids]  # None: the base's
        shared = [expert_shared_bytes(catalog, e) for e in spec.expert_ids]
        plans = []
        for t in tensors:
            if t.dtype not in MERGEABLE_DTYPES:
                continue  # carried through from the base, never merged
            params = definition.resolve(spec, t.name, num_layers)
            needs = [definition.needs_thresholds(p) for p in params.experts]
            # None (identical to the base) becomes NaN
            l2 = np.array([per[t.name] for per in norms], dtype=np.float64).reshape(len(norms), len(blocks[t.name]))
            expert_streams = [
                all(find_threshold(stats[i][t.name].thresholds, d) is not None for d in densities)
                for i, densities in enumerate(needs)
            ]
            base_bytes = np.array([b.nbytes for b in blocks[t.name]], dtype=np.int64)
            plans.append(
                TensorPlan(
                    record=t,
                    block_bytes=base_bytes,
                    l2=l2,
                    beta=[abs(b) for b in definition.beta(params)],
                    bound_kind=definition.error_bound,
                    tensor_level=not definition.streaming,
                    streams=definition.streams_with(params, all(expert_streams)),
                    expert_streams=expert_streams,
                    useful_entries=[max((kept_count(d, t.numel) for d in ds), default=None) for ds in needs],
                    expert_bytes=None
                    if not any(own_bytes)
                    else np.array([base_bytes if own is None else own[t.name] for own in own_bytes], dtype=np.int64),
                    shared_bytes=None
                    if not any(shared)
                    else np.array([per.get(t.name, 0) for per in shared], dtype=np.int64),
                )
            )
        return plans

    def _assemble(
        self,
        request: MergeRequest,
        spec: MergeSpec,
        base_id: str,
        tensors: list[TensorRecord],
        plans: list[TensorPlan],
        units: Units,
        budget_bytes: int,
        policy: str,
    ) -> Plan:
        """The plan of what ``policy`` chooses of ``units`` (and with ``entries``, of the delta stores)."""
        ids, catalog = spec.expert_ids, self.catalog
        entry_choice: EntryChoice | None = None
        stores: dict[int, str] = {}
        if policy == "entries":
            found = {i: catalog.deltas.find(e, base_id) for i, e in enumerate(ids)}
            stores = {i: record.digest for i, record in found.items() if record is not None}
            if not stores:
                raise ConfigError(
                    f"policy 'entries' reads delta stores, and none of {', '.join(ids)} has one against "
                    f"'{base_id}'; build them with `mergepipe analyze --db {catalog.path} --base {base_id} "
                    f"--store-deltas DIR {' '.join(ids)}`"
                )
            contents = {
                i: Store(catalog.deltas.chunks(ids[i], base_id), catalog.deltas.stages(ids[i], base_id)) for i in stores
            }
            chosen_units, chosen, entry_choice = plan_entries(plans, contents, budget_bytes)
        else:
            chosen_units, chosen = units, choose(units, budget_bytes, policy, [p.record.name for p in plans])
        picked = unit_reads(chosen_units, chosen, plans)
        for t, per in (entry_choice.blocks if entry_choice else {}).items():
            for i, blocks in per.items():  # experts read exactly through their blocks
                picked.setdefault(t, {})[i] = blocks
        reads: dict[str, dict[str, tuple[int, ...]]] = {}
        by_model = {e: 0 for e in ids}
        for t, per in picked.items():
            for i, blocks in per.items():
                reads.setdefault(plans[t].record.name, {})[ids[i]] = tuple(int(b) for b in blocks)
                by_model[ids[i]] += plans[t].read_bytes(i, blocks)
        blocks_complete = False
        if entry_choice is not None:
            others = sum(n for i, n in enumerate(by_model.values()) if i not in entry_choice.bytes_by_expert)
            blocks_complete = others == chosen_units.total_cost
            for i, n in entry_choice.bytes_by_expert.items():
                by_model[ids[i]] += n
        expert_bytes, full_bytes = sum(by_model.values()), units.total_cost
        bound = error_bound(plans, picked, entry_choice.energy if entry_choice else None)
        if not math.isfinite(bound.value):
            raise PlanError(
                "the plan's error bound overflows (weights times delta norms beyond float64): the "
                "merge would overflow too; check the weights and parameters"
            )
        notes = []
        if full_bytes and expert_bytes == 0:
            notes.append(
                f"the budget ({request.budget.text}) is below the cheapest useful read; "
                "this plan reads nothing from the experts and the output equals the base (Σw·B where the weights "
                "are not normalised)"
            )
        if entry_choice is None and budget_bytes >= full_bytes:
            notes.append("the budget covers every changed expert block: the result equals the full-read merge")
        plan = Plan(
            base=ModelRef(base_id, catalog.blocks.content_fingerprint(base_id)),
            experts=tuple(ModelRef(e, catalog.blocks.content_fingerprint(e)) for e in ids),
            merge=spec,
            block_bytes=catalog.block_bytes,
            budget_text=request.budget.text,
            budget_bytes=budget_bytes,
            policy=policy,
            out_dtype=request.out_dtype,
            reads=reads,
            tensor_level=tuple(sorted(p.record.name for p in plans if not p.streams)),
            cost=PlanCost(
                base_bytes=sum(t.nbytes for t in tensors),
                expert_bytes=expert_bytes,
                output_bytes=output_bytes(tensors, request.out_dtype),
                full_expert_bytes=full_bytes,
                expert_bytes_by_model=by_model,
            ),
            error_bound=bound.value,
            error_bound_kind=bound.kind,
            error_share=bound.share,
            estimate=bound.estimate,
            notes=tuple(notes),
            created_at=catalog.now(),
        )
        return plan if entry_choice is None else _with_entries(plan, plans, entry_choice, stores, blocks_complete)


def _with_entries(
    plan: Plan, plans: list[TensorPlan], choice: EntryChoice, stores: dict[int, str], blocks_complete: bool
) -> Plan:
    """The plan with its delta-store reads (tensor -> expert -> chunks or stages), their stores, and notes."""
    ids = plan.merge.expert_ids

    def by_name(reads: dict[int, dict[int, int]]) -> dict[str, dict[str, int]]:
        return {plans[t].record.name: {ids[i]: n for i, n in sorted(per.items())} for t, per in sorted(reads.items())}

    entry_reads, sketch_reads = by_name(choice.chunks), by_name(choice.sketch)
    used = {e for reads in (entry_reads, sketch_reads) for per in reads.values() for e in per}
    stored = ", ".join(f"{ids[i]} {format_bytes(n)}" for i, n in sorted(choice.bytes_by_expert.items()))
    stages = sum(len(per) for per in choice.sketch.values())
    exact = sum(len(per) for per in choice.chunks.values()) + sum(len(per) for per in choice.blocks.values())
    notes = [f"reads delta stores ({stored}): {stages} expert tensors as sketches, {exact} exactly"]
    if choice.complete and blocks_complete:
        notes.append("the plan reads every entry the operator uses: the result equals the full-read merge")
    return replace(
        plan,
        entry_reads=entry_reads,
        sketch_reads=sketch_reads,
        stores={ids[i]: d for i, d in stores.items() if ids[i] in used},
        notes=(*plan.notes, *notes),
    )


def _unmerged_differences(
    spec: MergeSpec, tensors: list[TensorRecord], norms: list[dict[str, list[float | None]]]
) -> tuple[str, ...]:
    """Warnings for tensors never merged (integer, F64, FP8) that differ in an expert: the output keeps the base's."""
    warnings = []
    for t in (t for t in tensors if t.dtype not in MERGEABLE_DTYPES):
        differ = [e for e, per in zip(spec.expert_ids, norms) if any(v is not None for v in per.get(t.name, ()))]
        if differ:
            warnings.append(
                f"warning: {t.dtype} tensor '{t.name}' differs in {', '.join(differ)}; {t.dtype} tensors are not "
                "merged: the output keeps the base's value"
            )
    return tuple(warnings)
