"""The engine's defaults and device-name check, for callers that have not loaded the engine (and torch)."""

from __future__ import annotations

from mergepipe.errors import ConfigError

#: Default bound on the engine's buffers: reads in flight plus working
#: tensors. Streaming operators never need more than a few blocks per expert.
DEFAULT_MAX_MEMORY = "2GiB"

#: How to install what ``--executor ray`` needs.
RAY_INSTALL_HINT = "pip install 'mergepipe[ray]'"


def device_name(name: str) -> str:
    """``name`` when it names a device the engine computes on (cpu, cuda, cuda:N); ConfigError otherwise."""
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ConfigError(f"--device must be cpu or cuda, got {name!r}")
    return name
