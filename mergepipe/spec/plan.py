"""The Plan: an executable, serialisable decision of what a merge reads.

A plan names its inputs by id and fingerprint, the merge (operator,
parameter settings, seed), the exact set of (expert, block) reads, the
estimated costs and the error bound. Its digest π is the sha256 of the
canonical JSON of the fields that decide the result; ``notes``
(explanations for people), ``created_at`` and ``seconds`` (the seconds
predicted from this catalog's timings on this machine, ``spec/time_model.py``) stay
outside the digest so that re-planning the same merge gives the same π on
any machine.

``Plan.from_json`` is strict (missing or unknown fields, wrong types and a
digest that does not match are ``PlanError``s), like ``Manifest.from_json``:
a stored plan is executed only if it is exactly what was planned.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from mergepipe.errors import ConfigError, PlanError
from mergepipe.spec import canonical as fields
from mergepipe.spec.canonical import canonical_json, compress_indices, digest, expand_ranges
from mergepipe.spec.copy_map import CopyMap
from mergepipe.spec.operators import MergeSpec
from mergepipe.spec.operators import get_operator


@dataclass(frozen=True)
class PlanReuse:
    """Output blocks taken from a previous snapshot instead of being merged again."""

    snapshot: str  # the previous snapshot's model id
    manifest_hash: str  # its manifest hash, as the catalog recorded it at publish time
    # tensor name -> output block indices copied from it (sorted)
    blocks: dict[str, tuple[int, ...]]
    output_bytes: int  # bytes of those blocks (output dtype): read from the previous snapshot
    # expert id -> bytes of its planned blocks that need not be read (negative: a replaced expert's
    # earlier version is read for delta updates)
    saved: dict[str, int] = field(default_factory=dict)
    # tensor name -> output blocks updated from the previous output (delta updates)
    updated: dict[str, tuple[int, ...]] = field(default_factory=dict)
    updated_bytes: int = 0  # bytes of those blocks: read from the previous snapshot too
    replaced: dict[str, str] = field(default_factory=dict)  # expert id -> the version it replaced
    bound: float = 0.0  # Frobenius norm the output may differ from the from-scratch merge by
    # tensor -> block -> its bound (updated blocks, and reused blocks that were updated before)
    errors: dict[str, dict[int, float]] = field(default_factory=dict)
    # tensor -> block -> the fp32 arithmetic term of an updated block's bound, from which the engine
    # computes its a-posteriori bound (planner/delta_update.py); in JSON only when there are updates, so
    # other plans keep their digests
    slack: dict[str, dict[int, float]] = field(default_factory=dict)

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

    def to_json(self) -> dict[str, Any]:
        return {
            "snapshot": self.snapshot,
            "manifest": self.manifest_hash,
            "blocks": {t: compress_indices(ix) for t, ix in sorted(self.blocks.items()) if ix},
            "bytes": self.output_bytes,
            "saved": dict(sorted(self.saved.items())),
            "updated": {t: compress_indices(ix) for t, ix in sorted(self.updated.items()) if ix},
            "updated_bytes": self.updated_bytes,
            "replaced": dict(sorted(self.replaced.items())),
            "bound": self.bound,
            "errors": _per_block(self.errors),
            **({"slack": _per_block(self.slack)} if self.slack else {}),
        }

    @classmethod
    def from_json(cls, data: Any) -> PlanReuse:
        d = fields.keys(
            data,
            (
                "snapshot",
                "manifest",
                "blocks",
                "bytes",
                "saved",
                "updated",
                "updated_bytes",
                "replaced",
                "bound",
                "errors",
            ),
            "plan reuse",
            optional=("slack",),
        )
        blocks, updated = (
            {
                t: tuple(expand_ranges(fields.array(r, f"{what} blocks of {t}")))
                for t, r in fields.mapping(d[key], f"plan reuse {key}").items()
            }
            for key, what in (("blocks", "reused"), ("updated", "updated"))
        )
        return cls(
            snapshot=fields.text(d["snapshot"], "plan reuse snapshot"),
            manifest_hash=fields.text(d["manifest"], "plan reuse manifest"),
            blocks=blocks,
            output_bytes=fields.integer(d["bytes"], "plan reuse bytes"),
            saved={
                e: fields.integer(n, f"bytes of {e} saved by reuse", minimum=None)
                for e, n in fields.mapping(d["saved"], "plan reuse saved").items()
            },
            updated=updated,
            updated_bytes=fields.integer(d["updated_bytes"], "plan reuse updated_bytes"),
            replaced={
                e: fields.text(v, f"version {e} replaced")
                for e, v in fields.mapping(d["replaced"], "plan reuse replaced").items()
            },
            bound=fields.number(d["bound"], "plan reuse bound"),
            errors=_read_per_block(d["errors"], "error"),
            slack=_read_per_block(d.get("slack", {}), "slack"),
        )


def _per_block(values: dict[str, dict[int, float]]) -> dict[str, list[list[float]]]:
    """tensor -> [[block, value], ...] in block order, tensors without values left out."""
    return {t: [[b, e] for b, e in sorted(per.items())] for t, per in sorted(values.items()) if per}


def _read_per_block(data: Any, what: str) -> dict[str, dict[int, float]]:
    """``_per_block``'s JSON, checked."""
    return {
        t: {
            fields.integer(p[0], f"block of {t}"): fields.number(p[1], f"{what} of {t}")
            for p in (fields.array(x, f"{what} of {t}") for x in fields.array(v, f"{what}s of {t}"))
        }
        for t, v in fields.mapping(data, f"plan reuse {what}").items()
    }


