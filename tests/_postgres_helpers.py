"""A throwaway PostgreSQL cluster for the Postgres store tests (Debian's ``postgresql`` package).

Why a real server: the store's concurrency guarantees are row locks, ``ON CONFLICT`` and WAL
recovery of Postgres itself; a mock would test nothing. ``initdb`` and ``postgres`` refuse to run as
root, so as root (CI) they run as the ``postgres`` OS user on a directory chowned to it. Set
``SLIME_TEST_POSTGRES_URL`` (a user allowed to CREATE DATABASE) to use an existing server instead.
"""

from __future__ import annotations

import glob
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path


def find_bindir() -> Path | None:
    """Directory holding initdb/pg_ctl: Debian's versioned dirs (newest first), then PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: [int(x) for x in Path(p).parts[-3].split(".") if x.isdigit()], reverse=True)
    if found:
        return Path(found[0]).parent
    on_path = shutil.which("initdb")
    return Path(on_path).parent if on_path else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgCluster:
    """initdb + pg_ctl start on a free port; ``stop``/``start``/``crash`` for the recovery tests."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.as_root = os.geteuid() == 0
        if self.as_root:
            try:
                self._pg_user = pwd.getpwnam("postgres")
            except KeyError as e:
                raise RuntimeError("running as root but there is no 'postgres' OS user to run the server") from e
        self.dir = Path(tempfile.mkdtemp(prefix="slime-pg-"))
        self.data = self.dir / "data"
        self.port = _free_port()
        if self.as_root:
            os.chown(self.dir, self._pg_user.pw_uid, self._pg_user.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync",
                  "-E", "UTF8", "--locale=C")
        self.start()

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / tool), *args]
        if self.as_root:
            runuser = shutil.which("runuser")
            cmd = ([runuser, "-u", "postgres", "--", *cmd] if runuser
                   else ["su", "postgres", "-s", "/bin/sh", "-c", shlex.join(cmd)])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=self.dir)
        if check and proc.returncode != 0:
            log = (self.dir / "server.log").read_text(errors="replace")[-2000:] if (self.dir / "server.log").exists() else ""
            raise RuntimeError(f"{tool} failed ({proc.returncode}): {proc.stdout}{proc.stderr}\n{log}")
        return proc

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "server.log"), "-w", "-t", "60", "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1", "start")

    def stop(self, mode: str = "fast") -> None:
        """``mode`` "immediate" is a crash: no checkpoint, recovery replays the WAL on the next start."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


def admin_execute(admin_url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql)


def create_database(admin_url: str) -> tuple[str, str]:
    """A fresh empty database on the server of ``admin_url`` (a postgresql:// URL): (its name, its URL)."""
    from urllib.parse import urlsplit

    name = f"slime_test_{uuid.uuid4().hex[:12]}"
    admin_execute(admin_url, f'CREATE DATABASE "{name}"')
    return name, urlsplit(admin_url)._replace(path=f"/{name}").geturl()


def drop_database(admin_url: str, name: str) -> None:
    admin_execute(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
