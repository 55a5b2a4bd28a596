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
from typing import Any

__all__ = ["canonical_json", "normalise", "sha256_hex", "digest"]


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
