"""The plan's optional output fields ``out_shard_bytes`` and ``chat_template``
(mergepipe.spec.plan): absent from the JSON and the digest unless set, part of
both when set, read back strictly.

Plans without them keep their digests bit for bit: tests/golden pins those.
"""

from __future__ import annotations

import copy
import json

import pytest

from mergepipe.errors import PlanError
from mergepipe.spec.plan import Plan
from tests.spec.test_plan_json import make_plan, stored

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %} — é"


def test_unset_options_leave_the_json_and_digest_as_they_were():
    plan = make_plan()
    data = plan.to_json()
    assert "out_shard_bytes" not in data and "chat_template" not in data
    assert make_plan(out_shard_bytes=None, chat_template=None).digest == plan.digest


@pytest.mark.parametrize("options", [{"out_shard_bytes": 5_000_000_000}, {"chat_template": TEMPLATE},
                                     {"out_shard_bytes": 1, "chat_template": TEMPLATE}])
def test_set_options_round_trip_exactly(options):
    plan = make_plan(**options)
    text = plan.to_json_str()
    back = Plan.from_json(text)
    assert back == plan and back.digest == plan.digest and back.to_json_str() == text
    for key, value in options.items():
        assert json.loads(text)[key] == value
        assert getattr(back, key) == value


def test_each_option_and_its_value_enter_the_digest():
    digests = {
        make_plan().digest,
        make_plan(out_shard_bytes=5_000_000_000).digest,
        make_plan(out_shard_bytes=4_000_000_000).digest,
        make_plan(chat_template=TEMPLATE).digest,
        make_plan(chat_template=TEMPLATE + " ").digest,
        make_plan(out_shard_bytes=5_000_000_000, chat_template=TEMPLATE).digest,
    }
    assert len(digests) == 6


@pytest.mark.parametrize("key, value", [
    ("out_shard_bytes", 0), ("out_shard_bytes", -5), ("out_shard_bytes", True), ("out_shard_bytes", "5GB"),
    ("out_shard_bytes", 1.5), ("out_shard_bytes", None),
    ("chat_template", ""), ("chat_template", 3), ("chat_template", None), ("chat_template", ["{{ x }}"]),
])
def test_malformed_options_are_plan_errors(key, value):
    data = stored()
    data.pop("digest")
    data[key] = value
    with pytest.raises(PlanError, match="not a valid MergePipe plan"):
        Plan.from_json(json.dumps(data))
    with pytest.raises(PlanError, match="not a valid MergePipe plan"):
        Plan.from_json(copy.deepcopy(data))


@pytest.mark.parametrize("key, value", [("out_shard_bytes", 2_000_000_000), ("chat_template", TEMPLATE)])
def test_an_option_added_to_a_stored_plan_fails_its_digest(key, value):
    data = stored()
    data[key] = value
    with pytest.raises(PlanError, match="digest mismatch"):
        Plan.from_json(json.dumps(data))
