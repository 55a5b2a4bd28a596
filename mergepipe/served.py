"""What the `mergepipe` command and a `mergepipe serve` process share: where the server listens, how a
request travels, and how a served command knows when it started.

A `mergepipe` process spends about 1.5 s before its first read, most of it
importing torch. `mergepipe serve` pays that once: it imports everything a
command needs and then forks one child per command, which starts with all of
it loaded. The `mergepipe` command (``mergepipe/launch.py``) asks a running
server first and falls back to running the command itself. A request carries
the client's stdin, stdout and stderr (as file descriptors, so progress bars
and prompts reach the user's terminal as they are), its arguments, working
directory and environment, and the fingerprint of the code it would run: a
server started before the installed code changed refuses, and the command
runs in the client's own process instead.

Standard library only: the client imports nothing else, so asking a server
costs milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import sys
from pathlib import Path
from typing import Any

#: Where the `mergepipe` command looks for a server: a socket path, or ``off`` to never ask one. Unset: the
#: default path (``default_socket``), used when a server listens there.
SERVER_ENV = "MERGEPIPE_SERVER"
#: Set by the server in a served command's environment: ``PID:SECONDS``, the served process and when its
#: client started on the clock of ``/proc/uptime``, so that the command's start-up counts from the user's
#: command, not from the fork (processes it starts inherit the variable, and see another pid in it).
STARTED_ENV = "MERGEPIPE_SERVED_STARTED"
#: Values of ``SERVER_ENV`` that turn the server off.
OFF = ("off", "0", "no", "false", "")
#: A request's header: the byte length of its JSON, big-endian.
_LENGTH_BYTES = 4
#: Why ``receive_request`` failed on a connection closed before sending anything.
EMPTY = "no request"
#: The most a request may be (its environment is most of it).
MAX_REQUEST_BYTES = 1 << 22


def default_socket() -> Path:
    """``$XDG_RUNTIME_DIR/mergepipe.sock``, else ``<tmp>/mergepipe-<uid>/serve.sock``: a directory only
    this user may enter, so no other user can listen where this user's commands look."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "mergepipe.sock"
    tmp = os.environ.get("TMPDIR") or "/tmp"
    return Path(tmp) / f"mergepipe-{os.getuid()}" / "serve.sock"


def socket_from_env() -> tuple[Path | None, bool]:
    """``(socket path or None when turned off, whether the user named it)``."""
    value = os.environ.get(SERVER_ENV)
    if value is None:
        return default_socket(), False
    if value.strip().lower() in OFF:
        return None, True
    return Path(value).expanduser(), True


def private_directory(path: Path) -> str | None:
    """Why ``path``'s directory may not hold this user's server (owned by someone else, or writable by
    others), or None when it is safe: a client hands its terminal to whoever listens there."""
    try:
        info = path.parent.stat()
    except OSError as exc:
        return f"cannot read {path.parent}: {exc.strerror}"
    if info.st_uid != os.getuid():
        return f"{path.parent} belongs to another user"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        return f"{path.parent} is writable by other users"
    return None


def code_fingerprint() -> str:
    """The installed code's identity: the interpreter, the package's place, and the size and modification
    time of each of its modules. A server whose fingerprint differs from a client's runs other code."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256(f"{sys.executable}\0{sys.version}\0{root}".encode())
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                info = os.stat(os.path.join(dirpath, name))
                digest.update(f"{dirpath}/{name}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def uptime() -> float | None:
    """Seconds on the ``/proc/uptime`` clock (Linux), or None elsewhere."""
    try:
        return float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def served_value(pid: int, started: float | None) -> str:
    """``STARTED_ENV``'s value for the served command ``pid`` whose client started at ``started``."""
    return f"{pid}:{'' if started is None else repr(started)}"


def _served_start() -> tuple[bool, float | None]:
    """``(whether this process is a served command, its client's start)`` from ``STARTED_ENV``, which
    names the served process: a process it starts inherits the variable but is not served."""
    pid, _, started = os.environ.get(STARTED_ENV, "").partition(":")
    if pid != str(os.getpid()):
        return False, None
    try:
        return True, float(started)
    except ValueError:
        return True, None


def process_started() -> float | None:
    """When this process started, on the ``/proc/uptime`` clock (to the clock tick), or None elsewhere;
    in a served command, when its client started (``STARTED_ENV``)."""
    served, started = _served_start()
    if served:
        return started
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def is_served() -> bool:
    """Whether this process runs a command for a `mergepipe serve` client."""
    return _served_start()[0]


# ---------------------------------------------------------------- the wire


def send_request(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """One request: its length and JSON, with ``fds`` attached to the first bytes."""
    body = json.dumps(request).encode()
    header = len(body).to_bytes(_LENGTH_BYTES, "big")
    socket.send_fds(sock, [header], fds)
    sock.sendall(body)


def receive_request(sock: socket.socket, max_fds: int = 3) -> tuple[dict[str, Any], list[int]]:
    """A request sent by ``send_request``; ValueError for a malformed one (its fds closed)."""
    header, fds, _, _ = socket.recv_fds(sock, _LENGTH_BYTES, max_fds)
    try:
        if not header:
            raise ValueError(EMPTY)
        if len(header) < _LENGTH_BYTES:
            header += _receive_exactly(sock, _LENGTH_BYTES - len(header))
        length = int.from_bytes(header, "big")
        if not 0 < length <= MAX_REQUEST_BYTES:
            raise ValueError(f"a request of {length} bytes")
        request = json.loads(_receive_exactly(sock, length))
        if not isinstance(request, dict):
            raise ValueError("a request that is not an object")
    except (ValueError, OSError):
        for fd in fds:
            os.close(fd)
        raise
    return request, list(fds)


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 16))
        if not chunk:
            raise ValueError("the request ended early")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def send_reply(sock: socket.socket, **reply: Any) -> None:
    """One reply line (``pid``, ``exit`` or ``refused``); a client that has gone is not an error."""
    try:
        sock.sendall(json.dumps(reply).encode() + b"\n")
    except OSError:
        pass
