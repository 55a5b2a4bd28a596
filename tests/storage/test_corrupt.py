"""Damaged safetensors files and indexes: each one is rejected with a useful line."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from mergepipe.errors import CheckpointError, CorruptCheckpointError
from mergepipe.storage.checkpoint import open_checkpoint
from mergepipe.storage.format import MAX_HEADER_BYTES, read_header
from tests.fixtures.checkpoints import write_raw_safetensors


def entry(dtype="F32", shape=(2, 2), offsets=(0, 16)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def assert_corrupt(path, *fragments):
    with pytest.raises(CorruptCheckpointError) as info:
        read_header(path)
    message = str(info.value)
    assert str(path) in message
    assert "re-download or re-export" in message
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    return message


def test_missing_file_is_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError) as info:
        read_header(tmp_path / "nope.safetensors")
    assert not isinstance(info.value, CorruptCheckpointError)
    assert "nope.safetensors" in str(info.value)


def test_shorter_than_prefix(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01\x02\x03")
    assert_corrupt(path, "shorter than the 8-byte")


def test_truncated_data(tmp_path):
    path = write_raw_safetensors(tmp_path / "t.safetensors", {"w": entry()}, b"\0" * 10)
    assert_corrupt(path, "data section is 10 bytes")


def test_trailing_bytes(tmp_path):
    path = write_raw_safetensors(tmp_path / "t.safetensors", {"w": entry()}, b"\0" * 20)
    assert_corrupt(path, "data section is 20 bytes")


def test_header_length_past_eof(tmp_path):
    path = write_raw_safetensors(tmp_path / "t.safetensors", {"w": entry()}, b"\0" * 16, header_len=5000)
    assert_corrupt(path, "past the end of the file")


def test_header_length_zero(tmp_path):
    path = tmp_path / "zero.safetensors"
    path.write_bytes(struct.pack("<Q", 0) + b"{}")
    assert_corrupt(path, "header length is 0")


def test_header_length_over_limit(tmp_path):
    # Only the 8-byte prefix: a reader that trusted the length would try to allocate 200 MB.
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 200_000_000))
    assert_corrupt(path, str(MAX_HEADER_BYTES))


def test_non_json_header(tmp_path):
    path = tmp_path / "t.safetensors"
    blob = b"this is not json"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)
    assert_corrupt(path, "not valid JSON")


@pytest.mark.parametrize("opener", [b"[", b'{"a":'])
def test_deeply_nested_header_is_corrupt_not_a_recursion_error(tmp_path, opener):
    """200,000 nested brackets made json recurse past Python's limit: a traceback."""
    path = tmp_path / "t.safetensors"
    blob = opener * 200_000
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)
    assert_corrupt(path, "too deeply")


def test_non_utf8_header(tmp_path):
    path = tmp_path / "t.safetensors"
    blob = b'{"\xff": 1}'
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)
    assert_corrupt(path, "UTF-8")


def test_header_not_an_object(tmp_path):
    path = tmp_path / "t.safetensors"
    blob = b"[1, 2]"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)
    assert_corrupt(path, "not an object")


def test_duplicate_key(tmp_path):
    path = tmp_path / "t.safetensors"
    one = json.dumps(entry())
    blob = ('{"w": %s, "w": %s}' % (one, one)).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * 16)
    assert_corrupt(path, "'w' twice")


def test_unknown_dtype(tmp_path):
    path = write_raw_safetensors(tmp_path / "t.safetensors", {"w": entry(dtype="F12")}, b"\0" * 16)
    assert_corrupt(path, "'w'", "unknown dtype 'F12'")


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ("not a dict", "entry is not an object"),
        ({"dtype": "F32", "shape": [4]}, "entry is not an object"),
        (entry(shape=(2, -2)), "shape"),
        (entry(shape=(True, 4)), "shape"),
        (entry(shape=(2.0, 2)), "shape"),
        ({"dtype": "F32", "shape": [2, 2], "data_offsets": [0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]}, "data_offsets"),
    ],
)
def test_bad_entry(tmp_path, bad, fragment):
    path = write_raw_safetensors(tmp_path / "t.safetensors", {"w": bad}, b"\0" * 16)
    assert_corrupt(path, "'w'", fragment)


def test_wrong_byte_length_for_shape(tmp_path):
    path = write_raw_safetensors(tmp_path / "t.safetensors", {"w": entry(shape=(2, 3))}, b"\0" * 16)
    assert_corrupt(path, "'w'", "needs 24")


def test_overlapping_offsets(tmp_path):
    header = {"a": entry(offsets=(0, 16)), "b": entry(offsets=(8, 24))}
    path = write_raw_safetensors(tmp_path / "t.safetensors", header, b"\0" * 24)
    assert_corrupt(path, "'b'", "overlap")


