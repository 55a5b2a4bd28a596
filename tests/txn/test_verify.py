"""verify: every file hash and size, the manifest hash, the snapshot id, missing and extra files."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from mergepipe.errors import VerifyError
from mergepipe.manifest.manifest import MANIFEST_FILENAME, Manifest, snapshot_id_for
from mergepipe.spec.canonical import canonical_json
from tests.fixtures.checkpoints import make_writable_tree
from mergepipe.txn.publish import TransactionManager
from mergepipe.txn.verify import verify_or_raise, verify_snapshot
from tests.txn.helpers import finish_snapshot, write_checkpoint


@pytest.fixture
def snapshot(tmp_path):
    """A published (read-only) snapshot, made writable again so tests can damage it."""
    tm = TransactionManager()
    out = tmp_path / "snap"
    area = tm.stage(out)
    write_checkpoint(area.path)
    finish_snapshot(area.path, "m")
    tm.publish(area)
    make_writable_tree(out)
    return out


def edit_manifest(snapshot, change, rehash=False):
    path = snapshot / MANIFEST_FILENAME
    data = json.loads(path.read_bytes())
    change(data)
    if rehash:  # a careful forger: recompute the stored hash from the edited fields
        data["manifest_hash"] = Manifest.from_json(data).manifest_hash
    path.write_bytes(canonical_json(data))


def test_clean_snapshot_verifies(snapshot):
    report = verify_or_raise(snapshot)
    assert report.ok and report.problems == [] and report.files_checked == 3
    assert json.loads((snapshot / MANIFEST_FILENAME).read_text())["manifest_hash"] == report.manifest.manifest_hash


def flip_byte(snapshot):
    path = snapshot / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(snapshot):
    path = snapshot / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-8])


DAMAGE = {
    "flipped byte": (flip_byte, r"^model\.safetensors: blake3 [0-9a-f]{64} differs from manifest"),
    "truncated": (truncate, r"^model\.safetensors: size \d+ bytes, manifest says \d+$"),
    "missing": (lambda s: (s / "tokenizer.json").unlink(), r"^tokenizer\.json: missing$"),
    "extra": (lambda s: (s / "notes.txt").write_text("hi"), r"^notes\.txt: not listed in the manifest$"),
    "extra nested": (lambda s: (s / "sub").mkdir() or (s / "sub" / "x.bin").write_bytes(b"x"),
                     r"^sub/x\.bin: not listed in the manifest$"),
    "tampered field": (lambda s: edit_manifest(s, lambda d: d.update(seed=12345)),
                       r"^manifest\.json: manifest_hash [0-9a-f]{64} does not match its fields"),
    "tampered file entry": (lambda s: edit_manifest(s, lambda d: d["files"][0].update(size=1), rehash=True),
                            r"^config\.json: size \d+ bytes, manifest says 1$"),
    "tampered plan digest, rehashed": (
        lambda s: edit_manifest(s, lambda d: d.update(plan_digest="0" * 64), rehash=True),
        r"^manifest\.json: snapshot_id snap-[0-9a-f]{16} does not match"),
    "missing manifest": (lambda s: (s / MANIFEST_FILENAME).unlink(), r"manifest\.json: missing"),
    "garbage manifest": (lambda s: (s / MANIFEST_FILENAME).write_bytes(b"\x00{"), r"manifest\.json: cannot be read"),
}


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_damage_is_detected_and_named(snapshot, name):
    damage, pattern = DAMAGE[name]
    damage(snapshot)
    report = verify_snapshot(snapshot)
    assert not report.ok
    assert any(re.search(pattern, p) for p in report.problems), report.problems
    assert all("\n" not in p for p in report.problems)
    with pytest.raises(VerifyError, match="failed verification") as info:
        verify_or_raise(snapshot)
    assert report.problems[0] in str(info.value) and "\n" not in str(info.value)


def test_all_problems_are_listed(snapshot):
    flip_byte(snapshot)
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "extra.bin").write_bytes(b"x")
    problems = verify_snapshot(snapshot).problems
    assert [p.split(":")[0] for p in problems] == ["model.safetensors", "tokenizer.json", "extra.bin"]
    with pytest.raises(VerifyError, match=r"and 2 more problem"):
        verify_or_raise(snapshot)


def test_not_a_directory(tmp_path):
    assert verify_snapshot(tmp_path / "nope").problems == [f"{tmp_path / 'nope'}: missing"]
    with pytest.raises(VerifyError) as info:  # a deleted snapshot is missing, not damaged
        verify_or_raise(tmp_path / "nope")
    assert str(info.value) == (f"{tmp_path / 'nope'} is missing: there is no such directory; give the directory of "
                               "a published snapshot (or verify by id with --db)")


def test_a_plain_checkpoint_is_not_a_snapshot_rather_than_damaged(tiny_family):
    with pytest.raises(VerifyError, match="is not a MergePipe snapshot") as info:
        verify_or_raise(tiny_family["base"])
    assert "damaged" not in str(info.value) and "\n" not in str(info.value)


def as_schema_1(snapshot):
    """Rewrite the manifest as a MergePipe before schema 2 wrote it: sha256 file hashes (hashlib's), the
    snapshot id and manifest hash that follow from them."""
    def change(data):
        data["schema"] = 1
        for entry in data["files"]:
            entry.pop("blake3")
            entry["sha256"] = hashlib.sha256((snapshot / entry["name"]).read_bytes()).hexdigest()
        data["snapshot_id"] = snapshot_id_for(data["plan_digest"], Manifest.from_json(data).files)

    edit_manifest(snapshot, change, rehash=True)


def test_a_schema_1_snapshot_verifies_by_its_sha256_hashes(snapshot):
    as_schema_1(snapshot)
    report = verify_or_raise(snapshot)
    assert report.manifest.schema == 1 and report.files_checked == 3
    flip_byte(snapshot)
    problems = verify_snapshot(snapshot).problems
    assert len(problems) == 1 and re.match(r"^model\.safetensors: sha256 [0-9a-f]{64} differs from manifest "
                                           r"[0-9a-f]{64}$", problems[0]), problems
