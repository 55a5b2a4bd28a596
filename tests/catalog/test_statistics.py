"""Per-tensor statistics as the catalog returns them: thresholds parsed only when looked at."""

from __future__ import annotations

import json
import pickle

import pytest

from mergepipe.catalog.statistics import StoredThresholds
from mergepipe.spec.operators import TrimThreshold, find_threshold

ROWS = [{"density": 0.1, "k": 3, "tau": 0.25, "last_index": 17},
        {"density": 0.3, "k": 9, "tau": 0.125, "last_index": 4}]


def test_stored_thresholds_read_as_the_json_they_were_stored_from():
    table = StoredThresholds(json.dumps(ROWS))
    expected = {r["density"]: TrimThreshold(r["density"], r["k"], r["tau"], r["last_index"]) for r in ROWS}
    assert dict(table) == expected and table == expected
    assert list(table) == [0.1, 0.3] and len(table) == 2
    assert table[0.3] == TrimThreshold(0.3, 9, 0.125, 4)
    assert find_threshold(table, 0.1 + 0.2) == TrimThreshold(0.3, 9, 0.125, 4)  # 0.30000000000000004
    assert find_threshold(table, 0.5) is None


def test_a_tensor_without_thresholds_is_an_empty_table():
    assert len(StoredThresholds(None)) == 0 and dict(StoredThresholds(None)) == {}
    assert find_threshold(StoredThresholds(None), 0.1) is None


def test_malformed_text_fails_only_when_the_table_is_read():
    table = StoredThresholds("not json")  # a plan of task arithmetic never reads it
    with pytest.raises(json.JSONDecodeError):
        len(table)


def test_pickles_as_its_stored_text():
    table = StoredThresholds(json.dumps(ROWS))
    assert table[0.1].k == 3  # parsed before pickling: the copy is the same either way
    copy = pickle.loads(pickle.dumps(table))
    assert isinstance(copy, StoredThresholds) and dict(copy) == dict(table)


def test_block_norms_are_each_tensors_block_l2_in_block_order_none_where_identical(family_catalog):
    """On both backends (PostgreSQL aggregates each tensor's norms into one array on the server): the values
    recorded, in block order whatever the order written, ``None`` for identical blocks, 0.0 for a missing l2."""
    from mergepipe.catalog.records import BlockDelta

    tensors = [t.name for t in family_catalog.models.tensors("base")][:3]
    recorded = {name: [(i, None if i % 3 == 0 else 0.5 * i + len(name), i % 4 == 1) for i in range(7)]
                for name in tensors}
    deltas = [BlockDelta(name, i, l2, 1.0, 5, identical) for name, rows in recorded.items()
              for i, l2, identical in reversed(rows)]
    family_catalog.stats.record("e1", "base", deltas, [])
    expected = {name: [None if identical else (0.0 if l2 is None else l2) for _, l2, identical in rows]
                for name, rows in recorded.items()}
    assert family_catalog.stats.block_norms("e1", "base") == expected
