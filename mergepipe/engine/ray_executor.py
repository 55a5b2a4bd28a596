"""Work units as Ray tasks: one plan executed by many workers, the same bytes and manifest as a local run.

``RayExecutor`` implements the engine's ``Executor`` (``executor.py``): the
coordinator (the engine, in the process that runs ``merge``) creates the
staged shards with their headers, cuts the plan into units and checks the
records; each unit runs as one Ray task with the same ``run_unit`` as a
local thread. A task opens its inputs itself (paths on a filesystem every
worker sees, or ``s3://``/``http(s)://`` URIs), writes its tensors into the
staged shard at their fixed offsets, makes them durable on its node
(``fdatasync``, so a shared filesystem shows them to the coordinator) and
returns its small ``UnitRecord``: no tensor byte passes through the
coordinator or Ray's object store.

What a task needs is the execution's ``UnitTask`` (plan, operator, opened
checkpoint headers, thresholds, recorded block hashes, shard layouts): plain
data, put in the object store once (``ray.put``) and fetched and
deserialised once per worker process (``_shipped_task``). The alternative,
rebuilding it in every worker from the plan and the catalog's path, would
have every worker open the SQLite catalog (unsafe on a network filesystem)
and repeat the coordinator's checks; this way the coordinator is the only
process that reads or writes the catalog.

Units are handed out largest first, ``workers`` at a time. A task whose
worker process (or node) dies is retried by Ray up to ``max_retries`` times:
writes at fixed offsets of deterministic bytes are idempotent, so a retry
simply writes its unit again. A task that fails for good (a unit that
raises, or a worker that keeps dying) stops the others and is raised as a
one-line error (a ``MergePipeError`` or ``OSError`` from the unit as it is,
so it reads as it would locally); Ctrl-C stops them too. Stopping is
cooperative first: the coordinator creates a stop file in the staging area,
which every task looks for between blocks (at most every
``STOP_CHECK_SECONDS``) and ends on; a task still running after
``STOP_GRACE_SECONDS`` (stuck in a read) is force-cancelled, its worker
killed. Only that last resort uses ``ray.cancel``: a force-cancel that races
its task's own completion aborts the coordinator inside Ray (Ray 2.60,
"Check failed: it != submissible_tasks_.end() Tried to complete task that
was not pending": exit status 1, no Python error; ray-project/ray#54798
fixed a sibling of it), and a task that ends by itself cannot race. Every
task has ended, or its worker was killed, before the error reaches the
engine, which then aborts the transaction: nothing is published and the
catalog records the intent as aborted.

Connecting (or starting a local instance) is bounded and quiet: ``ray.init``
runs on a thread of its own while the calling thread waits for it, at most
``RAY_CONNECT_SECONDS``, with Ctrl-C raised at once. Ray itself retries a
dead address for over ten minutes inside native code, where no signal
reaches Python, logging every retry on file descriptor 2; that descriptor
points at ``/dev/null`` while the caller waits, and a failure is one line.
The thread holds the connection until ``ray.shutdown``: on Linux, the
processes of a local instance die with the thread that started them.

Ray is an optional extra (``pip install 'mergepipe[ray]'``): nothing imports
it until ``ray_executor`` is called.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from mergepipe.engine.defaults import RAY_INSTALL_HINT
from mergepipe.engine.executor import UnitTask
from mergepipe.engine.job import WorkUnit
from mergepipe.engine.stream import UnitRecord
from mergepipe.errors import ConfigError, EngineError, MergePipeError
from mergepipe.runtime import compute_threads

#: Workers listed one by one on the status line; more are summarised (slowest, median, fastest).
MAX_LISTED = 4


@dataclass(frozen=True)
class WorkerResult:
    """What a task returns: the unit's record, the worker process that ran it (``host:pid``) and the
    unit's wall seconds there."""

    record: UnitRecord
    worker: str
    seconds: float


@dataclass
class WorkerStats:
    """One worker process's units so far."""

    units: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def mb_per_second(self) -> float:
        """Output MB written per second of its units' wall time."""
        return self.bytes_written / max(self.seconds, 1e-9) / 1e6


@dataclass
class WorkerProgress:
    """Units done of ``total_units`` and the stats of every worker that finished one."""

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
        """``7/24 units · pid 812 41 MB/s, pid 815 39 MB/s`` (many workers: slowest, median, fastest)."""
        if not self.total_units:
            return ""
        head = f"{self.units_done}/{self.total_units} units"
        if not self.workers:
            return head
        hosts = {name.rsplit(":", 1)[0] for name in self.workers}
        rates = {
            (f"pid {name.rsplit(':', 1)[1]}" if len(hosts) == 1 else name): w.mb_per_second
            for name, w in self.workers.items()
        }
        if len(rates) <= MAX_LISTED:
            return head + " · " + ", ".join(f"{name} {rate:.0f} MB/s" for name, rate in sorted(rates.items()))
        values = sorted(rates.values())
        return (
            f"{head} · {len(values)} workers {values[0]:.0f} / {statistics.median(values):.0f} / "
            f"{values[-1]:.0f} MB/s (slowest / median / fastest)"
        )


