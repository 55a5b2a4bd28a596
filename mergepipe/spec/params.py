"""Operator parameters, declared once: name, kind, scope, default, range, doc.

``PARAMS`` is the catalogue of every parameter any operator takes. An
operator declares which ones it takes as two small frozen dataclasses (one
for per-expert values, one for global values) whose fields are made with
``param(name)``: the field carries its ``ParamDef``, so validation, the
CLI's help text and the typed values the kernels read all come from the same
declaration.

Scopes:

* ``"expert"``: set per expert, or globally as every expert's default
  (``weight``, ``density``, ``gamma``, ``epsilon``);
* ``"global"``: set once for the merge (``lambda``, ``normalize``,
  ``rescale``, ``t``, ``filter_wise``).

Every value may also vary per tensor, written as a layer gradient or as
filter rules (``settings.py``); ranges are checked on every value a setting
can take.
"""

from __future__ import annotations

import keyword
import math
from dataclasses import MISSING, dataclass, field, fields, replace
from functools import cache
from typing import Any, Mapping

from mergepipe.errors import ConfigError

SCOPES = ("expert", "global")
KINDS = ("real", "int", "bool", "choice")
#: Where a ``param()`` field keeps its definition in the dataclass field's metadata.
_PARAM_KEY = "mergepipe.param"


@dataclass(frozen=True)
class ParamDef:
    """One parameter. A real value must lie in ``low .. high`` (each end open
    or closed as flagged, ``None`` for unbounded); a choice in ``choices``."""

    name: str
    kind: str
    scope: str
    default: Any
    doc: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()

    @property
    def attribute(self) -> str:
        """The Python attribute name: ``lambda`` is a keyword, so ``lambda_``."""
        return self.name + "_" if keyword.iskeyword(self.name) else self.name

    @property
    def range_text(self) -> str:
        """``in (0, 1]``, ``one of inverse, l1, none``, or '' when anything goes."""
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.low is None and self.high is None:
            return ""
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"

    def coerce(self, value: Any) -> Any:
        """``value`` checked against this parameter's kind and range (real numbers become floats, whole
        numbers ints)."""
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"{self.name} must be true or false, got {value!r}")
            return value
        if self.kind == "choice":
            mergekit_flag = self.name == "rescale" and isinstance(value, bool)
            hint = " (mergekit's rescale: true means 'l1')" if mergekit_flag else ""
            if isinstance(value, bool) or not isinstance(value, str) or value.lower() not in self.choices:
                raise ConfigError(f"{self.name} must be {self.range_text}, got {value!r}{hint}")
            return value.lower()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{self.name} must be a finite number, got {value!r}")
        number: float | int = float(value)
        if self.kind == "int":
            if not float(value).is_integer():
                raise ConfigError(f"{self.name} must be a whole number, got {value!r}")
            number = int(value)
        too_low = self.low is not None and (number <= self.low if self.low_open else number < self.low)
        too_high = self.high is not None and (number >= self.high if self.high_open else number > self.high)
        if too_low or too_high:
            raise ConfigError(f"{self.name} must be {self.range_text}, got {value!r}")
        return number

    def help(self) -> str:
        """One line for CLI help: the doc, the range and the default."""
        extra = f" ({self.range_text})" if self.range_text else ""
        return f"{self.doc}{extra}."


