"""Placing a file without writing it through this process: a reflink, else a kernel copy (never a hard link);
range copies; opening a snapshot's file through no symbolic link."""

from __future__ import annotations

import errno
import os

import pytest

from mergepipe.storage import writer
from mergepipe.storage.writer import CLONED, COPIED, OpenFiles, copy_range, open_inside, place_file


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "source.bin"
    path.write_bytes(os.urandom(3 * 1024 * 1024 + 17))  # not a multiple of any step
    path.chmod(0o444)
    return path


def place(source, target) -> str:
    fd = os.open(source, os.O_RDONLY)
    try:
        return place_file(fd, target)
    finally:
        os.close(fd)


def test_a_file_is_placed_as_a_file_of_its_own(source, tmp_path):
    """Never a hard link: an edit to one snapshot's file must not change another's."""
    target = tmp_path / "target.bin"
    assert place(source, target) in (CLONED, COPIED)
    assert target.read_bytes() == source.read_bytes()
    assert os.stat(target).st_ino != os.stat(source).st_ino and os.stat(source).st_nlink == 1


def test_without_a_reflink_the_kernel_copies_and_without_that_this_process_does(source, tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "_clone", lambda source_fd, target_fd: False)
    calls = []
    real = os.copy_file_range

    def unsupported(*args):
        calls.append(args)
        raise OSError(errno.ENOSYS, "no copy_file_range here")

    monkeypatch.setattr(os, "copy_file_range", unsupported)
    assert place(source, tmp_path / "by-hand.bin") == COPIED
    assert (tmp_path / "by-hand.bin").read_bytes() == source.read_bytes() and len(calls) == 1
    monkeypatch.setattr(os, "copy_file_range", real)
    assert place(source, tmp_path / "kernel.bin") == COPIED
    assert (tmp_path / "kernel.bin").read_bytes() == source.read_bytes()


def test_a_failed_copy_removes_what_it_created(source, tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "_clone", lambda source_fd, target_fd: False)
    monkeypatch.setattr(os, "copy_file_range", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(OSError, match="full"):
        place(source, tmp_path / "target.bin")
    assert not (tmp_path / "target.bin").exists()


def test_a_file_inside_a_folder_is_opened_through_no_symbolic_link(source, tmp_path):
    root = tmp_path / "snap"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "own.bin").write_bytes(b"own")
    (root / "link.bin").symlink_to(source)
    (root / "linked").symlink_to(root / "sub")
    (tmp_path / "via").symlink_to(root)  # the folder itself may be named through a link: `verify ./latest`
    for where in (root, tmp_path / "via"):
        with open(open_inside(where, "sub/own.bin"), "rb") as fh:
            assert fh.read() == b"own"
    for where, name, code in ((root, "link.bin", errno.ELOOP), (root, "linked/own.bin", None),
                              (root, "sub", errno.EINVAL), (root, "missing.bin", errno.ENOENT)):
        with pytest.raises(OSError) as raised:
            open_inside(where, name)
        assert raised.value.errno == code or (code is None and raised.value.errno in (errno.ELOOP, errno.ENOTDIR))


def test_a_range_lands_at_its_offsets_and_a_short_source_is_an_error(source, tmp_path):
    data = source.read_bytes()
    target = tmp_path / "target.bin"
    target.write_bytes(bytes(100))
    with OpenFiles() as files, open(target, "r+b") as out:
        copy_range(files.fd(source), out.fileno(), 1000, 10, 50)
        assert files.fd(source) == files.fd(source)  # opened once
        with pytest.raises(OSError, match="the source ended"):
            copy_range(files.fd(source), out.fileno(), len(data) - 5, 90, 10)
    assert target.read_bytes()[:90] == bytes(10) + data[1000:1050] + bytes(30)
