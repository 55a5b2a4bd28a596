"""WriteBehind: queued writes are done in order on one thread, within a byte bound; failures reach the
producer; every ``done`` runs, written or dropped."""

from __future__ import annotations

import threading

import pytest

from mergepipe.storage.writer import WriteBehind
from mergepipe.storage.writer import ShardWriter, create_shard


@pytest.fixture
def layout(tmp_path):
    return create_shard(tmp_path / "m.safetensors", [("a", "U8", (4096,)), ("b", "U8", (4096,))])


def test_writes_land_in_order_and_done_runs_after_each(layout):
    order: list[int] = []
    with ShardWriter(layout) as writer, WriteBehind(max_bytes=1024) as behind:
        for i in range(8):
            behind.write(writer, "a", 512 * i, bytes([i]) * 512, done=lambda i=i: order.append(i))
            behind.write(writer, "b", 512 * i, bytes([100 + i]) * 512)
    assert order == list(range(8))
    data = layout.path.read_bytes()[layout.data_start :]
    assert data[:4096] == b"".join(bytes([i]) * 512 for i in range(8))
    assert data[4096:] == b"".join(bytes([100 + i]) * 512 for i in range(8))


def test_the_queue_holds_at_most_its_bound_but_always_one_write(layout):
    """A slow writer: the producer waits for room rather than queueing more than max_bytes."""
    gate = threading.Event()
    lock = threading.Lock()
    outstanding, peak = [0], [0]  # bytes handed to the queue and not yet done

    def done(n: int) -> None:
        with lock:
            outstanding[0] -= n

    with ShardWriter(layout) as writer:
        real = writer.write

        def slow(name, offset, data):
            gate.wait(5)
            real(name, offset, data)

        writer.write = slow  # type: ignore[method-assign]
        threading.Timer(0.2, gate.set).start()
        behind = WriteBehind(max_bytes=1024)
        jobs = [("a", 0, 3000)] + [("b", 256 * i, 256) for i in range(8)]  # the first is larger than the bound
        for name, offset, n in jobs:
            with lock:
                outstanding[0] += n
            behind.write(writer, name, offset, bytes(n), done=lambda n=n: done(n))
            with lock:
                peak[0] = max(peak[0], outstanding[0])
        behind.close()
    assert peak[0] <= 3000  # never the big write and a small one at once
    assert outstanding[0] == 0
    assert behind.wait_seconds > 0.1  # the producer waited for the first write


def test_a_failed_write_is_raised_to_the_producer_and_later_writes_are_dropped(layout):
    released: list[int] = []
    with ShardWriter(layout) as writer:
        behind = WriteBehind(max_bytes=1 << 20)
        behind.write(writer, "a", 0, bytes(100), done=lambda: released.append(0))
        behind.write(writer, "a", 50, bytes(100), done=lambda: released.append(1))  # overlaps: the writer refuses
        with pytest.raises(ValueError, match="overlap"):
            for i in range(100):  # the failure surfaces at a later write, or at close
                behind.write(writer, "b", 10 * i, bytes(10), done=lambda i=i: released.append(10 + i))
            behind.close()
        with pytest.raises(ValueError, match="overlap"):
            behind.close()
    assert 0 in released and 1 in released
    assert len(released) == len(set(released))  # each done ran once


def test_leaving_on_an_exception_drops_what_is_queued_and_releases_it(layout):
    gate = threading.Event()
    released: list[int] = []
    with ShardWriter(layout) as writer:
        real = writer.write

        def slow(name, offset, data):
            gate.wait(5)
            real(name, offset, data)

        writer.write = slow  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="merge failed"):
            with WriteBehind() as behind:
                for i in range(5):
                    behind.write(writer, "a", 100 * i, bytes(100), done=lambda i=i: released.append(i))
                gate.set()
                raise RuntimeError("merge failed")
    assert sorted(released) == list(range(5))


def test_writing_after_close_is_refused(layout):
    with ShardWriter(layout) as writer:
        behind = WriteBehind()
        behind.close()
        with pytest.raises(ValueError, match="closed"):
            behind.write(writer, "a", 0, bytes(10))


def test_a_failing_done_is_raised_to_the_producer_and_does_not_stall_the_queue(layout):
    def broken() -> None:
        raise RuntimeError("release failed")

    with ShardWriter(layout) as writer:
        behind = WriteBehind()
        behind.write(writer, "a", 0, bytes(10), done=broken)
        with pytest.raises(RuntimeError, match="release failed"):
            behind.close()