#: The terms of a prediction, in the order of the coefficients.
TERMS = ("fixed", "experts", "output")


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted seconds on one machine: the total, how uncertain (relative), the seconds of each term
    (``TERMS``), and how many merges of its operator the model was fitted to (0: the prior alone)."""

    machine: str
    seconds: float
    uncertainty: float
    merges: int
    terms: dict[str, float]

    def flat(self) -> dict[str, float]:
        """The form a manifest keeps (``cost.estimated.seconds``) and ``describe`` reads."""
        return {"total": self.seconds, "uncertainty": self.uncertainty, **self.terms, "merges": float(self.merges)}

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "total": self.seconds,
            "uncertainty": self.uncertainty,
            "merges": self.merges,
            "terms": dict(self.terms),
        }

    @classmethod
    def from_json(cls, data: Any) -> Prediction | None:
        """A stored prediction; None for one the former cost model made (``work`` and ``phases``, in plans
        saved before this model): a plan's seconds are predicted again where it runs."""
        if isinstance(data, dict) and "phases" in data:
            return None
        d = fields.keys(data, ("machine", "total", "uncertainty", "merges", "terms"), "plan seconds")
        terms = fields.keys(d["terms"], TERMS, "plan seconds.terms")
        return cls(
            fields.text(d["machine"], "plan seconds.machine"),
            fields.number(d["total"], "plan seconds.total"),
            fields.number(d["uncertainty"], "plan seconds.uncertainty"),
            fields.integer(d["merges"], "plan seconds.merges"),
            {t: fields.number(terms[t], f"plan seconds.terms.{t}") for t in TERMS},
        )


def describe(seconds: Mapping[str, float] | None) -> str:
    """Predicted seconds for people, from ``Prediction.flat`` (a plan's, or a manifest's): the total, how
    uncertain, the terms and what the model learnt from. A manifest sealed by the former cost model (phases)
    shows its total; nothing predicted says so."""
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


PLAN_SCHEMA = 1

#: Fields of ``Plan.to_json()`` that do not decide the result.
_NOT_HASHED = ("digest", "notes", "created_at", "seconds", "estimate")
_PLAN_FIELDS = (
    "schema",
    "base",
    "experts",
    "merge",
    "block_bytes",
    "budget",
    "policy",
    "out_dtype",
    "reads",
    "tensor_level",
    "cost",
    "error_bound",
    "notes",
    "created_at",
)
#: Present only in plans that read delta stores (``entries``), reuse a previous
#: snapshot (``reuse``), shard the output to a size (``out_shard_bytes``), set a
#: chat template (``chat_template``) or leave the tokenizer out (``copy_tokenizer``:
#: false), copy tensors by a map (``copies``: a passthrough), carry predicted
#: seconds (``seconds``) or name the base's side files (``side_files``: absent for a
#: base an earlier release registered), so every other plan's JSON (and digest) is
#: what it was before those existed.
_OPTIONAL_FIELDS = (
    "digest",
    "entries",
    "reuse",
    "out_shard_bytes",
    "chat_template",
    "copy_tokenizer",
    "copies",
    "seconds",
    "estimate",
    "side_files",
)


@dataclass(frozen=True)
class ModelRef:
    """An input model as the plan saw it: catalog id and content fingerprint."""

    id: str
    fingerprint: str

    def __post_init__(self) -> None:
        fields.text(self.id, "model id")
        fields.text(self.fingerprint, f"fingerprint of {self.id}")

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "fingerprint": self.fingerprint}

    @classmethod
    def from_json(cls, data: Any, what: str = "model reference") -> ModelRef:
        d = fields.keys(data, ("id", "fingerprint"), what)
        return cls(id=d["id"], fingerprint=d["fingerprint"])


