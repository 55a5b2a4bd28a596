"""Atomic, durable publishing of a snapshot directory.

The protocol, in order (each name is a step reported to ``on_step``):

1. ``stage``: refuse if the output exists, create a staging directory beside
   it (same filesystem, so the rename is atomic), lock it, record the intent
   in the catalog (``record_intent``) — step ``"staged"``.
2. the caller writes every file into ``StagingArea.path`` — step ``"written"``
   is reported when ``publish`` starts.
3. make the files read-only (directories stay writable by their owner only, so
   the owner can delete the snapshot: ``fsync.make_read_only``), fsync every file
   and directory — ``"fsynced"``. (Modes are set before the fsync so they are
   durable with the data.)
4. rename the staging directory to the output path, refusing to replace
   anything that appeared meanwhile, and fsync the parent — ``"renamed"``.
5. ``commit()``: the caller's catalog commit — ``"committed"``.

With ``replace`` (``mergepipe-yaml``'s re-run into the OUT it published, or
into an empty folder), step 4 swaps the staging directory with the existing
output in one atomic step (``fsync.exchange``), after marking the old one as
this intent's, so that once swapped it is this staging area (``recover`` may
remove it); it is removed after the commit.

Any failure before the rename aborts: the staging directory is removed and the
intent marked aborted (``on_abort``); nothing is ever finalised after an
exception. After the rename the output is complete; if the process dies before
the commit, ``recover`` commits it from its manifest.

``on_step`` exists for crash-injection tests: it may raise, ``os._exit`` or
SIGKILL the process at any step. It is passed in; there is no global hook.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import shutil
import stat
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from mergepipe.errors import ConfigError, OutputExistsError, PublishError

#: Write bits a published file loses: nobody may change a snapshot's bytes in place.
_ALL_WRITE = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
#: Write bits a published directory loses: only its owner may add or remove entries (so the owner can
#: delete the snapshot with ``rm -rf`` or ``mergepipe rm``, which needs a writable directory).
_SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH


def fsync_file(path: str | Path) -> None:
    """Flush a file's data and metadata (including its mode) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries, making creates/renames inside it durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file, then every directory bottom-up, ``root`` last."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                fsync_file(full)
        fsync_dir(dirpath)


def make_read_only(path: str | Path) -> None:
    """Publish modes: files lose every write bit (0o644 becomes 0o444); directories keep their owner's
    rwx and lose group and other write (0o755). A directory is done recursively, bottom-up.

    The bytes are immutable: nothing may rewrite a weight file in place. The directories stay the
    owner's to delete, as any folder is (``rm -rf``, ``mergepipe rm``); ``verify`` reports a file
    added, removed or edited all the same.
    """
    path = Path(path)
    if not path.is_dir() or path.is_symlink():
        if not path.is_symlink():
            _clear(path, _ALL_WRITE)
        return
    for dirpath, _dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                _clear(full, _ALL_WRITE)
        os.chmod(dirpath, (stat.S_IMODE(os.stat(dirpath).st_mode) & ~_SHARED_WRITE) | stat.S_IRWXU)


def _clear(path: str | Path, bits: int) -> None:
    """Clear ``bits`` of a file's mode; a file without them (a linked one, published already) is not touched."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & bits:
        os.chmod(path, mode & ~bits)


def make_writable_tree(path: str | Path) -> None:
    """Give the owner write permission on ``path`` and everything under it (top-down)."""
    path = Path(path)
    if path.is_symlink() or not path.exists():
        return
    os.chmod(path, stat.S_IMODE(path.stat().st_mode) | stat.S_IWUSR | stat.S_IXUSR * path.is_dir())
    if not path.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                continue
            mode = stat.S_IMODE(os.stat(full).st_mode) | stat.S_IWUSR
            os.chmod(full, mode | (stat.S_IXUSR if name in dirnames else 0))


def remove_tree(path: str | Path) -> None:
    """Remove a (possibly read-only) tree; a missing path is fine. Only its directories are made writable:
    its files are unlinked as they are, so a file another snapshot shares keeps its mode and bytes."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_dir() and not path.is_symlink():
        _open_directories(path)
        shutil.rmtree(path)
    else:
        path.unlink()


