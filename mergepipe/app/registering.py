"""Models in the catalog: ``init_db``, ``register`` (headers only), and the models a request names (``resolved``):
ids, directories, URIs, Hub ids and ``X+ADAPTER``, registered on the fly and taken back if the call fails."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from mergepipe.analysis.experts import layer_count
from mergepipe.analysis.experts import LORA, is_lora_dir
from mergepipe.analysis.register import Registration, hub_adapter, register_model
from mergepipe.analysis.register import register as register_checkpoint
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog, prepare_catalog_dir
from mergepipe.catalog import Catalog
from mergepipe.catalog.database import Location, ServerURL, catalog_location
from mergepipe.errors import CatalogError, ConfigError, MergePipeError, UnknownModelError
from mergepipe.spec.copy_map import ALL_LAYERS
from mergepipe.spec.mergekit import FRANKENMERGE
from mergepipe.spec.request import MergeRequest
from mergepipe.spec.settings import count_layers
from mergepipe.storage.format import MERGEABLE_DTYPES
from mergepipe.storage.location import RemotePath, is_remote, location, model_location
from mergepipe.storage.remote import RemoteClient
from mergepipe.sizes import parse_size

#: Characters a folder name may have that a model id may not (ids: letters, digits and . _ : + -).
ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:+-]+")
#: A folder of the Hugging Face cache: ``…/models--ORG--NAME/snapshots/COMMIT`` (a Hub adapter's download).
_HUB_CACHE_FOLDER = re.compile(r"^models--(?:[^/]+?)--([^/]+)$")


@dataclass(frozen=True)
class CatalogInfo:
    """A catalog's settings."""

    path: Location
    schema_version: int
    block_bytes: int


def init_db(db: str | Path | ServerURL, block_bytes: int | str | None = None) -> CatalogInfo:
    """Create the catalog ``db`` (with ``block_bytes``), or check an existing one."""
    size = None if block_bytes is None else parse_size(block_bytes, "--block-bytes")
    where = catalog_location(db)
    prepare_catalog_dir(where)
    with Catalog.create(where, size, adopt_empty=True) as catalog:
        return CatalogInfo(where, catalog.schema_version, catalog.block_bytes)


def register(
    db: Catalogish,
    model_id: str,
    uri: str | Path,
    *,
    kind: str = "checkpoint",
    base: str | None = None,
    new_version: bool = False,
    force: bool = False,
    reporter: Reporter = SILENT,
) -> Registration:
    """Record the checkpoint at ``uri`` as ``model_id`` (a checkpoint, a delta or a LoRA of ``base``)."""
    if new_version and force:
        raise ConfigError("--new-version and --force contradict each other: keep the old version, or replace it")
    with open_catalog(db, writing=True, reporter=reporter) as catalog:
        return register_checkpoint(catalog, model_id, uri, force=force, new_version=new_version, kind=kind, base=base)


@contextmanager
def resolved(catalog: Catalog, request: MergeRequest) -> Iterator[MergeRequest]:
    """``request`` with its models as exact references; registrations made on the fly undone if the block fails."""
    registered: list[str] = []
    try:
        base = model_ref(catalog, request.base, registered)
        _check_per_tensor(catalog, base, request)
        experts = [model_ref(catalog, e, registered, base=base) for e in request.experts]
        if request.slice_layers is not None:
            _check_slice_layers(catalog, base, experts, request.slice_layers)
        refs = dict(zip(request.experts, experts))
        # a key not written as in the expert list may be another spelling of one (name vs name@N); an
        # unknown one stays as written, and planning says it is no expert
        params = {refs.get(k) or registered_ref(catalog, k) or k: v for k, v in request.expert_params.items()}
        if request.slices is None:
            yield request.with_refs(base, tuple(experts), params)
        else:  # a passthrough: its slices name the models too (two spellings of one model are one source)
            refs[request.base] = base
            slices = tuple(
                replace(
                    s, model=refs[s.model], end=s.end if s.end != ALL_LAYERS else _layer_count(catalog, refs[s.model])
                )
                for s in request.slices
            )
            yield request.with_refs(base, tuple(dict.fromkeys(e for e in experts if e != base)), params, slices)
    except MergePipeError:
        for model_id in registered:
            catalog.models.delete(model_id)
        raise


def _check_per_tensor(catalog: Catalog, base: str, request: MergeRequest) -> None:
    """The request's settings checked on every tensor of the base, from the catalog alone."""
    record = catalog.models.resolve(base)
    names = [t.name for t in catalog.models.tensors(record.id) if t.dtype in MERGEABLE_DTYPES]
    request.check_operator(names, layer_count(catalog, record.id))


