"""fp32 checkpoint families with varied delta layouts, and their catalog.

fp32 so that error measurements are not blurred by bf16 rounding of the
output. Layouts: a dense expert, one touching only attention rows, one
concentrated in layer 1, a sparse one (random tensors and rows), and two
experts whose deltas sit almost entirely in layer 1 (for energy vs uniform).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mergepipe.catalog import Catalog
from tests.fixtures.checkpoints import make_base, make_expert
from tests.planner.support import build_catalog, clone_catalog, make_sparse_expert

F32_BLOCK_BYTES = 4096
F32_EXPERTS = ("attn", "dense", "layer1", "sparse")
CONCENTRATED = ("conc1", "conc2")


@pytest.fixture(scope="session")
def f32_family(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("f32family")
    base = make_base(root / "base", arch="llama", dtype="f32", seed=5)
    in_layers = lambda n: ".layers." in n  # noqa: E731
    return {
        "base": base,
        "dense": make_expert(base, root / "dense", seed=21),
        "attn": make_sparse_expert(base, root / "attn", seed=22, tensor_fraction=1.0, row_fraction=0.5,
                                   touch=lambda n: "self_attn" in n),
        "layer1": make_expert(base, root / "layer1", seed=23, layer_scale={0: 0.0, 1: 3.0}),
        "sparse": make_sparse_expert(base, root / "sparse", seed=24, tensor_fraction=0.6, row_fraction=0.3,
                                     layer_scale={0: 0.2, 1: 1.5}),
        "conc1": make_expert(base, root / "conc1", seed=25, touch=in_layers, layer_scale={0: 0.05, 1: 1.0}),
        "conc2": make_expert(base, root / "conc2", seed=26, touch=in_layers, layer_scale={0: 0.05, 1: 1.0}),
    }


@pytest.fixture(scope="session")
def f32_template(f32_family, tmp_path_factory) -> Path:
    """A closed catalog with every f32 model registered and analysed."""
    path = tmp_path_factory.mktemp("f32catalog") / "template.db"
    experts = [m for m in f32_family if m != "base"]
    return build_catalog(path, F32_BLOCK_BYTES, dict(f32_family), base="base", experts=experts)


@pytest.fixture
def f32_catalog(f32_template, tmp_path):
    """A private, writable copy of the f32 catalog."""
    path = clone_catalog(f32_template, tmp_path / "catalog.db")
    with Catalog.open(path) as catalog:
        yield catalog