#: What to install for ``--executor ray`` (named in the error when it is missing).
INSTALL_HINT = RAY_INSTALL_HINT
#: Tries after the first when a task's worker process or node dies (Ray's own default for tasks). Unit
#: errors are never retried: the same inputs would fail again.
DEFAULT_MAX_RETRIES = 3
#: Cores each task asks Ray for; torch computes with as many threads (reads run on the unit's read-ahead).
DEFAULT_CPUS_PER_WORKER = 1
#: How long the coordinator waits for a record before looking again: the longest a Ctrl-C waits.
POLL_SECONDS = 0.5
#: How long cancelled tasks get to end (their workers are killed) before the staging area is removed.
CANCEL_WAIT_SECONDS = 30.0
#: How long tasks get to see the stop file and end by themselves before the ones left are force-cancelled.
STOP_GRACE_SECONDS = 5.0
#: How often a task looks for the stop file (between blocks).
STOP_CHECK_SECONDS = 0.2
#: The stop file, in the staging area beside the shards (a filesystem every worker sees).
STOP_FILE = ".mergepipe-stop"
#: How long connecting to a cluster, or starting a local instance, may take: a cluster answers within a
#: second and a local start takes a few, while Ray's own retries at a dead address go on for minutes.
RAY_CONNECT_SECONDS = 30.0


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
    """The ``ray`` module, connected: to the runtime this process already is, or else to the one at
    ``address`` (``auto``, ``ray://HOST:PORT``, ``HOST:PORT``, or ``local``: a Ray instance of this process's
    own, of at least ``cpus`` cores; by default ``$RAY_ADDRESS``, else ``local``) within ``connect_seconds``,
    disconnected on the way out."""
    ray = import_ray()
    connection = None
    if not ray.is_initialized():
        connection = _connect(ray, address or os.environ.get("RAY_ADDRESS") or "local", cpus, connect_seconds)
    try:
        yield ray
    finally:
        if connection is not None:
            connection.close()


