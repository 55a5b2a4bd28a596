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

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from mergepipe.analysis.experts import check_unchanged, expert_block_bytes, expert_shared_bytes
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import ModelRecord, TensorRecord
from mergepipe.catalog.snapshots import host_key
from mergepipe.errors import BudgetError, CatalogError, ConfigError, PlanError, UnknownModelError
from mergepipe.planner.policies import (
    EntryChoice,
    Store,
    TensorPlan,
    Units,
    build_units,
    choose,
    error_bound,
    plan_entries,
    unit_reads,
)
from mergepipe.planner.reuse import incremental
from mergepipe.sizes import format_bytes
from mergepipe.spec.copy_map import CopyMap, build_copy_map
from mergepipe.spec.operators import MergeSpec, OperatorDef, find_threshold, kept_count, validate_spec
from mergepipe.spec.plan import ModelRef, Plan, PlanCost, Prediction
from mergepipe.spec.request import Budget, MergeRequest
from mergepipe.spec.settings import count_layers
from mergepipe.spec.time_model import Prior, TimeModel, fit
from mergepipe.storage.checkpoint import TOKENIZER_CONFIG_FILE
from mergepipe.storage.format import DTYPE_SIZES, MERGEABLE_DTYPES
from mergepipe.storage.location import location
from mergepipe.storage.remote import is_file


def output_options(
    base: ModelRecord, out_shard_bytes: int | None, chat_template: str | None, copy_tokenizer: bool = True
) -> dict[str, Any]:
    """The plan fields ``out_shard_bytes``, ``chat_template``, ``copy_tokenizer`` and ``side_files`` (the
    base's, recorded at registration; the engine copies them, checked), checked; ConfigError naming the fix.

    Any shard size of at least one byte has a well-defined packing (a tensor larger than it sits alone in
    its shard), so 1 is the minimum: a floor such as 1 MiB would refuse nothing harmful and would forbid
    sharding small models. A chat template is written into the base's tokenizer_config.json, so the base
    must have one; the catalog records weight files only, so its folder is looked at (a stat, no read).
    """
    if out_shard_bytes is not None and (
        isinstance(out_shard_bytes, bool) or not isinstance(out_shard_bytes, int) or out_shard_bytes < 1
    ):
        raise ConfigError(
            f"the output shard size must be a whole number of bytes, at least 1 (e.g. 5GB), got {out_shard_bytes!r}"
        )
    if chat_template is not None and not copy_tokenizer:
        raise ConfigError(
            "a chat template is written into the output's tokenizer files, which "
            "--no-copy-tokenizer leaves out; keep the tokenizer, or drop chat_template"
        )
    if chat_template is not None:
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise ConfigError("the chat template must be the non-empty text of a Jinja template")
        if not is_file(location(base.uri) / TOKENIZER_CONFIG_FILE):  # a local stat, or a HEAD for a remote base
            raise ConfigError(
                f"a chat template is written into the base's {TOKENIZER_CONFIG_FILE}, and base '{base.id}' "
                f"({base.uri}) has none; give a base with tokenizer files, or merge without a chat template"
            )
    return {
        "out_shard_bytes": out_shard_bytes,
        "chat_template": chat_template,
        "copy_tokenizer": copy_tokenizer,
        "side_files": base.side_digests,
    }


#: The most recent merges a model is fitted to: enough to outweigh the prior many times over, recent enough to
#: follow a machine whose disk or load changed.
HISTORY = 50


def output_bytes(tensors: Sequence[TensorRecord], out_dtype: str | None) -> int:
    """The bytes a merge of the base ``tensors`` writes: mergeable tensors in ``out_dtype`` (the base's when
    None), the others as they are."""
    return sum(
        t.numel * DTYPE_SIZES[out_dtype] if (out_dtype and t.dtype in MERGEABLE_DTYPES) else t.nbytes for t in tensors
    )