def registered_ref(catalog: Catalog, value: str) -> str | None:
    """The exact reference of the registered model ``value`` names, or None."""
    try:
        return catalog.models.exact_ref(catalog.models.resolve(value))
    except UnknownModelError:
        return None


def model_ref(catalog: Catalog, value: str, registered: list[str], base: str | None = None) -> str:
    """The exact reference of what ``value`` names, a directory registered now (appended to ``registered``)."""
    known = registered_ref(catalog, value)
    if known is not None:
        return known
    path = location(value) if is_remote(value) else Path(value).expanduser()
    if isinstance(path, RemotePath) or path.is_dir():  # a remote URI is registered from its headers too
        return _registered_dir(catalog, path, registered, base)
    if "+" in value:
        return _adapter_of_base(catalog, value, registered, base)
    hub = _hub_location(value)  # mergekit's bare Hub id: a local path of that spelling wins
    if hub is not None:
        return _registered_dir(catalog, hub, registered, base, bare=value)
    if isinstance(path, Path) and (value.startswith((".", "~", "/")) or len(path.parts) > 1):  # written as a path
        where = "" if path.is_absolute() else f", relative to the current directory {Path.cwd()}"
        what = "is not a folder" if path.exists() else "does not exist"
        raise UnknownModelError(
            f"model '{value}': {path.resolve()} {what} (read as a path{where}); give a "
            "checkpoint's folder or a registered model id"
        )
    raise catalog.models.unknown(value)


def _registered_dir(
    catalog: Catalog, path: Path | RemotePath, registered: list[str], base: str | None, bare: str | None = None
) -> str:
    """The reference of checkpoint directory ``path``, registered now if it is not yet."""
    if isinstance(path, RemotePath) and path.hub is not None:
        client = RemoteClient()
        pinned = client.pin(path, bare)
        local = hub_adapter(pinned, client) if base is not None else None
        if local is None:
            _refuse_moved(catalog, path, pinned)
        path = pinned if local is None else local
    adapter = isinstance(path, Path) and is_lora_dir(path)
    if adapter and base is None:
        raise ConfigError(
            f"{path} is a LoRA adapter (adapter_config.json), which cannot be the base; make the model "
            "it was trained on the base and list the adapter among the experts"
        )
    model_id = directory_name(catalog, path)
    known = catalog.models.latest(model_id)
    if adapter:  # a no-op when this directory is already that adapter of this base
        record = register_model(catalog, model_id, path, kind=LORA, base=base)
    else:  # a no-op when this directory is already that model; its side files alone changed: its next version
        record = register_model(catalog, model_id, path, side_versions=True)
    if known is None or record.id != known.id:
        registered.append(record.id)
    return catalog.models.exact_ref(record)


def _adapter_of_base(catalog: Catalog, value: str, registered: list[str], base: str | None) -> str:
    """mergekit's ``X+ADAPTER``: the adapter, registered as an expert of the merge's base (X)."""
    model, _, adapter = value.partition("+")
    if base is None:
        raise ConfigError(
            f"base model '{value}' is a model with a LoRA adapter applied, which cannot be the base; "
            f"make '{model}' the base and list '{adapter}' among the experts, or merge the adapter "
            "into its model first"
        )
    if "+" in adapter or not model or not adapter:
        raise ConfigError(f"'{value}' is neither a registered model, a directory nor MODEL+ADAPTER (one '+')")
    if not _names_model(catalog, model, base):
        raise ConfigError(
            f"'{value}' is a LoRA adapter over '{model}', which is not the base '{base}': an adapter "
            f"over another model is another expert; merge it into '{model}' first and list the "
            "merged directory"
        )
    known = registered_ref(catalog, adapter)
    if known is not None:
        record = catalog.models.resolve(known)
        if record.kind != LORA or record.delta_base != catalog.models.resolve(base).id:
            raise ConfigError(
                f"'{adapter}' in '{value}' is registered as a {record.kind}, not as a LoRA adapter of the base '{base}'"
            )
        return known
    path = Path(adapter).expanduser()
    hub = _hub_location(adapter)
    if hub is not None:  # an adapter on the Hub (a local path of that spelling wins): downloaded, then as a local one
        client = RemoteClient()
        local = hub_adapter(client.pin(hub, None if adapter.startswith("hf://") else adapter), client)
        if local is None:
            raise ConfigError(f"'{adapter}' in '{value}' is not a LoRA adapter: {hub} has no adapter_config.json")
        return _registered_dir(catalog, local, registered, base)
    if not path.is_dir() or not is_lora_dir(path):
        raise ConfigError(
            f"'{adapter}' in '{value}' is not a LoRA adapter directory (one with "
            "adapter_config.json) nor a registered adapter"
        )
    return _registered_dir(catalog, path, registered, base)


