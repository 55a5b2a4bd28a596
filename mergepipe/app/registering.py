"""Models in the catalog: creating it, registering checkpoints, and resolving what a request names.

``init_db`` creates a catalog (or checks an existing one); ``register``
records a checkpoint, a delta checkpoint or a LoRA adapter (headers only).

A reference is a registered name (its latest version), ``name@N``, a stored
id, or a checkpoint directory or ``s3://``/``http(s)://`` URI. A directory
that is not registered yet is registered on the fly. Its catalog name is the
checkpoint already registered from that very directory if there is one, else
the folder's name if that is free, else the folder's name with a short hash
of the whole path: two ``…/model`` folders never collide, and the same
directory always gets the same name.

If the call that resolved them fails, the models it registered on the fly
are taken back (``resolved``): a failed command leaves the catalog as it
found it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mergepipe.analysis.register import Registration, register_model
from mergepipe.analysis.register import register as register_checkpoint
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.errors import ConfigError, MergePipeError, UnknownModelError
from mergepipe.spec.request import MergeRequest
from mergepipe.storage.location import RemotePath, is_remote, location
from mergepipe.sizes import parse_size

#: Characters a folder name may have that a model id may not (ids: letters, digits and . _ : + -).
_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:+-]+")


@dataclass(frozen=True)
class CatalogInfo:
    """A catalog's settings."""

    path: Path
    schema_version: int
    block_bytes: int


def init_db(db: str | Path, block_bytes: int | str | None = None) -> CatalogInfo:
    """Create the catalog ``db`` (with ``block_bytes``, default 1 MiB), or check an existing one: the same
    block size, or none given."""
    size = None if block_bytes is None else parse_size(block_bytes, "--block-bytes")
    with Catalog.create(db, size, adopt_empty=True) as catalog:
        return CatalogInfo(Path(db), catalog.schema_version, catalog.block_bytes)


def register(db: Catalogish, model_id: str, uri: str | Path, *, kind: str = "checkpoint", base: str | None = None,
             new_version: bool = False, force: bool = False, reporter: Reporter = SILENT) -> Registration:
    """Record the checkpoint at ``uri`` (a directory, or an s3://, http(s):// or file:// URI) as
    ``model_id``: ``kind`` checkpoint, delta (against ``base``) or lora (an adapter of ``base``); a
    registered id with other content needs ``new_version`` (its next version) or ``force`` (replaced)."""
    if new_version and force:
        raise ConfigError("--new-version and --force contradict each other: keep the old version, or replace it")
    with open_catalog(db, writing=True, reporter=reporter) as catalog:
        return register_checkpoint(catalog, model_id, uri, force=force, new_version=new_version, kind=kind,
                                   base=base)


@contextmanager
def resolved(catalog: Catalog, request: MergeRequest) -> Iterator[MergeRequest]:
    """``request`` with its base, experts and ``expert_params`` keys as catalog references, directories
    registered on the fly; those registrations are undone if the block raises a ``MergePipeError``."""
    registered: list[str] = []
    try:
        base = model_ref(catalog, request.base, registered)
        experts = [model_ref(catalog, e, registered) for e in request.experts]
        refs = dict(zip(request.experts, experts))
        # a key not written as in the expert list may be another spelling of one (name vs name@N); an
        # unknown one stays as written, and planning says it is no expert
        params = {refs.get(k) or registered_ref(catalog, k) or k: v for k, v in request.expert_params.items()}
        yield request.with_refs(base, tuple(experts), params)
    except MergePipeError:
        for model_id in registered:
            catalog.models.delete(model_id)
        raise


def registered_ref(catalog: Catalog, value: str) -> str | None:
    """The exact reference of the registered model ``value`` names, or None."""
    try:
        return catalog.models.exact_ref(catalog.models.resolve(value))
    except UnknownModelError:
        return None


def model_ref(catalog: Catalog, value: str, registered: list[str]) -> str:
    """A reference to the exact version a registered name (its latest version), ``name@N`` or id means,
    or to a directory registered on the fly (appended to ``registered``). Not the stored id: version 1's id
    is also its family's name, which would mean the latest version when resolved again."""
    known = registered_ref(catalog, value)
    if known is not None:
        return known
    path = location(value) if is_remote(value) else Path(value).expanduser()
    if isinstance(path, RemotePath) or path.is_dir():  # a remote URI is registered from its headers too
        model_id = directory_name(catalog, path)
        new = not catalog.models.exists(model_id)
        record = register_model(catalog, model_id, path)  # a no-op when this directory is already that model
        if new:
            registered.append(model_id)
        return catalog.models.exact_ref(record)
    if "+" in value:
        raise ConfigError(f"'{value}' looks like mergekit's model+lora form: LoRA adapters as inputs are not "
                          "supported yet (merge the adapter into its model first)")
    if "/" in value and not path.exists():
        raise ConfigError(f"'{value}' is neither a registered model nor a checkpoint directory; MergePipe does not "
                          "download from the Hugging Face Hub: download it first and give the directory")
    raise catalog.models.unknown(value)


def directory_name(catalog: Catalog, path: Path | RemotePath) -> str:
    """The catalog name of checkpoint directory ``path`` (see the module docstring)."""
    resolved_path = path if isinstance(path, RemotePath) else path.resolve()
    known = catalog.models.registered_at(str(resolved_path))
    if known is not None:
        return known.name
    name = _ID_UNSAFE.sub("-", resolved_path.name).strip("-._") or "model"
    if catalog.models.latest(name) is None and not catalog.models.exists(name):
        return name
    return f"{name}-{hashlib.sha256(str(resolved_path).encode()).hexdigest()[:8]}"
