"""A snapshot's files as one commit of a Hugging Face Hub repository, through ``huggingface_hub``.

Large files are uploaded first, then one commit adds every file and deletes what the branch held that the
snapshot does not, on top of the head it was listed at: the repository never shows half a model or a mix
of two. Failures are one ``PublishError`` line, the token cut out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mergepipe.errors import ConfigError, PublishError
from mergepipe.storage.location import redact
from mergepipe.storage.hub import TOKEN_HINT, bound_requests, offline

if TYPE_CHECKING:
    from huggingface_hub import HfApi

#: The branch a push goes to unless one is named (the Hub's default).
DEFAULT_BRANCH = "main"
#: Files of a repository a push leaves in place though the snapshot has none: the Hub's own.
KEPT_FILES = frozenset({".gitattributes"})


@dataclass(frozen=True)
class HubCommit:
    """The commit a push made on branch ``revision``, or found there (``created`` False: the branch held
    exactly these files already, so no commit was made); ``private``: the repository's visibility as the Hub
    reported it; ``deleted``: files of the branch the snapshot does not have, which the commit removed."""

    repo_id: str
    revision: str
    commit: str
    private: bool
    created: bool = True
    deleted: tuple[str, ...] = ()


def check_online() -> None:
    """ConfigError when huggingface_hub is in offline mode (``HF_HUB_OFFLINE``): nothing could be pushed."""
    if offline():
        raise ConfigError("HF_HUB_OFFLINE is set, so nothing can be pushed to the Hub; unset it to push")


def commit_files(
    repo_id: str, files: Mapping[str, Path], *, message: str, description: str, private: bool, revision: str | None
) -> HubCommit:
    """Commit ``files`` (name in the repository -> local file) to ``repo_id`` as one commit on branch
    ``revision`` (default ``main``), creating the repository (``private`` when asked) and the branch if
    missing. ``private`` and a repository that exists and is public: refused before any upload.
    PublishError (one line) for anything the Hub or the connection refuses."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, get_token
    from huggingface_hub.errors import HTTPError

    check_online()
    bound_requests()
    api = HfApi()
    branch = revision or DEFAULT_BRANCH
    try:
        api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        head = _head(api, repo_id, branch)
        if private and head.private is False:
            raise PublishError(
                f"{repo_id} exists and is public, and --private was asked (make it private on the "
                "Hub, or push without --private)"
            )
        present = set(api.list_repo_files(repo_id, revision=head.sha)) if head.sha else set()
        stale = tuple(sorted(present - set(files) - KEPT_FILES))
        operations: list[CommitOperationAdd | CommitOperationDelete] = [
            CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path)) for name, path in sorted(files.items())
        ]
        operations += [CommitOperationDelete(path_in_repo=name) for name in stale]
        made = api.create_commit(
            repo_id,
            operations,
            commit_message=message,
            commit_description=description,
            revision=branch,
            parent_commit=head.sha,
        )
    except (HTTPError, OSError, ValueError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and not isinstance(exc.__cause__, (HTTPError, OSError)):
            raise  # huggingface_hub wraps a failed upload's error in a RuntimeError; any other one is a bug
        raise PublishError(redact(_reason(exc, repo_id, api.endpoint), [get_token() or ""])) from None
    visible = private if head.private is None else head.private
    return HubCommit(repo_id, branch, made.oid, visible, made.oid != head.sha, stale)


@dataclass(frozen=True)
class _Head:
    """A branch's head commit (None: the repository has no commit yet) and the repository's visibility
    (None: not reported)."""

    sha: str | None
    private: bool | None


def _head(api: HfApi, repo_id: str, branch: str) -> _Head:
    """The head of ``branch``, which is created from the default branch if it is missing."""
    from huggingface_hub.errors import RevisionNotFoundError

    try:
        info = api.model_info(repo_id, revision=branch)
    except RevisionNotFoundError:
        if branch == DEFAULT_BRANCH:  # a repository without any commit yet: no head
            return _Head(None, api.model_info(repo_id).private)
        api.create_branch(repo_id, branch=branch, exist_ok=True)
        info = api.model_info(repo_id, revision=branch)
    return _Head(info.sha, info.private)


def _reason(exc: BaseException, repo_id: str, endpoint: str) -> str:
    """What went wrong, in one line, with what to do where the user can do something."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, RuntimeError) and exc.__cause__ is not None:  # an upload, to the Hub's storage
        return f"{_first_line(exc)} ({_failure(exc.__cause__, endpoint)})"
    status = exc.response.status_code if isinstance(exc, HfHubHTTPError) else None
    if status == 401:
        return f"the Hub did not accept the credentials (401): {TOKEN_HINT}, with a token that may write to {repo_id}"
    if status == 403:
        return f"the token may not write to {repo_id} (403): use a token with write access to it"
    return _failure(exc, endpoint)


def _failure(exc: BaseException, endpoint: str) -> str:
    """One failure as it came: an HTTP answer's status and message, a connection that failed, or an error
    of the library or the file system."""
    from huggingface_hub.errors import HfHubHTTPError, HTTPError

    if isinstance(exc, HfHubHTTPError) or not isinstance(exc, HTTPError):
        return _first_line(exc)
    status = getattr(getattr(exc, "response", None), "status_code", None)  # an HTTP status error has one
    if status is not None:
        return f"HTTP {status}: {_first_line(exc)}"
    return f"the connection to the Hub ({endpoint}) failed: {type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
