"""Canonical JSON (mergepipe.spec.canonical): the one encoding behind plan digests and manifest hashes."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mergepipe.spec.canonical import canonical_json, digest, sha256_hex
from tests.manifest.factories import json_values


def test_keys_sorted_and_no_whitespace():
    assert canonical_json({"b": 1, "a": {"d": [1, 2], "c": None}}) == b'{"a":{"c":null,"d":[1,2]},"b":1}'


def test_keys_sorted_by_code_point_and_utf8_raw():
    assert canonical_json({"é": 1, "z": 2, "A": 3}) == '{"A":3,"z":2,"é":1}'.encode()


@pytest.mark.parametrize(("value", "text"), [
    (0.1, "0.1"), (1.0, "1.0"), (-0.0, "-0.0"), (1e16, "1e+16"), (1.5e-7, "1.5e-07"),
    (123456789.125, "123456789.125"), (1 / 3, repr(1 / 3)),
])
def test_float_is_shortest_round_trip_repr(value, text):
    assert canonical_json(value) == text.encode()


def test_int_and_float_stay_distinct():
    assert canonical_json(1) == b"1" and canonical_json(1.0) == b"1.0"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, {"a": [1, math.nan]}])
def test_nan_and_infinity_rejected(bad):
    with pytest.raises(ValueError, match="NaN or infinity"):
        canonical_json(bad)


def test_tuples_are_lists():
    assert canonical_json({"t": (1, (2, 3))}) == canonical_json({"t": [1, [2, 3]]}) == b'{"t":[1,[2,3]]}'


def test_a_dataclass_is_not_encoded():
    """Stored shapes are dumped to plain values first (``Stored.to_json``): no object's repr is hashed."""

    @dataclass
    class Bare:
        x: int

    with pytest.raises(TypeError):
        canonical_json(Bare(1))


@pytest.mark.parametrize("bad", [{1: "a"}, {"a": {2, 3}}, b"bytes", object()])
def test_unencodable_values_rejected(bad):
    with pytest.raises(TypeError):
        canonical_json(bad)


def test_digest_is_sha256_of_canonical_bytes():
    obj = {"b": [1.5, "x"], "a": None}
    assert digest(obj) == sha256_hex(canonical_json(obj)) == hashlib.sha256(canonical_json(obj)).hexdigest()


@given(json_values)
def test_round_trip_and_idempotent(value):
    data = canonical_json(value)
    assert json.loads(data) == value
    assert canonical_json(json.loads(data)) == data


@given(st.dictionaries(st.text(max_size=5), json_values, max_size=6))
def test_insertion_order_does_not_matter(mapping):
    reversed_mapping = dict(reversed(list(mapping.items())))
    assert canonical_json(reversed_mapping) == canonical_json(mapping)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_every_finite_float_round_trips_exactly(value):
    data = canonical_json(value)
    assert data == repr(value).encode()
    assert float(data) == value and math.copysign(1, float(data)) == math.copysign(1, value)
