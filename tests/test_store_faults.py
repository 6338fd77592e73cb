"""A full or read-only trajectory store: requests fail clearly (503 ``store_unavailable``), nothing stored
is lost or corrupted, and the same server serves again once the fault is lifted.

Two ways to break the disk:
- ``FailingDisk`` (always runs): every SQLite connection the store opens goes through it. "read_only" turns
  on SQLite's own ``PRAGMA query_only`` (SQLite itself refuses each write with SQLITE_READONLY, as on a
  read-only mount); "disk_full" makes the COMMIT of a write transaction fail with SQLITE_FULL, the moment
  a full disk hits a WAL database (its frames are appended at commit), leaving the transaction open.
  Tests run as root, where chmod stops nothing, and a mount cannot turn read-only under open files.
- a real tmpfs with a size limit, filled up (root only; skipped where ``mount`` is not permitted): SQLite
  meets ENOSPC itself, fails with SQLITE_FULL and rolls the transaction back on its own.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from slime_server.buffer.schema import StoreUnavailable
from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from tests._gateway_helpers import MODEL, inprocess_gateway, start_gateway, stop_gateway
from tests._sessions_helpers import FakeEngine

FAULTS = ["read_only", "disk_full"]
SQLITE_FULL = 13


class FailingDisk:
    """The disk under every SQLite file below ``root`` while installed (``fault`` None: a healthy disk)."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.fault: str | None = None

    def connect(self, real_connect: Any) -> Any:
        disk = self

        class Connection(sqlite3.Connection):
            query_only = False
            writing = False

            def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
                read_only = disk.fault == "read_only"
                if read_only != self.query_only:
                    super().execute(f"PRAGMA query_only = {int(read_only)}")
                    self.query_only = read_only
                verb = sql.lstrip().upper()
                if verb.startswith("BEGIN"):
                    self.writing = verb.startswith("BEGIN IMMEDIATE")
                if disk.fault == "disk_full" and verb.startswith("COMMIT") and self.writing:
                    err = sqlite3.OperationalError("database or disk is full")
                    err.sqlite_errorcode, err.sqlite_errorname = SQLITE_FULL, "SQLITE_FULL"
                    raise err
                return super().execute(sql, *args)

        def connect(path: Any, *args: Any, **kwargs: Any) -> sqlite3.Connection:
            if str(path).startswith(disk.root):
                kwargs["factory"] = Connection
            return real_connect(path, *args, **kwargs)

        return connect


@pytest.fixture
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FailingDisk:
    d = FailingDisk(tmp_path)
    monkeypatch.setattr(sqlite3, "connect", d.connect(sqlite3.connect))
    return d


def integrity(db: Path) -> str:
    with sqlite3.connect(db) as conn:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]


# ----------------------------------------------------------------------------- the store alone


@pytest.mark.parametrize("fault", FAULTS)
def test_store_refuses_writes_and_keeps_what_it_had(fault: str, disk: FailingDisk, tmp_path: Path,
                                                    tiny_model_path: Path) -> None:
    from slime_server.gateway.chat_template import ChatRenderer
    from slime_server.gateway.sessions import SessionManager

    renderer = ChatRenderer(tiny_model_path)
    engine = FakeEngine(renderer)
    store = SQLiteTrajectoryStore(tmp_path / "s.db")
    sm = SessionManager(store, renderer)

    def turn(session: str, text: str) -> Any:
        prepared = sm.prepare_turn(session, [{"role": "user", "content": text}])
        return sm.commit_turn(prepared, [engine.choice(engine.response_id(), 0, "ok")])

    store.create_session("s-1")
    turn("s-1", "hello")
    assert store.set_reward("s-1", reward=1.0, idempotency_key="r-1")
    before = store.get_trajectories("s-1")

    disk.fault = fault
    for write in (lambda: turn("s-1", "hello again"), lambda: turn("s-new", "hi"),
                  lambda: store.set_reward("s-1", reward=0.0, idempotency_key="r-2"),
                  lambda: store.create_session("s-2"), lambda: store.close_session("s-1")):
        with pytest.raises(StoreUnavailable) as info:
            write()
        assert info.value.status_code == 503 and info.value.code == "store_unavailable"
    assert store.get_trajectories("s-1") == before  # reads still work, and nothing half-written shows

    disk.fault = None
    assert integrity(tmp_path / "s.db") == "ok"
    assert store.get_trajectories("s-1") == before
    assert store.set_reward("s-1", reward=0.5, idempotency_key="r-2")  # the refused key was never stored
    turn("s-1", "hello again")  # the same connections write again: no transaction was left open
    trajs = store.get_trajectories("s-1")
    assert len(trajs) == 2 and trajs[0].reward == 0.5  # a new segment: that message does not extend the first
    store.close()


# ----------------------------------------------------------------------------- through the gateway


def chat(http: httpx.Client, session: str | None, content: str | list[dict], **kw: Any) -> httpx.Response:
    headers = {"X-Session-Id": session} if session else {}
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    return http.post("/v1/chat/completions", headers=headers, json={
        "model": MODEL, "messages": messages, "max_tokens": 4, **kw})


