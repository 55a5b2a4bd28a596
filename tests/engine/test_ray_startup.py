"""Connecting to Ray, or starting a local instance (mergepipe.engine.ray_executor.ray_executor): bounded, one
line when it fails, quiet, and Ctrl-C honoured while Ray starts, runs and shuts down.

Each case runs ``ray_executor`` in a child Python process (``CHILD``), as the
``mergepipe`` command does: a start the coordinator gives up on goes on in a
thread of that process (Ray's native code logs on file descriptor 2), which in
the test process would reach other tests' captured output. The child's whole
stdout and stderr are the user's terminal. Every child gets a fresh Ray temp directory (no cluster
of this machine is found, no other Ray session is touched) and an
environment variable that marks every process it starts, so a test can tell
that no Ray process outlives its command.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.planner.support import subprocess_env

pytest.importorskip("ray")

#: The child: ``ray_executor(ADDRESS, 1, connect_seconds=SECONDS)``, a task run on it, and an interrupt
#: (SIGINT, as Ctrl-C sends) from a timer thread ``DELAY`` seconds after start-up (``start``) or closing
#: (``shutdown``) begins. It prints what the `mergepipe` command would (``error: ...``, ``aborted``) and how
#: long each step took.
CHILD = """
import os, signal, sys, threading, time
# SIGINT raising KeyboardInterrupt, as in a terminal: a background job of a shell without job control starts
# with SIGINT ignored, and Python leaves it so (the `sigint_handled` fixture of test_ray_executor.py says more).
signal.signal(signal.SIGINT, signal.default_int_handler)
import ray
from mergepipe.engine.ray_executor import ray_executor
from mergepipe.errors import MergePipeError

address, seconds, phase, delay = sys.argv[1], float(sys.argv[2]), sys.argv[3], float(sys.argv[4])
sent = []

def interrupt_in(delay):
    def send():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)
    threading.Timer(delay, send).start()

started = time.monotonic()
try:
    if phase == "start":
        interrupt_in(delay)
    if phase == "stderr":  # another thread of the command writes to file descriptor 2 while Ray starts
        threading.Timer(delay, lambda: os.write(2, b"another thread's line\\n")).start()
    with ray_executor(address, 1, connect_seconds=seconds) as executor:
        print("connected after", round(time.monotonic() - started, 1), flush=True)
        print("answer", ray.get(ray.remote(lambda: 6 * 7).remote()), flush=True)
        if phase == "shutdown":
            interrupt_in(delay)
    print("closed", ray.is_initialized(), flush=True)
    if phase == "shutdown":
        time.sleep(30)  # the interrupt lands here if closing was quicker than the timer
except MergePipeError as exc:
    print("failed after", round(time.monotonic() - started, 1), flush=True)
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(exc.exit_code)
except KeyboardInterrupt:
    print("interrupted after", round(time.monotonic() - sent[0], 1) if sent else "no signal", flush=True)
    print("aborted", file=sys.stderr)
    sys.exit(130)
"""
#: The most a child may take, imports and Ray's start included (a broken start-up takes minutes).
CHILD_TIMEOUT_SECONDS = 120.0
#: The most an interrupt or a deadline may be late (a loaded machine, and the first task's worker start).
LATE_SECONDS = 5.0
#: Marks the environment of the child and of every process it starts (Ray's processes inherit it).
MARK = "MERGEPIPE_TEST_RAY_CHILD"


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """A fresh Ray temp directory with a short path (Ray's sockets live under it: at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="mp-ray-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def unanswered() -> Iterator[str]:
    """``HOST:PORT`` where a connection is never answered: a listening socket whose queue is full, so the
    kernel drops every further SYN (a host behind a firewall that drops packets looks the same)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    queued = []
    for _ in range(4):
        client = socket.socket()
        client.setblocking(False)
        client.connect_ex(("127.0.0.1", port))
        queued.append(client)
    time.sleep(0.2)
    yield f"127.0.0.1:{port}"
    for sock in (*queued, server):
        sock.close()


def run_child(ray_tmp: Path, address: str, seconds: float, phase: str = "none", delay: float = 0.0,
              **env: str) -> tuple[subprocess.CompletedProcess, str]:
    """The child's result, and its mark."""
    mark = uuid.uuid4().hex
    child_env = subprocess_env() | {"RAY_TMPDIR": str(ray_tmp), MARK: mark} | env
    child_env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, address, str(seconds), phase, str(delay)],
                          check=False, capture_output=True, text=True, env=child_env,
                          timeout=CHILD_TIMEOUT_SECONDS)
    return proc, mark


