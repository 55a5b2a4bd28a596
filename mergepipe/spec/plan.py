"""The Plan: what one merge reads, what it costs, how far it may be from the full-read merge; its digest π
(the canonical JSON of the fields that decide the result) and its strict reading (``PlanError``)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import field
from functools import cached_property
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    Field,
    PlainSerializer,
    PlainValidator,
    SerializerFunctionWrapHandler,
    Strict,
    ValidationError,
    model_serializer,
    model_validator,
)
from pydantic.dataclasses import dataclass

from mergepipe.errors import ConfigError, PlanError
from mergepipe.spec.canonical import (
    STORED,
    Count,
    Number,
    Positive,
    Stored,
    Text,
    canonical_json,
    compress_indices,
    digest,
    expand_ranges,
    one_line,
    reading,
    when_set,
)
from mergepipe.spec.copy_map import CopyMap
from mergepipe.spec.operators import MergeSpec, get_operator
from mergepipe.spec.request import MergeRequest

PLAN_SCHEMA = 1
#: Stored fields that do not decide the result.
_NOT_HASHED = ("notes", "created_at", "seconds", "estimate", "request")
#: Fields stored only when they differ from these defaults, so that the JSON (and digest) of every plan
#: without them is what it was before they existed; a stored default is malformed.
_WHEN_SET: dict[str, Any] = {
    "reuse": None,
    "out_shard_bytes": None,
    "chat_template": None,
    "copy_tokenizer": True,
    "copies": None,
    "side_files": None,
    "seconds": None,
    "estimate": None,
    "request": None,
}
#: Stored objects that group fields: stored key -> its keys -> the field each holds.
_GROUPS = {
    "budget": {"text": "budget_text", "bytes": "budget_bytes"},
    "error_bound": {"value": "error_bound", "kind": "error_bound_kind", "share": "error_share"},
    "entries": {"stores": "stores", "reads": "entry_reads", "sketch": "sketch_reads"},
}


def _read_ranges(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _read_ranges(v) for k, v in value.items()}
    return tuple(expand_ranges(value))


def _write_ranges(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: w for k, v in value.items() if (w := _write_ranges(v))}
    return compress_indices(value)


#: Block indices per tensor (per expert), stored as ranges, keys without blocks left out.
Blocks = Annotated[dict[str, tuple[Count, ...]], reading(_read_ranges), PlainSerializer(_write_ranges)]
Reads = Annotated[dict[str, dict[str, tuple[Count, ...]]], reading(_read_ranges), PlainSerializer(_write_ranges)]
#: tensor -> block -> value, stored as ``[[block, value], ...]`` in block order.
PerBlock = Annotated[
    dict[str, dict[Count, Number]],
    reading(lambda d: {t: dict(pairs) for t, pairs in d.items()}),
    PlainSerializer(lambda d: {t: [[b, v] for b, v in sorted(per.items())] for t, per in d.items() if per}),
]
#: tensor -> expert -> chunks or sketch stages of its delta store (tensors without any left out).
StoreReads = Annotated[
    dict[str, dict[str, Positive]],
    PlainSerializer(lambda d: {t: per for t, per in d.items() if per}),
]


@dataclass(frozen=True, config=STORED)
class PlanReuse(Stored):
    """Output blocks taken from a previous snapshot instead of being merged again (``merge --from``)."""

    snapshot: Text  # the previous snapshot's model id
    manifest_hash: Annotated[Text, Field(alias="manifest")]
    blocks: Blocks  # tensor -> output blocks copied from it
    output_bytes: Annotated[Count, Field(alias="bytes")]
    # expert -> bytes of its planned blocks not read (negative: a replaced version read for delta updates)
    saved: dict[str, Annotated[int, Strict()]] = Field(default_factory=dict)
    updated: Blocks = Field(default_factory=dict)  # blocks updated from the previous output (delta updates)
    updated_bytes: Count = 0
    replaced: dict[str, Text] = Field(default_factory=dict)  # expert id -> the version it replaced
    bound: Number = 0.0  # how far (Frobenius) the output may be from the from-scratch merge
    errors: PerBlock = Field(default_factory=dict)  # per-block bounds of updated blocks
    slack: PerBlock = Field(default_factory=dict)  # their fp32 terms (planner/reuse.py); stored when set

    _write = when_set(slack={})

    @property
    def block_count(self) -> int:
        return sum(len(ix) for ix in self.blocks.values())

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())

    @property
    def updated_count(self) -> int:
        return sum(len(ix) for ix in self.updated.values())

    def reuses(self, tensor: str, block: int) -> bool:
        return block in self.blocks.get(tensor, ())


#: The terms of a prediction, in the order of the coefficients.
TERMS = ("fixed", "experts", "output")


def _terms(terms: dict[str, float]) -> dict[str, float]:
    if set(terms) != set(TERMS):
        raise ValueError(f"the terms are {', '.join(TERMS)}")
    return terms


@dataclass(frozen=True, config=STORED)
class Prediction(Stored):
    """A plan's predicted seconds on one machine: total, relative uncertainty, each term, merges fitted."""

    machine: str
    seconds: Annotated[Number, Field(alias="total")]
    uncertainty: Number
    merges: Count
    terms: Annotated[dict[str, Number], AfterValidator(_terms)]

    def flat(self) -> dict[str, float]:
        """The form a manifest keeps (``cost.estimated.seconds``) and ``describe`` reads."""
        return {"total": self.seconds, "uncertainty": self.uncertainty, **self.terms, "merges": float(self.merges)}


