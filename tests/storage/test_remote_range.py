"""A server that ignores ``Range`` (answers 200 with the whole file) is refused before the body is read.

The witness is the server: what it managed to hand to the socket before the
client hung up (``bytes_sent``) stays far below the file's size, and its log
shows one request, never a retry. A 200 is accepted when the range asked is
the whole object (a small side file read whole), so such a server still
serves what it can serve exactly.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from mergepipe.errors import CheckpointError
from mergepipe.storage.checkpoint import open_checkpoint
from mergepipe.storage.location import RemotePath
from mergepipe.storage.remote import RemoteClient, RemoteOptions
from tests.fixtures.cli import run_main
from tests.fixtures.remote import RangeServer

#: The shard's size: far above what loopback socket buffers hold (a few MB), so a body read would show.
SHARD_BYTES = 48 << 20


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """A one-shard checkpoint of 48 MiB, and a small blob."""
    root = tmp_path_factory.mktemp("ignores-range")
    model = root / "model"
    model.mkdir()
    save_file({"w": np.zeros((SHARD_BYTES // 4 // 1024, 1024), dtype=np.float32)}, str(model / "model.safetensors"))
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (root / "small.bin").write_bytes(os.urandom(5000))
    return root


@pytest.fixture
def ignoring(big_model):
    with RangeServer(big_model, ignore_range=True) as server:
        yield server


def _assert_refused_unread(server: RangeServer, message: str, shard: str) -> None:
    assert "\n" not in message and server.url in message and "ignores byte ranges" in message
    gets = server.log.gets(shard)
    assert len(gets) == 1 and gets[0].status == 200  # one request: never retried, never re-asked whole
    assert server.wait_whole_answers(1) == 1
    size = os.path.getsize(server.root / shard.lstrip("/"))
    assert size >= SHARD_BYTES and server.bytes_sent < size // 4, (server.bytes_sent, size)


def test_a_header_probe_answered_with_the_whole_file_is_refused_unread(ignoring):
    client = RemoteClient(RemoteOptions(retries=4, backoff_seconds=0.001))
    shard = RemotePath(f"{ignoring.url}/model/model.safetensors")
    with pytest.raises(CheckpointError) as info:
        client.read(shard, 0, 64 << 10)
    _assert_refused_unread(ignoring, str(info.value), "/model/model.safetensors")
    assert client.retried == 0 and client.requests == 1
    assert "bytes [0, 65536)" in str(info.value)


def test_open_checkpoint_fails_on_the_header_probe(ignoring):
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(f"{ignoring.url}/model")
    _assert_refused_unread(ignoring, str(info.value), "/model/model.safetensors")


def test_register_through_the_cli_is_one_line_naming_the_server(ignoring, tmp_path, capsys):
    db = tmp_path / "c.db"
    assert run_main(["init-db", "--db", db], capsys)[0] == 0
    code, _, err = run_main(["register", "--db", db, "--model-id", "m", "--uri", f"{ignoring.url}/model"], capsys)
    assert code != 0 and err.startswith("error:") and err.count("\n") == 1
    _assert_refused_unread(ignoring, err.strip(), "/model/model.safetensors")


@pytest.mark.parametrize(("begin", "end"), [(0, 4999), (1, 5000), (100, 200)])
def test_only_a_whole_object_range_may_be_answered_200(ignoring, big_model, begin, end):
    client = RemoteClient(RemoteOptions(retries=2, backoff_seconds=0.001))
    blob = RemotePath(f"{ignoring.url}/small.bin")
    assert client.read(blob, 0, 5000) == (big_model / "small.bin").read_bytes()
    with pytest.raises(CheckpointError, match="ignores byte ranges"):
        client.read(blob, begin, end)
    assert client.retried == 0 and [r.status for r in ignoring.log.gets("small.bin")] == [200, 200]


def test_a_range_supporting_server_still_serves_exact_ranges(big_model):
    with RangeServer(big_model) as server:
        client = RemoteClient(RemoteOptions())
        data = client.read(RemotePath(f"{server.url}/model/model.safetensors"), 8, 4096)
        assert data == (big_model / "model" / "model.safetensors").read_bytes()[8:4096]
        assert [(r.status, r.range) for r in server.log.gets("model.safetensors")] == [(206, (8, 4096))]
        assert server.bytes_sent == 4088
