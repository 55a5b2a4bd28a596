"""``RangeSource`` for remote checkpoints, and the source that routes each read to local or remote.

``RemoteSource`` reads exact ranges of remote objects (``remote.RemoteClient``)
with the same contract and counters as ``LocalFileSource``: bytes per tag are
the bytes *delivered* for that tag, each planned byte once, so the budget
guarantee (realized ≤ planned) holds for remote experts as for local ones.
Requests per tag are counted too (each try), for the manifest.

Why coalescing lives here: the engine's work items are output blocks, each
reading one block of the base and of each planned expert, so adjacent blocks
of one expert file arrive as separate reads, one item apart. On a local disk
that is free; remotely every request pays a round trip. ``expect`` is told
the planned reads in the order they will be made and, per file and tag,
coalesces runs of exactly adjacent ranges (fsspec's ``merge_offset_ranges``,
no gap, in that order) into requests of at most ``max_request_bytes``; the
first read of a group fetches it, the group's later reads are served from
those bytes, and the bytes are dropped once its last range is delivered. Only
ranges that were planned are ever fetched (no gaps are bridged), so a
coalesced request brings no byte outside the plan. Any other read is split
into requests of at most ``max_request_bytes``, ``concurrency`` fetched at
once (``RemoteClient.read_ranges``). What groups hold is bounded by
``max_request_bytes`` per file being read plus the reads in flight.

``CheckpointSource`` is what analysis and the engine open: local paths go to
a ``LocalFileSource`` (positional reads, unchanged), ``RemotePath`` to a
``RemoteSource`` opened on first use, so a local-only command never imports
fsspec. A file of a Hub commit that the local Hugging Face cache holds
(``storage/hub.py``) is a local file: read there by the ``LocalFileSource``
(without kernel readahead, like any input), with no request. Its counters
are the sums of both.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from mergepipe.errors import MergePipeError
from mergepipe.storage import hub
from mergepipe.storage.location import Location, RemotePath
from mergepipe.storage.readahead import WorkItem
from mergepipe.storage.remote import RemoteClient, RemoteOptions, TransferMeter
from mergepipe.storage.source import Buffer, LocalFileSource, ReadCounter, _target


class _Group:
    """Adjacent planned ranges of one file and tag, fetched as one request by their first reader."""

    def __init__(self, path: RemotePath, begin: int, end: int, tag: str | None) -> None:
        self.path, self.begin, self.end, self.tag = path, begin, end, tag
        self.pending = 0  # planned reads not yet delivered
        self.lock = threading.Lock()
        self.data: bytes | None = None
        self.error: MergePipeError | None = None  # a failed fetch fails its other reads too, without a new request


class RemoteSource:
    """Exact ranged reads of remote objects, coalesced as planned (see the module docstring). Thread-safe."""

    def __init__(self, options: RemoteOptions | None = None, meter: TransferMeter | None = None) -> None:
        self.client = RemoteClient(options, meter)
        self.options = self.client.options
        self._lock = threading.Lock()
        self._planned: dict[tuple[RemotePath, int, int], deque[_Group]] = defaultdict(deque)
        self._counter = ReadCounter()

    def expect(self, reads: Iterable[tuple[RemotePath, int, int, str | None]]) -> None:
        """The planned reads ``(path, begin, end, tag)``, in the order they will be made: runs of adjacent
        ranges of one file and tag become one request of at most ``max_request_bytes``."""
        try:
            from fsspec.utils import merge_offset_ranges
        except ImportError:
            return  # the first read says in one line what to install
        cap = self.options.max_request_bytes
        runs: dict[tuple[RemotePath, str | None], list[list[tuple[int, int]]]] = defaultdict(list)
        for path, begin, end, tag in reads:  # per file and tag, cut where a range starts before the last ends
            if 0 < end - begin <= cap:  # else nothing to read, or split into requests of its own
                file_runs = runs[(path, tag)]
                if file_runs and begin >= file_runs[-1][-1][1]:
                    file_runs[-1].append((begin, end))
                else:
                    file_runs.append([(begin, end)])
        with self._lock:
            for (path, tag), file_runs in runs.items():
                for run in file_runs:  # ascending: merged alike by every fsspec (unsorted input changed over time)
                    _, starts, ends = merge_offset_ranges([path.uri] * len(run), [b for b, _ in run],
                                                          [e for _, e in run], max_gap=0, max_block=cap, sort=False)
                    groups = iter([_Group(path, b, e, tag) for b, e in zip(starts, ends)])
                    group = next(groups)
                    for begin, end in run:
                        if end > group.end:
                            group = next(groups)
                        group.pending += 1
                        self._planned[(path, begin, end)].append(group)

    def size(self, path: RemotePath) -> int:
        stat = self.client.stat(path)
        if stat is None:
            raise FileNotFoundError(str(path))
        return stat.size

    def read(self, path: RemotePath, begin: int, end: int, out: Buffer | None = None,
             tag: str | None = None) -> memoryview:
        """Bytes ``[begin, end)`` of ``path`` into ``out`` (or a new buffer), from a planned group's request,
        else from requests of at most ``max_request_bytes`` (module docstring)."""
        if begin < 0 or end < begin:
            raise ValueError(f"invalid byte range [{begin}, {end}) of {path}")
        view = _target(out, end - begin)
        group = self._take(path, begin, end)
        if group is not None:
            view[:] = self._group_bytes(group, begin, end)
        else:
            self._read_split(path, begin, end, view, tag)
        self._counter.add(end - begin, tag)
        return view

    def _take(self, path: RemotePath, begin: int, end: int) -> _Group | None:
        with self._lock:
            groups = self._planned.get((path, begin, end))
            if not groups:
                return None
            group = groups.popleft()
            if not groups:
                del self._planned[(path, begin, end)]
            return group

    def _group_bytes(self, group: _Group, begin: int, end: int) -> memoryview:
        with group.lock:  # the first reader fetches; the others wait for it, then copy their range
            if group.error is not None:
                raise group.error
            if group.data is None:
                try:
                    group.data = self.client.read(group.path, group.begin, group.end, group.tag)
                except MergePipeError as exc:  # what the client raises once its retries are spent
                    group.error = exc
                    raise
            data = memoryview(group.data)[begin - group.begin : end - group.begin]
            group.pending -= 1
            if group.pending == 0:
                group.data = None  # delivered in full: the slice above keeps what this read needs
            return data

    def _read_split(self, path: RemotePath, begin: int, end: int, view: memoryview, tag: str | None) -> None:
        """``[begin, end)`` in requests of at most ``max_request_bytes``, ``concurrency`` at a time (so at most
        that many requests' bytes are held besides ``view``)."""
        step = self.options.max_request_bytes
        pieces = [(start, min(start + step, end)) for start in range(begin, end, step)]
        for i in range(0, len(pieces), self.options.concurrency):
            window = pieces[i : i + self.options.concurrency]
            for (start, stop), data in zip(window, self.client.read_ranges(path, window, tag)):
                view[start - begin : stop - begin] = data

    def advise_random(self, path: RemotePath) -> None:
        """Nothing to advise: a remote read brings exactly its range."""

    @property
    def bytes_read(self) -> int:
        return self._counter.total

    def bytes_by_tag(self) -> dict[str, int]:
        return self._counter.by_tag()

    def requests_by_tag(self) -> dict[str, int]:
        return self.client.requests_by_tag()

    def close(self) -> None:
        """Drop planned groups; counters stay readable."""
        with self._lock:
            self._planned.clear()


class CheckpointSource:
    """The ``RangeSource`` of analysis and merges: each read goes to a local or a remote source by its path.

    ``meter`` is the command's remote traffic meter; give it when any input is remote, and ``planned``
    then coalesces the planned reads (module docstring). Without one, reads of local files behave exactly
    as ``LocalFileSource``'s.
    """

    def __init__(self, meter: TransferMeter | None = None, options: RemoteOptions | None = None) -> None:
        self.local = LocalFileSource()
        self.meter = meter
        self._options = options
        self._remote: RemoteSource | None = None
        self._lock = threading.Lock()
        self._cached: dict[RemotePath, Path | None] = {}  # Hub files: their copy in the local cache, or None

    def __enter__(self) -> CheckpointSource:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def remote(self) -> RemoteSource:
        """The remote source, opened on first use (only then are fsspec and its backends imported)."""
        with self._lock:
            if self._remote is None:
                self._remote = RemoteSource(self._options, self.meter)
            return self._remote

    def size(self, path: Location) -> int:
        where = self._where(path)
        return self.remote.size(where) if isinstance(where, RemotePath) else self.local.size(where)

    def read(self, path: Location, begin: int, end: int, out: Buffer | None = None,
             tag: str | None = None) -> memoryview:
        where = self._where(path)
        if isinstance(where, RemotePath):
            return self.remote.read(where, begin, end, out, tag)
        return self.local.read(where, begin, end, out, tag)

    def advise_random(self, path: Location) -> None:
        where = self._where(path)
        if not isinstance(where, RemotePath):
            self.local.advise_random(where)

    def _where(self, path: Location) -> Location:
        """Where ``path``'s bytes are read: a Hub file's copy in the local cache when there is one (looked up
        once per file), else ``path`` itself."""
        if not isinstance(path, RemotePath) or path.scheme != "hf":
            return path
        with self._lock:
            if path in self._cached:
                return self._cached[path] or path
        local = hub.cached_file(path)
        if local is None and hub.offline():
            raise hub.offline_error(path)
        with self._lock:
            self._cached[path] = local
        return local or path

    def planned(self, items: Iterable[WorkItem]) -> Iterable[WorkItem]:
        """``items`` as they are for local inputs; with a meter (remote inputs), listed once and their remote
        reads told to the remote source (``RemoteSource.expect``) so adjacent ones are coalesced."""
        if self.meter is None:
            return items
        items = list(items)
        self.remote.expect((where, r.begin, r.end, r.tag) for item in items for r in item.reads
                           if isinstance(where := self._where(r.path), RemotePath))
        return items

    def read_threads(self, threads: int) -> int:
        """Read-ahead threads: ``threads`` for local inputs; for remote ones at least the request concurrency,
        since each thread waits on a round trip rather than a disk."""
        if self.meter is None:
            return threads
        return max(threads, (self._options or RemoteOptions.from_env()).concurrency)

    @property
    def bytes_read(self) -> int:
        return self.local.bytes_read + (self._remote.bytes_read if self._remote else 0)

    def bytes_by_tag(self) -> dict[str, int]:
        out = self.local.bytes_by_tag()
        for tag, n in (self._remote.bytes_by_tag() if self._remote else {}).items():
            out[tag] = out.get(tag, 0) + n
        return out

    def requests_by_tag(self) -> dict[str, int]:
        """Remote requests per tag (each try); local reads make none."""
        return self._remote.requests_by_tag() if self._remote else {}

    def close(self) -> None:
        self.local.close()
        if self._remote is not None:
            self._remote.close()
