"""Merge parameters: the spec a user writes, and its value for one tensor.

A ``MergeSpec`` names an operator, the experts with their own parameters,
global parameters and a seed. Any parameter may be written as

* a scalar: ``0.5``, ``true``, ``"l1"``;
* a list of scalars, a *gradient* over layers: layer ``i`` of ``L`` sits at
  ``t = i / (L - 1)`` and takes the linear interpolation between the two
  nearest list entries (entries are spread evenly over [0, 1]); booleans and
  strings are picked, not interpolated (``values[int(t * (len - 1))]``);
* a list of rules ``{filter: SUBSTRING, value: X}``: the first rule whose
  filter is a substring of the tensor name wins; a rule without filter (or
  with ``"*"``) matches every tensor; ``X`` may itself be a gradient.

These are mergekit's rules (``mergekit/config.py:evaluate_setting`` and
``plan.py``), kept so that mergekit configs mean the same here, including
the two corners: a tensor outside the layers (embeddings, final norm,
lm_head) takes ``t = 0`` (the first gradient value), and a model with one
layer takes ``t = 1`` (the last).

Per-expert parameters (``weight``, ``density``, ``gamma``, ``epsilon``) may
also be given globally, as the default for every expert; global-only ones
(``lambda``, ``normalize``, ``rescale``, ``t``) may not be given per expert.
What is not given anywhere takes the operator's default (``DEFAULTS`` below,
overridden per operator, e.g. ``normalize``; see ``Operator.defaults``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from mergepipe.errors import ConfigError

Scalar = bool | int | float | str


@dataclass(frozen=True)
class ParamDef:
    """One parameter: where it may be set, its kind, default and meaning."""

    name: str
    scope: str  # "expert" or "global"
    kind: str  # "real", "bool" or "choice"
    default: Any
    doc: str
    choices: tuple[str, ...] = ()


#: Every parameter an operator may take. Defaults follow mergekit 0.1.5
#: except where noted; operators override some (``normalize`` differs per
#: method in mergekit too).
PARAMS: dict[str, ParamDef] = {
    p.name: p
    for p in (
        # mergekit requires a weight; 1.0 (plain sum / equal average) is the
        # value nearly every config writes.
        ParamDef("weight", "expert", "real", 1.0, "multiplier of the expert's delta"),
        # mergekit's default: 1.0 keeps every entry (no sparsification).
        ParamDef("density", "expert", "real", 1.0, "fraction of delta entries kept, in (0, 1]"),
        ParamDef("gamma", "expert", "real", 0.01, "breadcrumbs: fraction of largest entries dropped, in [0, 1)"),
        ParamDef("epsilon", "expert", "real", 0.15, "della: spread of keep probabilities, density +- epsilon in (0, 1)"),
        ParamDef("lambda", "global", "real", 1.0, "multiplier of the merged delta"),
        ParamDef("normalize", "global", "bool", True, "divide by the sum of (agreeing) weights"),
        # The DARE/DELLA papers rescale by 1/keep-probability; mergekit's
        # ``rescale: true`` matches the L1 norm instead (also supported).
        ParamDef(
            "rescale", "global", "choice", "inverse",
            "how DARE/DELLA rescale survivors: inverse (1/p), l1 (match L1 norm) or none",
            choices=("inverse", "l1", "none"),
        ),
        # mergekit requires t; 0.5 is the midpoint.
        ParamDef("t", "global", "real", 0.5, "slerp: interpolation factor, 0 = base, 1 = expert, in [0, 1]"),
    )
}

#: Parameter names of tensors inside transformer layers: "model.layers.12.",
#: "transformer.h.3.", "gpt_neox.layers.0.", "encoder.layer.5.", "blocks.7.".
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")


def layer_index(tensor_name: str) -> int | None:
    """The transformer layer a tensor belongs to, or None (embeddings, norms, head)."""
    match = _LAYER_RE.search(tensor_name)
    return int(match.group(1)) if match else None


def count_layers(tensor_names: Sequence[str]) -> int:
    """Number of layers implied by tensor names: highest layer index + 1."""
    indices = [i for i in (layer_index(n) for n in tensor_names) if i is not None]
    return max(indices) + 1 if indices else 0


def gradient_position(layer: int | None, num_layers: int) -> float:
    """Where a tensor sits on a gradient: 0 outside layers, 1 for a 1-layer model."""
    if layer is None:
        return 0.0
    if not 0 <= layer < max(num_layers, 1):
        raise ValueError(f"layer index {layer} out of range for {num_layers} layers")
    return layer / (num_layers - 1) if num_layers > 1 else 1.0


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rules(value: Any) -> list[Mapping[str, Any]] | None:
    """The rule list of a setting, or None if it is a scalar or gradient."""
    if isinstance(value, Mapping):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):
        return list(value)
    return None


def _check_rule(rule: Mapping[str, Any]) -> None:
    extra = set(rule) - {"filter", "value"}
    if extra or "value" not in rule:
        raise ConfigError(
            f"a parameter rule must look like {{filter: SUBSTRING, value: X}}, got {dict(rule)!r}"
        )
    if rule.get("filter") is not None and not isinstance(rule["filter"], str):
        raise ConfigError(f"a rule's filter must be a string, got {rule['filter']!r}")


def setting_leaves(value: Any) -> list[Scalar]:
    """Every scalar a setting can evaluate to the ends of (gradient entries,
    rule values), after checking its structure. Interpolated values lie
    between neighbouring entries, so range checks on leaves cover them."""
    rules = _rules(value)
    if rules is not None:
        leaves: list[Scalar] = []
        for rule in rules:
            _check_rule(rule)
            if _rules(rule["value"]) is not None:
                raise ConfigError("a rule's value must be a scalar or a gradient, not more rules")
            leaves.extend(setting_leaves(rule["value"]))
        return leaves
    if _is_scalar(value):
        return [value]
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError("a parameter gradient must not be empty; give a number or a list of numbers")
        if not all(_is_scalar(v) for v in value):
            raise ConfigError(
                f"a parameter list must be all scalars (a gradient) or all {{filter, value}} rules, got {list(value)!r}"
            )
        kinds = {"number" if _is_number(v) else type(v).__name__ for v in value}
        if len(kinds) > 1:
            raise ConfigError(f"a gradient must not mix types, got {list(value)!r}")
        return list(value)
    raise ConfigError(f"unsupported parameter value {value!r}: use a number, a list, or {{filter, value}} rules")


def resolve(value: Any, tensor_name: str, layer_index: int | None, num_layers: int) -> Scalar | None:
    """The value of one parameter setting for one tensor.

    Returns None when a rule list has no rule matching ``tensor_name`` (the
    caller falls back to the next source, then to the default).
    """
    setting_leaves(value)  # structure check: malformed settings fail the same everywhere
    rules = _rules(value)
    if rules is not None:
        for rule in rules:
            pattern = rule.get("filter")
            if pattern is None or pattern == "*" or pattern in tensor_name:
                return resolve(rule["value"], tensor_name, layer_index, num_layers)
        return None
    if _is_scalar(value):
        return value
    values = list(value)
    t = gradient_position(layer_index, num_layers)
    if not all(_is_number(v) for v in values):
        return values[int(t * (len(values) - 1))]
    scaled = t * (len(values) - 1)
    i0 = int(scaled)
    i1 = min(len(values) - 1, i0 + 1)
    frac = scaled - i0
    return (1 - frac) * values[i0] + frac * values[i1]


def coerce(name: str, value: Scalar) -> Any:
    """Check one resolved or leaf value's type and generic range."""
    pdef = PARAMS[name]
    if pdef.kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return value
    if pdef.kind == "choice":
        if isinstance(value, bool):
            hint = " (mergekit's rescale: true means 'l1')" if name == "rescale" else ""
            raise ConfigError(f"{name} must be one of {', '.join(pdef.choices)}, got {value!r}{hint}")
        if not isinstance(value, str) or value.lower() not in pdef.choices:
            raise ConfigError(f"{name} must be one of {', '.join(pdef.choices)}, got {value!r}")
        return value.lower()
    if not _is_number(value) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    value = float(value)
    ranges = {
        "density": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
        "gamma": (lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
        "epsilon": (lambda v: 0.0 <= v < 0.5, "in [0, 0.5)"),
        "t": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    }
    if name in ranges and not ranges[name][0](value):
        raise ConfigError(f"{name} must be {ranges[name][1]}, got {value!r}")
    return value


@dataclass(frozen=True)
class ExpertSpec:
    """One expert of a merge and its own parameter settings."""

    expert_id: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"expert_id": self.expert_id, "params": dict(self.params)}