#: Every parameter an operator may take. Defaults follow mergekit 0.1.5
#: except where noted; an operator may override a default in its ``param()``.
PARAMS: dict[str, ParamDef] = {
    p.name: p
    for p in (
        # mergekit requires a weight; 1.0 (plain sum / equal average) is the
        # value nearly every config writes.
        ParamDef("weight", "real", "expert", 1.0, "Multiplier of the expert's delta"),
        # mergekit's default: 1.0 keeps every entry (no sparsification).
        ParamDef("density", "real", "expert", 1.0, "Fraction of delta entries kept",
                 low=0.0, high=1.0, low_open=True),
        ParamDef("gamma", "real", "expert", 0.01, "Breadcrumbs: fraction of the largest delta entries dropped",
                 low=0.0, high=1.0, high_open=True),
        ParamDef("epsilon", "real", "expert", 0.15, "DELLA: spread of keep probabilities, density +- epsilon",
                 low=0.0, high=0.5, high_open=True),
        ParamDef("lambda", "real", "global", 1.0, "Multiplier of the merged delta"),
        ParamDef("normalize", "bool", "global", True, "Divide by the sum of (agreeing) weights"),
        # The DARE/DELLA papers rescale by 1/keep-probability; mergekit's
        # ``rescale: true`` matches the L1 norm instead (also supported).
        ParamDef("rescale", "choice", "global", "inverse",
                 "DARE/DELLA: rescale survivors by 1/p (inverse), to the L1 norm (l1) or not (none)",
                 choices=("inverse", "l1", "none")),
        # mergekit requires t; 0.5 is the midpoint.
        ParamDef("t", "real", "global", 0.5, "SLERP: interpolation factor, 0 = base, 1 = expert",
                 low=0.0, high=1.0),
        # nuslerp, multislerp: mergekit's form follows from its config (a base_model or none), MergePipe's
        # base is a catalog model either way; these two say which (spec/mergekit.py sets them).
        ParamDef("task_vectors", "bool", "global", True,
                 "NuSLERP, Multi-SLERP: interpolate the experts' deltas from the base (mergekit with a base_model); "
                 "false: the models themselves, the base one of them (mergekit without one)"),
        ParamDef("base_weight", "real", "global", 1.0,
                 "NuSLERP, Multi-SLERP with task_vectors false: the base's weight among the interpolated models"),
        ParamDef("nuslerp_flatten", "bool", "global", True,
                 "NuSLERP: interpolate each tensor as one vector; false: vector by vector"),
        ParamDef("nuslerp_row_wise", "bool", "global", False,
                 "NuSLERP without flatten: the vectors along the first dimension (a matrix's columns) instead "
                 "of the last (its rows)"),
        ParamDef("normalize_weights", "bool", "global", True, "Multi-SLERP: divide the weights by their sum"),
        ParamDef("eps", "real", "global", 1e-8, "Multi-SLERP: added to each norm before dividing by it",
                 low=0.0, low_open=True),
        ParamDef("max_iter", "int", "global", 10, "Karcher: the most iterations of the mean", low=0),
        ParamDef("tol", "real", "global", 1e-5,
                 "Karcher: stop when a step is shorter; points of norm at most tol count as zero", low=0.0),
        # mergekit's default: one ratio for the whole tensor.
        ParamDef("filter_wise", "bool", "global", False,
                 "Model stock: one interpolation ratio per row (filter) instead of one per tensor"),
        # mergekit's default: 1.0 selects every entry (no selection).
        ParamDef("select_topk", "real", "global", 1.0,
                 "SCE: fraction of the entries that vary across the experts kept, those of largest variance",
                 low=0.0, high=1.0),
        ParamDef("r", "real", "global", 0.1,
                 "RAM+: gain on an expert's unique entries, 1 + r min(shared/unique, alpha)", low=0.0),
        ParamDef("alpha", "real", "global", 0.2, "RAM+: cap on an expert's shared/unique ratio", low=0.0),
    )
}


def param(name: str, default: Any = MISSING, **changes: Any) -> Any:
    """A dataclass field for parameter ``name`` (its catalogue default unless given). ``changes`` replace
    other fields of the definition (range, doc) for an operator that gives mergekit's name another
    meaning: nearswap's ``t`` is a distance, not slerp's fraction."""
    definition = replace(PARAMS[name], **changes)
    if default is not MISSING:
        definition = replace(definition, default=definition.coerce(default))
    return field(default=definition.default, metadata={_PARAM_KEY: definition})


class ParamSet:
    """Base of the typed parameter dataclasses (see the module docstring).

    Subclasses are frozen dataclasses whose every field comes from ``param``.
    """

    @classmethod
    @cache  # per class, which never changes: a plan resolves every tensor's parameters per expert
    def definitions(cls) -> tuple[ParamDef, ...]:
        # subclasses are dataclasses, this base is not: mypy cannot know ``cls`` is one of them
        return tuple(f.metadata[_PARAM_KEY] for f in fields(cls))  # type: ignore[arg-type]

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(d.name for d in cls.definitions())

    @classmethod
    def build(cls, values: Mapping[str, Any]) -> "ParamSet":
        """An instance from ``{user name: value}``; absent names take their default."""
        return cls(**{d.attribute: values[d.name] for d in cls.definitions() if d.name in values})

    def to_dict(self) -> dict[str, Any]:
        """``{user name: value}`` of every parameter."""
        return {d.name: getattr(self, d.attribute) for d in self.definitions()}


@dataclass(frozen=True)
class NoParams(ParamSet):
    """An operator (or scope) that takes no parameters."""
