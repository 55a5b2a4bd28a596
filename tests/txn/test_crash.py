"""Crash safety: a publish killed at every step leaves no partial output, and
``recover`` then commits or aborts it, idempotently; the merge can be redone.

Each case runs a real child process that SIGKILLs itself (or ``os._exit``s)
at one publish step. The children run concurrently, once per module, to keep
the suite fast; each test then inspects and recovers its own catalog.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mergepipe.catalog.db import Catalog
from mergepipe.txn import recover, verify_snapshot
from tests.txn.conftest import catalog_parents, make_catalog
from tests.txn.helpers import finish_snapshot, publish_snapshot, write_checkpoint

REPO = Path(__file__).resolve().parents[2]

# (step, how): SIGKILL at every step, plus os._exit where the brief pins it.
CASES = [("staged", "sigkill"), ("written", "sigkill"), ("fsynced", "sigkill"), ("renamed", "sigkill"),
         ("committed", "sigkill"), ("written", "exit"), ("renamed", "exit")]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """One catalog per case, each with a child killed at its step; case -> root dir."""
    roots, children = {}, {}
    for step, how in CASES:
        root = tmp_path_factory.mktemp(f"crash-{step}-{how}")
        make_catalog(root).close()
        (root / "snapshots").mkdir()
        roots[step, how] = root
        children[step, how] = subprocess.Popen(
            [sys.executable, "-m", "tests.txn.crash_child", str(root / "catalog.db"),
             str(root / "snapshots" / "merged"), "merged", step, how],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    for case, child in children.items():
        _, stderr = child.communicate(timeout=120)
        assert child.returncode in (-signal.SIGKILL, 9), f"{case}: rc={child.returncode}\n{stderr}"
    return roots


def expected_hash(root: Path, model_id: str, parents) -> str:
    scratch = root / "scratch"
    write_checkpoint(scratch, seed=1)
    return finish_snapshot(scratch, model_id, parents=parents).manifest_hash


def staging_dirs(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".mergepipe-staging-" in p.name)


@pytest.mark.parametrize(("step", "how"), CASES, ids=[f"{s}-{h}" for s, h in CASES])
def test_killed_publish_is_all_or_nothing_and_recoverable(crashed, step, how):
    root = crashed[step, how]
    out_dir, out = root / "snapshots", root / "snapshots" / "merged"
    with Catalog.open(root / "catalog.db") as catalog:
        parents = catalog_parents(catalog)
        want = expected_hash(root, "merged", parents)

        # never partial: absent, or a complete snapshot that verifies
        published = step in ("renamed", "committed")
        assert out.exists() == published
        if published:
            assert verify_snapshot(out).ok and verify_snapshot(out).manifest.manifest_hash == want
        assert len(staging_dirs(out_dir)) == (0 if published else 1)
        (intent,) = catalog.list_snapshots()
        assert intent.status == ("committed" if step == "committed" else "pending")

        report = recover(catalog)
        assert report.busy == [] and report.problems == []
        (intent,) = catalog.list_snapshots()
        if published:
            assert report.aborted == [] and report.removed == []
            assert intent.status == "committed" and intent.manifest_hash == want
            assert report.committed == ([] if step == "committed" else [intent.id])
            assert catalog.parents("merged") == [("base", "base"), ("e1", "expert")]
        else:
            assert report.committed == [] and report.aborted == [intent.intent_id]
            assert intent.status == "aborted"
            assert [p.name for p in report.removed] == [Path(intent.staging_path).name]
        assert staging_dirs(out_dir) == [] and catalog.pending_snapshots() == []

        again = recover(catalog)  # idempotent
        assert not again.changed and again.problems == [] and catalog.list_snapshots() == [intent]

        if not published:  # the same merge then succeeds, with the same manifest hash
            manifest = publish_snapshot(catalog, out, "merged", parents)
            assert manifest.manifest_hash == want and verify_snapshot(out).ok
            assert catalog.get_snapshot(manifest.snapshot_id).status == "committed"
