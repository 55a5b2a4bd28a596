"""What every merge method shares (torch only inside functions): ``MergeSpec``, parameters (``ParamDef``,
typed ``Params``), ``OperatorDef`` and ``register``, the trim-threshold contract, and what a kernel is given
(``BlockContext``, ``ElementRng``)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import keyword
import math
from dataclasses import KW_ONLY, dataclass
from functools import cache, cached_property
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Generic, Mapping, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from pydantic.dataclasses import dataclass as typed_dataclass
from pydantic_core import core_schema

from mergepipe.errors import ConfigError
from mergepipe.spec.canonical import one_line
from mergepipe.spec.settings import family, layer_index, resolve, setting_leaves

if TYPE_CHECKING:
    from torch import Tensor
else:
    Tensor = Any  # torch's tensor type: torch is imported where a kernel runs, never by this package


@typed_dataclass(frozen=True, config=ConfigDict(extra="forbid", defer_build=True))
class ExpertSpec:
    """One expert of a merge and its own parameter settings."""

    expert_id: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)


@typed_dataclass(frozen=True, config=ConfigDict(extra="forbid", defer_build=True))
class MergeSpec:
    """Operator name, experts in order (``(id, settings)`` pairs allowed), global settings, seed."""

    operator: Annotated[str, Field(min_length=1)]
    experts: tuple[ExpertSpec, ...]
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    seed: Annotated[int, Field(ge=0, strict=True)] = 0

    @field_validator("experts", mode="before")
    @classmethod
    def _pairs(cls, experts: Any) -> Any:
        if not isinstance(experts, tuple):
            return experts
        return tuple(ExpertSpec(e[0], dict(e[1]) if len(e) > 1 else {}) if isinstance(e, tuple) else e for e in experts)

    @property
    def expert_ids(self) -> tuple[str, ...]:
        return tuple(e.expert_id for e in self.experts)

    def expert(self, expert_id: str) -> ExpertSpec:
        for e in self.experts:
            if e.expert_id == expert_id:
                return e
        raise KeyError(f"expert {expert_id!r} is not part of this merge")

    def scalar_weight(self, expert_id: str) -> float:
        """The expert's weight as one number: its own, else the global one, else 1.0 (also for a per-tensor one)."""
        value = self.expert(expert_id).params.get("weight", self.params.get("weight", 1.0))
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 1.0

    def to_dict(self) -> dict[str, Any]:
        return _spec_adapter().dump_python(self, mode="json")

    @classmethod
    def from_dict(cls, data: Any) -> MergeSpec:
        try:
            return _spec_adapter().validate_python(data)
        except ValidationError as exc:
            raise ConfigError(one_line(exc, "malformed merge spec")) from None


@cache
def _spec_adapter() -> TypeAdapter[MergeSpec]:
    return TypeAdapter(MergeSpec)


@dataclass(frozen=True)
class ParamDef:
    """One parameter: a number in ``bounds`` as written (``(0, 1]``; '' for any) or one of ``choices``;
    ``flag``: the CLI takes ``--NAME``. As a field's ``Annotated`` metadata it is its validator (``coerce``)."""

    name: str
    doc: str
    bounds: str = ""
    kind: str = "real"  # real, int or bool (a choice has choices)
    scope: str = "global"  # or expert
    choices: tuple[str, ...] = ()
    flag: bool = False

    @property
    def attribute(self) -> str:
        return self.name + "_" if keyword.iskeyword(self.name) else self.name

    @property
    def range_text(self) -> str:
        return f"one of {', '.join(self.choices)}" if self.choices else f"in {self.bounds}" if self.bounds else ""

    def coerce(self, value: Any) -> Any:
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"{self.name} must be true or false, got {value!r}")
            return value
        if self.choices:
            hint = (
                " (mergekit's rescale: true means 'l1')" if self.name == "rescale" and isinstance(value, bool) else ""
            )
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
        if self.bounds:
            low, high = (float(end) for end in self.bounds[1:-1].split(", "))
            above = low < number if self.bounds[0] == "(" else low <= number
            if not (above and (number < high if self.bounds[-1] == ")" else number <= high)):
                raise ConfigError(f"{self.name} must be {self.range_text}, got {value!r}")
        return number

    def help(self) -> str:
        return f"{self.doc}{f' ({self.range_text})' if self.range_text else ''}."

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(self.coerce)