def test_gapped_offsets(tmp_path):
    header = {"a": entry(offsets=(0, 16)), "b": entry(offsets=(20, 36))}
    path = write_raw_safetensors(tmp_path / "t.safetensors", header, b"\0" * 36)
    assert_corrupt(path, "'b'", "gap")


def test_data_not_starting_at_zero(tmp_path):
    path = write_raw_safetensors(tmp_path / "t.safetensors", {"a": entry(offsets=(4, 20))}, b"\0" * 20)
    assert_corrupt(path, "'a'", "gap")


@pytest.mark.parametrize("metadata", ["text", {"k": 1}, ["a"]])
def test_bad_metadata(tmp_path, metadata):
    header = {"__metadata__": metadata, "w": entry()}
    path = write_raw_safetensors(tmp_path / "t.safetensors", header, b"\0" * 16)
    assert_corrupt(path, "__metadata__")


# -- checkpoint-level corruption ------------------------------------------


@pytest.fixture()
def sharded_copy(tmp_path, checkpoint_factory):
    source = checkpoint_factory("qwen3", "bf16", True)
    return shutil.copytree(source, tmp_path / "copy")


def load_index(ckpt):
    return json.loads((ckpt / "model.safetensors.index.json").read_text())


def save_index(ckpt, index):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


def test_index_points_to_missing_shard(sharded_copy):
    shard = sorted(sharded_copy.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CorruptCheckpointError) as info:
        open_checkpoint(sharded_copy)
    assert shard.name in str(info.value)
    assert "missing" in str(info.value)


def test_tensor_in_index_absent_from_shard(sharded_copy):
    index = load_index(sharded_copy)
    first_shard = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.layers.9.ghost.weight"] = first_shard
    save_index(sharded_copy, index)
    with pytest.raises(CorruptCheckpointError) as info:
        open_checkpoint(sharded_copy)
    assert "model.layers.9.ghost.weight" in str(info.value)
    assert first_shard in str(info.value)


def test_tensor_in_wrong_shard_of_index(sharded_copy):
    index = load_index(sharded_copy)
    shards = list(index["weight_map"].values())
    name, home = next((n, s) for n, s in sorted(index["weight_map"].items()) if shards.count(s) > 1)
    index["weight_map"][name] = next(s for s in shards if s != home)
    save_index(sharded_copy, index)
    with pytest.raises(CorruptCheckpointError, match="listed in shard"):
        open_checkpoint(sharded_copy)


def test_tensor_in_shard_missing_from_index(sharded_copy):
    index = load_index(sharded_copy)
    shards = list(index["weight_map"].values())
    # a tensor whose shard holds others too, so the shard stays in the index
    name = next(n for n, s in sorted(index["weight_map"].items()) if shards.count(s) > 1)
    del index["weight_map"][name]
    save_index(sharded_copy, index)
    with pytest.raises(CorruptCheckpointError) as info:
        open_checkpoint(sharded_copy)
    assert name in str(info.value) and "weight_map" in str(info.value)


def test_shard_left_out_of_index(sharded_copy):
    index = load_index(sharded_copy)
    shards = list(index["weight_map"].values())
    lonely = next(s for s in shards if shards.count(s) == 1)
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if s != lonely}
    save_index(sharded_copy, index)
    with pytest.raises(CorruptCheckpointError) as info:
        open_checkpoint(sharded_copy)
    assert lonely in str(info.value)


@pytest.mark.parametrize("text", ["{not json", "[]", '{"metadata": {}}', '{"weight_map": {"w": "../x.safetensors"}}'])
def test_bad_index(sharded_copy, text):
    (sharded_copy / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CorruptCheckpointError) as info:
        open_checkpoint(sharded_copy)
    assert "model.safetensors.index.json" in str(info.value)


def test_corrupt_shard_named_in_error(sharded_copy):
    shard = sorted(sharded_copy.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-3])
    with pytest.raises(CorruptCheckpointError) as info:
        open_checkpoint(sharded_copy)
    assert str(shard) in str(info.value)


def test_invalid_config_json(tmp_path, checkpoint_factory):
    ckpt = shutil.copytree(checkpoint_factory("llama", "bf16", False), tmp_path / "copy")
    (ckpt / "config.json").write_text("{oops")
    with pytest.raises(CorruptCheckpointError) as info:
        open_checkpoint(ckpt)
    assert "config.json" in str(info.value)


def test_duplicate_tensor_across_unindexed_shards(tmp_path):
    ckpt = tmp_path / "dup"
    ckpt.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        write_raw_safetensors(ckpt / name, {"w": entry()}, b"\0" * 16)
    with pytest.raises(CorruptCheckpointError) as info:
        open_checkpoint(ckpt)
    assert "'w'" in str(info.value) and "a.safetensors" in str(info.value)