def time_model(catalog: Catalog, operator: str, device: str, tensors: Sequence[TensorRecord]) -> tuple[str, TimeModel]:
    """``(machine, model)``: the model of ``operator`` merges on ``device`` here, for a base of ``tensors`` (whose
    dtype says how many bytes an element the kernel probe's seconds are for)."""
    if device != "cpu" and device != "cuda" and not re.fullmatch(r"cuda:\d+", device):
        raise ConfigError(f"--device must be cpu or cuda, got {device!r}")
    host = host_key()
    mergeable = [t for t in tensors if t.dtype in MERGEABLE_DTYPES and t.numel]
    element_bytes = sum(t.nbytes for t in mergeable) / sum(t.numel for t in mergeable) if mergeable else 4.0
    prior = Prior.measured(
        catalog.timings.read_rate(host), catalog.timings.kernel_seconds(host, device).get(operator), element_bytes
    )
    return f"{host}/{device}", fit(prior, catalog.timings.merges(host, device, operator, HISTORY))


def predict_plan(catalog: Catalog, plan: Plan, device: str = "cpu") -> Prediction:
    """``plan``'s seconds on ``device`` here: the expert bytes the engine reads (reused ones left out) and the
    output bytes it writes, through this machine's model."""
    machine, model = time_model(catalog, plan.operator, device, catalog.models.tensors(plan.base.id))
    expert_bytes = sum(plan.expert_bytes_to_read(e.id) for e in plan.experts)
    return model.predict(machine, expert_bytes, plan.cost.output_bytes)


def with_prediction(catalog: Catalog, plan: Plan, device: str = "cpu") -> Plan:
    """``plan`` carrying its predicted seconds on ``device`` here; the digest stays."""
    return replace(plan, seconds=predict_plan(catalog, plan, device))


def resolve_budget(
    catalog: Catalog,
    budget: Budget,
    full_bytes: int,
    tensors: Sequence[TensorRecord],
    out_dtype: str | None,
    operator: str,
    device: str = "cpu",
) -> int:
    """The budget in bytes: its byte part (or the full read), and with a time part the most expert bytes the
    model predicts to fit in it, whichever is tighter. BudgetError when reading nothing already takes longer."""
    budget_bytes = budget.resolve(full_bytes)
    if budget.seconds is None:
        return budget_bytes
    _, model = time_model(catalog, operator, device, tensors)
    output = output_bytes(tensors, out_dtype)
    within = model.expert_bytes_within(budget.seconds, output)
    if within < 0:
        raise BudgetError(
            f"--budget {budget.text}: even reading no expert byte this merge is predicted to take "
            f"{model.seconds(0, output):.1f} s ± {100 * model.uncertainty:.0f}% here (reading the base, writing and "
            "publishing the output; start-up not included); give more time"
        )
    return min(budget_bytes, full_bytes, math.floor(within) if math.isfinite(within) else full_bytes)


#: Kinds of models whose tensors a passthrough copies: full weights (a delta or an adapter is not a model).
_COPYABLE = ("checkpoint", "snapshot")


@dataclass(frozen=True)
class _Inputs:
    """What a passthrough's plan is made of, from the catalog's records alone."""

    base: ModelRecord
    records: dict[str, ModelRecord]  # the base and every slice model, by id
    copies: CopyMap
    by_model: dict[str, int]  # bytes the map reads of each source
    budget_bytes: int
    tensors: dict[str, list[TensorRecord]]


def check_copies(catalog: Catalog, request: MergeRequest) -> None:
    """Refuse what the passthrough ``request`` cannot be (its map, its budget) from the catalog's records:
    before its sources are hashed (``app/planning.py``), so that a refusal reads nothing."""
    _inputs(catalog, request)


def plan_copies(catalog: Catalog, request: MergeRequest, device: str = "cpu") -> Plan:
    """The plan of the passthrough ``request`` (references resolved here, as ``Planner.plan`` does)."""
    inputs = _inputs(catalog, request)
    base, copies, by_model = inputs.base, inputs.copies, inputs.by_model
    output = output_options(base, request.out_shard_bytes, request.chat_template, request.copy_tokenizer)
    for model_id in inputs.records:
        check_unchanged(catalog, model_id)
    _require_hashed(catalog, list(inputs.records.values()))
    experts = [catalog.models.resolve(e).id for e in request.experts]
    expert_bytes = {e: by_model.get(e, 0) for e in experts}
    plan = Plan(
        base=ModelRef(base.id, catalog.blocks.content_fingerprint(base.id)),
        experts=tuple(ModelRef(e, catalog.blocks.content_fingerprint(e)) for e in experts),
        merge=request.spec(dict(zip(request.experts, experts))),
        block_bytes=catalog.block_bytes,
        budget_text=request.budget.text,
        budget_bytes=inputs.budget_bytes,
        policy=request.policy or "energy",
        out_dtype=request.out_dtype,
        reads={},
        tensor_level=(),
        cost=PlanCost(
            base_bytes=by_model.get(base.id, 0),
            expert_bytes=sum(expert_bytes.values()),
            output_bytes=_output_bytes(copies, inputs.tensors, request.out_dtype),
            full_expert_bytes=sum(expert_bytes.values()),
            expert_bytes_by_model=expert_bytes,
        ),
        error_bound=0.0,
        error_bound_kind="exact",
        error_share=0.0,
        notes=_notes(copies, base.id),
        created_at=catalog.now(),
        copies=copies,
        request=request.pinned(
            {request.base: base.id, **{a.model: b.model for a, b in zip(request.slices or (), copies.slices)}}
        ),
        **output,
    )
    return with_prediction(catalog, plan, device)


