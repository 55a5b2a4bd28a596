"""Model references: ``name`` (the latest version of a family) and ``name@N`` (version N).

A model's first version is stored under its name, later ones under
``name@N``; names that end in ``@<number>`` are refused at registration, so
the family of any stored id is a pure function of the id string.
"""

from __future__ import annotations

import re

VERSIONED = re.compile(r"^(?P<name>.+)@(?P<version>[0-9]+)$")


def family(model_id: str) -> str:
    """The family (name) of a stored model id: ``math@3`` -> ``math``, ``math`` -> ``math``.

    Random operators key an expert's stream by its family, not its version:
    a retrained expert keeps the drop pattern of its unchanged tensors, so an
    incremental merge can reuse their output blocks."""
    match = VERSIONED.match(model_id)
    return match["name"] if match else model_id
