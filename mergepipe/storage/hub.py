"""The Hugging Face Hub through ``huggingface_hub``: revisions resolved to commits, the cache's copy of a file,
whole downloads checked against the commit, the one timeout policy, failures as one line naming the fix.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError

from mergepipe.errors import CheckpointError, MergePipeError
from mergepipe.storage.location import HUB_COMMIT, HubLocation, RemotePath

#: How a user gives a token, named in every error about access.
TOKEN_HINT = "set HF_TOKEN or log in with `hf auth login` (formerly `huggingface-cli login`)"
#: How long the Hub may take to answer a write (a commit, an upload) that huggingface_hub sends without a timeout.
WRITE_ANSWER_SECONDS = 600.0


class _Answer(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True)


class HubInfo(_Answer):
    """What MergePipe takes of ``HfApi.model_info``: the commit a revision names (None: an empty repository)."""

    sha: Annotated[str, StringConstraints(pattern=HUB_COMMIT.pattern)] | None


class HubLfs(_Answer):
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class HubEntry(_Answer):
    """An entry of a commit's listing (``HfFileSystem.ls``)."""

    name: str
    type: Literal["file", "directory"]
    size: Annotated[int, Field(ge=0)]
    blob_id: Annotated[str, StringConstraints(pattern=HUB_COMMIT.pattern)] | None = None
    lfs: HubLfs | None = None


_LISTING = TypeAdapter(list[HubEntry])


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks for the cache only."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def filesystem() -> Any:
    """A fresh ``HfFileSystem`` (a shared one would keep listings, and a refusal cached before a login)."""
    from huggingface_hub import HfFileSystem

    bound_requests()
    return HfFileSystem(endpoint=endpoint(), skip_instance_cache=True)


def bound_requests() -> None:
    """The one timeout policy, as a request hook on huggingface_hub's shared client."""
    from huggingface_hub import get_session

    hooks = getattr(get_session(), "event_hooks", None)
    if hooks is not None and _bounded not in hooks["request"]:
        get_session().event_hooks = {**hooks, "request": [*hooks["request"], _bounded]}


def _bounded(request: Any) -> None:
    from huggingface_hub import constants

    seconds = float(constants.HF_HUB_ETAG_TIMEOUT)
    given = request.extensions.get("timeout") or {}
    read = seconds if request.method in ("GET", "HEAD") else WRITE_ANSWER_SECONDS
    request.extensions["timeout"] = {
        key: given.get(key) or default
        for key, default in (("connect", seconds), ("read", read), ("write", read), ("pool", seconds))
    }


def listing(fs: Any, folder: RemotePath) -> dict[str, HubEntry]:
    """The entries directly under ``folder`` at its commit, by name (one request, then ``fs``'s cache)."""
    entries = _LISTING.validate_python(fs.ls(hub_of(folder).fs_path, detail=True))
    return {entry.name.rsplit("/", 1)[-1]: entry for entry in entries}


