"""The Hugging Face Hub as one more remote store, through ``huggingface_hub``: its API, filesystem, cache and auth.

A location is ``hf://ORG/NAME[@REVISION][/PATH]`` (``location.HubLocation``).
A branch or tag moves; a commit does not. ``resolve_commit`` turns the
revision into its commit (``HfApi.model_info``; no request when it already
is one), and everything after it reads that commit: the catalog records
``hf://ORG/NAME@COMMIT``, so a plan made from it, its manifest and a later
re-check all name bytes that cannot change under them (the commit is what
an ETag is to S3). A branch that moved since is another commit, which
registration then refuses or records as a new version.

Where the bytes come from. The local Hugging Face cache (``HF_HUB_CACHE``,
``HF_HOME``) is keyed by commit: a file of the commit it holds
(``try_to_load_from_cache`` with the commit) is read there, as a local file,
with no request; ``cached_folder`` finds the commit's folder, which
``storage/checkpoint.py`` opens as the checkpoint when it is complete.
``HF_HUB_OFFLINE=1`` reads the cache only (a branch resolved from the
cache's refs, ``scan_cache_dir``), and names the missing file otherwise.
Anything else is read through ``HfFileSystem`` (``storage/remote.py``): its
listing of the commit, then exact byte ranges of its resolve URLs (the Hub
redirects LFS files to its CDN, which honours ``Range``) — headers and the
planned blocks only, with huggingface_hub's own backoff as the retry policy.
``download`` fetches whole files into the cache (``hf_hub_download``), for
the small ones read whole (a LoRA adapter).

The endpoint, the cache folders and offline mode are huggingface_hub's own
settings (``huggingface_hub.constants``, from ``HF_ENDPOINT``,
``HF_HUB_CACHE``/``HF_HOME``, ``HF_HUB_OFFLINE``). The token is found by
huggingface_hub for each request (``HF_TOKEN``, the stored login of
``hf auth login``): MergePipe never holds, stores or prints it. ``failure``
turns huggingface_hub's typed errors into one line naming the fix (gated,
private or missing repository, missing revision or file, offline, the Hub
unreachable), never quoting a library message that might carry a URL.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mergepipe.errors import CheckpointError, MergePipeError
from mergepipe.storage.location import HubLocation, RemotePath

#: How a user gives a token, named in every error about access.
TOKEN_HINT = "set HF_TOKEN or log in with `hf auth login` (formerly `huggingface-cli login`)"


def endpoint() -> str:
    """The Hub huggingface_hub talks to (``HF_ENDPOINT``, else huggingface.co)."""
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def cache_dir() -> str:
    """huggingface_hub's cache folder (``HF_HUB_CACHE``, else ``HF_HOME/hub``)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) asks for the cache only."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def filesystem() -> Any:
    """A fresh ``HfFileSystem`` for one client: its listings and repository checks are cached per instance
    (fsspec would otherwise share one across commands, with a refusal it cached before a login)."""
    from huggingface_hub import HfFileSystem

    return HfFileSystem(endpoint=endpoint(), skip_instance_cache=True)


def hub_of(path: RemotePath) -> HubLocation:
    """The repository, revision and path of an ``hf://`` location (a caller's bug for any other)."""
    hub = path.hub
    if hub is None:
        raise ValueError(f"not a Hub location: {path}")
    return hub


# ---------------------------------------------------------------------- which commit


def resolve_commit(path: RemotePath) -> str:
    """The commit ``path``'s revision names now: itself when it is one (no request), else the Hub's answer
    (``HfApi.model_info``), or offline, or with the Hub out of reach, the cache's record of the revision."""
    hub = hub_of(path)
    if hub.commit is not None:
        return hub.commit
    if offline():
        cached = _cached_ref(hub)
        if cached is None:
            raise CheckpointError(f"HF_HUB_OFFLINE is set and the Hugging Face cache ({cache_dir()}) does not know "
                                  f"which commit {_revision_text(hub)} is; download the model while online (`hf "
                                  f"download {hub.repo_id}`), or unset HF_HUB_OFFLINE")
        return cached
    from huggingface_hub import HfApi

    try:
        sha = HfApi(endpoint=endpoint()).model_info(hub.repo_id, revision=hub.revision).sha
    except errors() as exc:
        if _unreachable(exc) and (cached := _cached_ref(hub)) is not None:
            return cached  # as huggingface_hub itself does: the cache's commit when the Hub cannot be reached
        raise failure(path, exc, "resolving its revision") from None
    if not sha:
        raise CheckpointError(f"{_revision_text(hub)} has no commit yet (an empty repository); push a model to it "
                              "or give another")
    return sha


def pinned(path: RemotePath) -> RemotePath:
    """``path`` at the commit its revision names now (``resolve_commit``)."""
    hub = hub_of(path)
    return path if hub.commit is not None else RemotePath(hub.with_revision(resolve_commit(path)).uri)


def _cached_ref(hub: HubLocation) -> str | None:
    """The commit the cache recorded for ``hub``'s revision (``refs/REVISION``), if it did."""
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


# ---------------------------------------------------------------------- the local cache


def cached_file(path: RemotePath) -> Path | None:
    """The cache's copy of the file ``path`` names at its commit; None when it has none (or ``path`` names a
    branch: only a commit says which bytes the cache must hold)."""
    from huggingface_hub import try_to_load_from_cache

    hub = hub_of(path)
    if hub.commit is None or not hub.path:
        return None
    found = try_to_load_from_cache(hub.repo_id, hub.path, cache_dir=cache_dir(), revision=hub.commit)
    return Path(found) if isinstance(found, str) else None