@dataclass(frozen=True)
class PlanCost:
    """Bytes a plan expects to move. ``expert_bytes`` is the budgeted term."""

    base_bytes: int
    expert_bytes: int
    output_bytes: int
    full_expert_bytes: int
    expert_bytes_by_model: dict[str, int]

    @property
    def reduction(self) -> float | None:
        """Full expert read / planned expert read (None when nothing is read)."""
        if self.expert_bytes == 0:
            return None
        return self.full_expert_bytes / self.expert_bytes

    def to_json(self) -> dict:
        return {
            "base_bytes": self.base_bytes,
            "expert_bytes": self.expert_bytes,
            "output_bytes": self.output_bytes,
            "full_expert_bytes": self.full_expert_bytes,
            "expert_bytes_by_model": dict(self.expert_bytes_by_model),
        }

    @classmethod
    def from_json(cls, data: Any) -> PlanCost:
        names = ("base_bytes", "expert_bytes", "output_bytes", "full_expert_bytes")
        d = fields.keys(data, (*names, "expert_bytes_by_model"), "plan cost")
        by_model = fields.mapping(d["expert_bytes_by_model"], "plan cost.expert_bytes_by_model")
        return cls(
            **{name: fields.integer(d[name], f"plan cost.{name}") for name in names},
            expert_bytes_by_model={k: fields.integer(v, f"plan cost of {k}") for k, v in by_model.items()},
        )


