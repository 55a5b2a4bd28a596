"""What to merge and how: the operator, the experts with their own parameter
settings, global settings and a seed, as the user wrote them.

Settings are kept as written (scalars, gradients, filter rules; see
``settings.py``) because that is what the plan records and hashes; the
operator's definition resolves them to typed values per tensor
(``OperatorDef.resolve``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from mergepipe.errors import ConfigError


@dataclass(frozen=True)
class ExpertSpec:
    """One expert of a merge and its own parameter settings."""

    expert_id: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"expert_id": self.expert_id, "params": dict(self.params)}


@dataclass(frozen=True)
class MergeSpec:
    """Operator name, experts (in the order given), global settings, seed."""

    operator: str
    experts: tuple[ExpertSpec, ...]
    params: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        experts = tuple(
            e if isinstance(e, ExpertSpec) else ExpertSpec(e[0], dict(e[1]) if len(e) > 1 else {})
            for e in self.experts
        )
        object.__setattr__(self, "experts", experts)

    @property
    def expert_ids(self) -> tuple[str, ...]:
        return tuple(e.expert_id for e in self.experts)

    def expert(self, expert_id: str) -> ExpertSpec:
        for e in self.experts:
            if e.expert_id == expert_id:
                return e
        raise KeyError(f"expert {expert_id!r} is not part of this merge")

    def scalar_weight(self, expert_id: str) -> float:
        """The expert's weight as one number: its own, else the global one,
        else 1.0; a weight that varies by tensor (gradient, filter rules)
        also counts as 1.0 here (manifests and explain record it in full)."""
        value = self.expert(expert_id).params.get("weight", self.params.get("weight", 1.0))
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 1.0

    def to_dict(self) -> dict:
        return {
            "operator": self.operator,
            "experts": [e.to_dict() for e in self.experts],
            "params": dict(self.params),
            "seed": self.seed,
        }

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): stable bytes for hashing."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MergeSpec":
        """A spec from its JSON object; ConfigError naming what is malformed."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a merge spec must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - {"operator", "experts", "params", "seed"}
        if unknown:
            raise ConfigError(f"unknown merge spec field(s): {', '.join(sorted(unknown))}")
        operator = data.get("operator")
        if not isinstance(operator, str) or not operator:
            raise ConfigError("a merge spec needs an operator name, e.g. \"ties\"")
        experts_raw = data.get("experts")
        if not isinstance(experts_raw, list):
            raise ConfigError("a merge spec needs a list of experts")
        experts = []
        for e in experts_raw:
            well_formed = isinstance(e, Mapping) and isinstance(e.get("expert_id"), str)
            if not well_formed or set(e) - {"expert_id", "params"}:
                raise ConfigError(f"an expert must look like {{expert_id: ID, params: {{...}}}}, got {e!r}")
            params = e.get("params", {})
            if not isinstance(params, Mapping):
                raise ConfigError(f"params of expert {e['expert_id']!r} must be an object")
            experts.append(ExpertSpec(e["expert_id"], dict(params)))
        params = data.get("params", {})
        if not isinstance(params, Mapping):
            raise ConfigError("global params must be an object")
        seed = data.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
        return cls(operator, tuple(experts), dict(params), seed)

    @classmethod
    def from_json(cls, text: str) -> "MergeSpec":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"merge spec is not valid JSON: {exc}") from None
        return cls.from_dict(data)
