"""Output shard layouts (mergepipe.storage.checkpoint): Hugging Face's packing and names.

The reference is ``huggingface_hub.split_torch_state_dict_into_shards`` itself
wherever its convention and ours agree (no tensor larger than the limit), and
hand-written expectations where ours keeps the base's order instead.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards

from mergepipe.storage.checkpoint import open_checkpoint
from mergepipe.storage.checkpoint import index_text, mirror_layout, pack_shards, packed_layout, shard_name
from tests.planner.support import raw_layout


def hub_shards(sizes: list[tuple[str, int]], limit: int) -> dict[str, list[str]]:
    state = {name: torch.zeros(n, dtype=torch.uint8) for name, n in sizes}
    return split_torch_state_dict_into_shards(state, max_shard_size=limit).filename_to_tensors


def test_the_documented_example_of_huggingface_hub():
    """Its docs: sizes [6, 6, 2, 6, 2, 2] (GB) under 10 become [6], [6+2], [6+2+2]."""
    sizes = [(f"t{i}", n) for i, n in enumerate([6, 6, 2, 6, 2, 2])]
    assert pack_shards(sizes, 10) == [["t0"], ["t1", "t2"], ["t3", "t4", "t5"]]


@pytest.mark.parametrize("seed", range(20))
def test_packing_and_names_are_huggingface_hubs_when_no_tensor_exceeds_the_limit(seed):
    rng = random.Random(seed)
    limit = rng.randint(10, 200)
    # no empty tensors here: huggingface_hub groups tensors by storage, and empty ones look shared to it
    sizes = [(f"t{i:03d}", rng.randint(1, limit)) for i in range(rng.randint(1, 40))]
    layout = packed_layout(sizes, limit)
    expected = hub_shards(sizes, limit)
    assert {f.name: list(f.tensors) for f in layout.files} == expected
    assert [f.name for f in layout.files] == sorted(expected)
    assert layout.indexed == (len(expected) > 1)


def test_a_tensor_larger_than_the_limit_is_alone_in_its_place():
    sizes = [("a", 2), ("big", 12), ("b", 2), ("c", 3), ("huge", 50), ("d", 1)]
    assert pack_shards(sizes, 10) == [["a"], ["big"], ["b", "c"], ["huge"], ["d"]]
    # the same tensors and the same oversized shards as huggingface_hub, in the base's order
    assert sorted(map(sorted, pack_shards(sizes, 10))) != sorted(map(sorted, hub_shards(sizes, 10).values()))
    assert {"big", "huge"} <= {t for shard in hub_shards(sizes, 10).values() if len(shard) == 1 for t in shard}


def test_a_limit_of_one_byte_puts_every_tensor_alone_and_empty_tensors_fit_anywhere():
    assert pack_shards([("a", 4), ("e", 0), ("b", 4)], 1) == [["a"], ["e"], ["b"]]
    assert pack_shards([("e", 0), ("f", 0)], 1) == [["e", "f"]]
    assert pack_shards([], 10) == [[]]
    with pytest.raises(ValueError, match="at least 1"):
        pack_shards([("a", 1)], 0)


def test_names_are_huggingface_five_digit_names_or_model_safetensors_alone():
    assert shard_name(1, 1) == "model.safetensors"
    assert shard_name(2, 3) == "model-00002-of-00003.safetensors"
    assert [f.name for f in packed_layout([("a", 5), ("b", 5)], 100).files] == ["model.safetensors"]
    assert not packed_layout([("a", 5), ("b", 5)], 100).indexed


def test_the_index_lists_every_tensor_sorted_with_the_total_size():
    layout = packed_layout([("z", 6), ("a", 6), ("m", 2)], 10, {"format": "pt"})
    index = json.loads(index_text(layout, 14))
    assert index == {"metadata": {"total_size": 14},
                     "weight_map": {"a": "model-00002-of-00002.safetensors", "m": "model-00002-of-00002.safetensors",
                                    "z": "model-00001-of-00002.safetensors"}}
    assert list(index["weight_map"]) == ["a", "m", "z"]
    assert all(f.metadata == {"format": "pt"} for f in layout.files)


def test_the_mirror_layout_is_the_checkpoints_own(sharded_family):
    base = sharded_family["base"]
    layout = mirror_layout(open_checkpoint(base))
    raw = raw_layout(base)
    by_file: dict[str, list[tuple[int, str]]] = {}
    for t in raw.values():
        by_file.setdefault(t.file.name, []).append((t.begin, t.name))
    assert {f.name: list(f.tensors) for f in layout.files} == {k: [n for _, n in sorted(v)] for k, v in by_file.items()}
    assert layout.indexed and (base / "model.safetensors.index.json").exists()
    assert json.loads((base / "model.safetensors.index.json").read_text())["weight_map"] == layout.weight_map()
