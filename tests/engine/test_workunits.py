"""Cutting a merge into work units (mergepipe.engine.job.cut_units).

Units must cover the output exactly: every tensor of every shard once, in
file order, a tensor never split (tensor-level operators need it whole),
each unit inside one shard (it writes one shard file). Expectations come
from the safetensors headers parsed independently (tests/planner/support.py).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from mergepipe.engine.job import DEFAULT_UNIT_BYTES, cut_units
from mergepipe.storage.checkpoint import open_checkpoint
from tests.planner.support import raw_layout

TARGETS = [1, 3000, 16_000, 40_000, 10**9]


def file_order(directory) -> dict[str, list[str]]:
    """Shard name -> its tensors in data-offset order, from the raw headers."""
    out: dict[str, list[tuple[int, str]]] = {}
    for t in raw_layout(directory).values():
        out.setdefault(t.file.name, []).append((t.begin, t.name))
    return {shard: [name for _, name in sorted(entries)] for shard, entries in out.items()}


@pytest.fixture(params=["tiny_family", "sharded_family"])
def base_dir(request):
    return request.getfixturevalue(request.param)["base"]


@pytest.mark.parametrize("target", TARGETS)
def test_units_cover_every_tensor_once_in_file_order(base_dir, target):
    units = cut_units(open_checkpoint(base_dir), target)
    expected = file_order(base_dir)
    assert [u.index for u in units] == list(range(len(units)))
    # each shard's units are consecutive, and together list its tensors in file order
    shards = [u.shard for u in units]
    runs = [s for i, s in enumerate(shards) if i == 0 or shards[i - 1] != s]
    assert sorted(runs) == sorted(expected)  # one run of units per shard, every shard
    assert {s: [t for u in units if u.shard == s for t in u.tensors] for s in expected} == expected


@pytest.mark.parametrize("target", TARGETS)
def test_a_unit_is_one_shard_sized_to_the_target(base_dir, target):
    layout = raw_layout(base_dir)
    units = cut_units(open_checkpoint(base_dir), target)
    last_of_shard = {u.shard: u.index for u in units}
    for u in units:
        assert u.tensors, u
        assert {layout[t].file.name for t in u.tensors} == {u.shard}
        assert u.nbytes == sum(layout[t].nbytes for t in u.tensors)
        # a unit closes as soon as it reaches the target...
        assert sum(layout[t].nbytes for t in u.tensors[:-1]) < target
        # ...and stays below it only at the end of its shard or before a tensor that fills a unit alone
        assert (u.nbytes >= target or u.index == last_of_shard[u.shard]
                or layout[units[u.index + 1].tensors[0]].nbytes >= target)


def test_the_default_target_makes_one_unit_per_shard_of_a_small_model(sharded_family):
    units = cut_units(open_checkpoint(sharded_family["base"]))
    assert DEFAULT_UNIT_BYTES == 256 * 1024 * 1024
    assert [u.shard for u in units] == sorted(file_order(sharded_family["base"]))


def test_a_target_of_one_byte_puts_every_tensor_alone(tiny_family):
    units = cut_units(open_checkpoint(tiny_family["base"]), 1)
    assert [u.tensors for u in units] == [(t,) for t in file_order(tiny_family["base"])["model.safetensors"]]


@pytest.fixture
def small_big_small(tmp_path):
    """One shard: an 8-byte tensor, a 4000-byte one, an 8-byte one (names sort in that order)."""
    save_file({"a": torch.zeros(2), "b": torch.zeros(1000), "c": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_a_tensor_larger_than_the_target_is_a_unit_of_its_own(small_big_small):
    units = cut_units(open_checkpoint(small_big_small), 100)
    assert [u.tensors for u in units] == [("a",), ("b",), ("c",)]
    assert [u.nbytes for u in units] == [8, 4000, 8]


def test_small_tensors_group_until_the_target(small_big_small):
    """A target above every tensor groups them all."""
    units = cut_units(open_checkpoint(small_big_small), 5000)
    assert [(u.tensors, u.nbytes) for u in units] == [(("a", "b", "c"), 4016)]


@pytest.mark.parametrize("target", [0, -1])
def test_a_target_of_zero_or_less_is_refused(tiny_family, target):
    with pytest.raises(ValueError, match="target_bytes must be positive"):
        cut_units(open_checkpoint(tiny_family["base"]), target)