def _inputs(catalog: Catalog, request: MergeRequest) -> _Inputs:
    """The records, the copy map and the budget of ``request``; ConfigError or BudgetError naming what
    does not fit."""
    assert request.slices is not None, "a passthrough request has slices (MergeRequest checks it)"
    base = catalog.models.resolve(request.base)
    slices = tuple(replace(s, model=catalog.models.resolve(s.model).id) for s in request.slices)
    records = {base.id: base, **{s.model: catalog.models.get(s.model) for s in slices}}
    for record in records.values():
        if record.kind not in _COPYABLE:
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
    by_model = _bytes_by_model(copies, tensors)
    needed = sum(by_model.values())
    budget_bytes = request.budget.resolve(needed)
    if budget_bytes < needed:
        raise BudgetError(
            f"budget {request.budget.text} ({format_bytes(budget_bytes)}) is below the "
            f"{format_bytes(needed)} this passthrough copies; it has no partial result (a tensor left "
            "out is a hole in the model): give --budget 100%, or none"
        )
    return _Inputs(base, records, copies, by_model, budget_bytes, tensors)


def _entries(copies: CopyMap, tensors: dict[str, list[TensorRecord]]) -> list[TensorRecord]:
    """The source tensor of every output tensor, in output order."""
    by_name = {m: {t.name: t for t in ts} for m, ts in tensors.items()}
    return [by_name[c.model][c.tensor] for c in copies.copies]


def _bytes_by_model(copies: CopyMap, tensors: dict[str, list[TensorRecord]]) -> dict[str, int]:
    """The bytes the map reads of each source (a tensor copied twice, as a self-stack does, is read twice)."""
    out: dict[str, int] = {}
    for c, t in zip(copies.copies, _entries(copies, tensors)):
        out[c.model] = out.get(c.model, 0) + t.nbytes
    return out


def _output_bytes(copies: CopyMap, tensors: dict[str, list[TensorRecord]], out_dtype: str | None) -> int:
    """The output's tensor bytes: float tensors in ``out_dtype`` (their own when None), the others as they are."""
    return sum(
        t.numel * DTYPE_SIZES[out_dtype] if out_dtype and t.dtype in MERGEABLE_DTYPES else t.nbytes
        for t in _entries(copies, tensors)
    )


def _require_hashed(catalog: Catalog, records: Sequence[ModelRecord]) -> None:
    """CatalogError naming the command, unless every block of every input is hashed."""
    missing = [r.id for r in records if catalog.blocks.hashed_count(r.id) < r.n_blocks]
    if missing:
        raise CatalogError(
            f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} not been analysed: a passthrough checks "
            f"every block it copies against its hash; run `mergepipe analyze --db {catalog.path} "
            f"{' '.join(missing)}` first (the CLI's --analyze-missing does it for you)"
        )


def _notes(copies: CopyMap, base_id: str) -> tuple[str, ...]:
    """What the plan does, for people: the layers it stacks and where the rest comes from."""
    stacked = ", ".join(f"[{s.first}, {s.end}) of '{s.model}'" for s in copies.slices)
    first, last = copies.slices[0].model, copies.slices[-1].model
    return (
        f"passthrough: {copies.layers} layers, {len(copies.copies)} tensors copied as they are: layers "
        f"{stacked}; embeddings from '{first}', the other tensors outside the layers from '{last}'; "
        f"config.json and tokenizer from '{base_id}' (layer count rewritten)",
    )