@contextmanager
def ray_executor(
    address: str | None = None,
    workers: int | None = None,
    *,
    cpus_per_worker: int = DEFAULT_CPUS_PER_WORKER,
    max_retries: int = DEFAULT_MAX_RETRIES,
    connect_seconds: float = RAY_CONNECT_SECONDS,
) -> Iterator[RayExecutor]:
    """A ``RayExecutor`` on the runtime of ``ray_runtime(address)``. ``workers``: tasks at once, by default the
    cluster's cores over ``cpus_per_worker``."""
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    cpus = None if workers is None else workers * cpus_per_worker
    with ray_runtime(address, cpus, connect_seconds=connect_seconds) as ray:
        if workers is None:
            workers = max(1, int(ray.cluster_resources().get("CPU", 1)) // cpus_per_worker)
        yield RayExecutor(ray, workers, cpus_per_worker=cpus_per_worker, max_retries=max_retries)


def _connect(ray: ModuleType, address: str, num_cpus: int | None, seconds: float = RAY_CONNECT_SECONDS) -> _Connection:
    """Connect to (or, for ``local``, start) a Ray runtime within ``seconds``; a one-line error when that
    fails or takes longer (a ConfigError for an address, an EngineError for a local start)."""
    # Ray's warnings while it starts (not the main thread, token authentication) are noise here; after it,
    # its warnings about the run are not.
    options: dict[str, Any] = {"address": address, "logging_level": logging.ERROR, "log_to_driver": False}
    error: type[MergePipeError]
    if address == "local":  # cores for the workers asked for (at least this machine's), no dashboard
        options.update(num_cpus=max(num_cpus or 0, os.cpu_count() or 1), include_dashboard=False)
        error, failed, advice = (
            EngineError,
            "could not start a local Ray instance",
            (
                "check that Ray can start on this machine (`ray start --head` says why it cannot), "
                "or run with --executor local"
            ),
        )
    else:
        error, failed, advice = (
            ConfigError,
            f"could not connect to Ray at {address!r}",
            (
                "check the address, or start a cluster there with `ray start --head` (then --ray-address auto), "
                "or use --ray-address local"
            ),
        )
    connection = _Connection(ray, options)
    try:
        started = connection.wait(seconds)
    except (OSError, ValueError, RuntimeError, ray.exceptions.RayError) as exc:
        raise error(f"{failed}: {_first_line(exc)}; {advice}") from None
    if not started:
        raise error(f"{failed}: no answer within {seconds:g} s; {advice}")
    logging.getLogger("ray").setLevel(logging.WARNING)
    return connection


class _Connection:
    """This process's connection to Ray, held by a daemon thread from ``ray.init`` until it is closed.

    The calling thread only waits (``wait``), so a deadline and Ctrl-C end the wait at once; a start it
    gave up on goes on in the background and shuts down as soon as it is done."""

    def __init__(self, ray: ModuleType, options: dict[str, Any]) -> None:
        self._ray = ray
        self._options = options
        self._done = threading.Event()  # ray.init returned or raised
        self._release = threading.Event()  # the connection is no longer wanted
        self._abandoned = False
        self._error: BaseException | None = None
        threading.Thread(target=self._hold, name="mergepipe-ray-init", daemon=True).start()

    def _hold(self) -> None:
        try:
            self._ray.init(**self._options)
        except BaseException as exc:
            self._error = exc
            self._done.set()
            return
        self._done.set()
        self._release.wait()
        if self._abandoned:  # nobody uses this connection: end it (and a local instance's processes)
            self._ray.shutdown()

    def wait(self, seconds: float) -> bool:
        """Whether ``ray.init`` returned within ``seconds`` (what it raised is raised here). Ray's native
        logging is kept off the terminal meanwhile; an interrupt, or the deadline, abandons the start."""
        try:
            with _quiet_stderr():
                done = self._done.wait(seconds)
        except BaseException:  # Ctrl-C while Ray starts
            self._abandon()
            raise
        if not done:
            self._abandon()
            return False
        if self._error is not None:
            raise self._error
        return True

    def _abandon(self) -> None:
        self._abandoned = True
        self._release.set()

    def close(self) -> None:
        """``ray.shutdown`` here, so Ctrl-C interrupts it as any Python code; then the holding thread ends.
        An interrupted shutdown keeps the thread: Ray's exit handler finishes the shutdown as the process
        ends, stopping a local instance's processes in order (killed with the thread, its raylet's agents
        would linger for a minute, waiting for the dead GCS)."""
        self._ray.shutdown()
        self._release.set()


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 on ``/dev/null``: Ray's native code logs every connection retry there, whatever
    Python's logging says. Restored on the way out, before any error is shown."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


class RayExecutor:
    """Runs units as Ray tasks, ``workers`` at a time (see the module docstring)."""

    in_process = False  # units run in other processes: the coordinator hashes the written files after

    def __init__(
        self,
        ray: ModuleType,
        workers: int,
        *,
        cpus_per_worker: int = DEFAULT_CPUS_PER_WORKER,
        max_retries: int = DEFAULT_MAX_RETRIES,
    ) -> None:
        if workers < 1 or cpus_per_worker < 1 or max_retries < 0:
            raise ValueError(
                f"bad Ray executor settings: workers={workers}, cpus_per_worker={cpus_per_worker}, "
                f"max_retries={max_retries}"
            )
        self._ray = ray
        self.workers = workers
        self.cpus_per_worker = cpus_per_worker
        self.max_retries = max_retries
        #: The last run's units done and per-worker rates (the progress bar's status; benchmarks read it).
        self.progress = WorkerProgress(0)

    def status(self) -> str:
        return self.progress.status()

    def run(self, units: Sequence[WorkUnit], task: UnitTask) -> list[UnitRecord]:
        """Every unit as a task; the records in unit order, or the first failure (the rest cancelled)."""
        ray = self._ray
        remote = ray.remote(run_on_worker).options(
            num_cpus=self.cpus_per_worker, max_retries=self.max_retries, retry_exceptions=False
        )
        shipped = [ray.put(task.detached())]  # in a list, so the worker fetches it itself (and keeps it)
        self.progress = WorkerProgress(len(units))
        queue = deque(sorted(units, key=lambda u: (-u.nbytes, u.index)))  # largest first: an even finish
        pending: dict[Any, WorkUnit] = {}
        records: dict[int, UnitRecord] = {}
        try:
            while queue or pending:
                while queue and len(pending) < self.workers:
                    unit = queue.popleft()
                    pending[remote.remote(shipped, unit, self.cpus_per_worker)] = unit
                done, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_SECONDS)
                for ref in done:
                    unit = pending.pop(ref)
                    result = self._result(ref, unit)
                    records[unit.index] = result.record
                    self.progress.add(result)
                    task.advance(result.record.bytes_written, f"unit {unit.index} ({result.worker})")
        except BaseException:  # a failed unit, Ctrl-C: no task may go on writing into the staging area
            self._stop(list(pending), stop_file(task))
            raise
        return [records[unit.index] for unit in units]

    def _result(self, ref: Any, unit: WorkUnit) -> WorkerResult:
        """A finished task's result, or its failure as the one-line error the engine raises."""
        result: WorkerResult = task_result(
            self._ray,
            ref,
            f"work unit {unit.index} ({unit.shard})",
            failed="nothing was published. This is a bug: please report it (run the merge with --executor local "
            "for its traceback)",
            died=f"died {self.max_retries + 1} times",  # its worker or node died on every try
            lost="nothing was published. Check the workers' memory and logs (`ray logs`), or run with fewer --workers",
        )
        return result

    def _stop(self, refs: list[Any], flag: Path) -> None:
        """End the tasks of ``refs``: the stop file, then a force-cancel of those still running after the
        grace period (module docstring); returns once every one has ended."""
        if not refs:
            return
        flag.touch()
        _, running = self._ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_SECONDS)
        for ref in running:
            self._ray.cancel(ref, force=True)
        if running:
            self._ray.wait(running, num_returns=len(running), timeout=CANCEL_WAIT_SECONDS)


