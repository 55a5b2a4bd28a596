"""The operator definitions and the one registry of operator names.

Each definition says which parameters the operator takes (typed dataclasses
of ``param()`` fields), how it streams and which error bound it admits. The
formulas, references and every intentional difference from mergekit are in
the docstring of the operator's kernel, ``engine/operators/<family>.py``.
"""

from __future__ import annotations

import json
import keyword
import math
from dataclasses import MISSING, dataclass, field, fields, replace
from functools import cache
from typing import Any, ClassVar, Generic, Mapping, Sequence, TypeVar

from mergepipe.errors import ConfigError
from mergepipe.spec.settings import layer_index, resolve, setting_leaves


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
            e if isinstance(e, ExpertSpec) else ExpertSpec(e[0], dict(e[1]) if len(e) > 1 else {}) for e in self.experts
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
            raise ConfigError('a merge spec needs an operator name, e.g. "ties"')
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
        ParamDef("density", "real", "expert", 1.0, "Fraction of delta entries kept", low=0.0, high=1.0, low_open=True),
        ParamDef(
            "gamma",
            "real",
            "expert",
            0.01,
            "Breadcrumbs: fraction of the largest delta entries dropped",
            low=0.0,
            high=1.0,
            high_open=True,
        ),
        ParamDef(
            "epsilon",
            "real",
            "expert",
            0.15,
            "DELLA: spread of keep probabilities, density +- epsilon",
            low=0.0,
            high=0.5,
            high_open=True,
        ),
        ParamDef("lambda", "real", "global", 1.0, "Multiplier of the merged delta"),
        ParamDef("normalize", "bool", "global", True, "Divide by the sum of (agreeing) weights"),
        # The DARE/DELLA papers rescale by 1/keep-probability; mergekit's
        # ``rescale: true`` matches the L1 norm instead (also supported).
        ParamDef(
            "rescale",
            "choice",
            "global",
            "inverse",
            "DARE/DELLA: rescale survivors by 1/p (inverse), to the L1 norm (l1) or not (none)",
            choices=("inverse", "l1", "none"),
        ),
        # mergekit requires t; 0.5 is the midpoint.
        ParamDef("t", "real", "global", 0.5, "SLERP: interpolation factor, 0 = base, 1 = expert", low=0.0, high=1.0),
        # nuslerp, multislerp: mergekit's form follows from its config (a base_model or none), MergePipe's
        # base is a catalog model either way; these two say which (spec/mergekit.py sets them).
        ParamDef(
            "task_vectors",
            "bool",
            "global",
            True,
            "NuSLERP, Multi-SLERP: interpolate the experts' deltas from the base (mergekit with a base_model); "
            "false: the models themselves, the base one of them (mergekit without one)",
        ),
        ParamDef(
            "base_weight",
            "real",
            "global",
            1.0,
            "NuSLERP, Multi-SLERP with task_vectors false: the base's weight among the interpolated models",
        ),
        ParamDef(
            "nuslerp_flatten",
            "bool",
            "global",
            True,
            "NuSLERP: interpolate each tensor as one vector; false: vector by vector",
        ),
        ParamDef(
            "nuslerp_row_wise",
            "bool",
            "global",
            False,
            "NuSLERP without flatten: the vectors along the first dimension (a matrix's columns) instead "
            "of the last (its rows)",
        ),
        ParamDef("normalize_weights", "bool", "global", True, "Multi-SLERP: divide the weights by their sum"),
        ParamDef(
            "eps",
            "real",
            "global",
            1e-8,
            "Multi-SLERP: added to each norm before dividing by it",
            low=0.0,
            low_open=True,
        ),
        ParamDef("max_iter", "int", "global", 10, "Karcher: the most iterations of the mean", low=0),
        ParamDef(
            "tol",
            "real",
            "global",
            1e-5,
            "Karcher: stop when a step is shorter; points of norm at most tol count as zero",
            low=0.0,
        ),
        # mergekit's default: one ratio for the whole tensor.
        ParamDef(
            "filter_wise",
            "bool",
            "global",
            False,
            "Model stock: one interpolation ratio per row (filter) instead of one per tensor",
        ),
        # mergekit's default: 1.0 selects every entry (no selection).
        ParamDef(
            "select_topk",
            "real",
            "global",
            1.0,
            "SCE: fraction of the entries that vary across the experts kept, those of largest variance",
            low=0.0,
            high=1.0,
        ),
        ParamDef(
            "r",
            "real",
            "global",
            0.1,
            "RAM+: gain on an expert's unique entries, 1 + r min(shared/unique, alpha)",
            low=0.0,
        ),
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


ERROR_BOUNDS = ("exact", "separable", "consensus", "none")

