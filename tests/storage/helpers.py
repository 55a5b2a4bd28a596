"""Independent helpers for storage tests (no MergePipe code)."""

from __future__ import annotations

import json
from pathlib import Path


def raw_header(path: Path) -> tuple[int, dict]:
    """Header length and JSON of a safetensors file, parsed here independently."""
    with open(path, "rb") as handle:
        n = int.from_bytes(handle.read(8), "little")
        return n, json.loads(handle.read(n))