def _open_directories(root: Path) -> None:
    """Give the owner rwx on ``root`` and every directory under it (top-down), so their entries can be
    removed; files are left alone."""

    def open_up(directory: str | Path) -> None:
        os.chmod(directory, stat.S_IMODE(os.stat(directory).st_mode) | stat.S_IRWXU)

    open_up(root)
    for dirpath, dirnames, _ in os.walk(root):  # each directory opened before os.walk lists it
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        for name in dirnames:
            open_up(os.path.join(dirpath, name))


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _renameat2() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    return getattr(libc, "renameat2", None)


def rename_no_replace(src: str | Path, dst: str | Path) -> None:
    """Rename ``src`` to ``dst``; raise ``FileExistsError`` if ``dst`` exists.

    Uses Linux ``renameat2(RENAME_NOREPLACE)`` so the check and the rename are
    one atomic step (a plain ``rename`` would silently replace an empty
    directory). Where that is unavailable (other OS, or a filesystem that does
    not support the flag) it falls back to check-then-rename.
    """
    src_b, dst_b = os.fsencode(src), os.fsencode(dst)
    fn = _renameat2()
    if fn is not None:
        if fn(_AT_FDCWD, src_b, _AT_FDCWD, dst_b, _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST or err == errno.ENOTEMPTY:
            raise FileExistsError(err, os.strerror(err), os.fsdecode(dst_b))
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), os.fsdecode(src_b), None, os.fsdecode(dst_b))
    if os.path.lexists(dst_b):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(dst_b))
    os.rename(src_b, dst_b)


def exchange(src: str | Path, dst: str | Path) -> None:
    """Swap ``src`` and ``dst`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``): a reader of
    either path sees the old entry or the new one, never neither. OSError where that is unavailable."""
    fn = _renameat2()
    if fn is None:
        raise OSError(errno.ENOSYS, "this system cannot swap two directories atomically (renameat2)", os.fspath(dst))
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fspath(src), None, os.fspath(dst))


class DirLock:
    """An exclusive, non-blocking ``flock`` on a directory, released by ``release()``."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def try_acquire(cls, path: str | Path) -> DirLock | None:
        """The lock, or ``None`` if another open file description holds it.

        Raises ``FileNotFoundError`` if ``path`` does not exist.
        """
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
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
        """Unlock and close; safe to call twice."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
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
    """``(output name, intent id)`` if ``name`` is a staging directory name, else ``None``."""
    match = _STAGING_NAME.match(name)
    return (match["out"], match["intent"]) if match else None


def write_marker(path: Path, intent_id: str) -> None:
    """Mark a freshly created staging directory as this intent's."""
    with open(path / MARKER, "x", encoding="utf-8") as fh:
        fh.write(intent_id + "\n")


def unmark_published(out: Path) -> None:
    """Drop the marker from a committed snapshot (its directory is read-only:
    write permission is lent for the unlink). Manifests and ``verify`` ignore
    the marker, so a crash before this leaves a valid snapshot."""
    marker = out / MARKER
    if not os.path.lexists(marker):
        return
    mode = stat.S_IMODE(os.stat(out).st_mode)
    os.chmod(out, mode | stat.S_IWUSR)
    try:
        marker.unlink(missing_ok=True)
    finally:
        os.chmod(out, mode)
    fsync_dir(out)


def remove_staging(path: str | Path, intent_id: str, out_path: str | Path) -> str | None:
    """Remove the staging directory of ``intent_id`` for ``out_path`` if it is provably ours.

    Returns ``None`` when it was removed or is absent, else one line saying
    why it was left alone (for the user: remove it yourself if it is a leftover).
    """
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
    if _marker(path) != intent_id:
        return (
            f"{path}: holds no MergePipe staging marker for intent {intent_id}; left untouched "
            "(remove it yourself if it is a leftover)"
        )
    remove_tree(path)
    return None


