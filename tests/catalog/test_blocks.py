"""The blocks store: block rows, content hashes and the content fingerprint."""

from __future__ import annotations

import pytest

from mergepipe.analysis.register import register_model
from mergepipe.errors import CatalogError

HASH_A = "aa" * 32
HASH_B = "bb" * 32


def hash_all(catalog, model_id: str, digest=lambda tensor, index: HASH_A) -> None:
    blocks = catalog.blocks.by_tensor(model_id)
    catalog.blocks.set_hashes(model_id, [(t, b.index, digest(t, b.index)) for t, bs in blocks.items() for b in bs])


def test_set_hashes_fills_only_missing_hashes(family_catalog):
    blocks = family_catalog.blocks.by_tensor("e1")
    tensor = next(iter(blocks))
    family_catalog.blocks.set_hashes("e1", [(tensor, 0, HASH_A)])
    family_catalog.blocks.set_hashes("e1", [(tensor, 0, HASH_B), (tensor, 1, HASH_B)])  # 0 is kept
    got = family_catalog.blocks.by_tensor("e1")[tensor]
    assert [b.hash for b in got[:3]] == [HASH_A, HASH_B, None]
    assert family_catalog.blocks.hashed_count("e1") == 2
    assert family_catalog.blocks.hashed_count("e2") == 0


def test_content_fingerprint_follows_every_block_hash(family_catalog):
    """base and e1 share a layout; equal hashes give equal fingerprints, and a
    single different block hash gives a different one."""
    hash_all(family_catalog, "base")
    hash_all(family_catalog, "e1")
    tensors = list(family_catalog.blocks.by_tensor("e2"))
    last = tensors[-1]
    hash_all(family_catalog, "e2", lambda t, i: HASH_B if (t, i) == (last, 0) else HASH_A)
    base = family_catalog.blocks.content_fingerprint("base")
    assert len(base) == 64 and int(base, 16) >= 0
    assert family_catalog.blocks.content_fingerprint("e1") == base
    assert family_catalog.blocks.content_fingerprint("e2") != base
    assert family_catalog.blocks.content_fingerprint("base") == base  # deterministic


def test_content_fingerprint_follows_the_layout(catalog, tiny_family, sharded_family):
    register_model(catalog, "llama", tiny_family["base"])
    register_model(catalog, "qwen", sharded_family["base"])
    hash_all(catalog, "llama")
    hash_all(catalog, "qwen")
    assert catalog.blocks.content_fingerprint("llama") != catalog.blocks.content_fingerprint("qwen")


@pytest.mark.parametrize("hashed", [0, 1])
def test_content_fingerprint_needs_every_block_hashed(family_catalog, hashed):
    if hashed:  # all but one block
        blocks = family_catalog.blocks.by_tensor("e1")
        family_catalog.blocks.set_hashes(
            "e1", [(t, b.index, HASH_A) for t, bs in blocks.items() for b in bs][:-1]
        )
    with pytest.raises(CatalogError, match=r"model 'e1' is not analysed yet; run `mergepipe analyze"):
        family_catalog.blocks.content_fingerprint("e1")


def test_by_tensor_is_in_file_then_index_order(family_catalog):
    blocks = family_catalog.blocks.by_tensor("base")
    tensors = family_catalog.models.tensors("base")
    assert list(blocks) == [t.name for t in tensors]
    for t in tensors:
        got = blocks[t.name]
        assert [b.index for b in got] == list(range(len(got)))
        assert got[0].begin == t.begin and got[-1].end == t.end

