"""SQLite trajectory store: the embedded default (one file, WAL, fsync on every commit).

Why these settings: the gateway answers a request only after its turn is committed
(ARCHITECTURE decision 6), so ``synchronous=FULL`` makes a returned commit survive a power cut;
WAL lets the trainer read while the gateway writes. Each thread gets its own connection and
writes take the write lock up front (``BEGIN IMMEDIATE``) so concurrent writers queue instead of
failing half-way. Token arrays are little-endian binary blobs: compact, and float64 logprobs
round-trip bit-exactly.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from pathlib import Path
from typing import Any, TypeVar

from slime_server.buffer.rows import RECENT_SESSIONS_SQL
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
from slime_server.buffer.sqlite_conn import ThreadConnections
from slime_server.buffer.store import DROPPED_STEP, TrajectoryStore, TurnWrite

T = TypeVar("T")

# Each entry migrates the schema from version i to i + 1; applied ones are recorded in schema_migrations.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE sessions (
        id TEXT PRIMARY KEY,
        group_id TEXT,
        metadata TEXT NOT NULL,
        status TEXT NOT NULL,
        key_hash TEXT,
        segment_splits INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE trajectories (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        session_id TEXT NOT NULL REFERENCES sessions(id),
        segment INTEGER NOT NULL,
        branch INTEGER NOT NULL,
        group_id TEXT,
        n_tokens INTEGER NOT NULL,
        tokens BLOB NOT NULL,
        loss_mask BLOB NOT NULL,
        rollout_logprobs BLOB NOT NULL,
        weight_versions BLOB NOT NULL,
        turns TEXT NOT NULL,
        messages TEXT NOT NULL,
        tools_digest TEXT,
        reward REAL,
        turn_rewards TEXT NOT NULL,
        status TEXT NOT NULL,
        consumed_step INTEGER,
        metadata TEXT NOT NULL,
        revision INTEGER NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        UNIQUE (session_id, segment, branch)
    );
    CREATE INDEX trajectories_pick ON trajectories (status, consumed_step, seq);
    CREATE TABLE responses (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        response_id TEXT NOT NULL,
        choice INTEGER NOT NULL,
        session_id TEXT NOT NULL REFERENCES sessions(id),
        trajectory_id TEXT NOT NULL REFERENCES trajectories(id),
        UNIQUE (response_id, choice)
    );
    CREATE INDEX responses_session ON responses (session_id, seq);
    CREATE TABLE reward_events (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        idempotency_key TEXT NOT NULL UNIQUE,
        session_id TEXT NOT NULL REFERENCES sessions(id),
        reward REAL,
        turn_rewards TEXT,
        created_at REAL NOT NULL
    );
    CREATE TABLE feedback (
        id TEXT PRIMARY KEY,
        response_id TEXT NOT NULL,
        session_id TEXT NOT NULL REFERENCES sessions(id),
        thumb TEXT,
        score REAL,
        comment TEXT,
        created_at REAL NOT NULL
    );
    CREATE INDEX feedback_response ON feedback (response_id);
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
        created_at REAL NOT NULL
    );
    """,
    # 5: finding idle open sessions (``close_idle_sessions``) without scanning every session.
    """
    CREATE INDEX sessions_idle ON sessions (status, updated_at);
    """,
]

