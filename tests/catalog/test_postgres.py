"""What is PostgreSQL's own in a server catalog: column types and byte-order text, the write lock, retries,
intent owners across connections, and driver errors as one line. (Every store's behaviour is tested on both
backends by the rest of tests/catalog.)"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

import mergepipe.catalog.database as database_module
from mergepipe.catalog import Catalog, database as dialect
from mergepipe.catalog.database import Database
from mergepipe.catalog.database import ServerURL
from mergepipe.catalog.database import CONFLICT_RETRIES, WRITE_LOCK_KEY, PostgresDialect
from mergepipe.errors import CatalogError, StalePlanError
from tests.catalog.helpers import db_dump, raw_db


def columns(url: str, table: str) -> dict[str, tuple[str, str | None]]:
    """column -> (type, collation) as PostgreSQL's catalog reports them."""
    with raw_db(ServerURL(url)) as conn:
        rows = conn.execute("SELECT column_name, data_type, collation_name FROM information_schema.columns "
                            "WHERE table_name = ?", (table,))
    return {name: (kind, collation) for name, kind, collation in rows}


def test_integers_and_reals_are_eight_bytes_and_text_is_byte_ordered(postgres_url):
    Catalog.create(postgres_url).close()
    blocks, deltas, outputs = (columns(postgres_url, t) for t in ("blocks", "block_deltas", "output_blocks"))
    assert blocks["byte_end"][0] == blocks["idx"][0] == deltas["nnz"][0] == "bigint"
    assert deltas["l2"][0] == outputs["l2"][0] == outputs["error"][0] == "double precision"  # REAL there too
    assert blocks["tensor"] == blocks["model_id"] == ("text", "C")


def test_order_by_is_byte_order_under_a_language_collation(postgres_server):
    """Content fingerprints hash rows in ``ORDER BY`` order: a database whose default collation sorts 'a'
    before 'B' (ICU en-US) must still give SQLite's byte order."""
    url = postgres_server.new_database(collation="en-US")
    ids = ["B", "a", "_z", ".y", "Ä", "b"]
    with Catalog.create(url, clock=lambda: 0.0) as catalog:  # one timestamp: plans list by id alone
        for plan_id in ids:
            catalog.plans.save(plan_id, "{}")
        assert [p.id for p in catalog.plans.list()] == sorted(ids, key=lambda s: s.encode())
    with raw_db(ServerURL(url)) as conn:  # the database itself sorts otherwise
        assert conn.execute("SELECT 'a' < 'B'")[0][0] is True


def test_a_held_write_lock_makes_a_writer_wait_then_fail_in_one_line(postgres_url, monkeypatch):
    monkeypatch.setattr(dialect, "BUSY_TIMEOUT_SECONDS", 0.2)
    with Catalog.create(postgres_url) as catalog, psycopg.connect(postgres_url, autocommit=True) as holder:
        holder.execute("BEGIN")
        holder.execute(f"SELECT pg_advisory_xact_lock({WRITE_LOCK_KEY})")  # another process is writing
        assert catalog.plans.list() == []  # reading does not wait
        with pytest.raises(CatalogError, match="is locked: another mergepipe process held its write lock for "
                                               "more than 0.2 s") as info:
            catalog.plans.save("p1", "{}")
        assert "\n" not in str(info.value) and not catalog.in_transaction
        holder.execute("ROLLBACK")
        catalog.plans.save("p1", "{}")
        assert [p.id for p in catalog.plans.list()] == ["p1"]


def test_a_failed_transaction_releases_the_write_lock(postgres_url):
    with Catalog.create(postgres_url) as catalog:
        with pytest.raises(CatalogError, match="refused a change that conflicts"):
            with catalog.transaction():
                catalog.plans.save("p1", "{}")
                catalog._db.write("INSERT INTO meta (key, value) VALUES ('magic', 'twice')")
        with psycopg.connect(postgres_url, autocommit=True) as other:
            assert other.execute(f"SELECT pg_try_advisory_lock({WRITE_LOCK_KEY})").fetchone() == (True,)
        assert catalog.plans.list() == []


