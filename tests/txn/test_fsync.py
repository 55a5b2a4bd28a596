"""Filesystem primitives: modes, removal, no-replace rename."""

from __future__ import annotations

import errno
import stat

import pytest

from mergepipe.txn import publish as fs
from tests.fixtures.checkpoints import make_writable_tree


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_seal_then_writable_then_remove(tmp_path):
    root = tmp_path / "snap"
    (root / "sub").mkdir(parents=True)
    (root / "a").write_text("a")
    (root / "sub" / "b").write_text("b")
    for path in (root, root / "sub", root / "a", root / "sub" / "b"):
        path.chmod(0o777 if path.is_dir() else 0o666)
    fs.seal(root)  # read-only files and dirs are fsynced after their chmod
    # files lose every write bit; directories only group's and other's: the owner may still delete them
    assert (mode(root), mode(root / "sub"), mode(root / "a"), mode(root / "sub" / "b")) == (0o755, 0o755, 0o444, 0o444)
    make_writable_tree(root)
    assert mode(root) & stat.S_IWUSR and mode(root / "sub" / "b") & stat.S_IWUSR
    fs.seal(root)
    fs.remove_tree(root)
    assert not root.exists()
    fs.remove_tree(root)  # missing is fine


def test_seal_keeps_a_private_directory_private(tmp_path):
    root = tmp_path / "snap"
    root.mkdir(mode=0o700)
    root.chmod(0o700)
    fs.seal(root)
    assert mode(root) == 0o700


@pytest.mark.parametrize("native", [True, False], ids=["renameat2", "fallback"])
def test_rename_no_replace(tmp_path, monkeypatch, native):
    if not native:
        monkeypatch.setattr(fs, "_renameat2", lambda *args: errno.ENOSYS)
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileExistsError):
        fs.rename_no_replace(src, empty)  # plain os.rename would replace an empty dir
    (tmp_path / "file").write_text("y")
    with pytest.raises(FileExistsError):
        fs.rename_no_replace(src, tmp_path / "file")
    fs.rename_no_replace(src, tmp_path / "dst")
    assert (tmp_path / "dst" / "f").read_text() == "x" and not src.exists() and empty.is_dir()


def test_removing_a_tree_leaves_a_file_it_shares_with_another_alone(tmp_path):
    """Snapshots share hard-linked files (an incremental merge links what it reuses whole): removing one
    unlinks its names, and the other's file keeps its mode, bytes and inode."""
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "w.safetensors").write_bytes(b"weights")
    fs.seal(kept)
    gone = tmp_path / "gone"
    gone.mkdir()
    (gone / "sub").mkdir()
    (gone / "sub" / "w.safetensors").hardlink_to(kept / "w.safetensors")
    fs.seal(gone)
    assert mode(kept / "w.safetensors") == 0o444  # publishing the second snapshot changed nothing of it
    inode = (kept / "w.safetensors").stat().st_ino
    fs.remove_tree(gone)
    assert not gone.exists()
    shared = kept / "w.safetensors"
    assert (mode(shared), shared.read_bytes(), shared.stat().st_ino, shared.stat().st_nlink) == \
        (0o444, b"weights", inode, 1)
