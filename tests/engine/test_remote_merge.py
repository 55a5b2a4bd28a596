"""Register, analyze and merge experts kept in S3 (moto on 127.0.0.1) or behind an HTTP server (loopback).

The reference is the same merge of local copies of the same files: the output
bytes, the snapshot id and the manifest hash must be identical. The servers'
request logs are the independent witness of what was fetched: headers, JSON
files, and for the merge only the planned blocks (adjacent ones coalesced);
faults injected by the HTTP server are retried to the same output, and a
permanent error or a replaced object publishes nothing.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.errors import CheckpointError, ModelChangedError
from mergepipe.planner.planner import Planner
from mergepipe.spec.plan import Plan
from mergepipe.storage.format import read_header
from mergepipe.spec.request import MergeRequest
from tests.fixtures.checkpoints import make_base, make_expert
from tests.fixtures.remote import RangeServer, RequestLog, S3Server

BLOCK_BYTES = 2048
MODELS = ("base", "e1", "e2")
MERGE = {"operator": "ties", "params": {"density": 0.5}}


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> Path:
    """A sharded bf16 Qwen3 base and two experts, as directories of one root (served as they are)."""
    root = tmp_path_factory.mktemp("remote-family")
    base = make_base(root / "base", arch="qwen3", dtype="bf16", sharded=True)
    make_expert(base, root / "e1", seed=11)
    make_expert(base, root / "e2", seed=12, layer_scale={1: 1.0})
    return root


@pytest.fixture(scope="module")
def http(family):
    with RangeServer(family) as server:
        yield server


@pytest.fixture(scope="module")
def s3(family):
    with S3Server() as server:
        for name in MODELS:
            server.upload(family / name, "models", f"team/{name}")
        yield server


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch):
    monkeypatch.setenv("MERGEPIPE_REMOTE_BACKOFF_SECONDS", "0.01")
    monkeypatch.setenv("MERGEPIPE_REMOTE_HEADER_PROBE_BYTES", "8")  # header reads touch no data byte


def _uris(kind: str, family: Path, http: RangeServer | None, s3: S3Server | None, monkeypatch) -> dict[str, str]:
    if kind == "local":
        return {m: str(family / m) for m in MODELS}
    if kind == "http":
        return {m: f"{http.url}/{m}" for m in MODELS}
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return {m: f"s3://models/team/{m}" for m in MODELS}


def _merge(db: Path, uris: dict[str, str], out: Path, budget: str) -> tuple[Plan, str, object, Catalog]:
    catalog = Catalog.create(db, BLOCK_BYTES)
    for model_id, uri in uris.items():
        register_model(catalog, model_id, uri)
    analyze(catalog, ["e1", "e2"], base_id="base", progress=False)
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator=MERGE["operator"], budget=budget, params=MERGE["params"]))
    snapshot_id, manifest = Engine(catalog, progress=False).execute(plan, out=out, model_id="merged")
    return plan, snapshot_id, manifest, catalog


def _files(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
            if p.name != "manifest.json"}


@pytest.fixture(scope="module")
def local_reference(family, tmp_path_factory):
    """The same merges from the local directories: budget -> (plan digest, snapshot id, manifest hash, files)."""
    root = tmp_path_factory.mktemp("local-merges")
    out = {}
    for budget in ("100%", "25%"):
        plan, snapshot_id, manifest, catalog = _merge(root / f"{budget[:-1]}.db", {m: str(family / m) for m in MODELS},
                                                      root / f"out{budget[:-1]}", budget)
        catalog.close()
        out[budget] = (plan.digest, snapshot_id, manifest.manifest_hash, _files(root / f"out{budget[:-1]}"))
    return out


def _planned_ranges(catalog: Catalog, plan: Plan, expert: str) -> dict[str, list[tuple[int, int]]]:
    """File name -> the byte ranges of the expert's planned blocks, from the catalog (sorted)."""
    files = {t.name: t.file for t in catalog.models.tensors(expert)}
    blocks = catalog.blocks.by_tensor(expert)
    out: dict[str, list[tuple[int, int]]] = {}
    for tensor, per in plan.reads.items():
        for i in per.get(expert, ()):
            out.setdefault(files[tensor], []).append((blocks[tensor][i].begin, blocks[tensor][i].end))
    return {f: sorted(r) for f, r in out.items()}


