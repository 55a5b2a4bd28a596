"""What one ``analyze`` call did and what it cost (``analyze.py``; the CLI and ``integrate`` print it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AnalyzeReport:
    """What one ``analyze`` call did and what it cost."""

    base_id: str | None
    hashed: tuple[str, ...]
    analyzed: tuple[str, ...]
    skipped: tuple[str, ...]
    bytes_read: int
    bytes_by_model: dict[str, int]
    seconds: float
    # expert -> (tensors taken from its previous version unchanged, tensors in all): incremental.py
    inherited: dict[str, tuple[int, int]] = field(default_factory=dict)
    # bytes read a second time, from the page cache, for the thresholds of tensors larger than a window
    # (windows.py); not in bytes_read, which counts each checkpoint byte once
    reread_bytes: int = 0

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "base_id": self.base_id,
            "hashed": list(self.hashed),
            "analyzed": list(self.analyzed),
            "skipped": list(self.skipped),
            "bytes_read": self.bytes_read,
            "bytes_by_model": dict(self.bytes_by_model),
            "seconds": self.seconds,
            "inherited": {e: list(n) for e, n in self.inherited.items()},
            "reread_bytes": self.reread_bytes,
        }

