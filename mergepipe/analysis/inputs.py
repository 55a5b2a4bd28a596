"""Open a registered model's checkpoint, after checking it is still what was registered.

The catalog remembers each weight file's size, mtime and header hash at
registration. Before anything reads a model (analysis, a merge), its files
are checked against that record: a missing file or a changed size or mtime
is a ``ModelChangedError`` naming the file, and so is a header that no
longer matches the layout fingerprint. (Block hashes catch a change that
keeps size and mtime.)
"""

from __future__ import annotations

import os
from pathlib import Path

from mergepipe.analysis.describe import checkpoint_files, layout_fingerprint
from mergepipe.catalog import Catalog
from mergepipe.errors import ModelChangedError
from mergepipe.storage.checkpoint import Checkpoint, open_checkpoint


def check_unchanged(catalog: Catalog, model_id: str) -> None:
    """ModelChangedError if a weight file of ``model_id`` is gone or its size
    or mtime moved since registration."""
    record = catalog.models.get(model_id)
    root = Path(record.uri)
    for file in catalog.models.files(model_id):
        path = root / file.name
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise changed(model_id, f"{path} is missing") from None
        except OSError as exc:
            raise changed(model_id, f"{path}: {exc.strerror}") from None
        if st.st_size != file.size or st.st_mtime_ns != file.mtime_ns:
            raise changed(model_id, f"{path}")


def open_registered(catalog: Catalog, model_id: str) -> Checkpoint:
    """The model's checkpoint, opened and checked against its registration."""
    check_unchanged(catalog, model_id)
    record = catalog.models.get(model_id)
    checkpoint = open_checkpoint(record.uri)
    if layout_fingerprint(checkpoint_files(checkpoint)) != record.fingerprint:
        raise changed(model_id, f"headers in {record.uri}")
    return checkpoint


def changed(model_id: str, what: str) -> ModelChangedError:
    return ModelChangedError(
        f"model '{model_id}' changed on disk since registration (file {what}); "
        "re-register it with `mergepipe register --force`"
    )