def _names_model(catalog: Catalog, value: str, ref: str) -> bool:
    """Whether ``value`` (a reference or a directory, as written) names the registered model ``ref``."""
    known = registered_ref(catalog, value)
    hub = _hub_location(value) if known is None else None
    if known is None and not is_remote(value) and Path(value).expanduser().is_dir():
        record = catalog.models.registered_at(str(Path(value).expanduser().resolve()))
        known = None if record is None else catalog.models.exact_ref(record)
    elif hub is not None:  # the commit its revision names now, registered from there
        record = catalog.models.registered_at(RemoteClient().pin(hub).uri)
        known = None if record is None else catalog.models.exact_ref(record)
    return known is not None and catalog.models.resolve(known).id == catalog.models.resolve(ref).id


def _hub_location(value: str) -> RemotePath | None:
    """The Hub location ``value`` names (``hf://``, or a bare ``ORG/NAME[@REVISION]`` that is no local path)."""
    found = model_location(value)
    return found if isinstance(found, RemotePath) and found.hub is not None else None


def _refuse_moved(catalog: Catalog, typed: RemotePath, pinned: RemotePath) -> None:
    """Refuse a Hub branch or tag that moved since its repository's model was registered."""
    hub = pinned.hub
    if (
        hub is None
        or typed.hub is None
        or typed.hub.commit is not None
        or catalog.models.registered_at(pinned.uri) is not None
    ):
        return
    name = _hub_name(pinned) or ""
    latest = catalog.models.latest(name)
    was = location(latest.uri) if latest is not None else None
    old = was.hub if isinstance(was, RemotePath) else None
    if latest is None or old is None or (old.repo_id, old.path) != (hub.repo_id, hub.path):
        return
    raise CatalogError(
        f"'{typed.hub.repo_id}@{typed.hub.revision or 'main'}' is now commit {hub.commit}, but '{name}' "
        f"({latest.label}) is registered from commit {old.commit}: the branch moved since; register the new commit "
        f"as its next version (`mergepipe register --db {catalog.path} --model-id {name} --uri {typed} "
        f"--new-version`), or name the registered one ('{latest.label}', or {old.repo_id}@{old.commit})"
    )


def _check_slice_layers(catalog: Catalog, base: str, experts: list[str], layers: int) -> None:
    """The config's ``slices:`` take layers [0, ``layers``) of every model: all of them, or they cut layers."""
    have = _layer_count(catalog, base)
    if have != layers:
        raise ConfigError(
            f"the slice takes layers [0, {layers}] of the base '{base}', which has {have}: "
            f"{FRANKENMERGE}; give layer_range [0, {have}] to merge the whole models"
        )
    for expert in experts:
        count = catalog.models.resolve(expert).num_layers
        if count is not None and count != layers:
            raise ConfigError(f"the slice takes layers [0, {layers}] of '{expert}', which has {count}: {FRANKENMERGE}")


def _layer_count(catalog: Catalog, ref: str) -> int:
    """The number of layers of registered model ``ref``: its config.json's, else its tensor names'."""
    record = catalog.models.resolve(ref)
    return record.num_layers or count_layers([t.name for t in catalog.models.tensors(record.id)])


def directory_name(catalog: Catalog, path: Path | RemotePath) -> str:
    """The catalog name of directory ``path``: its model's, else its folder's name, else with a path hash."""
    resolved_path = path if isinstance(path, RemotePath) else path.resolve()
    known = catalog.models.registered_at(str(resolved_path))
    if known is not None:
        return known.name
    name = ID_UNSAFE.sub("-", _hub_name(resolved_path) or resolved_path.name).strip("-._") or "model"
    latest = catalog.models.latest(name)
    if latest is None and not catalog.models.exists(name):
        return name
    if latest is not None and latest.uri == str(resolved_path):  # an adapter registered from here before
        return name
    return f"{name}-{hashlib.sha256(str(resolved_path).encode()).hexdigest()[:8]}"


def _hub_name(path: Path | RemotePath) -> str | None:
    """``NAME`` of a Hub location ``ORG/NAME``, or of a folder of the Hugging Face cache; else None."""
    if isinstance(path, RemotePath):
        return None if path.hub is None else path.hub.repo_id.split("/")[1]
    cached = _HUB_CACHE_FOLDER.match(path.parent.parent.name) if path.parent.name == "snapshots" else None
    return None if cached is None else cached[1]
