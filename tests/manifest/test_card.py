"""The model card a snapshot gets: written from the manifest, checked by verify, enough to redo the merge."""

from __future__ import annotations

import re
import shutil

import yaml

from mergepipe.txn.verify import verify_snapshot
from tests.fixtures.cli import invoke, wide_runner
from tests.planner.support import build_catalog


def test_the_card_describes_the_snapshot_and_reproduces_it(tiny_family, tmp_path, monkeypatch):
    base = tmp_path / "base"
    shutil.copytree(tiny_family["base"], base)
    (base / "README.md").write_text("# the base's own card\n")
    models = {"base": base, "e1": tiny_family["e1"], "e2": tiny_family["e2"]}
    db = build_catalog(tmp_path / "c.db", 2048, models)
    runner = wide_runner(monkeypatch)
    invoke(runner, ["merge", "--db", db, "--base", "base", "--experts", "e1", "e2", "--operator", "ties",
                    "--density", "0.4", "--weights", "0.7", "0.3", "--budget", "60%", "--seed", "3",
                    "--out", tmp_path / "m", "--model-id", "m", "--no-progress"])
    card = (tmp_path / "m" / "README.md").read_text()
    manifest = verify_snapshot(tmp_path / "m").manifest
    assert "the base's own card" not in card
    for text in (manifest.snapshot_id, manifest.manifest_hash, "`e1`", "`e2`", "ties, seed 3", "base_model: base"):
        assert text in card, text
    assert verify_snapshot(tmp_path / "m").ok

    # the card shows mergepipe_config.yml; rerun from that file against a fresh catalog of the same inputs, it
    # gives the same plan (the budget as written, "60%"), so the same snapshot
    config_text = (tmp_path / "m" / "mergepipe_config.yml").read_text()
    shown = re.search(r"```yaml\n(.*?)```", card, re.S).group(1)
    assert yaml.safe_load(shown) == yaml.safe_load(config_text)
    config = yaml.safe_load(config_text)
    assert config["merge_method"] == "ties" and config["base_model"] == "base@1"
    assert config["models"] == [{"model": "e1@1", "parameters": {"weight": 0.7}},
                                {"model": "e2@1", "parameters": {"weight": 0.3}}]
    assert config["parameters"] == {"density": 0.4}
    assert config["dtype"] == "float32" and "out_dtype" not in config  # computed in float32, written as the base
    assert config["mergepipe"] == {"budget": "60%", "policy": "energy", "seed": 3, "block_bytes": 2048,
                                   "model_id": "m", "out_dtype": "base"}
    command = re.search(r"\n(mergepipe merge .*?)\n```", card, re.S).group(1).split()[2:]
    fresh = build_catalog(tmp_path / "fresh.db", 2048, models)
    args = [str(fresh) if a == "CATALOG" else str(tmp_path / "again") if a == "DIR" else
            str(tmp_path / "m" / a) if a == "mergepipe_config.yml" else a for a in command]
    invoke(runner, ["merge", *args, "--no-progress"])
    again = verify_snapshot(tmp_path / "again").manifest
    assert again.reads == manifest.reads and again.operator == manifest.operator
    assert again.snapshot_id == manifest.snapshot_id
    weights = [(tmp_path / d / "model.safetensors").read_bytes() for d in ("again", "m")]
    assert weights[0] == weights[1]

    # an edited card is reported like an edited file
    target = tmp_path / "m" / "README.md"
    target.chmod(0o644)
    target.write_text(card.replace("ties", "TIES"))
    report = verify_snapshot(tmp_path / "m")
    assert not report.ok and any("README.md: differs from the one the manifest describes" in p for p in report.problems)


def test_a_card_an_earlier_mergepipe_wrote_is_checked_for_naming_its_snapshot_and_said_so(tiny_family, tmp_path,
                                                                                           monkeypatch):
    import json

    from mergepipe.manifest.manifest import MANIFEST_FILENAME, Manifest
    from mergepipe.spec.canonical import canonical_json
    from tests.fixtures.checkpoints import make_writable_tree

    db = build_catalog(tmp_path / "c.db", 2048, {n: tiny_family[n] for n in ("base", "e1")})
    runner = wide_runner(monkeypatch)
    out = tmp_path / "m"
    invoke(runner, ["merge", "--db", db, "--base", "base", "--experts", "e1", "--operator", "avg", "--out", out,
                    "--model-id", "m", "--no-progress"])
    manifest = verify_snapshot(out).manifest
    assert manifest.extra["card_format"] == 2
    # as a MergePipe before the card format was recorded wrote it: no card_format (the manifest resealed), and
    # a card and config file of another text, each naming the snapshot
    make_writable_tree(out)
    data = json.loads((out / MANIFEST_FILENAME).read_bytes())
    del data["extra"]["card_format"]
    data["manifest_hash"] = Manifest.from_json(data).manifest_hash
    (out / MANIFEST_FILENAME).write_bytes(canonical_json(data))
    card, config = (out / "README.md").read_text(), (out / "mergepipe_config.yml").read_text()
    (out / "README.md").write_text(card.replace("base_model_relation: merge\n", ""))
    (out / "mergepipe_config.yml").write_text(config.replace("dtype: float32\n", ""))
    report = verify_snapshot(out)
    assert report.ok, report.problems
    assert report.derived_checked == ["README.md", "mergepipe_config.yml"]
    assert report.notes == ["README.md and mergepipe_config.yml: written by an earlier MergePipe (card format 1, "
                            "this one writes 2), so checked only for naming the snapshot"]
    assert invoke(runner, ["verify", out]).splitlines()[-1] == f"note: {report.notes[0]}"

    # one that does not name the snapshot is still damage
    (out / "README.md").write_text(card.replace(manifest.snapshot_id, "snap-0000000000000000"))
    report = verify_snapshot(out)
    assert report.problems == [f"README.md: does not name snapshot {manifest.snapshot_id}; it was edited or belongs "
                               "to another snapshot"]

    # `rm` takes the earlier card and config file for MergePipe's own, and leaves nothing behind
    (out / "README.md").write_text(card.replace("base_model_relation: merge\n", ""))
    invoke(runner, ["rm", "--db", db, out])
    assert not out.exists()
