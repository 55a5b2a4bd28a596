"""Human sizes ("512MiB", "8GB", "1.5 GiB") parsed once, at the boundary."""

from __future__ import annotations

import re

from mergepipe.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, what: str = "size") -> int:
    """Return a byte count for ``text`` (an int, or a number with a unit).

    Decimal units (KB, MB, GB) are powers of 1000, binary ones (KiB, MiB,
    GiB) powers of 1024, as in the SI/IEC convention.
    """
    if isinstance(text, bool):
        raise ConfigError(f"{what}: expected a size like 512MiB, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"{what} must not be negative, got {text}")
        return text
    match = _SIZE_RE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{what}: cannot parse {text!r}; use bytes or a unit such as 512MiB, 8GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: int | float) -> str:
    """Format a byte count for people: 1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
