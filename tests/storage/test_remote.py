"""Remote locations and the remote source, against a Range-capable HTTP server on 127.0.0.1.

What a reader gets is compared with the file's own bytes; what was fetched
with the server's request log (the independent witness): exact ranges,
adjacent planned ranges coalesced up to the cap, long reads split, transient
faults retried by the one policy (each try one request in the log), permanent
ones raised once as one line.
"""

from __future__ import annotations

import os
import sys

import pytest

from mergepipe.errors import CheckpointError, ConfigError
from mergepipe.storage.checkpoint import open_checkpoint
from mergepipe.storage.location import RemotePath, is_remote, location
from mergepipe.storage.remote import RemoteClient, RemoteOptions, TransferMeter
from mergepipe.storage.source import ByteRange, CheckpointSource, ReadAhead, WorkItem
from tests.fixtures.remote import RangeServer

SIZE = 1 << 20


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    (root / "blob.bin").write_bytes(os.urandom(SIZE))
    with RangeServer(root) as server:
        yield server, root / "blob.bin"


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch):
    monkeypatch.setenv("MERGEPIPE_REMOTE_BACKOFF_SECONDS", "0.001")


def test_remote_path_is_a_value_that_cannot_be_opened_locally():
    root = RemotePath("s3://bucket/team/model/")
    assert str(root) == "s3://bucket/team/model" and root.name == "model" and root.scheme == "s3"
    assert str(root / "model.safetensors") == "s3://bucket/team/model/model.safetensors"
    assert (root / "config.json").parent == root
    assert RemotePath("HTTPS://host/a") == RemotePath("https://host/a/")
    with pytest.raises(TypeError):
        os.fspath(root)
    with pytest.raises(TypeError):
        open(root / "config.json")  # noqa: SIM115 - the point is that it cannot be opened
    with pytest.raises(ValueError):
        root / "../other"


def test_location_parses_what_users_type(tmp_path):
    assert location("s3://b/k") == RemotePath("s3://b/k") and is_remote("http://h/p") and not is_remote("./m")
    assert location(f"file://{tmp_path}/a%20b") == tmp_path / "a b"
    assert location("relative/dir") == location(os.path.join("relative", "dir"))
    with pytest.raises(ConfigError, match="unsupported location"):
        location("gs://bucket/model")
    with pytest.raises(ConfigError, match="another host"):
        location("file://elsewhere/x")
    with pytest.raises(ConfigError, match="names no bucket"):
        location("s3:///x")


def test_options_come_from_the_environment_and_are_checked():
    options = RemoteOptions.from_env({"MERGEPIPE_REMOTE_CONCURRENCY": "3", "MERGEPIPE_REMOTE_REQUEST_BYTES": "4096"})
    assert (options.concurrency, options.max_request_bytes, options.retries) == (3, 4096, RemoteOptions().retries)
    for bad in ({"MERGEPIPE_REMOTE_CONCURRENCY": "0"}, {"MERGEPIPE_REMOTE_RETRIES": "many"}):
        with pytest.raises(ConfigError, match="MERGEPIPE_REMOTE"):
            RemoteOptions.from_env(bad)


