"""ReadAhead and BufferPool: in-order items with the right bytes, pooled
buffers, and a window that bounds the bytes held at once."""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mergepipe.errors import CorruptCheckpointError
from mergepipe.storage.source import BufferPool, ByteRange, CheckpointSource, ReadAhead, WorkItem

FILE_BYTES = 1 << 16

@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> tuple[Path, bytes]:
    """A file of random bytes and those bytes, read back independently."""
    path = tmp_path_factory.mktemp("readahead") / "data.bin"
    path.write_bytes(os.urandom(FILE_BYTES))
    return path, path.read_bytes()


class TrackingSource:
    """A CheckpointSource that records what reads it is asked for.

    A read adds its bytes to ``in_flight`` when it starts; the consumer
    subtracts an item's bytes with ``released`` just before it releases the
    item. ``max_in_flight`` is then the most bytes held at once, ``buffers``
    the ``out`` buffers the reads were given, in call order.
    """

    def __init__(self, delay=lambda begin: 0.0, fail_at: int | None = None) -> None:
        self.inner = CheckpointSource()
        self.delay = delay
        self.fail_at = fail_at
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.buffers: list[object] = []
        self.reading: set[int] = set()  # begin offsets of reads started, not yet released
        self.overlaps: list[tuple[int, frozenset[int]]] = []  # (read begin, others held then)

    def read(self, path, begin, end, out=None, tag=None):
        if begin == self.fail_at:
            raise OSError(5, "Input/output error", str(path))
        with self.lock:
            self.overlaps.append((begin, frozenset(self.reading)))
            self.reading.add(begin)
            self.in_flight += end - begin
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.buffers.append(out)
        time.sleep(self.delay(begin))
        return self.inner.read(path, begin, end, out=out, tag=tag)

    def released(self, fetched) -> None:
        with self.lock:
            self.in_flight -= fetched.item.nbytes
            self.reading.difference_update(r.begin for r in fetched.item.reads)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def items_of(path: Path, sizes: list[int], tag: str = "t") -> list[WorkItem]:
    """Consecutive ranges of ``path`` with the given sizes; the payload is the index."""
    items, offset = [], 0
    for i, size in enumerate(sizes):
        items.append(WorkItem(i, [ByteRange(path, offset, offset + size, tag)]))
        offset += size
    assert offset <= FILE_BYTES
    return items


def consume(readahead: ReadAhead, items, source: TrackingSource | None = None, hold: float = 0.0):
    """Run ``items``; return (payload, bytes of every view, result) per item, releasing each."""
    seen = []
    for fetched in readahead.run(items):
        seen.append((fetched.item.payload, [bytes(v) for v in fetched.views], fetched.result))
        time.sleep(hold)
        if source is not None:
            source.released(fetched)
        fetched.release()
    return seen


def expected_bytes(data: bytes, item: WorkItem) -> list[bytes]:
    return [data[r.begin : r.end] for r in item.reads]


# -- order and bytes ------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 4])
def test_items_come_in_order_with_their_bytes(data_file, threads):
    path, data = data_file
    rng = random.Random(threads)
    items = []
    for i in range(40):  # several ranges per item, anywhere in the file, some empty
        ranges = []
        for _ in range(rng.randint(1, 3)):
            begin = rng.randrange(FILE_BYTES)
            ranges.append(ByteRange(path, begin, min(FILE_BYTES, begin + rng.randint(0, 3000)), f"m{i % 3}"))
        items.append(WorkItem(i, ranges))
    # early items are the slowest to read: completion order is not item order
    source = TrackingSource(delay=lambda begin: 0.002 if begin % 2 else 0.0)
    seen = consume(ReadAhead(source, threads=threads, window_bytes=8000), items, source)
    assert [p for p, _, _ in seen] == list(range(40))
    for (_, views, _), item in zip(seen, items):
        assert views == expected_bytes(data, item)
    tags: dict[str, int] = {}
    for item in items:
        for r in item.reads:
            if r.nbytes:
                tags[r.tag] = tags.get(r.tag, 0) + r.nbytes
    assert source.bytes_by_tag() == tags
    assert source.bytes_read == sum(item.nbytes for item in items)


def test_items_without_reads_pass_through(data_file):
    path, data = data_file
    items = [
        WorkItem("a"),
        WorkItem("b", [ByteRange(path, 0, 100, "t")]),
        WorkItem("c"),
        WorkItem("d"),
        WorkItem("e", [ByteRange(path, 100, 250, "t")]),
        WorkItem("f"),
    ]
    with CheckpointSource() as source:
        seen = consume(ReadAhead(source, threads=2, window_bytes=100), items)
        assert source.bytes_read == 250
    assert [p for p, _, _ in seen] == list("abcdef")
    assert [v for _, v, _ in seen] == [[], [data[:100]], [], [], [data[100:250]], []]


