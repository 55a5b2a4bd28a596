"""The loop of `mergepipe serve`: accept a command, fork a child that runs it, report its exit status.

One process, one thread: a ``selectors`` loop over the listening socket, each
running command's pidfd (readable when the child exits) and its client's
connection (readable when the client goes away). The parent never runs a
command and never touches torch beyond importing it, so forking it is safe:
no thread pools or CUDA context exist yet to be copied half-made. Each child
is a fresh command in all but its imports: its own process group, the
client's stdin/stdout/stderr, working directory and environment. A client
that disappears (killed) gets its command interrupted as Ctrl-C would, which
aborts a merge cleanly. Linux only (``os.pidfd_open``, ``SO_PEERCRED``).
"""

from __future__ import annotations

import io
import os
import selectors
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.errors import ConfigError
from mergepipe.served import (
    EMPTY,
    STARTED_ENV,
    code_fingerprint,
    private_directory,
    receive_request,
    send_reply,
    served_value,
)

#: Seconds a connected client has to send its request.
REQUEST_TIMEOUT = 10.0
#: What a child runs: the command line with these arguments (an error status leaves by ``SystemExit``).
Run = Callable[[list[str]], None]


@dataclass
class Running:
    """A command in flight."""

    pid: int
    conn: socket.socket
    argv: list[str]
    started: float = field(default_factory=time.monotonic)


def listen(path: Path) -> socket.socket:
    """A socket listening at ``path`` that only this user can reach; ConfigError where a server already
    listens there or the directory is not private."""
    if not hasattr(os, "pidfd_open") or not hasattr(socket, "SO_PEERCRED"):
        raise ConfigError("`mergepipe serve` needs Linux (pidfd_open, SO_PEERCRED); run commands directly")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    unsafe = private_directory(path)
    if unsafe is not None:
        raise ConfigError(f"cannot serve at {path}: {unsafe}; choose --socket in a directory of your own")
    if path.exists() or path.is_symlink():
        if server_pid(path) is not None:
            raise ConfigError(f"a server already listens at {path}; stop it first, or choose another --socket")
        path.unlink()  # a socket left by a server that was killed
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o177)
    try:
        sock.bind(os.fspath(path))
    except OSError as exc:  # a path over the 107 bytes a socket address holds, a read-only directory
        sock.close()
        raise ConfigError(f"cannot listen at {path}: {exc.strerror or exc}; choose a shorter --socket path in a "
                          "directory of your own") from exc
    finally:
        os.umask(old_mask)
    sock.listen(16)
    return sock


def server_pid(path: Path) -> int | None:
    """The pid of the server listening at ``path`` (its credentials on a connection), or None when none
    does. The connection sends nothing: the server drops it without a word."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(os.fspath(path))
        return _peer(probe)[0]
    except OSError:
        return None
    finally:
        probe.close()


def _peer(conn: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a Unix socket connection."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def stop(path: Path, seconds: float) -> int:
    """Ask the server at ``path`` to stop (SIGTERM: it lets running commands finish) and wait up to
    ``seconds`` for it to go; its pid. ConfigError when no server listens there or it does not stop."""
    pid = server_pid(path)
    if pid is None:
        raise ConfigError(f"no server listens at {path}")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + seconds
    while path.exists() or _alive(pid):
        if time.monotonic() > deadline:
            raise ConfigError(f"the server at {path} (pid {pid}) has not stopped after {seconds:.0f} s; it waits "
                              f"for its running commands (`kill -INT {pid}` twice leaves them)")
        time.sleep(0.05)
    return pid


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, exited but not yet reaped by whoever started it, does not)."""
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except ProcessLookupError:
        return False
    except (OSError, IndexError):  # no /proc: it exists
        return True


def serve(sock: socket.socket, path: Path, run: Run, log: Callable[[str], None]) -> None:
    """Serve commands on ``sock`` until interrupted (Ctrl-C or SIGTERM), then let the commands still
    running finish and report to their clients (interrupted again: leave them running, unreported)."""
    fingerprint = code_fingerprint()
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, ("listen", None))
    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a shell starts `serve &` with it ignored
        signal.signal(sig, signal.default_int_handler)
    try:
        _loop(selector, sock, fingerprint, run, log)
    except KeyboardInterrupt:
        selector.unregister(sock)
        sock.close()
        path.unlink(missing_ok=True)
        waiting = [key for key in selector.get_map().values() if key.data[0] == "exit"]
        if waiting:
            log(f"stopping: waiting for {len(waiting)} running command(s); interrupt again to leave them")
            try:
                _loop(selector, sock, fingerprint, run, log)
            except KeyboardInterrupt:
                pass
        log("stopped")
    finally:
        selector.close()
        sock.close()
        path.unlink(missing_ok=True)


