"""Remote reads of S3 objects (moto on 127.0.0.1): s3fs's ``cat_ranges``, coalesced planned ranges, one retry policy.

The witness is moto's request log: adjacent planned ranges travel as one
GET, and an injected 503 or 500 is tried exactly ``retries + 1`` times in
all, so neither botocore nor s3fs retries under MergePipe's policy (each of
their tries would show as a request of its own and use up the injected
faults unseen). A 403 or a missing key is asked once.
"""

from __future__ import annotations

import itertools
import os

import pytest

from mergepipe.errors import CheckpointError
from mergepipe.storage.location import RemotePath
from mergepipe.storage.remote import RemoteClient, RemoteOptions, TransferMeter
from mergepipe.storage.source import ByteRange, CheckpointSource, ReadAhead, WorkItem
from tests.fixtures.remote import S3Server

SIZE = 300_000
KEY = "team/blob.bin"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    root = tmp_path_factory.mktemp("s3")
    (root / "blob.bin").write_bytes(os.urandom(SIZE))
    with S3Server() as server:
        server.upload(root, "models", "team")
        yield server, (root / "blob.bin").read_bytes()


@pytest.fixture(autouse=True)
def _env(s3, monkeypatch):
    for key, value in s3[0].env().items():
        monkeypatch.setenv(key, value)
    yield
    s3[0].clear_faults()


BLOB = RemotePath(f"s3://models/{KEY}")


def _gets(server: S3Server) -> list[tuple[int, int] | None]:
    return [r.range for r in server.log.gets(KEY)]


def test_planned_adjacent_ranges_travel_as_one_request(s3):
    server, data = s3
    blocks = [(i * 1000, (i + 1) * 1000) for i in range(6)] + [(9000, 10_000)]
    meter = TransferMeter()
    source = CheckpointSource(meter, RemoteOptions(max_request_bytes=4000))
    items = [WorkItem(i, [ByteRange(BLOB, b, e, "e1")]) for i, (b, e) in enumerate(blocks)]
    server.log.clear()
    for fetched in ReadAhead(source, threads=1, window_bytes=1 << 20).run(items):
        r = fetched.item.reads[0]
        assert bytes(fetched.views[0]) == data[r.begin : r.end]
        fetched.release()
    assert sorted(_gets(server)) == [(0, 4000), (4000, 6000), (9000, 10_000)]
    assert source.bytes_by_tag() == {"e1": 7000} and source.requests_by_tag() == {"e1": 3}
    assert meter.requests == 3 and meter.bytes_received == 7000
    source.close()


def test_a_long_read_is_split_into_concurrent_exact_ranges(s3):
    server, data = s3
    source = CheckpointSource(options=RemoteOptions(max_request_bytes=64_000, concurrency=2))
    server.log.clear()
    assert bytes(source.read(BLOB, 1000, SIZE, tag="x")) == data[1000:]
    ranges = sorted(_gets(server))
    assert ranges[0] == (1000, 65_000) and ranges[-1] == (257_000, SIZE) and len(ranges) == 5
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert source.bytes_by_tag() == {"x": SIZE - 1000} and source.requests_by_tag() == {"x": 5}


@pytest.mark.parametrize("error", ["503", "500"])
def test_a_transient_error_is_retried_by_the_one_policy(error, s3):
    server, data = s3
    client = RemoteClient(RemoteOptions(retries=2, backoff_seconds=0.001))
    server.log.clear()
    server.inject(error, suffix=KEY, times=2)
    assert client.read(BLOB, 100, 5000, tag="t") == data[100:5000]
    assert client.retried == 2 and client.requests_by_tag() == {"t": 3}
    assert len(_gets(server)) == 3  # our tries, and none of botocore's or s3fs's own
    server.log.clear()
    server.inject(error, suffix=KEY, times=3)
    with pytest.raises(CheckpointError, match="after 3 tries") as info:
        client.read(BLOB, 100, 5000)
    assert "\n" not in str(info.value) and len(_gets(server)) == 3


def test_metadata_is_retried_too(s3):
    server, _ = s3
    client = RemoteClient(RemoteOptions(retries=2, backoff_seconds=0.001))
    server.inject("503", suffix=KEY, times=1)
    stat = client.stat(BLOB)
    assert stat is not None and stat.size == SIZE and stat.etag and client.retried == 1


def test_a_split_read_re_asks_only_the_range_that_failed(s3):
    server, data = s3
    source = CheckpointSource(options=RemoteOptions(max_request_bytes=100_000, concurrency=4, backoff_seconds=0.001))
    server.log.clear()
    server.inject("503", suffix=KEY, times=1)
    assert bytes(source.read(BLOB, 0, SIZE, tag="x")) == data
    gets = server.log.gets(KEY)
    assert len(gets) == 4 and sorted({g.range for g in gets}) == [(0, 100_000), (100_000, 200_000), (200_000, SIZE)]
    assert [g.status for g in gets].count(503) == 1 and source.requests_by_tag() == {"x": 4}
    assert source.bytes_by_tag() == {"x": SIZE}


@pytest.mark.parametrize(("error", "message"), [("403", "denied"), (None, "404")])
def test_a_permanent_error_is_one_line_and_asked_once(error, message, s3):
    server, _ = s3
    client = RemoteClient(RemoteOptions(retries=3, backoff_seconds=0.001))
    path = BLOB if error else RemotePath("s3://models/team/missing.bin")
    if error:
        server.inject(error, suffix=KEY, times=5)
    server.log.clear()
    with pytest.raises(CheckpointError, match=message) as info:
        client.read(path, 0, 10)
    assert "\n" not in str(info.value) and client.retried == 0
    assert len(server.log.gets(path.name)) == 1


def test_missing_credentials_are_one_line_and_not_retried(s3, tmp_path, monkeypatch):
    import s3fs

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()  # a client made with the test credentials would still hold them
    try:
        client = RemoteClient(RemoteOptions(retries=3, backoff_seconds=0.001))
        with pytest.raises(CheckpointError, match="no credentials found for s3://models/team/blob.bin") as info:
            client.read(BLOB, 0, 10)
        assert "\n" not in str(info.value) and client.retried == 0
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