@dataclass(frozen=True)
class Plan:
    """What one merge will read, what it costs, and how far it may be from
    the full-read merge."""

    base: ModelRef
    experts: tuple[ModelRef, ...]
    merge: MergeSpec
    block_bytes: int
    budget_text: str
    budget_bytes: int
    policy: str
    out_dtype: str | None
    # tensor name -> expert id -> block indices to read (sorted)
    reads: dict[str, dict[str, tuple[int, ...]]]
    # tensors the engine must merge whole (tensor-level operator or fallback)
    tensor_level: tuple[str, ...]
    cost: PlanCost
    error_bound: float
    error_bound_kind: str
    # share of the experts' weighted deltas the plan leaves out (0..1; planner/bound.py)
    error_share: float
    schema: int = PLAN_SCHEMA
    notes: tuple[str, ...] = ()
    created_at: str | None = field(default=None, compare=False)
    # tensor name -> expert id -> chunks of its delta store to read (a prefix)
    entry_reads: dict[str, dict[str, int]] = field(default_factory=dict)
    # tensor name -> expert id -> sketch stages of its delta store to read
    sketch_reads: dict[str, dict[str, int]] = field(default_factory=dict)
    # expert id -> digest of the delta store the entry and sketch reads were planned on
    stores: dict[str, str] = field(default_factory=dict)
    # output blocks copied from a previous snapshot (``merge --from``); None: everything is merged
    reuse: PlanReuse | None = None
    # the output's weight files: Hugging Face shards of at most this many tensor bytes (a larger tensor
    # alone in its shard); None: the base's files, mirrored (storage/sharding.py)
    out_shard_bytes: int | None = None
    # the Jinja chat template the output's tokenizer_config.json gets; None: the base's file as it is
    chat_template: str | None = None
    # whether the output gets the base's tokenizer files (False: mergekit-yaml's --no-copy-tokenizer)
    copy_tokenizer: bool = True
    # a passthrough's output, tensor by tensor from its sources (spec/copy_map.py; the base gives the config
    # and tokenizer, and ``reads`` is empty); None: a merge, whose output has the base's tensors
    copies: CopyMap | None = None
    # the base's side files, name -> sha256, which the output gets (its tokenizer's unless copy_tokenizer is False;
    # ModelRecord.side_files); None: a base an earlier release registered, none recorded
    side_files: dict[str, str] | None = None
    # the seconds predicted on the machine that planned it; None: not predicted (not hashed, not compared)
    seconds: Prediction | None = field(default=None, compare=False)
    # the first-order deviation from the full-read merge (planner/bound.py); None: planned before it existed
    # (not hashed, not compared: a plan's identity is what it reads)
    estimate: float | None = field(default=None, compare=False)

    # -- identity -------------------------------------------------------
    @cached_property
    def digest(self) -> str:
        """π: sha256 of the canonical JSON of the result-deciding fields (computed once)."""
        hashed = {k: v for k, v in self._fields_json().items() if k not in _NOT_HASHED}
        return digest(hashed)

    @property
    def operator(self) -> str:
        return self.merge.operator

    def reads_of(self, tensor: str, expert_id: str) -> tuple[int, ...]:
        return self.reads.get(tensor, {}).get(expert_id, ())

    def keeps_base(self, tensor: str, num_layers: int) -> bool:
        """Whether the operator, with ``tensor``'s parameters, gives the base where every Δ is 0
        (``OperatorDef.keeps_base``): only then is a block no expert is read for the base's."""
        definition = get_operator(self.operator)
        return definition.keeps_base(definition.resolve(self.merge, tensor, num_layers))

    def merge_mode(self, tensor: str, mergeable: bool, same_dtype: bool, keeps_base: bool) -> str:
        """How a tensor's output is made: ``"copy"`` (the base's bytes, block by block), ``"blocks"``
        (merged block by block; a block no expert is read for is the base's where ``same_dtype`` and
        ``keeps_base``, ``Plan.keeps_base``) or ``"whole"`` (read and merged whole: tensor-level operators,
        delta-store reads, dtype conversions of unmerged tensors). The engine and the provenance of output
        blocks both follow it."""
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
        """How many chunks of ``expert_id``'s delta store the plan reads for ``tensor``."""
        return self.entry_reads.get(tensor, {}).get(expert_id, 0)

    def stages_of(self, tensor: str, expert_id: str) -> int:
        """How many sketch stages of ``expert_id``'s delta store the plan reads for ``tensor``."""
        return self.sketch_reads.get(tensor, {}).get(expert_id, 0)

    # -- serialisation --------------------------------------------------
    def _fields_json(self) -> dict:
        data = {
            "schema": self.schema,
            "base": self.base.to_json(),
            "experts": [e.to_json() for e in self.experts],
            "merge": self.merge.to_dict(),
            "block_bytes": self.block_bytes,
            "budget": {"text": self.budget_text, "bytes": self.budget_bytes},
            "policy": self.policy,
            "out_dtype": self.out_dtype,
            "reads": {
                tensor: {expert: compress_indices(idx) for expert, idx in sorted(per.items()) if idx}
                for tensor, per in sorted(self.reads.items())
                if any(per.values())
            },
            "tensor_level": sorted(self.tensor_level),
            "cost": self.cost.to_json(),
            "error_bound": {"value": self.error_bound, "kind": self.error_bound_kind, "share": self.error_share},
            "notes": list(self.notes),
            "created_at": self.created_at,
        }
        entry_reads = {t: dict(sorted(per.items())) for t, per in sorted(self.entry_reads.items()) if per}
        sketch_reads = {t: dict(sorted(per.items())) for t, per in sorted(self.sketch_reads.items()) if per}
        if entry_reads or sketch_reads:
            data["entries"] = {
                "stores": dict(sorted(self.stores.items())),
                "reads": entry_reads,
                "sketch": sketch_reads,
            }
        if self.reuse is not None:
            data["reuse"] = self.reuse.to_json()
        if self.out_shard_bytes is not None:
            data["out_shard_bytes"] = self.out_shard_bytes
        if self.chat_template is not None:
            data["chat_template"] = self.chat_template
        if not self.copy_tokenizer:
            data["copy_tokenizer"] = False
        if self.copies is not None:
            data["copies"] = self.copies.to_json()
        if self.side_files is not None:
            data["side_files"] = dict(sorted(self.side_files.items()))
        if self.seconds is not None:
            data["seconds"] = self.seconds.to_json()
        if self.estimate is not None:
            data["estimate"] = self.estimate
        return data

    def to_json(self) -> dict:
        data = self._fields_json()
        data["digest"] = self.digest
        return data

    def to_json_str(self) -> str:
        return canonical_json(self.to_json()).decode("utf-8")

    @classmethod
    def from_json(cls, data: dict | str) -> Plan:
        """Parse a stored plan strictly; PlanError naming the first problem."""
        try:
            parsed = json.loads(data) if isinstance(data, str) else data
            plan = _parse(parsed)
            computed = plan.digest  # NaN/Infinity in the settings fail here, not later
        except (ValueError, ConfigError) as exc:  # json.JSONDecodeError is a ValueError
            raise PlanError(f"not a valid MergePipe plan ({exc}); make a new one with `mergepipe plan`") from None
        stored = parsed.get("digest")
        if stored is not None and stored != computed:
            raise PlanError(
                f"plan digest mismatch: stored {str(stored)[:12]}, recomputed {plan.digest[:12]}; the plan was edited"
            )
        return plan


