"""Work units as Ray tasks (``RayExecutor``): each runs ``run_unit`` on a worker, which opens the inputs
itself and writes into the staged shards at fixed offsets; the shared job goes through Ray's object store
once. ``ray_runtime`` connects (or starts a local instance) within a deadline. Ray is an optional extra,
imported only here and only when asked for (docs/ARCHITECTURE.md, "Execution")."""

from __future__ import annotations

import logging
import os
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

from mergepipe.engine import RAY_INSTALL_HINT
from mergepipe.engine.job import WorkUnit
from mergepipe.engine.stream import UnitRecord, UnitTask, no_progress
from mergepipe.errors import ConfigError, EngineError, MergePipeError
from mergepipe.runtime import compute_threads

INSTALL_HINT = RAY_INSTALL_HINT
#: Tries after the first when a task's worker process or node dies (Ray's default); unit errors are not retried.
MAX_RETRIES = 3
#: Cores each task asks Ray for; torch computes with as many threads.
CPUS_PER_WORKER = 1
#: How long the coordinator waits for a record before looking again: the longest a Ctrl-C waits.
POLL_SECONDS = 0.5
#: Seconds stopped tasks get to see the stop file and end; then force-cancelled ones get to end.
STOP_GRACE_SECONDS, CANCEL_WAIT_SECONDS = 5.0, 30.0
#: How often a task looks for the stop file (between blocks), and its name in the staging area.
STOP_CHECK_SECONDS, STOP_FILE = 0.2, ".mergepipe-stop"
#: How long connecting, or starting a local instance, may take (Ray itself retries a dead address for minutes).
RAY_CONNECT_SECONDS = 30.0
#: Workers listed one by one on the status line; more are summarised (slowest, median, fastest).
MAX_LISTED = 4