def _marker(path: Path) -> str | None:
    marker = path / MARKER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        return marker.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


STEPS = ("staged", "written", "fsynced", "renamed", "committed")

StepHook = Callable[[str], None]
AreaHook = Callable[["StagingArea"], None]


def refuse_existing(out_path: str | os.PathLike[str], option: str = "--out") -> Path:
    """The resolved output path (``resolve_output``); OutputExistsError, naming ``option``, if anything is there."""
    out = resolve_output(out_path)
    # the name itself may be a (dangling) symlink: the OS resolves the raw path
    raw = os.path.join(os.getcwd(), os.path.expanduser(os.fspath(out_path)))
    if os.path.lexists(raw) or os.path.lexists(out):
        shown = os.path.abspath(raw) if os.path.lexists(raw) else out
        raise OutputExistsError(f"output path {shown} already exists; choose another {option} or remove it")
    return out


def write_failure(out_path: Path, exc: OSError) -> PublishError:
    """One line for an OS error while staging or publishing ``out_path`` (disk full, permissions, ...)."""
    where = f" ({exc.filename})" if exc.filename else ""
    hint = "free space on that filesystem" if exc.errno == errno.ENOSPC else "check the directory and its permissions"
    return PublishError(
        f"cannot write the merged model {out_path}: {exc.strerror or exc}{where}; nothing was published. "
        f"{hint[0].upper()}{hint[1:]} (or choose another --out) and retry"
    )


def resolve_output(out_path: str | os.PathLike[str]) -> Path:
    """The absolute path an output will have, as the filesystem sees it.

    Symlinks in the part that exists are resolved, and ``..`` steps up from
    the real directory; a ``..`` after a component that does not exist is
    refused (``mkdir`` could not follow it either), where a textual
    normalisation would silently drop both.
    """
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


class StagingArea:
    """One publish attempt: where to write (``path``) and where it will appear (``out_path``).

    ``state`` moves ``staged`` -> ``committed`` (via ``published``) or ``aborted``.
    """

    def __init__(
        self,
        intent_id: str,
        path: Path,
        out_path: Path,
        lock: DirLock,
        on_abort: AreaHook | None,
        replace: bool = False,
    ) -> None:
        self.intent_id = intent_id
        self.path = path
        self.out_path = out_path
        self.replace = replace
        self.state = "staged"
        self._lock = lock
        self._on_abort = on_abort
        self._intent_recorded = False

    def __repr__(self) -> str:
        return f"StagingArea(intent_id={self.intent_id!r}, out_path={str(self.out_path)!r}, state={self.state!r})"