def _parse(data: Any) -> Plan:
    d = fields.keys(data, _PLAN_FIELDS, "plan", optional=_OPTIONAL_FIELDS)
    schema = fields.integer(d["schema"], "plan schema")
    if schema != PLAN_SCHEMA:
        raise ValueError(f"plan schema {schema} is not supported (this mergepipe reads schema {PLAN_SCHEMA})")
    budget = fields.keys(d["budget"], ("text", "bytes"), "plan budget")
    bound = fields.keys(d["error_bound"], ("value", "kind", "share"), "plan error_bound")
    reads = {}
    for tensor, per in fields.mapping(d["reads"], "plan reads").items():
        per = fields.mapping(per, f"plan reads of {tensor}")
        reads[tensor] = {
            expert: tuple(expand_ranges(fields.array(r, f"reads of {tensor}"))) for expert, r in per.items()
        }
    stores, entry_reads, sketch_reads = _parse_entries(d.get("entries"))
    return Plan(
        schema=schema,
        base=ModelRef.from_json(d["base"], "plan base"),
        experts=tuple(ModelRef.from_json(e, "plan expert") for e in fields.array(d["experts"], "plan experts")),
        merge=MergeSpec.from_dict(d["merge"]),
        block_bytes=fields.integer(d["block_bytes"], "plan block_bytes", minimum=1),
        budget_text=fields.text(budget["text"], "plan budget text"),
        budget_bytes=fields.integer(budget["bytes"], "plan budget bytes"),
        policy=fields.text(d["policy"], "plan policy"),
        out_dtype=fields.optional_text(d["out_dtype"], "plan out_dtype"),
        reads=reads,
        tensor_level=tuple(fields.text(t, "tensor name") for t in fields.array(d["tensor_level"], "plan tensor_level")),
        cost=PlanCost.from_json(d["cost"]),
        error_bound=fields.number(bound["value"], "plan error bound"),
        error_bound_kind=fields.text(bound["kind"], "plan error bound kind"),
        error_share=fields.number(bound["share"], "plan error share"),
        notes=tuple(fields.text(n, "plan note") for n in fields.array(d["notes"], "plan notes")),
        created_at=fields.optional_text(d["created_at"], "plan created_at"),
        entry_reads=entry_reads,
        sketch_reads=sketch_reads,
        stores=stores,
        reuse=None if d.get("reuse") is None else PlanReuse.from_json(d["reuse"]),
        # present means set: a stored null is malformed, not "unset" (the digest would not cover it)
        out_shard_bytes=(
            fields.integer(d["out_shard_bytes"], "plan out_shard_bytes", minimum=1) if "out_shard_bytes" in d else None
        ),
        chat_template=fields.text(d["chat_template"], "plan chat_template") if "chat_template" in d else None,
        copy_tokenizer=_copy_tokenizer(d),
        copies=CopyMap.from_json(d["copies"]) if "copies" in d else None,
        side_files=(
            {
                n: fields.text(h, f"sha256 of side file {n}")
                for n, h in fields.mapping(d["side_files"], "plan side_files").items()
            }
            if "side_files" in d
            else None
        ),
        seconds=Prediction.from_json(d["seconds"]) if "seconds" in d else None,
        estimate=fields.number(d["estimate"], "plan estimate") if "estimate" in d else None,
    )


def _copy_tokenizer(d: dict) -> bool:
    """A plan's ``copy_tokenizer``: absent is True; present, it must be false (true is never written, so
    that the digest of every plan copying the tokenizer is what it was before the field existed)."""
    if "copy_tokenizer" not in d:
        return True
    if d["copy_tokenizer"] is not False:
        raise ValueError(f"plan copy_tokenizer must be false when present, got {d['copy_tokenizer']!r}")
    return False


def _parse_entries(data: Any) -> tuple[dict[str, str], dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """``(stores, entry_reads, sketch_reads)`` of a plan's optional ``entries`` field."""
    if data is None:
        return {}, {}, {}
    d = fields.keys(data, ("stores", "reads", "sketch"), "plan entries")
    stores = {e: fields.text(v, f"store digest of {e}") for e, v in fields.mapping(d["stores"], "plan stores").items()}
    parsed = []
    for key, what in (("reads", "chunks"), ("sketch", "sketch stages")):
        reads = {}
        for tensor, per in fields.mapping(d[key], f"plan entries.{key}").items():
            per = fields.mapping(per, f"plan entries.{key} of {tensor}")
            reads[tensor] = {e: fields.integer(n, f"{what} of {tensor} from {e}", minimum=1) for e, n in per.items()}
            missing = set(reads[tensor]) - set(stores)
            if missing:
                raise ValueError(f"entries.{key} of {tensor} name {sorted(missing)}, which have no store in the plan")
        parsed.append(reads)
    return stores, parsed[0], parsed[1]