@dataclass(frozen=True)
class _Choice:
    """What ``policy`` chose within the budget: ``chosen`` indexes ``units`` (every block unit; with policy
    ``entries``, those of the experts without a delta store), and with ``entries`` what it reads from the
    stores and their digests, by expert position."""

    policy: str
    units: Units
    chosen: np.ndarray
    entries: EntryChoice | None = None
    stores: dict[int, str] = field(default_factory=dict)


class Planner:
    """Turns a merge request into a :class:`Plan` using only the catalog."""

    def __init__(self, catalog: Catalog, device: str = "cpu") -> None:
        self.catalog = catalog
        self.device = device  # where its plans will run: their predicted seconds, a time budget (planner/seconds.py)

    def plan(self, request: MergeRequest) -> Plan:
        """Plan the merge ``request`` asks for (its references resolved here: a name means its latest
        version, ``name@N`` version N; the plan records exact versions). A passthrough's slices are no
        merge: they are planned as a copy map (``copy_plan.py``)."""
        catalog = self.catalog
        if request.slices is not None:
            return plan_copies(catalog, request, self.device)
        base = catalog.models.resolve(request.base)
        # ConfigError before any I/O
        output = output_options(base, request.out_shard_bytes, request.chat_template, request.copy_tokenizer)
        expert_records = [catalog.models.resolve(e) for e in request.experts]
        exact = {ref: r.id for ref, r in zip(request.experts, expert_records)}
        exact.update({key: _exact_or_none(catalog, key) or key for key in request.expert_params if key not in exact})
        spec = request.spec(exact)
        if base.id in spec.expert_ids:
            raise ConfigError(f"model {base.id!r} is both the base and an expert; list it once")
        tensors = catalog.models.tensors(base.id)
        names = [t.name for t in tensors if t.dtype in MERGEABLE_DTYPES]
        num_layers = base.num_layers or count_layers(names)
        definition = validate_spec(spec, names, num_layers)  # ConfigError before any I/O
        for model_id in (base.id, *spec.expert_ids):
            check_unchanged(catalog, model_id)
        self._require_analyzed(base.id, spec.expert_ids)

        dtype = request.out_dtype
        norms = [self.catalog.stats.block_norms(e, base.id) for e in spec.expert_ids]
        plans = self._tensor_plans(definition, spec, base.id, tensors, num_layers, norms)
        units = build_units(plans)
        budget_bytes = resolve_budget(
            catalog, request.budget, units.total_cost, tensors, dtype, spec.operator, self.device
        )
        budgeted = budget_bytes < units.total_cost
        # a request naming no policy: entries when a budget leaves something unread, the operator merges entry by
        # entry and every expert has a delta store against the base; else energy
        unstored = (
            []
            if request.policy is not None
            else [e for e in spec.expert_ids if catalog.deltas.find(e, base.id) is None]
        )
        policy = request.policy or ("entries" if budgeted and definition.streaming and not unstored else "energy")
        _check_full_policy(policy, budget_bytes, units.total_cost, request.budget.text)
        choice = self._choose(definition, base.id, spec.expert_ids, plans, units, budget_bytes, policy)
        plan = self._assemble(request, spec, base.id, tensors, plans, units, choice, budget_bytes)
        if choice.entries is not None:
            stores = {spec.expert_ids[i]: digest for i, digest in choice.stores.items()}
            plan = _with_entries(plan, plans, choice.entries, stores)
        if definition.budget_note and plan.cost.expert_bytes < plan.cost.full_expert_bytes:
            plan = replace(plan, notes=(*plan.notes, definition.budget_note))
        if request.policy is None and budgeted:
            plan = replace(plan, notes=(*plan.notes, *_policy_note(definition, base.id, unstored, policy)))
        pinned = request.pinned({**exact, request.base: base.id})
        plan = replace(plan, notes=plan.notes + _unmerged_differences(spec, tensors, norms), request=pinned, **output)
        return with_prediction(catalog, incremental(catalog, plan, request.previous, request.delta_update), self.device)

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
            # None (identical to the base) becomes NaN
            l2 = np.array([per[t.name] for per in norms], dtype=np.float64).reshape(len(norms), len(blocks[t.name]))
            expert_streams = [
                all(find_threshold(stats[i][t.name].thresholds, d) is not None for d in definition.needs_thresholds(p))
                for i, p in enumerate(params.experts)
            ]
            useful = [
                max((kept_count(d, t.numel) for d in definition.needs_thresholds(p)), default=None)
                for p in params.experts
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
                    useful_entries=useful,
                    expert_bytes=None
                    if not any(own_bytes)
                    else np.array([base_bytes if own is None else own[t.name] for own in own_bytes], dtype=np.int64),
                    shared_bytes=None
                    if not any(shared)
                    else np.array([per.get(t.name, 0) for per in shared], dtype=np.int64),
                )
            )
        return plans

    def _choose(
        self,
        definition: OperatorDef,
        base_id: str,
        expert_ids: Sequence[str],
        plans: list[TensorPlan],
        units: Units,
        budget_bytes: int,
        policy: str,
    ) -> _Choice:
        """What ``policy`` reads of ``units`` (and, policy ``entries``, of the delta stores) within the budget."""
        if policy != "entries":
            return _Choice(policy, units, choose(units, budget_bytes, policy, [p.record.name for p in plans]))
        stores = self._stores(definition, base_id, expert_ids)
        contents = {
            i: Store(
                self.catalog.deltas.chunks(expert_ids[i], base_id), self.catalog.deltas.stages(expert_ids[i], base_id)
            )
            for i in stores
        }
        read_units, chosen, entry_choice = plan_entries(plans, contents, budget_bytes)
        return _Choice(policy, read_units, chosen, entry_choice, stores)

    def _stores(self, definition: OperatorDef, base_id: str, expert_ids: Sequence[str]) -> dict[int, str]:
        """Expert position -> digest of its delta store against ``base_id`` (policy ``entries``)."""
        if not definition.streaming:
            raise ConfigError(
                f"policy 'entries' needs an operator that merges entry by entry; {definition.name} needs "
                "whole tensors: use the energy or uniform policy"
            )
        stores = {}
        for i, expert_id in enumerate(expert_ids):
            record = self.catalog.deltas.find(expert_id, base_id)
            if record is not None:
                stores[i] = record.digest
        if not stores:
            raise ConfigError(
                f"policy 'entries' reads delta stores, and none of {', '.join(expert_ids)} has one against "
                f"'{base_id}'; build them with `mergepipe analyze --db {self.catalog.path} --base {base_id} "
                f"--store-deltas DIR {' '.join(expert_ids)}`"
            )
        return stores

    # ------------------------------------------------------------------ output

    def _assemble(
        self,
        request: MergeRequest,
        spec: MergeSpec,
        base_id: str,
        tensors: list[TensorRecord],
        plans: list[TensorPlan],
        units: Units,
        choice: _Choice,
        budget_bytes: int,
    ) -> Plan:
        """The plan of ``spec`` (``request`` resolved) reading what ``choice`` chose; ``units``: every unit
        (what a full read costs)."""
        ids = spec.expert_ids
        parsed_budget, dtype, entry_choice = request.budget, request.out_dtype, choice.entries
        picked = unit_reads(choice.units, choice.chosen, plans)
        for t, per in (entry_choice.blocks if entry_choice else {}).items():
            for i, blocks in per.items():  # experts read exactly through their blocks
                picked.setdefault(t, {})[i] = blocks
        reads, by_model = _block_reads(picked, plans, ids)
        blocks_complete = False
        if entry_choice is not None:
            others = sum(n for i, n in enumerate(by_model.values()) if i not in entry_choice.bytes_by_expert)
            blocks_complete = others == choice.units.total_cost
            for i, n in entry_choice.bytes_by_expert.items():
                by_model[ids[i]] += n
        expert_bytes = sum(by_model.values())
        full_bytes = units.total_cost
        out_bytes = output_bytes(tensors, dtype)
        bound = error_bound(plans, picked, entry_choice.energy if entry_choice else None)
        if not math.isfinite(bound.value):
            raise PlanError(
                "the plan's error bound overflows (weights times delta norms beyond float64): the "
                "merge would overflow too; check the weights and parameters"
            )
        notes = []
        if full_bytes and expert_bytes == 0:
            notes.append(
                f"the budget ({parsed_budget.text}) is below the cheapest useful read; "
                "this plan reads nothing from the experts and the output equals the base (Σw·B where the weights "
                "are not normalised)"
            )
        if entry_choice is None and budget_bytes >= full_bytes:
            notes.append("the budget covers every changed expert block: the result equals the full-read merge")
        if entry_choice is not None:
            notes.extend(_entry_notes(entry_choice, ids, blocks_complete))
        return Plan(
            base=ModelRef(base_id, self.catalog.blocks.content_fingerprint(base_id)),
            experts=tuple(ModelRef(e, self.catalog.blocks.content_fingerprint(e)) for e in ids),
            merge=spec,
            block_bytes=self.catalog.block_bytes,
            budget_text=parsed_budget.text,
            budget_bytes=budget_bytes,
            policy=choice.policy,
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
            error_bound=bound.value,
            error_bound_kind=bound.kind,
            error_share=bound.share,
            estimate=bound.estimate,
            notes=tuple(notes),
            created_at=self.catalog.now(),
        )


