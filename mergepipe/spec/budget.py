"""Expert-I/O budgets: parsed once at the boundary, resolved against a plan.

A budget is the most bytes one execution may read from expert files. People
give it as bytes (``1073741824``), a size with a unit (``906MB``, ``8GiB``),
a fraction of the full expert read (``25%``), or ``none``/``full`` (no limit).
A bare number is bytes only when it is a whole number of at least 1: ``0.25``
(which people mean as 25%) is refused with that suggestion, not read as 0 bytes.

A budget may also be a time (``20s``, ``1.5min``, ``1h``), alone or with a
byte budget (``20s,8GiB``, ``20s,25%``): the planner converts the seconds into
bytes through this machine's measured rates (``planner/seconds.py``), and the
tighter of the two wins.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mergepipe.errors import BudgetError, ConfigError
from mergepipe.sizes import parse_size

_UNLIMITED_WORDS = {"none", "full", "all", "unlimited", "inf"}
_BARE_NUMBER = re.compile(r"^(\d+\.?\d*|\.\d+)$")
_TIME = re.compile(r"^(\d+\.?\d*|\.\d+)\s*(s|sec|secs|seconds?|min|mins|minutes?|h|hours?)$", re.I)
_SECONDS_PER = {"s": 1.0, "m": 60.0, "h": 3600.0}  # by the unit's first letter


@dataclass(frozen=True)
class Budget:
    """A parsed budget: at most one of ``bytes`` or ``fraction`` is set (neither: no byte limit), and
    ``seconds`` when it has a time part."""

    text: str
    bytes: int | None = None
    fraction: float | None = None
    seconds: float | None = None

    @property
    def unlimited(self) -> bool:
        return self.bytes is None and self.fraction is None and self.seconds is None

    def resolve(self, full_expert_bytes: int) -> int:
        """The byte part of the budget, in bytes, for a merge whose full expert read is given (the time
        part is the planner's: ``planner/seconds.py``)."""
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
    if "," in text or _TIME.match(text):
        return _with_time(text)
    return _parse_bytes(text)


def _with_time(text: str) -> Budget:
    """A budget with a time part: ``20s`` alone, or with one byte budget (``20s,8GiB``, ``8GiB,20s``)."""
    parts = [p.strip() for p in text.split(",")]
    times = [p for p in parts if _TIME.match(p)]
    others = [p for p in parts if not _TIME.match(p)]
    if len(parts) > 2 or len(times) != 1 or any(p.lower() in _UNLIMITED_WORDS or not p for p in others):
        raise BudgetError(f"budget {text!r}: give a time (20s, 2min), a byte budget (8GiB, 25%), or one of each "
                          "separated by a comma (20s,8GiB)")
    match = _TIME.match(times[0])
    assert match is not None
    seconds = float(match.group(1)) * _SECONDS_PER[match.group(2)[0].lower()]
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
