"""The one exception tree (every error a person can cause is a one-line ``MergePipeError``), and ``visible``,
how every line and table shows a name a person chose."""

from __future__ import annotations

import re

#: C0 and C1 controls but newline and tab, DEL, and the bidirectional controls (an RLO turns "gnp.exe" around).
_HIDDEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def visible(text: object) -> str:
    """``text`` with each hidden character spelled as its code point, ``<U+202E>``."""
    return _HIDDEN.sub(lambda m: f"<U+{ord(m.group()):04X}>", str(text))


class MergePipeError(Exception):
    """Base of all expected, user-facing failures."""

    exit_code = 1


class ConfigError(MergePipeError):
    """Invalid user input: an operator parameter, a size string, a CLI value."""

    exit_code = 2


class CatalogError(MergePipeError):
    """The catalog is missing, foreign, or inconsistent with a request."""


class UnknownModelError(CatalogError):
    """A model id that the catalog does not know."""


class ModelChangedError(CatalogError):
    """A registered model's files changed on disk since registration."""


class LayoutMismatchError(CatalogError):
    """An expert whose tensor names, shapes or dtypes differ from the base."""


class CheckpointError(MergePipeError):
    """A checkpoint directory that cannot be used (missing, unreadable)."""


class CorruptCheckpointError(CheckpointError):
    """A safetensors file or index that violates the format."""


class PlanError(MergePipeError):
    """A plan that cannot be made, found, or executed as asked."""


class BudgetError(PlanError):
    """An unparsable or negative expert-I/O budget."""


class StalePlanError(PlanError):
    """A stored plan whose input fingerprints no longer match the catalog."""


class EngineError(MergePipeError):
    """A failure while executing a plan (bad tensor values, device)."""


class PublishError(MergePipeError):
    """A snapshot that cannot be published (output exists, staging failed)."""


class OutputExistsError(PublishError):
    """The output path already exists; MergePipe never overwrites."""


class InterruptedAfterPublish(PublishError):
    """Ctrl-C after the output was renamed into place: the message says the snapshot exists (and what was skipped)."""

    exit_code = 130

    def __init__(self, out_path: object, snapshot_id: str | None, skipped: str = "") -> None:
        self.out_path, self.snapshot_id, self.skipped = out_path, snapshot_id, skipped
        done = (
            f"committed as snapshot {snapshot_id}"
            if snapshot_id is not None
            else "its catalog commit is finished by `mergepipe recover`, which every writing command runs first"
        )
        super().__init__(f"interrupted after publishing {out_path} ({done})" + (f"; {skipped}" if skipped else ""))

    def skipping(self, skipped: str) -> InterruptedAfterPublish:
        return InterruptedAfterPublish(self.out_path, self.snapshot_id, skipped)


class PushError(PublishError):
    """A failed or interrupted (exit code 130) push to the Hub; the local snapshot is intact."""

    def __init__(self, message: str, interrupted: bool = False) -> None:
        super().__init__(message)
        if interrupted:
            self.exit_code = 130


class PreviousChangedError(ModelChangedError):
    """The previous snapshot of an incremental merge is gone or changed; ``reason`` says how, without advice."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class VerifyError(MergePipeError):
    """A published snapshot whose files no longer match its manifest."""