def _loop(selector: selectors.BaseSelector, sock: socket.socket, fingerprint: str, run: Run,
          log: Callable[[str], None]) -> None:
    """Handle events until nothing is left to wait for (never, while listening)."""
    while any(key.data[0] in ("listen", "exit") for key in selector.get_map().values()):
        for key, _ in selector.select():
            kind, running = key.data
            if kind == "listen":
                _accept(sock, selector, fingerprint, run, log)
            elif kind == "exit":
                _reap(selector, running, key.fileobj, log)
            else:
                _client_gone(selector, running, log)


def _accept(sock: socket.socket, selector: selectors.BaseSelector, fingerprint: str, run: Run,
            log: Callable[[str], None]) -> None:
    conn, _ = sock.accept()
    pid, uid = _peer(conn)
    if uid != os.getuid():
        log(f"refused a client of another user (uid {uid})")
        conn.close()
        return
    conn.settimeout(REQUEST_TIMEOUT)
    try:
        request, fds = receive_request(conn)
    except (ValueError, OSError) as exc:
        if str(exc) != EMPTY:  # a probe that connected and left (another `serve` checking the socket)
            log(f"dropped a malformed request from pid {pid}: {exc}")
        conn.close()
        return
    conn.settimeout(None)
    if request.get("code") != fingerprint:
        for fd in fds:
            os.close(fd)
        send_reply(conn, refused="the server runs other code than is installed here (started before it changed); "
                   "restart `mergepipe serve`")
        conn.close()
        return
    others = [key.fd for key in selector.get_map().values() if key.fileobj is not sock]  # other commands'
    child = os.fork()
    if child == 0:
        for fd in others:  # not this child's to hold: a client waits until every copy of its connection closes
            os.close(fd)
        # the child keeps its copy of ``conn`` open, unused: should the server stop first, the client
        # still waits for the command's end (and then reports it lost)
        _child(sock, fds, request, run)  # never returns
    for fd in fds:
        os.close(fd)
    running = Running(child, conn, list(request.get("argv", [])))
    send_reply(conn, pid=child)
    selector.register(os.pidfd_open(child), selectors.EVENT_READ, ("exit", running))
    selector.register(conn, selectors.EVENT_READ, ("client", running))
    log(f"pid {child}: mergepipe {' '.join(running.argv)}")


def _reap(selector: selectors.BaseSelector, running: Running, pidfd: object, log: Callable[[str], None]) -> None:
    selector.unregister(pidfd)
    os.close(pidfd)  # type: ignore[arg-type]
    _, status = os.waitpid(running.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    code = 128 - code if code < 0 else code  # killed by a signal: as a shell reports it
    send_reply(running.conn, exit=code)
    _close_client(selector, running)
    log(f"pid {running.pid}: exit {code} after {time.monotonic() - running.started:.1f} s")


def _client_gone(selector: selectors.BaseSelector, running: Running, log: Callable[[str], None]) -> None:
    """The client's end is readable: it sent nothing, so it has gone; interrupt its command (as Ctrl-C:
    a merge aborts cleanly)."""
    _close_client(selector, running)
    try:
        os.kill(running.pid, signal.SIGINT)
        log(f"pid {running.pid}: its client went away; interrupted")
    except ProcessLookupError:
        pass


def _close_client(selector: selectors.BaseSelector, running: Running) -> None:
    if running.conn.fileno() >= 0:
        selector.unregister(running.conn)
        running.conn.close()


def _child(sock: socket.socket, fds: list[int], request: dict, run: Run) -> None:
    """In the forked child: become the client's command, run it, exit with its status (which the server
    sends the client once it has reaped the child)."""
    code = 1
    try:
        os.setpgid(0, 0)  # the server's Ctrl-C is not the command's; the client forwards its own
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sock.close()
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        _become(request)
        run(list(request["argv"]))
        code = 0
    except BaseException as exc:  # noqa: BLE001 - whatever happens, the client gets a status and the child exits
        if not isinstance(exc, SystemExit):
            print(f"mergepipe serve: the command failed: {exc!r}", file=sys.stderr)
        else:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _become(request: dict) -> None:
    """The client's working directory, environment and standard streams (new Python streams on the
    client's descriptors, so that their buffering and encoding are those of the client's terminal)."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[STARTED_ENV] = served_value(os.getpid(), request.get("started"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), errors="surrogateescape")
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        interactive = raw.isatty()
        setattr(sys, name, io.TextIOWrapper(io.BufferedWriter(raw), line_buffering=interactive or fd == 2,
                                            errors="backslashreplace" if fd == 2 else "strict"))
    sys.argv = ["mergepipe", *request["argv"]]