def check_whole(path: RemotePath, entry: HubEntry, data: bytes | Path) -> None:
    """CheckpointError unless ``data`` (the bytes of the file ``path``, or its downloaded copy, then removed
    from the cache) is what the commit lists: its sha256 for an LFS file, else its git blob id."""
    kind, want = ("sha256", entry.lfs.sha256) if entry.lfs is not None else ("git blob id", entry.blob_id)
    digest = hashlib.sha256() if entry.lfs is not None else hashlib.sha1(b"blob %d\0" % entry.size)
    if isinstance(data, bytes):
        digest.update(data)
    else:
        with open(data, "rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
    if digest.hexdigest() == want:
        return
    if isinstance(data, Path):
        blob = data.resolve()
        data.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
    raise CheckpointError(
        f"{path}: the bytes the Hub at {endpoint()} sent do not match the commit's {kind} of the file "
        f"({str(want)[:12]}…, got {digest.hexdigest()[:12]}…; nothing of them kept); run the command again, and if it "
        "repeats, the server does not serve this commit's files: check HF_ENDPOINT"
    )


def hub_of(path: RemotePath) -> HubLocation:
    hub = path.hub
    if hub is None:
        raise ValueError(f"not a Hub location: {path}")
    return hub


def resolve_commit(path: RemotePath) -> str:
    """The commit ``path``'s revision names now."""
    hub = hub_of(path)
    if hub.commit is not None:
        return hub.commit
    if offline():
        cached = _cached_ref(hub)
        if cached is None:
            raise CheckpointError(
                f"HF_HUB_OFFLINE is set and the Hugging Face cache ({cache_dir()}) does not know "
                f"which commit {_revision_text(hub)} is; download the model while online (`hf "
                f"download {hub.repo_id}`), or unset HF_HUB_OFFLINE"
            )
        return cached
    from huggingface_hub import HfApi

    bound_requests()
    try:
        sha = HubInfo(sha=HfApi(endpoint=endpoint()).model_info(hub.repo_id, revision=hub.revision).sha).sha
    except errors() as exc:
        if _unreachable(exc) and (cached := _cached_ref(hub)) is not None:
            return cached  # as huggingface_hub itself does: the cache's commit when the Hub cannot be reached
        raise failure(path, exc, "resolving its revision") from None
    if not sha:
        raise CheckpointError(
            f"{_revision_text(hub)} has no commit yet (an empty repository); push a model to it or give another"
        )
    return sha


def pinned(path: RemotePath) -> RemotePath:
    hub = hub_of(path)
    return path if hub.commit is not None else RemotePath(hub.with_revision(resolve_commit(path)).uri)


def _cached_ref(hub: HubLocation) -> str | None:
    """The commit the cache recorded for ``hub``'s revision, if it did."""
    from huggingface_hub import scan_cache_dir

    revision = hub.revision or "main"
    if not Path(cache_dir()).is_dir():  # nothing cached (scan_cache_dir would say so by raising)
        return None
    for repo in scan_cache_dir(cache_dir()).repos:
        if repo.repo_id == hub.repo_id and repo.repo_type == "model":
            for cached in repo.revisions:
                if revision in cached.refs:
                    return str(cached.commit_hash)
    return None


def _revision_text(hub: HubLocation) -> str:
    return f"{hub.repo_id}@{hub.revision}" if hub.revision is not None else f"{hub.repo_id} (its default branch)"


def cached_file(path: RemotePath) -> Path | None:
    """The cache's copy of the file ``path`` names at its commit (a branch names none: it moves)."""
    from huggingface_hub import try_to_load_from_cache

    hub = hub_of(path)
    if hub.commit is None or not hub.path:
        return None
    found = try_to_load_from_cache(hub.repo_id, hub.path, cache_dir=cache_dir(), revision=hub.commit)
    return Path(found) if isinstance(found, str) else None


def local_copy(path: RemotePath) -> Path | None:
    """``cached_file``; offline, an error when there is none."""
    local = cached_file(path)
    if local is None and offline():
        raise offline_error(path)
    return local


def cached_folder(root: RemotePath, names: Sequence[str]) -> Path | None:
    """The cache's folder of the commit (and path) ``root`` names, found by the first of ``names`` it holds."""
    for name in names:
        found = cached_file(root / name)
        if found is not None:
            return found.parent
    return None


def download(root: RemotePath, names: Sequence[str]) -> Path:
    """Files ``names`` of ``root``'s commit, whole, into the cache (unless there)."""
    from huggingface_hub import hf_hub_download

    hub = hub_of(root)
    if hub.commit is None:
        raise ValueError(f"download needs a commit: {root}")
    folder, listed = None, None
    for name in names:
        found = local_copy(root / name)
        if found is None:
            try:
                listed = listed or listing(filesystem(), root)  # what the download is checked against
                if name not in listed:
                    raise FileNotFoundError(name)
                found = Path(
                    hf_hub_download(
                        hub.repo_id,
                        f"{hub.path}/{name}".lstrip("/"),
                        revision=hub.commit,
                        cache_dir=cache_dir(),
                        endpoint=endpoint(),
                    )
                )
            except errors() as exc:
                raise failure(root / name, exc, "downloading it") from None
            check_whole(root / name, listed[name], found)
        folder = found.parent
    if folder is None:
        raise ValueError("download needs at least one file name")
    return folder


def offline_error(path: RemotePath, names: str | None = None) -> CheckpointError:
    """The one line for a file offline mode needs but the cache lacks (``names``: files of the folder ``path``)."""
    hub = hub_of(path)
    missing = f"{names} of {path}" if names else str(path)
    return CheckpointError(
        f"HF_HUB_OFFLINE is set and the Hugging Face cache ({cache_dir()}) lacks {missing}; download it while "
        f"online (`hf download {hub.repo_id} --revision {hub.revision or 'main'}`), or unset HF_HUB_OFFLINE"
    )


#: What huggingface_hub raises on an answer of the wrong shape (``null`` for an object, JSON nested past the
#: recursion limit, a field missing) and what the typed models raise on one (a commit that is not 40 hex digits).
_MALFORMED = (TypeError, KeyError, AttributeError, RecursionError, json.JSONDecodeError, ValidationError)


def errors() -> tuple[type[BaseException], ...]:
    """What a Hub call can fail with."""
    return (
        OSError,
        ValueError,
        TimeoutError,
        *_MALFORMED,
        *installed_classes("httpx2.HTTPError", "httpx.HTTPError", "requests.RequestException"),
    )


def failure(path: RemotePath, exc: BaseException, what: str) -> MergePipeError:
    """``exc`` (one of ``errors()``), raised while ``what`` of ``path``, as one line naming the fix."""
    if isinstance(exc, MergePipeError):
        return exc
    hub = hub_of(path)
    repo, cause = hub.repo_id, _hub_error(exc)
    kind = type(cause).__name__ if cause is not None else ""
    if kind == "GatedRepoError":
        return CheckpointError(
            f"{repo} is a gated model: accept its terms on {endpoint()}/{repo} with your "
            f"account, then {TOKEN_HINT} with a token of that account"
        )
    if kind in ("RepositoryNotFoundError", "DisabledRepoError"):
        if _status(cause) == 401 and not _has_token():
            return CheckpointError(
                f"{repo} is private or does not exist on {endpoint()}: check the id, or "
                f"{TOKEN_HINT} with a token that may read it"
            )
        return CheckpointError(
            f"{repo} was not found on {endpoint()}, or the token given may not read it: check "
            f"the id and the token ({TOKEN_HINT})"
        )
    if kind == "RevisionNotFoundError":
        return CheckpointError(f"{repo} has no revision {hub.revision!r}: give a branch, tag or commit it has")
    if kind in ("RemoteEntryNotFoundError", "EntryNotFoundError") or (
        cause is None and isinstance(exc, FileNotFoundError)
    ):
        return CheckpointError(
            f"{path} is not there: {_revision_text(hub)} has no {hub.path or 'such path'}; "
            "check the path and the revision"
        )
    if isinstance(exc, _MALFORMED):
        detail = type(exc).__name__
        if isinstance(exc, ValidationError):  # where and what, never the value (it may be 100 kB)
            detail = f"{'.'.join(map(str, exc.errors()[0]['loc']))}: {exc.errors()[0]['msg']}"
        return CheckpointError(
            f"the Hub at {endpoint()} sent what is not a Hub answer while {what} of {path} "
            f"({detail[:200]}); check that HF_ENDPOINT names a Hugging Face Hub"
        )
    timeouts = installed_classes("httpx2.TimeoutException", "httpx.TimeoutException", "requests.Timeout")
    if any(isinstance(e, (TimeoutError, *timeouts)) for e in _chain(exc)):
        from huggingface_hub import constants

        return CheckpointError(
            f"the Hugging Face Hub at {endpoint()} did not answer within "
            f"{constants.HF_HUB_ETAG_TIMEOUT:g} s ({what} of {path}); check HF_ENDPOINT and the "
            "connection, or raise HF_HUB_ETAG_TIMEOUT (HF_HUB_DOWNLOAD_TIMEOUT for downloads)"
        )
    if _unreachable(exc):
        return CheckpointError(
            f"cannot reach the Hugging Face Hub at {endpoint()} ({what} of {path}: "
            f"{type(_root_cause(exc)).__name__}); check the connection, or set HF_HUB_OFFLINE=1 "
            "to read the local cache only"
        )
    if kind in ("OfflineModeIsEnabled", "LocalEntryNotFoundError"):
        return offline_error(path)
    if _status(cause) == 401 and _has_token():
        return CheckpointError(
            f"the Hub at {endpoint()} refused the token (HTTP 401: wrong or expired) while "
            f"{what} of {path}; {TOKEN_HINT} with a valid token, or unset HF_TOKEN for a public "
            "model"
        )
    if (status := _status(cause)) is not None:
        return CheckpointError(f"the Hub at {endpoint()} answered HTTP {status} ({what} of {path}); try again later")
    return CheckpointError(
        f"cannot read {path} ({what}): {type(_root_cause(exc)).__name__}; check the connection "
        "and the cache folder, then run the command again"
    )


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it was raised from (HfFileSystem turns the Hub's errors into ``FileNotFoundError``)."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _hub_error(exc: BaseException) -> BaseException | None:
    """The first of huggingface_hub's own errors in ``exc``'s chain."""
    hub_errors = installed_classes(
        "huggingface_hub.errors.HfHubHTTPError",
        "huggingface_hub.errors.OfflineModeIsEnabled",
        "huggingface_hub.errors.LocalEntryNotFoundError",
        "huggingface_hub.errors.EntryNotFoundError",
    )
    return next((e for e in _chain(exc) if isinstance(e, hub_errors)), None)


def _root_cause(exc: BaseException) -> BaseException:
    return _chain(exc)[-1]


def _unreachable(exc: BaseException) -> bool:
    """Whether the Hub could not be reached at all (refused, reset, timed out)."""
    transport = installed_classes(
        "httpx2.TransportError", "httpx.TransportError", "requests.ConnectionError", "requests.Timeout"
    )
    return any(isinstance(e, (*transport, ConnectionError, TimeoutError)) for e in _chain(exc)) and not any(
        type(e).__name__ == "OfflineModeIsEnabled" for e in _chain(exc)
    )


def _status(exc: BaseException | None) -> int | None:
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def _has_token() -> bool:
    from huggingface_hub import get_token

    return get_token() is not None


def installed_classes(*names: str) -> tuple[type[BaseException], ...]:
    """The exception classes ``module.Class`` the installed libraries have (versions differ, extras may lack)."""
    found = []
    for name in names:
        module, _, cls = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), cls))
        except (ImportError, AttributeError):
            pass
    return tuple(found)
