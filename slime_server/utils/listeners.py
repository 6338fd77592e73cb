"""Whether a process (or one of its session) is the one listening on a TCP port, read from Linux's /proc.

Why: a launcher picks a free port, then starts a server that binds it seconds later (after loading a model).
Meanwhile another process can take the port, and a readiness poll of the URL is then answered by that
process: the launcher took a stranger for its server (CI: an engine's /health answered by another test's
server, the engine itself dead of "address already in use", and the first weight push sent to the
stranger). ``owns_listener`` tells the two apart; off Linux it cannot tell and says None.
"""

from __future__ import annotations

import os
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def listening_inodes(port: int, pid: int | str = "self") -> set[int] | None:
    """Socket inodes listening on ``port`` (IPv4 and IPv6) in ``pid``'s network namespace, or None where
    /proc cannot say."""
    found: set[int] = set()
    read_any = False
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        read_any = True
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == _LISTEN and int(f[1].rsplit(":", 1)[1], 16) == port:
                found.add(int(f[9]))
    return found if read_any else None


def _session(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[3])  # fields after comm: state ppid pgrp session


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def owns_listener(pid: int, port: int) -> bool | None:
    """True when ``pid``, or a process of its session (a server it forked), listens on ``port``; False when
    another process does or none yet; None where /proc cannot tell (not Linux)."""
    inodes = listening_inodes(port, pid)  # its own network namespace's table (it may run in another)
    if inodes is None:
        return None
    if not inodes:
        return False
    session = _session(pid)
    pids = [pid]
    if session is not None and session == pid:  # a session leader (start_new_session): its whole session
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != pid and _session(int(entry)) == session:
                pids.append(int(entry))
    return any(_socket_inodes(p) & inodes for p in pids)
