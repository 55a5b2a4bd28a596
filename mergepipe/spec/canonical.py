"""Canonical JSON, the one encoding behind every hash (UTF-8, keys sorted, no whitespace, shortest float
``repr``, NaN refused); ``Stored``, the JSON and strict reading of every stored shape; block-index ranges."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from typing import Annotated, Any, TypeVar

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    Strict,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_serializer,
)

#: The pydantic config of every stored shape (each a frozen pydantic dataclass): unknown keys refused; a
#: field stored under another key (its alias) is given by its name in Python; NaN kept for ``canonical_json``
#: to refuse.
STORED = ConfigDict(extra="forbid", populate_by_name=True, ser_json_inf_nan="constants")
Text = Annotated[str, Strict(), Field(min_length=1)]
Count = Annotated[int, Strict(), Field(ge=0)]
Positive = Annotated[int, Strict(), Field(ge=1)]
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]


def canonical_json(obj: Any) -> bytes:
    _check_keys(obj)
    try:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        raise ValueError(f"canonical JSON has no NaN or infinity ({exc})") from None
    return text.encode("utf-8")


def _check_keys(obj: Any) -> None:
    """``{1: x}`` and ``{"1": x}`` would encode alike: keys must be strings."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"canonical JSON keys must be str, got {key!r}")
            _check_keys(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _check_keys(value)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest(obj: Any) -> str:
    """sha256 hex of ``canonical_json(obj)``."""
    return sha256_hex(canonical_json(obj))


def one_line(exc: ValidationError, what: str = "") -> str:
    """The first problem of a pydantic error as ``what: key: problem (got value)``."""
    first = exc.errors(include_url=False)[0]
    key = ".".join(str(part) for part in first["loc"])
    head = f"{what}: " if what else ""
    if first["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        return f"{head}unknown key {key!r}"
    if first["type"] in ("missing", "missing_argument"):
        return f"{head}{key} is missing"
    got = first.get("input")
    message = str(first["msg"]).removeprefix("Value error, ")
    shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
    return f"{head}{key}: {message}{shown}" if key else f"{head}{message}{shown}"


S = TypeVar("S", bound="Stored")
_adapter: Callable[[type], TypeAdapter[Any]] = cache(TypeAdapter)  # one per stored shape


class Stored:
    """A stored shape's JSON (``to_json``) and its strict reading (``from_json``: a ``ValidationError``)."""

    def to_json(self) -> dict[str, Any]:
        return _adapter(type(self)).dump_python(self, mode="json", by_alias=True)

    @classmethod
    def from_json(cls: type[S], data: Any) -> S:
        return _adapter(cls).validate_python(data, context={"stored": True})


def when_set(**defaults: Any) -> Any:
    """A wrap serializer for a stored shape's body (``_write = when_set(...)``): fields holding these defaults
    are left out, so that shapes without them are stored (and hashed) as before the fields existed."""

    def write(self: Any, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if k not in defaults or v != defaults[k]}

    return model_serializer(mode="wrap")(write)


def reading(read: Callable[[Any], Any]) -> BeforeValidator:
    """``Annotated`` metadata: a field's stored form read back by ``read`` in ``from_json`` (Python callers
    give the value itself); a stored value of the wrong shape is a ``ValueError``."""

    def before(value: Any, info: ValidationInfo) -> Any:
        if not info.context:
            return value
        try:
            return read(value)
        except (TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"not as stored ({exc})") from None

    return BeforeValidator(before)


def compress_indices(indices: Iterable[int]) -> list[list[int]]:
    """Sorted, de-duplicated indices as canonical inclusive ``[first, last]`` ranges."""
    ranges: list[list[int]] = []
    for index in sorted(set(_index(i) for i in indices)):
        if ranges and index == ranges[-1][1] + 1:
            ranges[-1][1] = index
        else:
            ranges.append([index, index])
    return ranges


def expand_ranges(ranges: Iterable[Sequence[int]]) -> list[int]:
    """Sorted, de-duplicated indices covered by ``[first, last]`` ranges (any order, overlaps merged)."""
    covered: set[int] = set()
    for pair in ranges:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or _index(pair[0]) > _index(pair[1]):
            raise ValueError(f"a block range must be [first, last] with first <= last, got {pair!r}")
        covered.update(range(pair[0], pair[1] + 1))
    return sorted(covered)


def canonical_ranges(ranges: Iterable[Sequence[int]]) -> list[list[int]]:
    return compress_indices(expand_ranges(ranges))


def _index(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a block index must be an int >= 0, got {value!r}")
    return value
