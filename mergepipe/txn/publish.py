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

import errno
import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from mergepipe.errors import ConfigError, OutputExistsError, PublishError
from mergepipe.txn.fsync import exchange, fsync_dir, fsync_tree, make_read_only, remove_tree, rename_no_replace
from mergepipe.txn.lock import DirLock
from mergepipe.txn.staging import MARKER, staging_path_for, unmark_published, write_marker

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

    def __init__(self, intent_id: str, path: Path, out_path: Path, lock: DirLock,
                 on_abort: AreaHook | None, replace: bool = False) -> None:
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

    def stage(self, out_path: str | Path, *, record_intent: AreaHook | None = None,
              on_abort: AreaHook | None = None, replace: bool = False) -> StagingArea:
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
            raise PublishError(f"cannot create staging directory {path}: {exc.strerror}; "
                               f"check that {out.parent} is writable") from None
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
    def staged(self, out_path: str | Path, *, record_intent: AreaHook | None = None,
               on_abort: AreaHook | None = None, replace: bool = False) -> Iterator[StagingArea]:
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
