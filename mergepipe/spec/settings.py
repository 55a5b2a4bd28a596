"""The language of parameter settings: scalars, layer gradients, filter rules.

Any operator parameter may be written as

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
layer takes ``t = 1`` (the last). What a resolved value may be (type,
range) is the parameter's business: see ``params.py``.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from mergepipe.errors import ConfigError

Scalar = bool | int | float | str


#: Parameter names of tensors inside transformer layers: "model.layers.12.",
#: "transformer.h.3.", "gpt_neox.layers.0.", "encoder.layer.5.", "blocks.7.".
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")


def layer_index(tensor_name: str) -> int | None:
    """The transformer layer a tensor belongs to, or None (embeddings, norms, head)."""
    match = _LAYER_RE.search(tensor_name)
    return int(match.group(1)) if match else None


def layer_parts(tensor_name: str) -> tuple[str, int, str] | None:
    """``(prefix, layer, rest)`` of a tensor inside a layer (``"model.layers."``, 3, ``".mlp.up_proj.weight"``),
    so that ``f"{prefix}{i}{rest}"`` names the same tensor of layer ``i``; None outside the layers."""
    match = _LAYER_RE.search(tensor_name)
    if match is None:
        return None
    return tensor_name[: match.start(1)], int(match.group(1)), tensor_name[match.end(1) :]


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
        raise ConfigError(f"a parameter rule must look like {{filter: SUBSTRING, value: X}}, got {dict(rule)!r}")
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


VERSIONED = re.compile(r"^(?P<name>.+)@(?P<version>[0-9]+)$")


def family(model_id: str) -> str:
    """The family (name) of a stored model id: ``math@3`` -> ``math``, ``math`` -> ``math``.

    Random operators key an expert's stream by its family, not its version:
    a retrained expert keeps the drop pattern of its unchanged tensors, so an
    incremental merge can reuse their output blocks."""
    match = VERSIONED.match(model_id)
    return match["name"] if match else model_id
