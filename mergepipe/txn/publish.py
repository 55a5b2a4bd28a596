"""Publishing a snapshot: ``TransactionManager`` (stage, write, fsync, rename, commit) with the filesystem
primitives it, ``recover``, ``rm`` and ``gc`` need (modes, fsync, no-replace rename and exchange, directory
locks, staging names and markers, output paths); and ``commit_files``, a snapshot as one Hub commit."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.errors import ConfigError, OutputExistsError, PublishError
from mergepipe.storage.hub import TOKEN_HINT, bound_requests, offline
from mergepipe.storage.location import redact

#: Write bits a published file loses: nobody may change a snapshot's bytes in place.
_ALL_WRITE = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
#: Write bits a published directory loses: its owner may still delete it (``rm -rf``, ``mergepipe rm``).
_SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH


def fsync_path(path: str | Path) -> None:
    """Flush a file's data and metadata, or a directory's entries, to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(root: str | Path) -> None:
    """Publish modes, then fsync, bottom-up (``root`` last): files lose every write bit (one without any,
    shared or published, is untouched); directories keep their owner's rwx and lose group and other write."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            if not os.path.islink(full := os.path.join(dirpath, name)):
                if (mode := stat.S_IMODE(os.stat(full).st_mode)) & _ALL_WRITE:
                    os.chmod(full, mode & ~_ALL_WRITE)
                fsync_path(full)
        os.chmod(dirpath, (stat.S_IMODE(os.stat(dirpath).st_mode) & ~_SHARED_WRITE) | stat.S_IRWXU)
        fsync_path(dirpath)


def remove_tree(path: str | Path) -> None:
    """Remove a (possibly read-only) tree; a missing path is fine. Only its directories are made
    writable: files are unlinked as they are, so a file another snapshot shares keeps its mode."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        return path.unlink()
    os.chmod(path, stat.S_IMODE(path.stat().st_mode) | stat.S_IRWXU)
    for dirpath, dirnames, _ in os.walk(path):  # each directory opened before os.walk lists it
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        for name in dirnames:
            full = os.path.join(dirpath, name)
            os.chmod(full, stat.S_IMODE(os.stat(full).st_mode) | stat.S_IRWXU)
    shutil.rmtree(path)


_AT_FDCWD, _RENAME_NOREPLACE, _RENAME_EXCHANGE = -100, 1, 2


