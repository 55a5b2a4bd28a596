"""The Hugging Face Hub as a remote store (``storage/hub.py``, ``remote.py``, ``checkpoint.py``,
``source.py``): ``hf://`` locations, commits pinned, exact ranges through huggingface_hub's filesystem, the
local cache read with no request, offline mode. Checked against the fake Hub's own log of what it sent."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pytest
from huggingface_hub import constants, hf_hub_download

from mergepipe.errors import CheckpointError, ConfigError
from mergepipe.storage.checkpoint import open_checkpoint
from mergepipe.storage.location import RemotePath, hub_uri, location
from mergepipe.storage.remote import RemoteClient
from mergepipe.storage.source import CheckpointSource

if TYPE_CHECKING:
    from tests.fixtures.fake_hub import FakeHub

pytest_plugins = ["tests.fixtures.fake_hub"]  # the fake_hub fixture

DATA = bytes(range(256)) * 1024  # 256 KiB: an LFS file on the Hub (served by its CDN)


@pytest.mark.parametrize("typed, uri, repo, revision, path", [
    ("hf://org/name", "hf://org/name", "org/name", None, ""),
    ("hf://org/name@main", "hf://org/name@main", "org/name", "main", ""),
    ("hf://org/name@v1.0/sub/dir/", "hf://org/name@v1.0/sub/dir", "org/name", "v1.0", "sub/dir"),
    ("hf://org/name@feature%2Fx", "hf://org/name@feature%2Fx", "org/name", "feature/x", ""),
    ("hf://org/name@refs/pr/3/sub", "hf://org/name@refs/pr/3/sub", "org/name", "refs/pr/3", "sub"),
    ("HF://Org/My.Model_2", "hf://Org/My.Model_2", "Org/My.Model_2", None, ""),
])
def test_hub_locations_are_split_as_huggingface_hub_spells_them(typed, uri, repo, revision, path):
    found = location(typed)
    assert isinstance(found, RemotePath) and found.uri == uri and found.credentials is None
    assert (found.hub.repo_id, found.hub.revision, found.hub.path) == (repo, revision, path)
    assert (found / "config.json").hub.path == f"{path}/config.json".lstrip("/")
    assert found.parent == (found if not path else location(uri.rsplit("/", 1)[0]))


@pytest.mark.parametrize("typed, needle", [
    ("hf://org", "not a Hub model location"),
    ("hf://org/a/../b", "not a Hub model location"),
    ("hf://org/name@", "not a Hub model location"),
    ("hf://a--b/c", "not a Hub model location"),
    ("hf://datasets/org/name", "model repositories only"),
    ("hf://spaces/org/name", "model repositories only"),
    ("hf://hf_secret@org/name", "carries no token"),
    ("hf://org/name?token=hf_secret", "carries no token"),
])
def test_what_is_no_hub_model_location_is_refused_by_name_without_the_secret(typed, needle):
    with pytest.raises(ConfigError, match=needle) as caught:
        location(typed)
    assert "hf_secret" not in str(caught.value)


@pytest.mark.parametrize("value, uri", [
    ("org/name", "hf://org/name"), ("org/name@v2", "hf://org/name@v2"), ("org/name@refs/pr/1", "hf://org/name@refs/pr/1"),
    ("name", None), ("name@2", None), ("org/name/sub", None), ("./org/name", None), ("/abs/org", None),
    ("~/org/name", None), ("s3://b/m", None), ("org/na me", None), ("a--b/c", None),
])
def test_a_bare_hub_id_is_mergekits_org_name_at_revision(value, uri):
    assert hub_uri(value) == uri


@pytest.fixture
def repo(fake_hub: FakeHub) -> tuple[str, str]:
    """``org/m`` at two commits: the old one, and main's (with ``w.safetensors``)."""
    old = fake_hub.add_repo("org/m", {"config.json": b"{}", "w.safetensors": DATA[:1000]})
    new = fake_hub.move_branch("org/m", "main", {"config.json": b'{"a": 1}', "w.safetensors": DATA})
    return old, new


def test_a_revision_is_pinned_to_its_commit_and_old_commits_stay_readable(repo, fake_hub):
    old, new = repo
    client = RemoteClient()
    assert client.pin(RemotePath("hf://org/m")).uri == f"hf://org/m@{new}"
    assert client.pin(RemotePath("hf://org/m@main/sub")).uri == f"hf://org/m@{new}/sub"
    fake_hub.clear_log()
    assert client.pin(RemotePath(f"hf://org/m@{old}")).uri == f"hf://org/m@{old}"  # a commit needs no request
    assert fake_hub.log == []
    assert client.stat(RemotePath(f"hf://org/m@{old}/w.safetensors")).size == 1000


