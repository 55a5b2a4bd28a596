"""Crash safety: a publish killed at every step leaves no partial output, and
``recover`` then commits or aborts it, idempotently; the merge can be redone.

Each case forks a child process that publishes against its own catalog
connection and SIGKILLs itself (or ``os._exit``s, skipping every cleanup
handler) at one publish step. Forking rather than starting a new interpreter
keeps each case to milliseconds; the child dies exactly as a killed merge would.
Every case runs on a SQLite file and on a PostgreSQL catalog (recovered there
from another process once the server has seen the killed one's connection end).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from mergepipe.catalog import Catalog
from mergepipe.txn.recover import recover
from mergepipe.txn.verify import verify_snapshot
from tests.fixtures.postgres import postgres_server, postgres_url  # noqa: F401 (fixtures)
from tests.txn.conftest import catalog_parents, make_catalog
from tests.txn.helpers import finish_snapshot, publish_snapshot, write_checkpoint

# (step, how): SIGKILL at every step, plus os._exit where the brief pins it.
CASES = [("staged", "sigkill"), ("written", "sigkill"), ("fsynced", "sigkill"), ("renamed", "sigkill"),
         ("committed", "sigkill"), ("written", "exit"), ("renamed", "exit")]


def publish_and_die(db: Path, out: Path, model_id: str, step: str, how: str) -> int:
    """Fork; the child publishes and dies at ``step``. Returns the child's wait status."""
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        try:
            def die_at(name: str) -> None:
                if name == step:
                    if how == "exit":
                        os._exit(9)
                    os.kill(os.getpid(), signal.SIGKILL)

            catalog = Catalog.open(db)  # its own connection, opened after the fork
            publish_snapshot(catalog, out, model_id, catalog_parents(catalog), on_step=die_at)
        finally:
            os._exit(70)  # the step never fired, or the publish raised
    _, wait_status = os.waitpid(pid, 0)
    return wait_status


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog(request, tmp_path: Path):
    """The txn catalog as a file and as a PostgreSQL database: a server catalog is recovered the same way."""
    location = None if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    cat = make_catalog(tmp_path, location)
    yield cat
    cat.close()


def wait_until_owners_are_gone(catalog: Catalog) -> None:
    """A killed process's server connection ends a moment after the process (the server sees the socket
    close): only then is its intent free for ``recover``, which says 'busy' until it is."""
    deadline = time.monotonic() + 30
    while any(catalog.snapshots.owner_alive(i.intent_id) for i in catalog.snapshots.pending()):
        assert time.monotonic() < deadline, "the killed publisher's connection never ended"
        time.sleep(0.02)


def expected_hash(root: Path, model_id: str, parents) -> str:
    scratch = root / "scratch"
    write_checkpoint(scratch, seed=1)
    return finish_snapshot(scratch, model_id, parents=parents).manifest_hash


def staging_dirs(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".mergepipe-staging-" in p.name)


@pytest.mark.parametrize(("step", "how"), CASES, ids=[f"{s}-{h}" for s, h in CASES])
def test_killed_publish_is_all_or_nothing_and_recoverable(catalog, parents, tmp_path, step, how):
    out_dir, out = tmp_path / "snapshots", tmp_path / "snapshots" / "merged"
    out_dir.mkdir()
    wait_status = publish_and_die(catalog.path, out, "merged", step, how)
    if how == "sigkill":
        assert os.WIFSIGNALED(wait_status) and os.WTERMSIG(wait_status) == signal.SIGKILL
    else:
        assert os.WIFEXITED(wait_status) and os.WEXITSTATUS(wait_status) == 9
    want = expected_hash(tmp_path, "merged", parents)

    # never partial: absent, or a complete snapshot that verifies
    published = step in ("renamed", "committed")
    assert out.exists() == published
    if published:
        assert verify_snapshot(out).ok and verify_snapshot(out).manifest.manifest_hash == want
    assert len(staging_dirs(out_dir)) == (0 if published else 1)
    (intent,) = catalog.snapshots.list()
    assert intent.status == ("committed" if step == "committed" else "pending")

    wait_until_owners_are_gone(catalog)
    report = recover(catalog)
    assert report.busy == [] and report.problems == []
    (intent,) = catalog.snapshots.list()
    if published:
        assert report.aborted == [] and report.removed == []
        assert intent.status == "committed" and intent.manifest_hash == want
        assert report.committed == ([] if step == "committed" else [intent.id])
        assert catalog.models.parents("merged") == [("base", "base"), ("e1", "expert")]
    else:
        assert report.committed == [] and report.aborted == [intent.intent_id]
        assert intent.status == "aborted"
        assert [p.name for p in report.removed] == [Path(intent.staging_path).name]
    assert staging_dirs(out_dir) == [] and catalog.snapshots.pending() == []

    again = recover(catalog)  # idempotent
    assert not again.changed and again.problems == [] and catalog.snapshots.list() == [intent]

    if not published:  # the same merge then succeeds, with the same manifest hash
        manifest = publish_snapshot(catalog, out, "merged", parents)
        assert manifest.manifest_hash == want and verify_snapshot(out).ok
        assert catalog.snapshots.get(manifest.snapshot_id).status == "committed"
