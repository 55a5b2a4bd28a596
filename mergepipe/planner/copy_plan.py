"""Plan a passthrough: the copy map of its slices, what copying it reads, and the budget that takes.

A passthrough (mergekit's frankenmerge, ``spec/copy_map.py``) reads every byte its map names and nothing
else, and has no partial result: a tensor left out is a hole in the model, not a smaller error. So its
budget counts every byte the map reads, from every source alike (the base too when a slice takes its
layers), and a budget below that is refused in one line before anything is read; a time budget, which
buys a number of expert bytes, has nothing to buy here and is refused too.

The plan has no block reads and no error (the output is its sources' bytes, in the output dtype): its
``copies`` say what the engine copies. The sources must be registered checkpoints whose blocks are hashed
(``mergepipe analyze MODEL``: no base, nothing to compare), since the engine checks every block it
copies against its recorded hash, as it checks every byte a merge reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from mergepipe.analysis.opening import check_unchanged
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import ModelRecord, TensorRecord
from mergepipe.errors import BudgetError, CatalogError, ConfigError
from mergepipe.planner.output import output_options
from mergepipe.planner.seconds import with_prediction
from mergepipe.spec.copy_map import CopyMap, build_copy_map
from mergepipe.spec.plan import ModelRef, Plan, PlanCost
from mergepipe.spec.request import MergeRequest
from mergepipe.storage.format import DTYPE_SIZES, MERGEABLE_DTYPES
from mergepipe.sizes import format_bytes

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
            raise ConfigError(f"'{record.id}' is a {record.kind} checkpoint, not a model: a passthrough copies "
                              "the tensors of full checkpoints; merge it into its base first")
    tensors = {m: catalog.models.tensors(m) for m in records}
    copies = build_copy_map(slices, base.id, {m: [(t.name, t.shape) for t in ts] for m, ts in tensors.items()})
    if request.budget.seconds is not None:
        raise BudgetError(f"--budget {request.budget.text}: a passthrough copies every tensor its slices name, so a "
                          "time budget has nothing to buy; give a byte budget, 100% or none")
    by_model = _bytes_by_model(copies, tensors)
    needed = sum(by_model.values())
    budget_bytes = request.budget.resolve(needed)
    if budget_bytes < needed:
        raise BudgetError(f"budget {request.budget.text} ({format_bytes(budget_bytes)}) is below the "
                          f"{format_bytes(needed)} this passthrough copies; it has no partial result (a tensor left "
                          "out is a hole in the model): give --budget 100%, or none")
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
    return sum(t.numel * DTYPE_SIZES[out_dtype] if out_dtype and t.dtype in MERGEABLE_DTYPES else t.nbytes
               for t in _entries(copies, tensors))


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
    return (f"passthrough: {copies.layers} layers, {len(copies.copies)} tensors copied as they are: layers "
            f"{stacked}; embeddings from '{first}', the other tensors outside the layers from '{last}'; "
            f"config.json and tokenizer from '{base_id}' (layer count rewritten)",)
