"""The merge methods: one module per method (or family), each registered by ``@register`` (``base.py``);
``OPERATORS`` holds every one by name. Importing this package imports every module in it, torch not."""

from __future__ import annotations

import pkgutil
from importlib import import_module
from typing import Sequence

from mergepipe.errors import ConfigError
from mergepipe.spec.operators.base import (
    DENSITY_GRID,
    REGISTERED,
    BlockContext,
    ExpertSpec,
    MergeSpec,
    OperatorDef,
    ParamDef,
    TrimThreshold,
    find_threshold,
    kept_count,
)

for _module in pkgutil.iter_modules(__path__):
    import_module(f"{__name__}.{_module.name}")

#: Every method by name, sorted.
OPERATORS: dict[str, OperatorDef] = dict(sorted(REGISTERED.items()))
#: Other spellings people use.
ALIASES: dict[str, str] = {"dare": "dare_linear"}
#: The parameters with a flag of their own (``--density``), in the order the methods declare them.
FLAGS: tuple[ParamDef, ...] = tuple(
    dict.fromkeys(
        d
        for op in OPERATORS.values()
        for d in (*op.expert_params.definitions(), *op.global_params.definitions())
        if d.flag
    )
)


def canonical_name(name: str) -> str:
    """``"DARE-TIES"`` -> ``"dare_ties"``; ConfigError for an unknown name."""
    key = str(name).strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in OPERATORS:
        raise ConfigError(f"unknown merge operator {name!r}; known operators: {', '.join([*OPERATORS, *ALIASES])}")
    return key


def get_operator(name: str) -> OperatorDef:
    """The definition of operator ``name`` (any spelling ``canonical_name`` accepts)."""
    return OPERATORS[canonical_name(name)]


def validate_spec(spec: MergeSpec, tensor_names: Sequence[str] = (), num_layers: int = 0) -> OperatorDef:
    """Check a spec before any I/O; returns its operator's definition."""
    definition = get_operator(spec.operator)
    definition.validate(spec, tensor_names, num_layers)
    return definition


__all__ = [
    "ALIASES",
    "DENSITY_GRID",
    "FLAGS",
    "OPERATORS",
    "BlockContext",
    "ExpertSpec",
    "MergeSpec",
    "OperatorDef",
    "ParamDef",
    "TrimThreshold",
    "canonical_name",
    "find_threshold",
    "get_operator",
    "kept_count",
    "validate_spec",
]
