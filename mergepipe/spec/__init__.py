"""What a merge is: the bottom layer that the planner and the engine share.

Pure Python (no torch, no I/O): the parameter catalogue and the setting
language, each operator's definition (parameters, streaming, error bound),
the ``MergeSpec`` a user writes, the trim-threshold contract, and the
``Plan`` with its canonical JSON and strict reader.
"""

from mergepipe.spec.merge_spec import ExpertSpec, MergeSpec
from mergepipe.spec.operator import OperatorDef, TensorParams
from mergepipe.spec.operators import OPERATORS, canonical_name, get_operator, validate_spec
from mergepipe.spec.plan import ModelRef, Plan, PlanCost
from mergepipe.spec.thresholds import DENSITY_GRID, TrimThreshold

__all__ = [
    "DENSITY_GRID",
    "OPERATORS",
    "ExpertSpec",
    "MergeSpec",
    "ModelRef",
    "OperatorDef",
    "Plan",
    "PlanCost",
    "TensorParams",
    "TrimThreshold",
    "canonical_name",
    "get_operator",
    "validate_spec",
]
