"""Budget parsing: bytes, unit strings, fractions of the full expert read, none."""

from __future__ import annotations

import pytest

from mergepipe.errors import BudgetError
from mergepipe.spec.request import parse_budget
from mergepipe.spec.request import MergeRequest

FULL = 1_000_003  # a full expert read that no percentage divides evenly


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (1024, 1024),
        ("1024", 1024),
        ("906MB", 906_000_000),
        ("906 MB", 906_000_000),
        ("8GiB", 8 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1.5KiB", 1536),
    ],
)
def test_absolute_budgets_resolve_to_bytes_whatever_the_full_read(text, expected):
    budget = parse_budget(text)
    assert not budget.unlimited
    assert budget.resolve(FULL) == expected
    assert budget.resolve(10) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("25%", int(0.25 * FULL)),
        ("12.5%", int(0.125 * FULL)),
        ("0%", 0),
        ("99.9%", int(0.999 * FULL)),
    ],
)
def test_percentages_are_floored_fractions_of_the_full_read(text, expected):
    assert parse_budget(text).resolve(FULL) == expected
    assert parse_budget(text).resolve(FULL) <= FULL


@pytest.mark.parametrize("text", [None, "none", "NONE", "100%", "full"])
def test_unlimited_budgets_resolve_to_the_full_read(text):
    budget = parse_budget(text)
    assert budget.unlimited
    assert budget.resolve(FULL) == FULL


@pytest.mark.parametrize(
    "value",
    [-1, -0.5, "-1", "-5MB", "-10%", "12 parsecs", "abc", "", "%", "x%", "101%", "1e3", "5 MB MB", True, "nan%"],
)
def test_negative_or_garbage_budgets_are_budget_errors(value):
    with pytest.raises(BudgetError) as info:
        parse_budget(value)
    message = str(info.value)
    assert "\n" not in message and "budget" in message.lower()


@pytest.mark.parametrize(("value", "hint"), [("0.25", "25%"), (".5", "50%"), ("0", "0%"), ("1.5", "1.5%"),
                                             (0.25, "25%"), ("0.", "0%")])
def test_bare_numbers_that_are_not_whole_bytes_are_refused_with_a_suggestion(value, hint):
    with pytest.raises(BudgetError, match=f"has no unit.*did you mean {hint}\\?"):
        parse_budget(value)
    assert parse_budget("0B").resolve(FULL) == 0 and parse_budget("1").resolve(FULL) == 1


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_numbers_are_budget_errors(value):
    with pytest.raises(BudgetError):
        parse_budget(value)


def test_a_request_parses_its_budget_once():
    assert MergeRequest(base="b", experts=["e"], budget="25%").budget == parse_budget("25%")
    assert MergeRequest(base="b", experts=["e"], budget=1024).budget.bytes == 1024
    assert MergeRequest(base="b", experts=["e"]).budget.text == "100%"
    with pytest.raises(BudgetError):
        MergeRequest(base="b", experts=["e"], budget=-1)
