"""What the `mergepipe` command and `mergepipe serve` share (served.py): the wire, the start, the checks."""

from __future__ import annotations

import os
import socket

import pytest

from mergepipe import served
from mergepipe.engine.stream import process_seconds


def test_a_request_and_its_descriptors_cross_the_socket_whole():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    read_end, write_end = os.pipe()
    request = {"argv": ["merge", "--db", "c.db"], "env": {"A": "x" * 100_000}, "cwd": "/tmp"}  # over one send
    with left, right:
        served.send_request(left, request, [write_end])
        got, fds = served.receive_request(right)
        assert got == request and len(fds) == 1
        os.write(fds[0], b"through the passed descriptor")
        assert os.read(read_end, 100) == b"through the passed descriptor"
    for fd in (read_end, write_end, *fds):
        os.close(fd)


@pytest.mark.parametrize("raw, why", [
    (b"", served.EMPTY),
    ((5).to_bytes(4, "big") + b"[1,2]", "not an object"),
    ((0).to_bytes(4, "big"), "a request of 0 bytes"),
    ((10).to_bytes(4, "big") + b"{}", "ended early"),
])
def test_a_malformed_request_is_an_error_that_closes_what_came_with_it(raw, why):
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    read_end, write_end = os.pipe()
    with left, right:
        if raw:
            socket.send_fds(left, [raw], [write_end])
        left.shutdown(socket.SHUT_WR)
        with pytest.raises(ValueError, match=why):
            served.receive_request(right)
    os.close(write_end)
    assert os.read(read_end, 1) == b""  # every copy of the write end is closed: end of file
    os.close(read_end)


def test_a_served_command_starts_when_its_client_did_and_its_children_do_not(monkeypatch):
    now = served.uptime()
    assert now is not None
    monkeypatch.setenv(served.STARTED_ENV, served.served_value(os.getpid(), now - 5.0))
    assert served.is_served() and served.process_started() == pytest.approx(now - 5.0)
    assert process_seconds() == pytest.approx(5.0, abs=0.5)
    monkeypatch.setenv(served.STARTED_ENV, served.served_value(os.getpid() + 1, now - 5.0))  # inherited
    assert not served.is_served() and process_seconds() != pytest.approx(5.0, abs=0.5)


def test_only_a_private_directory_may_hold_a_server(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert served.private_directory(private / "s.sock") is None
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert "writable by other users" in served.private_directory(shared / "s.sock")
    shared.chmod(0o1777)  # sticky, like /tmp: others cannot replace this user's socket
    assert served.private_directory(shared / "s.sock") is None
    assert "cannot read" in served.private_directory(tmp_path / "missing" / "s.sock")


def test_where_the_command_looks_for_a_server(monkeypatch, tmp_path):
    monkeypatch.delenv(served.SERVER_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert served.socket_from_env() == (tmp_path / "mergepipe.sock", False)
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert served.socket_from_env() == (tmp_path / f"mergepipe-{os.getuid()}" / "serve.sock", False)
    monkeypatch.setenv(served.SERVER_ENV, "off")
    assert served.socket_from_env() == (None, True)
    monkeypatch.setenv(served.SERVER_ENV, str(tmp_path / "x.sock"))
    assert served.socket_from_env() == (tmp_path / "x.sock", True)


def test_the_fingerprint_changes_with_the_code(tmp_path, monkeypatch):
    first = served.code_fingerprint()
    assert first == served.code_fingerprint()
    module = os.path.join(os.path.dirname(served.__file__), "units.py")
    info = os.stat(module)
    try:
        os.utime(module, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000_000))
        assert served.code_fingerprint() != first
    finally:
        os.utime(module, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert served.code_fingerprint() == first