class _Conflicting:
    """A connection whose write lock fails with a deadlock the first ``failures`` times."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.statements: list[str] = []
        self.in_transaction = False

    def execute(self, sql: str, params=None):
        self.statements.append(sql)
        if sql.startswith("SELECT pg_advisory_xact_lock") and self.failures:
            self.failures -= 1
            raise psycopg.errors.DeadlockDetected("deadlock detected")
        self.in_transaction = sql == "BEGIN" or (self.in_transaction and sql not in ("COMMIT", "ROLLBACK"))
        return None

    def close(self) -> None:
        pass


def test_a_conflict_while_beginning_is_retried_a_bounded_number_of_times(monkeypatch):
    monkeypatch.setattr(database_module, "RETRY_PAUSE_SECONDS", 0.0)
    url = ServerURL("postgresql://u:secret@db.example:5432/team")
    conn = _Conflicting(failures=CONFLICT_RETRIES - 1)
    db = Database(conn, url, PostgresDialect())
    with db.transaction():
        pass
    assert conn.statements.count("BEGIN") == CONFLICT_RETRIES and conn.statements[-1] == "COMMIT"

    db = Database(_Conflicting(failures=CONFLICT_RETRIES), url, PostgresDialect())
    with pytest.raises(CatalogError) as info:
        with db.transaction():
            raise AssertionError("the body never runs")
    assert str(info.value) == ("catalog postgresql://u@db.example:5432/team: a concurrent transaction conflicted "
                               "with this one (deadlock detected); nothing was changed, retry")


@pytest.mark.parametrize("error, fragment", [
    (psycopg.errors.UniqueViolation("duplicate key value"), "refused a change that conflicts with its records"),
    (psycopg.errors.SerializationFailure("could not serialize"), "a concurrent transaction conflicted"),
    (psycopg.errors.LockNotAvailable("canceling statement due to lock timeout"), "is locked"),
    (psycopg.errors.DiskFull("could not extend file"), "the server's disk is full, nothing was changed"),
    (psycopg.errors.ReadOnlySqlTransaction("read-only"), "is read-only for this role"),
    (psycopg.errors.AdminShutdown("terminating connection\nDETAIL: x"), "cannot reach catalog"),
    (psycopg.errors.UndefinedTable('relation "x" does not exist'), 'relation "x" does not exist (a database error'),
])
def test_driver_errors_become_one_line_naming_the_url_without_password(error, fragment):
    text = str(PostgresDialect().translate(error, ServerURL("postgresql://ana:sesame@h:5/cat")))
    assert fragment in text and "postgresql://ana@h:5/cat" in text and "sesame" not in text and "\n" not in text


def test_an_intent_is_owned_while_its_process_is_connected(postgres_url, tmp_path: Path):
    with Catalog.create(postgres_url) as owner, Catalog.open(postgres_url) as other:
        owner.plans.save("p", '{"base": {"id": "b", "fingerprint": "x"}, "experts": []}')
        with pytest.raises(StalePlanError):  # no model 'b': the intent is refused, and not left claimed
            owner.snapshots.add_intent("i0", "p", owner.plans.get("p"), "m", tmp_path / "o", tmp_path / ".s")
        assert not other.snapshots.owner_alive("i0")
    before = db_dump(ServerURL(postgres_url))
    with Catalog.open(postgres_url) as owner:
        owner._db.claim("i1")
        with Catalog.open(postgres_url) as other:
            assert other.snapshots.owner_alive("i1") and not owner.snapshots.owner_alive("i1")
            assert other.snapshots.owner_alive("i1")  # asking takes nothing
    with Catalog.open(postgres_url) as other:  # the owner's connection ended: nobody holds it
        assert not other.snapshots.owner_alive("i1")
    assert db_dump(ServerURL(postgres_url)) == before


def test_the_catalog_says_its_sqlalchemy_url(tmp_path: Path, postgres_url):
    with Catalog.create(tmp_path / "c.db") as catalog:
        assert catalog.url == f"sqlite:///{tmp_path / 'c.db'}" and not catalog.shared
    with Catalog.create(postgres_url) as catalog:
        assert catalog.url == postgres_url.replace("postgresql://", "postgresql+psycopg://") and catalog.shared
        assert str(catalog.path) == postgres_url
    assert str(ServerURL("postgres://ana:sesame@h/cat?sslmode=require&password=x")) == \
        "postgresql://ana@h/cat?sslmode=require"


def test_a_database_with_other_tables_is_not_a_catalog(postgres_server):
    url = postgres_server.new_database()
    postgres_server.execute("CREATE TABLE people (name TEXT)", database=url.rsplit("/", 1)[1])
    for make in (Catalog.create, Catalog.open):
        with pytest.raises(CatalogError, match="is not a MergePipe catalog"):
            make(url)


def test_a_claim_given_up_inside_a_transaction_is_held_until_it_ends(postgres_url):
    """A commit that joins a caller's transaction (the engine's, with the merge's timing row) gives its intent up
    only once that transaction has committed: before, the intent is pending for everyone else."""
    with Catalog.create(postgres_url) as owner, Catalog.open(postgres_url) as other:
        owner._db.claim("i1")
        with owner.transaction():
            owner._db.release("i1")
            assert other.snapshots.owner_alive("i1")
        assert not other.snapshots.owner_alive("i1")