def test_ranges_are_exact_gets_of_the_cdn_and_the_listing_is_made_once(repo, fake_hub):
    _, new = repo
    path = RemotePath(f"hf://org/m@{new}/w.safetensors")
    client = RemoteClient()
    fake_hub.clear_log()
    ranges = [(0, 10), (5000, 70_000), (len(DATA) - 7, len(DATA))]
    assert client.read_ranges(path, ranges, tag="m") == [DATA[b:e] for b, e in ranges]
    cdn = [r for r in fake_hub.log if r.host == "cdn"]
    assert sorted(r.range for r in cdn) == sorted(f"bytes={b}-{e - 1}" for b, e in ranges)
    assert fake_hub.bytes_sent("cdn") == sum(e - b for b, e in ranges)  # exactly the bytes asked, once
    assert client.requests_by_tag() == {"m": 3}

    def read(i: int) -> bytes:
        return client.read(path, i * 100, i * 100 + 50)

    with ThreadPoolExecutor(8) as pool:  # reading threads share the one listing of the commit
        assert list(pool.map(read, range(32))) == [DATA[i * 100 : i * 100 + 50] for i in range(32)]
    listings = [r for r in fake_hub.log if "/tree/" in r.path]
    assert len(listings) == 1


def test_a_file_of_the_commit_the_cache_holds_is_read_there_with_no_request(repo, fake_hub, monkeypatch):
    old, new = repo
    cached = hf_hub_download("org/m", "w.safetensors", revision=new)
    fake_hub.clear_log()
    path = RemotePath(f"hf://org/m@{new}/w.safetensors")
    client = RemoteClient()
    assert client.read_ranges(path, [(3, 9), (100, 200)]) == [DATA[3:9], DATA[100:200]]
    assert client.stat(path).size == len(DATA)
    with CheckpointSource() as source:
        assert bytes(source.read(path, 1000, 1100, tag="m")) == DATA[1000:1100]
        assert source.bytes_by_tag() == {"m": 100} and source.requests_by_tag() == {}
    assert fake_hub.log == [] and client.requests == 0
    # the cache is keyed by commit: the old commit's file is not that one, and is read on the Hub
    assert client.read(RemotePath(f"hf://org/m@{old}/w.safetensors"), 0, 4) == DATA[:4]
    assert [r.host for r in fake_hub.log if r.host == "cdn"] == ["cdn"]
    assert hashlib.sha256(open(cached, "rb").read()).hexdigest() == hashlib.sha256(DATA).hexdigest()


def test_a_checkpoint_opens_at_a_commit_from_the_cache_when_it_holds_all_of_it(fake_hub, tiny_family):
    commit = fake_hub.add_folder("org/sharded", tiny_family["base"])
    opened = open_checkpoint("hf://org/sharded")
    assert opened.root == RemotePath(f"hf://org/sharded@{commit}")
    assert [f.path for f in opened.files] == [opened.root / "model.safetensors"]

    hf_hub_download("org/sharded", "config.json", revision=commit)  # a part only: the Hub gives the rest
    fake_hub.clear_log()
    assert open_checkpoint(opened.root).tensor_files == opened.tensor_files
    assert fake_hub.log != []

    for name in ("model.safetensors", "generation_config.json", "tokenizer_config.json"):
        hf_hub_download("org/sharded", name, revision=commit)
    fake_hub.clear_log()
    cached = open_checkpoint(opened.root)
    assert fake_hub.log == []
    assert (cached.root, cached.files, cached.tensor_files, cached.aux_files) == \
        (opened.root, opened.files, opened.tensor_files, opened.aux_files)


def test_offline_mode_reads_the_cache_only(repo, fake_hub, monkeypatch):
    _, new = repo
    hf_hub_download("org/m", "config.json", revision="main")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    fake_hub.clear_log()
    client = RemoteClient()
    assert client.pin(RemotePath("hf://org/m")).uri == f"hf://org/m@{new}"  # main's commit, from the cache's refs
    assert client.read(RemotePath(f"hf://org/m@{new}/config.json"), 0, 8) == b'{"a": 1}'
    with pytest.raises(CheckpointError, match=f"HF_HUB_OFFLINE.*hf://org/m@{new}/w.safetensors"):
        client.read(RemotePath(f"hf://org/m@{new}/w.safetensors"), 0, 8)
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE.*org/other"):
        client.pin(RemotePath("hf://org/other"))
    assert fake_hub.log == []


def test_a_hub_out_of_reach_is_one_line_naming_offline_mode(repo, fake_hub):
    _, new = repo
    fake_hub.stop()
    with pytest.raises(CheckpointError, match="cannot reach the Hugging Face Hub.*HF_HUB_OFFLINE=1"):
        RemoteClient().pin(RemotePath("hf://org/m"))
    with pytest.raises(CheckpointError, match="cannot reach the Hugging Face Hub"):
        RemoteClient().read(RemotePath(f"hf://org/m@{new}/w.safetensors"), 0, 8)


def test_a_missing_file_of_a_commit_is_no_stat_and_a_missing_revision_an_error(repo):
    client = RemoteClient()
    assert client.stat(RemotePath("hf://org/m@main/nothing.json")) is None
    with pytest.raises(CheckpointError, match="no revision 'gone'"):
        client.stat(RemotePath("hf://org/m@gone/config.json"))
    with pytest.raises(CheckpointError, match="org/absent.*HF_TOKEN"):
        client.pin(RemotePath("hf://org/absent"))
