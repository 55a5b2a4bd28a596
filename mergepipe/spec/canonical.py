"""The one canonical JSON encoding behind every MergePipe hash.

Plan digests, manifest hashes and snapshot ids are sha256 over these bytes, so
two processes, machines or Python versions that hold equal values must produce
identical bytes. The rules:

- UTF-8, object keys sorted by code point, no whitespace (``,`` and ``:``).
- Keys must be strings: ``{1: x}`` and ``{"1": x}`` would otherwise collide.
- Floats use Python's ``repr`` (the shortest string that round-trips); NaN and
  infinities are rejected with ``ValueError`` because JSON has no spelling for
  them. ``1`` and ``1.0`` stay distinct: callers coerce types before hashing.
- Tuples encode as lists; dataclasses encode through their ``to_json()``.
- Anything else (sets, bytes, numpy integers, arbitrary objects) is a
  ``TypeError``: a silent ``str()`` fallback would make hashes depend on reprs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Iterable, Sequence


def normalise(obj: Any) -> Any:
    """Return ``obj`` as plain JSON values (dict/list/str/int/float/bool/None).

    Validates on the way down, so an error names the offending path.
    """
    return _normalise(obj, "$")


def _normalise(obj: Any, where: str) -> Any:
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)  # int subclasses (IntEnum) encode as their value
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise ValueError(f"canonical JSON has no NaN or infinity (at {where}: {obj!r})")
        return float(obj)  # numpy.float64 is a float subclass; encode as float
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"canonical JSON keys must be str, got {type(key).__name__} at {where}")
            out[key] = _normalise(value, f"{where}.{key}")
        return out
    if isinstance(obj, (list, tuple)):
        return [_normalise(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        to_json = getattr(obj, "to_json", None)
        if to_json is None:
            raise TypeError(
                f"dataclass {type(obj).__name__} at {where} has no to_json(); "
                "define one so its canonical form is explicit"
            )
        return _normalise(to_json(), where)
    raise TypeError(f"cannot encode {type(obj).__name__} at {where} as canonical JSON")


def canonical_json(obj: Any) -> bytes:
    """Encode ``obj`` as canonical JSON bytes (see the module docstring)."""
    return json.dumps(
        normalise(obj),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    ).encode("utf-8")


def sha256_hex(data: bytes) -> str:
    """Lower-case hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def digest(obj: Any) -> str:
    """sha256 hex of ``canonical_json(obj)``: the digest of a value."""
    return sha256_hex(canonical_json(obj))


def keys(data: Any, required: Iterable[str], what: str, optional: Iterable[str] = ()) -> dict:
    """``data`` as a dict with exactly the ``required`` keys (plus any ``optional`` ones)."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(data).__name__}")
    required, optional = set(required), set(optional)
    missing = sorted(required - data.keys())
    unknown = sorted(data.keys() - required - optional)
    if missing:
        raise ValueError(f"{what} is missing {', '.join(missing)}")
    if unknown:
        raise ValueError(f"{what} has unknown field(s) {', '.join(unknown)}")
    return data


def text(value: Any, what: str) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    return value


def optional_text(value: Any, what: str) -> str | None:
    return None if value is None else text(value, what)


def integer(value: Any, what: str, minimum: int | None = 0) -> int:
    """An int (not a bool), at least ``minimum`` unless that is None."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return int(value)


def number(value: Any, what: str) -> float:
    """A finite float; ints are widened so ``1`` and ``1.0`` hash the same."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number, got {value!r}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return result


def optional_number(value: Any, what: str) -> float | None:
    return None if value is None else number(value, what)


def array(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a JSON list, got {type(value).__name__}")
    return value


def mapping(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _check_index(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return int(value)


def compress_indices(indices: Iterable[int]) -> list[list[int]]:
    """Sorted, de-duplicated indices as canonical inclusive ``[first, last]`` ranges."""
    ordered = sorted({_check_index(i, "block index") for i in indices})
    ranges: list[list[int]] = []
    for index in ordered:
        if ranges and index == ranges[-1][1] + 1:
            ranges[-1][1] = index
        else:
            ranges.append([index, index])
    return ranges


def expand_ranges(ranges: Iterable[Sequence[int]]) -> list[int]:
    """Sorted, de-duplicated indices covered by inclusive ``[first, last]`` ranges.

    Accepts ranges in any order (overlaps are merged); rejects anything that is
    not a pair of non-negative ints with ``first <= last``.
    """
    covered: set[int] = set()
    for pair in ranges:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"a block range must be [first, last], got {pair!r}")
        first = _check_index(pair[0], "range start")
        last = _check_index(pair[1], "range end")
        if first > last:
            raise ValueError(f"a block range must have first <= last, got {list(pair)!r}")
        covered.update(range(first, last + 1))
    return sorted(covered)


def canonical_ranges(ranges: Iterable[Sequence[int]]) -> list[list[int]]:
    """The canonical spelling of any valid range list."""
    return compress_indices(expand_ranges(ranges))
