"""The engine: executes a plan as a bounded-memory stream of work units, then seals and publishes the snapshot
(``engine.py`` reads top-down). Here, what callers use without loading the engine (and torch): its defaults
and the device-name check."""

from mergepipe.errors import ConfigError

#: Default bound on the engine's buffers: reads in flight plus working tensors.
DEFAULT_MAX_MEMORY = "2GiB"
#: How to install what ``--executor ray`` needs.
RAY_INSTALL_HINT = "pip install 'mergepipe[ray]'"


def device_name(name: str) -> str:
    """``name`` when it names a device the engine computes on (cpu, cuda, cuda:N); ConfigError otherwise."""
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ConfigError(f"--device must be cpu or cuda, got {name!r}")
    return name
