"""Strict readers for the fields of stored JSON (plans, manifests).

A plan or manifest read back from disk or the catalog must be exactly what
was written: a missing key, an unknown key (a typo) or a value of the wrong
type is an error naming the field, never a silent default. Each reader
raises ``ValueError``; the caller turns it into the error of its domain
(``PlanError``, ``VerifyError``) with advice.
"""

from __future__ import annotations

import math
from typing import Any, Iterable


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