E = TypeVar("E", bound=ParamSet)
G = TypeVar("G", bound=ParamSet)


@dataclass(frozen=True)
class TensorParams(Generic[E, G]):
    """An operator's parameters resolved for one tensor: one ``E`` per expert
    (in the spec's expert order) and one ``G``."""

    experts: tuple[E, ...]
    global_: G


class OperatorDef:
    """Base of the operator definitions (``operators.py`` lists them)."""

    #: Canonical lower-case name, shared with the engine's kernel registry.
    name: ClassVar[str]
    #: One line for the CLI's help.
    summary: ClassVar[str] = ""
    #: Per-expert and global parameters (frozen dataclasses of ``param()`` fields).
    expert_params: ClassVar[type[ParamSet]] = NoParams
    global_params: ClassVar[type[ParamSet]] = NoParams
    #: False: needs whole tensors (the engine passes them; planned all-or-nothing).
    streaming: ClassVar[bool] = True
    #: One of ``ERROR_BOUNDS``: see the module docstring.
    error_bound: ClassVar[str] = "none"
    #: Negative weights are refused where a weighted mean or a sign election
    #: makes them meaningless.
    nonnegative_weights: ClassVar[bool] = False
    #: Whether the kernel draws random numbers (keyed by seed, expert family and tensor): then the output
    #: depends on the experts' names, not only on their content (analysis/provenance.py).
    random: ClassVar[bool] = False
    #: Output = base·s + Σ ci·Δi with per-expert constants ci: a block can be updated from a previous
    #: output when an expert is replaced (``merge --delta-update``, planner/reuse.py).
    delta_updatable: ClassVar[bool] = False
    min_experts: ClassVar[int] = 1
    max_experts: ClassVar[int | None] = None
    #: What a plan that leaves expert bytes unread means for this operator, beyond what every plan says
    #: (the planner adds it to such plans' notes); '' when reading less needs no word of its own.
    budget_note: ClassVar[str] = ""

    def __repr__(self) -> str:
        return f"<operator {self.name}>"

    # ---- validation (before any I/O) ---------------------------------

    def validate(self, spec: MergeSpec, tensor_names: Sequence[str] = (), num_layers: int = 0) -> None:
        """ConfigError for anything wrong with ``spec`` for this operator.

        Checks counts, ids, parameter names and scopes, the structure of every
        setting and every value it can take. Combinations that depend on the
        tensor (della's epsilon vs density, weights summing to 0) are checked
        for every tensor in ``tensor_names``. Without names (before any I/O)
        they are checked where every model is known to be: everywhere for
        plain scalars, at both ends of the layer gradients (any model with
        layers and embeddings has a tensor at each: t = 0 outside the layers
        and at the first, t = 1 at the last); the points between, which
        depend on the layer count, and filter rules, which depend on the
        names, wait for the names (``app/registering.py`` gives the base's
        before any expert is registered).
        """
        n = len(spec.experts)
        if n < self.min_experts or (self.max_experts is not None and n > self.max_experts):
            raise ConfigError(f"{self.name} needs {self._count_phrase()}, got {n}")
        ids = spec.expert_ids
        if any(not isinstance(e, str) or not e for e in ids):
            raise ConfigError(f"expert ids must be non-empty strings, got {list(ids)!r}")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"an expert is listed twice in {list(ids)!r}; list each expert once")
        for key, value in spec.params.items():
            self._check_setting(self._definition(key, None), value, "global parameters")
        for e in spec.experts:
            for key, value in e.params.items():
                self._check_setting(self._definition(key, e.expert_id), value, f"expert {e.expert_id!r}")
        if tensor_names:
            for name in tensor_names:
                self.check_tensor(self.resolve(spec, name, num_layers), name)
        elif _scalar_only(spec):
            self.check_tensor(self.resolve(spec, "", 0), "every tensor")
        elif not _has_rules(spec):
            self.check_tensor(self.resolve(spec, "", 0), "the first layer (and the tensors outside the layers)")
            self.check_tensor(self.resolve(spec, *_LAST_LAYER), "the last layer")

    def _definition(self, key: str, expert_id: str | None) -> ParamDef:
        by_name = {d.name: d for d in (*self.expert_params.definitions(), *self.global_params.definitions())}
        where = "" if expert_id is None else f" (expert {expert_id!r})"
        if key not in by_name:
            raise ConfigError(f"{self.name} does not take parameter {key!r}{where}; it takes: {self._params_phrase()}")
        definition = by_name[key]
        if expert_id is not None and definition.scope == "global":
            raise ConfigError(
                f"{key!r} is a global parameter of {self.name}; set it once for the merge, not for expert {expert_id!r}"
            )
        return definition

    def _check_setting(self, definition: ParamDef, value: Any, where: str) -> None:
        try:
            for leaf in setting_leaves(value):
                checked = definition.coerce(leaf)
                if definition.name == "weight" and self.nonnegative_weights and checked < 0:
                    raise ConfigError(
                        f"weight must be >= 0 for {self.name} (a weighted mean/sign election), got {leaf!r}; "
                        "use task_arithmetic for negative weights"
                    )
        except ConfigError as exc:
            raise ConfigError(f"{self.name}, {where}: {exc}") from None

    def _count_phrase(self) -> str:
        plural = "s" if self.min_experts > 1 else ""
        if self.max_experts == self.min_experts:
            return f"exactly {self.min_experts} expert{plural}"
        return f"at least {self.min_experts} expert{plural}"

    def _params_phrase(self) -> str:
        names = [*self.expert_params.names(), *self.global_params.names()]
        return ", ".join(names) if names else "no parameters"

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        """ConfigError for a combination of resolved values that is invalid for
        this tensor. Default: nothing to check."""

    # ---- resolution ----------------------------------------------------

    def resolve(self, spec: MergeSpec, tensor_name: str, num_layers: int) -> TensorParams:
        """The typed parameters of one tensor: an expert's own setting, else
        the global one, else the operator's default."""
        layer = layer_index(tensor_name)

        def values(names: Sequence[ParamDef], sources: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
            out = {}
            for definition in names:
                for source in sources:
                    if definition.name in source:
                        value = resolve(source[definition.name], tensor_name, layer, num_layers)
                        if value is not None:
                            out[definition.name] = definition.coerce(value)
                            break
            return out

        expert_defs = self.expert_params.definitions()
        experts = tuple(self.expert_params.build(values(expert_defs, (e.params, spec.params))) for e in spec.experts)
        return TensorParams(experts, self.global_params.build(values(self.global_params.definitions(), (spec.params,))))

    # ---- planning ----------------------------------------------------

    def needs_thresholds(self, expert: Any) -> tuple[float, ...]:
        """Densities whose per-tensor TrimThreshold this expert needs."""
        return ()

    def streams_with(self, params: TensorParams, thresholds_available: bool) -> bool:
        """Whether this tensor can be merged block by block, given whether the
        catalog has every threshold ``needs_thresholds`` asked for. If False
        the engine passes whole tensors (and the kernel computes thresholds)."""
        if not self.streaming:
            return False
        return thresholds_available or not any(self.needs_thresholds(p) for p in params.experts)

    def absent_neutral(self, params: TensorParams) -> bool:
        """Whether an expert whose delta is absent for a block (not read: ``None``) takes no part in
        the block's result, bit for bit: its weight and parameters do not enter the arithmetic of the
        others. Provenance keys (``analysis/provenance.py``) then leave it out, so adding an expert
        does not invalidate the blocks it does not touch. False unless an operator knows better."""
        return False

    def keeps_base(self, params: TensorParams) -> bool:
        """Whether the output is the base where every expert's Δ is 0 (``B + f(Δ)`` with ``f(0) = 0``): only then
        is a block no expert is read for (identical to the base, or left out by the budget) the base's bytes,
        copied without the kernel. Not so for an output that scales B (linear without normalisation: ``Σw·B``).
        ``tests/cli/test_untouched_tensors.py`` checks every method against it."""
        return True

    def beta(self, params: TensorParams) -> list[float]:
        """Per-expert multiplier of the error bound (>= 0, or inf: no bound)."""
        return [math.inf] * len(params.experts)


#: A tensor of the last of two layers, as ``resolve`` takes it: the end of every layer gradient (t = 1).
_LAST_LAYER = ("layers.1", 2)


def _settings(spec: MergeSpec) -> list[Any]:
    return [*spec.params.values(), *(v for e in spec.experts for v in e.params.values())]


def _scalar_only(spec: MergeSpec) -> bool:
    return all(isinstance(v, (bool, int, float, str)) for v in _settings(spec))


def _has_rules(spec: MergeSpec) -> bool:
    """Whether a setting is ``{filter, value}`` rules, whose values depend on the tensors' names."""
    return any(
        isinstance(v, Mapping) or (isinstance(v, (list, tuple)) and any(isinstance(x, Mapping) for x in v))
        for v in _settings(spec)
    )


# ----------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Weighted(ParamSet):
    weight: float = param("weight")


@dataclass(frozen=True)
class Trimmed(ParamSet):
    weight: float = param("weight")
    density: float = param("density")


@dataclass(frozen=True)
class Crumbs(ParamSet):
    weight: float = param("weight")
    density: float = param("density")
    gamma: float = param("gamma")


@dataclass(frozen=True)
class Magprune(ParamSet):
    weight: float = param("weight")
    density: float = param("density")
    epsilon: float = param("epsilon")


@dataclass(frozen=True)
class Averaged(ParamSet):
    normalize: bool = param("normalize", True)
    # mergekit's linear averages the models it lists: the base too where it is one of them (spec/mergekit.py)
    base_weight: float = param(
        "base_weight",
        0.0,
        low=0.0,
        doc="Linear: the base's weight among the averaged models (mergekit's linear without "
        "base_model, or with it listed among the models); 0: the base is not one of them",
    )


@dataclass(frozen=True)
class ScaledSum(ParamSet):
    lambda_: float = param("lambda")
    normalize: bool = param("normalize", False)


@dataclass(frozen=True)
class ScaledMean(ParamSet):
    lambda_: float = param("lambda")
    normalize: bool = param("normalize", True)


@dataclass(frozen=True)
class RescaledSum(ParamSet):
    lambda_: float = param("lambda")
    normalize: bool = param("normalize", False)
    rescale: str = param("rescale")


@dataclass(frozen=True)
class RescaledMean(ParamSet):
    lambda_: float = param("lambda")
    normalize: bool = param("normalize", True)
    rescale: str = param("rescale")


@dataclass(frozen=True)
class Interpolation(ParamSet):
    t: float = param("t")


@dataclass(frozen=True)
class Stock(ParamSet):
    filter_wise: bool = param("filter_wise")


# -------------------------------------------------------------- shared rules


def linear_coefficients(
    weights: Sequence[float], lam: float, normalize: bool, op_name: str, tensor_name: str = "this tensor"
) -> list[float]:
    """``ci = λ wi / Σw`` (normalize) or ``λ wi``, in float64.

    The sum is exactly rounded (``math.fsum``), so it does not depend on the
    order of the experts.
    """
    if not normalize:
        return [lam * w for w in weights]
    total = math.fsum(weights)
    if abs(total) < 1e-8:
        raise ConfigError(
            f"{op_name}: the expert weights sum to {total!r} for {tensor_name}, so they cannot be "
            "normalised; change the weights or set normalize: false"
        )
    return [lam * w / total for w in weights]


def band_fractions(gamma: float, density: float) -> tuple[float, float]:
    """Breadcrumbs ``(top, outer)``: the kept band lies between these two trim fractions."""
    return min(gamma, 1.0 - density), min(gamma + density, 1.0)


# -------------------------------------------------------------- definitions


class LinearDef(OperatorDef):
    name = "linear"
    summary = "weighted average of the experts (and of the base, with base_weight): B + Σ wi Δi / Σw"
    # declared as the base's (any ParamSet): avg and task_arithmetic take others
    expert_params: ClassVar[type[ParamSet]] = Weighted
    global_params: ClassVar[type[ParamSet]] = Averaged
    error_bound = "exact"
    nonnegative_weights = True
    delta_updatable = True

    def coefficients(self, params: TensorParams, tensor_name: str = "this tensor") -> list[float]:
        """The signed multiplier of each expert's delta: wi / Σw, the base's weight in the sum (the base
        is one of the averaged models, with Δ = 0), or wi."""
        weights = [e.weight for e in params.experts]
        every = [*weights, params.global_.base_weight]  # + 0.0 leaves an exactly rounded sum as it was
        return linear_coefficients(every, 1.0, params.global_.normalize, self.name, tensor_name)[:-1]

    def base_scale(self, params: TensorParams) -> float:
        """Multiplier of B in the output: 1, or Σw (the base's weight included) without normalize."""
        if params.global_.normalize:
            return 1.0
        return math.fsum([*(e.weight for e in params.experts), params.global_.base_weight])

    def keeps_base(self, params: TensorParams) -> bool:
        return self.base_scale(params) == 1.0  # Σw·B without normalize: the base's only where Σw = 1

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        self.coefficients(params, tensor_name)

    def beta(self, params: TensorParams) -> list[float]:
        return [abs(c) for c in self.coefficients(params)]


class AvgDef(LinearDef):
    name = "avg"
    summary = "plain average of the experts: B + Σ Δi / K"
    expert_params = NoParams
    global_params = NoParams

    def coefficients(self, params: TensorParams, tensor_name: str = "this tensor") -> list[float]:
        return [1.0 / len(params.experts)] * len(params.experts)

    def base_scale(self, params: TensorParams) -> float:
        return 1.0


class TaskArithmeticDef(LinearDef):
    name = "task_arithmetic"
    summary = "sum of weighted task vectors: B + λ Σ wi Δi (negative weights allowed)"
    global_params = ScaledSum
    nonnegative_weights = False

    def coefficients(self, params: TensorParams, tensor_name: str = "this tensor") -> list[float]:
        weights = [e.weight for e in params.experts]
        g = params.global_
        return linear_coefficients(weights, g.lambda_, g.normalize, self.name, tensor_name)

    def base_scale(self, params: TensorParams) -> float:
        return 1.0

    def absent_neutral(self, params: TensorParams) -> bool:
        return not params.global_.normalize  # λ wi: no sum over all experts' weights


class TiesDef(OperatorDef):
    name = "ties"
    summary = "trim each delta to its top density, elect signs, disjoint mean"
    expert_params = Trimmed
    global_params = ScaledMean
    error_bound = "consensus"
    nonnegative_weights = True

    def needs_thresholds(self, expert: Trimmed) -> tuple[float, ...]:
        return (expert.density,) if expert.density < 1.0 else ()

    def absent_neutral(self, params: TensorParams) -> bool:
        return True  # sign election and the agreeing-weight divisor see only the deltas present

    def beta(self, params: TensorParams) -> list[float]:
        g = params.global_
        return [abs(g.lambda_) * (1.0 if g.normalize else abs(e.weight)) for e in params.experts]


class SparsifyThenSumDef(OperatorDef):
    """Per-expert sparsification, then ``B + Σ ci xi`` with linear coefficients."""

    error_bound = "separable"

    def coefficients(self, params: TensorParams, tensor_name: str = "this tensor") -> list[float]:
        weights = [e.weight for e in params.experts]
        g = params.global_
        return linear_coefficients(weights, g.lambda_, g.normalize, self.name, tensor_name)

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        self.coefficients(params, tensor_name)

    def absent_neutral(self, params: TensorParams) -> bool:
        return getattr(params.global_, "normalize", True) is False  # λ wi: no sum over all weights

    def gain(self, expert: ParamSet, params: TensorParams) -> float:
        """Largest factor the rescaling applies to a kept entry (1: none)."""
        return 1.0

    def l1_rescaled(self, params: TensorParams) -> bool:
        """Whether survivors are rescaled to the whole tensor's L1 norm (tensor-level)."""
        return getattr(params.global_, "rescale", None) == "l1"

    def beta(self, params: TensorParams) -> list[float]:
        if self.l1_rescaled(params):  # a per-tensor factor: no per-element bound
            return [math.inf] * len(params.experts)
        return [abs(c) * self.gain(e, params) for c, e in zip(self.coefficients(params), params.experts)]


class SparsifyThenConsensusDef(SparsifyThenSumDef):
    """Per-expert sparsification, then TIES sign election and disjoint mean."""

    error_bound = "consensus"
    nonnegative_weights = True

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        pass  # normalize divides by the agreeing weights: no sum to check

    def absent_neutral(self, params: TensorParams) -> bool:
        return True  # sign election and the agreeing-weight divisor see only the deltas present

    def beta(self, params: TensorParams) -> list[float]:
        if self.l1_rescaled(params):
            return [math.inf] * len(params.experts)
        g = params.global_
        return [abs(g.lambda_) * (1.0 if g.normalize else abs(e.weight)) * self.gain(e, params) for e in params.experts]


class RandomDropDef(SparsifyThenSumDef):
    """DARE and DELLA: entries kept at random, survivors rescaled by 1/p, l1 or not.

    They need no thresholds, so they stream unless the L1 rescale needs whole tensors.
    """

    global_params: ClassVar[type[ParamSet]] = RescaledSum  # DELLA's mean takes RescaledMean
    random = True

    def streams_with(self, params: TensorParams, thresholds_available: bool) -> bool:
        return not self.l1_rescaled(params)

    # ``expert`` is one of the operator's own ``expert_params`` (each subclass names its class), as in
    # ``needs_thresholds``: typed Any here so that a subclass may declare its own.
    def min_keep_probability(self, expert: Any) -> float:
        raise NotImplementedError

    def gain(self, expert: Any, params: TensorParams) -> float:
        """Largest factor the rescale applies to a kept entry: 1 / the smallest keep probability."""
        inverse = params.global_.rescale == "inverse" and expert.density < 1.0
        return 1.0 / self.min_keep_probability(expert) if inverse else 1.0


class DareLinearDef(RandomDropDef):
    name = "dare_linear"
    summary = "drop delta entries at random (keep density), rescale, sum"
    expert_params = Trimmed

    def min_keep_probability(self, expert: Trimmed) -> float:
        return expert.density


class DareTiesDef(SparsifyThenConsensusDef, DareLinearDef):
    name = "dare_ties"
    summary = "DARE's random drop, then TIES sign election"


class BreadcrumbsDef(SparsifyThenSumDef):
    name = "breadcrumbs"
    summary = "drop the largest (gamma) and smallest delta entries, keep a density band, sum"
    expert_params = Crumbs
    global_params = ScaledSum

    def needs_thresholds(self, expert: Crumbs) -> tuple[float, ...]:
        if expert.density >= 1.0:
            return ()
        return tuple(f for f in band_fractions(expert.gamma, expert.density) if 0.0 < f < 1.0)


class BreadcrumbsTiesDef(SparsifyThenConsensusDef, BreadcrumbsDef):
    name = "breadcrumbs_ties"
    summary = "breadcrumbs' band, then TIES sign election"


class DellaLinearDef(RandomDropDef):
    name = "della_linear"
    summary = "drop entries with a probability that falls with magnitude rank (MAGPRUNE), rescale, sum"
    expert_params = Magprune

    def min_keep_probability(self, expert: Magprune) -> float:
        return expert.density - expert.epsilon

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        self.check_epsilon(params.experts, tensor_name)
        super().check_tensor(params, tensor_name)

    def check_epsilon(self, experts: Sequence[Magprune], tensor_name: str) -> None:
        for e in experts:
            d, eps = e.density, e.epsilon
            if d < 1.0 and not (d - eps > 0.0 and d + eps < 1.0):
                raise ConfigError(
                    f"{self.name}: density {d!r} +- epsilon {eps!r} must stay inside (0, 1) for {tensor_name}; "
                    "lower epsilon or move density away from 0 and 1"
                )


class DellaDef(SparsifyThenConsensusDef, DellaLinearDef):
    name = "della"
    summary = "DELLA's MAGPRUNE drop, then TIES sign election"
    global_params = RescaledMean

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        self.check_epsilon(params.experts, tensor_name)


class SlerpDef(OperatorDef):
    name = "slerp"
    summary = "spherical interpolation between the base and one expert, per tensor"
    global_params = Interpolation
    streaming = False
    min_experts = 1
    max_experts = 1


class ModelStockDef(OperatorDef):
    name = "model_stock"
    summary = "average of the experts moved toward the base by their mutual cosine, per tensor (or row)"
    global_params = Stock
    streaming = False
    min_experts = 2


# ------------------------------------------------------ two-model fusions


@dataclass(frozen=True)
class SwapDistance(ParamSet):
    # mergekit's t here is a distance with no upper end (0.001 is typical), not slerp's fraction
    t: float = param("t", high=None, doc="NearSwap: the distance |E - B| up to which the expert's value is taken")


class NearswapDef(OperatorDef):
    """Element-wise: each entry's weight depends on its own |Δ| only, w |Δ| <= |Δ|, so it streams and an
    unread block is the base's (beta 1)."""

    name = "nearswap"
    summary = "take the expert's value where it is within t of the base's, a step of t toward it elsewhere"
    global_params = SwapDistance
    error_bound = "separable"
    min_experts = 1
    max_experts = 1

    def validate(self, spec: MergeSpec, tensor_names: Sequence[str] = (), num_layers: int = 0) -> None:
        super().validate(spec, tensor_names, num_layers)
        if "t" not in spec.params:  # no default means anything: 0.5 would take nearly every entry whole
            raise ConfigError(
                "nearswap needs t, the distance |E - B| up to which the expert's value is taken "
                "(e.g. 0.001); mergekit requires it too"
            )

    def absent_neutral(self, params: TensorParams) -> bool:
        return True  # an unread block is the base's

    def beta(self, params: TensorParams) -> list[float]:
        return [1.0]


class ArceeFusionDef(OperatorDef):
    """Tensor-level: the importance threshold is a quantile of the whole tensor, so a partial budget
    fuses whole tensors or keeps them as the base's."""

    name = "arcee_fusion"
    summary = "keep the expert's changes whose importance (|Δ| x its row's softmax KL) is an outlier, per tensor"
    streaming = False
    budget_note = (
        "arcee_fusion fuses whole tensors: each is read whole or not at all (then it keeps the base's "
        "values), since its importance threshold is a quantile of the whole tensor"
    )
    min_experts = 1
    max_experts = 1


# ---------------------------------------- variance selection, agent merging


@dataclass(frozen=True)
class VarianceSelection(ParamSet):
    select_topk: float = param("select_topk")


#: RAM's epsilon is mergekit's global threshold on |Δ|, not DELLA's per-expert spread of the same name.
_RAM_EPSILON: dict[str, Any] = {
    "scope": "global",
    "high": None,
    "high_open": False,
    "doc": "RAM: |Δ| above which an entry counts as changed by the expert",
}


@dataclass(frozen=True)
class ChangeThreshold(ParamSet):
    epsilon: float = param("epsilon", 1e-5, **_RAM_EPSILON)


@dataclass(frozen=True)
class ReinforcedThreshold(ParamSet):
    r: float = param("r")
    alpha: float = param("alpha")
    epsilon: float = param("epsilon", 1e-5, **_RAM_EPSILON)


class SceDef(OperatorDef):
    """Tensor-level: the variance selection and the experts' weights need every expert's whole tensor."""

    name = "sce"
    summary = "keep the entries that vary most across the experts, weight experts by energy, erase minority signs"
    global_params = VarianceSelection
    streaming = False
    budget_note = (
        "sce merges whole tensors, each from every expert or not at all (then it keeps the base's "
        "values); an expert tensor a delta-store plan leaves unread counts as Δ = 0 among the experts "
        "(its zeros enter the variance; its weight is 0)"
    )


class RamDef(OperatorDef):
    """Element-wise, so it streams: each entry keeps the deltas that changed it, whole or divided by their
    count, so |m_j| <= Σ |Δi_j| (beta 1, a consensus bound), and an unread expert takes no part."""

    name = "ram"
    summary = "keep each expert's changed entries (|Δ| > epsilon); the mean where several experts changed one"
    global_params = ChangeThreshold
    error_bound = "consensus"

    def absent_neutral(self, params: TensorParams) -> bool:
        return True  # Δ = 0 changes no entry and counts for none

    def beta(self, params: TensorParams) -> list[float]:
        return [1.0] * len(params.experts)


class RamPlusTlDef(OperatorDef):
    """Tensor-level: each expert's gain counts its shared and unique entries over the whole tensor."""

    name = "ramplus_tl"
    summary = "RAM, each expert's unique entries scaled by 1 + r min(shared/unique, alpha) per tensor"
    global_params = ReinforcedThreshold
    streaming = False
    budget_note = (
        "ramplus_tl merges whole tensors, each from every expert or not at all (then it keeps the "
        "base's values); an expert tensor a delta-store plan leaves unread takes no part in it"
    )

    def absent_neutral(self, params: TensorParams) -> bool:
        return True  # Δ = 0 changes no entry and counts for none


# ------------------------------------------------------------ spherical means


@dataclass(frozen=True)
class NuSlerpParams(ParamSet):
    nuslerp_flatten: bool = param("nuslerp_flatten")
    nuslerp_row_wise: bool = param("nuslerp_row_wise")
    task_vectors: bool = param("task_vectors")
    base_weight: float = param("base_weight")


@dataclass(frozen=True)
class MultiSlerpParams(ParamSet):
    normalize_weights: bool = param("normalize_weights")
    eps: float = param("eps")
    task_vectors: bool = param("task_vectors")
    base_weight: float = param("base_weight")


@dataclass(frozen=True)
class KarcherParams(ParamSet):
    max_iter: int = param("max_iter")
    tol: float = param("tol")


class SphericalDef(OperatorDef):
    """Interpolation on the sphere of either the experts' task vectors (``task_vectors: true``) or the
    models themselves, the base one of them with ``base_weight`` (``engine/operators/_spherical.py``).
    Tensor-level: norms and angles are whole tensors' (or whole rows'), so a partial budget reads a
    tensor of every expert or of none, and an unread tensor keeps the base's."""

    expert_params = Weighted
    streaming = False

    def validate(self, spec: MergeSpec, tensor_names: Sequence[str] = (), num_layers: int = 0) -> None:
        super().validate(spec, tensor_names, num_layers)
        if "base_weight" in spec.params and spec.params.get("task_vectors", True) is not False:
            raise ConfigError(
                f"{self.name}: base_weight is the base's weight among the interpolated models; "
                "it needs task_vectors: false"
            )


class NuSlerpDef(SphericalDef):
    name = "nuslerp"
    summary = "spherical interpolation of two task vectors (or of the base and one model), per tensor or vector"
    global_params = NuSlerpParams
    min_experts = 1
    max_experts = 2
    budget_note = (
        "nuslerp merges whole tensors, whatever nuslerp_flatten says, each from every expert or not at "
        "all (then it keeps the base's values: without a base_model, the first model's)"
    )

    def _count_phrase(self) -> str:
        return "two experts (one with task_vectors: false, the base being the other point)"

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        task_vectors, n = params.global_.task_vectors, len(params.experts)
        if n != (2 if task_vectors else 1):
            points = "the task vectors of two experts" if task_vectors else "the base and one expert"
            raise ConfigError(
                f"nuslerp with task_vectors: {str(task_vectors).lower()} interpolates {points}, "
                f"got {n} expert{'s' if n > 1 else ''} for {tensor_name}"
            )


class MultiSlerpDef(SphericalDef):
    name = "multislerp"
    summary = "barycentric interpolation of the experts' task vectors (or of the models) on the sphere, per tensor"
    global_params = MultiSlerpParams
    budget_note = (
        "multislerp merges whole tensors, each from every expert or not at all (then it keeps the "
        "base's values: without a base_model, the first model's, times |Σw| with normalize_weights: false)"
    )

    def keeps_base(self, params: TensorParams) -> bool:
        g = params.global_  # the models themselves, unnormalised: copies of B average to |Σw|·B
        return (
            g.task_vectors
            or g.normalize_weights
            or abs(math.fsum([*(e.weight for e in params.experts), g.base_weight])) == 1.0
        )

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        g = params.global_
        weights = [e.weight for e in params.experts] + ([] if g.task_vectors else [g.base_weight])
        if g.normalize_weights and len(weights) > 1 and abs(math.fsum(weights)) < 1e-8:
            raise ConfigError(
                f"multislerp: the weights sum to {math.fsum(weights)!r} for {tensor_name}, so they "
                "cannot be normalised; change the weights or set normalize_weights: false"
            )


class KarcherDef(OperatorDef):
    """The base is always one of the averaged models (mergekit's karcher has no task-vector form).
    Tensor-level, as the spherical means above."""

    name = "karcher"
    summary = "Riemannian (Karcher) mean of the base and the experts on the sphere, rescaled to their mean norm"
    global_params = KarcherParams
    streaming = False
    budget_note = (
        "karcher averages whole tensors, each from every model or not at all (then it keeps the base's "
        "values, the base being one of the averaged models)"
    )


# ------------------------------------------------------------------ registry

OPERATORS: dict[str, OperatorDef] = {
    d.name: d
    for d in (
        AvgDef(),
        LinearDef(),
        TaskArithmeticDef(),
        TiesDef(),
        DareLinearDef(),
        DareTiesDef(),
        BreadcrumbsDef(),
        BreadcrumbsTiesDef(),
        DellaDef(),
        DellaLinearDef(),
        SlerpDef(),
        ModelStockDef(),
        NearswapDef(),
        ArceeFusionDef(),
        SceDef(),
        RamDef(),
        RamPlusTlDef(),
        NuSlerpDef(),
        MultiSlerpDef(),
        KarcherDef(),
    )
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


def get_operator(name: str) -> OperatorDef:
    """The definition of operator ``name`` (any spelling ``canonical_name`` accepts)."""
    return OPERATORS[canonical_name(name)]


def validate_spec(spec: MergeSpec, tensor_names: Sequence[str] = (), num_layers: int = 0) -> OperatorDef:
    """Check a spec before any I/O; returns its operator's definition."""
    definition = get_operator(spec.operator)
    definition.validate(spec, tensor_names, num_layers)
    return definition


#: Densities analysed per (expert, tensor). Covers the values people use for
#: TIES/DARE/breadcrumbs; an off-grid density falls back to a tensor-level
#: computation in the engine.
DENSITY_GRID: tuple[float, ...] = (
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.3,
    0.4,
    0.5,
    0.6,
    0.7,
    0.8,
    0.9,
)

#: Densities closer than this are the same grid point: a fraction computed
#: as gamma + density (0.1 + 0.2 = 0.30000000000000004) must find 0.3.
DENSITY_TOLERANCE = 1e-9


@dataclass(frozen=True)
class TrimThreshold:
    """Where to cut |delta| of one tensor to keep the top ``k`` entries."""

    density: float
    k: int
    tau: float
    last_index: int

    def to_json(self) -> dict:
        return {"density": self.density, "k": self.k, "tau": self.tau, "last_index": self.last_index}

    @classmethod
    def from_json(cls, data: dict) -> "TrimThreshold":
        return cls(
            density=float(data["density"]),
            k=int(data["k"]),
            tau=float(data["tau"]),
            last_index=int(data["last_index"]),
        )


def find_threshold(table: Mapping[float, TrimThreshold] | None, density: float) -> TrimThreshold | None:
    """The threshold stored for ``density`` (within DENSITY_TOLERANCE), or None."""
    if not table:
        return None
    exact = table.get(density)
    if exact is not None:
        return exact
    for key, value in table.items():
        if abs(key - density) <= DENSITY_TOLERANCE:
            return value
    return None


def kept_count(density: float, n: int) -> int:
    """The number of entries a magnitude trim keeps: max(1, int(density * n))."""
    return 0 if n == 0 else max(1, int(density * n))