def _covered_exactly(get: tuple[int, int], planned: list[tuple[int, int]]) -> bool:
    """Whether ``get`` is a run of whole, adjacent planned ranges."""
    inside = [r for r in planned if get[0] <= r[0] and r[1] <= get[1]]
    return bool(inside) and inside[0][0] == get[0] and inside[-1][1] == get[1] and all(
        a[1] == b[0] for a, b in zip(inside, inside[1:]))


@pytest.mark.parametrize("kind", ["s3", "http"])
@pytest.mark.parametrize("budget", ["100%", "25%"])
def test_remote_merge_is_the_local_merge_and_fetches_only_headers_and_planned_blocks(
        kind, budget, family, http, s3, local_reference, tmp_path, monkeypatch):
    uris = _uris(kind, family, http, s3, monkeypatch)
    log: RequestLog = (http if kind == "http" else s3).log
    with Catalog.create(tmp_path / "c.db", BLOCK_BYTES) as catalog:
        for model_id, uri in uris.items():
            register_model(catalog, model_id, uri)
        analyze(catalog, ["e1", "e2"], base_id="base", progress=False)
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator=MERGE["operator"], budget=budget, params=MERGE["params"]))
        log.clear()
        snapshot_id, manifest = Engine(catalog, progress=False).execute(plan, out=tmp_path / "out", model_id="merged")
        digest, local_id, local_hash, local_files = local_reference[budget]
        assert (plan.digest, snapshot_id, manifest.manifest_hash) == (digest, local_id, local_hash)
        assert _files(tmp_path / "out") == local_files
        realized = manifest.cost.realized
        assert realized.expert_bytes <= plan.cost.expert_bytes <= plan.budget_bytes
        assert set(realized.requests_by_model) >= {"base", "e1"}
        for expert in ("e1", "e2"):
            planned = _planned_ranges(catalog, plan, expert)
            data_gets = []
            for name in sorted(p.name for p in (family / expert).glob("*.safetensors")):
                data_start = read_header(family / expert / name).data_start
                for get in log.gets(f"/{expert}/{name}"):
                    assert get.range is not None, f"an unranged GET of {name}"
                    if get.range[1] <= data_start:
                        continue  # a header read
                    assert _covered_exactly(get.range, planned.get(name, [])), f"{get.range} of {name} was not planned"
                    data_gets.append(get.range)
            n_planned = sum(len(r) for r in planned.values())
            assert sum(e - b for b, e in data_gets) == realized.expert_bytes_by_model[expert]
            assert realized.requests_by_model.get(expert, 0) == len(data_gets)
            if n_planned > 1:
                assert len(data_gets) < n_planned  # adjacent planned blocks travelled together


def test_register_reads_only_headers_and_records_etags(family, s3, tmp_path, monkeypatch):
    uris = _uris("s3", family, None, s3, monkeypatch)
    s3.log.clear()
    with Catalog.create(tmp_path / "c.db", BLOCK_BYTES) as catalog:
        record = register_model(catalog, "e1", uris["e1"])
        files = catalog.models.files("e1")
    assert record.uri == "s3://models/team/e1"
    etags = {o["Key"].rsplit("/", 1)[-1]: o["ETag"].strip('"')
             for o in s3.client().list_objects_v2(Bucket="models", Prefix="team/e1/")["Contents"]}
    assert {f.name: f.etag for f in files} == {n: e for n, e in etags.items() if n.endswith(".safetensors")}
    for name in etags:
        if not name.endswith(".safetensors"):
            continue
        data_start = read_header(family / "e1" / name).data_start
        ranges = [g.range for g in s3.log.gets(f"/e1/{name}")]
        assert ranges == [(0, 8), (8, data_start)]  # the length, then the header: no data byte


