"""MergePipe: budget-aware parameter management for LLM merging.

The loop is register -> analyze -> plan(budget) -> execute -> publish ->
verify / explain / lineage. See docs/ARCHITECTURE.md for the map.

The public API (``Catalog``, ``register_model``, ``analyze``, ``Planner``,
``Plan``, ``Engine``, ``TransactionManager``, ``Manifest``) is imported lazily, so that importing
a light module such as ``mergepipe.errors`` does not load torch.
"""

from __future__ import annotations

from importlib import import_module, metadata
from typing import Any

try:
    __version__ = metadata.version("mergepipe")
except metadata.PackageNotFoundError:  # a source tree used without `pip install -e .`
    __version__ = "0+unknown"

_EXPORTS = {
    "Catalog": "mergepipe.catalog.catalog",
    "register_model": "mergepipe.analysis.register",
    "analyze": "mergepipe.analysis.analyze",
    "Planner": "mergepipe.planner.planner",
    "Plan": "mergepipe.spec.plan",
    "Engine": "mergepipe.engine.engine",
    "TransactionManager": "mergepipe.txn.publish",
    "Manifest": "mergepipe.manifest.manifest",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mergepipe' has no attribute {name!r}")
