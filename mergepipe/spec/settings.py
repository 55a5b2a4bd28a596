"""The language of parameter settings (mergekit's): scalars, layer gradients (spread evenly over the layers,
numbers interpolated), ``{filter, value}`` rules (the first whose filter is in the name wins); a tensor's
layer; a model id's family and version."""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from mergepipe.errors import ConfigError

Scalar = bool | int | float | str

#: Tensors inside transformer layers: "model.layers.12.", "transformer.h.3.", "encoder.layer.5.", "blocks.7.".
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")
#: A stored id of a version after the first: ``name@N``.
VERSIONED = re.compile(r"^(?P<name>.+)@(?P<version>[0-9]+)$")


def layer_index(tensor_name: str) -> int | None:
    """The transformer layer a tensor belongs to, or None (embeddings, norms, head)."""
    match = _LAYER_RE.search(tensor_name)
    return int(match.group(1)) if match else None


def layer_parts(tensor_name: str) -> tuple[str, int, str] | None:
    """``(prefix, layer, rest)`` such that ``f"{prefix}{i}{rest}"`` names the same tensor of layer ``i``."""
    match = _LAYER_RE.search(tensor_name)
    if match is None:
        return None
    return tensor_name[: match.start(1)], int(match.group(1)), tensor_name[match.end(1) :]


def count_layers(tensor_names: Sequence[str]) -> int:
    indices = [i for i in (layer_index(n) for n in tensor_names) if i is not None]
    return max(indices) + 1 if indices else 0


def gradient_position(layer: int | None, num_layers: int) -> float:
    """Where a tensor sits on a gradient: 0 outside the layers (mergekit's), 1 in a 1-layer model."""
    if layer is None:
        return 0.0
    if not 0 <= layer < max(num_layers, 1):
        raise ValueError(f"layer index {layer} out of range for {num_layers} layers")
    return layer / (num_layers - 1) if num_layers > 1 else 1.0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def rules(value: Any) -> list[Mapping[str, Any]] | None:
    """The ``{filter, value}`` rules of a setting, or None for a scalar or a gradient."""
    if isinstance(value, Mapping):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):
        return list(value)
    return None


def setting_leaves(value: Any) -> list[Scalar]:
    """Every scalar a setting can take or interpolate between, after checking its structure (so a range
    check of the leaves covers every value)."""
    found = rules(value)
    if found is not None:
        leaves: list[Scalar] = []
        for rule in found:
            if set(rule) - {"filter", "value"} or "value" not in rule:
                raise ConfigError(
                    f"a parameter rule must look like {{filter: SUBSTRING, value: X}}, got {dict(rule)!r}"
                )
            if rule.get("filter") is not None and not isinstance(rule["filter"], str):
                raise ConfigError(f"a rule's filter must be a string, got {rule['filter']!r}")
            if rules(rule["value"]) is not None:
                raise ConfigError("a rule's value must be a scalar or a gradient, not more rules")
            leaves.extend(setting_leaves(rule["value"]))
        return leaves
    if isinstance(value, (bool, int, float, str)):
        return [value]
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError("a parameter gradient must not be empty; give a number or a list of numbers")
        if not all(isinstance(v, (bool, int, float, str)) for v in value):
            raise ConfigError(
                f"a parameter list must be all scalars (a gradient) or all {{filter, value}} rules, got {list(value)!r}"
            )
        if len({"number" if _is_number(v) else type(v).__name__ for v in value}) > 1:
            raise ConfigError(f"a gradient must not mix types, got {list(value)!r}")
        return list(value)
    raise ConfigError(f"unsupported parameter value {value!r}: use a number, a list, or {{filter, value}} rules")


def resolve(value: Any, tensor_name: str, layer_index: int | None, num_layers: int) -> Scalar | None:
    """The value of one setting for one tensor; None when no rule matches (the next source is tried)."""
    setting_leaves(value)  # malformed settings fail the same everywhere
    found = rules(value)
    if found is not None:
        for rule in found:
            pattern = rule.get("filter")
            if pattern is None or pattern == "*" or pattern in tensor_name:
                return resolve(rule["value"], tensor_name, layer_index, num_layers)
        return None
    if isinstance(value, (bool, int, float, str)):
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


def family(model_id: str) -> str:
    """The name of a stored id (``math@3`` -> ``math``), which keys an expert's random streams."""
    match = VERSIONED.match(model_id)
    return match["name"] if match else model_id


def pinned(model_id: str) -> str:
    """A reference to exactly this version: version 1 is stored as ``name``, which means the latest."""
    return model_id if VERSIONED.match(model_id) else f"{model_id}@1"
