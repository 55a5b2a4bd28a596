"""The content hash of a block: blake3 of its bytes, as lower-case hex.

One definition for analysis (which records every block's hash) and the engine
(which checks every block it reads against the record before using it).
Single-threaded blake3 runs at several GB/s per core, above what the
statistics and merges around it sustain.
"""

from __future__ import annotations

import blake3


def block_digest(data: bytes | bytearray | memoryview) -> str:
    """blake3 hex digest of ``data``."""
    return blake3.blake3(data).hexdigest()
