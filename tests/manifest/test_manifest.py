"""Manifest: exact JSON round trip, what the hash covers, snapshot ids, files."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings

from mergepipe.errors import VerifyError
from mergepipe.manifest.manifest import (
    HASH_EXCLUDED_FIELDS,
    MANIFEST_FILENAME,
    ByteCost,
    Cost,
    ErrorBound,
    ExpertRef,
    FileEntry,
    Manifest,
    OperatorSpec,
    RealizedCost,
    SoftwareVersions,
    read_manifest,
    snapshot_id_for,
)
from mergepipe.spec.canonical import canonical_json, sha256_hex
from mergepipe.spec.plan import ModelRef
from tests.manifest.factories import make_manifest, manifests, sha

replace = dataclasses.replace


@settings(max_examples=150, deadline=None)
@given(manifests())
def test_json_round_trip_is_exact(manifest):
    data = manifest.to_json()
    assert Manifest.from_json(data) == manifest
    # through canonical bytes too, as written to disk
    parsed = Manifest.from_json(json.loads(canonical_json(data)))
    assert parsed == manifest
    assert parsed.manifest_hash == manifest.manifest_hash == data["manifest_hash"]
    assert canonical_json(parsed.to_json()) == canonical_json(data)


def test_hash_is_sha256_of_canonical_bytes_without_excluded_fields():
    m = make_manifest()
    hashed = json.loads(m.canonical_bytes())
    assert m.manifest_hash == sha256_hex(m.canonical_bytes())
    assert "created_at" not in hashed and "manifest_hash" not in hashed
    assert "seconds" not in hashed["cost"]["realized"]
    assert set(hashed) == set(m.to_json()) - {"created_at", "manifest_hash"}
    assert HASH_EXCLUDED_FIELDS == ("created_at", "manifest_hash", "cost.realized.seconds", "cost.estimated.seconds",
                                    "cost.realized.requests_by_model", "cost.realized.output_bytes_by_method")


def test_timestamps_and_timings_do_not_enter_the_hash():
    m = make_manifest()
    realized = replace(m.cost.realized, seconds={"read": 99.0, "other": 1.0})
    other = replace(m, created_at="2030-12-31T23:59:59Z", cost=replace(m.cost, realized=realized))
    assert other != m
    assert other.manifest_hash == m.manifest_hash


def _mutations():
    m = make_manifest()
    c, r = m.cost, m.cost.realized
    return {
        "snapshot_id": replace(m, snapshot_id="snap-other"),
        "model_id": replace(m, model_id="merged-2"),
        "plan_digest": replace(m, plan_digest=sha("other plan")),
        "base.id": replace(m, base=ModelRef("base2", m.base.fingerprint)),
        "base.fingerprint": replace(m, base=ModelRef("base", sha("x"))),
        "experts.weight": replace(m, experts=(replace(m.experts[0], weight=0.75), m.experts[1])),
        "experts.fingerprint": replace(m, experts=(replace(m.experts[0], fingerprint=sha("y")), m.experts[1])),
        "experts.order": replace(m, experts=m.experts[::-1]),
        "experts.dropped": replace(m, experts=m.experts[:1]),
        "operator.name": replace(m, operator=OperatorSpec("dare_ties", m.operator.params)),
        "operator.params": replace(m, operator=OperatorSpec("ties", {"density": 0.6, "lambda": 1.0})),
        "seed": replace(m, seed=8),
        "budget_bytes": replace(m, budget_bytes=None),
        "cost.estimated": replace(m, cost=replace(c, estimated=replace(c.estimated, expert_bytes=1025))),
        "cost.realized.base_bytes": replace(m, cost=replace(c, realized=replace(r, base_bytes=1))),
        "cost.realized.output_bytes": replace(m, cost=replace(c, realized=replace(r, output_bytes=1))),
        "cost.realized.by_model": replace(m, cost=replace(c, realized=replace(
            r, expert_bytes_by_model={"e1": 601, "e2": 399}))),
        "error_bound.estimated": replace(m, error_bound=replace(m.error_bound, estimated=0.5)),
        "error_bound.realized": replace(m, error_bound=replace(m.error_bound, realized=None)),
        "error_bound.kind": replace(m, error_bound=replace(m.error_bound, kind="not known")),
        "reads.range": replace(m, reads={"layers.0.w": {"e1": [[0, 3], [8, 8]], "e2": [[1, 1]]}}),
        "reads.expert": replace(m, reads={"layers.0.w": {"e1": [[0, 3], [7, 7]]}}),
        "files.digest": replace(m, files=(replace(m.files[0], digest=sha("z")), m.files[1])),
        "files.size": replace(m, files=(replace(m.files[0], size=121), m.files[1])),
        "software": replace(m, software=replace(m.software, torch="2.14.0")),
        "extra": replace(m, extra={"note": "x"}),
    }


@pytest.mark.parametrize("name", sorted(_mutations()))
def test_every_other_field_changes_the_hash(name):
    assert _mutations()[name].manifest_hash != make_manifest().manifest_hash


def test_normalisation_makes_equal_values_hash_equal():
    m = make_manifest()
    same = make_manifest(
        experts=(ExpertRef("e1", sha("e1"), 0.5), ExpertRef("e2", sha("e2"), 0.25)),
        files=tuple(reversed(m.files)),
        reads={"layers.0.w": {"e2": [(1, 1)], "e1": [[7, 7], [0, 1], [2, 3]]}},
        operator=OperatorSpec("ties", {"lambda": 1.0, "density": 0.5}),
    )
    assert same == m and same.manifest_hash == m.manifest_hash
    # free-form params are hashed as given: the plan resolves their types, so 1 != 1.0 here
    assert make_manifest(operator=OperatorSpec("ties", {"lambda": 1, "density": 0.5})).manifest_hash != m.manifest_hash
    assert make_manifest(experts=(ExpertRef("e1", sha("e1"), 1),)).experts[0].weight == 1.0
    assert isinstance(make_manifest(experts=(ExpertRef("e1", sha("e1"), 1),)).experts[0].weight, float)


@pytest.mark.parametrize(("change", "match"), [
    (lambda d: d.update(schema=3), "manifest schema 3 is not supported (this mergepipe reads schemas 1, 2)"),
    (lambda d: d.update(schema=True), "manifest schema True is not supported"),
    (lambda d: d.update(schema=1), "manifest schema 1 records sha256 file hashes, and only those"),
    (lambda d: d.update(surprise=1), "unknown key 'surprise'"),
    (lambda d: d.pop("seed"), "seed is missing"),
    (lambda d: d["cost"]["realized"].pop("seconds"), "cost.realized.seconds is missing"),
    (lambda d: d["experts"][0].update(weight="heavy"), "experts.0.weight: Input should be a valid number (got 'heavy')"),
    (lambda d: d.update(budget_bytes=-1), "budget_bytes: Input should be greater than or equal to 0 (got -1)"),
    (lambda d: d["files"][0].update(name="../escape"), "plain relative path inside the snapshot, got '../escape'"),
    (lambda d: d["files"][0].update(name=MANIFEST_FILENAME), "manifest.json cannot list itself"),
    (lambda d: d["files"][0].update(blake3="XYZ"), "files.0.digest: String should match pattern '^[0-9a-f]{64}$'"),
    (lambda d: d["files"][0].update(sha256=sha("x")), "needs exactly one hash (blake3 or sha256)"),
    (lambda d: d["files"][0].pop("blake3"), "needs exactly one hash (blake3 or sha256)"),
    (lambda d: d["files"].append(dict(d["files"][0])), "manifest lists a file name twice"),
    (lambda d: d.update(reads={"t": {"e1": [[3, 2]]}}), "first <= last"),
    (lambda d: d["error_bound"].update(estimated=True), "error_bound.estimated: Input should be a valid number"),
])
def test_a_bad_manifest_is_one_line_naming_what_is_wrong(tmp_path, change, match):
    data = make_manifest().to_json()
    change(data)
    (tmp_path / MANIFEST_FILENAME).write_bytes(canonical_json(data))
    with pytest.raises(VerifyError) as info:
        read_manifest(tmp_path)
    message = str(info.value)
    assert match in message and "not a valid manifest" in message and "\n" not in message, message


def test_snapshot_id_is_content_derived():
    files = (FileEntry("a.safetensors", sha("a"), 1), FileEntry("config.json", sha("c"), 2))
    sid = snapshot_id_for(sha("plan"), files)
    assert sid.startswith("snap-") and len(sid) == 5 + 16 and int(sid[5:], 16) >= 0
    assert snapshot_id_for(sha("plan"), files[::-1]) == sid
    assert snapshot_id_for(sha("plan"), (replace(files[0], size=99), files[1])) == sid  # size is implied by sha
    assert snapshot_id_for(sha("plan2"), files) != sid
    assert snapshot_id_for(sha("plan"), (replace(files[0], digest=sha("b")), files[1])) != sid
    assert snapshot_id_for(sha("plan"), files[:1]) != sid


def test_a_schema_1_manifest_with_sha256_file_hashes_still_reads():
    """Snapshots made before blake3 file hashes (schema 2) stay readable: their entries keep sha256."""
    data = make_manifest().to_json()
    data["schema"] = 1
    for entry in data["files"]:
        entry["sha256"] = entry.pop("blake3")
    old = Manifest.from_json(data)
    assert old.schema == 1 and {f.algorithm for f in old.files} == {"sha256"}
    assert old.to_json()["files"] == data["files"]
    assert Manifest.from_json(old.to_json()) == old
    assert old.manifest_hash != make_manifest().manifest_hash


def test_write_then_load(tmp_path):
    m = make_manifest()
    path = m.write(tmp_path)
    assert path == tmp_path / MANIFEST_FILENAME
    assert path.read_bytes() == canonical_json(m.to_json())
    assert json.loads(path.read_bytes())["manifest_hash"] == m.manifest_hash
    assert Manifest.load(tmp_path) == m
    with pytest.raises(FileExistsError):
        m.write(tmp_path)


def test_pretty_printing_does_not_change_the_hash(tmp_path):
    m = make_manifest()
    (tmp_path / MANIFEST_FILENAME).write_text(json.dumps(m.to_json(), indent=4, sort_keys=False))
    loaded = Manifest.load(tmp_path)
    assert loaded == m and loaded.manifest_hash == m.manifest_hash


def test_load_refuses_edited_manifest(tmp_path):
    data = make_manifest().to_json()
    data["seed"] = 8
    (tmp_path / MANIFEST_FILENAME).write_bytes(canonical_json(data))
    with pytest.raises(VerifyError, match="manifest was edited"):
        Manifest.load(tmp_path)
    manifest, stored = read_manifest(tmp_path)
    assert manifest.seed == 8 and stored == make_manifest().manifest_hash


@pytest.mark.parametrize(("content", "match"), [(None, "missing"), (b"{not json", "cannot be read"),
                                                (b'{"schema": 1}', "not a valid manifest")])
def test_read_manifest_errors_name_the_file(tmp_path, content, match):
    if content is not None:
        (tmp_path / MANIFEST_FILENAME).write_bytes(content)
    with pytest.raises(VerifyError, match=match) as info:
        read_manifest(tmp_path)
    assert MANIFEST_FILENAME in str(info.value) and "\n" not in str(info.value)


def test_software_versions_current():
    versions = SoftwareVersions.current()
    import platform

    import mergepipe

    assert versions.mergepipe == mergepipe.__version__ and versions.python == platform.python_version()
    assert versions.torch and versions.safetensors


def test_parts_round_trip_on_their_own():
    assert ByteCost(1, 2, 3).to_json() == {"base_bytes": 1, "expert_bytes": 2, "output_bytes": 3}
    assert Cost.from_json(make_manifest().cost.to_json()) == make_manifest().cost
    assert RealizedCost.from_json(make_manifest().cost.realized.to_json()) == make_manifest().cost.realized
    assert ErrorBound(None, None, "none").to_json() == {"estimated": None, "realized": None, "kind": "none"}
