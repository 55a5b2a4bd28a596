"""The catalog's schema: an ordered registry of forward migrations (never edit a released one: append one);
``{int64}``, ``{float64}`` and ``{without_rowid}`` are filled in by the dialect.
"""

from __future__ import annotations

from typing import NamedTuple

#: Value of ``meta.magic``: how a MergePipe catalog recognises itself.
CATALOG_MAGIC = "mergepipe-catalog"


class Migration(NamedTuple):
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

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "initial schema: models, files, tensors, blocks, analyses, plans, snapshots", _INITIAL),
    Migration(2, "models.content_fingerprint", ("ALTER TABLE models ADD COLUMN content_fingerprint TEXT",)),
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
    Migration(9, "remote file ETags", ("ALTER TABLE files ADD COLUMN etag TEXT",)),
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
    Migration(13, "removed snapshot locations", ("ALTER TABLE snapshot_locations ADD COLUMN removed_at TEXT",)),
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
    Migration(17, "output block drift", ("ALTER TABLE output_blocks ADD COLUMN drift REAL",)),
    Migration(18, "published file stamps", ("ALTER TABLE snapshot_locations ADD COLUMN stamps TEXT",)),
    Migration(19, "models.side_files", ("ALTER TABLE models ADD COLUMN side_files TEXT",)),
)
