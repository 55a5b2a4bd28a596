"""Hugging Face Hub models as inputs, through the CLI as a user types them: ``hf://ORG/NAME[@REVISION]`` in
``register``, mergekit's bare ``ORG/NAME`` in a config. The Hub is the loopback fake (``tests/fixtures/fake_hub.py``),
read by huggingface_hub itself; what it sent is checked from its own log, never from MergePipe's counters alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml
from huggingface_hub import constants, snapshot_download

from mergepipe.catalog import Catalog
from tests.fixtures.checkpoints import load_tensors
from tests.fixtures.cli import invoke, refused, wide_runner

if TYPE_CHECKING:
    from tests.fixtures.fake_hub import FakeHub

pytest_plugins = ["tests.fixtures.fake_hub"]  # the fake_hub fixture

#: The first read of a safetensors file (its header, which is ~2 KiB here): small beside these ~200 KiB files.
PROBE_BYTES = 4096
MODELS = ("base", "e1", "e2")


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.setenv("MERGEPIPE_REMOTE_HEADER_PROBE_BYTES", str(PROBE_BYTES))
    return wide_runner(monkeypatch)


@pytest.fixture
def commits(fake_hub: FakeHub, tiny_family) -> dict[str, str]:
    """``org/base``, ``org/e1``, ``org/e2`` on the Hub, each the files of the local folder of that name."""
    return {name: fake_hub.add_folder(f"org/{name}", tiny_family[name]) for name in MODELS}


def _config(path: Path, refs: dict[str, str]) -> Path:
    path.write_text(yaml.safe_dump({
        "merge_method": "ties", "base_model": refs["base"], "dtype": "bfloat16",
        "models": [{"model": refs[e], "parameters": {"weight": 0.5, "density": 0.5}} for e in ("e1", "e2")],
        "mergepipe": {"model_id": "m", "block_bytes": "4KiB"}}))
    return path


def _merge(runner, tmp_path: Path, name: str, refs: dict[str, str], *extra) -> Path:
    config = _config(tmp_path / f"{name}.yml", refs)
    out = tmp_path / f"{name}-out"
    invoke(runner, ["merge", "--db", tmp_path / f"{name}.db", "--config", config, "--out", out, "--no-progress",
                    *extra])
    return out


def _weights_and_config(out: Path) -> dict[str, bytes]:
    """The files of a merge that only its inputs decide (the card, manifest and config file also name them)."""
    return {p.name: p.read_bytes() for p in out.iterdir() if p.name not in ("README.md", "manifest.json",
                                                                             "mergepipe_config.yml")}


def _uris(db: Path) -> dict[str, str]:
    with Catalog.open(db) as catalog:
        return {m.id: m.uri for m in catalog.models.list() if m.kind != "snapshot"}


def _local(tiny_family) -> dict[str, str]:
    return {name: str(tiny_family[name]) for name in MODELS}


def test_a_mergekit_config_naming_hub_models_merges_like_the_same_config_naming_folders(
        commits, tiny_family, tmp_path, runner):
    hub_out = _merge(runner, tmp_path, "hub", {name: f"org/{name}" for name in MODELS})
    local_out = _merge(runner, tmp_path, "local", _local(tiny_family))

    assert _weights_and_config(hub_out) == _weights_and_config(local_out)
    assert sorted(_weights_and_config(hub_out)) == ["config.json", "generation_config.json", "model.safetensors",
                                                    "tokenizer_config.json"]
    # the catalog pins each model at the commit its branch named, under the repository's name
    assert _uris(tmp_path / "hub.db") == {name: f"hf://org/{name}@{commits[name]}" for name in MODELS}
    manifest = json.loads((hub_out / "manifest.json").read_text())
    local = json.loads((local_out / "manifest.json").read_text())
    assert manifest["plan_digest"] == local["plan_digest"]  # the same inputs, block for block
    assert manifest["extra"]["base_name"] == "org/base"
    assert manifest["extra"]["hub_commits"] == {name: f"org/{name}@{commits[name]}" for name in MODELS}
    assert "hub_commits" not in local["extra"]


def test_a_budgeted_merge_moves_headers_planned_ranges_and_side_files_only(commits, tiny_family, tmp_path, runner,
                                                                          fake_hub):
    db, out = tmp_path / "c.db", tmp_path / "out"
    invoke(runner, ["init-db", "--db", db, "--block-bytes", "4KiB"])
    for name in MODELS:
        invoke(runner, ["register", "--db", db, "--model-id", name, "--uri", f"hf://org/{name}"])
    invoke(runner, ["analyze", "--db", db, "--base", "base", "e1", "e2", "--no-progress"])  # reads every block once
    # a teammate with this catalog (or this machine with its Hugging Face cache evicted): the cache is empty
    shutil.rmtree(Path(constants.HF_HUB_CACHE))
    fake_hub.clear_log()
    invoke(runner, ["merge", "--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "ties", "--density",
                    "0.5", "--budget", "10%", "--out", out, "--model-id", "m", "--no-progress"])

    realized = json.loads((out / "manifest.json").read_text())["cost"]["realized"]
    log = fake_hub.log
    file_bytes = (tiny_family["e1"] / "model.safetensors").stat().st_size
    for name in ("e1", "e2"):
        cdn = [r for r in log if r.host == "cdn" and r.path.startswith(f"/repos/org/{name}/")]
        assert cdn and all(r.range is not None and r.status == 206 for r in cdn)  # ranges only, never a whole file
        probes = [r for r in cdn if r.range == f"bytes=0-{PROBE_BYTES - 1}"]
        planned = sum(r.bytes_sent for r in cdn if r not in probes)
        assert planned == realized["expert_bytes_by_model"][name]  # each planned byte once, nothing else
        assert sum(r.bytes_sent for r in probes) == PROBE_BYTES * len(probes)
        assert sum(r.bytes_sent for r in cdn) < 0.25 * file_bytes  # far less than the whole file at 10%
    base = [r for r in log if r.host == "cdn" and r.path.startswith("/repos/org/base/")]
    assert sum(r.bytes_sent for r in base if r.range != f"bytes=0-{PROBE_BYTES - 1}") == realized["base_bytes"]
    # the small side files come whole from the Hub itself, and are the base's
    whole = {r.path.rsplit("/", 1)[1]: r.bytes_sent for r in log
             if r.host == "hub" and "/resolve/" in r.path and r.status in (200, 206)}
    for side in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert whole[side] == (tiny_family["base"] / side).stat().st_size
        assert (out / side).read_bytes() == (tiny_family["base"] / side).read_bytes()
    assert set(whole) == {"config.json", "generation_config.json", "tokenizer_config.json"}


def test_analysis_downloads_each_model_once_into_the_cache_and_the_merge_after_it_reads_no_byte_more(
        commits, tiny_family, tmp_path, runner, fake_hub):
    db = tmp_path / "c.db"
    for name in MODELS:
        invoke(runner, ["register", "--db", db, "--model-id", name, "--uri", f"hf://org/{name}"])
    fake_hub.clear_log()
    invoke(runner, ["analyze", "--db", db, "--base", "base", "e1", "e2", "--no-progress"])

    cdn = [r for r in fake_hub.log if r.host == "cdn"]
    for name in ("base", "e1", "e2"):  # each weight file once, whole, into the cache
        weights = tiny_family[name] / "model.safetensors"
        sent = [r.bytes_sent for r in cdn if r.path.startswith(f"/repos/org/{name}/")]
        assert [n for n in sent if n != PROBE_BYTES] == [weights.stat().st_size]  # besides the header probes
        cached = Path(constants.HF_HUB_CACHE) / f"models--org--{name}" / "snapshots" / commits[name]
        assert (cached / "model.safetensors").read_bytes() == weights.read_bytes()
        assert (cached / "config.json").read_bytes() == (tiny_family[name] / "config.json").read_bytes()
    fake_hub.clear_log()
    invoke(runner, ["merge", "--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "ties", "--out",
                    tmp_path / "out", "--model-id", "m", "--no-progress"])
    assert [r for r in fake_hub.log if r.host == "cdn"] == []  # the whole merge from the cache


def test_a_branch_that_moved_is_refused_or_registered_as_a_new_version(fake_hub, tiny_family, tmp_path, runner,
                                                                       capsys):
    db = tmp_path / "c.db"
    first = fake_hub.add_folder("org/m", tiny_family["e1"])
    out = invoke(runner, ["register", "--db", db, "--model-id", "m", "--uri", "hf://org/m"])
    assert f"hf://org/m@{first}" in out
    out = invoke(runner, ["register", "--db", db, "--model-id", "m", "--uri", "hf://org/m@main"])
    assert "nothing to do" in out

    moved = fake_hub.move_branch("org/m", "main", {p.name: p.read_bytes() for p in tiny_family["e2"].iterdir()})
    line = refused(["register", "--db", db, "--model-id", "m", "--uri", "hf://org/m"], capsys,
                   first, moved, "--new-version")
    assert "org/m@main" in line
    assert _uris(db) == {"m": f"hf://org/m@{first}"}

    out = invoke(runner, ["register", "--db", db, "--model-id", "m", "--uri", "hf://org/m", "--new-version"])
    assert "version 2 of 'm'" in out
    assert _uris(db) == {"m": f"hf://org/m@{first}", "m@2": f"hf://org/m@{moved}"}
    # the old commit stays readable by its sha
    invoke(runner, ["register", "--db", db, "--model-id", "old", "--uri", f"hf://org/m@{first}"])
    assert _uris(db)["old"] == f"hf://org/m@{first}"


def test_a_config_whose_branch_moved_since_it_was_registered_is_refused(commits, fake_hub, tiny_family, tmp_path,
                                                                          runner, capsys):
    config = _config(tmp_path / "merge.yml", {name: f"org/{name}" for name in MODELS})
    db = tmp_path / "c.db"
    invoke(runner, ["plan", "--db", db, "--config", config, "--analyze-missing", "--no-progress"])
    moved = fake_hub.move_branch("org/e2", "main", {p.name: p.read_bytes() for p in tiny_family["e3"].iterdir()})

    line = refused(["plan", "--db", db, "--config", config, "--no-progress"], capsys, moved, commits["e2"],
                   "--new-version")
    assert "--uri hf://org/e2 --new-version" in line
    assert set(_uris(db)) == set(MODELS)

    invoke(runner, ["register", "--db", db, "--model-id", "e2", "--uri", "hf://org/e2", "--new-version"])
    invoke(runner, ["plan", "--db", db, "--config", config, "--analyze-missing", "--no-progress"])
    assert _uris(db)["e2@2"] == f"hf://org/e2@{moved}"


def test_models_the_cache_holds_are_read_there_without_a_request(commits, fake_hub, tiny_family, tmp_path, runner):
    for name in MODELS:
        snapshot_download(f"org/{name}")  # what transformers' from_pretrained leaves in the cache
    local = _weights_and_config(_merge(runner, tmp_path, "local", _local(tiny_family)))

    fake_hub.clear_log()
    pinned = _merge(runner, tmp_path, "pinned", {name: f"org/{name}@{commits[name]}" for name in MODELS})
    assert fake_hub.log == []
    assert _weights_and_config(pinned) == local

    fake_hub.stop()  # a branch then resolves from the cache's refs, as huggingface_hub does
    branch = _merge(runner, tmp_path, "branch", {name: f"org/{name}" for name in MODELS})
    assert _weights_and_config(branch) == local
    assert _uris(tmp_path / "branch.db") == {name: f"hf://org/{name}@{commits[name]}" for name in MODELS}


def test_offline_mode_reads_the_cache_only_and_names_what_it_lacks(commits, fake_hub, tiny_family, tmp_path, runner,
                                                                   capsys, monkeypatch):
    for name in ("base", "e1"):
        snapshot_download(f"org/{name}")
    capsys.readouterr()  # its progress bar
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # huggingface_hub reads it at import
    fake_hub.clear_log()

    db = tmp_path / "c.db"
    line = refused(["merge", "--db", db, "--config", _config(tmp_path / "m.yml", {n: f"org/{n}" for n in MODELS}),
                    "--out", tmp_path / "out", "--no-progress"], capsys, "HF_HUB_OFFLINE", "org/e2")
    assert "hf download org/e2" in line
    assert not db.exists() or _uris(db) == {}  # nothing registered
    line = refused(["register", "--db", db, "--model-id", "e2", "--uri", f"hf://org/e2@{commits['e2']}"], capsys,
                   "HF_HUB_OFFLINE", f"hf://org/e2@{commits['e2']}")
    assert _uris(db) == {}

    invoke(runner, ["register", "--db", db, "--model-id", "e1", "--uri", "hf://org/e1"])
    assert _uris(db) == {"e1": f"hf://org/e1@{commits['e1']}"}
    assert fake_hub.log == []


def test_closed_repositories_need_the_token_which_no_written_file_holds(fake_hub, tiny_family, tmp_path, runner,
                                                                         capsys, monkeypatch):
    fake_hub.add_folder("org/base", tiny_family["base"])
    fake_hub.add_folder("org/private", tiny_family["e1"], private=True)
    fake_hub.add_folder("org/gated", tiny_family["e2"], gated=True)
    db = tmp_path / "c.db"
    line = refused(["register", "--db", db, "--model-id", "p", "--uri", "hf://org/private"], capsys,
                   "org/private", "HF_TOKEN", "hf auth login")
    assert "private" in line
    refused(["register", "--db", db, "--model-id", "g", "--uri", "hf://org/gated"], capsys,
            "org/gated", "gated", "accept its terms", "HF_TOKEN")
    assert not db.exists() or _uris(db) == {}

    monkeypatch.setenv("HF_TOKEN", fake_hub.token)
    config = _config(tmp_path / "m.yml", {"base": "org/base", "e1": "org/private", "e2": "org/gated"})
    out, db = tmp_path / "out", tmp_path / "m.db"
    invoke(runner, ["merge", "--db", db, "--config", config, "--out", out, "--no-progress", "--json-summary",
                    tmp_path / "summary.json"])
    invoke(runner, ["explain", "--db", db, "m", "--html", tmp_path / "report.html"])
    assert _uris(db)["private"].startswith("hf://org/private@")

    written = [p for p in tmp_path.rglob("*") if p.is_file() and "hf_home" not in p.parts]
    assert {"m.db", "manifest.json", "README.md", "mergepipe_config.yml", "summary.json", "report.html"} \
        <= {p.name for p in written}
    assert [p for p in written if fake_hub.token.encode() in p.read_bytes()] == []


@pytest.mark.parametrize("uri, needles", [
    ("hf://org/nowhere", ("org/nowhere", "HF_TOKEN")),
    ("hf://org/base@no-such-branch", ("org/base", "no revision 'no-such-branch'")),
    ("hf://org/base@main/no/such/folder", ("no/such/folder", "nothing found")),
    ("hf://org/pickled", ("pytorch_model.bin", "safetensors")),
    ("hf://datasets/org/base", ("model repositories only",)),
])
def test_what_cannot_be_read_from_the_hub_is_one_line_and_registers_nothing(fake_hub, tiny_family, tmp_path, capsys,
                                                                            uri, needles):
    fake_hub.add_folder("org/base", tiny_family["base"])
    fake_hub.add_repo("org/pickled", {"config.json": b"{}", "pytorch_model.bin": b"\x80\x02pickle"})
    db = tmp_path / "c.db"
    refused(["register", "--db", db, "--model-id", "x", "--uri", uri], capsys, *needles)
    assert not db.exists() or _uris(db) == {}


def test_a_config_naming_a_model_the_hub_lacks_is_one_line_and_takes_back_what_it_registered(
        commits, tmp_path, capsys):
    config = _config(tmp_path / "m.yml", {"base": "org/base", "e1": "org/e1", "e2": "org/nowhere"})
    db = tmp_path / "c.db"
    refused(["merge", "--db", db, "--config", config, "--out", tmp_path / "out", "--no-progress"], capsys,
            "org/nowhere", "HF_TOKEN", "there is no local folder org/nowhere")
    assert _uris(db) == {} and not (tmp_path / "out").exists()


def test_a_bare_id_that_is_a_local_folder_is_the_folder(commits, tiny_family, tmp_path, runner, monkeypatch):
    (tmp_path / "org").mkdir()
    shutil.copytree(tiny_family["e2"], tmp_path / "org" / "e1")  # ./org/e1 exists: mergekit reads the folder
    monkeypatch.chdir(tmp_path)
    _merge(runner, tmp_path, "mixed", {name: f"org/{name}" for name in MODELS})
    uris = _uris(tmp_path / "mixed.db")
    assert uris["e1"] == str((tmp_path / "org" / "e1").resolve())
    assert uris["base"] == f"hf://org/base@{commits['base']}"


def test_register_takes_a_bare_hub_id_as_merge_does_and_a_local_folder_of_that_name_wins(
        commits, tiny_family, tmp_path, runner, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "c.db"
    out = invoke(runner, ["register", "--db", db, "--model-id", "b", "--uri", "org/base@main"])
    assert f"hf://org/base@{commits['base']}" in out
    invoke(runner, ["register", "--db", db, "--model-id", "e1", "--uri", "org/e1"])
    shutil.copytree(tiny_family["e2"], tmp_path / "org" / "e2")  # ./org/e2 exists: the folder, not the Hub's
    invoke(runner, ["register", "--db", db, "--model-id", "e2", "--uri", "org/e2"])
    assert _uris(db) == {"b": f"hf://org/base@{commits['base']}", "e1": f"hf://org/e1@{commits['e1']}",
                         "e2": str((tmp_path / "org" / "e2").resolve())}
    # the same model as its hf:// URI: nothing to do
    assert "nothing to do" in invoke(runner, ["register", "--db", db, "--model-id", "e1", "--uri", "hf://org/e1"])
    refused(["register", "--db", db, "--model-id", "x", "--uri", "org/nowhere"], capsys, "org/nowhere", "HF_TOKEN",
            "read as a Hub id: there is no local folder org/nowhere")


def test_an_adapter_on_the_hub_applied_to_a_hub_base_merges_like_peft(fake_hub, tmp_path, runner):
    peft = pytest.importorskip("peft")
    from tests.fixtures.checkpoints import make_base
    from tests.fixtures.lora import assert_merged_like_peft, make_lora_adapter

    base = make_base(tmp_path / "models" / "base", dtype="f32", seed=5)
    adapter = make_lora_adapter(base, tmp_path / "models" / "math-lora",
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]), seed=3)
    fake_hub.add_folder("org/base", base)
    commit = fake_hub.add_folder("org/math-lora", adapter)
    config = tmp_path / "m.yml"
    config.write_text(yaml.safe_dump({
        "merge_method": "task_arithmetic", "base_model": "org/base", "parameters": {"lambda": 1.0},
        "models": [{"model": "org/base+org/math-lora", "parameters": {"weight": 1.0}}],
        "mergepipe": {"model_id": "m"}}))
    out = tmp_path / "out"
    invoke(runner, ["merge", "--db", tmp_path / "c.db", "--config", config, "--out", out, "--no-progress"])

    assert_merged_like_peft(load_tensors(out), base, adapter)
    with Catalog.open(tmp_path / "c.db") as catalog:
        lora = catalog.models.get("math-lora")
    assert (lora.kind, lora.delta_base) == ("lora", "base")
    assert lora.uri.endswith(f"models--org--math-lora/snapshots/{commit}")  # downloaded: the folder names the commit
    assert json.loads((out / "manifest.json").read_text())["extra"]["hub_commits"]["math-lora"] == \
        f"org/math-lora@{commit}"
