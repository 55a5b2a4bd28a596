"""Storage fixtures: tiny real checkpoints in every layout and dtype we read.

Built with transformers/safetensors only (tests/fixtures), once per session,
and treated as read-only; tests that damage a file copy it first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.checkpoints import make_base

# (arch, dtype, sharded): both architectures, all mergeable dtypes, both layouts.
VARIANTS = [
    ("llama", "bf16", False),
    ("llama", "f16", False),
    ("llama", "f32", False),
    ("llama", "f16", True),
    ("qwen3", "bf16", True),
    ("qwen3", "f32", True),
    ("qwen3", "bf16", False),
]


def variant_id(variant: tuple[str, str, bool]) -> str:
    arch, dtype, sharded = variant
    return f"{arch}-{dtype}-{'sharded' if sharded else 'single'}"


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """Return ``make(arch, dtype, sharded) -> Path``, building each variant once."""
    root = tmp_path_factory.mktemp("storage-ckpts")
    cache: dict[tuple[str, str, bool], Path] = {}

    def make(arch: str, dtype: str, sharded: bool) -> Path:
        key = (arch, dtype, sharded)
        if key not in cache:
            cache[key] = make_base(root / variant_id(key), arch=arch, dtype=dtype, sharded=sharded)
        return cache[key]

    return make


@pytest.fixture(params=VARIANTS, ids=variant_id)
def any_checkpoint(request, checkpoint_factory) -> Path:
    return checkpoint_factory(*request.param)