def test_header_probe_costs_one_request_and_a_longer_header_a_second(family, http, monkeypatch):
    from mergepipe.storage.checkpoint import open_checkpoint

    name = sorted(p.name for p in (family / "e2").glob("*.safetensors"))[0]
    data_start = read_header(family / "e2" / name).data_start
    for probe, expected in ((data_start + 100, [(0, data_start + 100)]), (64, [(0, 64), (64, data_start)])):
        monkeypatch.setenv("MERGEPIPE_REMOTE_HEADER_PROBE_BYTES", str(probe))
        http.log.clear()
        checkpoint = open_checkpoint(f"{http.url}/e2")
        assert [g.range for g in http.log.gets(f"/e2/{name}")] == expected
        local = read_header(family / "e2" / name)
        remote = checkpoint.file(name).header
        assert (remote.header_sha256, remote.tensors, remote.file_size) == (local.header_sha256, local.tensors,
                                                                            local.file_size)


def test_analyze_is_skipped_when_the_catalog_holds_it(family, http, tmp_path, monkeypatch):
    uris = _uris("http", family, http, None, monkeypatch)
    with Catalog.create(tmp_path / "c.db", BLOCK_BYTES) as catalog:
        for model_id, uri in uris.items():
            register_model(catalog, model_id, uri)
        first = analyze(catalog, ["e1", "e2"], base_id="base", progress=False)
        http.log.clear()
        again = analyze(catalog, ["e1", "e2"], base_id="base", progress=False)
    assert first.bytes_read > 0 and again.bytes_read == 0 and set(again.skipped) == {"e1", "e2"}
    for get in http.log.gets(".safetensors"):  # at most headers: no tensor byte
        name = get.path.rsplit("/", 1)[-1]
        assert get.range[1] <= read_header(family / get.path.split("/")[1] / name).data_start


@pytest.mark.parametrize("fault", ["503", "drop", "short"])
def test_transient_faults_mid_merge_are_retried_to_the_same_output(fault, family, http, local_reference, tmp_path,
                                                                    monkeypatch):
    uris = _uris("http", family, http, None, monkeypatch)
    with Catalog.create(tmp_path / "c.db", BLOCK_BYTES) as catalog:
        for model_id, uri in uris.items():
            register_model(catalog, model_id, uri)
        analyze(catalog, ["e1", "e2"], base_id="base", progress=False)
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator=MERGE["operator"], budget="25%", params=MERGE["params"]))
        http.log.clear()
        for expert in ("e1", "e2"):
            shard = sorted(_planned_ranges(catalog, plan, expert))[0]
            data_start = read_header(family / expert / shard).data_start
            http.inject(fault, suffix=f"/{expert}/{shard}", times=2, after=data_start)  # block reads, not headers
        try:
            _, manifest = Engine(catalog, progress=False).execute(plan, out=tmp_path / "out", model_id="merged")
        finally:
            http.clear_faults()
    failed = [r for r in http.log.items if r.status == 503] if fault == "503" else []
    assert fault != "503" or len(failed) == 4
    assert _files(tmp_path / "out") == local_reference["25%"][3]
    assert manifest.cost.realized.expert_bytes <= plan.cost.expert_bytes


def _full_plan(catalog: Catalog, uris: dict[str, str]) -> Plan:
    """Register every model at its URI, analyse both experts, and plan their task arithmetic at 100%."""
    for model_id, uri in uris.items():
        register_model(catalog, model_id, uri)
    analyze(catalog, ["e1", "e2"], base_id="base", progress=False)
    return Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="task_arithmetic", budget="100%"))


def test_a_missing_shard_is_one_line_and_publishes_nothing(family, s3, tmp_path, monkeypatch):
    uris = _uris("s3", family, None, s3, monkeypatch)
    s3.upload(family / "e1", "models", "gone/e1")
    uris["e1"] = "s3://models/gone/e1"
    with Catalog.create(tmp_path / "c.db", BLOCK_BYTES) as catalog:
        plan = _full_plan(catalog, uris)
        shard = sorted(_planned_ranges(catalog, plan, "e1"))[0]
        s3.client().delete_object(Bucket="models", Key=f"gone/e1/{shard}")
        with pytest.raises((CheckpointError, ModelChangedError)) as info:
            Engine(catalog, progress=False).execute(plan, out=tmp_path / "out", model_id="merged")
        assert "\n" not in str(info.value) and shard in str(info.value)
    assert not (tmp_path / "out").exists()


