"""The `mergepipe` command: a running `mergepipe serve` runs it if there is one, this process otherwise.

Asking the server costs a few milliseconds and saves the ~1.5 s of imports
(torch) every command would otherwise pay (``mergepipe/served.py`` says how).
Nothing changes for the user: the command reads and writes this terminal,
exits with the command's status, and Ctrl-C interrupts it. Where there is no
server, where ``MERGEPIPE_SERVER=off``, or where the server runs other code
than is installed here (it started before an upgrade or an edit), the command
runs here, as it always did; the two latter say so on stderr. Only the
standard library is imported before the command runs here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from importlib import import_module
from typing import BinaryIO

from mergepipe.served import (
    code_fingerprint,
    private_directory,
    process_started,
    send_request,
    socket_from_env,
)

#: Signals passed on to the served command, so that Ctrl-C and a `kill` reach it as they would a local one.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: The exit status when the server ends without the command's (as a shell reports a lost process).
LOST = 255


def main() -> None:
    """Console entry point (``mergepipe`` and ``python -m mergepipe``)."""
    args = sys.argv[1:]
    status = None if args[:1] == ["serve"] else ask_server(args)
    if status is None:
        import_module("mergepipe.cli").main()  # imported here: that is what a served command saves
        return
    sys.exit(status)


def ask_server(args: list[str]) -> int | None:
    """Run ``args`` in the server; its exit status, or None to run the command here instead (no server,
    or one that refused: the reason is on stderr where the user asked for that server or it refused)."""
    path, named = socket_from_env()
    if path is None or not _standard_streams_open():
        return None
    unsafe = private_directory(path) if path.exists() else None
    if unsafe is not None:
        return _local(f"not asking the server at {path}: {unsafe}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(os.fspath(path))
    except OSError as exc:
        sock.close()
        return _local(f"no server at {path} ({exc.strerror or exc})") if named else None
    with sock:
        return _served(sock, args)


def _served(sock: socket.socket, args: list[str]) -> int | None:
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was removed: nothing to hand over, the command decides here
        return None
    request = {"argv": args, "cwd": cwd, "env": dict(os.environ), "code": code_fingerprint(),
               "started": process_started()}
    try:
        send_request(sock, request, [0, 1, 2])
        replies = sock.makefile("rb")
        first = _reply(replies)
    except OSError as exc:
        return _local(f"the server did not take the command ({exc.strerror or exc})")
    if first is None or "refused" in first:
        return _local(first["refused"] if first else "the server closed the connection")
    pid = int(first["pid"])
    previous = {sig: signal.signal(sig, lambda number, _frame: _forward(pid, number)) for sig in FORWARDED}
    try:
        while True:
            reply = _reply(replies)
            if reply is None:
                print(f"mergepipe: the server ended before the command (pid {pid}) did", file=sys.stderr)
                return LOST
            if "exit" in reply:
                return int(reply["exit"])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _reply(replies: BinaryIO) -> dict | None:
    """The next reply line, or None at the end of the connection (a forwarded signal does not interrupt the
    read: Python retries it, PEP 475)."""
    line = replies.readline()
    return json.loads(line) if line.strip() else None


def _standard_streams_open() -> bool:
    """Whether stdin, stdout and stderr are open, as a served command needs them (a daemon that closed
    one runs its commands by itself)."""
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
    except OSError:
        return False
    return True


def _forward(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def _local(reason: str) -> None:
    print(f"mergepipe: {reason}; running the command in this process", file=sys.stderr)
    return None