# The parameters most methods share; a method gives each field its default (mergekit 0.1.5's).
Weight = Annotated[float, ParamDef("weight", "Multiplier of the expert's delta", scope="expert")]
Density = Annotated[float, ParamDef("density", "Fraction of delta entries kept", "(0, 1]", scope="expert", flag=True)]
Lambda = Annotated[float, ParamDef("lambda", "Multiplier of the merged delta", flag=True)]
Normalize = Annotated[bool, ParamDef("normalize", "Divide by the sum of (agreeing) weights", kind="bool", flag=True)]


class Params(BaseModel):
    """Typed parameters: each field's type carries its ``ParamDef``; its alias is the user's name."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        populate_by_name=True,
        alias_generator=lambda name: name.rstrip("_"),
        defer_build=True,
    )

    @classmethod
    @cache  # per class: a plan resolves every tensor's parameters per expert
    def definitions(cls) -> tuple[ParamDef, ...]:
        return tuple(next(m for m in f.metadata if isinstance(m, ParamDef)) for f in cls.model_fields.values())

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(d.name for d in cls.definitions())

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True)


class NoParams(Params):
    """An operator (or scope) that takes no parameters."""


class Weighted(Params):
    weight: Weight = 1.0


class ScaledSum(Params):
    lambda_: Lambda = 1.0
    normalize: Normalize = False


class ScaledMean(ScaledSum):
    normalize: Normalize = True


E = TypeVar("E", bound=Params)
G = TypeVar("G", bound=Params)


@dataclass(frozen=True)
class TensorParams(Generic[E, G]):
    """An operator's parameters resolved for one tensor: one ``E`` per expert (spec order), one ``G``."""

    experts: tuple[E, ...]
    global_: G


ERROR_BOUNDS = ("exact", "separable", "consensus", "none")


