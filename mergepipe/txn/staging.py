"""Staging directories: where they are, how they are marked, and when one may be removed.

A publish attempt stages its files in ``<parent>/.<out name>.mergepipe-staging-<intent id>``
(hidden, beside the output, on the same filesystem so the final rename is
atomic) and writes a marker file holding its intent id into it right after
creating it. ``recover`` and ``gc`` remove a staging directory only when it
is provably MergePipe's: the path is exactly the staging path of that intent
beside that output, it is a real directory (not a symlink), and it is empty
or holds the marker with that intent id. Anything else is reported and left
alone: a forged or damaged catalog row can never make MergePipe delete a
user's folder. The marker travels with the directory through the rename;
manifests and ``verify`` ignore it, and it is removed once the snapshot is
committed.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from mergepipe.txn.fsync import fsync_dir, remove_tree

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
