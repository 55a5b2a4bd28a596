"""`mergepipe serve` and the `mergepipe` command asking it (cli/server.py, launch.py), with real processes.

One server runs for the module on a socket in a directory of the test's own;
every command runs as ``python -m mergepipe ...`` with ``MERGEPIPE_SERVER``
naming that socket, and is compared with the same command run in its own
process (``MERGEPIPE_SERVER=off``): the output, the exit status and the bytes
written must be the same.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from mergepipe import launch
from mergepipe.served import send_request
from tests.planner.support import build_catalog, clone_catalog

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="`mergepipe serve` needs Linux")

BLOCK_BYTES = 2048
EXPERTS = ["e1", "e2"]
#: Seconds the server may take to import torch and every command on a busy machine.
START_SECONDS = 120


@dataclass(frozen=True)
class Server:
    socket: Path
    log: Path
    process: subprocess.Popen

    def log_text(self) -> str:
        return self.log.read_text()


def start_server(sock: Path, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "mergepipe", "serve", "--socket", str(sock)],
                                   stdout=out, stderr=out, env={**os.environ, "MERGEPIPE_SERVER": "off"})
    deadline = time.monotonic() + START_SECONDS
    while "serving on" not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the server did not start: {log.read_text()}")
        time.sleep(0.1)
    return process


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    sock, log = root / "run" / "serve.sock", root / "serve.log"
    process = start_server(sock, log)
    yield Server(sock, log, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert not sock.exists()  # removed on the way out
    assert "stopped" in log.read_text()


@pytest.fixture(scope="module")
def template(tiny_family, tmp_path_factory):
    return build_catalog(tmp_path_factory.mktemp("servecat") / "t.db", BLOCK_BYTES, dict(tiny_family),
                         base="base", experts=EXPERTS)


def mergepipe(args: list[str], where: Path | str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``python -m mergepipe ARGS`` in ``cwd``, asking the server at ``where`` (or ``off``)."""
    return subprocess.run([sys.executable, "-m", "mergepipe", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "MERGEPIPE_SERVER": str(where), **env}, timeout=300)


def merge_args(summary: str) -> list[str]:
    return ["merge", "--db", "c.db", "--base", "base", "--experts", *EXPERTS, "--operator", "ties", "--density",
            "0.5", "--budget", "50%", "--out", "out", "--model-id", "m", "--no-progress", "--json-summary", summary]


def test_a_served_merge_writes_what_the_same_merge_in_its_own_process_writes(server, template, tmp_path):
    here, served = tmp_path / "here", tmp_path / "served"
    for directory in (here, served):
        directory.mkdir()
        clone_catalog(template, directory / "c.db")
    local = mergepipe(merge_args("s.json"), "off", here)
    remote = mergepipe(merge_args("s.json"), server.socket, served)  # relative paths: the client's directory
    assert local.returncode == 0, local.stderr
    assert remote.returncode == 0, remote.stderr
    a, b = (json.loads((d / "s.json").read_text()) for d in (here, served))
    assert a["snapshot_id"] == b["snapshot_id"]
    files = sorted(p.name for p in (here / "out").iterdir())
    assert files == sorted(p.name for p in (served / "out").iterdir()) and "model.safetensors" in files
    for name in set(files) - {"manifest.json"}:  # the manifest carries each run's own seconds and times
        assert (here / "out" / name).read_bytes() == (served / "out" / name).read_bytes(), name
    assert "snapshot" in remote.stdout and remote.stdout.count("\n") == local.stdout.count("\n")
    assert "mergepipe merge --db c.db" in server.log_text()  # it did run in the server
    assert 0 < b["seconds"]["startup"]  # counted from the client's start (served.py)
    # the command's own usage, from inside the server's child: torch's pages (shared from the fork) are in
    # its RSS, where the client, which never imports torch, stays near 20 MB
    assert b["process"]["cpu_seconds"] > 0 and b["process"]["peak_rss_bytes"] > 150e6
    verified = mergepipe(["verify", "--db", "c.db", b["snapshot_id"]], server.socket, served)
    assert verified.returncode == 0 and "ok" in verified.stdout.lower()


