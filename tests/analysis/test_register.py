"""register_model: what is recorded, idempotence and refusals, from raw headers."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from mergepipe.analysis.experts import checkpoint_files as described_files
from mergepipe.analysis.experts import describe_checkpoint, layout_fingerprint
from mergepipe.analysis.register import check_model_id, register_model
from mergepipe.errors import CatalogError, CheckpointError, ConfigError
from mergepipe.storage.checkpoint import open_checkpoint
from tests.catalog.conftest import SMALL_BLOCK_BYTES
from tests.catalog.helpers import block_rows, db_dump, raw_header
from tests.fixtures.checkpoints import (
    checkpoint_files,
    make_base,
    write_raw_safetensors,
)

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}


def _expected_tensors(ckpt: Path) -> dict[str, tuple[str, str, list[int], int, int]]:
    """name -> (file, dtype, shape, absolute begin, absolute end), from raw headers."""
    out = {}
    for f in checkpoint_files(ckpt):
        n, header = raw_header(f)
        header.pop("__metadata__", None)
        for name, info in header.items():
            b, e = info["data_offsets"]
            out[name] = (f.name, info["dtype"], info["shape"], 8 + n + b, 8 + n + e)
    return out


@pytest.mark.parametrize("family", ["tiny_family", "sharded_family"])
def test_register_records_tensors_blocks_and_files(catalog, family, request):
    ckpt = request.getfixturevalue(family)["base"]
    record = register_model(catalog, "base", ckpt)

    expected = _expected_tensors(ckpt)
    tensors = catalog.models.tensors("base")
    assert {t.name: (t.file, t.dtype, list(t.shape), t.begin, t.end) for t in tensors} == expected
    # ordinal order is file order, then offset order
    assert [t.ordinal for t in tensors] == list(range(len(tensors)))
    assert [(t.file, t.begin) for t in tensors] == sorted((t.file, t.begin) for t in tensors)

    blocks = catalog.blocks.by_tensor("base")
    for t in tensors:
        rows = block_rows(list(t.shape), ITEMSIZE[t.dtype], SMALL_BLOCK_BYTES)
        got = blocks[t.name]
        assert [(b.index, b.row_start, b.row_end) for b in got] == [(i, r0, r1) for i, (r0, r1) in enumerate(rows)]
        assert got[0].begin == t.begin and got[-1].end == t.end
        assert all(a.end == b.begin for a, b in zip(got, got[1:]))
        assert all(b.hash is None for b in got)

    files = catalog.models.files("base")
    assert [f.name for f in files] == [p.name for p in checkpoint_files(ckpt)]
    for f in files:
        st = os.stat(ckpt / f.name)
        n, _ = raw_header(ckpt / f.name)
        raw = (ckpt / f.name).read_bytes()[8 : 8 + n]
        assert (f.size, f.mtime_ns, f.header_sha256) == (st.st_size, st.st_mtime_ns, hashlib.sha256(raw).hexdigest())

    assert record == catalog.models.get("base")
    assert record.uri == str(ckpt.resolve())
    assert record.kind == "checkpoint"
    assert record.n_tensors == len(expected)
    assert record.n_blocks == sum(len(v) for v in blocks.values())
    assert record.total_bytes == sum(e - b for _, _, _, b, e in expected.values())
    assert record.num_layers == 2
    assert record.architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM")


def test_same_id_same_content_is_a_no_op(family_catalog, tiny_family):
    before = db_dump(family_catalog.path)
    again = register_model(family_catalog, "e1", tiny_family["e1"])
    assert again == family_catalog.models.get("e1")
    assert db_dump(family_catalog.path) == before


def test_different_content_refused(family_catalog, tmp_path):
    other = make_base(tmp_path / "qwen", arch="qwen3")
    before = db_dump(family_catalog.path)
    with pytest.raises(CatalogError, match="model 'e1' \\(e1@1\\) is already registered with different content; register it as version 2 with "
               "--new-version, or replace it with --force"):
        register_model(family_catalog, "e1", other)
    assert db_dump(family_catalog.path) == before


def test_force_replaces_and_drops_statistics(family_catalog, tmp_path):
    other = make_base(tmp_path / "qwen", arch="qwen3")
    family_catalog.blocks.set_hashes("e1", [("lm_head.weight", 0, "ab" * 32)])
    record = register_model(family_catalog, "e1", other, force=True)
    assert record.architecture == "Qwen3ForCausalLM"
    assert family_catalog.models.get("e1") == record
    assert all(b.hash is None for bs in family_catalog.blocks.by_tensor("e1").values() for b in bs)
    assert {t.name for t in family_catalog.models.tensors("e1")} == set(_expected_tensors(other))


def test_moved_checkpoint_needs_force(family_catalog, tiny_family, tmp_path):
    moved = shutil.copytree(tiny_family["e1"], tmp_path / "moved")
    with pytest.raises(CatalogError, match="already registered from"):
        register_model(family_catalog, "e1", moved)
    assert register_model(family_catalog, "e1", moved, force=True).uri == str(moved.resolve())


def test_missing_dir_refused_with_nothing_written(family_catalog, tmp_path):
    before = db_dump(family_catalog.path)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        register_model(family_catalog, "x", tmp_path / "nope")
    assert db_dump(family_catalog.path) == before


def test_corrupt_checkpoint_refused_with_nothing_written(family_catalog, tiny_family, tmp_path):
    bad = shutil.copytree(tiny_family["base"], tmp_path / "bad")
    n, header = raw_header(bad / "model.safetensors")
    data = (bad / "model.safetensors").read_bytes()[8 + n :]
    write_raw_safetensors(bad / "model.safetensors", header, data[:-2])  # wrong byte length
    before = db_dump(family_catalog.path)
    for model_id, force in (("new", False), ("e1", True)):
        with pytest.raises(CheckpointError, match="corrupt safetensors file"):
            register_model(family_catalog, model_id, bad, force=force)
    assert db_dump(family_catalog.path) == before


@pytest.mark.parametrize("bad_id", ["", " x", "a b", "x;rm", "-flag", "x" * 201])
def test_invalid_model_id_refused(catalog, tiny_family, bad_id):
    with pytest.raises(ConfigError, match="invalid model id"):
        register_model(catalog, bad_id, tiny_family["base"])


def test_fingerprint_is_deterministic_and_layout_sensitive(catalog, tiny_family, sharded_family):
    a = register_model(catalog, "a", tiny_family["base"])
    b = register_model(catalog, "b", tiny_family["e1"])
    c = register_model(catalog, "c", sharded_family["base"])
    # headers of a base and its expert are byte-identical: same layout fingerprint
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert len(a.fingerprint) == 64


@pytest.mark.parametrize("good_id", ["a", "org/name-v2", "llama3:8b@rev", "x.y_z+1", "9" * 200])
def test_valid_model_ids_accepted(good_id):
    assert check_model_id(good_id) == good_id


@pytest.mark.parametrize("family", ["tiny_family", "sharded_family"])
def test_describe_checkpoint_is_pure_and_follows_the_headers(family, request):
    """The rows a commit registers for a snapshot, from the headers alone."""
    ckpt = request.getfixturevalue(family)["base"]
    content = describe_checkpoint(open_checkpoint(ckpt), "m", "snapshot", SMALL_BLOCK_BYTES, "2024-01-01T00:00:00Z")
    expected = _expected_tensors(ckpt)
    assert {t.name: (t.file, t.dtype, list(t.shape), t.begin, t.end) for t in content.tensors} == expected
    assert [t.ordinal for t in content.tensors] == list(range(len(expected)))
    by_tensor: dict[str, list] = {}
    for b in content.blocks:
        by_tensor.setdefault(b.tensor, []).append(b)
    for t in content.tensors:
        rows = block_rows(list(t.shape), ITEMSIZE[t.dtype], SMALL_BLOCK_BYTES)
        assert [(b.index, b.row_start, b.row_end) for b in by_tensor[t.name]] == [
            (i, r0, r1) for i, (r0, r1) in enumerate(rows)
        ]
        assert all(b.hash is None for b in by_tensor[t.name])
    record = content.record
    assert (record.id, record.kind, record.created_at) == ("m", "snapshot", "2024-01-01T00:00:00Z")
    assert record.uri == str(ckpt.resolve())
    assert (record.n_tensors, record.n_blocks) == (len(expected), len(content.blocks))
    assert record.total_bytes == sum(e - b for _, _, _, b, e in expected.values())
    assert [f.name for f in content.files] == [p.name for p in checkpoint_files(ckpt)]


def test_layout_fingerprint_ignores_order_and_follows_headers_and_sizes(tiny_family, sharded_family):
    files = described_files(open_checkpoint(sharded_family["base"]))
    assert len(files) > 1
    base = layout_fingerprint(files)
    assert layout_fingerprint(tuple(reversed(files))) == base
    assert layout_fingerprint(described_files(open_checkpoint(sharded_family["e1"]))) == base
    first = files[0]
    for changed in (
        first.model_copy(update={"size": first.size + 1}),
        first.model_copy(update={"header_sha256": "0" * 64}),
        first.model_copy(update={"name": "renamed.safetensors"}),
    ):
        assert layout_fingerprint((changed,) + files[1:]) != base
    moved = first.model_copy(update={"mtime_ns": first.mtime_ns + 1})
    assert layout_fingerprint((moved,) + files[1:]) == base  # mtime is not layout