class SQLiteTrajectoryStore(TrajectoryStore):
    """``TrajectoryStore`` over one SQLite file; safe to share between threads and processes."""

    SCHEMA_VERSION = len(MIGRATIONS)

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 30.0) -> None:
        self.path = str(path)
        self._db = ThreadConnections(self.path, busy_timeout_s=busy_timeout_s)
        self._conn, self._write, self._read = self._db.conn, self._db.write, self._db.read
        self._migrate()

    def _migrate(self) -> None:
        with self._write() as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
                         "applied_at REAL NOT NULL)")
            current = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()[0]
            if current > len(MIGRATIONS):
                raise StoreError(f"database schema version {current} is newer than this code ({len(MIGRATIONS)})")
            for version in range(current + 1, len(MIGRATIONS) + 1):
                for statement in MIGRATIONS[version - 1].split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)", (version, now()))

    def schema_version(self) -> int:
        return self._read(lambda c: c.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0])

    def integrity_check(self) -> str:
        return self._conn().execute("PRAGMA integrity_check").fetchone()[0]

    def close(self) -> None:
        self._db.close()

    # ---------------------------------------------------------------- sessions
    @staticmethod
    def _session(conn: sqlite3.Connection, session_id: str) -> Session:
        row = conn.execute("SELECT * FROM sessions WHERE id = ?", (session_id,)).fetchone()
        if row is None:
            raise SessionNotFound(f"session {session_id!r} not found")
        return _session_from_row(row)

    @staticmethod
    def _insert_session(conn: sqlite3.Connection, s: Session) -> None:
        conn.execute("INSERT INTO sessions (id, group_id, metadata, status, key_hash, owner, segment_splits, "
                     "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     (s.id, s.group_id, json.dumps(s.metadata), s.status, s.key_hash, s.owner, s.segment_splits,
                      s.created_at, s.updated_at))

    def create_session(self, session_id: str | None = None, *, group_id: str | None = None,
                       metadata: dict[str, Any] | None = None, key_hash: str | None = None,
                       owner: str | None = None) -> Session:
        s = Session(id=session_id or f"sess-{uuid.uuid4().hex}", group_id=group_id, metadata=metadata or {},
                    key_hash=key_hash, owner=owner)
        with self._write() as conn:
            if conn.execute("SELECT 1 FROM sessions WHERE id = ?", (s.id,)).fetchone():
                raise SessionExistsError(f"session {s.id!r} already exists")
            self._insert_session(conn, s)
        return s

    def get_session(self, session_id: str) -> Session:
        return self._read(lambda c: self._session(c, session_id))

    def get_or_create_session(self, session_id: str, *, group_id: str | None = None,
                              metadata: dict[str, Any] | None = None, owner: str | None = None) -> Session:
        try:  # the common case reads only, so it never waits for the write lock
            return _owned(self.get_session(session_id), owner)
        except SessionNotFound:
            pass
        with self._write() as conn:
            try:
                return _owned(self._session(conn, session_id), owner)
            except SessionNotFound:
                s = Session(id=session_id, group_id=group_id, metadata=metadata or {}, owner=owner)
                self._insert_session(conn, s)
                return s

    def close_session(self, session_id: str) -> Session:
        with self._write() as conn:
            self._session(conn, session_id)
            self._close(conn, [session_id])
            return self._session(conn, session_id)

    @staticmethod
    def _close(conn: sqlite3.Connection, session_ids: list[str]) -> None:
        t = now()
        for session_id in session_ids:
            conn.execute("UPDATE sessions SET status = 'closed', updated_at = ? WHERE id = ?", (t, session_id))
            conn.execute("UPDATE trajectories SET status = 'finished', updated_at = ?, revision = revision + 1 "
                         "WHERE session_id = ? AND status = 'open'", (t, session_id))

    def close_idle_sessions(self, idle_since: float, limit: int = 1000) -> list[str]:
        with self._write() as conn:
            ids = [r[0] for r in conn.execute("SELECT id FROM sessions WHERE status = 'open' AND updated_at < ? "
                                              "ORDER BY updated_at LIMIT ?", (idle_since, limit)).fetchall()]
            self._close(conn, ids)
        return ids

    # ---------------------------------------------------------------- trajectories
    def get_trajectories(self, session_id: str) -> list[Trajectory]:
        def run(conn: sqlite3.Connection) -> list[Trajectory]:
            self._session(conn, session_id)
            rows = conn.execute(f"SELECT {_TRAJ_COLUMNS} FROM trajectories WHERE session_id = ? "
                                "ORDER BY segment, branch", (session_id,)).fetchall()
            return [_traj_from_row(r) for r in rows]
        return self._read(run)

    def get_trajectory(self, trajectory_id: str) -> Trajectory:
        row = self._read(lambda c: c.execute(f"SELECT {_TRAJ_COLUMNS} FROM trajectories WHERE id = ?",
                                             (trajectory_id,)).fetchone())
        if row is None:
            raise TrajectoryNotFound(f"trajectory {trajectory_id!r} not found")
        return _traj_from_row(row)

    def write_turn(self, write: TurnWrite) -> list[Trajectory]:
        t = now()
        stored: list[Trajectory] = []
        with self._write() as conn:
            if write.create_session is not None:
                if write.create_session.id != write.session_id:
                    raise StoreError("create_session must be the turn's own session")
                if conn.execute("SELECT 1 FROM sessions WHERE id = ?", (write.session_id,)).fetchone():
                    raise SessionExistsError(f"session {write.session_id!r} already exists")
                self._insert_session(conn, write.create_session)
            session = self._session(conn, write.session_id)
            if session.status != "open":
                raise SessionClosedError(f"session {write.session_id!r} is closed")
            for traj in write.trajectories:
                if traj.session_id != write.session_id:
                    raise StoreError("a turn may only write trajectories of its own session")
                p = _traj_params(traj, traj.revision + 1, t)
                if traj.revision == 0:
                    try:
                        conn.execute(
                            "INSERT INTO trajectories (id, session_id, segment, branch, group_id, n_tokens, tokens, "
                            "loss_mask, rollout_logprobs, weight_versions, turns, messages, tools_digest, reward, "
                            "turn_rewards, status, consumed_step, metadata, revision, created_at, updated_at) "
                            "VALUES (:id, :session_id, :segment, :branch, :group_id, :n_tokens, :tokens, "
                            ":loss_mask, :rollout_logprobs, :weight_versions, :turns, :messages, :tools_digest, "
                            ":reward, :turn_rewards, :status, :consumed_step, :metadata, :revision, :created_at, "
                            ":updated_at)", p)
                    except sqlite3.IntegrityError as exc:
                        raise StaleWriteError(f"trajectory {traj.id} (segment {traj.segment}, branch "
                                              f"{traj.branch}) was written concurrently") from exc
                else:
                    cur = conn.execute(
                        "UPDATE trajectories SET n_tokens = :n_tokens, tokens = :tokens, loss_mask = :loss_mask, "
                        "rollout_logprobs = :rollout_logprobs, weight_versions = :weight_versions, turns = :turns, "
                        "messages = :messages, tools_digest = :tools_digest, reward = :reward, "
                        "turn_rewards = :turn_rewards, status = :status, metadata = :metadata, "
                        "revision = :revision, updated_at = :updated_at "
                        "WHERE id = :id AND revision = :old_revision AND status = 'open'", p)
                    if cur.rowcount != 1:
                        raise StaleWriteError(f"trajectory {traj.id} changed since it was read")
                stored.append(traj.model_copy(update={"revision": traj.revision + 1, "updated_at": t}))
            for ref in write.responses:
                conn.execute("INSERT INTO responses (response_id, choice, session_id, trajectory_id) "
                             "VALUES (?, ?, ?, ?)", (ref.response_id, ref.choice, write.session_id, ref.trajectory_id))
            if write.close_session:
                conn.execute("UPDATE trajectories SET status = 'finished', revision = revision + 1 "
                             "WHERE session_id = ? AND status = 'open'", (write.session_id,))
                stored = [s.model_copy(update={"status": "finished", "revision": s.revision + 1}) for s in stored]
            conn.execute("UPDATE sessions SET updated_at = ?, segment_splits = segment_splits + ?, "
                         "status = CASE WHEN ? THEN 'closed' ELSE status END WHERE id = ?",
                         (t, int(write.segment_split), int(write.close_session), write.session_id))
        return stored

    def find_by_response_id(self, response_id: str) -> list[tuple[Trajectory, int]]:
        def run(conn: sqlite3.Connection) -> list[tuple[Trajectory, int]]:
            rows = conn.execute(f"SELECT {', '.join('t.' + c.strip() for c in _TRAJ_COLUMNS.split(','))} "
                                "FROM responses r JOIN trajectories t ON t.id = r.trajectory_id "
                                "WHERE r.response_id = ? ORDER BY r.choice", (response_id,)).fetchall()
            return [(_traj_from_row(r), 0) for r in rows]
        found = self._read(run)
        if not found:
            raise ResponseNotFound(f"response {response_id!r} not found")
        out = []
        for traj, _ in found:
            index = next(i for i, turn in enumerate(traj.turns) if turn.response_id == response_id)
            out.append((traj, index))
        return out

    def list_trajectories(self, *, status: TrajectoryStatus | None = None, rewarded: bool | None = None,
                          unconsumed: bool | None = None, session_id: str | None = None,
                          limit: int = 100, after: str | None = None) -> list[Trajectory]:
        where, args = [], []
        if status is not None:
            where.append("status = ?")
            args.append(status)
        if rewarded is not None:
            where.append("reward IS NOT NULL" if rewarded else "reward IS NULL")
        if unconsumed is not None:
            where.append("consumed_step IS NULL" if unconsumed else "consumed_step IS NOT NULL")
        if session_id is not None:
            where.append("session_id = ?")
            args.append(session_id)
        if after is not None:
            self.get_trajectory(after)  # an unknown cursor is an error, not an empty page
            where.append("seq > (SELECT seq FROM trajectories WHERE id = ?)")
            args.append(after)
        sql = f"SELECT {_TRAJ_COLUMNS} FROM trajectories"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq LIMIT ?"
        args.append(max(0, int(limit)))
        rows = self._read(lambda c: c.execute(sql, args).fetchall())
        return [_traj_from_row(r) for r in rows]

    def mark_consumed(self, trajectory_ids: list[str], train_step: int, job_id: str | None = None) -> int:
        changed = 0
        with self._write() as conn:
            for tid in trajectory_ids:
                cur = conn.execute("UPDATE trajectories SET consumed_step = ?, consumed_job = ?, revision = revision + 1, "
                                   "updated_at = ? WHERE id = ? AND consumed_step IS NULL",
                                   (train_step, job_id, now(), tid))
                changed += cur.rowcount
        return changed

    def release_consumed(self, after_step: int, job_id: str | None = None) -> int:
        with self._write() as conn:
            cur = conn.execute("UPDATE trajectories SET consumed_step = NULL, consumed_job = NULL, "
                               "revision = revision + 1, updated_at = ? "
                               "WHERE consumed_step > ? AND consumed_job IS ?", (now(), max(after_step, DROPPED_STEP), job_id))
            return cur.rowcount

    # ---------------------------------------------------------------- rewards and feedback
    def set_reward(self, session_id: str, *, reward: float | None = None,
                   turn_rewards: list[float] | None = None, idempotency_key: str | None = None,
                   finish: bool = False) -> bool:
        if reward is None and turn_rewards is None:
            raise StoreError("give a reward or turn_rewards")
        event = RewardEvent(idempotency_key=idempotency_key or f"auto-{uuid.uuid4().hex}", session_id=session_id,
                            reward=reward, turn_rewards=turn_rewards)
        with self._write() as conn:
            self._session(conn, session_id)
            row = conn.execute("SELECT session_id, reward, turn_rewards FROM reward_events "
                               "WHERE idempotency_key = ?", (event.idempotency_key,)).fetchone()
            if row is not None:
                seen = (row["session_id"], row["reward"], json.loads(row["turn_rewards"] or "null"))
                if seen != (session_id, reward, turn_rewards):
                    raise IdempotencyConflict(f"idempotency key {event.idempotency_key!r} was used with "
                                              "a different reward")
                return False
            conn.execute("INSERT INTO reward_events (idempotency_key, session_id, reward, turn_rewards, created_at) "
                         "VALUES (?, ?, ?, ?, ?)", (event.idempotency_key, session_id, reward,
                                                    None if turn_rewards is None else json.dumps(turn_rewards),
                                                    event.created_at))
            self._apply_reward(conn, session_id, reward, turn_rewards)
            if finish:
                self._close(conn, [session_id])
        return True

    @staticmethod
    def _apply_reward(conn: sqlite3.Connection, session_id: str, reward: float | None,
                      turn_rewards: list[float] | None) -> None:
        t = now()
        if reward is not None:
            conn.execute("UPDATE trajectories SET reward = ?, updated_at = ?, revision = revision + 1 "
                         "WHERE session_id = ?", (reward, t, session_id))
        if turn_rewards is None:
            return
        order = [r[0] for r in conn.execute("SELECT response_id FROM responses WHERE session_id = ? GROUP BY "
                                            "response_id ORDER BY MIN(seq)", (session_id,)).fetchall()]
        if len(turn_rewards) != len(order):
            raise StoreError(f"turn_rewards has {len(turn_rewards)} values but the session has "
                             f"{len(order)} responses")
        by_response = dict(zip(order, turn_rewards, strict=True))
        rows = conn.execute("SELECT id, turns, turn_rewards FROM trajectories WHERE session_id = ? ORDER BY seq",
                            (session_id,)).fetchall()
        for row in rows:
            turns = json.loads(row["turns"])
            old = json.loads(row["turn_rewards"])
            new = [by_response.get(turn["response_id"], old[i] if i < len(old) else None)
                   for i, turn in enumerate(turns)]
            conn.execute("UPDATE trajectories SET turn_rewards = ?, updated_at = ?, revision = revision + 1 "
                         "WHERE id = ?", (json.dumps(new), t, row["id"]))

    def add_feedback(self, response_id: str, *, thumb: Thumb | None = None, score: float | None = None,
                     comment: str | None = None) -> Feedback:
        with self._write() as conn:
            row = conn.execute("SELECT session_id FROM responses WHERE response_id = ? LIMIT 1",
                               (response_id,)).fetchone()
            if row is None:
                raise ResponseNotFound(f"response {response_id!r} not found")
            fb = Feedback(response_id=response_id, session_id=row["session_id"], thumb=thumb, score=score,
                          comment=comment)
            conn.execute("INSERT INTO feedback (id, response_id, session_id, thumb, score, comment, created_at) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)", (fb.id, fb.response_id, fb.session_id, fb.thumb, fb.score,
                                                         fb.comment, fb.created_at))
        return fb

    def get_feedback(self, response_id: str) -> list[Feedback]:
        rows = self._read(lambda c: c.execute("SELECT * FROM feedback WHERE response_id = ? ORDER BY created_at, rowid",
                                              (response_id,)).fetchall())
        return [Feedback.model_validate(dict(r)) for r in rows]

    # ---------------------------------------------------------------- stored API responses
    def put_stored_response(self, response: StoredResponse) -> None:
        with self._write() as conn:
            conn.execute("INSERT OR REPLACE INTO stored_responses (id, session_id, owner, previous_response_id, body, "
                         "created_at) VALUES (?, ?, ?, ?, ?, ?)",
                         (response.id, response.session_id, response.owner, response.previous_response_id,
                          json.dumps(response.body, ensure_ascii=False), response.created_at))

    def get_stored_response(self, response_id: str) -> StoredResponse:
        row = self._read(lambda c: c.execute("SELECT * FROM stored_responses WHERE id = ?",
                                             (response_id,)).fetchone())
        if row is None:
            raise ResponseNotFound(f"response {response_id!r} not found")
        return StoredResponse.model_validate({**dict(row), "body": json.loads(row["body"])})

    # ---------------------------------------------------------------- housekeeping
    def recent_sessions(self, limit: int) -> list[SessionSummary]:
        rows = self._read(lambda c: c.execute(RECENT_SESSIONS_SQL + "?", (max(0, int(limit)),)).fetchall())
        return [SessionSummary.model_validate({**dict(r), "metadata": json.loads(r["metadata"] or "{}")}) for r in rows]

    def stats(self) -> StoreStats:
        def run(conn: sqlite3.Connection) -> StoreStats:
            s = conn.execute("SELECT COUNT(*), COALESCE(SUM(status = 'open'), 0), COALESCE(SUM(segment_splits), 0) "
                             "FROM sessions").fetchone()
            by_status = {r[0]: r[1] for r in conn.execute("SELECT status, COUNT(*) FROM trajectories "
                                                          "GROUP BY status")}
            t = conn.execute("SELECT COALESCE(SUM(reward IS NOT NULL), 0), COALESCE(SUM(n_tokens), 0), "
                             "COALESCE(SUM(status = 'finished' AND reward IS NOT NULL AND consumed_step IS NULL), 0) "
                             "FROM trajectories").fetchone()
            fb = conn.execute("SELECT COUNT(*) FROM feedback").fetchone()[0]
            return StoreStats(sessions=s[0], open_sessions=s[1], segment_splits=s[2], trajectories=by_status,
                              rewarded=t[0], tokens=t[1], unconsumed_finished_rewarded=t[2], feedback=fb)
        return self._read(run)