@pytest.mark.parametrize(("scheme", "module"), [("s3", "s3fs"), ("http", "aiohttp"), ("https", "fsspec")])
def test_a_missing_extra_is_one_line_naming_the_install(scheme, module, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if it were not installed
    with pytest.raises(ConfigError, match=r"pip install 'mergepipe\[remote\]'") as info:
        RemoteClient().read(RemotePath(f"{scheme}://host/bucket/x"), 0, 1)
    assert "\n" not in str(info.value)


def test_exact_ranges_and_long_reads_split_into_concurrent_requests(served):
    server, blob = served
    data = blob.read_bytes()
    source = CheckpointSource(options=RemoteOptions(max_request_bytes=100_000, concurrency=4))
    uri = RemotePath(f"{server.url}/blob.bin")
    server.log.clear()
    assert bytes(source.read(uri, 10, 20, tag="x")) == data[10:20]
    out = bytearray(SIZE)
    assert bytes(source.read(uri, 0, SIZE, out=out, tag="x")) == data
    ranges = sorted(g.range for g in server.log.gets("blob.bin"))
    assert ranges[0] == (0, 100_000) and (10, 20) in ranges and len(ranges) == 1 + 11
    assert sum(e - b for b, e in ranges) == 10 + SIZE
    assert source.bytes_by_tag() == {"x": 10 + SIZE} and source.requests_by_tag() == {"x": 12}
    source.close()


def test_planned_adjacent_ranges_are_coalesced_up_to_the_cap(served):
    server, blob = served
    data = blob.read_bytes()
    uri = RemotePath(f"{server.url}/blob.bin")
    blocks = [(i * 1000, (i + 1) * 1000) for i in range(10)] + [(20_000, 21_000), (21_000, 22_000)]
    meter = TransferMeter()
    source = CheckpointSource(meter, RemoteOptions(max_request_bytes=4000))
    items = [WorkItem(i, [ByteRange(uri, b, e, "e1")]) for i, (b, e) in enumerate(blocks)]
    server.log.clear()
    readahead = ReadAhead(source, threads=1, window_bytes=1 << 20)
    for fetched in readahead.run(items):
        r = fetched.item.reads[0]
        assert bytes(fetched.views[0]) == data[r.begin : r.end]
        fetched.release()
    ranges = [g.range for g in server.log.gets("blob.bin")]
    assert sorted(ranges) == [(0, 4000), (4000, 8000), (8000, 10_000), (20_000, 22_000)]  # no gap bridged
    assert source.bytes_by_tag() == {"e1": 12_000} and source.requests_by_tag() == {"e1": 4}
    assert meter.requests == 4 and meter.bytes_received == 12_000 and "4 req" in meter.status()
    assert readahead.threads >= source.client.options.concurrency
    source.close()


def test_planned_ranges_are_coalesced_only_where_adjacent_in_the_order_they_are_read(served):
    server, blob = served
    data = blob.read_bytes()
    uri = RemotePath(f"{server.url}/blob.bin")
    order = [(2000, 3000), (0, 1000), (1000, 2000), (1000, 2000), (3000, 4000), (5000, 6000), (6000, 7000)]
    source = CheckpointSource(TransferMeter(), RemoteOptions(max_request_bytes=4000))
    items = [WorkItem(i, [ByteRange(uri, b, e, "e1"), ByteRange(uri, b, e, "e2")]) for i, (b, e) in enumerate(order)]
    server.log.clear()
    for fetched in ReadAhead(source, threads=1, window_bytes=1 << 20).run(items):
        assert [bytes(v) for v in fetched.views] == [data[r.begin : r.end] for r in fetched.item.reads]
        fetched.release()
    expected = [(2000, 3000), (0, 2000), (1000, 2000), (3000, 4000), (5000, 7000)]  # each tag's own requests
    assert sorted(g.range for g in server.log.gets("blob.bin")) == sorted(expected * 2)
    assert source.bytes_by_tag() == {"e1": 7000, "e2": 7000} and source.requests_by_tag() == {"e1": 5, "e2": 5}
    source.close()


def test_a_local_only_source_neither_plans_nor_imports_remote_backends(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)
    path = tmp_path / "f.bin"
    path.write_bytes(b"abcdef")
    with CheckpointSource() as source:
        readahead = ReadAhead(source, threads=2, window_bytes=100)
        assert readahead.threads == 2
        assert [bytes(f.views[0]) for f in readahead.run([WorkItem(0, [ByteRange(path, 1, 4, "t")])])] == [b"bcd"]
        assert source.bytes_by_tag() == {"t": 3} and source.requests_by_tag() == {}


@pytest.mark.parametrize("fault", ["503", "drop", "short"])
def test_transient_faults_are_retried_and_exhaustion_is_one_line(fault, served):
    server, blob = served
    uri = RemotePath(f"{server.url}/blob.bin")
    client = RemoteClient(RemoteOptions(retries=2, backoff_seconds=0.001))
    server.log.clear()
    server.inject(fault, suffix="blob.bin", times=2)
    assert client.read(uri, 5000, 9000) == blob.read_bytes()[5000:9000]
    assert client.retried == 2 and client.requests == 3 == len(server.log.gets("blob.bin"))
    server.log.clear()
    server.inject(fault, suffix="blob.bin", times=3)
    with pytest.raises(CheckpointError, match="after 3 tries") as info:
        client.read(uri, 5000, 9000)
    assert "\n" not in str(info.value) and len(server.log.gets("blob.bin")) == 3  # one policy: no nested tries
    server.clear_faults()


def test_a_split_read_re_asks_only_the_range_that_failed(served):
    server, blob = served
    source = CheckpointSource(options=RemoteOptions(max_request_bytes=400_000, backoff_seconds=0.001))
    uri = RemotePath(f"{server.url}/blob.bin")
    server.log.clear()
    server.inject("503", suffix="blob.bin", times=1, after=800_000)  # the last of three concurrent requests
    assert bytes(source.read(uri, 0, SIZE, tag="x")) == blob.read_bytes()
    gets = [(g.range, g.status) for g in server.log.gets("blob.bin")]
    assert sorted(gets) == [((0, 400_000), 206), ((400_000, 800_000), 206), ((800_000, SIZE), 206),
                            ((800_000, SIZE), 503)]
    assert source.requests_by_tag() == {"x": 4} and source.bytes_by_tag() == {"x": SIZE}
    server.clear_faults()


def test_404_is_permanent_and_not_retried(served):
    server, _ = served
    server.log.clear()
    client = RemoteClient(RemoteOptions(retries=3))
    with pytest.raises(CheckpointError, match="404"):
        client.read(RemotePath(f"{server.url}/missing.bin"), 0, 10)
    assert len(server.log.gets("missing.bin")) == 1
    assert client.stat(RemotePath(f"{server.url}/missing.bin")) is None


def test_an_http_checkpoint_opens_like_the_local_directory(tiny_family, tmp_path):
    root = tiny_family["base"].parent
    with RangeServer(root) as server:
        remote = open_checkpoint(f"{server.url}/base")
    local = open_checkpoint(tiny_family["base"])
    assert remote.root == RemotePath(f"{server.url}/base")
    assert remote.tensor_files == local.tensor_files and remote.config == local.config
    assert remote.aux_files == local.aux_files
    for r, loc in zip(remote.files, local.files):
        assert (r.name, r.size, r.header.tensors, r.header.header_sha256) == (
            loc.name, loc.size, loc.header.tensors, loc.header.header_sha256)
        assert r.etag and r.mtime_ns // 10**9 == loc.mtime_ns // 10**9


def test_a_missing_remote_directory_is_one_line(served):
    server, _ = served
    with pytest.raises(CheckpointError, match="nothing found") as info:
        open_checkpoint(f"{server.url}/no-such-model")
    assert "\n" not in str(info.value)