def assert_store_unavailable(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "store_unavailable" and "trajectory store" in err["message"], err


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_gateway_answers_503_and_recovers(fault: str, disk: FailingDisk, tmp_path: Path,
                                          router_url: str, tiny_model_path: Path) -> None:
    db = tmp_path / "traj.db"
    with inprocess_gateway(router_url, tiny_model_path, db) as (url, _), \
            httpx.Client(base_url=url, timeout=60) as http:  # a hang fails the test
        session = http.post("/v1/sessions", json={}).json()["id"]
        first = chat(http, session, "hello")
        assert first.status_code == 200, first.text
        assert http.post(f"/v1/sessions/{session}/reward", json={"reward": 1.0, "final": False}).status_code == 200
        stored = http.get(f"/v1/sessions/{session}/trajectory").json()
        convo = [{"role": "user", "content": "hello"}, first.json()["choices"][0]["message"],
                 {"role": "user", "content": "and now?"}]

        disk.fault = fault
        t0 = time.monotonic()
        assert_store_unavailable(chat(http, session, convo))
        assert_store_unavailable(chat(http, None, "one-shot"))
        assert_store_unavailable(http.post(f"/v1/sessions/{session}/reward", json={"reward": 0.0},
                                           headers={"Idempotency-Key": "late"}))
        assert_store_unavailable(http.post("/v1/sessions", json={}))
        assert_store_unavailable(http.post(f"/v1/responses/{first.json()['id']}/feedback", json={"thumb": "up"}))
        stream = chat(http, session, convo, stream=True)  # the answer began before the record failed
        events = [line for line in stream.text.splitlines() if line.startswith("data:")]
        assert '"store_unavailable"' in events[-2] and events[-1] == "data: [DONE]", events[-3:]
        assert not any('"finish_reason"' in e for e in events)  # never looks like a finished answer
        assert time.monotonic() - t0 < 30
        assert http.get(f"/v1/sessions/{session}/trajectory").json() == stored  # reads are served

        disk.fault = None
        assert integrity(db) == "ok"
        assert http.get(f"/v1/sessions/{session}/trajectory").json() == stored
        again = chat(http, session, convo)  # extends the acknowledged turn, as if the failed one never was
        assert again.status_code == 200, again.text
        r = http.post(f"/v1/sessions/{session}/reward", json={"reward": 0.0}, headers={"Idempotency-Key": "late"})
        assert r.status_code == 200 and r.json()["changed"], r.text
        assert chat(http, None, "one-shot").status_code == 200
    after = SQLiteTrajectoryStore(db)
    [traj] = after.get_trajectories(session)
    assert traj.reward == 0.0
    assert [turn.response_id for turn in traj.turns] == [first.json()["id"], again.json()["id"]]
    after.close()


# ----------------------------------------------------------------------------- a real full disk


@contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> Path:
    """Write zeros to ``path`` until the filesystem has no space left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as e:
        assert e.errno == 28, e  # ENOSPC
    try:
        while True:
            os.write(fd, b"\0")
    except OSError:
        pass
    os.close(fd)
    return path


@pytest.mark.slow
def test_real_full_disk(tmp_path: Path, router_url: str, tiny_model_path: Path) -> None:
    """A gateway process whose SQLite file lives on a 4 MiB tmpfs that fills up."""
    with small_tmpfs(tmp_path / "disk", "4m") as mnt:
        gw = start_gateway(router_url, tiny_model_path, mnt / "traj.db", tmp_path / "gateway.log")
        try:
            with httpx.Client(base_url=gw.url, timeout=60) as http:
                session = http.post("/v1/sessions", json={}).json()["id"]
                acked = [chat(http, session, f"turn {i}") for i in range(3)]
                assert all(r.status_code == 200 for r in acked), [r.text for r in acked]
                assert http.post(f"/v1/sessions/{session}/reward", json={"reward": 1.0, "final": False}).status_code == 200
                stored = http.get(f"/v1/sessions/{session}/trajectory").json()

                filler = fill(mnt / "filler")
                assert_store_unavailable(chat(http, session, "no room"))
                assert_store_unavailable(chat(http, None, "no room"))
                assert_store_unavailable(http.post(f"/v1/sessions/{session}/reward", json={"reward": 0.0}))
                assert http.get(f"/v1/sessions/{session}/trajectory").json() == stored

                filler.unlink()
                assert integrity(mnt / "traj.db") == "ok"
                assert chat(http, session, "room again").status_code == 200
                r = http.post(f"/v1/sessions/{session}/reward", json={"reward": 0.5})
                assert r.status_code == 200, r.text
        finally:
            stop_gateway(gw)
        store = SQLiteTrajectoryStore(mnt / "traj.db")
        assert store.integrity_check() == "ok"
        trajs = store.get_trajectories(session)
        ids = [turn.response_id for t in trajs for turn in t.turns]
        assert ids[:3] == [r.json()["id"] for r in acked] and len(ids) == 4
        assert {t.reward for t in trajs} == {0.5}
        store.close()
