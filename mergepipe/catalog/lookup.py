"""The one "unknown model" check every store uses, with the known ids in its message."""

from __future__ import annotations

from mergepipe.catalog.database import Database
from mergepipe.errors import UnknownModelError

# How many registered ids an "unknown model" message lists.
_MAX_IDS_IN_MESSAGE = 10


def unknown_model(db: Database, model_id: str) -> UnknownModelError:
    ids = [r[0] for r in db.query("SELECT id FROM models ORDER BY id")]
    if not ids:
        known = "none registered yet"
    else:
        known = "registered: " + ", ".join(ids[:_MAX_IDS_IN_MESSAGE])
        if len(ids) > _MAX_IDS_IN_MESSAGE:
            known += f" … ({len(ids)} in all)"
    return UnknownModelError(f"unknown model '{model_id}'; {known} (register it with `mergepipe register`)")


def require_model(db: Database, model_id: str) -> None:
    """UnknownModelError unless ``model_id`` is registered."""
    if db.query_one("SELECT 1 FROM models WHERE id = ?", (model_id,)) is None:
        raise unknown_model(db, model_id)
