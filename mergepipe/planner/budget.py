"""Expert-I/O budgets: parsed once at the boundary, resolved against a plan.

A budget is the most bytes one execution may read from expert files. People
give it as bytes (``1073741824``), a size with a unit (``906MB``, ``8GiB``),
a fraction of the full expert read (``25%``), or ``none``/``full`` (no limit).
A bare number is bytes only when it is a whole number of at least 1: ``0.25``
(which people mean as 25%) is refused with that suggestion, not read as 0 bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mergepipe.errors import BudgetError, ConfigError
from mergepipe.units import parse_size

_UNLIMITED_WORDS = {"none", "full", "all", "unlimited", "inf"}
_BARE_NUMBER = re.compile(r"^(\d+\.?\d*|\.\d+)$")


@dataclass(frozen=True)
class Budget:
    """A parsed budget: exactly one of ``bytes`` or ``fraction`` is set, or
    neither (unlimited)."""

    text: str
    bytes: int | None = None
    fraction: float | None = None

    @property
    def unlimited(self) -> bool:
        return self.bytes is None and self.fraction is None

    def resolve(self, full_expert_bytes: int) -> int:
        """The budget in bytes for a merge whose full expert read is given."""
        if self.bytes is not None:
            return self.bytes
        if self.fraction is not None:
            # floor: the budget is a hard upper limit, never rounded up
            return int(self.fraction * full_expert_bytes)
        return full_expert_bytes


def parse_budget(value: str | int | float | None) -> Budget:
    """Parse a budget given on the CLI or through the Python API."""
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
        if percent == 100:
            return Budget(text=text)
        return Budget(text=text, fraction=percent / 100)
    if _BARE_NUMBER.match(text) and (not text.isdigit() or int(text) < 1):
        raise _bare_number_error(text, float(text))
    try:
        return Budget(text=text, bytes=parse_size(text, what="budget"))
    except ConfigError as exc:
        raise BudgetError(str(exc)) from None


def _bare_number_error(text: str, number: float) -> BudgetError:
    hint = f"{number * 100:g}%" if 0 < number < 1 else f"{number:g}%" if number <= 100 else f"{math.floor(number)}B"
    return BudgetError(f"budget {text!r} has no unit: a bare number is a count of bytes and must be a whole number "
                       f">= 1; did you mean {hint}? (or give a unit: 0B, 906MB, 8GiB)")