def test_on_read_result_is_on_fetched(data_file):
    path, data = data_file
    threads_seen = set()

    def digest(item: WorkItem, views: list[memoryview]) -> tuple[int, str]:
        threads_seen.add(threading.current_thread().name)
        return item.payload, hashlib.sha256(b"".join(bytes(v) for v in views)).hexdigest()

    items = items_of(path, [500, 1000, 1, 4096, 300])
    with CheckpointSource() as source:
        seen = consume(ReadAhead(source, threads=2, window_bytes=3000, on_read=digest), items)
    for payload, _, result in seen:
        expected = hashlib.sha256(b"".join(expected_bytes(data, items[payload]))).hexdigest()
        assert result == (payload, expected)
    # on_read runs on the reading threads, not on the consumer's
    assert threads_seen and threading.current_thread().name not in threads_seen


# -- buffers ---------------------------------------------------------------------


def test_released_buffers_are_reused(data_file):
    path, data = data_file
    items = items_of(path, [1024] * 6)
    source = TrackingSource()
    # a window of one item: each read starts only after the previous release
    seen = consume(ReadAhead(source, threads=1, window_bytes=1024), items, source)
    assert all(isinstance(b, np.ndarray) for b in source.buffers)
    assert all(b is source.buffers[0] for b in source.buffers)
    assert [v for _, v, _ in seen] == [expected_bytes(data, item) for item in items]


def test_held_items_keep_their_own_buffers(data_file):
    path, data = data_file
    items = items_of(path, [700, 700, 700, 700])
    source = TrackingSource()
    held = list(ReadAhead(source, threads=2, window_bytes=1 << 20).run(items))
    assert len({id(b) for b in source.buffers}) == len(items)  # nothing is reused while held
    for fetched, item in zip(held, items):  # no view was overwritten by a later read
        assert [bytes(v) for v in fetched.views] == expected_bytes(data, item)
        fetched.release()
        fetched.release()  # idempotent


# -- the window ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes, window",
    [
        ([1000] * 12, 3000),
        ([1000] * 12, 2500),
        ([700, 900, 300, 1000, 200, 950, 50, 600, 999, 400, 800, 10], 2000),
        ([100] * 5 + [1900] + [100] * 5, 2000),
    ],
    ids=["uniform-fits", "uniform-ragged", "mixed", "big-after-small"],
)
def test_window_bounds_bytes_in_flight(data_file, sizes, window):
    """Items no larger than the window: never more than the window held at once."""
    path, data = data_file
    items = items_of(path, sizes)
    source = TrackingSource()
    seen = consume(ReadAhead(source, threads=4, window_bytes=window), items, source, hold=0.005)
    assert [v for _, v, _ in seen] == [expected_bytes(data, item) for item in items]
    assert source.max_in_flight <= window
    assert source.max_in_flight > max(sizes)  # and it did read ahead


def test_item_larger_than_the_window_runs_alone(data_file):
    path, data = data_file
    sizes = [300, 300, 5000, 300, 300]
    items = items_of(path, sizes)
    source = TrackingSource()
    seen = consume(ReadAhead(source, threads=4, window_bytes=1000), items, source, hold=0.005)
    assert [v for _, v, _ in seen] == [expected_bytes(data, item) for item in items]
    huge = items[2].reads[0].begin
    with_huge = [(begin, others) for begin, others in source.overlaps if begin == huge or huge in others]
    assert with_huge == [(huge, frozenset())]  # nothing held while it ran, nothing started beside it


def test_window_pool_keeps_at_most_the_window(data_file):
    path, _ = data_file
    source = TrackingSource()
    readahead = ReadAhead(source, threads=2, window_bytes=3000)
    consume(readahead, items_of(path, [1000, 2000, 500, 1500, 3000, 100]), source)
    kept = drain(readahead.pool, source.buffers)
    assert kept  # released buffers went back to the pool
    assert sum(b.nbytes for b in kept) <= 3000


# -- stopping and failing --------------------------------------------------------------