def _policy_note(definition: OperatorDef, base_id: str, unstored: Sequence[str], policy: str) -> tuple[str, ...]:
    """Why a budgeted plan that named no policy took the one it took (a note: not hashed); ``unstored``: the
    experts without a delta store against ``base_id``."""
    if policy == "entries":
        return (
            "policy entries (the default: every expert has a delta store): the budget buys sketches and "
            "exact deltas, the most quality per byte",
        )
    if not definition.streaming or not unstored:
        return ()
    return (
        f"policy energy (the default without delta stores); delta stores would keep more quality at this "
        f"budget: `mergepipe analyze --base {base_id} --store-deltas DIR {' '.join(unstored)}` (on disk "
        "1.1-1.3x the experts' size), then plans use policy entries",
    )


def _check_full_policy(policy: str, budget_bytes: int, full_bytes: int, budget_text: str) -> None:
    if policy == "full" and budget_bytes < full_bytes:
        raise ConfigError(
            f"policy 'full' reads every changed expert block ({full_bytes} bytes) but the budget "
            f"is {budget_text}; use --budget 100% or the energy/uniform policy"
        )


def _block_reads(
    picked: dict[int, dict[int, np.ndarray]], plans: list[TensorPlan], ids: Sequence[str]
) -> tuple[dict[str, dict[str, tuple[int, ...]]], dict[str, int]]:
    """The plan's block reads by name, and the bytes they read per expert."""
    reads: dict[str, dict[str, tuple[int, ...]]] = {}
    by_model = {e: 0 for e in ids}
    for t, per in picked.items():
        name = plans[t].record.name
        for i, blocks in per.items():
            reads.setdefault(name, {})[ids[i]] = tuple(int(b) for b in blocks)
            by_model[ids[i]] += plans[t].read_bytes(i, blocks)
    return reads, by_model


