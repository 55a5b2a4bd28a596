"""The plans store: plans by digest or unique prefix, and their clean-up."""

from __future__ import annotations

import pytest

from mergepipe.errors import PlanError


def test_plans_round_trip_by_prefix(catalog):
    catalog.plans.save("abc123", '{"a": 1}')
    catalog.plans.save("abd456", '{"b": 2}')
    catalog.plans.save("abc123", '{"other": "ignored"}')  # same digest: no-op
    assert catalog.plans.get("abc123") == '{"a": 1}'
    assert catalog.plans.get("abd") == '{"b": 2}'
    assert [p.id for p in catalog.plans.list()] == ["abc123", "abd456"]
    with pytest.raises(PlanError, match="matches several plans"):
        catalog.plans.get("ab")
    with pytest.raises(PlanError, match="unknown plan 'zz'"):
        catalog.plans.get("zz")
    with pytest.raises(PlanError, match="unknown plan"):
        catalog.plans.get("")


@pytest.mark.parametrize(
    "query, found",
    [("abc123", "abc123"), ("abc1", "abc123"), ("abd", "abd456"), ("abd456", "abd456"),
     ("zz", None), ("", None), ("abc1234", None), ("bc", None)],
)
def test_find_gives_the_full_digest_or_none(catalog, query, found):
    catalog.plans.save("abc123", "{}")
    catalog.plans.save("abd456", "{}")
    assert catalog.plans.find(query) == found


@pytest.mark.parametrize("prefix", ["a", "ab"])
def test_find_refuses_an_ambiguous_prefix(catalog, prefix):
    catalog.plans.save("abc123", "{}")
    catalog.plans.save("abd456", "{}")
    with pytest.raises(PlanError, match=f"plan prefix '{prefix}' matches several plans; give more characters"):
        catalog.plans.find(prefix)


def test_a_full_id_that_prefixes_another_is_exact(catalog):
    catalog.plans.save("abc", '{"short": 1}')
    catalog.plans.save("abcdef", '{"long": 1}')
    assert catalog.plans.find("abc") == "abc"
    assert catalog.plans.get("abc") == '{"short": 1}'
    with pytest.raises(PlanError, match="matches several"):
        catalog.plans.find("ab")


def test_prefix_is_not_a_pattern(catalog):
    """Prefixes match literally: SQL wildcards in a query match nothing."""
    catalog.plans.save("abc123", "{}")
    for query in ("%", "a%", "_bc", "ab_"):
        assert catalog.plans.find(query) is None


def test_a_plan_removed_after_it_was_found_is_unknown(catalog, monkeypatch):
    """``get`` finds the digest, then reads the plan: one removed in between (a concurrent ``gc --plans``) is the
    usual PlanError, not a crash."""
    monkeypatch.setattr(catalog.plans, "find", lambda plan_id: "gone123")
    with pytest.raises(PlanError, match="unknown plan 'gone'"):
        catalog.plans.get("gone")
