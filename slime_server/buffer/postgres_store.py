"""PostgreSQL trajectory store: one database shared by several gateway replicas (issue 8, item 4).

Why it mirrors ``sqlite_store.py`` statement by statement: callers (gateway, sessions, trainer,
exporters) must not notice which store they talk to, so every method keeps the SQLite store's
semantics and typed errors, and the schema keeps its versions (``schema_migrations``, same numbers).

What differs, and why:
- SQLite serialises all writers on one file lock; here replicas write at the same time. Each write
  that reads-then-writes a session locks that session's row first (``SELECT ... FOR UPDATE``), so
  writes to one session queue like SQLite's, writes to different sessions run in parallel, and the
  trajectory revision check still turns a lost race into ``StaleWriteError``. Inserts that may race
  use ``ON CONFLICT DO NOTHING`` and decide from the row count, never from an aborted transaction.
  Deadlocks are retried whole by ``pg_conn.PgConnections``.
- Token arrays are ``bytea`` packed exactly like the SQLite blobs (little-endian numpy), so float64
  logprobs round-trip bit-exactly and a row moves between stores byte for byte. JSON columns stay
  ``text`` (``jsonb`` would reorder keys of user metadata).
- Write order (``seq``) comes from an identity column. Postgres hands out values at insert time and
  transactions may commit out of that order, so a page read with ``after`` while another replica is
  inserting can miss a row that lands behind the cursor; callers that must see every row (the
  trainer) filter by ``unconsumed`` rather than keep a cursor, which is unaffected.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg

from slime_server.buffer.pg_conn import PgConnections
from slime_server.buffer.rows import RECENT_SESSIONS_SQL
from slime_server.buffer.rows import SESSION_COLUMNS as _SESSION_COLUMNS
from slime_server.buffer.rows import TRAJ_COLUMNS as _TRAJ_COLUMNS
from slime_server.buffer.rows import owned as _owned
from slime_server.buffer.rows import session_from_row as _session_from_row
from slime_server.buffer.rows import traj_from_row as _traj_from_row
from slime_server.buffer.rows import traj_params as _traj_params
from slime_server.buffer.schema import (
    Feedback,
    IdempotencyConflict,
    ResponseNotFound,
    RewardEvent,
    Session,
    SessionClosedError,
    SessionExistsError,
    SessionNotFound,
    SessionSummary,
    StaleWriteError,
    StoredResponse,
    StoreError,
    StoreStats,
    Thumb,
    Trajectory,
    TrajectoryNotFound,
    TrajectoryStatus,
    now,
)
from slime_server.buffer.store import DROPPED_STEP, TrajectoryStore, TurnWrite

Conn = psycopg.Connection[Any]
Row = dict[str, Any]

# Serialises migrations when several replicas start at once (any constant unique to this schema).
_MIGRATION_LOCK = 0x5_11_3E_7A_0001

# Same versions as sqlite_store.MIGRATIONS: version i means the same columns in both stores.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE sessions (
        id TEXT PRIMARY KEY,
        group_id TEXT,
        metadata TEXT NOT NULL,
        status TEXT NOT NULL,
        key_hash TEXT,
        segment_splits INTEGER NOT NULL DEFAULT 0,
        created_at DOUBLE PRECISION NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL
    );
    CREATE TABLE trajectories (
        seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        session_id TEXT NOT NULL REFERENCES sessions(id),
        segment INTEGER NOT NULL,
        branch INTEGER NOT NULL,
        group_id TEXT,
        n_tokens INTEGER NOT NULL,
        tokens BYTEA NOT NULL,
        loss_mask BYTEA NOT NULL,
        rollout_logprobs BYTEA NOT NULL,
        weight_versions BYTEA NOT NULL,
        turns TEXT NOT NULL,
        messages TEXT NOT NULL,
        tools_digest TEXT,
        reward DOUBLE PRECISION,
        turn_rewards TEXT NOT NULL,
        status TEXT NOT NULL,
        consumed_step INTEGER,
        metadata TEXT NOT NULL,
        revision INTEGER NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL,
        UNIQUE (session_id, segment, branch)
    );
    CREATE INDEX trajectories_pick ON trajectories (status, consumed_step, seq);
    CREATE TABLE responses (
        seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        response_id TEXT NOT NULL,
        choice INTEGER NOT NULL,
        session_id TEXT NOT NULL REFERENCES sessions(id),
        trajectory_id TEXT NOT NULL REFERENCES trajectories(id),
        UNIQUE (response_id, choice)
    );
    CREATE INDEX responses_session ON responses (session_id, seq);
    CREATE TABLE reward_events (
        seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        idempotency_key TEXT NOT NULL UNIQUE,
        session_id TEXT NOT NULL REFERENCES sessions(id),
        reward DOUBLE PRECISION,
        turn_rewards TEXT,
        created_at DOUBLE PRECISION NOT NULL
    );
    CREATE TABLE feedback (
        seq BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
        id TEXT PRIMARY KEY,
        response_id TEXT NOT NULL,
        session_id TEXT NOT NULL REFERENCES sessions(id),
        thumb TEXT,
        score DOUBLE PRECISION,
        comment TEXT,
        created_at DOUBLE PRECISION NOT NULL
    );
    CREATE INDEX feedback_response ON feedback (response_id, created_at, seq);
    """,
    # 2: which training job consumed a trajectory (release_consumed puts back only that job's steps).
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
        created_at DOUBLE PRECISION NOT NULL
    );
    """,
    # 5: finding idle open sessions (``close_idle_sessions``) without scanning every session.
    """
    CREATE INDEX sessions_idle ON sessions (status, updated_at);
    """,
]

class PostgresTrajectoryStore(TrajectoryStore):
    """``TrajectoryStore`` over a PostgreSQL database; safe to share between threads, processes and hosts.

    ``url`` is a libpq URL (``postgresql://user:password@host:5432/db``); the database must exist and
    the user must be allowed to create tables in it (the schema is created and migrated on open).
    """

    SCHEMA_VERSION = len(MIGRATIONS)

    def __init__(self, url: str, *, pool_max: int = 8, timeout_s: float = 30.0, connect_timeout_s: float = 10.0,
                 busy_timeout_s: float = 30.0) -> None:
        self.url = url  # deliberately not ``path``: callers that find ``path`` open SQLite files beside it
        self._db = PgConnections(url, max_size=pool_max, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                                 lock_timeout_s=busy_timeout_s)
        self._write, self._read = self._db.write, self._db.read
        try:
            self._migrate()
        except BaseException:
            self._db.close()
            raise

    def _migrate(self) -> None:
        def run(conn: Conn) -> None:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
                         "applied_at DOUBLE PRECISION NOT NULL)")
            current = conn.execute("SELECT COALESCE(MAX(version), 0) AS v FROM schema_migrations").fetchone()["v"]
            if current > len(MIGRATIONS):
                raise StoreError(f"database schema version {current} is newer than this code ({len(MIGRATIONS)})")
            for version in range(current + 1, len(MIGRATIONS) + 1):
                for statement in MIGRATIONS[version - 1].split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (%s, %s)", (version, now()))
        self._write(run)

    def schema_version(self) -> int:
        return self._read(lambda c: c.execute("SELECT MAX(version) AS v FROM schema_migrations").fetchone()["v"])

    def integrity_check(self) -> str:
        """"ok", or what is wrong: the schema version and the byte length of every token array.

        Postgres checksums pages and replays its WAL itself; what it cannot know is that each packed
        array holds exactly ``n_tokens`` elements, which a partial or foreign write would break."""
        def run(conn: Conn) -> str:
            version = conn.execute("SELECT MAX(version) AS v FROM schema_migrations").fetchone()["v"]
            if version != len(MIGRATIONS):
                return f"schema version {version}, expected {len(MIGRATIONS)}"
            bad = conn.execute(
                "SELECT COUNT(*) AS n FROM trajectories WHERE length(tokens) <> 4 * n_tokens "
                "OR length(loss_mask) <> n_tokens OR length(rollout_logprobs) <> 8 * n_tokens "
                "OR length(weight_versions) <> 8 * n_tokens").fetchone()["n"]
            return "ok" if bad == 0 else f"{bad} trajectories have token arrays of the wrong length"
        return self._read(run)

    def close(self) -> None:
        self._db.close()

    # ---------------------------------------------------------------- sessions
    @staticmethod
    def _session(conn: Conn, session_id: str, *, lock: bool = False) -> Session:
        """The session; with ``lock`` its row stays locked until commit, so writes to one session queue."""
        row = conn.execute(f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE id = %s" + (" FOR UPDATE" if lock else ""),
                           (session_id,)).fetchone()
        if row is None:
            raise SessionNotFound(f"session {session_id!r} not found")
        return _session_from_row(row)

    @staticmethod
    def _insert_session(conn: Conn, s: Session) -> bool:
        """Insert ``s``; False (and nothing written) if the id is taken, even by a concurrent replica."""
        cur = conn.execute(
            "INSERT INTO sessions (id, group_id, metadata, status, key_hash, owner, segment_splits, created_at, "
            "updated_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING",
            (s.id, s.group_id, json.dumps(s.metadata), s.status, s.key_hash, s.owner, s.segment_splits,
             s.created_at, s.updated_at))
        return cur.rowcount == 1

    def create_session(self, session_id: str | None = None, *, group_id: str | None = None,
                       metadata: dict[str, Any] | None = None, key_hash: str | None = None,
                       owner: str | None = None) -> Session:
        s = Session(id=session_id or f"sess-{uuid.uuid4().hex}", group_id=group_id, metadata=metadata or {},
                    key_hash=key_hash, owner=owner)

        def run(conn: Conn) -> None:
            if not self._insert_session(conn, s):
                raise SessionExistsError(f"session {s.id!r} already exists")
        self._write(run)
        return s

    def get_session(self, session_id: str) -> Session:
        return self._read(lambda c: self._session(c, session_id))

    def get_or_create_session(self, session_id: str, *, group_id: str | None = None,
                              metadata: dict[str, Any] | None = None, owner: str | None = None) -> Session:
        try:  # the common case reads only
            return _owned(self.get_session(session_id), owner)
        except SessionNotFound:
            pass

        def run(conn: Conn) -> Session:
            s = Session(id=session_id, group_id=group_id, metadata=metadata or {}, owner=owner)
            if self._insert_session(conn, s):
                return s
            return _owned(self._session(conn, session_id), owner)  # another replica created it first
        return self._write(run)

    def close_session(self, session_id: str) -> Session:
        def run(conn: Conn) -> Session:
            self._session(conn, session_id, lock=True)
            self._close(conn, [session_id])
            return self._session(conn, session_id)
        return self._write(run)

    @staticmethod
    def _close(conn: Conn, session_ids: list[str]) -> None:
        if not session_ids:
            return
        t = now()
        conn.execute("UPDATE sessions SET status = 'closed', updated_at = %s WHERE id = ANY(%s)", (t, session_ids))
        conn.execute("UPDATE trajectories SET status = 'finished', updated_at = %s, revision = revision + 1 "
                     "WHERE session_id = ANY(%s) AND status = 'open'", (t, session_ids))

    def close_idle_sessions(self, idle_since: float, limit: int = 1000) -> list[str]:
        def run(conn: Conn) -> list[str]:
            # SKIP LOCKED: a session another replica is writing right now is not idle; it waits for the next sweep
            rows = conn.execute("SELECT id FROM sessions WHERE status = 'open' AND updated_at < %s "
                                "ORDER BY updated_at LIMIT %s FOR UPDATE SKIP LOCKED", (idle_since, limit)).fetchall()
            ids = [r["id"] for r in rows]
            self._close(conn, ids)
            return ids
        return self._write(run)

    # ---------------------------------------------------------------- trajectories
    def get_trajectories(self, session_id: str) -> list[Trajectory]:
        def run(conn: Conn) -> list[Trajectory]:
            self._session(conn, session_id)
            rows = conn.execute(f"SELECT {_TRAJ_COLUMNS} FROM trajectories WHERE session_id = %s "
                                "ORDER BY segment, branch", (session_id,)).fetchall()
            return [_traj_from_row(r) for r in rows]
        return self._read(run)

    def get_trajectory(self, trajectory_id: str) -> Trajectory:
        row = self._read(lambda c: c.execute(f"SELECT {_TRAJ_COLUMNS} FROM trajectories WHERE id = %s",
                                             (trajectory_id,)).fetchone())
        if row is None:
            raise TrajectoryNotFound(f"trajectory {trajectory_id!r} not found")
        return _traj_from_row(row)

    def write_turn(self, write: TurnWrite) -> list[Trajectory]:
        def run(conn: Conn) -> list[Trajectory]:
            t = now()
            stored: list[Trajectory] = []
            if write.create_session is not None:
                if write.create_session.id != write.session_id:
                    raise StoreError("create_session must be the turn's own session")
                if not self._insert_session(conn, write.create_session):
                    raise SessionExistsError(f"session {write.session_id!r} already exists")
            session = self._session(conn, write.session_id, lock=True)
            if session.status != "open":
                raise SessionClosedError(f"session {write.session_id!r} is closed")
            for traj in write.trajectories:
                if traj.session_id != write.session_id:
                    raise StoreError("a turn may only write trajectories of its own session")
                p = _traj_params(traj, traj.revision + 1, t)
                if traj.revision == 0:
                    cur = conn.execute(
                        "INSERT INTO trajectories (id, session_id, segment, branch, group_id, n_tokens, tokens, "
                        "loss_mask, rollout_logprobs, weight_versions, turns, messages, tools_digest, reward, "
                        "turn_rewards, status, consumed_step, metadata, revision, created_at, updated_at) "
                        "VALUES (%(id)s, %(session_id)s, %(segment)s, %(branch)s, %(group_id)s, %(n_tokens)s, "
                        "%(tokens)s, %(loss_mask)s, %(rollout_logprobs)s, %(weight_versions)s, %(turns)s, "
                        "%(messages)s, %(tools_digest)s, %(reward)s, %(turn_rewards)s, %(status)s, "
                        "%(consumed_step)s, %(metadata)s, %(revision)s, %(created_at)s, %(updated_at)s) "
                        "ON CONFLICT DO NOTHING", p)
                    if cur.rowcount != 1:
                        raise StaleWriteError(f"trajectory {traj.id} (segment {traj.segment}, branch "
                                              f"{traj.branch}) was written concurrently")
                else:
                    cur = conn.execute(
                        "UPDATE trajectories SET n_tokens = %(n_tokens)s, tokens = %(tokens)s, "
                        "loss_mask = %(loss_mask)s, rollout_logprobs = %(rollout_logprobs)s, "
                        "weight_versions = %(weight_versions)s, turns = %(turns)s, messages = %(messages)s, "
                        "tools_digest = %(tools_digest)s, reward = %(reward)s, turn_rewards = %(turn_rewards)s, "
                        "status = %(status)s, metadata = %(metadata)s, revision = %(revision)s, "
                        "updated_at = %(updated_at)s WHERE id = %(id)s AND session_id = %(session_id)s "
                        "AND revision = %(old_revision)s AND status = 'open'", p)
                    if cur.rowcount != 1:
                        raise StaleWriteError(f"trajectory {traj.id} changed since it was read")
                stored.append(traj.model_copy(update={"revision": traj.revision + 1, "updated_at": t}))
            for ref in write.responses:
                conn.execute("INSERT INTO responses (response_id, choice, session_id, trajectory_id) "
                             "VALUES (%s, %s, %s, %s)",
                             (ref.response_id, ref.choice, write.session_id, ref.trajectory_id))
            if write.close_session:
                conn.execute("UPDATE trajectories SET status = 'finished', revision = revision + 1, updated_at = %s "
                             "WHERE session_id = %s AND status = 'open'", (t, write.session_id))
                stored = [s.model_copy(update={"status": "finished", "revision": s.revision + 1}) for s in stored]
            conn.execute("UPDATE sessions SET updated_at = %s, segment_splits = segment_splits + %s, "
                         "status = CASE WHEN %s THEN 'closed' ELSE status END WHERE id = %s",
                         (t, int(write.segment_split), write.close_session, write.session_id))
            return stored
        return self._write(run)

    def find_by_response_id(self, response_id: str) -> list[tuple[Trajectory, int]]:
        columns = ", ".join("t." + c.strip() for c in _TRAJ_COLUMNS.split(","))
        rows = self._read(lambda c: c.execute(
            f"SELECT {columns} FROM responses r JOIN trajectories t ON t.id = r.trajectory_id "
            "WHERE r.response_id = %s ORDER BY r.choice", (response_id,)).fetchall())
        if not rows:
            raise ResponseNotFound(f"response {response_id!r} not found")
        out = []
        for traj in map(_traj_from_row, rows):
            index = next(i for i, turn in enumerate(traj.turns) if turn.response_id == response_id)
            out.append((traj, index))
        return out

    def list_trajectories(self, *, status: TrajectoryStatus | None = None, rewarded: bool | None = None,
                          unconsumed: bool | None = None, session_id: str | None = None,
                          limit: int = 100, after: str | None = None) -> list[Trajectory]:
        where: list[str] = []
        args: list[Any] = []
        if status is not None:
            where.append("status = %s")
            args.append(status)
        if rewarded is not None:
            where.append("reward IS NOT NULL" if rewarded else "reward IS NULL")
        if unconsumed is not None:
            where.append("consumed_step IS NULL" if unconsumed else "consumed_step IS NOT NULL")
        if session_id is not None:
            where.append("session_id = %s")
            args.append(session_id)
        if after is not None:
            self.get_trajectory(after)  # an unknown cursor is an error, not an empty page
            where.append("seq > (SELECT seq FROM trajectories WHERE id = %s)")
            args.append(after)
        sql = f"SELECT {_TRAJ_COLUMNS} FROM trajectories"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq LIMIT %s"
        args.append(max(0, int(limit)))
        rows = self._read(lambda c: c.execute(sql, args).fetchall())
        return [_traj_from_row(r) for r in rows]

    def mark_consumed(self, trajectory_ids: list[str], train_step: int, job_id: str | None = None) -> int:
        if not trajectory_ids:
            return 0
        # One statement: a trajectory another replica (or trainer) consumed first stays with it.
        return self._write(lambda c: c.execute(
            "UPDATE trajectories SET consumed_step = %s, consumed_job = %s, revision = revision + 1, "
            "updated_at = %s WHERE id = ANY(%s) AND consumed_step IS NULL",
            (train_step, job_id, now(), list(trajectory_ids))).rowcount)

    def release_consumed(self, after_step: int, job_id: str | None = None) -> int:
        return self._write(lambda c: c.execute(
            "UPDATE trajectories SET consumed_step = NULL, consumed_job = NULL, revision = revision + 1, "
            "updated_at = %s WHERE consumed_step > %s AND consumed_job IS NOT DISTINCT FROM %s::text",
            (now(), max(after_step, DROPPED_STEP), job_id)).rowcount)

    # ---------------------------------------------------------------- rewards and feedback
    def set_reward(self, session_id: str, *, reward: float | None = None,
                   turn_rewards: list[float] | None = None, idempotency_key: str | None = None,
                   finish: bool = False) -> bool:
        if reward is None and turn_rewards is None:
            raise StoreError("give a reward or turn_rewards")
        event = RewardEvent(idempotency_key=idempotency_key or f"auto-{uuid.uuid4().hex}", session_id=session_id,
                            reward=reward, turn_rewards=turn_rewards)

        def run(conn: Conn) -> bool:
            self._session(conn, session_id, lock=True)
            cur = conn.execute(
                "INSERT INTO reward_events (idempotency_key, session_id, reward, turn_rewards, created_at) "
                "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING",
                (event.idempotency_key, session_id, reward,
                 None if turn_rewards is None else json.dumps(turn_rewards), event.created_at))
            if cur.rowcount == 0:  # the key was applied before (possibly by another replica, just now)
                row = conn.execute("SELECT session_id, reward, turn_rewards FROM reward_events "
                                   "WHERE idempotency_key = %s", (event.idempotency_key,)).fetchone()
                seen = (row["session_id"], row["reward"], json.loads(row["turn_rewards"] or "null"))
                if seen != (session_id, reward, turn_rewards):
                    raise IdempotencyConflict(f"idempotency key {event.idempotency_key!r} was used with "
                                              "a different reward")
                return False
            self._apply_reward(conn, session_id, reward, turn_rewards)
            if finish:
                self._close(conn, [session_id])
            return True
        return self._write(run)

    @staticmethod
    def _apply_reward(conn: Conn, session_id: str, reward: float | None, turn_rewards: list[float] | None) -> None:
        t = now()
        if reward is not None:
            conn.execute("UPDATE trajectories SET reward = %s, updated_at = %s, revision = revision + 1 "
                         "WHERE session_id = %s", (reward, t, session_id))
        if turn_rewards is None:
            return
        order = [r["response_id"] for r in conn.execute(
            "SELECT response_id FROM responses WHERE session_id = %s GROUP BY response_id ORDER BY MIN(seq)",
            (session_id,)).fetchall()]
        if len(turn_rewards) != len(order):
            raise StoreError(f"turn_rewards has {len(turn_rewards)} values but the session has "
                             f"{len(order)} responses")
        by_response = dict(zip(order, turn_rewards, strict=True))
        rows = conn.execute("SELECT id, turns, turn_rewards FROM trajectories WHERE session_id = %s ORDER BY seq",
                            (session_id,)).fetchall()
        for row in rows:
            turns = json.loads(row["turns"])
            old = json.loads(row["turn_rewards"])
            new = [by_response.get(turn["response_id"], old[i] if i < len(old) else None)
                   for i, turn in enumerate(turns)]
            conn.execute("UPDATE trajectories SET turn_rewards = %s, updated_at = %s, revision = revision + 1 "
                         "WHERE id = %s", (json.dumps(new), t, row["id"]))

    def add_feedback(self, response_id: str, *, thumb: Thumb | None = None, score: float | None = None,
                     comment: str | None = None) -> Feedback:
        def run(conn: Conn) -> Feedback:
            row = conn.execute("SELECT session_id FROM responses WHERE response_id = %s LIMIT 1",
                               (response_id,)).fetchone()
            if row is None:
                raise ResponseNotFound(f"response {response_id!r} not found")
            fb = Feedback(response_id=response_id, session_id=row["session_id"], thumb=thumb, score=score,
                          comment=comment)
            conn.execute("INSERT INTO feedback (id, response_id, session_id, thumb, score, comment, created_at) "
                         "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                         (fb.id, fb.response_id, fb.session_id, fb.thumb, fb.score, fb.comment, fb.created_at))
            return fb
        return self._write(run)

    def get_feedback(self, response_id: str) -> list[Feedback]:
        rows = self._read(lambda c: c.execute(
            "SELECT id, response_id, session_id, thumb, score, comment, created_at FROM feedback "
            "WHERE response_id = %s ORDER BY created_at, seq", (response_id,)).fetchall())
        return [Feedback.model_validate(r) for r in rows]

    # ---------------------------------------------------------------- stored API responses
    def put_stored_response(self, response: StoredResponse) -> None:
        def run(conn: Conn) -> None:
            conn.execute("INSERT INTO stored_responses (id, session_id, owner, previous_response_id, body, created_at) "
                         "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET session_id = EXCLUDED.session_id, "
                         "owner = EXCLUDED.owner, previous_response_id = EXCLUDED.previous_response_id, "
                         "body = EXCLUDED.body, created_at = EXCLUDED.created_at",
                         (response.id, response.session_id, response.owner, response.previous_response_id,
                          json.dumps(response.body, ensure_ascii=False), response.created_at))
        self._write(run)

    def get_stored_response(self, response_id: str) -> StoredResponse:
        row = self._read(lambda c: c.execute(
            "SELECT id, session_id, owner, previous_response_id, body, created_at FROM stored_responses "
            "WHERE id = %s", (response_id,)).fetchone())
        if row is None:
            raise ResponseNotFound(f"response {response_id!r} not found")
        return StoredResponse.model_validate({**dict(row), "body": json.loads(row["body"])})

    # ---------------------------------------------------------------- housekeeping
    def recent_sessions(self, limit: int) -> list[SessionSummary]:
        rows = self._read(lambda c: c.execute(
            RECENT_SESSIONS_SQL + "%s", (max(0, int(limit)),)).fetchall())
        return [SessionSummary.model_validate({**r, "metadata": json.loads(r["metadata"] or "{}"),
                                               "num_tokens": int(r["num_tokens"])}) for r in rows]

    def stats(self) -> StoreStats:
        def run(conn: Conn) -> StoreStats:
            s = conn.execute("SELECT COUNT(*) AS n, COUNT(*) FILTER (WHERE status = 'open') AS open, "
                             "COALESCE(SUM(segment_splits), 0) AS splits FROM sessions").fetchone()
            by_status = {r["status"]: r["n"] for r in conn.execute(
                "SELECT status, COUNT(*) AS n FROM trajectories GROUP BY status").fetchall()}
            t = conn.execute(
                "SELECT COUNT(*) FILTER (WHERE reward IS NOT NULL) AS rewarded, COALESCE(SUM(n_tokens), 0) AS tokens, "
                "COUNT(*) FILTER (WHERE status = 'finished' AND reward IS NOT NULL AND consumed_step IS NULL) AS ready "
                "FROM trajectories").fetchone()
            fb = conn.execute("SELECT COUNT(*) AS n FROM feedback").fetchone()["n"]
            return StoreStats(sessions=s["n"], open_sessions=s["open"], segment_splits=int(s["splits"]),
                              trajectories=by_status, rewarded=t["rewarded"], tokens=int(t["tokens"]),
                              unconsumed_finished_rewarded=t["ready"], feedback=fb)
        return self._db.read(run, snapshot=True)  # one snapshot for all counts, as SQLite's read gives