def _entry_notes(choice: EntryChoice, ids: Sequence[str], blocks_complete: bool) -> list[str]:
    stored = ", ".join(f"{ids[i]} {format_bytes(n)}" for i, n in sorted(choice.bytes_by_expert.items()))
    stages = sum(len(per) for per in choice.sketch.values())
    exact = sum(len(per) for per in choice.chunks.values()) + sum(len(per) for per in choice.blocks.values())
    notes = [f"reads delta stores ({stored}): {stages} expert tensors as sketches, {exact} exactly"]
    if choice.complete and blocks_complete:
        notes.append("the plan reads every entry the operator uses: the result equals the full-read merge")
    return notes


def _with_entries(plan: Plan, plans: list[TensorPlan], choice: EntryChoice, stores: dict[str, str]) -> Plan:
    """The plan with its delta-store reads (tensor name -> expert id -> chunks) and store digests."""
    ids = plan.merge.expert_ids

    def by_name(reads: dict[int, dict[int, int]]) -> dict[str, dict[str, int]]:
        return {plans[t].record.name: {ids[i]: n for i, n in sorted(per.items())} for t, per in sorted(reads.items())}

    entry_reads, sketch_reads = by_name(choice.chunks), by_name(choice.sketch)
    used = {e for reads in (entry_reads, sketch_reads) for per in reads.values() for e in per}
    return replace(
        plan, entry_reads=entry_reads, sketch_reads=sketch_reads, stores={e: d for e, d in stores.items() if e in used}
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


def _exact_or_none(catalog: Catalog, ref: str) -> str | None:
    """The stored id ``ref`` names, or None (a key of ``expert_params`` may be another spelling of an
    expert: ``name`` for ``name@N`` while N is the latest)."""
    try:
        return catalog.models.resolve(ref).id
    except UnknownModelError:
        return None