@dataclass(frozen=True)
class MergeSpec:
    """What to merge and how: operator, experts, global parameters, seed."""

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

    def scalar_weight(self, expert_id: str) -> float:
        """The expert's weight as one number: its own, else the global one,
        else 1.0; a weight that varies by tensor (gradient, filter rules)
        also counts as 1.0 here (manifests and explain record it in full)."""
        own = next(e.params for e in self.experts if e.expert_id == expert_id)
        value = own.get("weight", self.params.get("weight", 1.0))
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
            if not isinstance(e, Mapping) or not isinstance(e.get("expert_id"), str) or set(e) - {"expert_id", "params"}:
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


def resolve_for_tensor(
    spec: MergeSpec, tensor_name: str, layer_index: int | None, num_layers: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every parameter of ``spec``'s operator for one tensor, defaults filled.

    Returns ``(per_expert, global)``: one dict per expert in spec order with
    the operator's per-expert parameters, and one dict of its global ones.
    Ranges that involve one parameter are checked here; combinations (della
    epsilon vs density, weights summing to 0) by ``Operator.check_tensor``.
    """
    # Imported here: operators import this module for the settings helpers.
    from mergepipe.engine.operators.registry import get_operator

    op = get_operator(spec.operator)

    def value_of(name: str, sources: Sequence[Mapping[str, Any]]) -> Any:
        for source in sources:
            if name in source:
                resolved = resolve(source[name], tensor_name, layer_index, num_layers)
                if resolved is not None:
                    return coerce(name, resolved)
        return op.defaults[name]

    per_expert = [
        {name: value_of(name, (e.params, spec.params)) for name in op.expert_params}
        for e in spec.experts
    ]
    global_ = {name: value_of(name, (spec.params,)) for name in op.global_params}
    return per_expert, global_