class TransactionManager:
    """Stages, publishes and aborts snapshot directories (see the module docstring).

    >>> tm = TransactionManager()
    >>> with tm.staged(out, record_intent=..., on_abort=...) as area:  # doctest: +SKIP
    ...     write_files(area.path)
    ...     tm.publish(area, commit=lambda: catalog.commit_snapshot(...))
    """

    def __init__(self, on_step: StepHook | None = None) -> None:
        self._on_step = on_step

    def _step(self, name: str) -> None:
        if self._on_step is not None:
            self._on_step(name)

    # -- stage ----------------------------------------------------------------

    def stage(
        self,
        out_path: str | Path,
        *,
        record_intent: AreaHook | None = None,
        on_abort: AreaHook | None = None,
        replace: bool = False,
    ) -> StagingArea:
        """Create a locked staging directory for ``out_path``; refuse if it exists (unless ``replace``).

        ``record_intent(area)`` runs after the directory exists and is locked,
        so recovery never mistakes a live publish for a dead one;
        ``on_abort(area)`` runs if this attempt is aborted after that.
        """
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
        area = StagingArea(intent_id, path, out, lock, on_abort, replace)
        try:
            write_marker(path, intent_id)
            if record_intent is not None:
                record_intent(area)
            area._intent_recorded = True
            self._step("staged")
        except OSError as exc:  # a disk too full for the marker: one line, like a full disk later
            self.abort(area)
            raise write_failure(out, exc) from None
        except BaseException:
            self.abort(area)
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
        """``stage`` as a context manager: an exception, or leaving the block
        without ``publish``, aborts; after the rename nothing is undone."""
        area = self.stage(out_path, record_intent=record_intent, on_abort=on_abort, replace=replace)
        try:
            yield area
        finally:
            if area.state == "staged":
                self.abort(area)

    # -- publish ----------------------------------------------------------------

    def publish(self, staging: StagingArea, *, commit: Callable[[], None] | None = None) -> None:
        """Make ``staging`` durable and visible at ``staging.out_path``, then ``commit()``.

        Before the rename any exception aborts (staging removed, intent
        aborted) and propagates. ``OutputExistsError`` if the output appeared
        meanwhile. After the rename the output stays whatever happens; an
        exception from ``commit`` propagates and leaves the intent pending for
        ``recover``.
        """
        if staging.state != "staged":
            raise PublishError(f"{staging!r} cannot be published: it is {staging.state}")
        try:
            self._step("written")
            make_read_only(staging.path)
            fsync_tree(staging.path)
            self._step("fsynced")
            if staging.replace and os.path.lexists(staging.out_path):
                (staging.out_path / MARKER).unlink(missing_ok=True)  # one a crash left here before
                write_marker(staging.out_path, staging.intent_id)
                exchange(staging.path, staging.out_path)
            else:
                rename_no_replace(staging.path, staging.out_path)
        except FileExistsError:
            self.abort(staging)
            raise OutputExistsError(
                f"output path {staging.out_path} already exists (it appeared while merging); "
                "choose another --out or remove it"
            ) from None
        except OSError as exc:
            self.abort(staging)
            raise write_failure(staging.out_path, exc) from None
        except BaseException:
            self.abort(staging)
            raise
        staging.state = "published"
        try:
            fsync_dir(staging.out_path.parent)
            self._step("renamed")
            if commit is not None:
                commit()
            staging.state = "committed"
            unmark_published(staging.out_path)
            if staging.replace:  # what the output held before, if anything
                remove_tree(staging.path)
            self._step("committed")
        finally:
            staging._lock.release()

    # -- abort ------------------------------------------------------------------

    def abort(self, staging: StagingArea) -> None:
        """Discard a staged attempt: mark the intent aborted, remove the staging tree.

        Idempotent for an aborted area; refuses one already renamed into place.
        """
        if staging.state == "aborted":
            return
        if staging.state != "staged":
            raise PublishError(
                f"{staging!r} is already published at {staging.out_path}; it cannot be aborted "
                "(run `mergepipe recover` to finish its commit)"
            )
        staging.state = "aborted"
        try:
            if staging._intent_recorded and staging._on_abort is not None:
                staging._on_abort(staging)  # catalog first: a leftover dir is an orphan recover removes
        finally:
            try:
                remove_tree(staging.path)
            finally:
                staging._lock.release()


def _ensure_dir(directory: Path) -> None:
    """Create ``directory`` and missing parents, durably (each new entry's parent fsynced)."""
    missing = []
    probe = directory
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    if not probe.is_dir():
        raise PublishError(f"cannot create output under {probe}: it is not a directory; choose another --out")
    for new in reversed(missing):
        try:
            os.mkdir(new)
        except FileExistsError:
            pass  # created concurrently; fine
        except OSError as exc:
            raise PublishError(
                f"cannot create directory {new}: {exc.strerror}; check the path and permissions"
            ) from None
        fsync_dir(new.parent)