def describe(seconds: Mapping[str, float] | None) -> str:
    """Predicted seconds for people, from ``Prediction.flat`` (a plan's, or a manifest's: one of the former
    cost model, by phase, shows its total)."""
    if not seconds:
        return "none"
    if "uncertainty" not in seconds:
        return f"{seconds.get('total', math.nan):.3g} s"
    merges = int(seconds.get("merges", 0))
    source = (
        f"fitted to {merges} merge{'s' * (merges != 1)} here"
        if merges
        else "prior only: no merge of this operator timed here yet"
    )
    terms = " + ".join(f"{name} {seconds[name]:.2g}" for name in TERMS if name in seconds)
    return f"{seconds['total']:.3g} s ± {100 * seconds['uncertainty']:.0f}%, start-up excluded ({terms} s; {source})"


@dataclass(frozen=True, config=STORED)
class ModelRef(Stored):
    """An input model as the plan saw it: catalog id and content fingerprint."""

    id: Text
    fingerprint: Text


@dataclass(frozen=True, config=STORED)
class PlanCost(Stored):
    """Bytes a plan expects to move. ``expert_bytes`` is the budgeted term."""

    base_bytes: Count
    expert_bytes: Count
    output_bytes: Count
    full_expert_bytes: Count
    expert_bytes_by_model: dict[str, Count]

    @property
    def reduction(self) -> float | None:
        """Full expert read / planned expert read (None when nothing is read)."""
        return None if self.expert_bytes == 0 else self.full_expert_bytes / self.expert_bytes