@pytest.mark.parametrize("args, code", [
    (["--version"], 0),
    (["show", "--db", "c.db", "nothing"], 1),  # a MergePipeError: one line, no traceback
    (["merge", "--no-such-option"], 2),  # a usage error
    (["models", "--db", "c.db"], 0),
])
def test_output_and_exit_status_are_the_commands_own(server, template, tmp_path, args, code):
    clone_catalog(template, tmp_path / "c.db")
    local = mergepipe(args, "off", tmp_path, COLUMNS="70")
    remote = mergepipe(args, server.socket, tmp_path, COLUMNS="70")  # the client's environment: its width
    assert (remote.returncode, remote.stdout, remote.stderr) == (local.returncode, local.stdout, local.stderr)
    assert remote.returncode == code
    assert "Traceback" not in remote.stderr


def test_ctrl_c_reaches_the_served_command(server, template, tmp_path):
    """SIGINT to the client is passed on: the command aborts as it would by itself (`calibrate` runs for
    seconds and cleans up its scratch files on the way out)."""
    clone_catalog(template, tmp_path / "c.db")
    before = _started(server, "calibrate")
    client = subprocess.Popen([sys.executable, "-m", "mergepipe", "calibrate", "--db", "c.db", "--no-progress"],
                              cwd=tmp_path, env={**os.environ, "MERGEPIPE_SERVER": str(server.socket)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: len(_started(server, "calibrate")) > len(before))
    time.sleep(0.5)
    client.send_signal(signal.SIGINT)
    out, err = client.communicate(timeout=120)
    assert client.returncode == 130, err
    assert "aborted" in err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".mergepipe-calibrate")]