def import_ray() -> ModuleType:
    """The ``ray`` module; a one-line ConfigError naming the extra when it is not installed."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--executor ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


@contextmanager
def ray_runtime(
    address: str | None = None, cpus: int | None = None, *, connect_seconds: float = RAY_CONNECT_SECONDS
) -> Iterator[ModuleType]:
    """``ray`` connected to the runtime at ``address`` (``auto``, ``ray://HOST:PORT``, ``HOST:PORT``, ``local``:
    an instance of its own with at least ``cpus`` cores; default ``$RAY_ADDRESS``, else ``local``)."""
    ray = import_ray()
    held = None
    if not ray.is_initialized():
        held = _connect(ray, address or os.environ.get("RAY_ADDRESS") or "local", cpus, connect_seconds)
    try:
        yield ray
    finally:
        if held is not None:
            ray.shutdown()  # here, where Ctrl-C interrupts it (Ray's exit handler then stops a local instance)
            held.set()


@contextmanager
def ray_executor(
    address: str | None = None, workers: int | None = None, *, connect_seconds: float = RAY_CONNECT_SECONDS
) -> Iterator[RayExecutor]:
    """A ``RayExecutor`` on ``ray_runtime(address)``; ``workers`` by default the cluster's cores."""
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    with ray_runtime(address, workers and workers * CPUS_PER_WORKER, connect_seconds=connect_seconds) as ray:
        if workers is None:
            workers = max(1, int(ray.cluster_resources().get("CPU", 1)) // CPUS_PER_WORKER)
        yield RayExecutor(ray, workers)


def _connect(ray: ModuleType, address: str, cpus: int | None, seconds: float) -> threading.Event:
    """Connect to (for ``local``: start) Ray within ``seconds`` on a thread holding it until the event is set."""
    # Ray's logging while it starts is noise here; its warnings about the run are not
    options: dict[str, Any] = {"address": address, "logging_level": logging.ERROR, "log_to_driver": False}
    error: type[MergePipeError] = ConfigError
    failed, advice = f"could not connect to Ray at {address!r}", "check the address, or start a cluster there "
    advice += "with `ray start --head` (then --ray-address auto), or use --ray-address local"
    if address == "local":  # cores for the workers asked for (at least this machine's), no dashboard
        options.update(num_cpus=max(cpus or 0, os.cpu_count() or 1), include_dashboard=False)
        error, failed = EngineError, "could not start a local Ray instance"
        advice = "check that Ray can start on this machine (`ray start --head` says why it cannot), or run with "
        advice += "--executor local"
    done, held, raised, wanted = threading.Event(), threading.Event(), [], [True]

    def hold() -> None:
        try:
            ray.init(**options)
        except BaseException as exc:  # raised in the waiting thread
            raised.append(exc)
            return
        finally:
            done.set()
        held.wait()
        if not wanted[0]:
            ray.shutdown()

    deadline, started = time.monotonic() + seconds, False
    try:
        parts = urlsplit(address if "://" in address else f"//{address}")
        if address != "local" and parts.hostname and parts.port:  # nothing listening: at once, Ray never started
            socket.create_connection((parts.hostname, parts.port), timeout=seconds).close()
        threading.Thread(target=hold, name="mergepipe-ray-init", daemon=True).start()
        started = done.wait(max(0.0, deadline - time.monotonic())) and not raised
        if raised:
            raise raised[0]
    except TimeoutError:  # the TCP connect took the whole deadline: "no answer" below
        started = False
    except (OSError, ValueError, RuntimeError, ray.exceptions.RayError) as exc:
        raise error(f"{failed}: {_first_line(exc)}; {advice}") from None
    finally:
        if not started:  # the deadline, an error or Ctrl-C: a start still going on shuts down when it is done
            wanted[0] = False
            held.set()
    if not started:
        raise error(f"{failed}: no answer within {seconds:g} s; {advice}")
    logging.getLogger("ray").setLevel(logging.WARNING)
    return held


@dataclass(frozen=True)
class WorkerResult:
    """What a task returns: the unit's record, the worker process that ran it (``host:pid``), its seconds."""

    record: UnitRecord
    worker: str
    seconds: float


@dataclass
class WorkerStats:
    units: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    seconds: float = 0.0


@dataclass
class WorkerProgress:
    """Units done of ``total_units`` and what each worker process did: the status line beside the bar."""

    total_units: int
    workers: dict[str, WorkerStats] = field(default_factory=dict)

    @property
    def units_done(self) -> int:
        return sum(w.units for w in self.workers.values())

    def add(self, result: WorkerResult) -> None:
        stats = self.workers.setdefault(result.worker, WorkerStats())
        stats.units += 1
        stats.bytes_written += result.record.bytes_written
        stats.bytes_read += sum(result.record.bytes_by_tag.values())
        stats.seconds += result.seconds

    def status(self) -> str:
        """``7/24 units · pid 812 41 MB/s, pid 815 39 MB/s`` (output MB/s over each worker's own time)."""
        head = f"{self.units_done}/{self.total_units} units" if self.total_units else ""
        one_host = len({name.rsplit(":", 1)[0] for name in self.workers}) == 1
        rates = {
            (f"pid {name.rsplit(':', 1)[1]}" if one_host else name): w.bytes_written / max(w.seconds, 1e-9) / 1e6
            for name, w in self.workers.items()
        }
        if not head or not rates:
            return head
        if len(rates) <= MAX_LISTED:
            return head + " · " + ", ".join(f"{name} {rate:.0f} MB/s" for name, rate in sorted(rates.items()))
        values = sorted(rates.values())
        return (
            f"{head} · {len(values)} workers {values[0]:.0f} / {statistics.median(values):.0f} / "
            f"{values[-1]:.0f} MB/s (slowest / median / fastest)"
        )


class RayExecutor:
    """Runs units as Ray tasks, ``workers`` at a time, largest first; a task whose worker dies is retried."""

    in_process = False  # units run in other processes: the coordinator hashes the written files after

    def __init__(self, ray: ModuleType, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self._ray, self.workers = ray, workers
        self.progress = WorkerProgress(0)  # the last run's (benchmarks read it)

    def status(self) -> str:
        return self.progress.status()

    def run(self, units: Sequence[WorkUnit], task: UnitTask) -> list[UnitRecord]:
        ray = self._ray
        remote = ray.remote(run_on_worker).options(
            num_cpus=CPUS_PER_WORKER, max_retries=MAX_RETRIES, retry_exceptions=False
        )
        shipped = [ray.put(replace(task, advance=no_progress))]  # in a list: the worker fetches it, once per process
        self.progress = WorkerProgress(len(units))
        queue = deque(sorted(units, key=lambda u: (-u.nbytes, u.index)))
        pending: dict[Any, WorkUnit] = {}
        records: dict[int, UnitRecord] = {}
        try:
            while queue or pending:
                while queue and len(pending) < self.workers:
                    unit = queue.popleft()
                    pending[remote.remote(shipped, unit, CPUS_PER_WORKER)] = unit
                for ref in ray.wait(list(pending), num_returns=1, timeout=POLL_SECONDS)[0]:
                    unit = pending.pop(ref)
                    result: WorkerResult = task_result(
                        ray,
                        ref,
                        f"work unit {unit.index} ({unit.shard})",
                        failed="nothing was published. This is a bug: please report it (run the merge with "
                        "--executor local for its traceback)",
                        died=f"died {MAX_RETRIES + 1} times",
                        lost="nothing was published. Check the workers' memory and logs (`ray logs`), or run with "
                        "fewer --workers",
                    )
                    records[unit.index] = result.record
                    self.progress.add(result)
                    task.advance(result.record.bytes_written, f"unit {unit.index} ({result.worker})")
        except BaseException:  # a failed unit, Ctrl-C: no task may go on writing into the staging area
            self._stop(list(pending), stop_file(task))
            raise
        return [records[unit.index] for unit in units]

    def _stop(self, refs: list[Any], flag: Path) -> None:
        """End the tasks of ``refs``: the stop file, then a force-cancel of those still running after a while."""
        if not refs:
            return
        flag.touch()
        running = self._ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_SECONDS)[1]
        for ref in running:
            self._ray.cancel(ref, force=True)
        if running:
            self._ray.wait(running, num_returns=len(running), timeout=CANCEL_WAIT_SECONDS)


def task_result(ray: ModuleType, ref: Any, what: str, *, failed: str, died: str, lost: str) -> Any:
    """``ray.get(ref)``; the task's ``MergePipeError`` or ``OSError`` as it is, any other failure one line."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:  # the task raised: not retried
        cause = exc.cause if exc.cause is not None else exc  # None: the driver could not rebuild it
        if isinstance(cause, (MergePipeError, OSError)):
            raise cause from None
        raise EngineError(
            f"{what} failed on a Ray worker: {type(cause).__name__}: {_first_line(cause)}; {failed}"
        ) from None
    except ray.exceptions.RayError as exc:
        raise EngineError(f"{what} was lost: its Ray worker {died} ({type(exc).__name__}); {lost}") from None


def stop_file(task: UnitTask) -> Path:
    return next(iter(task.job.layouts.values())).path.parent / STOP_FILE


def run_on_worker(shipped: list[Any], unit: WorkUnit, threads: int) -> WorkerResult:
    """A Ray task: run ``unit`` (until the stop file appears), then make its bytes durable on this node."""
    started = time.perf_counter()
    task = _shipped(shipped[0])
    flag, last = stop_file(task), [time.monotonic()]

    def advance(nbytes: int, description: str) -> None:
        if time.monotonic() - last[0] >= STOP_CHECK_SECONDS:
            last[0] = time.monotonic()
            if flag.exists():
                raise EngineError("this unit was stopped: another unit failed, or the merge was interrupted")

    with compute_threads(threads):
        record = replace(task, advance=advance)(unit)
    fd = os.open(task.job.layouts[unit.shard].path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        getattr(os, "fdatasync", os.fsync)(fd)  # the data is what matters; macOS has only fsync
    finally:
        os.close(fd)
    return WorkerResult(record, f"{socket.gethostname()}:{os.getpid()}", time.perf_counter() - started)


_SHIPPED: dict[str, UnitTask] = {}  # in a worker process: the task of the merge it ran last, by object id


def _shipped(ref: Any) -> UnitTask:
    """The shared task, deserialised once per worker process and merge (it holds every planned block's hash)."""
    if ref.hex() not in _SHIPPED:
        _SHIPPED.clear()
        _SHIPPED[ref.hex()] = import_ray().get(ref)
    return _SHIPPED[ref.hex()]


def _first_line(exc: BaseException | None) -> str:
    text = str(exc).strip() if exc is not None else ""
    return text.splitlines()[0] if text else "(no message)"
