"""The engine's defaults that the command line shows before it loads the engine (and torch with it)."""

from __future__ import annotations

#: Default bound on the engine's buffers: reads in flight plus working
#: tensors. Streaming operators never need more than a few blocks per expert.
DEFAULT_MAX_MEMORY = "2GiB"

#: How to install what ``--executor ray`` needs.
RAY_INSTALL_HINT = "pip install 'mergepipe[ray]'"
