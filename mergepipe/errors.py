"""The one exception tree of MergePipe.

Every error a person can cause is a ``MergePipeError`` whose message is one
line saying what is wrong and what to do next. The CLI prints that line and
exits non-zero without a traceback; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations


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


class VerifyError(MergePipeError):
    """A published snapshot whose files no longer match its manifest."""