class OperatorDef:
    """A merge method: its parameters, how it streams and bounds its error, its kernel (``@register``)."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""  # one line for the CLI's help
    #: mergekit 0.1.5 has this method, under the same name and with the same parameters.
    mergekit: ClassVar[bool] = True
    #: mergekit interpolates the models themselves (without a base_model, or always): the base is one of them.
    mergekit_points: ClassVar[bool] = False
    expert_params: ClassVar[type[Params]] = NoParams
    global_params: ClassVar[type[Params]] = NoParams
    #: False: needs whole tensors (planned all-or-nothing).
    streaming: ClassVar[bool] = True
    #: One of ``ERROR_BOUNDS`` (docs/ARCHITECTURE.md, Planning).
    error_bound: ClassVar[str] = "none"
    #: Negative weights refused (a weighted mean or a sign election).
    nonnegative_weights: ClassVar[bool] = False
    #: The kernel draws random numbers (keyed by seed, expert family and tensor).
    random: ClassVar[bool] = False
    #: Output = base·s + Σ ci·Δi with per-expert constants ci (``merge --delta-update``).
    delta_updatable: ClassVar[bool] = False
    min_experts: ClassVar[int] = 1
    max_experts: ClassVar[int | None] = None
    #: Added to the notes of a plan that leaves expert bytes unread.
    budget_note: ClassVar[str] = ""

    def validate(self, spec: MergeSpec, tensor_names: Sequence[str] = (), num_layers: int = 0) -> None:
        """ConfigError for anything wrong with ``spec``; ``check_tensor`` per tensor name, or without names
        where every model has one: once for scalars, at both ends of gradients."""
        n = len(spec.experts)
        if n < self.min_experts or (self.max_experts is not None and n > self.max_experts):
            raise ConfigError(f"{self.name} needs {self._count_phrase()}, got {n}")
        ids = spec.expert_ids
        if any(not e for e in ids):
            raise ConfigError(f"expert ids must be non-empty strings, got {list(ids)!r}")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"an expert is listed twice in {list(ids)!r}; list each expert once")
        for key, value in spec.params.items():
            self._check_setting(self._definition(key, None), value, "global parameters")
        for e in spec.experts:
            for key, value in e.params.items():
                self._check_setting(self._definition(key, e.expert_id), value, f"expert {e.expert_id!r}")
        settings = [*spec.params.values(), *(v for e in spec.experts for v in e.params.values())]
        if tensor_names:
            for name in tensor_names:
                self.check_tensor(self.resolve(spec, name, num_layers), name)
        elif all(isinstance(v, (bool, int, float, str)) for v in settings):
            self.check_tensor(self.resolve(spec, "", 0), "every tensor")
        elif not any(
            isinstance(v, Mapping) or (isinstance(v, (list, tuple)) and any(isinstance(x, Mapping) for x in v))
            for v in settings
        ):
            self.check_tensor(self.resolve(spec, "", 0), "the first layer (and the tensors outside the layers)")
            self.check_tensor(self.resolve(spec, "layers.1", 2), "the last layer")  # a gradient's end: t = 1

    def _definition(self, key: str, expert_id: str | None) -> ParamDef:
        by_name = {d.name: d for d in (*self.expert_params.definitions(), *self.global_params.definitions())}
        where = "" if expert_id is None else f" (expert {expert_id!r})"
        if key not in by_name:
            names = ", ".join([*self.expert_params.names(), *self.global_params.names()]) or "no parameters"
            raise ConfigError(f"{self.name} does not take parameter {key!r}{where}; it takes: {names}")
        if expert_id is not None and by_name[key].scope == "global":
            raise ConfigError(
                f"{key!r} is a global parameter of {self.name}; set it once for the merge, not for expert {expert_id!r}"
            )
        return by_name[key]

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
        exactly = "exactly" if self.max_experts == self.min_experts else "at least"
        return f"{exactly} {self.min_experts} expert{'s' if self.min_experts > 1 else ''}"

    def check_tensor(self, params: TensorParams, tensor_name: str) -> None:
        """ConfigError for a combination of resolved values invalid for this tensor."""

    def resolve(self, spec: MergeSpec, tensor_name: str, num_layers: int) -> TensorParams:
        """One tensor's typed parameters: an expert's own setting, else the global one, else the default."""
        layer = layer_index(tensor_name)

        def values(cls: type[Params], sources: Sequence[Mapping[str, Any]]) -> Params:
            out = {}
            for name in cls.names():
                for source in sources:
                    value = resolve(source[name], tensor_name, layer, num_layers) if name in source else None
                    if value is not None:
                        out[name] = value
                        break
            return cls.model_validate(out)

        experts = tuple(values(self.expert_params, (e.params, spec.params)) for e in spec.experts)
        return TensorParams(experts, values(self.global_params, (spec.params,)))

    def needs_thresholds(self, expert: Any) -> tuple[float, ...]:
        """Densities whose TrimThreshold this expert (one of ``expert_params``) needs per tensor."""
        return ()

    def streams_with(self, params: TensorParams, thresholds_available: bool) -> bool:
        """Whether this tensor merges block by block, given whether the catalog has its thresholds."""
        if not self.streaming:
            return False
        return thresholds_available or not any(self.needs_thresholds(p) for p in params.experts)

    def absent_neutral(self, params: TensorParams) -> bool:
        """Whether an expert not read for a block (``None``) takes no part in its result, bit for bit."""
        return False

    def keeps_base(self, params: TensorParams) -> bool:
        """Whether the output is the base where every Δ is 0 (a block no expert is read for is then copied)."""
        return True

    def beta(self, params: TensorParams) -> list[float]:
        """Per-expert multiplier of the error bound (>= 0, or inf: no bound)."""
        return [math.inf] * len(params.experts)

    def kernel(self, base: Tensor, deltas: list[Tensor | None], ctx: BlockContext) -> Tensor:
        """The merged fp32 block (``kernels.merge`` checks it); a ``None`` delta was not read: Δ = 0."""
        raise NotImplementedError


REGISTERED: dict[str, OperatorDef] = {}
D = TypeVar("D", bound=type[OperatorDef])


def register(cls: D) -> D:
    REGISTERED[cls.name] = cls()
    return cls


def linear_coefficients(
    weights: Sequence[float], lam: float, normalize: bool, op_name: str, tensor_name: str = "this tensor"
) -> list[float]:
    """``ci = λ wi / Σw`` (normalize) or ``λ wi``, in float64, Σw exactly rounded (``math.fsum``)."""
    if not normalize:
        return [lam * w for w in weights]
    total = math.fsum(weights)
    if abs(total) < 1e-8:
        raise ConfigError(
            f"{op_name}: the expert weights sum to {total!r} for {tensor_name}, so they cannot be "
            "normalised; change the weights or set normalize: false"
        )
    return [lam * w / total for w in weights]


#: Densities analysed per (expert, tensor); an off-grid density is trimmed at tensor level.
DENSITY_GRID: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
#: Densities this close are one grid point (gamma + density = 0.1 + 0.2 must find 0.3).
DENSITY_TOLERANCE = 1e-9


@typed_dataclass(frozen=True, config=ConfigDict(defer_build=True))
class TrimThreshold:
    """Where to cut |Δ| of one tensor to keep its top ``k`` entries: keep ``|Δj| > tau``, or
    ``|Δj| == tau`` at flat index ``j <= last_index``."""

    density: float
    k: int
    tau: float
    last_index: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrimThreshold:
        return cls(**data)


def find_threshold(table: Mapping[float, TrimThreshold] | None, density: float) -> TrimThreshold | None:
    if not table:
        return None
    exact = table.get(density)
    if exact is not None:
        return exact
    return next((value for key, value in table.items() if abs(key - density) <= DENSITY_TOLERANCE), None)


def kept_count(density: float, n: int) -> int:
    return 0 if n == 0 else max(1, int(density * n))


class ElementRng:
    """Random numbers addressed by element, the same on every device and for any split of a range: element
    j of (seed, expert, tensor) is raw word j of Philox-4x64-10 (numpy) keyed by the first 128 bits of
    sha256(json([seed, expert, tensor])); its top 53 bits make the uniform ``(w >> 11) * 2**-53``."""

    def __init__(self, seed: int, expert_id: str, tensor_name: str) -> None:
        blob = json.dumps([seed, str(expert_id), str(tensor_name)], ensure_ascii=True).encode()
        self._key = int.from_bytes(hashlib.sha256(blob).digest()[:16], "little")

    def bits(self, flat_start: int, count: int, device: Any = None) -> Tensor:
        """53 random bits per element (int64 in [0, 2**53)) of elements ``flat_start ..``, on ``device``."""
        import numpy as np
        import torch

        if count == 0:
            return torch.zeros(0, dtype=torch.int64, device=device)
        counter, skip = divmod(flat_start, 4)  # four 64-bit words per counter value
        words = np.random.Philox(key=self._key, counter=counter).random_raw(skip + count)[skip:]
        raw = torch.from_numpy(np.ascontiguousarray(words).view(np.int64)).to(device)
        return (raw >> 11) & ((1 << 53) - 1)  # int64 shifts are arithmetic: the mask makes it logical


@dataclass(frozen=True)
class BlockContext:
    """What a kernel knows about its block besides the fp32 base and deltas: per expert (spec order) its
    parameters, catalog trim thresholds (missing: computed from the whole tensor) and random stream (of its
    family); ``owns_deltas``: the kernel may overwrite the deltas."""

    definition: OperatorDef
    tensor_name: str
    shape: Sequence[int]
    expert_ids: Sequence[str]
    params: TensorParams
    _: KW_ONLY
    seed: int = 0
    thresholds: Sequence[Mapping[float, TrimThreshold] | None] | None = None
    owns_deltas: bool = False
    row_start: int = 0

    def for_rows(self, row_start: int) -> BlockContext:
        block = copy.copy(self)
        object.__setattr__(block, "row_start", row_start)
        return block

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) >= 2 else self.numel

    @property
    def flat_start(self) -> int:
        return self.row_start * self.row_numel

    @cached_property
    def order(self) -> tuple[int, ...]:
        """Expert indices sorted by id: every sum over experts runs in this order."""
        return tuple(sorted(range(len(self.expert_ids)), key=lambda i: self.expert_ids[i]))

    @cached_property
    def rngs(self) -> tuple[ElementRng, ...]:
        return tuple(ElementRng(self.seed, family(e), self.tensor_name) for e in self.expert_ids)

    def threshold(self, expert: int, density: float) -> TrimThreshold | None:
        return find_threshold(self.thresholds[expert] if self.thresholds else None, density)

    def is_whole(self, block: Tensor) -> bool:
        return self.row_start == 0 and block.numel() == self.numel
