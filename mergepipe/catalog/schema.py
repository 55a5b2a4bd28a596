"""The catalog's schema as an ordered list of forward migrations.

``Database`` applies every migration above the stored ``schema_version`` in
one write transaction, bumping ``meta.schema_version`` after each, so a
catalog is never left between versions. Never edit a released migration:
append a new one. Statements are written with ``{int64}``, ``{float64}``
and ``{without_rowid}`` tokens that the dialect fills in (``dialect.ddl``).

Layout notes:

* Child tables are ``WITHOUT ROWID`` with the parent key as primary-key
  prefix, so "all blocks of model m" is one index range scan and cascading
  deletes (re-registering with ``--force``) need no extra index.
* Byte offsets are absolute file offsets (``byte_begin``/``byte_end``:
  ``begin``/``end`` are SQL keywords).
* ``blocks.hash`` stays NULL until ``analyze`` hashes the model.
* ``block_deltas`` / ``tensor_stats`` hang off ``analyses``: one row there
  means the (expert, base) pair is completely recorded, because all three are
  written in one transaction.
* ``snapshots.model_id`` has no foreign key: the output model is registered
  only when the snapshot commits. At most one live (pending or committed)
  snapshot may target a model id.
* ``models.delta_base``: the base a model of kind ``delta`` was taken
  against (NULL for every other kind); a base with deltas cannot be deleted.
* ``snapshot_locations``: every directory a committed snapshot's bytes were
  published to, with the intents that put them there. The first is where its
  merge published it (same intent id); re-executing the plan adds another
  (the same bytes, checked). For a committed snapshot, ``snapshots.out_path``
  is its *current* location, always equal to its model's ``uri``. A location
  whose directory ``mergepipe rm`` deleted stays, with ``removed_at`` set.
* ``snapshot_aliases``: the locations that publish their snapshot as another
  model id (the same merge asked for under a second id). That model is a row
  of ``models`` like any snapshot's (its ``uri`` the alias's current
  location), whose one parent is the snapshot's own model, role
  ``same snapshot``.
* ``hub_locations``: the Hugging Face Hub commits a committed snapshot was
  pushed to (``mergepipe push``), apart from ``snapshot_locations``: they are
  not directories, and nothing removes or recovers them.
* ``evaluations``: keyed by content (a plan digest, a model's content
  fingerprint), not by model id, so no foreign key: ``gc`` and ``rm`` leave
  them, and they apply again to whatever has that content later.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Value of ``meta.magic``: how a MergePipe catalog recognises itself.
CATALOG_MAGIC = "mergepipe-catalog"


@dataclass(frozen=True)
class Migration:
    """One step of the schema: ``statements`` run in order, in one transaction."""

    version: int
    description: str
    statements: tuple[str, ...]


_INITIAL = (
    """
    CREATE TABLE meta (
        key   TEXT PRIMARY KEY,
        value TEXT NOT NULL
    ) {without_rowid}
    """,
    """
    CREATE TABLE models (
        id           TEXT PRIMARY KEY,
        uri          TEXT NOT NULL,
        kind         TEXT NOT NULL CHECK (kind IN ('checkpoint', 'snapshot')),
        fingerprint  TEXT NOT NULL,
        architecture TEXT,
        num_layers   {int64},
        total_bytes  {int64} NOT NULL,
        n_tensors    {int64} NOT NULL,
        n_blocks     {int64} NOT NULL,
        created_at   TEXT NOT NULL
    ) {without_rowid}
    """,
    """
    CREATE TABLE model_parents (
        model_id  TEXT NOT NULL REFERENCES models(id) ON DELETE CASCADE,
        position  {int64} NOT NULL,
        parent_id TEXT NOT NULL REFERENCES models(id),
        role      TEXT NOT NULL CHECK (role IN ('base', 'expert')),
        PRIMARY KEY (model_id, position)
    ) {without_rowid}
    """,
    "CREATE INDEX model_parents_by_parent ON model_parents(parent_id)",
    """
    CREATE TABLE files (
        model_id      TEXT NOT NULL REFERENCES models(id) ON DELETE CASCADE,
        name          TEXT NOT NULL,
        position      {int64} NOT NULL,
        size          {int64} NOT NULL,
        mtime_ns      {int64} NOT NULL,
        header_sha256 TEXT NOT NULL,
        PRIMARY KEY (model_id, name)
    ) {without_rowid}
    """,
    """
    CREATE TABLE tensors (
        model_id   TEXT NOT NULL,
        name       TEXT NOT NULL,
        file       TEXT NOT NULL,
        dtype      TEXT NOT NULL,
        shape      TEXT NOT NULL,
        byte_begin {int64} NOT NULL,
        byte_end   {int64} NOT NULL,
        ordinal    {int64} NOT NULL,
        PRIMARY KEY (model_id, name),
        FOREIGN KEY (model_id, file) REFERENCES files(model_id, name) ON DELETE CASCADE
    ) {without_rowid}
    """,
    "CREATE UNIQUE INDEX tensors_by_ordinal ON tensors(model_id, ordinal)",
    "CREATE INDEX tensors_by_file ON tensors(model_id, file)",
    """
    CREATE TABLE blocks (
        model_id   TEXT NOT NULL,
        tensor     TEXT NOT NULL,
        idx        {int64} NOT NULL,
        row_start  {int64} NOT NULL,
        row_end    {int64} NOT NULL,
        byte_begin {int64} NOT NULL,
        byte_end   {int64} NOT NULL,
        hash       TEXT,
        PRIMARY KEY (model_id, tensor, idx),
        FOREIGN KEY (model_id, tensor) REFERENCES tensors(model_id, name) ON DELETE CASCADE
    ) {without_rowid}
    """,
    """
    CREATE TABLE analyses (
        expert_id   TEXT NOT NULL REFERENCES models(id) ON DELETE CASCADE,
        base_id     TEXT NOT NULL REFERENCES models(id) ON DELETE CASCADE,
        analyzed_at TEXT NOT NULL,
        PRIMARY KEY (expert_id, base_id)
    ) {without_rowid}
    """,
    "CREATE INDEX analyses_by_base ON analyses(base_id)",
    """
    CREATE TABLE block_deltas (
        expert_id TEXT NOT NULL,
        base_id   TEXT NOT NULL,
        tensor    TEXT NOT NULL,
        idx       {int64} NOT NULL,
        l2        {float64},
        maxabs    {float64},
        nnz       {int64},
        identical {int64} NOT NULL CHECK (identical IN (0, 1)),
        PRIMARY KEY (expert_id, base_id, tensor, idx),
        FOREIGN KEY (expert_id, base_id) REFERENCES analyses(expert_id, base_id) ON DELETE CASCADE
    ) {without_rowid}
    """,
    """
    CREATE TABLE tensor_stats (
        expert_id  TEXT NOT NULL,
        base_id    TEXT NOT NULL,
        tensor     TEXT NOT NULL,
        numel      {int64} NOT NULL,
        mergeable  {int64} NOT NULL CHECK (mergeable IN (0, 1)),
        identical  {int64} NOT NULL CHECK (identical IN (0, 1)),
        thresholds TEXT,
        PRIMARY KEY (expert_id, base_id, tensor),
        FOREIGN KEY (expert_id, base_id) REFERENCES analyses(expert_id, base_id) ON DELETE CASCADE
    ) {without_rowid}
    """,
    """
    CREATE TABLE plans (
        id         TEXT PRIMARY KEY,
        json       TEXT NOT NULL,
        created_at TEXT NOT NULL
    ) {without_rowid}
    """,
    """
    CREATE TABLE snapshots (
        intent_id     TEXT PRIMARY KEY,
        id            TEXT UNIQUE,
        plan_id       TEXT NOT NULL REFERENCES plans(id),
        model_id      TEXT NOT NULL,
        out_path      TEXT NOT NULL,
        staging_path  TEXT NOT NULL,
        status        TEXT NOT NULL CHECK (status IN ('pending', 'committed', 'aborted')),
        manifest_hash TEXT,
        manifest      TEXT,
        created_at    TEXT NOT NULL,
        committed_at  TEXT,
        CHECK ((status = 'committed') = (id IS NOT NULL AND manifest_hash IS NOT NULL
                                         AND manifest IS NOT NULL AND committed_at IS NOT NULL))
    )
    """,
    "CREATE INDEX snapshots_by_status ON snapshots(status)",
    "CREATE INDEX snapshots_by_path ON snapshots(out_path)",
    "CREATE INDEX snapshots_by_plan ON snapshots(plan_id)",
    "CREATE UNIQUE INDEX snapshots_live_model ON snapshots(model_id) WHERE status != 'aborted'",
)

#: Every migration, in order. ``Catalog`` reads this at call time.
MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "initial schema: models, files, tensors, blocks, analyses, plans, snapshots", _INITIAL),
    # The content fingerprint (layout + every block hash), stored once all
    # blocks are hashed: plans, intents and commits compare it in O(1).
    Migration(2, "models.content_fingerprint", ("ALTER TABLE models ADD COLUMN content_fingerprint TEXT",)),
    # Delta stores (analysis/deltastore.py): an expert's delta entries, largest
    # first, in chunks, and sketch stages; one file per (expert, base), its
    # parts indexed here.
    Migration(
        3,
        "delta stores",
        (
            """
        CREATE TABLE delta_stores (
            expert_id  TEXT NOT NULL,
            base_id    TEXT NOT NULL,
            path       TEXT NOT NULL,
            file_size  {int64} NOT NULL,
            digest     TEXT NOT NULL,
            created_at TEXT NOT NULL,
            PRIMARY KEY (expert_id, base_id),
            FOREIGN KEY (expert_id, base_id) REFERENCES analyses(expert_id, base_id) ON DELETE CASCADE
        ) {without_rowid}
        """,
            """
        CREATE TABLE delta_chunks (
            expert_id  TEXT NOT NULL,
            base_id    TEXT NOT NULL,
            tensor     TEXT NOT NULL,
            idx        {int64} NOT NULL,
            byte_begin {int64} NOT NULL,
            byte_end   {int64} NOT NULL,
            entries    {int64} NOT NULL,
            gap_bytes  {int64} NOT NULL,
            energy     {float64} NOT NULL,
            hash       TEXT NOT NULL,
            PRIMARY KEY (expert_id, base_id, tensor, idx),
            FOREIGN KEY (expert_id, base_id) REFERENCES delta_stores(expert_id, base_id) ON DELETE CASCADE
        ) {without_rowid}
        """,
            """
        CREATE TABLE delta_stages (
            expert_id  TEXT NOT NULL,
            base_id    TEXT NOT NULL,
            tensor     TEXT NOT NULL,
            stage      {int64} NOT NULL,
            byte_begin {int64} NOT NULL,
            byte_end   {int64} NOT NULL,
            rows       {int64} NOT NULL,
            residual   {float64} NOT NULL,
            norm       {float64} NOT NULL,
            hash       TEXT NOT NULL,
            PRIMARY KEY (expert_id, base_id, tensor, stage),
            FOREIGN KEY (expert_id, base_id) REFERENCES delta_stores(expert_id, base_id) ON DELETE CASCADE
        ) {without_rowid}
        """,
        ),
    ),
    # Versions (issue 11): a model id names a family of versions. Version 1
    # keeps the plain id ("math"), later ones get "math@2", "math@3"; a bare
    # name means the latest version (catalog/models.py, ``resolve``).
    Migration(
        4,
        "model versions",
        (
            "ALTER TABLE models ADD COLUMN name TEXT",
            "ALTER TABLE models ADD COLUMN version {int64} NOT NULL DEFAULT 1",
            "UPDATE models SET name = id",
            "CREATE UNIQUE INDEX models_by_version ON models(name, version)",
        ),
    ),
    # Output provenance (issue 11, analysis/provenance.py): per output block
    # of a snapshot, the key of what decided its bytes and the blake3 of them,
    # so a later merge can reuse the block (checked) instead of recomputing it;
    # an upper bound on the norm of its values where merged (NULL otherwise),
    # which bounds the rounding a delta update of the block inherits; and the bound on how far
    # the block may be from the from-scratch merge (0 unless delta-updated).
    Migration(
        5,
        "snapshot output blocks",
        (
            """
        CREATE TABLE output_blocks (
            model_id TEXT NOT NULL REFERENCES models(id) ON DELETE CASCADE,
            tensor   TEXT NOT NULL,
            idx      {int64} NOT NULL,
            key      TEXT NOT NULL,
            hash     TEXT NOT NULL,
            l2       REAL,
            error    REAL NOT NULL,
            PRIMARY KEY (model_id, tensor, idx)
        ) {without_rowid}
        """,
        ),
    ),
    # Re-runs (issue 12): a plan executed again gives the same snapshot at another location. A location
    # is recorded like a snapshot intent (pending -> committed | aborted) so that a crash mid-way is
    # recovered the same way; only committed rows are locations, one per (snapshot, path). Existing
    # snapshots get their publish directory as their first location (same intent id).
    Migration(
        6,
        "snapshot locations",
        (
            """
        CREATE TABLE snapshot_locations (
            intent_id    TEXT PRIMARY KEY,
            snapshot_id  TEXT NOT NULL REFERENCES snapshots(id),
            path         TEXT NOT NULL,
            staging_path TEXT NOT NULL,
            status       TEXT NOT NULL CHECK (status IN ('pending', 'committed', 'aborted')),
            created_at   TEXT NOT NULL,
            committed_at TEXT,
            CHECK ((status = 'committed') = (committed_at IS NOT NULL))
        ) {without_rowid}
        """,
            "CREATE INDEX snapshot_locations_by_snapshot ON snapshot_locations(snapshot_id)",
            "CREATE INDEX snapshot_locations_by_status ON snapshot_locations(status)",
            "CREATE UNIQUE INDEX snapshot_locations_one_per_path ON snapshot_locations(snapshot_id, path) "
            "WHERE status = 'committed'",
            """
        INSERT INTO snapshot_locations
            (intent_id, snapshot_id, path, staging_path, status, created_at, committed_at)
        SELECT intent_id, id, out_path, staging_path, 'committed', created_at, committed_at
        FROM snapshots WHERE status = 'committed'
        """,
        ),
    ),
    # Delta checkpoints (issue 13, analysis/delta_checkpoint.py): a model of kind 'delta' holds
    # Δ = E − B against one base, named by ``delta_base``. A CHECK cannot be altered in place, so the
    # kind column is rebuilt (add, copy, drop, rename: portable SQL, no table rebuild, so no row of a
    # child table is touched); existing models keep their kind, and get no base. A PEFT LoRA adapter
    # (kind 'lora', analysis/lora_expert.py) names its base the same way (added before 7 was released).
    Migration(
        7,
        "delta checkpoints",
        (
            "ALTER TABLE models ADD COLUMN kind_v7 TEXT NOT NULL DEFAULT 'checkpoint' "
            "CHECK (kind_v7 IN ('checkpoint', 'snapshot', 'delta', 'lora'))",
            "UPDATE models SET kind_v7 = kind",
            "ALTER TABLE models DROP COLUMN kind",
            "ALTER TABLE models RENAME COLUMN kind_v7 TO kind",
            "ALTER TABLE models ADD COLUMN delta_base TEXT REFERENCES models(id)",
            "CREATE INDEX models_by_delta_base ON models(delta_base)",
        ),
    ),
    # Measured rates (issue 14): per machine key, each rate of the former cost model as `mergepipe calibrate`
    # measured it and merges refined it since (``samples``: how many merges moved it). Dropped by migration 11.
    Migration(
        8,
        "measured rates",
        (
            """
        CREATE TABLE rates (
            machine    TEXT NOT NULL,
            name       TEXT NOT NULL,
            value      {float64} NOT NULL CHECK (value > 0),
            samples    {int64} NOT NULL,
            updated_at TEXT NOT NULL,
            PRIMARY KEY (machine, name)
        ) {without_rowid}
        """,
        ),
    ),
    # Experts in object storage (issue 15, storage/remote.py): a remote weight file's ETag as the server gave it
    # at registration, compared before any read (NULL for local files, whose size and mtime are compared).
    Migration(9, "remote file ETags", ("ALTER TABLE files ADD COLUMN etag TEXT",)),
    # ``steal`` (the former cost model's compute lost per byte read and written beside it) is a rate that may
    # be 0: the value's CHECK becomes >= 0, rebuilt as in migration 7.
    Migration(
        10,
        "rates may be zero",
        (
            "ALTER TABLE rates ADD COLUMN value_v10 {float64} NOT NULL DEFAULT 0 CHECK (value_v10 >= 0)",
            "UPDATE rates SET value_v10 = value",
            "ALTER TABLE rates DROP COLUMN value",
            "ALTER TABLE rates RENAME COLUMN value_v10 TO value",
        ),
    ),
    # Seconds from history (spec/time_model.py) replace the calibrated rates: per host (hostname, CPU count) the
    # read rate each analysis saw, per device the kernel probes (engine/probe.py) and every merge's bytes and
    # seconds (the publish intent that ran it), which the time model is fitted to.
    Migration(
        11,
        "timings from history",
        (
            """
        CREATE TABLE analyze_reads (
            id          TEXT PRIMARY KEY,
            host        TEXT NOT NULL,
            recorded_at TEXT NOT NULL,
            bytes_read  {int64} NOT NULL CHECK (bytes_read > 0),
            seconds     {float64} NOT NULL CHECK (seconds > 0)
        ) {without_rowid}
        """,
            "CREATE INDEX analyze_reads_by_host ON analyze_reads(host, recorded_at)",
            """
        CREATE TABLE kernel_probes (
            host                TEXT NOT NULL,
            device              TEXT NOT NULL,
            operator            TEXT NOT NULL,
            seconds_per_element {float64} NOT NULL CHECK (seconds_per_element > 0),
            recorded_at         TEXT NOT NULL,
            PRIMARY KEY (host, device, operator)
        ) {without_rowid}
        """,
            """
        CREATE TABLE merge_timings (
            intent_id    TEXT PRIMARY KEY,
            host         TEXT NOT NULL,
            device       TEXT NOT NULL,
            operator     TEXT NOT NULL,
            expert_bytes {int64} NOT NULL CHECK (expert_bytes >= 0),
            output_bytes {int64} NOT NULL CHECK (output_bytes >= 0),
            seconds      {float64} NOT NULL CHECK (seconds > 0),
            recorded_at  TEXT NOT NULL
        ) {without_rowid}
        """,
            "CREATE INDEX merge_timings_by_machine ON merge_timings(host, device, operator, recorded_at)",
            "DROP TABLE rates",
        ),
    ),
    # Aliases (the same merge published under another model id): a location of a snapshot may publish it
    # as another model, registered at that location with the snapshot's files, tensors and blocks and
    # with the snapshot's own model as its one parent (role 'same snapshot', which is how an alias finds
    # its snapshot). A row here says which location intent publishes which model (read when it commits,
    # also by `recover`); the role's CHECK is rebuilt as in migration 7.
    Migration(
        12,
        "snapshot aliases",
        (
            """
        CREATE TABLE snapshot_aliases (
            intent_id TEXT PRIMARY KEY REFERENCES snapshot_locations(intent_id),
            model_id  TEXT NOT NULL
        ) {without_rowid}
        """,
            "CREATE INDEX snapshot_aliases_by_model ON snapshot_aliases(model_id)",
            "ALTER TABLE model_parents ADD COLUMN role_v12 TEXT NOT NULL DEFAULT 'base' "
            "CHECK (role_v12 IN ('base', 'expert', 'same snapshot'))",
            "UPDATE model_parents SET role_v12 = role",
            "ALTER TABLE model_parents DROP COLUMN role",
            "ALTER TABLE model_parents RENAME COLUMN role_v12 TO role",
        ),
    ),
    # `mergepipe rm` (app/maintenance.py) deletes a snapshot's directory but keeps its rows: the snapshot stays
    # for lineage, and executing its plan re-materialises it. The location records when its directory was removed.
    Migration(13, "removed snapshot locations", ("ALTER TABLE snapshot_locations ADD COLUMN removed_at TEXT",)),
    # `mergepipe push` (app/publishing.py): the Hugging Face Hub commits holding a snapshot's files. Not rows of
    # snapshot_locations, whose paths are directories that `rm`, `recover` and `verify` act on; one row per
    # (snapshot, repository, commit): pushing the same files again makes no new commit, and records nothing new.
    Migration(
        14,
        "snapshot Hub locations",
        (
            """
        CREATE TABLE hub_locations (
            snapshot_id TEXT NOT NULL REFERENCES snapshots(id),
            repo_id     TEXT NOT NULL,
            revision    TEXT NOT NULL,
            commit_sha  TEXT NOT NULL,
            private     {int64} NOT NULL CHECK (private IN (0, 1)),
            pushed_at   TEXT NOT NULL,
            PRIMARY KEY (snapshot_id, repo_id, commit_sha)
        ) {without_rowid}
        """,
        ),
    ),
    # Evaluations (issue 37, catalog/evaluations.py): what a model scored on some data. The subject is
    # content-derived, so rows stay true whatever is collected or removed: a merge's plan digest (the same plan
    # gives the same bytes, so evaluating a plan in memory and its snapshot share rows), a registered model's
    # content fingerprint, or the digest of a tensor-level mix `bisect` probes (its two merges and the tensors
    # taken). One row per (subject, data, metric): evaluating again replaces it. ``value`` NULL is NaN (SQLite
    # stores a NaN as NULL); ``tokens`` the tokens scored, where the metric counts them.
    Migration(
        15,
        "evaluations",
        (
            """
        CREATE TABLE evaluations (
            subject      TEXT NOT NULL,
            subject_kind TEXT NOT NULL CHECK (subject_kind IN ('plan', 'model', 'hybrid')),
            data_digest  TEXT NOT NULL,
            data_name    TEXT NOT NULL,
            metric       TEXT NOT NULL,
            value        {float64},
            tokens       {int64},
            versions     TEXT NOT NULL,
            device       TEXT NOT NULL,
            seconds      {float64} NOT NULL,
            created_at   TEXT NOT NULL,
            PRIMARY KEY (subject, data_digest, metric)
        ) {without_rowid}
        """,
        ),
    ),
    # `mergepipe search` (app/searching.py): which study and trial a published snapshot is the best of. The
    # study itself is Optuna's, in its own tables of the same file; this row is what explain and lineage show.
    Migration(
        16,
        "search results",
        (
            """
        CREATE TABLE searches (
            snapshot_id   TEXT NOT NULL REFERENCES snapshots(id),
            study         TEXT NOT NULL,
            trial         {int64} NOT NULL,
            trials        {int64} NOT NULL,
            objective     {float64} NOT NULL,
            params        TEXT NOT NULL,
            search_budget TEXT NOT NULL,
            created_at    TEXT NOT NULL,
            PRIMARY KEY (snapshot_id, study, trial)
        ) {without_rowid}
        """,
        ),
    ),
    # Measured rounding (issue 41, planner/delta_update.py): per output block of a fixed-coefficient merge,
    # a bound on the Frobenius distance between the block as written and the fp32 values a from-scratch merge
    # computes for it, measured when the block was written (NULL: not measured; blocks of older snapshots,
    # operators a delta update cannot use). A later delta update of the block starts from it, which gives
    # its a-posteriori bound.
    Migration(17, "output block drift", ("ALTER TABLE output_blocks ADD COLUMN drift REAL",)),
    # `mergepipe rm` (app/maintenance.py) deletes a published file without reading it when it is still the inode
    # MergePipe wrote, unchanged since: per location, each manifest file's inode, mtime, ctime (ns) and size as
    # published (JSON, ``SnapshotStore.stamps``; NULL for locations published before: their files are hashed).
    Migration(18, "published file stamps", ("ALTER TABLE snapshot_locations ADD COLUMN stamps TEXT",)),
    # A model's side files (issue 52): the canonical JSON of the records (size, time, ETag, sha256) of what a merge
    # copies from it as its base, part of what a version is (NULL: registered before; ModelRecord.side_files).
    Migration(19, "models.side_files", ("ALTER TABLE models ADD COLUMN side_files TEXT",)),
)
