"""The trajectory store, once, over either database (``sql.Database``: SQLite or PostgreSQL).

Why one implementation: callers (gateway, sessions, trainer, exporters) must not notice which
database they talk to, and two copies drifted. The statements are the SQL both accept; what differs
is named in ``sql.Dialect``. Concurrency, the same on both:
- Every write is one transaction, committed (fsync) before it returns.
- A write that reads a session to change it locks that session's row first (``FOR UPDATE`` on
  Postgres, where replicas write at once; SQLite's write transaction already holds the file's only
  write lock), so writes to one session queue, and the trajectory revision check turns a lost race
  into ``StaleWriteError``.
- Inserts that may race use ``ON CONFLICT DO NOTHING`` and decide from the row count, never from an
  aborted transaction.
Token arrays are little-endian blobs (``rows.pack``): float64 logprobs round-trip bit-exactly and a
row moves between the databases byte for byte. JSON columns are text (``jsonb`` would reorder keys).

On Postgres, write order (``seq``) is handed out at insert time and transactions may commit out of
that order, so a page read with ``after`` while another replica inserts can miss a row that lands
behind the cursor; callers that must see every row (the trainer) filter by ``unconsumed`` instead.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from slime_server.buffer.migrations import SCHEMA_VERSION, migrated, schema_version
from slime_server.buffer.rows import (
    HEAD_COLUMNS,
    SESSION_COLUMNS,
    TRAJ_COLUMNS,
    head_from_row,
    owned,
    session_from_row,
    traj_from_row,
    traj_params,
)
from slime_server.buffer.schema import (
    Feedback,
    IdempotencyConflict,
    ImageBlob,
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
    TrajectoryHead,
    TrajectoryNotFound,
    TrajectoryStatus,
    now,
)
from slime_server.buffer.sql import Database, Tx, placeholders
from slime_server.buffer.store import DROPPED_STEP, TrajectoryStore, TurnWrite

_INSERT_TRAJECTORY = (
    "INSERT INTO trajectories (id, session_id, segment, branch, group_id, n_tokens, tokens, loss_mask, "
    "rollout_logprobs, weight_versions, routed_experts, images, turns, messages, tools_digest, reward, turn_rewards, "
    "status, consumed_step, metadata, revision, created_at, updated_at) VALUES (:id, :session_id, :segment, :branch, "
    ":group_id, :n_tokens, :tokens, :loss_mask, :rollout_logprobs, :weight_versions, :routed_experts, :images, :turns, "
    ":messages, :tools_digest, :reward, "
    ":turn_rewards, :status, :consumed_step, :metadata, :revision, :created_at, :updated_at) ON CONFLICT DO NOTHING")
_UPDATE_TRAJECTORY = (
    "UPDATE trajectories SET n_tokens = :n_tokens, tokens = :tokens, loss_mask = :loss_mask, "
    "rollout_logprobs = :rollout_logprobs, weight_versions = :weight_versions, routed_experts = :routed_experts, "
    "images = :images, turns = :turns, messages = :messages, "
    "tools_digest = :tools_digest, reward = :reward, turn_rewards = :turn_rewards, status = :status, "
    "metadata = :metadata, revision = :revision, updated_at = :updated_at "
    "WHERE id = :id AND session_id = :session_id AND revision = :old_revision AND status = 'open'")
# The dashboard's session list: newest first, with each session's trajectory count, tokens and last reward.
_RECENT_SESSIONS = (
    "SELECT s.id, s.status, s.group_id, s.created_at, s.updated_at, s.metadata, "
    "(SELECT COUNT(*) FROM trajectories t WHERE t.session_id = s.id) AS num_trajectories, "
    "(SELECT COALESCE(SUM(t.n_tokens), 0) FROM trajectories t WHERE t.session_id = s.id) AS num_tokens, "
    "(SELECT t.reward FROM trajectories t WHERE t.session_id = s.id AND t.reward IS NOT NULL "
    "ORDER BY t.seq DESC LIMIT 1) AS reward "
    "FROM sessions s ORDER BY s.created_at DESC, s.id DESC LIMIT ?")
# buffer pacing's count: status and consumed_step lead the pick index, so only unconsumed finished rows are visited
READY_COUNT_SQL = ("SELECT COUNT(*) AS n FROM trajectories WHERE status = 'finished' AND consumed_step IS NULL "
                   "AND reward IS NOT NULL")
_CHUNK = 500  # ids per IN list: far below both databases' parameter limits


class SQLTrajectoryStore(TrajectoryStore):
    """``TrajectoryStore`` over ``db``; safe to share between threads (and, on Postgres, hosts)."""

    SCHEMA_VERSION = SCHEMA_VERSION

    def __init__(self, db: Database) -> None:
        self._db = migrated(db)
        self._lock = db.dialect.for_update

    def schema_version(self) -> int:
        return self._db.read(schema_version)

    def integrity_check(self) -> str:
        """"ok", or what is wrong: the database's own page check (SQLite), the schema version, and
        that every packed token array holds exactly ``n_tokens`` elements (a partial or foreign write)."""
        def run(tx: Tx) -> str:
            if self._db.dialect.name == "sqlite":
                pages = tx.execute("PRAGMA integrity_check").fetchone()[0]
                if pages != "ok":
                    return pages
            version = schema_version(tx)
            if version != SCHEMA_VERSION:
                return f"schema version {version}, expected {SCHEMA_VERSION}"
            bad = tx.execute(
                "SELECT COUNT(*) AS n FROM trajectories WHERE length(tokens) <> 4 * n_tokens "
                "OR length(loss_mask) <> n_tokens OR length(rollout_logprobs) <> 8 * n_tokens "
                "OR length(weight_versions) <> 8 * n_tokens").fetchone()["n"]
            return "ok" if bad == 0 else f"{bad} trajectories have token arrays of the wrong length"
        return self._db.read(run, snapshot=True)

    def close(self) -> None:
        self._db.close()

    # ---------------------------------------------------------------- sessions
    def _session(self, tx: Tx, session_id: str, *, lock: bool = False) -> Session:
        """The session; with ``lock`` its row stays locked until commit, so writes to one session queue."""
        row = tx.execute(f"SELECT {SESSION_COLUMNS} FROM sessions WHERE id = ?" + (self._lock if lock else ""),
                         (session_id,)).fetchone()
        if row is None:
            raise SessionNotFound(f"session {session_id!r} not found")
        return session_from_row(row)

    @staticmethod
    def _insert_session(tx: Tx, s: Session) -> bool:
        """Insert ``s``; False (and nothing written) if the id is taken, even by a concurrent replica."""
        cur = tx.execute(
            "INSERT INTO sessions (id, group_id, metadata, status, key_hash, owner, segment_splits, created_at, "
            "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
            (s.id, s.group_id, json.dumps(s.metadata), s.status, s.key_hash, s.owner, s.segment_splits,
             s.created_at, s.updated_at))
        return cur.rowcount == 1

    def create_session(self, session_id: str | None = None, *, group_id: str | None = None,
                       metadata: dict[str, Any] | None = None, key_hash: str | None = None,
                       owner: str | None = None) -> Session:
        s = Session(id=session_id or f"sess-{uuid.uuid4().hex}", group_id=group_id, metadata=metadata or {},
                    key_hash=key_hash, owner=owner)

        def run(tx: Tx) -> None:
            if not self._insert_session(tx, s):
                raise SessionExistsError(f"session {s.id!r} already exists")
        self._db.write(run)
        return s

    def get_session(self, session_id: str) -> Session:
        return self._db.read(lambda tx: self._session(tx, session_id))

    def get_or_create_session(self, session_id: str, *, group_id: str | None = None,
                              metadata: dict[str, Any] | None = None, owner: str | None = None) -> Session:
        try:  # the common case reads only, so it never waits for a write lock
            return owned(self.get_session(session_id), owner)
        except SessionNotFound:
            pass

        def run(tx: Tx) -> Session:
            s = Session(id=session_id, group_id=group_id, metadata=metadata or {}, owner=owner)
            if self._insert_session(tx, s):
                return s
            return owned(self._session(tx, session_id), owner)  # another writer created it first
        return self._db.write(run)

    def close_session(self, session_id: str) -> Session:
        def run(tx: Tx) -> Session:
            self._session(tx, session_id, lock=True)
            self._close(tx, [session_id])
            return self._session(tx, session_id)
        return self._db.write(run)

    @staticmethod
    def _close(tx: Tx, session_ids: list[str]) -> None:
        t = now()
        for i in range(0, len(session_ids), _CHUNK):
            ids = session_ids[i:i + _CHUNK]
            tx.execute(f"UPDATE sessions SET status = 'closed', updated_at = ? WHERE id IN {placeholders(len(ids))}",
                       (t, *ids))
            tx.execute("UPDATE trajectories SET status = 'finished', updated_at = ?, revision = revision + 1 "
                       f"WHERE session_id IN {placeholders(len(ids))} AND status = 'open'", (t, *ids))

    def close_idle_sessions(self, idle_since: float, limit: int = 1000) -> list[str]:
        def run(tx: Tx) -> list[str]:
            # SKIP LOCKED (Postgres): a session another replica is writing right now is not idle; the next sweep
            rows = tx.execute("SELECT id FROM sessions WHERE status = 'open' AND updated_at < ? ORDER BY updated_at "
                              "LIMIT ?" + self._db.dialect.skip_locked, (idle_since, int(limit))).fetchall()
            ids = [r["id"] for r in rows]
            self._close(tx, ids)
            return ids
        return self._db.write(run)

    # ---------------------------------------------------------------- trajectories
    def get_trajectories(self, session_id: str) -> list[Trajectory]:
        def run(tx: Tx) -> list[Trajectory]:
            self._session(tx, session_id)
            rows = tx.execute(f"SELECT {TRAJ_COLUMNS} FROM trajectories WHERE session_id = ? ORDER BY segment, branch",
                              (session_id,)).fetchall()
            return [traj_from_row(r) for r in rows]
        return self._db.read(run)

    def get_trajectory(self, trajectory_id: str) -> Trajectory:
        row = self._db.read(lambda tx: tx.execute(f"SELECT {TRAJ_COLUMNS} FROM trajectories WHERE id = ?",
                                                  (trajectory_id,)).fetchone())
        if row is None:
            raise TrajectoryNotFound(f"trajectory {trajectory_id!r} not found")
        return traj_from_row(row)

    def write_turn(self, write: TurnWrite) -> list[Trajectory]:
        def run(tx: Tx) -> list[Trajectory]:
            t = now()
            stored: list[Trajectory] = []
            if write.create_session is not None:
                if write.create_session.id != write.session_id:
                    raise StoreError("create_session must be the turn's own session")
                if not self._insert_session(tx, write.create_session):
                    raise SessionExistsError(f"session {write.session_id!r} already exists")
            session = self._session(tx, write.session_id, lock=True)
            if session.status != "open":
                raise SessionClosedError(f"session {write.session_id!r} is closed")
            for traj in write.trajectories:
                if traj.session_id != write.session_id:
                    raise StoreError("a turn may only write trajectories of its own session")
                p = traj_params(traj, traj.revision + 1, t)
                if traj.revision == 0:
                    if tx.execute(_INSERT_TRAJECTORY, p).rowcount != 1:
                        raise StaleWriteError(f"trajectory {traj.id} (segment {traj.segment}, branch "
                                              f"{traj.branch}) was written concurrently")
                elif tx.execute(_UPDATE_TRAJECTORY, p).rowcount != 1:
                    raise StaleWriteError(f"trajectory {traj.id} changed since it was read")
                stored.append(traj.model_copy(update={"revision": traj.revision + 1, "updated_at": t}))
            for image in write.images:  # once per content hash, whoever sent it first
                tx.execute("INSERT INTO images (sha256, mime, width, height, data, created_at) VALUES (?, ?, ?, ?, ?, ?) "
                           "ON CONFLICT (sha256) DO NOTHING",
                           (image.sha256, image.mime, image.width, image.height, image.data, t))
            for ref in write.responses:
                tx.execute("INSERT INTO responses (response_id, choice, session_id, trajectory_id) VALUES (?, ?, ?, ?)",
                           (ref.response_id, ref.choice, write.session_id, ref.trajectory_id))
            if write.close_session:
                tx.execute("UPDATE trajectories SET status = 'finished', revision = revision + 1, updated_at = ? "
                           "WHERE session_id = ? AND status = 'open'", (t, write.session_id))
                stored = [s.model_copy(update={"status": "finished", "revision": s.revision + 1}) for s in stored]
            tx.execute("UPDATE sessions SET updated_at = ?, segment_splits = segment_splits + ?, "
                       "status = CASE WHEN ? = 1 THEN 'closed' ELSE status END WHERE id = ?",
                       (t, int(write.segment_split), int(write.close_session), write.session_id))
            return stored
        return self._db.write(run)

    def get_images(self, hashes: list[str]) -> dict[str, ImageBlob]:
        wanted = sorted(set(hashes))

        def run(tx: Tx) -> dict[str, ImageBlob]:
            out: dict[str, ImageBlob] = {}
            for i in range(0, len(wanted), _CHUNK):
                chunk = wanted[i:i + _CHUNK]
                for row in tx.execute("SELECT sha256, mime, width, height, data FROM images WHERE sha256 IN "
                                      f"{placeholders(len(chunk))}", chunk).fetchall():
                    out[row["sha256"]] = ImageBlob(sha256=row["sha256"], mime=row["mime"], width=row["width"],
                                                   height=row["height"], data=bytes(row["data"]))
            return out
        return self._db.read(run) if wanted else {}

    def find_by_response_id(self, response_id: str) -> list[tuple[Trajectory, int]]:
        columns = ", ".join("t." + c.strip() for c in TRAJ_COLUMNS.split(","))
        rows = self._db.read(lambda tx: tx.execute(
            f"SELECT {columns} FROM responses r JOIN trajectories t ON t.id = r.trajectory_id "
            "WHERE r.response_id = ? ORDER BY r.choice", (response_id,)).fetchall())
        if not rows:
            raise ResponseNotFound(f"response {response_id!r} not found")
        out = []
        for traj in map(traj_from_row, rows):
            index = next(i for i, turn in enumerate(traj.turns) if turn.response_id == response_id)
            out.append((traj, index))
        return out

    def list_trajectories(self, *, status: TrajectoryStatus | None = None, rewarded: bool | None = None,
                          unconsumed: bool | None = None, session_id: str | None = None,
                          limit: int = 100, after: str | None = None) -> list[Trajectory]:
        sql, args = self._listing(TRAJ_COLUMNS, status=status, rewarded=rewarded, unconsumed=unconsumed,
                                  session_id=session_id, limit=limit, after=after)
        rows = self._db.read(lambda tx: tx.execute(sql, args).fetchall())
        return [traj_from_row(r) for r in rows]

    def list_heads(self, *, status: TrajectoryStatus | None = None, rewarded: bool | None = None,
                   unconsumed: bool | None = None, limit: int = 100) -> list[TrajectoryHead]:
        sql, args = self._listing(HEAD_COLUMNS, status=status, rewarded=rewarded, unconsumed=unconsumed, limit=limit)
        rows = self._db.read(lambda tx: tx.execute(sql, args).fetchall())
        return [head_from_row(r) for r in rows]

    def _listing(self, columns: str, *, status: TrajectoryStatus | None = None, rewarded: bool | None = None,
                 unconsumed: bool | None = None, session_id: str | None = None, limit: int = 100,
                 after: str | None = None) -> tuple[str, list[Any]]:
        """The SELECT of a listing in write order, and its parameters."""
        where: list[str] = []
        args: list[Any] = []
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
        sql = f"SELECT {columns} FROM trajectories"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq LIMIT ?"
        args.append(max(0, int(limit)))
        return sql, args

    def get_trajectories_by_id(self, trajectory_ids: list[str]) -> list[Trajectory]:
        ids = list(dict.fromkeys(trajectory_ids))

        def run(tx: Tx) -> list[Any]:
            rows: list[Any] = []
            for i in range(0, len(ids), _CHUNK):
                chunk = ids[i:i + _CHUNK]
                rows += tx.execute(f"SELECT {TRAJ_COLUMNS} FROM trajectories WHERE id IN {placeholders(len(chunk))}",
                                   chunk).fetchall()
            return rows
        found = {t.id: t for t in map(traj_from_row, self._db.read(run) if ids else [])}
        missing = [i for i in ids if i not in found]
        if missing:
            raise TrajectoryNotFound(f"trajectories not found: {missing[:5]}")
        return [found[i] for i in trajectory_ids]

    def mark_consumed(self, trajectory_ids: list[str], train_step: int, job_id: str | None = None) -> int:
        ids = list(dict.fromkeys(trajectory_ids))

        def run(tx: Tx) -> int:
            # one statement per chunk: a trajectory another replica (or trainer) consumed first stays with it
            t, changed = now(), 0
            for i in range(0, len(ids), _CHUNK):
                chunk = ids[i:i + _CHUNK]
                changed += tx.execute(
                    "UPDATE trajectories SET consumed_step = ?, consumed_job = ?, revision = revision + 1, "
                    f"updated_at = ? WHERE id IN {placeholders(len(chunk))} AND consumed_step IS NULL",
                    (train_step, job_id, t, *chunk)).rowcount
            return changed
        return self._db.write(run) if ids else 0

    def release_consumed(self, after_step: int, job_id: str | None = None) -> int:
        return self._db.write(lambda tx: tx.execute(
            "UPDATE trajectories SET consumed_step = NULL, consumed_job = NULL, revision = revision + 1, "
            f"updated_at = ? WHERE consumed_step > ? AND consumed_job {self._db.dialect.null_safe_eq} CAST(? AS TEXT)",
            (now(), max(after_step, DROPPED_STEP), job_id)).rowcount)

    # ---------------------------------------------------------------- rewards and feedback
    def set_reward(self, session_id: str, *, reward: float | None = None,
                   turn_rewards: list[float] | None = None, idempotency_key: str | None = None,
                   finish: bool = False) -> bool:
        if reward is None and turn_rewards is None:
            raise StoreError("give a reward or turn_rewards")
        event = RewardEvent(idempotency_key=idempotency_key or f"auto-{uuid.uuid4().hex}", session_id=session_id,
                            reward=reward, turn_rewards=turn_rewards)

        def run(tx: Tx) -> bool:
            self._session(tx, session_id, lock=True)
            cur = tx.execute(
                "INSERT INTO reward_events (idempotency_key, session_id, reward, turn_rewards, created_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (idempotency_key) DO NOTHING",
                (event.idempotency_key, session_id, reward,
                 None if turn_rewards is None else json.dumps(turn_rewards), event.created_at))
            if cur.rowcount == 0:  # the key was applied before (possibly by another replica, just now)
                row = tx.execute("SELECT session_id, reward, turn_rewards FROM reward_events "
                                 "WHERE idempotency_key = ?", (event.idempotency_key,)).fetchone()
                seen = (row["session_id"], row["reward"], json.loads(row["turn_rewards"] or "null"))
                if seen != (session_id, reward, turn_rewards):
                    raise IdempotencyConflict(f"idempotency key {event.idempotency_key!r} was used with "
                                              "a different reward")
                return False
            self._apply_reward(tx, session_id, reward, turn_rewards)
            if finish:
                self._close(tx, [session_id])
            return True
        return self._db.write(run)

    @staticmethod
    def _apply_reward(tx: Tx, session_id: str, reward: float | None, turn_rewards: list[float] | None) -> None:
        t = now()
        if reward is not None:
            tx.execute("UPDATE trajectories SET reward = ?, updated_at = ?, revision = revision + 1 "
                       "WHERE session_id = ?", (reward, t, session_id))
        if turn_rewards is None:
            return
        order = [r["response_id"] for r in tx.execute(
            "SELECT response_id FROM responses WHERE session_id = ? GROUP BY response_id ORDER BY MIN(seq)",
            (session_id,)).fetchall()]
        if len(turn_rewards) != len(order):
            raise StoreError(f"turn_rewards has {len(turn_rewards)} values but the session has "
                             f"{len(order)} responses")
        by_response = dict(zip(order, turn_rewards, strict=True))
        rows = tx.execute("SELECT id, turns, turn_rewards FROM trajectories WHERE session_id = ? ORDER BY seq",
                          (session_id,)).fetchall()
        for row in rows:
            turns = json.loads(row["turns"])
            old = json.loads(row["turn_rewards"])
            new = [by_response.get(turn["response_id"], old[i] if i < len(old) else None)
                   for i, turn in enumerate(turns)]
            tx.execute("UPDATE trajectories SET turn_rewards = ?, updated_at = ?, revision = revision + 1 "
                       "WHERE id = ?", (json.dumps(new), t, row["id"]))

    def add_feedback(self, response_id: str, *, thumb: Thumb | None = None, score: float | None = None,
                     comment: str | None = None) -> Feedback:
        def run(tx: Tx) -> Feedback:
            row = tx.execute("SELECT session_id FROM responses WHERE response_id = ? LIMIT 1",
                             (response_id,)).fetchone()
            if row is None:
                raise ResponseNotFound(f"response {response_id!r} not found")
            fb = Feedback(response_id=response_id, session_id=row["session_id"], thumb=thumb, score=score,
                          comment=comment)
            tx.execute("INSERT INTO feedback (id, response_id, session_id, thumb, score, comment, created_at) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (fb.id, fb.response_id, fb.session_id, fb.thumb, fb.score, fb.comment, fb.created_at))
            return fb
        return self._db.write(run)

    def get_feedback(self, response_id: str) -> list[Feedback]:
        rows = self._db.read(lambda tx: tx.execute(
            "SELECT id, response_id, session_id, thumb, score, comment, created_at FROM feedback "
            f"WHERE response_id = ? ORDER BY created_at, {self._db.dialect.insert_order}", (response_id,)).fetchall())
        return [Feedback.model_validate(dict(r)) for r in rows]

    # ---------------------------------------------------------------- stored API responses
    def put_stored_response(self, response: StoredResponse) -> None:
        self._db.write(lambda tx: tx.execute(
            "INSERT INTO stored_responses (id, session_id, owner, previous_response_id, body, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET session_id = excluded.session_id, "
            "owner = excluded.owner, previous_response_id = excluded.previous_response_id, body = excluded.body, "
            "created_at = excluded.created_at",
            (response.id, response.session_id, response.owner, response.previous_response_id,
             json.dumps(response.body, ensure_ascii=False), response.created_at)))

    def get_stored_response(self, response_id: str) -> StoredResponse:
        row = self._db.read(lambda tx: tx.execute(
            "SELECT id, session_id, owner, previous_response_id, body, created_at FROM stored_responses "
            "WHERE id = ?", (response_id,)).fetchone())
        if row is None:
            raise ResponseNotFound(f"response {response_id!r} not found")
        return StoredResponse.model_validate({**dict(row), "body": json.loads(row["body"])})

    # ---------------------------------------------------------------- housekeeping
    def recent_sessions(self, limit: int) -> list[SessionSummary]:
        rows = self._db.read(lambda tx: tx.execute(_RECENT_SESSIONS, (max(0, int(limit)),)).fetchall())
        return [SessionSummary.model_validate({**dict(r), "metadata": json.loads(r["metadata"] or "{}"),
                                               "num_tokens": int(r["num_tokens"])}) for r in rows]

    def count_open_rewarded_sessions(self) -> int:
        return int(self._db.read(lambda tx: tx.execute(
            "SELECT COUNT(DISTINCT session_id) AS n FROM trajectories WHERE status = 'open' "
            "AND consumed_step IS NULL AND reward IS NOT NULL").fetchone()["n"]))

    def count_ready(self) -> int:
        return int(self._db.read(lambda tx: tx.execute(READY_COUNT_SQL).fetchone()["n"]))

    def stats(self) -> StoreStats:
        def run(tx: Tx) -> StoreStats:
            s = tx.execute("SELECT COUNT(*) AS n, COALESCE(SUM(CASE WHEN status = 'open' THEN 1 ELSE 0 END), 0) AS "
                           "open, COALESCE(SUM(segment_splits), 0) AS splits FROM sessions").fetchone()
            by_status = {r["status"]: int(r["n"]) for r in tx.execute(
                "SELECT status, COUNT(*) AS n FROM trajectories GROUP BY status").fetchall()}
            t = tx.execute(
                "SELECT COALESCE(SUM(CASE WHEN reward IS NOT NULL THEN 1 ELSE 0 END), 0) AS rewarded, "
                "COALESCE(SUM(n_tokens), 0) AS tokens, COALESCE(SUM(CASE WHEN status = 'finished' AND reward IS NOT "
                "NULL AND consumed_step IS NULL THEN 1 ELSE 0 END), 0) AS ready FROM trajectories").fetchone()
            fb = tx.execute("SELECT COUNT(*) AS n FROM feedback").fetchone()["n"]
            return StoreStats(sessions=int(s["n"]), open_sessions=int(s["open"]), segment_splits=int(s["splits"]),
                              trajectories=by_status, rewarded=int(t["rewarded"]), tokens=int(t["tokens"]),
                              unconsumed_finished_rewarded=int(t["ready"]), feedback=int(fb))
        return self._db.read(run, snapshot=True)  # one snapshot for all counts