def _renameat2(src: str | Path, dst: str | Path, flags: int) -> int:
    """Linux ``renameat2``: 0, or the errno (ENOSYS where libc lacks it)."""
    try:
        call = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:
        call = None
    if call is None:
        return errno.ENOSYS
    return 0 if call(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0 else ctypes.get_errno()


def rename_no_replace(src: str | Path, dst: str | Path) -> None:
    """Rename ``src`` to ``dst`` in one atomic step, FileExistsError if ``dst`` exists (a plain rename
    replaces an empty directory); check-then-rename where ``renameat2`` is unavailable."""
    err = _renameat2(src, dst, _RENAME_NOREPLACE)
    if err in (errno.EEXIST, errno.ENOTEMPTY):
        raise FileExistsError(err, os.strerror(err), os.fspath(dst))
    if err not in (0, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        raise OSError(err, os.strerror(err), os.fspath(src), None, os.fspath(dst))
    if err:
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(dst))
        os.rename(src, dst)


def exchange(src: str | Path, dst: str | Path) -> None:
    """Swap ``src`` and ``dst`` in one atomic step (``renameat2(RENAME_EXCHANGE)``); OSError where unavailable."""
    if err := _renameat2(src, dst, _RENAME_EXCHANGE):
        raise OSError(err, os.strerror(err), os.fspath(src), None, os.fspath(dst))


@dataclass
class DirLock:
    """An exclusive ``flock`` on a directory, held until ``release()``."""

    fd: int | None
    path: Path

    @classmethod
    def try_acquire(cls, path: str | Path) -> DirLock | None:
        """The lock, or None if another process holds it; FileNotFoundError if ``path`` is missing."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, Path(path))

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)  # closing the only descriptor drops the flock

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


STAGING_INFIX = ".mergepipe-staging-"
#: The marker file inside a staging directory; it holds the intent id.
MARKER = ".mergepipe-staging"
_STAGING_NAME = re.compile(r"^\.(?P<out>.+)\.mergepipe-staging-(?P<intent>[0-9a-f]{32})$")


def staging_path_for(out_path: str | Path, intent_id: str) -> Path:
    """``<parent>/.<out name>.mergepipe-staging-<intent_id>``: hidden, beside the output."""
    out = Path(os.path.abspath(out_path))
    return out.parent / f".{out.name}{STAGING_INFIX}{intent_id}"


def parse_staging_name(name: str) -> tuple[str, str] | None:
    """``(output name, intent id)`` if ``name`` is a staging directory's name."""
    match = _STAGING_NAME.match(name)
    return (match["out"], match["intent"]) if match else None


def write_marker(path: Path, intent_id: str) -> None:
    with open(path / MARKER, "x", encoding="utf-8") as fh:
        fh.write(intent_id + "\n")


def unmark_published(out: Path) -> None:
    """Drop the marker from a committed snapshot (write permission lent for the unlink; manifests and
    ``verify`` ignore it, so a crash before this leaves a valid snapshot)."""
    marker = out / MARKER
    if not os.path.lexists(marker):
        return
    mode = stat.S_IMODE(os.stat(out).st_mode)
    os.chmod(out, mode | stat.S_IWUSR)
    try:
        marker.unlink(missing_ok=True)
    finally:
        os.chmod(out, mode)
    fsync_path(out)


def remove_staging(path: str | Path, intent_id: str, out_path: str | Path) -> str | None:
    """Remove ``intent_id``'s staging directory for ``out_path`` if it is provably ours: None when
    removed or absent, else one line saying why it was left alone."""
    path = Path(path)
    if not os.path.lexists(path):
        return None
    expected = staging_path_for(out_path, intent_id)
    if Path(os.path.abspath(path)) != expected:
        return f"{path}: not where intent {intent_id} stages (that is {expected}); left untouched"
    if path.is_symlink() or not path.is_dir():
        return f"{path}: not a directory; left untouched"
    try:
        os.rmdir(path)  # empty (a kill right after it was created): nothing to lose
        return None
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            return f"{path}: cannot be removed ({exc.strerror}); left untouched"
    marker = path / MARKER
    try:
        ours = not marker.is_symlink() and marker.read_text(encoding="utf-8").strip() == intent_id
    except (OSError, UnicodeDecodeError):
        ours = False
    if not ours:
        return (
            f"{path}: holds no MergePipe staging marker for intent {intent_id}; left untouched "
            "(remove it yourself if it is a leftover)"
        )
    remove_tree(path)
    return None


def refuse_existing(out_path: str | os.PathLike[str], option: str = "--out") -> Path:
    """The resolved output path (``resolve_output``); OutputExistsError, naming ``option``, if anything is there."""
    out = resolve_output(out_path)
    raw = os.path.join(os.getcwd(), os.path.expanduser(os.fspath(out_path)))  # a dangling symlink counts
    if os.path.lexists(raw) or os.path.lexists(out):
        shown = os.path.abspath(raw) if os.path.lexists(raw) else out
        raise OutputExistsError(f"output path {shown} already exists; choose another {option} or remove it")
    return out


def write_failure(out_path: Path, exc: OSError) -> PublishError:
    """One line for an OS error while staging or publishing ``out_path`` (disk full, permissions, ...)."""
    where = f" ({exc.filename})" if exc.filename else ""
    hint = "Free space on that filesystem" if exc.errno == errno.ENOSPC else "Check the directory and its permissions"
    return PublishError(
        f"cannot write the merged model {out_path}: {exc.strerror or exc}{where}; nothing was published. "
        f"{hint} (or choose another --out) and retry"
    )


def resolve_output(out_path: str | os.PathLike[str]) -> Path:
    """The absolute path an output will have as the filesystem sees it: symlinks in the part that exists
    resolved, ``..`` stepping up from the real directory; a ``..`` after a missing component is refused."""
    path = Path(os.path.expanduser(os.fspath(out_path)))
    if not path.is_absolute():
        path = Path.cwd() / path
    current, missing = Path(path.anchor), False
    for part in path.parts[1:]:
        if part == ".":
            continue
        if part == "..":
            if missing:
                raise ConfigError(
                    f"output path {out_path}: '..' follows {current}, which does not exist; give a plain path"
                )
            current = current.parent
            continue
        current = current / part
        if not missing:
            if os.path.lexists(current):
                current = Path(os.path.realpath(current))
            else:
                missing = True
    return current


STEPS = ("staged", "written", "fsynced", "renamed", "committed")
AreaHook = Callable[["StagingArea"], None]


@dataclass
class StagingArea:
    """One publish attempt: where to write (``path``), where it will appear (``out_path``); ``state``
    moves from staged to published, then committed, or to aborted. ``on_abort`` is set once the intent is
    recorded."""

    intent_id: str
    path: Path
    out_path: Path
    lock: DirLock = field(repr=False)
    replace: bool = False
    on_abort: AreaHook | None = field(default=None, repr=False)
    state: str = "staged"


class TransactionManager:
    """Stages, publishes and aborts snapshot directories. ``on_step(name)`` is told each of ``STEPS``
    (crash-injection tests raise, exit or SIGKILL there). With ``replace`` (``mergepipe-yaml`` re-running
    into the OUT it published), the rename is an atomic exchange with the existing output, which is marked
    as this intent's first so ``recover`` may remove it once swapped."""

    def __init__(self, on_step: Callable[[str], None] | None = None) -> None:
        self._on_step = on_step or (lambda _name: None)

    def stage(
        self,
        out_path: str | Path,
        *,
        record_intent: AreaHook | None = None,
        on_abort: AreaHook | None = None,
        replace: bool = False,
    ) -> StagingArea:
        """A locked staging directory beside ``out_path`` (refused if it exists, unless ``replace``);
        ``record_intent(area)`` runs once it is locked, ``on_abort(area)`` if the attempt is aborted."""
        out = resolve_output(out_path) if replace else refuse_existing(out_path)
        _ensure_dir(out.parent)
        intent_id = uuid.uuid4().hex
        path = staging_path_for(out, intent_id)
        try:
            os.mkdir(path)
        except OSError as exc:
            raise PublishError(
                f"cannot create staging directory {path}: {exc.strerror}; check that {out.parent} is writable"
            ) from None
        lock = DirLock.try_acquire(path)
        if lock is None:  # a fresh, uniquely named directory: nobody else can hold it
            remove_tree(path)
            raise PublishError(f"staging directory {path} is locked by another process; retry")
        area = StagingArea(intent_id, path, out, lock, replace)
        try:
            write_marker(path, intent_id)
            if record_intent is not None:
                record_intent(area)
            area.on_abort = on_abort
            self._on_step("staged")
        except BaseException as exc:
            self.abort(area)
            if isinstance(exc, OSError):  # a disk too full for the marker: one line, like a full disk later
                raise write_failure(out, exc) from None
            raise
        return area

    @contextmanager
    def staged(
        self,
        out_path: str | Path,
        *,
        record_intent: AreaHook | None = None,
        on_abort: AreaHook | None = None,
        replace: bool = False,
    ) -> Iterator[StagingArea]:
        """``stage`` for a block: an exception, or leaving it without ``publish``, aborts."""
        area = self.stage(out_path, record_intent=record_intent, on_abort=on_abort, replace=replace)
        try:
            yield area
        finally:
            if area.state == "staged":
                self.abort(area)

    def publish(self, staging: StagingArea, *, commit: Callable[[], None] | None = None) -> None:
        """Make ``staging`` durable and visible at its ``out_path``, then ``commit()``. Before the rename
        any exception aborts and propagates (OutputExistsError if the output appeared meanwhile); after
        it the output stays, and an exception from ``commit`` leaves the intent pending for ``recover``."""
        if staging.state != "staged":
            raise PublishError(f"{staging!r} cannot be published: it is {staging.state}")
        try:
            self._on_step("written")
            seal(staging.path)
            self._on_step("fsynced")
            if staging.replace and os.path.lexists(staging.out_path):
                (staging.out_path / MARKER).unlink(missing_ok=True)  # one a crash left here before
                write_marker(staging.out_path, staging.intent_id)
                exchange(staging.path, staging.out_path)
            else:
                rename_no_replace(staging.path, staging.out_path)
        except BaseException as exc:
            self.abort(staging)
            if isinstance(exc, FileExistsError):
                raise OutputExistsError(
                    f"output path {staging.out_path} already exists (it appeared while merging); "
                    "choose another --out or remove it"
                ) from None
            if isinstance(exc, OSError):
                raise write_failure(staging.out_path, exc) from None
            raise
        staging.state = "published"
        try:
            fsync_path(staging.out_path.parent)
            self._on_step("renamed")
            if commit is not None:
                commit()
            staging.state = "committed"
            unmark_published(staging.out_path)
            if staging.replace:  # what the output held before, if anything
                remove_tree(staging.path)
            self._on_step("committed")
        finally:
            staging.lock.release()

    def abort(self, staging: StagingArea) -> None:
        """Mark the intent aborted (catalog first: a leftover directory is an orphan ``recover`` removes),
        then remove the staging tree. Idempotent; refused once renamed into place."""
        if staging.state == "aborted":
            return
        if staging.state != "staged":
            raise PublishError(
                f"{staging!r} is already published at {staging.out_path}; it cannot be aborted "
                "(run `mergepipe recover` to finish its commit)"
            )
        staging.state = "aborted"
        try:
            if staging.on_abort is not None:
                staging.on_abort(staging)
        finally:
            try:
                remove_tree(staging.path)
            finally:
                staging.lock.release()


def _ensure_dir(directory: Path) -> None:
    """Create ``directory`` and missing parents, each new entry's parent fsynced."""
    missing, probe = [], directory
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    if not probe.is_dir():
        raise PublishError(f"cannot create output under {probe}: it is not a directory; choose another --out")
    for new in reversed(missing):
        try:
            os.mkdir(new)
        except FileExistsError:
            pass  # created concurrently
        except OSError as exc:
            raise PublishError(
                f"cannot create directory {new}: {exc.strerror}; check the path and permissions"
            ) from None
        fsync_path(new.parent)


#: Files of a repository a push leaves in place though the snapshot has none: the Hub's own.
KEPT_FILES = frozenset({".gitattributes"})


@dataclass(frozen=True)
class HubCommit:
    """The commit a push made on branch ``revision``, or found there (``created`` False: the branch held
    exactly these files already); ``private`` as the Hub reported it; ``deleted``: files the commit removed."""

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
    ``revision`` (default ``main``) on top of its head, removing what the snapshot does not have: uploads
    first, so the repository never shows half a model. The repository (``private`` when asked) and the
    branch are created if missing; ``private`` and an existing public repository: refused before any
    upload. PublishError (one line, no token) for anything the Hub or the connection refuses."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, get_token
    from huggingface_hub.errors import HTTPError, RevisionNotFoundError

    check_online()
    bound_requests()
    api = HfApi()
    branch = revision or "main"
    try:
        api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        try:
            info = api.model_info(repo_id, revision=branch)
            head: str | None = info.sha
        except RevisionNotFoundError:
            if branch == "main":  # a repository without any commit yet: no head
                info, head = api.model_info(repo_id), None
            else:
                api.create_branch(repo_id, branch=branch, exist_ok=True)
                info = api.model_info(repo_id, revision=branch)
                head = info.sha
        if private and info.private is False:
            raise PublishError(
                f"{repo_id} exists and is public, and --private was asked (make it private on the "
                "Hub, or push without --private)"
            )
        present = set(api.list_repo_files(repo_id, revision=head)) if head else set()
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
            parent_commit=head,
        )
    except (HTTPError, OSError, ValueError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and not isinstance(exc.__cause__, (HTTPError, OSError)):
            raise  # huggingface_hub wraps a failed upload's error in a RuntimeError; any other one is a bug
        raise PublishError(redact(_reason(exc, repo_id, api.endpoint), [get_token() or ""])) from None
    visible = private if info.private is None else info.private
    return HubCommit(repo_id, branch, made.oid, visible, made.oid != head, stale)


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
    """An HTTP answer's status and message, a connection that failed, or an error of the library or the file system."""
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
