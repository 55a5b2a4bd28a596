"""Credentials in a URL (userinfo, a signed query string) are used for its requests, never stored or printed.

A test server on 127.0.0.1 demands basic auth and a signature parameter
(401 otherwise), so every read that succeeds proves the credentials were
sent; the catalog's bytes on disk, what `models` and `show` print, what a
merge writes and every error are searched for the secrets.
"""

from __future__ import annotations

import json

import pytest

from mergepipe.errors import CheckpointError, ConfigError
from mergepipe.storage.checkpoint import open_checkpoint
from mergepipe.storage.location import forget_credentials, is_secret_param, redact
from mergepipe.storage.location import RemotePath, location
from mergepipe.storage.remote import RemoteClient, RemoteOptions
from tests.fixtures.cli import invoke, run_main, wide_runner
from tests.fixtures.remote import RangeServer

USER, PASSWORD = "alice", "Pa55-w0rd-secret"
SIG, CREDENTIAL = "c0ffee5167", "AKIAEXAMPLEKEY%2F20250101%2Fus-east-1%2Fs3%2Faws4_request"
SECRETS = (PASSWORD, SIG, "AKIAEXAMPLEKEY")


def _clean(text: str) -> bool:
    return not any(secret in text for secret in SECRETS)


def signed(server: RangeServer, model: str) -> str:
    """``model``'s URL with a password and a presigned-style query string."""
    host = server.url.split("://", 1)[1]
    return (f"http://{USER}:{PASSWORD}@{host}/{model}?X-Amz-Algorithm=AWS4-HMAC-SHA256"
            f"&X-Amz-Credential={CREDENTIAL}&X-Amz-Signature={SIG}")


@pytest.fixture(autouse=True)
def _fresh_process(monkeypatch, tmp_path):
    """Each test starts as a new process would: nothing remembered, no ~/.netrc, fast retries."""
    forget_credentials()
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("MERGEPIPE_REMOTE_BACKOFF_SECONDS", "0.001")
    yield
    forget_credentials()


@pytest.fixture(scope="module")
def guarded(tiny_family):
    with RangeServer(tiny_family["base"].parent, require_auth=(USER, PASSWORD),
                     require_query={"X-Amz-Signature": SIG}) as server:
        yield server


@pytest.mark.parametrize("name", ["X-Amz-Signature", "x-amz-credential", "X-AMZ-SECURITY-TOKEN", "X-Amz-Expires",
                                  "Signature", "sig", "token", "access_token", "AWSAccessKeyId", "Expires",
                                  "client_secret", "id_token", "X-Goog-Signature", "Key-Pair-Id", "Policy"])
def test_secret_parameters_are_recognised_whatever_their_case(name):
    assert is_secret_param(name) and is_secret_param(name.upper()) and is_secret_param(name.lower())


@pytest.mark.parametrize("name", ["versionId", "download", "response-content-type", "partNumber", "revision"])
def test_other_parameters_stay_in_the_uri(name):
    assert not is_secret_param(name)


def test_a_url_is_split_into_what_it_names_and_what_it_carries():
    typed = (f"HTTP://{USER}:{PASSWORD}@host:8080/team/m/?versionId=7&X-Amz-Signature={SIG}"
             f"&X-Amz-Credential={CREDENTIAL}#frag")
    path = location(typed)
    assert isinstance(path, RemotePath) and path.uri == str(path) == "http://host:8080/team/m?versionId=7"
    assert _clean(repr(path)) and _clean(repr(path.credentials)) and _clean(str(path))
    assert path.credentials is not None and path.credentials.basic_auth == (USER, PASSWORD)
    assert path.credentials.params == (f"X-Amz-Signature={SIG}", f"X-Amz-Credential={CREDENTIAL}")
    child = path / "model.safetensors"
    assert child.uri == "http://host:8080/team/m/model.safetensors?versionId=7" and child.name == "model.safetensors"
    assert child.credentials == path.credentials and child.parent == path
    assert path == RemotePath("http://host:8080/team/m?versionId=7") and hash(path) == hash(RemotePath(path.uri))
    assert location(f"http://{USER}@host/m").credentials.basic_auth == (USER, "")


def test_this_process_lends_them_to_locations_under_the_one_given_and_forgets_them():
    given = location(f"http://{USER}:{PASSWORD}@host/team/m?sig={SIG}")
    assert location("http://host/team/m/model.safetensors").credentials == given.credentials
    assert location("http://host/team/m").credentials == given.credentials
    assert location("http://host/team/m2").credentials is None and location("https://host/team/m").credentials is None
    forget_credentials()
    assert location("http://host/team/m").credentials is None


@pytest.mark.parametrize("typed", [f"s3://AKIAEXAMPLEKEY:{PASSWORD}@bucket/m", f"s3://bucket/m?X-Amz-Signature={SIG}",
                                   f"gs://{USER}:{PASSWORD}@bucket/m", f"ftp://h/m?token={SIG}",
                                   f"file://{USER}:{PASSWORD}@elsewhere/m"])
def test_a_refused_uri_is_never_echoed_with_its_secrets(typed):
    with pytest.raises(ConfigError) as info:
        location(typed)
    assert _clean(str(info.value)) and "\n" not in str(info.value)


