"""Shared fixtures: tiny base and expert checkpoints made on the fly."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.checkpoints import make_base, make_expert
from tests.fixtures.fake_hub import point_huggingface_hub_at


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory) -> dict[str, Path]:
    """A bf16 Llama base with three experts (one leaves embeddings untouched).

    Session-scoped and read-only by convention: tests that modify files copy
    them first.
    """
    root = tmp_path_factory.mktemp("family")
    base = make_base(root / "base", arch="llama", dtype="bf16")
    return {
        "base": base,
        "e1": make_expert(base, root / "e1", seed=1),
        "e2": make_expert(base, root / "e2", seed=2, scale=0.03),
        "e3": make_expert(base, root / "e3", seed=3, touch=lambda n: "embed" not in n),
    }


@pytest.fixture(scope="session")
def sharded_family(tmp_path_factory) -> dict[str, Path]:
    """A sharded bf16 Qwen3 base (tied embeddings, q/k norms) with two experts."""
    root = tmp_path_factory.mktemp("sharded")
    base = make_base(root / "base", arch="qwen3", dtype="bf16", sharded=True)
    return {
        "base": base,
        "e1": make_expert(base, root / "e1", seed=11),
        "e2": make_expert(base, root / "e2", seed=12, layer_scale={1: 1.0}),
    }


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tests check values, not speed: one intra-op thread avoids OpenMP
    workers spinning against each other on tiny tensors on a 2-core box."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True, scope="session")
def _private_default_catalog(tmp_path_factory):
    """A command given no ``--db`` uses ``$MERGEPIPE_DB``, else the per-user catalog under
    ``$XDG_DATA_HOME``: point both at a throwaway folder so the tests never write into the home of
    whoever runs them (tests of the default itself set their own)."""
    patch = pytest.MonkeyPatch()
    patch.delenv("MERGEPIPE_DB", raising=False)
    patch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg-data")))
    yield
    patch.undo()


@pytest.fixture(autouse=True, scope="session")
def _no_real_hub(tmp_path_factory):
    """No test reaches huggingface.co, or reads or writes the Hugging Face cache and login of whoever runs
    them: the endpoint is a closed loopback port (a request fails at once, as offline) and the cache and
    home are throwaway folders. ``fake_hub`` points them at its own server for the tests that use one."""
    patch = pytest.MonkeyPatch()
    point_huggingface_hub_at(patch, "http://127.0.0.1:9", tmp_path_factory.mktemp("hf-home"))
    yield
    patch.undo()
