"""The Plan: an executable, serialisable decision of what a merge reads.

A plan names its inputs by id and fingerprint, the operator with its
parameters and seed, the exact set of (expert, block) reads, the estimated
costs and the error bound. Its digest π is the sha256 of the canonical JSON of
the fields that decide the result; ``notes`` (explanations for people) and
``created_at`` stay outside the digest so that re-planning the same merge gives
the same π.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from mergepipe.errors import PlanError
from mergepipe.manifest.canonical import canonical_json, digest
from mergepipe.manifest.parts import ModelRef
from mergepipe.manifest.ranges import compress_indices, expand_ranges

PLAN_SCHEMA = 1

#: Fields of ``Plan.to_json()`` that do not decide the result.
_NOT_HASHED = ("digest", "notes", "created_at")


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
    def from_json(cls, data: dict) -> "PlanCost":
        return cls(
            base_bytes=int(data["base_bytes"]),
            expert_bytes=int(data["expert_bytes"]),
            output_bytes=int(data["output_bytes"]),
            full_expert_bytes=int(data["full_expert_bytes"]),
            expert_bytes_by_model={k: int(v) for k, v in data["expert_bytes_by_model"].items()},
        )


@dataclass(frozen=True)
class Plan:
    """What one merge will read, what it costs, and how far it may be from
    the full-read merge."""

    base: ModelRef
    experts: tuple[ModelRef, ...]
    merge: dict[str, Any]
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
    schema: int = PLAN_SCHEMA
    notes: tuple[str, ...] = ()
    created_at: str | None = field(default=None, compare=False)

    # -- identity -------------------------------------------------------
    @property
    def digest(self) -> str:
        """π: sha256 of the canonical JSON of the result-deciding fields."""
        hashed = {k: v for k, v in self._fields_json().items() if k not in _NOT_HASHED}
        return digest(hashed)

    @property
    def plan_id(self) -> str:
        return self.digest

    @property
    def operator(self) -> str:
        return str(self.merge["operator"])

    @property
    def seed(self) -> int:
        return int(self.merge.get("seed", 0))

    def reads_of(self, tensor: str, expert_id: str) -> tuple[int, ...]:
        return self.reads.get(tensor, {}).get(expert_id, ())

    def with_notes(self, *notes: str) -> "Plan":
        return replace(self, notes=self.notes + tuple(notes))

    # -- serialisation --------------------------------------------------
    def _fields_json(self) -> dict:
        return {
            "schema": self.schema,
            "base": self.base.to_json(),
            "experts": [e.to_json() for e in self.experts],
            "merge": self.merge,
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
            "error_bound": {"value": self.error_bound, "kind": self.error_bound_kind},
            "notes": list(self.notes),
            "created_at": self.created_at,
        }

    def to_json(self) -> dict:
        data = self._fields_json()
        data["digest"] = self.digest
        return data

    def to_json_str(self) -> str:
        return canonical_json(self.to_json()).decode("utf-8")

    @classmethod
    def from_json(cls, data: dict | str) -> "Plan":
        if isinstance(data, str):
            data = json.loads(data)
        plan = cls(
            schema=int(data["schema"]),
            base=ModelRef.from_json(data["base"]),
            experts=tuple(ModelRef.from_json(e) for e in data["experts"]),
            merge=data["merge"],
            block_bytes=int(data["block_bytes"]),
            budget_text=data["budget"]["text"],
            budget_bytes=int(data["budget"]["bytes"]),
            policy=data["policy"],
            out_dtype=data.get("out_dtype"),
            reads={
                tensor: {expert: tuple(expand_ranges(r)) for expert, r in per.items()}
                for tensor, per in data["reads"].items()
            },
            tensor_level=tuple(data["tensor_level"]),
            cost=PlanCost.from_json(data["cost"]),
            error_bound=float(data["error_bound"]["value"]),
            error_bound_kind=data["error_bound"]["kind"],
            notes=tuple(data.get("notes", ())),
            created_at=data.get("created_at"),
        )
        stored = data.get("digest")
        if stored is not None and stored != plan.digest:
            raise PlanError(f"plan digest mismatch: stored {stored[:12]}, recomputed {plan.digest[:12]}; the plan was edited")
        return plan
