"""The layout of a base: the check every (expert, base) analysis starts with (same tensor names,
shapes and dtypes; for a delta checkpoint, that it was taken against this base), and how many layers
its parameter gradients spread over."""

from __future__ import annotations

from mergepipe.catalog import Catalog
from mergepipe.catalog.records import ModelRecord, TensorRecord
from mergepipe.errors import LayoutMismatchError
from mergepipe.spec.settings import count_layers
from mergepipe.storage.format import MERGEABLE_DTYPES

# Layout differences listed in a mismatch message.
_MAX_DIFFERENCES = 5


def summarise(problems: list[str], noun: str = "difference") -> str:
    """``N differences: first; second; …; … K more`` for a one-line mismatch message."""
    shown = "; ".join(problems[:_MAX_DIFFERENCES])
    more = f"; … {len(problems) - _MAX_DIFFERENCES} more" if len(problems) > _MAX_DIFFERENCES else ""
    return f"{len(problems)} {noun}{'s' if len(problems) > 1 else ''}: {shown}{more}"


def check_layout(expert: str, expert_tensors: list[TensorRecord], base: str, base_tensors: list[TensorRecord]) -> None:
    """LayoutMismatchError naming the first differences unless the expert has the base's layout."""
    mine = {t.name: t for t in expert_tensors}
    theirs = {t.name: t for t in base_tensors}
    problems = []
    for name, b in theirs.items():
        e = mine.get(name)
        if e is None:
            problems.append(f"tensor '{name}' is missing")
        elif e.shape != b.shape:
            problems.append(f"'{name}' has shape {list(e.shape)}, base {list(b.shape)}")
        elif e.dtype != b.dtype:
            problems.append(f"'{name}' is {e.dtype}, base {b.dtype}")
    problems.extend(f"extra tensor '{name}'" for name in mine if name not in theirs)
    if problems:
        raise LayoutMismatchError(
            f"expert '{expert}' does not match the layout of base '{base}' ({summarise(problems)}); "
            "analyse it against a base of the same architecture and size"
        )


def check_delta_base(expert: ModelRecord, base: ModelRecord) -> None:
    """LayoutMismatchError unless ``expert`` (a delta checkpoint) was registered against ``base``: its
    tensors were checked against that base, and its Δ means nothing against another."""
    if expert.delta_base != base.id:
        raise LayoutMismatchError(
            f"'{expert.id}' is a delta checkpoint taken against '{expert.delta_base}', not '{base.id}'; "
            f"analyse and merge it with --base {expert.delta_base}"
        )


def layer_count(catalog: Catalog, base_id: str) -> int:
    """The base's layer count: its config's, else counted from the names of its merged tensors."""
    names = [t.name for t in catalog.models.tensors(base_id) if t.dtype in MERGEABLE_DTYPES]
    return catalog.models.get(base_id).num_layers or count_layers(names)