def test_redact_hides_userinfo_and_secret_values_in_any_text():
    text = f"failed: 'gs://{USER}:{PASSWORD}@b/m?x=1&sig={SIG}&X-Amz-Credential={CREDENTIAL}'"
    assert redact(text) == "failed: 'gs://***@b/m?x=1&sig=***&X-Amz-Credential=***'"


def test_reads_use_them_and_a_later_process_is_told_how_to_give_them(guarded, tiny_family):
    checkpoint = open_checkpoint(signed(guarded, "base"))
    local = open_checkpoint(tiny_family["base"])
    assert str(checkpoint.root) == f"{guarded.url}/base"
    assert [(f.name, f.header.header_sha256) for f in checkpoint.files] == [
        (f.name, f.header.header_sha256) for f in local.files]
    sent = guarded.log.items
    assert sent and all(r.status != 401 and f"X-Amz-Signature={SIG}" in r.query for r in sent)
    assert open_checkpoint(str(checkpoint.root)).files == checkpoint.files  # the stored uri, in this process
    forget_credentials()  # a later command
    guarded.log.clear()
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(str(checkpoint.root))
    message = str(info.value)
    assert "never stores them" in message and "~/.netrc" in message and f"{guarded.url}/base" in message
    assert "\n" not in message and _clean(message)
    # asked (fsspec's HTTP info asks again by GET when a HEAD fails), refused, nothing read
    assert {(r.method, r.status) for r in guarded.log.items} == {("HEAD", 401), ("GET", 401)}


def test_wrong_credentials_and_exhausted_retries_never_show_the_secret(guarded):
    wrong = signed(guarded, "base").replace(PASSWORD, PASSWORD[::-1])
    with pytest.raises(CheckpointError, match="denied") as info:
        open_checkpoint(wrong)
    assert _clean(str(info.value)) and PASSWORD[::-1] not in str(info.value)
    forget_credentials()
    guarded.inject("503", suffix="/base/config.json", times=6, method="HEAD")  # each try: a HEAD, then a GET
    client = RemoteClient(RemoteOptions(retries=2, backoff_seconds=0.001))
    with pytest.raises(CheckpointError, match="after 3 tries") as info:
        client.stat(location(signed(guarded, "base")) / "config.json")
    assert "503" in str(info.value) and _clean(str(info.value)), str(info.value)
    guarded.clear_faults()


def test_netrc_supplies_basic_auth_to_a_later_process(tiny_family, tmp_path, monkeypatch):
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine 127.0.0.1 login {USER} password {PASSWORD}\n")
    monkeypatch.setenv("NETRC", str(netrc))
    with RangeServer(tiny_family["base"].parent, require_auth=(USER, PASSWORD)) as server:
        assert open_checkpoint(f"{server.url}/base").files
        assert 401 not in {r.status for r in server.log.items} and server.log.gets("model.safetensors")


def test_the_cli_never_stores_or_prints_them_and_a_later_command_says_how(guarded, tmp_path, capsys, monkeypatch):
    db = tmp_path / "c.db"
    merge = ["--out", tmp_path / "out", "--model-id", "m", "--budget", "100%", "--no-progress"]
    code, out, err = run_main(["--db", db, "--base", signed(guarded, "base"), "--experts", signed(guarded, "e1"),
                               *merge], capsys)
    assert code == 0, err
    assert _clean(out + err)
    runner = wide_runner(monkeypatch)
    printed = "".join(invoke(runner, args) for args in (["models", "--db", db], ["show", "--db", db, "base"],
                                                         ["show", "--db", db, "e1", "--json"]))
    assert f"{guarded.url}/base" in printed and f"{guarded.url}/e1" in printed and _clean(printed)
    assert json.loads(invoke(runner, ["show", "--db", db, "e1", "--json"]))
    stored = b"".join(p.read_bytes() for p in tmp_path.glob("c.db*"))  # the database, its WAL and shared memory
    assert f"{guarded.url}/base".encode() in stored
    assert not any(secret.encode() in stored for secret in SECRETS) and b"X-Amz" not in stored
    written = b"".join(p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file() and p.stat().st_size < 1e6)
    assert not any(secret.encode() in written for secret in SECRETS)

    forget_credentials()  # a later command, by the catalog's ids: the credentials are not there
    another = ["--out", tmp_path / "again", "--model-id", "m2", "--budget", "50%", "--no-progress"]
    by_id = ["merge", "--db", db, "--base", "base", "--experts", "e1", *another]
    code, out, err = run_main(by_id, capsys)
    assert code != 0 and err.startswith("error:") and err.count("\n") == 1, err
    assert "never stores them" in err and f"{guarded.url}/" in err and _clean(out + err)

    forget_credentials()  # the same, given the URLs again: registered already, read with them
    code, out, err = run_main(["--db", db, "--base", signed(guarded, "base"), "--experts", signed(guarded, "e1"),
                               *another], capsys)
    assert code == 0, err
    assert _clean(out + err) and "m2" in invoke(runner, ["models", "--db", db])
