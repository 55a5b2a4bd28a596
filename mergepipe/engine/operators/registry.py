"""The one list of merge operators, and lookup by (case-insensitive) name."""

from __future__ import annotations

from typing import Sequence

from mergepipe.engine.operators.base import Operator
from mergepipe.engine.operators.breadcrumbs import BREADCRUMBS, BREADCRUMBS_TIES
from mergepipe.engine.operators.dare import DARE_LINEAR, DARE_TIES
from mergepipe.engine.operators.della import DELLA, DELLA_LINEAR
from mergepipe.engine.operators.linear import AVG, LINEAR
from mergepipe.engine.operators.model_stock import MODEL_STOCK
from mergepipe.engine.operators.slerp import SLERP
from mergepipe.engine.operators.task_arithmetic import TASK_ARITHMETIC
from mergepipe.engine.operators.ties import TIES
from mergepipe.engine.params import MergeSpec
from mergepipe.errors import ConfigError

OPERATORS: dict[str, Operator] = {
    "avg": AVG,
    "linear": LINEAR,
    "task_arithmetic": TASK_ARITHMETIC,
    "ties": TIES,
    "dare_linear": DARE_LINEAR,
    "dare_ties": DARE_TIES,
    "breadcrumbs": BREADCRUMBS,
    "breadcrumbs_ties": BREADCRUMBS_TIES,
    "della": DELLA,
    "della_linear": DELLA_LINEAR,
    "slerp": SLERP,
    "model_stock": MODEL_STOCK,
}

#: Other spellings people use (the seed vocabulary: AVG, TIES, DARE).
ALIASES: dict[str, str] = {"dare": "dare_linear"}


def canonical_name(name: str) -> str:
    """``"DARE-TIES"`` -> ``"dare_ties"``; ConfigError for an unknown name."""
    key = str(name).strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in OPERATORS:
        known = ", ".join([*OPERATORS, *ALIASES])
        raise ConfigError(f"unknown merge operator {name!r}; known operators: {known}")
    return key


def get_operator(name: str) -> Operator:
    return OPERATORS[canonical_name(name)]


def validate_spec(spec: MergeSpec, tensor_names: Sequence[str] = (), num_layers: int = 0) -> Operator:
    """Check a spec before any I/O; returns its operator."""
    op = get_operator(spec.operator)
    op.validate(spec, tensor_names, num_layers)
    return op
