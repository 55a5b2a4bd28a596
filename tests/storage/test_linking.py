"""Placing a file without writing it: a hard link, else a reflink, else a kernel copy; and range copies."""

from __future__ import annotations

import errno
import os

import pytest

from mergepipe.storage import linking
from mergepipe.storage.linking import CLONED, COPIED, LINKED, OpenFiles, copy_range, place_file


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "source.bin"
    path.write_bytes(os.urandom(3 * 1024 * 1024 + 17))  # not a multiple of any step
    path.chmod(0o444)
    return path


def place(source, target) -> str:
    fd = os.open(source, os.O_RDONLY)
    try:
        return place_file(source, target, fd)
    finally:
        os.close(fd)


def test_a_file_is_hard_linked_where_it_can_be(source, tmp_path):
    target = tmp_path / "target.bin"
    assert place(source, target) == LINKED
    assert os.stat(target).st_ino == os.stat(source).st_ino and os.stat(source).st_nlink == 2
    assert oct(os.stat(source).st_mode & 0o777) == oct(0o444)  # a link leaves the shared inode's mode alone


@pytest.mark.parametrize("code", [errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP])
def test_without_a_link_the_file_is_cloned_or_copied(source, tmp_path, monkeypatch, code):
    def no_link(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "link", no_link)
    target = tmp_path / "target.bin"
    assert place(source, target) in (CLONED, COPIED)
    assert target.read_bytes() == source.read_bytes()
    assert os.stat(target).st_ino != os.stat(source).st_ino and os.stat(source).st_nlink == 1


def test_without_a_reflink_the_kernel_copies_and_without_that_this_process_does(source, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "link", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EXDEV, "cross-device")))
    monkeypatch.setattr(linking, "_clone", lambda source_fd, target_fd: False)
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


def test_another_link_error_is_raised_and_leaves_nothing(source, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "link", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(OSError, match="full"):
        place(source, tmp_path / "target.bin")
    assert not (tmp_path / "target.bin").exists()


def test_a_failed_copy_removes_what_it_created(source, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "link", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EXDEV, "cross-device")))
    monkeypatch.setattr(linking, "_clone", lambda source_fd, target_fd: False)
    monkeypatch.setattr(os, "copy_file_range", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(OSError, match="full"):
        place(source, tmp_path / "target.bin")
    assert not (tmp_path / "target.bin").exists()


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