def cached_folder(root: RemotePath, names: Sequence[str]) -> Path | None:
    """The cache's folder of the commit (and path) ``root`` names, found from the first of ``names`` it holds
    there; None when it holds none of them."""
    for name in names:
        found = cached_file(root / name)
        if found is not None:
            return found.parent
    return None


def download(root: RemotePath, names: Sequence[str]) -> Path:
    """Files ``names`` of ``root``'s commit, whole, into the cache (what it holds already is not fetched
    again); their folder there."""
    from huggingface_hub import hf_hub_download

    hub = hub_of(root)
    if hub.commit is None:
        raise ValueError(f"download needs a commit: {root}")
    folder = None
    for name in names:
        found = cached_file(root / name)
        if found is None:
            if offline():
                raise offline_error(root / name)
            try:
                found = Path(hf_hub_download(hub.repo_id, f"{hub.path}/{name}".lstrip("/"), revision=hub.commit,
                                             cache_dir=cache_dir(), endpoint=endpoint()))
            except errors() as exc:
                raise failure(root / name, exc, "downloading it") from None
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


# ---------------------------------------------------------------------- errors


def errors() -> tuple[type[BaseException], ...]:
    """What a Hub call can fail with, for ``failure`` to classify: huggingface_hub's errors (its HTTP errors
    are ``OSError``s; offline mode a ``ConnectionError``; a malformed id a ``ValueError``), the HTTP client's
    (httpx for huggingface_hub 1.x and later, requests before), and the filesystem's."""
    return (OSError, ValueError, TimeoutError, *installed_classes("httpx2.HTTPError", "httpx.HTTPError",
                                                                    "requests.RequestException"))


def failure(path: RemotePath, exc: BaseException, what: str) -> MergePipeError:
    """``exc`` (one of ``errors()``), raised by huggingface_hub while ``what`` of ``path``, as one line naming
    the fix."""
    if isinstance(exc, MergePipeError):
        return exc
    hub = hub_of(path)
    repo, cause = hub.repo_id, _hub_error(exc)
    kind = type(cause).__name__ if cause is not None else ""
    if kind == "GatedRepoError":
        return CheckpointError(f"{repo} is a gated model: accept its terms on {endpoint()}/{repo} with your "
                               f"account, then {TOKEN_HINT} with a token of that account")
    if kind in ("RepositoryNotFoundError", "DisabledRepoError"):
        if _status(cause) == 401 and not _has_token():
            return CheckpointError(f"{repo} is private or does not exist on {endpoint()}: check the id, or "
                                   f"{TOKEN_HINT} with a token that may read it")
        return CheckpointError(f"{repo} was not found on {endpoint()}, or the token given may not read it: check "
                               f"the id and the token ({TOKEN_HINT})")
    if kind == "RevisionNotFoundError":
        return CheckpointError(f"{repo} has no revision {hub.revision!r}: give a branch, tag or commit it has")
    if kind in ("RemoteEntryNotFoundError", "EntryNotFoundError") or (cause is None and isinstance(exc,
                                                                                                 FileNotFoundError)):
        return CheckpointError(f"{path} is not there: {_revision_text(hub)} has no {hub.path or 'such path'}; "
                               "check the path and the revision")
    if _unreachable(exc):
        return CheckpointError(f"cannot reach the Hugging Face Hub at {endpoint()} ({what} of {path}: "
                               f"{type(_root_cause(exc)).__name__}); check the connection, or set HF_HUB_OFFLINE=1 "
                               "to read the local cache only")
    if kind in ("OfflineModeIsEnabled", "LocalEntryNotFoundError"):
        return offline_error(path)
    if (status := _status(cause)) is not None:
        return CheckpointError(f"the Hub at {endpoint()} answered HTTP {status} ({what} of {path}); try again later")
    return CheckpointError(f"cannot read {path} ({what}): {type(_root_cause(exc)).__name__}; check the connection "
                           "and the cache folder, then run the command again")


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it was raised from (HfFileSystem turns the Hub's errors into ``FileNotFoundError``)."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _hub_error(exc: BaseException) -> BaseException | None:
    """The first of huggingface_hub's own errors in ``exc``'s chain (its HTTP errors and offline mode)."""
    hub_errors = installed_classes("huggingface_hub.errors.HfHubHTTPError",
                                   "huggingface_hub.errors.OfflineModeIsEnabled",
                                   "huggingface_hub.errors.LocalEntryNotFoundError",
                                   "huggingface_hub.errors.EntryNotFoundError")
    return next((e for e in _chain(exc) if isinstance(e, hub_errors)), None)


def _root_cause(exc: BaseException) -> BaseException:
    return _chain(exc)[-1]


def _unreachable(exc: BaseException) -> bool:
    """Whether the Hub could not be reached at all (refused, reset, timed out): not an answer it gave."""
    transport = installed_classes("httpx2.TransportError", "httpx.TransportError", "requests.ConnectionError",
                                  "requests.Timeout")
    return any(isinstance(e, (*transport, ConnectionError, TimeoutError)) for e in _chain(exc)) \
        and not any(type(e).__name__ == "OfflineModeIsEnabled" for e in _chain(exc))


def _status(exc: BaseException | None) -> int | None:
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def _has_token() -> bool:
    from huggingface_hub import get_token

    return get_token() is not None


def installed_classes(*names: str) -> tuple[type[BaseException], ...]:
    """The exception classes ``module.Class`` that the installed libraries have (versions differ, and one
    scheme's extra may be missing)."""
    found = []
    for name in names:
        module, _, cls = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), cls))
        except (ImportError, AttributeError):
            pass
    return tuple(found)
