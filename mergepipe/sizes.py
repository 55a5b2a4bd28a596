"""Human sizes ("512MiB", "8GB", "1.5 GiB") parsed once, at the boundary; byte counts formatted for people."""

from __future__ import annotations

import re

from mergepipe.errors import ConfigError

#: Decimal units (KB, MB) are powers of 1000, binary ones (KiB, MiB) powers of 1024 (SI/IEC).
_UNITS = {"": 1, "b": 1} | {
    prefix + suffix: base**power
    for power, prefix in enumerate("kmgt", 1)
    for suffix, base in (("", 1000), ("b", 1000), ("ib", 1024))
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, what: str = "size") -> int:
    """A byte count for ``text``: an int, or a number with a unit."""
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
    """1536 -> '1.5 KiB'."""
    value = float(n)
    if abs(value) < 1024:
        return f"{value:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if abs(value) < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"