def test_a_404_while_reading_blocks_is_permanent_and_publishes_nothing(family, http, tmp_path, monkeypatch):
    uris = _uris("http", family, http, None, monkeypatch)
    with Catalog.create(tmp_path / "c.db", BLOCK_BYTES) as catalog:
        plan = _full_plan(catalog, uris)
        http.log.clear()
        shard = sorted(_planned_ranges(catalog, plan, "e2"))[0]
        http.inject("404", suffix=f"/e2/{shard}", times=100, after=read_header(family / "e2" / shard).data_start)
        try:
            with pytest.raises(CheckpointError, match="404") as info:
                Engine(catalog, progress=False).execute(plan, out=tmp_path / "out", model_id="merged")
        finally:
            http.clear_faults()
        assert "\n" not in str(info.value)
        assert len([r for r in http.log.gets() if r.status == 404]) == 1  # not retried
    assert not (tmp_path / "out").exists()


def test_an_object_replaced_after_register_is_refused_before_any_read(family, s3, tmp_path, monkeypatch):
    uris = _uris("s3", family, None, s3, monkeypatch)
    s3.upload(family / "e2", "models", "replaced/e2")
    uris["e2"] = "s3://models/replaced/e2"
    with Catalog.create(tmp_path / "c.db", BLOCK_BYTES) as catalog:
        plan = _full_plan(catalog, uris)
        name = sorted(p.name for p in (family / "e2").glob("*.safetensors"))[-1]
        changed = bytearray((family / "e2" / name).read_bytes())
        changed[-1] ^= 1  # same size, same header: only the ETag tells
        s3.client().put_object(Bucket="models", Key=f"replaced/e2/{name}", Body=bytes(changed))
        s3.log.clear()
        with pytest.raises(ModelChangedError, match="e2") as info:
            Engine(catalog, progress=False).execute(plan, out=tmp_path / "out", model_id="merged")
        assert "\n" not in str(info.value)
    assert not [g for g in s3.log.gets("/replaced/e2/" + name) if g.range and g.range[0] > 0]
    assert not (tmp_path / "out").exists()


def test_a_remote_base_with_local_experts_copies_its_side_files(family, http, local_reference, tmp_path,
                                                                  monkeypatch):
    uris = {"base": f"{http.url}/base", "e1": str(family / "e1"), "e2": str(family / "e2")}
    with Catalog.create(tmp_path / "c.db", BLOCK_BYTES) as catalog:
        for model_id, uri in uris.items():
            register_model(catalog, model_id, uri)
        analyze(catalog, ["e1", "e2"], base_id="base", progress=False)
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator=MERGE["operator"], budget="25%", params=MERGE["params"]))
        snapshot_id, manifest = Engine(catalog, progress=False).execute(plan, out=tmp_path / "out", model_id="merged")
    assert _files(tmp_path / "out") == local_reference["25%"][3]
    assert set(manifest.cost.realized.requests_by_model) == {"base"}
    shutil.rmtree(tmp_path / "out")


def test_a_delta_exported_from_a_remote_expert_registers_against_the_remote_base(family, http, tmp_path):
    """export-delta reads a remote expert, and registering its (local) delta against a remote base reads the
    base's blocks for the fingerprint check: both through the remote source, no local open() of a URI. The
    f32 delta merges bit for bit like the expert it came from."""
    from mergepipe.analysis.export_delta import export_delta

    catalog = Catalog.create(tmp_path / "c.db", BLOCK_BYTES)
    register_model(catalog, "base", f"{http.url}/base")
    register_model(catalog, "e1", f"{http.url}/e1")
    report = export_delta(catalog, "e1", tmp_path / "d1", base="base", dtype="F32")
    assert report.tensors > 0
    register_model(catalog, "d1", tmp_path / "d1", kind="delta", base="base")
    analyze(catalog, ["d1"], base_id="base", progress=False)
    outputs = {}
    for expert in ("e1", "d1"):
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=[expert], operator="task_arithmetic", params={"lambda": 1.0}))
        Engine(catalog).execute(plan, out=tmp_path / f"out-{expert}", model_id=f"m-{expert}")
        outputs[expert] = {p.name: p.read_bytes() for p in sorted((tmp_path / f"out-{expert}").glob("*.safetensors"))}
    assert outputs["e1"] == outputs["d1"] and outputs["e1"]
    catalog.close()
