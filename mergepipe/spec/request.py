"""``MergeRequest``, the one merge request (flags, config files, recipes and Python all build it), and the
budget, dtype and shard sizes it parses."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.dataclasses import dataclass

from mergepipe.errors import BudgetError, ConfigError
from mergepipe.sizes import parse_size
from mergepipe.spec.canonical import STORED, one_line
from mergepipe.spec.copy_map import PASSTHROUGH, LayerSlice
from mergepipe.spec.operators import ExpertSpec, MergeSpec, canonical_name, validate_spec
from mergepipe.spec.settings import pinned

_UNLIMITED_WORDS = {"none", "full", "all", "unlimited", "inf"}
_BARE_NUMBER = re.compile(r"^(\d+\.?\d*|\.\d+)$")
_TIME = re.compile(r"^(\d+\.?\d*|\.\d+)\s*(s|sec|secs|seconds?|min|mins|minutes?|h|hours?)$", re.I)
_SECONDS_PER = {"s": 1.0, "m": 60.0, "h": 3600.0}  # by the unit's first letter


@dataclass(frozen=True, config=STORED)
class Budget:
    """A parsed budget: ``bytes`` or ``fraction`` (neither: no byte limit), and ``seconds`` for a time part."""

    text: str
    bytes: int | None = None
    fraction: float | None = None
    seconds: float | None = None

    @property
    def unlimited(self) -> bool:
        return self.bytes is None and self.fraction is None and self.seconds is None

    def resolve(self, full_expert_bytes: int) -> int:
        """The byte part in bytes, for a merge of this full expert read (the time part: ``planner.resolve_budget``)."""
        if self.bytes is not None:
            return self.bytes
        if self.fraction is not None:
            return int(self.fraction * full_expert_bytes)  # floor: a hard upper limit
        return full_expert_bytes


def parse_budget(value: str | int | float | None) -> Budget:
    """A budget as given on the command line or in Python: bytes, a size, a percentage, none, a time."""
    if value is None:
        return Budget(text="none")
    if isinstance(value, bool):
        raise BudgetError(f"budget: expected bytes, a size like 8GiB or a percentage, got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise BudgetError(f"budget must be a finite number of bytes, got {value}")
        if value < 0:
            raise BudgetError(f"budget must not be negative, got {value}")
        if isinstance(value, float) and not value.is_integer():
            raise _bare_number_error(str(value), value)
        return Budget(text=str(value), bytes=int(value))
    text = str(value).strip()
    if "," not in text and not _TIME.match(text):
        return _parse_bytes(text)
    parts = [p.strip() for p in text.split(",")]  # a time alone, or with one byte budget (20s,8GiB)
    times = [p for p in parts if _TIME.match(p)]
    others = [p for p in parts if not _TIME.match(p)]
    if len(parts) > 2 or len(times) != 1 or any(p.lower() in _UNLIMITED_WORDS or not p for p in others):
        raise BudgetError(
            f"budget {text!r}: give a time (20s, 2min), a byte budget (8GiB, 25%), or one of each "
            "separated by a comma (20s,8GiB)"
        )
    number, unit = _TIME.match(times[0]).groups()  # type: ignore[union-attr]
    seconds = float(number) * _SECONDS_PER[unit[0].lower()]
    if not 0 < seconds < math.inf:
        raise BudgetError(f"a time budget must be more than 0 seconds, got {times[0]!r}")
    limit = _parse_bytes(others[0]) if others else Budget(text=text)
    return Budget(text=text, bytes=limit.bytes, fraction=limit.fraction, seconds=seconds)


def _parse_bytes(text: str) -> Budget:
    if text.lower() in _UNLIMITED_WORDS:
        return Budget(text=text.lower())
    if text.startswith("-"):
        raise BudgetError(f"budget must not be negative, got {text!r}")
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise BudgetError(f"budget: cannot parse {text!r}; use e.g. 25%, 906MB, 8GiB or none") from None
        if not 0 <= percent <= 100:
            raise BudgetError(f"budget percentage must be between 0% and 100%, got {text!r}")
        return Budget(text=text) if percent == 100 else Budget(text=text, fraction=percent / 100)
    if _BARE_NUMBER.match(text) and (not text.isdigit() or int(text) < 1):
        raise _bare_number_error(text, float(text))
    try:
        return Budget(text=text, bytes=parse_size(text, what="budget"))
    except ConfigError as exc:
        raise BudgetError(str(exc)) from None


def _bare_number_error(text: str, number: float) -> BudgetError:
    hint = f"{number * 100:g}%" if 0 < number < 1 else f"{number:g}%" if number <= 100 else f"{math.floor(number)}B"
    return BudgetError(
        f"budget {text!r} has no unit: a bare number is a count of bytes and must be a whole number "
        f">= 1; did you mean {hint}? (or give a unit: 0B, 906MB, 8GiB)"
    )


#: A budget field: parsed from what a person writes (a stored request's budget is the parsed one, a dict).
BudgetField = Annotated[Budget, BeforeValidator(lambda v: v if isinstance(v, (Budget, dict)) else parse_budget(v))]

#: How a budget may be spent (``planner/policies.py``).
Policy = Literal["energy", "uniform", "full", "entries"]
POLICIES: tuple[str, ...] = get_args(Policy)
#: The dtypes a merge computes from and writes (``storage.format.MERGEABLE_DTYPES``; a test keeps them equal).
OUTPUT_DTYPES = ("BF16", "F16", "F32")
_DTYPE_ALIASES = {
    **dict.fromkeys(("bf16", "bfloat16"), "BF16"),
    **dict.fromkeys(("f16", "fp16", "float16", "half"), "F16"),
    **dict.fromkeys(("f32", "fp32", "float32", "float"), "F32"),
}


class StrictModel(BaseModel):
    """A frozen model without unknown keys whose every failure is one ``ConfigError`` naming the key."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    what: ClassVar[str] = "request"

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(one_line(exc, self.what)) from None


