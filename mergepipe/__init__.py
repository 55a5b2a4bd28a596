"""MergePipe: budget-aware parameter management for LLM merging (docs/ARCHITECTURE.md is the map).

The public API, imported lazily (importing ``mergepipe.errors`` loads no torch): one call per command, taking
one typed ``MergeRequest``, and the parts underneath (``Catalog``, ``Plan``, ``Engine``, ``Manifest``).
"""

from __future__ import annotations

from importlib import import_module, metadata
from typing import Any

try:
    __version__ = metadata.version("mergepipe")
except metadata.PackageNotFoundError:  # a source tree used without `pip install -e .`
    __version__ = "0+unknown"

_EXPORTS = {
    name: module
    for module, names in {
        "mergepipe.spec.request": "MergeRequest",
        "mergepipe.app.merging": "Execution merge merge_config execute",
        "mergepipe.app.planning": "plan",
        "mergepipe.app.integration": "integrate",
        "mergepipe.app.registering": "init_db register",
        "mergepipe.app.analysing": "analyze export_delta",
        "mergepipe.app.views": "verify explain diff lineage",
        "mergepipe.app.publishing": "push HubTarget",
        "mergepipe.app.evaluating": "evaluate evaluate_tasks EvalSettings",
        "mergepipe.app.bisecting": "bisect",
        "mergepipe.app.maintenance": "gc recover",
        "mergepipe.catalog.catalog": "Catalog",
        "mergepipe.analysis.register": "register_model",
        "mergepipe.planner.planner": "Planner",
        "mergepipe.spec.plan": "Plan",
        "mergepipe.engine.engine": "Engine",
        "mergepipe.txn.publish": "TransactionManager",
        "mergepipe.manifest.manifest": "Manifest",
    }.items()
    for name in names.split()
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mergepipe' has no attribute {name!r}")