def task_result(ray: ModuleType, ref: Any, what: str, *, failed: str, died: str, lost: str) -> Any:
    """``ray.get(ref)``; what the task raised when it is a ``MergePipeError`` or ``OSError``, as it is (it reads
    as it would locally: a full disk names the path); any other failure one ``EngineError`` line: ``what`` failed
    on a worker (then ``failed``), or was lost because its worker ``died`` (then ``lost``)."""
    exceptions = ray.exceptions
    try:
        return ray.get(ref)
    except exceptions.RayTaskError as exc:  # the task raised: not retried
        cause = exc.cause if exc.cause is not None else exc  # None: the driver could not rebuild it
        if isinstance(cause, (MergePipeError, OSError)):
            raise cause from None
        raise EngineError(
            f"{what} failed on a Ray worker: {type(cause).__name__}: {_first_line(cause)}; {failed}"
        ) from None
    except exceptions.RayError as exc:
        raise EngineError(f"{what} was lost: its Ray worker {died} ({type(exc).__name__}); {lost}") from None


def stop_file(task: UnitTask) -> Path:
    """The stop file of ``task``'s execution: in its staging area."""
    return next(iter(task.job.layouts.values())).path.parent / STOP_FILE


# ------------------------------------------------------------------ in the worker process


@dataclass
class _Shipped:
    """The task this worker process fetched last, by its object id: a worker that runs several units of
    one merge deserialises the shared job (every planned block's hash: megabytes for a large merge) once."""

    key: str = ""
    task: UnitTask | None = None


_SHIPPED = _Shipped()  # per worker process; never used in the coordinator


def run_on_worker(shipped: list[Any], unit: WorkUnit, threads: int) -> WorkerResult:
    """A Ray task: run ``unit`` with the shipped task, make its bytes durable on this node, and say who ran
    it and for how long."""
    started = time.perf_counter()
    task = _shipped_task(shipped[0])
    task = replace(task, advance=_stop_watch(stop_file(task)))
    with compute_threads(threads):
        record = task(unit)
    _sync(task.job.layouts[unit.shard].path)
    return WorkerResult(record, f"{socket.gethostname()}:{os.getpid()}", time.perf_counter() - started)


def _stop_watch(flag: Path) -> Callable[[int, str], None]:
    """A unit's ``advance`` that ends it once the coordinator has created ``flag`` (looked for at most every
    ``STOP_CHECK_SECONDS``)."""
    last = time.monotonic()

    def advance(nbytes: int, description: str) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= STOP_CHECK_SECONDS:
            last = now
            if flag.exists():
                raise EngineError("this unit was stopped: another unit failed, or the merge was interrupted")

    return advance


def _shipped_task(ref: Any) -> UnitTask:
    key = ref.hex()
    if _SHIPPED.key != key or _SHIPPED.task is None:
        _SHIPPED.task, _SHIPPED.key = import_ray().get(ref), key
    return _SHIPPED.task


def _sync(path: Path) -> None:
    """Flush the unit's shard to disk from this node: on a shared filesystem, the coordinator (which hashes
    the files, then fsyncs them again before publishing) then reads what every worker wrote."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        getattr(os, "fdatasync", os.fsync)(fd)  # the data is what matters; macOS has only fsync
    finally:
        os.close(fd)


def _first_line(exc: BaseException | None) -> str:
    text = str(exc).strip() if exc is not None else ""
    return text.splitlines()[0] if text else "(no message)"
