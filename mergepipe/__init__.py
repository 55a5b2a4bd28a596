"""MergePipe: budget-aware parameter management for LLM merging (docs/ARCHITECTURE.md is the map).

The public API is what the command line does, one call per command (``merge``, ``merge_config``,
``plan``, ``execute``, ``register``, ``analyze``, ``verify``, ...), taking one typed ``MergeRequest``,
and the parts underneath (``Catalog``, ``Plan``, ``Engine``, ``Manifest``); all imported lazily, so
that importing ``mergepipe.errors`` does not load torch.
"""

from __future__ import annotations

from importlib import import_module, metadata
from typing import Any

try:
    __version__ = metadata.version("mergepipe")
except metadata.PackageNotFoundError:  # a source tree used without `pip install -e .`
    __version__ = "0+unknown"

_EXPORTS = {
    "MergeRequest": "mergepipe.spec.request",
    "Execution": "mergepipe.app.merging",
    "merge": "mergepipe.app.merging",
    "merge_config": "mergepipe.app.merging",
    "execute": "mergepipe.app.merging",
    "plan": "mergepipe.app.planning",
    "integrate": "mergepipe.app.integration",
    "init_db": "mergepipe.app.registering",
    "register": "mergepipe.app.registering",
    "analyze": "mergepipe.app.analysing",
    "export_delta": "mergepipe.app.analysing",
    "verify": "mergepipe.app.views",
    "explain": "mergepipe.app.views",
    "diff": "mergepipe.app.views",
    "lineage": "mergepipe.app.views",
    "push": "mergepipe.app.publishing",
    "evaluate": "mergepipe.app.evaluating",
    "evaluate_tasks": "mergepipe.app.evaluating",
    "EvalSettings": "mergepipe.app.evaluating",
    "bisect": "mergepipe.app.bisecting",
    "HubTarget": "mergepipe.app.publishing",
    "gc": "mergepipe.app.maintenance",
    "recover": "mergepipe.app.maintenance",
    "Catalog": "mergepipe.catalog.catalog",
    "register_model": "mergepipe.analysis.register",
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
