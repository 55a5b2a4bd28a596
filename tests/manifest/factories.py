"""Manifest values for tests: one valid example and a hypothesis strategy."""

from __future__ import annotations

import hashlib
from typing import Any

from hypothesis import strategies as st

from mergepipe.manifest.manifest import (
    ByteCost,
    Cost,
    ErrorBound,
    ExpertRef,
    FileEntry,
    Manifest,
    OperatorSpec,
    RealizedCost,
    SoftwareVersions,
    snapshot_id_for,
)
from mergepipe.spec.plan import ModelRef


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def make_manifest(**overrides: Any) -> Manifest:
    """A valid, fully populated manifest; ``overrides`` replace fields."""
    files = overrides.pop("files", (
        FileEntry("config.json", sha("config"), 120),
        FileEntry("model.safetensors", sha("weights"), 4096),
    ))
    plan_digest = overrides.pop("plan_digest", sha("plan"))
    fields: dict[str, Any] = dict(
        snapshot_id=snapshot_id_for(plan_digest, files),
        model_id="merged-1",
        plan_digest=plan_digest,
        base=ModelRef("base", sha("base")),
        experts=(ExpertRef("e1", sha("e1"), 0.5), ExpertRef("e2", sha("e2"), 0.25)),
        operator=OperatorSpec("ties", {"density": 0.5, "lambda": 1.0}),
        seed=7,
        budget_bytes=1 << 20,
        cost=Cost(
            estimated=ByteCost(base_bytes=4096, expert_bytes=1024, output_bytes=4096),
            realized=RealizedCost(
                base_bytes=4096, expert_bytes=1000, output_bytes=4216,
                expert_bytes_by_model={"e1": 600, "e2": 400},
                seconds={"read": 0.25, "merge": 0.5, "write": 0.125},
            ),
        ),
        error_bound=ErrorBound(estimated=0.125, realized=0.0625, kind="frobenius bound of omitted blocks"),
        reads={"layers.0.w": {"e1": [[0, 3], [7, 7]], "e2": [[1, 1]]}},
        files=files,
        software=SoftwareVersions(mergepipe="0.1.0", torch="2.13.0", safetensors="0.8.0", python="3.11.7"),
        created_at="2025-01-02T03:04:05Z",
        extra={},
    )
    fields.update(overrides)
    return Manifest(**fields)


# -- hypothesis ------------------------------------------------------------------

names = st.text(st.characters(codec="utf-8", exclude_characters="/\\"), min_size=1, max_size=12)
ids = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=10)
hexes = st.binary(min_size=1, max_size=8).map(lambda b: hashlib.sha256(b).hexdigest())
floats = st.floats(allow_nan=False, allow_infinity=False)
counts = st.integers(min_value=0, max_value=1 << 62)
json_leaf = st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | floats | st.text(max_size=8)
json_values = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)
index_sets = st.lists(st.integers(0, 300), max_size=20)


@st.composite
def file_entries(draw) -> tuple[FileEntry, ...]:
    paths = draw(st.lists(
        st.lists(names.filter(lambda n: n not in (".", "..")), min_size=1, max_size=2).map("/".join),
        unique=True, max_size=4,
    ))
    return tuple(FileEntry(p, draw(hexes), draw(counts)) for p in paths if p != "manifest.json")


@st.composite
def manifests(draw) -> Manifest:
    from mergepipe.spec.canonical import compress_indices

    experts = draw(st.lists(st.builds(ExpertRef, ids, hexes, floats), max_size=3))
    reads = draw(st.dictionaries(
        names, st.dictionaries(ids, index_sets.map(compress_indices), max_size=3), max_size=3,
    ))
    return Manifest(
        snapshot_id=draw(ids),
        model_id=draw(ids),
        plan_digest=draw(hexes),
        base=ModelRef(draw(ids), draw(hexes)),
        experts=tuple(experts),
        operator=OperatorSpec(draw(ids), draw(st.dictionaries(st.text(max_size=6), json_values, max_size=3))),
        seed=draw(st.integers(-(1 << 63), 1 << 64)),
        budget_bytes=draw(st.none() | counts),
        cost=Cost(
            ByteCost(draw(counts), draw(counts), draw(counts)),
            RealizedCost(
                draw(counts), draw(counts), draw(counts),
                draw(st.dictionaries(ids, counts, max_size=3)),
                draw(st.dictionaries(ids, floats, max_size=3)),
            ),
        ),
        error_bound=ErrorBound(draw(st.none() | floats), draw(st.none() | floats), draw(names)),
        reads=reads,
        files=draw(file_entries()),
        software=SoftwareVersions(draw(ids), draw(ids), draw(ids), draw(ids)),
        created_at=draw(names),
        extra=draw(st.dictionaries(st.text(max_size=6), json_values, max_size=3)),
    )