def parse_out_dtype(value: str | None) -> str | None:
    """An output dtype as its safetensors name (``bf16`` -> ``BF16``); None keeps the base's."""
    if value is None:
        return None
    key = str(value).strip()
    dtype = _DTYPE_ALIASES.get(key.lower(), key.upper())
    if dtype not in OUTPUT_DTYPES:
        raise ConfigError(f"the output dtype must be one of bf16, f16, f32, got {value!r}")
    return dtype


def parse_shard_bytes(value: Any, what: str = "--out-shard-size") -> int | None:
    """A largest-shard size in bytes; a bare number or a ``B`` size under 1 MiB is refused (in mergekit
    ``5B`` is five billion bytes)."""
    if value is None:
        return None
    size = parse_size(value, what)
    text = str(value).strip()
    if size < 1 or (text.lower().lstrip("0123456789.").strip() in ("", "b") and size < 1 << 20):
        raise ConfigError(
            f"{what} {value!r} is {size} bytes; give a unit, e.g. {text.rstrip('bB').strip()}GB (mergekit's B "
            "means billions of bytes)"
        )
    return size


def _operator(name: Any) -> str:
    return PASSTHROUGH if str(name).strip().lower() == PASSTHROUGH else canonical_name(name)


class MergeRequest(StrictModel):
    """A merge as asked for: references and parameter settings as written."""

    what: ClassVar[str] = "merge request"

    base: str = Field(min_length=1)
    #: The models merged into the base, or a passthrough's slice models other than the base.
    experts: tuple[str, ...] = ()
    operator: Annotated[str, BeforeValidator(_operator)] = "ties"
    #: One weight per expert, in order (each expert's ``weight`` parameter).
    weights: tuple[float, ...] | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    #: Per-expert parameter settings, keyed by the reference as written.
    expert_params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    seed: int = Field(0, ge=0, strict=True)
    budget: BudgetField = Field(default_factory=lambda: parse_budget("100%"))
    #: None: ``entries`` when the budget is below a full read, the operator merges entry by entry and every
    #: expert has a delta store against the base; else ``energy``.
    policy: Policy | None = None
    #: None keeps each tensor's base dtype.
    out_dtype: Annotated[str | None, BeforeValidator(parse_out_dtype)] = None
    #: The largest output shard in bytes; None mirrors the base's files.
    out_shard_bytes: int | None = None
    chat_template: str | None = None
    copy_tokenizer: bool = True
    #: Merge incrementally from this snapshot (a snapshot id, or a merged model id: its latest version).
    previous: str | None = None
    delta_update: bool = False
    #: The merged model's id in the catalog (a merge needs one; a plan does not).
    model_id: str | None = None
    #: The block size of a catalog this request creates (an existing catalog must match).
    block_bytes: Annotated[int | None, BeforeValidator(lambda v: parse_size(v, "block_bytes"))] = None
    #: N of a mergekit config's ``slices:`` whose sources all cover layers [0, N): the base must have N layers.
    slice_layers: int | None = Field(None, ge=1, strict=True)
    #: A passthrough's slices (``spec/copy_map.py``); None for a merge.
    slices: tuple[LayerSlice, ...] | None = None
    #: What a translation (a mergekit config) changed or ignored, for the user.
    notes: tuple[str, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _none_is_the_default(cls, data: Any) -> Any:
        # a field given as None takes its default (``budget=None`` is no limit, its own meaning)
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k == "budget"}
        return data

    @field_validator("out_shard_bytes", mode="before")
    @classmethod
    def _shard_bytes(cls, value: Any) -> int | None:
        if isinstance(value, str):
            return parse_shard_bytes(value, "the output shard size")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"the output shard size must be a whole number of bytes, at least 1 (e.g. 5GB), got {value!r}"
            )
        return value

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ConfigError("the chat template must be the non-empty text of a Jinja template")
        return value

    @model_validator(mode="after")
    def _whole(self) -> MergeRequest:
        if self.weights is not None and len(self.weights) != len(self.experts):
            raise ConfigError(f"got {len(self.weights)} weights for {len(self.experts)} experts; give one per expert")
        if len(set(self.experts)) != len(self.experts):
            raise ConfigError(f"an expert is listed twice in {list(self.experts)!r}; list each expert once")
        if self.base in self.experts:
            raise ConfigError(f"model {self.base!r} is both the base and an expert; list it once")
        if self.delta_update and self.previous is None:
            raise ConfigError("--delta-update updates a previous merge: give --from SNAPSHOT too")
        if self.operator == PASSTHROUGH or self.slices is not None:
            self._check_passthrough()
        elif not self.experts:
            raise ConfigError(f"{self.what}: experts: give at least one expert to merge into the base")
        else:
            self.check_operator()
        return self

    def _check_passthrough(self) -> None:
        if self.operator != PASSTHROUGH or not self.slices:
            raise ConfigError(
                "slices (layers stacked from several models) need the operator passthrough, and "
                "passthrough needs slices (a mergekit config's `slices:`)"
            )
        models = {s.model for s in self.slices} - {self.base}
        if set(self.experts) != models:
            raise ConfigError(
                f"a passthrough's experts are its slices' models other than the base "
                f"({', '.join(sorted(models)) or 'none'}), got {', '.join(self.experts) or 'none'}"
            )
        if self.params or self.expert_params or self.weights:
            raise ConfigError(
                "passthrough copies tensors as they are: it takes no parameters or weights (mergekit's "
                "`scale` is not supported yet)"
            )
        if self.previous is not None:
            raise ConfigError("--from does not apply to a passthrough: it copies every tensor its slices name")

    def check_operator(self, tensor_names: Sequence[str] = (), num_layers: int = 0) -> None:
        """``OperatorDef.validate`` of the settings (parameters keyed by another spelling of an expert: once
        it is resolved)."""
        if self.operator == PASSTHROUGH:
            return
        written = {k: v for k, v in self.expert_params.items() if k in self.experts}
        validate_spec(
            self.model_copy(update={"expert_params": written}).spec({ref: ref for ref in self.experts}),
            tensor_names,
            num_layers,
        )

    def spec(self, exact: Mapping[str, str]) -> MergeSpec:
        """The merge with each reference replaced by its id (``exact``) and the weights folded in."""
        by_id = {exact[ref]: ref for ref in self.experts}
        params = {}
        for key, settings in self.expert_params.items():
            expert = exact.get(key, key)
            if expert not in by_id:
                raise ConfigError(f"parameters given for {key!r}, which is not among the experts")
            params[expert] = dict(settings)
        experts = []
        for i, ref in enumerate(self.experts):
            own = dict(params.get(exact[ref], {}))
            if self.weights is not None:
                own["weight"] = float(self.weights[i])
            experts.append(ExpertSpec(exact[ref], own))
        return MergeSpec(self.operator, tuple(experts), dict(self.params), self.seed)

    def with_refs(
        self,
        base: str,
        experts: tuple[str, ...],
        expert_params: dict[str, dict[str, Any]],
        slices: tuple[LayerSlice, ...] | None = None,
    ) -> MergeRequest:
        update = {"base": base, "experts": experts, "expert_params": expert_params}
        return self.model_copy(update={**update, "slices": slices if slices is not None else self.slices})

    def changed(self, **changes: Any) -> MergeRequest:
        """This request with ``changes`` as a person writes them (``budget="50%"``), checked again as a whole."""
        return type(self)(**{**self.model_dump(), **changes})

    def pinned(self, exact: Mapping[str, str]) -> MergeRequest:
        """The request naming each model by its exact version (``exact``: reference -> stored id)."""

        def ref(written: str) -> str:
            return pinned(exact.get(written, written))

        slices = None if self.slices is None else tuple(replace(s, model=ref(s.model)) for s in self.slices)
        params = {ref(k): v for k, v in self.expert_params.items()}
        return self.with_refs(ref(self.base), tuple(map(ref, self.experts)), params, slices)