@dataclass(frozen=True, config=STORED)
class Plan(Stored):
    """What one merge will read, what it costs, and how far it may be from the full-read merge."""

    base: ModelRef
    experts: tuple[ModelRef, ...]
    merge: Annotated[
        MergeSpec,
        PlainValidator(lambda v: v if isinstance(v, MergeSpec) else MergeSpec.from_dict(v)),
        PlainSerializer(MergeSpec.to_dict),
    ]
    block_bytes: Positive
    budget_text: Text
    budget_bytes: Count
    policy: Text
    out_dtype: Text | None
    reads: Reads  # tensor -> expert -> block indices to read
    # tensors the engine merges whole (tensor-level operator or fallback)
    tensor_level: Annotated[tuple[Text, ...], PlainSerializer(sorted)]
    cost: PlanCost
    error_bound: Number
    error_bound_kind: Text
    error_share: Number  # the share of the experts' weighted deltas it leaves out (0..1; planner/policies.py)
    notes: tuple[Text, ...]
    created_at: Text | None = field(compare=False)
    entry_reads: StoreReads = field(default_factory=dict)  # tensor -> expert -> chunks of its delta store
    sketch_reads: StoreReads = field(default_factory=dict)  # tensor -> expert -> sketch stages
    stores: dict[str, Text] = field(default_factory=dict)  # expert -> digest of the store they were planned on
    reuse: PlanReuse | None = None  # None: everything is merged
    # the output's shards of at most this many tensor bytes; None: the base's files, mirrored (storage/checkpoint.py)
    out_shard_bytes: Positive | None = None
    chat_template: Text | None = None  # None: the base's tokenizer_config.json as it is
    copy_tokenizer: bool = True  # False: mergekit-yaml's --no-copy-tokenizer
    copies: CopyMap | None = None  # a passthrough's output (``reads`` is empty); None: a merge
    # the base's side files the output gets, name -> sha256; None: a base an earlier release registered
    side_files: dict[str, Text] | None = None
    # predicted on the machine that planned it (a prediction of the former cost model reads as None)
    seconds: Annotated[Prediction | None, reading(lambda v: None if isinstance(v, dict) and "phases" in v else v)] = (
        field(default=None, compare=False)
    )
    estimate: Number | None = field(default=None, compare=False)  # first-order deviation (planner/policies.py)
    request: MergeRequest | None = field(default=None, compare=False)  # with exact versions; None: planned before

    @model_validator(mode="before")
    @classmethod
    def _read(cls, data: Any) -> Any:
        """A stored plan's JSON as fields (a Python caller gives the fields themselves)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        schema = data.pop("schema", None)
        if type(schema) is not int or schema != PLAN_SCHEMA:
            raise ValueError(f"plan schema {schema!r} is not supported (this mergepipe reads schema {PLAN_SCHEMA})")
        stored_defaults = [k for k, default in _WHEN_SET.items() if k in data and data[k] == default]
        if stored_defaults:
            raise ValueError(f"{stored_defaults[0]} is {data[stored_defaults[0]]!r}, which is never stored")
        for key, names in _GROUPS.items():
            group = data.pop(key, {} if key == "entries" else None)
            if not isinstance(group, dict) or set(group) - set(names) or (group and set(names) - set(group)):
                raise ValueError(f"{key} must be an object of {', '.join(names)}")
            data.update({names[k]: v for k, v in group.items()})
        return data

    @model_validator(mode="after")
    def _check_stores(self) -> Plan:
        for reads in (self.entry_reads, self.sketch_reads):
            for tensor, per in reads.items():
                if set(per) - set(self.stores):
                    raise ValueError(
                        f"delta-store reads of {tensor} name {sorted(set(per) - set(self.stores))}, which have no store"
                    )
        return self

    @model_serializer(mode="wrap")
    def _write(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key, names in _GROUPS.items():
            data[key] = {name: data.pop(f) for name, f in names.items()}
        if not (data["entries"]["reads"] or data["entries"]["sketch"]):
            del data["entries"]
        return {"schema": PLAN_SCHEMA, **{k: v for k, v in data.items() if k not in _WHEN_SET or v != _WHEN_SET[k]}}

    @cached_property
    def digest(self) -> str:
        """π: sha256 of the canonical JSON of the result-deciding fields (computed once)."""
        return digest({k: v for k, v in super().to_json().items() if k not in _NOT_HASHED})

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "digest": self.digest}

    def to_json_str(self) -> str:
        return canonical_json(self.to_json()).decode("utf-8")

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str) -> Plan:
        """A stored plan, read strictly; PlanError naming the first problem, or an edit."""
        try:
            parsed = json.loads(data) if isinstance(data, str) else dict(data)
            if not isinstance(parsed, dict):
                raise ValueError(f"a plan is a JSON object, got {type(parsed).__name__}")
            stored = parsed.pop("digest", None)
            plan = super().from_json(parsed)
            computed = plan.digest  # NaN in the settings fails here
        except (ValueError, ConfigError) as exc:  # json.JSONDecodeError and ValidationError are ValueErrors
            reason = one_line(exc, "plan") if isinstance(exc, ValidationError) else str(exc)
            raise PlanError(f"not a valid MergePipe plan ({reason}); make a new one with `mergepipe plan`") from None
        if stored is not None and stored != computed:
            raise PlanError(
                f"plan digest mismatch: stored {str(stored)[:12]}, recomputed {computed[:12]}; the plan was edited"
            )
        return plan

    @property
    def operator(self) -> str:
        return self.merge.operator

    def reads_of(self, tensor: str, expert_id: str) -> tuple[int, ...]:
        return self.reads.get(tensor, {}).get(expert_id, ())

    def keeps_base(self, tensor: str, num_layers: int) -> bool:
        """Whether the operator, with ``tensor``'s parameters, gives the base where every Δ is 0: only then
        is a block no expert is read for the base's."""
        definition = get_operator(self.operator)
        return definition.keeps_base(definition.resolve(self.merge, tensor, num_layers))

    def merge_mode(self, tensor: str, mergeable: bool, same_dtype: bool, keeps_base: bool) -> str:
        """How a tensor's output is made: ``"copy"`` (the base's bytes), ``"blocks"`` (merged block by block)
        or ``"whole"`` (tensor-level operators, delta-store reads, dtype conversions)."""
        stored = bool(self.entry_reads.get(tensor)) or bool(self.sketch_reads.get(tensor))
        merged = mergeable and (any(self.reads.get(tensor, {}).values()) or stored or not keeps_base)
        if not merged and same_dtype:
            return "copy"
        if tensor in self.tensor_level or not merged or stored:
            return "whole"
        return "blocks"

    def experts_reading(self, tensor: str, block: int) -> list[str]:
        """The experts (in spec order) the plan reads block ``block`` of ``tensor`` from."""
        per = self.reads.get(tensor, {})
        return [e for e in self.merge.expert_ids if block in per.get(e, ())]

    def expert_bytes_to_read(self, expert_id: str) -> int:
        """Bytes of ``expert_id`` the engine reads: the planned ones, less those reuse saves."""
        saved = self.reuse.saved.get(expert_id, 0) if self.reuse else 0
        return self.cost.expert_bytes_by_model.get(expert_id, 0) - saved

    def chunks_of(self, tensor: str, expert_id: str) -> int:
        return self.entry_reads.get(tensor, {}).get(expert_id, 0)

    def stages_of(self, tensor: str, expert_id: str) -> int:
        return self.sketch_reads.get(tensor, {}).get(expert_id, 0)
