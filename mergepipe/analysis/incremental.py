"""Incremental analysis: a new version of an expert inherits what did not change.

A retrained expert registered as version N of its id usually changes only
some tensors. When version N-1 is analysed against the same base, analysis
of version N hashes N's blocks (one read of its files), takes every tensor
whose block hashes all equal N-1's straight from N-1's statistics (same
bytes, same base: the same deltas, norms and trim thresholds), and computes
only the others (those are read again, with the base). ``analyze`` reports
how many tensors it computed and how many it inherited.

The hashing does not come first as a pass of its own: ``VersionHasher``
reads and hashes version N on a thread of its own, tensor by tensor in the
order analysis visits them, and analysis waits only for the tensor it is
at. So version N is read once at disk speed while the statistics of its
changed tensors are computed beside that read (their second read comes from
the page cache, moments after the first).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from types import TracebackType

from mergepipe.analysis.stats import TensorResult
from mergepipe.analysis.windows import Read, hash_window
from mergepipe.catalog import Catalog
from mergepipe.storage.readahead import ReadAhead, WorkItem
from mergepipe.storage.remote_source import CheckpointSource

#: Windows the hashing thread reads ahead of its hashing: enough to keep the disk busy.
_WINDOWS_AHEAD = 3


@dataclass(frozen=True)
class Inheritance:
    """Where expert ``expert`` may take unchanged tensors from, and how many it took."""

    expert: str
    previous: str  # the previous version's id
    results: dict[str, TensorResult]  # tensor -> the previous version's rows
    previous_hashes: dict[str, list[str | None]]


def previous_versions(catalog: Catalog, experts: Sequence[str], base_id: str) -> dict[str, str]:
    """Expert id -> the id of its previous version, for experts whose previous version is analysed
    against ``base_id``."""
    out = {}
    for expert_id in experts:
        record = catalog.models.get(expert_id)
        if record.version < 2:
            continue
        previous = next((v for v in catalog.models.versions(record.name) if v.version == record.version - 1), None)
        if previous is not None and catalog.stats.is_analyzed(previous.id, base_id):
            out[expert_id] = previous.id
    return out


def inheritance(catalog: Catalog, expert_id: str, previous_id: str, base_id: str) -> Inheritance:
    """The previous version's rows, per tensor, ready to be taken over."""
    deltas = catalog.stats.block_deltas(previous_id, base_id)
    stats = catalog.stats.tensor_stats(previous_id, base_id)
    results = {name: (list(deltas.get(name, [])), s) for name, s in stats.items()}
    return Inheritance(expert_id, previous_id, results, catalog.blocks.hashes(previous_id))


def inherited(inherit: Inheritance | None, tensor: str, hashes: list[str | None]) -> TensorResult | None:
    """The previous version's result for ``tensor`` if the expert's blocks there are byte-identical to
    it (every hash known and equal), else None."""
    if inherit is None or tensor not in inherit.results or any(h is None for h in hashes):
        return None
    return inherit.results[tensor] if inherit.previous_hashes.get(tensor) == hashes else None


class VersionHasher:
    """The block hashes of new versions, read and hashed on a thread of its own (module docstring).

    ``work`` lists, in the order analysis will ask for them, each (model, tensor) and the reads of its
    windows; ``hashes(model, tensor)`` waits for that tensor's hashes (an error of the thread is raised
    there). A context manager: leaving it stops the thread (between windows) and waits for it.
    """

    def __init__(self, work: Sequence[tuple[str, str, Sequence[WorkItem]]]) -> None:
        self._work = work
        self._ready: dict[tuple[str, str], list[str | None]] = {}
        self._failed: BaseException | None = None
        self._stop = False
        self._changed = threading.Condition()
        self.source = CheckpointSource(None)  # local files only: its own byte counters
        self.read_bytes = 0
        self.read_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="mergepipe-version-hash", daemon=True)
        for model_id, tensor, items in work:  # nothing to read (an empty tensor): no hashes to wait for
            if not items:
                self._ready[(model_id, tensor)] = []

    def __enter__(self) -> VersionHasher:
        self.source.__enter__()
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with self._changed:
            self._stop = True
        self._thread.join()
        self.source.__exit__(kind, exc, tb)

    def hashes_for(self, model_id: str) -> bool:
        """Whether this hasher hashes ``model_id``."""
        return any(m == model_id for m, _, _ in self._work)

    def hashes(self, model_id: str, tensor: str) -> list[str | None]:
        """The block hashes of ``tensor`` of ``model_id``, once the thread has them."""
        key = (model_id, tensor)
        with self._changed:
            while key not in self._ready and self._failed is None:
                self._changed.wait()
            if key in self._ready:
                return self._ready.pop(key)
            assert self._failed is not None
            raise self._failed

    def _items(self) -> Iterator[WorkItem]:
        for _, _, items in self._work:
            if self._stop:
                return
            yield from items

    def _run(self) -> None:
        largest = max((item.nbytes for _, _, items in self._work for item in items), default=1)
        readahead = ReadAhead(self.source, threads=1, window_bytes=_WINDOWS_AHEAD * largest, on_read=hash_window)
        pending: dict[tuple[str, str], list[str | None]] = {}
        try:
            with closing(readahead.run(self._items())) as stream:
                for fetched in stream:
                    read: Read = fetched.item.payload
                    fetched.release()
                    key = (read.model_id, read.tensor.name)
                    found = pending.setdefault(key, [None] * len(read.blocks))
                    found[read.lo : read.hi] = fetched.result or [None] * (read.hi - read.lo)
                    if read.last:
                        with self._changed:
                            self._ready[key] = pending.pop(key)
                            self._changed.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits for these hashes
            with self._changed:
                self._failed = exc
                self._changed.notify_all()
        finally:
            self.read_bytes, self.read_seconds = readahead.read_bytes, readahead.read_seconds
