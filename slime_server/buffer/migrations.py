"""The one schema of every store (trajectories, jobs, keys), as a list of versions, for both backends.

Why one list: version i means the same tables and columns on SQLite and PostgreSQL, so a schema
change is written once. Types and the few backend-only columns are named in braces and filled from
the dialect (``sql.Dialect.ddl``). Applied versions are recorded in ``schema_migrations``; a database
newer than this code is refused rather than misread. Every store runs ``migrate`` on open: it is one
read when the schema is current, and replicas starting together apply each version once.
"""

from __future__ import annotations

from typing import TypeVar

from slime_server.buffer.schema import StoreError, now
from slime_server.buffer.sql import Database, Tx

D = TypeVar("D", bound=Database)

# Each entry migrates the schema from version i to i + 1.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE sessions (
        id TEXT PRIMARY KEY,
        group_id TEXT,
        metadata TEXT NOT NULL,
        status TEXT NOT NULL,
        key_hash TEXT,
        segment_splits INTEGER NOT NULL DEFAULT 0,
        created_at {real} NOT NULL,
        updated_at {real} NOT NULL
    );
    CREATE TABLE trajectories (
        seq {serial},
        id TEXT NOT NULL UNIQUE,
        session_id TEXT NOT NULL REFERENCES sessions(id),
        segment INTEGER NOT NULL,
        branch INTEGER NOT NULL,
        group_id TEXT,
        n_tokens INTEGER NOT NULL,
        tokens {blob} NOT NULL,
        loss_mask {blob} NOT NULL,
        rollout_logprobs {blob} NOT NULL,
        weight_versions {blob} NOT NULL,
        turns TEXT NOT NULL,
        messages TEXT NOT NULL,
        tools_digest TEXT,
        reward {real},
        turn_rewards TEXT NOT NULL,
        status TEXT NOT NULL,
        consumed_step INTEGER,
        metadata TEXT NOT NULL,
        revision INTEGER NOT NULL,
        created_at {real} NOT NULL,
        updated_at {real} NOT NULL,
        UNIQUE (session_id, segment, branch)
    );
    CREATE INDEX trajectories_pick ON trajectories (status, consumed_step, seq);
    CREATE TABLE responses (
        seq {serial},
        response_id TEXT NOT NULL,
        choice INTEGER NOT NULL,
        session_id TEXT NOT NULL REFERENCES sessions(id),
        trajectory_id TEXT NOT NULL REFERENCES trajectories(id),
        UNIQUE (response_id, choice)
    );
    CREATE INDEX responses_session ON responses (session_id, seq);
    CREATE TABLE reward_events (
        seq {serial},
        idempotency_key TEXT NOT NULL UNIQUE,
        session_id TEXT NOT NULL REFERENCES sessions(id),
        reward {real},
        turn_rewards TEXT,
        created_at {real} NOT NULL
    );
    CREATE TABLE feedback (
        {feedback_seq}
        id TEXT PRIMARY KEY,
        response_id TEXT NOT NULL,
        session_id TEXT NOT NULL REFERENCES sessions(id),
        thumb TEXT,
        score {real},
        comment TEXT,
        created_at {real} NOT NULL
    );
    CREATE INDEX feedback_response ON feedback ({feedback_index});
    """,
    # 2: which training job consumed a trajectory, so a job that restarts from a checkpoint puts back
    # only what *it* consumed after that checkpoint.
    """
    ALTER TABLE trajectories ADD COLUMN consumed_job TEXT;
    """,
    # 3: which agent key owns a session (agent keys reach only their own sessions).
    """
    ALTER TABLE sessions ADD COLUMN owner TEXT;
    """,
    # 4: stateful API responses (OpenAI Responses ``store``: ``previous_response_id``, ``GET /v1/responses/{id}``).
    """
    CREATE TABLE stored_responses (
        id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL,
        owner TEXT,
        previous_response_id TEXT,
        body TEXT NOT NULL,
        created_at {real} NOT NULL
    );
    """,
    # 5: finding idle open sessions (``close_idle_sessions``) without scanning every session.
    """
    CREATE INDEX sessions_idle ON sessions (status, updated_at);
    """,
    # 6: jobs (record, metrics over time, event log) and minted API keys join the versioned schema. Before,
    # their stores created these tables on open, so databases written then have them: IF NOT EXISTS.
    """
    CREATE TABLE IF NOT EXISTS jobs (
        id TEXT PRIMARY KEY, spec TEXT NOT NULL, status TEXT NOT NULL, state TEXT NOT NULL,
        error TEXT, created_at {real} NOT NULL, updated_at {real} NOT NULL);
    CREATE TABLE IF NOT EXISTS job_metrics (
        job_id TEXT NOT NULL REFERENCES jobs(id), step INTEGER NOT NULL, t {real} NOT NULL,
        metrics TEXT NOT NULL, PRIMARY KEY (job_id, step));
    CREATE TABLE IF NOT EXISTS job_events (
        seq {serial}, job_id TEXT NOT NULL REFERENCES jobs(id), t {real} NOT NULL,
        kind TEXT NOT NULL, data TEXT NOT NULL);
    CREATE INDEX IF NOT EXISTS job_events_job ON job_events (job_id, seq);
    CREATE TABLE IF NOT EXISTS api_keys (
        id TEXT PRIMARY KEY, role TEXT NOT NULL, name TEXT NOT NULL, key_hash TEXT NOT NULL,
        created_at {real} NOT NULL, revoked_at {real});
    """,
    # 7: published LoRA adapters: an alias clients name (``<served>:<alias>``) -> the versioned adapter the engines
    # hold now (stock SGLang cannot replace a loaded adapter: each update is loaded under a new name), and the
    # newest version saved as a PEFT directory (what a restarted engine or server loads again).
    """
    CREATE TABLE lora_adapters (
        alias TEXT PRIMARY KEY, name TEXT NOT NULL, version INTEGER NOT NULL, job_id TEXT, previous TEXT,
        saved_version INTEGER, saved_path TEXT, created_at {real} NOT NULL, updated_at {real} NOT NULL);
    """,
    # 8: an MoE model's routed experts per trajectory (buffer/routed_experts.py's bytes), for routing replay.
    """
    ALTER TABLE trajectories ADD COLUMN routed_experts {blob};
    """,
    # 9: images (issue 45): each image file once by content hash, and each trajectory's image spans (JSON).
    """
    CREATE TABLE images (
        sha256 TEXT PRIMARY KEY, mime TEXT NOT NULL, width INTEGER NOT NULL, height INTEGER NOT NULL,
        data {blob} NOT NULL, created_at {real} NOT NULL);
    ALTER TABLE trajectories ADD COLUMN images TEXT;
    """,
]

SCHEMA_VERSION = len(MIGRATIONS)


def schema_version(tx: Tx) -> int:
    return int(tx.execute("SELECT COALESCE(MAX(version), 0) AS v FROM schema_migrations").fetchone()["v"])


def migrate(db: Database) -> None:
    """Bring ``db`` to ``SCHEMA_VERSION`` (nothing to do when it is there); ``StoreError`` if it is newer."""
    try:
        if db.read(schema_version) == SCHEMA_VERSION:
            return
    except Exception:  # no schema_migrations table yet: a new database
        pass

    def run(tx: Tx) -> None:
        if db.dialect.schema_lock:
            tx.execute(db.dialect.schema_lock)
        tx.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
                   f"applied_at {db.dialect.ddl['real']} NOT NULL)")
        current = schema_version(tx)
        if current > SCHEMA_VERSION:
            raise StoreError(f"database schema version {current} is newer than this code ({SCHEMA_VERSION})")
        for version in range(current + 1, SCHEMA_VERSION + 1):
            for statement in MIGRATIONS[version - 1].format_map(db.dialect.ddl).split(";"):
                if statement.strip():
                    tx.execute(statement)
            tx.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)", (version, now()))
    db.write(run)


def migrated(db: D) -> D:
    """``db`` brought to ``SCHEMA_VERSION`` (every store's first step on open); closed if that fails."""
    try:
        migrate(db)
    except BaseException:
        db.close()
        raise
    return db