def run_with_timeout(fn, seconds: float = 20.0):
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it does not finish."""
    outcome: dict[str, object] = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # not swallowed: re-raised on the test thread below
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "ReadAhead hung"
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome.get("value")


def test_stopping_early_does_not_hang(data_file):
    path, data = data_file
    pulled = []

    def endless():
        for i in itertools.count():
            pulled.append(i)
            offset = (i * 100) % (FILE_BYTES - 100)
            yield WorkItem(i, [ByteRange(path, offset, offset + 100, "t")])

    def take_three():
        source = TrackingSource(delay=lambda begin: 0.001)
        stream = ReadAhead(source, threads=3, window_bytes=1000).run(endless())
        got = []
        for fetched in stream:
            got.append(bytes(fetched.views[0]))
            fetched.release()
            if len(got) == 3:
                break
        stream.close()
        return got

    got = run_with_timeout(take_three)
    assert got == [data[0:100], data[100:200], data[200:300]]
    assert len(pulled) <= 3 + 10 + 1  # the window (10 items) bounds how far it ran ahead


@pytest.mark.parametrize("threads", [1, 3])
def test_read_error_reaches_the_consumer(data_file, threads):
    path, data = data_file
    items = items_of(path, [100] * 8)
    source = TrackingSource(fail_at=items[4].reads[0].begin)
    seen = []

    def run():
        with pytest.raises(OSError, match="Input/output error"):
            for fetched in ReadAhead(source, threads=threads, window_bytes=300).run(items):
                seen.append((fetched.item.payload, bytes(fetched.views[0])))
                fetched.release()

    run_with_timeout(run)
    # everything before the failing item, in order, with its bytes
    assert seen == [(i, data[i * 100 : (i + 1) * 100]) for i in range(4)]


def test_truncated_file_error_reaches_the_consumer(data_file, tmp_path):
    _, data = data_file
    short = tmp_path / "short.bin"
    short.write_bytes(data[:1000])
    items = [WorkItem(0, [ByteRange(short, 0, 500, "t")]), WorkItem(1, [ByteRange(short, 500, 1500, "t")])]
    with CheckpointSource() as source:
        stream = ReadAhead(source, threads=2, window_bytes=4000).run(items)
        first = next(stream)
        assert bytes(first.views[0]) == data[:500]
        first.release()
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            next(stream)


def test_on_read_error_reaches_the_consumer(data_file):
    path, _ = data_file

    def refuse(item, views):
        if item.payload == 2:
            raise ValueError("bad block 2")
        return item.payload

    with CheckpointSource() as source:
        stream = ReadAhead(source, threads=2, window_bytes=1000, on_read=refuse).run(items_of(path, [100] * 5))
        assert [next(stream).result, next(stream).result] == [0, 1]
        with pytest.raises(ValueError, match="bad block 2"):
            next(stream)


# -- BufferPool -------------------------------------------------------------------------


def drain(pool: BufferPool, known: list[np.ndarray]) -> list[np.ndarray]:
    """The free buffers of ``pool`` (all among ``known``): get() until it hands
    out a buffer that is not one of them, i.e. a fresh one."""
    out: list[np.ndarray] = []
    while True:
        buf = pool.get(0)
        if not any(buf is k for k in known):
            return out
        assert not any(buf is b for b in out), "the pool handed out a buffer twice"
        out.append(buf)


def test_pool_gives_fresh_buffers_of_the_size_asked():
    pool = BufferPool(1 << 20)
    buf = pool.get(1234)
    assert isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.nbytes == 1234
    assert pool.get(0).nbytes >= 0


def test_pool_returns_the_best_fit():
    pool = BufferPool(10_000)
    small, large, middle = np.empty(100, np.uint8), np.empty(300, np.uint8), np.empty(200, np.uint8)
    for buf in (small, large, middle):
        pool.put(buf)
    assert pool.get(150) is middle  # the smallest that holds 150 bytes
    assert pool.get(150) is large
    fresh = pool.get(150)
    assert fresh is not small and fresh.nbytes == 150  # 100 bytes do not hold 150
    assert pool.get(100) is small


@pytest.mark.parametrize(
    "keep, sizes, kept_sizes",
    [
        (600, [400, 300, 200], [200, 400]),  # 300 went first: the smallest of 400 + 300 > 600
        (600, [200, 300, 400], [400]),  # the smallest go first: 200, then 300
        (1000, [400, 300, 200], [200, 300, 400]),
        (500, [800], []),  # a buffer above the limit is never kept
        (0, [10], []),
    ],
)
def test_pool_keeps_at_most_keep_bytes(keep, sizes, kept_sizes):
    pool = BufferPool(keep)
    buffers = [np.empty(n, np.uint8) for n in sizes]
    for buf in buffers:
        pool.put(buf)
    kept = drain(pool, buffers)
    assert sorted(b.nbytes for b in kept) == kept_sizes
    assert sum(b.nbytes for b in kept) <= keep