def test_a_client_that_goes_away_gets_its_command_interrupted(server, template, tmp_path):
    clone_catalog(template, tmp_path / "c.db")
    before = _started(server, "calibrate")
    client = subprocess.Popen([sys.executable, "-m", "mergepipe", "calibrate", "--db", "c.db", "--no-progress"],
                              cwd=tmp_path, env={**os.environ, "MERGEPIPE_SERVER": str(server.socket)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(lambda: len(_started(server, "calibrate")) > len(before))
    pid = _started(server, "calibrate")[-1]
    time.sleep(0.5)
    client.kill()
    client.wait()
    _wait_for(lambda: f"pid {pid}: its client went away; interrupted" in server.log_text())
    _wait_for(lambda: f"pid {pid}: exit 130" in server.log_text())


def test_a_command_without_stdin_runs_by_itself(server, tmp_path):
    before = _started(server, "--version")
    closed = subprocess.run(f"{sys.executable} -m mergepipe --version <&-", shell=True, capture_output=True,
                            text=True, cwd=tmp_path, env={**os.environ, "MERGEPIPE_SERVER": str(server.socket)})
    assert closed.returncode == 0 and "version" in closed.stdout and closed.stderr == ""
    assert _started(server, "--version") == before  # not handed over: the server never saw it


def test_a_command_in_a_removed_directory_runs_by_itself(server, tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    script = f"cd {gone} && rmdir {gone} && {sys.executable} -m mergepipe --version"
    result = subprocess.run(script, shell=True, capture_output=True, text=True,
                            env={**os.environ, "MERGEPIPE_SERVER": str(server.socket)})
    assert result.returncode == 0 and "version" in result.stdout and "Traceback" not in result.stderr


def test_a_server_running_other_code_is_refused_and_the_command_runs_here(server, monkeypatch, capsys):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(server.socket))
        send_request(sock, {"argv": ["--version"], "cwd": "/", "env": {}, "code": "other", "started": None},
                     [0, 1, 2])
        reply = json.loads(sock.makefile("rb").readline())
    assert "other code" in reply["refused"] and "restart `mergepipe serve`" in reply["refused"]
    monkeypatch.setenv("MERGEPIPE_SERVER", str(server.socket))
    monkeypatch.setattr(launch, "code_fingerprint", lambda: "edited since")
    assert launch.ask_server(["--version"]) is None  # None: run it here
    assert "other code" in capsys.readouterr().err


def test_no_server_where_one_is_named_runs_the_command_here_and_says_so(tmp_path):
    named = mergepipe(["--version"], tmp_path / "nothing.sock", tmp_path)
    assert named.returncode == 0 and "version" in named.stdout
    assert "no server at" in named.stderr and "running the command in this process" in named.stderr
    quiet = subprocess.run([sys.executable, "-m", "mergepipe", "--version"], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "MERGEPIPE_SERVER"}
                           | {"XDG_RUNTIME_DIR": str(tmp_path)})
    assert quiet.returncode == 0 and quiet.stderr == ""  # the default place, empty: nothing to say


def test_the_socket_is_this_users_alone_and_taken_once(server, tmp_path):
    assert stat.S_IMODE(server.socket.stat().st_mode) == 0o600
    assert stat.S_IMODE(server.socket.parent.stat().st_mode) == 0o700
    again = mergepipe(["serve", "--socket", server.socket], "off", tmp_path)
    assert again.returncode == 2 and "a server already listens at" in again.stderr
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    refused = mergepipe(["serve", "--socket", shared / "s.sock"], "off", tmp_path)
    assert refused.returncode == 2 and "writable by other users" in refused.stderr
    assert not (shared / "s.sock").exists()


def test_a_socket_path_too_long_for_a_socket_is_one_line(tmp_path):
    deep = tmp_path / ("d" * 120) / "serve.sock"  # a socket's address holds 107 bytes
    refused = mergepipe(["serve", "--socket", deep], "off", tmp_path)
    assert refused.returncode == 2 and "cannot listen at" in refused.stderr and "Traceback" not in refused.stderr


def test_a_socket_left_by_a_killed_server_is_taken_over(tmp_path):
    sock = tmp_path / "run" / "serve.sock"
    first = start_server(sock, tmp_path / "first.log")
    first.kill()  # no clean-up: the socket file stays
    first.wait()
    assert sock.exists()
    second = start_server(sock, tmp_path / "second.log")
    try:
        assert mergepipe(["--version"], sock, tmp_path).returncode == 0
        assert "mergepipe --version" in (tmp_path / "second.log").read_text()
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=60)


def test_status_and_stop_from_another_command(tmp_path):
    sock = tmp_path / "run" / "serve.sock"
    assert mergepipe(["serve", "--status", "--socket", sock], "off", tmp_path).stdout.startswith("no server listens")
    process = start_server(sock, tmp_path / "serve.log")
    status = mergepipe(["serve", "--status", "--socket", sock], "off", tmp_path)
    assert status.returncode == 0 and f"a server listens at {sock} (pid {process.pid})" in status.stdout
    stopped = mergepipe(["serve", "--stop", "--socket", sock], "off", tmp_path)
    assert stopped.returncode == 0 and f"(pid {process.pid})" in stopped.stdout
    assert process.wait(timeout=10) == 0 and not sock.exists()
    again = mergepipe(["serve", "--stop", "--socket", sock], "off", tmp_path)
    assert again.returncode == 2 and "no server listens at" in again.stderr
    assert "dropped" not in (tmp_path / "serve.log").read_text()  # the status probe was not taken for a request


def _wait_for(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _started(server: Server, command: str) -> list[int]:
    """The pids of the ``command`` commands the server has started, in order (its log)."""
    return [int(line.split("pid ")[1].split(":")[0]) for line in server.log_text().splitlines()
            if f": mergepipe {command}" in line]
