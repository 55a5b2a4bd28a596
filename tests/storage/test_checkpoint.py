"""Opening checkpoint directories: single file, indexed shards, unindexed shards."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mergepipe.errors import CheckpointError, CorruptCheckpointError
from mergepipe.storage.checkpoint import open_checkpoint
from tests.fixtures.checkpoints import checkpoint_files, load_tensors


def test_open_matches_safetensors(any_checkpoint):
    ckpt = open_checkpoint(any_checkpoint)
    expected = load_tensors(any_checkpoint)
    assert ckpt.root == any_checkpoint
    assert [f.name for f in ckpt.files] == [p.name for p in checkpoint_files(any_checkpoint)]
    assert set(ckpt.tensor_files) == set(expected)
    assert layout(ckpt) == {
        name: (safe_dtype(any_checkpoint, ckpt.tensor_files[name], name), tuple(t.shape))
        for name, t in expected.items()
    }
    assert ckpt.total_bytes == sum(t.numel() * t.element_size() for t in expected.values())
    assert sum(f.size for f in ckpt.files) == sum(p.stat().st_size for p in checkpoint_files(any_checkpoint))
    assert len(ckpt.tensor_files) == len(expected)
    assert ckpt.config == json.loads((any_checkpoint / "config.json").read_text())
    for file in ckpt.files:
        st = os.stat(file.path)
        assert (file.size, file.mtime_ns) == (st.st_size, st.st_mtime_ns)
        with safe_open(str(file.path), framework="pt") as handle:
            assert set(file.header.tensors) == set(handle.keys())


def layout(ckpt) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor, from the opened headers."""
    return {entry.name: (entry.dtype, tuple(entry.shape)) for _, entry in ckpt.iter_tensors()}


def safe_dtype(root, file_name, tensor):
    with safe_open(str(root / file_name), framework="pt") as handle:
        return handle.get_slice(tensor).get_dtype()


def test_iteration_order_is_file_then_offset(any_checkpoint):
    ckpt = open_checkpoint(any_checkpoint)
    pairs = list(ckpt.iter_tensors())
    assert [e.name for _, e in pairs] == list(ckpt.tensor_files)
    keys = [(f.name, e.begin) for f, e in pairs]
    assert keys == sorted(keys)
    for file, entry in pairs:
        assert ckpt.file_of(entry.name) is file
        assert ckpt.tensor(entry.name) == entry
        assert ckpt.tensor_files[entry.name] == file.name
        assert ckpt.file(file.name) is file


def test_sharded_index_kept(checkpoint_factory):
    root = checkpoint_factory("qwen3", "bf16", True)
    ckpt = open_checkpoint(root)
    assert len(ckpt.files) > 1
    assert ckpt.index == json.loads((root / "model.safetensors.index.json").read_text())
    assert dict(sorted(ckpt.tensor_files.items())) == dict(sorted(ckpt.index["weight_map"].items()))


def test_single_file_has_no_index(checkpoint_factory):
    ckpt = open_checkpoint(checkpoint_factory("llama", "bf16", False))
    assert [f.name for f in ckpt.files] == ["model.safetensors"]
    assert ckpt.index is None


def test_aux_files(tmp_path, checkpoint_factory):
    root = shutil.copytree(checkpoint_factory("qwen3", "bf16", True), tmp_path / "c")
    (root / "manifest.json").write_text("{}")
    (root / ".gitattributes").write_text("")
    (root / "tokenizer.json").write_text("{}")
    (root / "chat_template.jinja").write_text("{{ x }}")
    (root / "subdir").mkdir()
    for other_weights in ("pytorch_model.bin", "training_args.bin", "model.gguf", "tf_model.h5", "flax_model.msgpack"):
        (root / other_weights).write_bytes(b"\0" * 16)  # the base's weights in another format: no side file
    ckpt = open_checkpoint(root)
    assert ckpt.aux_files == (
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    )


def test_unknown_tensor_raises_key_error(checkpoint_factory):
    ckpt = open_checkpoint(checkpoint_factory("llama", "bf16", False))
    with pytest.raises(KeyError):
        ckpt.tensor("nope")


def test_symlinked_files_are_followed(tmp_path, checkpoint_factory):
    source = checkpoint_factory("llama", "bf16", False)
    root = tmp_path / "links"
    root.mkdir()
    for p in source.iterdir():
        (root / p.name).symlink_to(p)
    ckpt = open_checkpoint(root)
    assert layout(ckpt) == layout(open_checkpoint(source))
    assert [f.size for f in ckpt.files] == [f.size for f in open_checkpoint(source).files]
    assert "config.json" in ckpt.aux_files


def test_unindexed_shards_accepted(tmp_path, checkpoint_factory):
    root = shutil.copytree(checkpoint_factory("qwen3", "bf16", True), tmp_path / "c")
    (root / "model.safetensors.index.json").unlink()
    ckpt = open_checkpoint(root)
    assert len(ckpt.files) == len(checkpoint_files(root)) > 1
    assert set(ckpt.tensor_files) == set(load_tensors(root))


def test_single_file_wins_over_stray_safetensors(tmp_path, checkpoint_factory):
    root = shutil.copytree(checkpoint_factory("llama", "bf16", False), tmp_path / "c")
    save_file({"other": torch.zeros(3)}, str(root / "consolidated.safetensors"))
    ckpt = open_checkpoint(root)
    assert [f.name for f in ckpt.files] == ["model.safetensors"]
    assert "other" not in ckpt.tensor_files
    assert "consolidated.safetensors" not in ckpt.aux_files


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(tmp_path / "absent")
    assert "no such checkpoint directory" in str(info.value)
    assert "absent" in str(info.value)


def test_file_instead_of_directory(checkpoint_factory):
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        open_checkpoint(checkpoint_factory("llama", "bf16", False) / "model.safetensors")


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(tmp_path)
    assert not isinstance(info.value, CorruptCheckpointError)
    assert "model.safetensors" in str(info.value)


def test_no_config_is_none(tmp_path):
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.config is None and ckpt.aux_files == ()