def seconds_after(stdout: str, what: str) -> float:
    """The seconds the child printed after ``what`` (``failed after``, ``interrupted after``)."""
    lines = [line for line in stdout.splitlines() if line.startswith(what)]
    assert len(lines) == 1, stdout
    return float(lines[0].rsplit(" ", 1)[1])


def marked_processes(mark: str) -> list[int]:
    """Process ids of live processes whose environment holds ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


def assert_no_ray_process_left(mark: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (left := marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes of the child still running: {left}"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["refused", "unanswered", "auto"])
def test_a_cluster_that_cannot_be_reached_fails_in_time_with_one_line(case, ray_tmp, request):
    """No cluster at the address (``auto``: none on this machine): one error line, none of Ray's own logging.
    A refused address fails at once, Ray never started (Ray itself would retry it for over ten minutes); an
    unanswered one at the deadline, saying so."""
    address = {"refused": "127.0.0.1:1", "auto": "auto"}.get(case) or request.getfixturevalue("unanswered")
    seconds = 2.0
    proc, mark = run_child(ray_tmp, address, seconds)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr  # one line: nothing of Ray's
    message = proc.stderr.strip()
    assert message.startswith(f"error: could not connect to Ray at '{address}': "), message
    assert "ray start --head" in message and "--ray-address local" in message
    assert seconds_after(proc.stdout, "failed after") <= seconds + LATE_SECONDS
    if case == "refused":
        assert "Connection refused" in message
        assert seconds_after(proc.stdout, "failed after") <= LATE_SECONDS
    if case == "unanswered":
        assert "no answer within 2 s" in message
        assert seconds_after(proc.stdout, "failed after") >= seconds
    assert "connected" not in proc.stdout
    assert_no_ray_process_left(mark)


@pytest.mark.slow
def test_a_local_instance_that_cannot_start_is_one_line(ray_tmp):
    """Ray's temp directory under a regular file: the start fails at once, as one line naming why."""
    blocker = ray_tmp / "not-a-directory"
    blocker.write_text("")
    proc, mark = run_child(ray_tmp, "local", 30.0, RAY_TMPDIR=str(blocker))
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr
    message = proc.stderr.strip()
    assert message.startswith("error: could not start a local Ray instance: "), message
    assert "Not a directory" in message and "--executor local" in message
    assert "Traceback" not in proc.stdout + proc.stderr
    assert_no_ray_process_left(mark)


@pytest.mark.slow
def test_ctrl_c_while_connecting_is_honoured_at_once(ray_tmp, unanswered):
    """SIGINT while connecting to an address that never answers (a deadline far off): KeyboardInterrupt at
    once, and the process ends without anything of Ray's on its stderr."""
    proc, mark = run_child(ray_tmp, unanswered, 100.0, "start", 1.0)
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert seconds_after(proc.stdout, "interrupted after") <= LATE_SECONDS
    assert "connected" not in proc.stdout
    assert proc.stderr.splitlines() == ["aborted"], proc.stderr
    assert_no_ray_process_left(mark)


@pytest.mark.slow
def test_ctrl_c_while_a_local_instance_starts_leaves_no_ray_process(ray_tmp):
    proc, mark = run_child(ray_tmp, "local", 100.0, "start", 0.5)
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert seconds_after(proc.stdout, "interrupted after") <= LATE_SECONDS
    assert "Traceback" not in proc.stderr, proc.stderr
    assert_no_ray_process_left(mark)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["none", "shutdown"], ids=["closed", "ctrl-c-while-closing"])
def test_a_local_instance_runs_tasks_and_ends_with_the_command(phase, ray_tmp):
    """The instance started for the command (by a thread that holds it) runs tasks, is shut down on the
    way out, quietly, and leaves no process behind, also when Ctrl-C interrupts its shutdown."""
    proc, mark = run_child(ray_tmp, "local", 100.0, phase, 0.1)
    assert "answer 42" in proc.stdout, proc.stdout + proc.stderr
    if phase == "none":
        assert proc.returncode == 0, proc.stderr
        assert "closed False" in proc.stdout
        assert proc.stderr == "", proc.stderr
    else:
        assert proc.returncode == 130, proc.stdout + proc.stderr
        assert seconds_after(proc.stdout, "interrupted after") <= LATE_SECONDS
        assert "Traceback" not in proc.stderr, proc.stderr
    assert_no_ray_process_left(mark)


@pytest.mark.slow
def test_starting_ray_leaves_other_threads_stderr_alone(ray_tmp):
    """No process-wide redirection: a line another thread writes to file descriptor 2 while a local instance
    starts reaches the terminal."""
    proc, mark = run_child(ray_tmp, "local", 100.0, "stderr", 0.3)
    assert "answer 42" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr
    assert "another thread's line" in proc.stderr.splitlines(), proc.stderr
    assert_no_ray_process_left(mark)
