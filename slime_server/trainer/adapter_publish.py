"""A LoRA job that publishes adapters instead of pushing weights (``lora.publish = 'adapter'``): the loop's side of it.

Each version of an adapter is loaded into every engine under a new name (``versioned(alias, version)``; nothing
paused), its alias is moved to it in the store every gateway reads, and the name the alias left is unloaded a few
seconds later, off the loop's thread (the engines wait for its requests; gateways' alias reads expire first).

A job publishes one alias (``lora.per = 'job'``), or one per user (``lora.per = 'user'``: each user's slot of the
stacked adapters under ``user_alias(user)``; a step publishes the users it trained, a restored job or a
restarted engine gets them all).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from slime_server.buffer.adapter_store import user_alias
from slime_server.trainer.user_slots import UserSlots

log = logging.getLogger(__name__)
UNLOAD_AFTER_S = 3.0  # > the gateway's alias cache (gateway/adapters.ALIAS_TTL_S)


class AdapterTrainer(Protocol):
    def push_adapter(self, engine_urls: Sequence[str], name: str, adapter: int | None = None) -> dict[str, Any]: ...

    def save_adapter(self, path: str, base_model: str | None = None, adapter: int | None = None,
                     with_adam: bool = False) -> str: ...


@dataclass
class AdapterPublication:
    """Where a job's adapter versions go (built by ``jobs/adapters.py``): ``versioned(alias, version)`` names a
    version on the engines, ``publish(alias, name, version)`` points the alias at it and returns the name it left,
    ``unload(name)`` removes a name from the engines, ``saved(alias, version, path)`` records a PEFT directory a
    restart loads again. ``user_slots``: a per-user job's number of users (0: one adapter, ``alias``)."""

    alias: str
    versioned: Callable[[str, int], str]
    publish: Callable[[str, str, int], str | None]
    unload: Callable[[str], None]
    saved: Callable[[str, int, str], None]
    save_dir: Path  # where the versions a job ends on are saved (checkpoints hold theirs)
    user_slots: int = 0


class AdapterPublisher:
    def __init__(self, publication: AdapterPublication, users: UserSlots | None,
                 on_event: Callable[[str, dict[str, Any]], None]) -> None:
        self.pub, self.users, self.on_event = publication, users, on_event
        self._unloads: list[threading.Thread] = []  # left versions waiting out the gateways' alias reads

    def _targets(self, users: Sequence[str] | None) -> list[tuple[str, int | None, str | None]]:
        """(alias, adapter slot, user) of each adapter to publish: the job's one, or ``users``' (None: all)."""
        if self.users is None:
            return [(self.pub.alias, None, None)]
        chosen = list(self.users.state.users) if users is None else users
        return [(user_alias(u), self.users.slot(u), u) for u in chosen]

    def publish(self, trainer: AdapterTrainer, urls: Sequence[str], version: int,
                users: Sequence[str] | None = None) -> dict[str, Any]:
        """``version`` of each adapter into every engine, then each alias moved to it; the left names unloaded
        later. The stats summed over the adapters."""
        totals: dict[str, Any] = {"seconds": 0.0, "bytes": 0}
        published = []
        for alias, slot, user in self._targets(users):
            name = self.pub.versioned(alias, version)
            stats = trainer.push_adapter(urls, name, slot)
            previous = self.pub.publish(alias, name, version)
            if user is not None and self.users is not None:
                self.users.published(user, version)
            totals["seconds"] += float(stats.get("seconds") or 0.0)
            totals["bytes"] += int(stats.get("bytes") or 0)
            totals["mode"] = stats.get("mode")  # adapter: by reference; adapter-staged: some engine loaded files
            if previous and previous != name:
                unload = threading.Thread(target=self._unload_later, args=(previous,), name=f"unload-{previous}",
                                          daemon=True)
                unload.start()
                self._unloads = [t for t in self._unloads if t.is_alive()] + [unload]
            published.append((alias, name, previous))
        if self.users is None:
            alias, name, previous = published[0]
            self.on_event("adapter_published", {"alias": alias, "name": name, "version": version,
                                                "previous": previous, "engines": len(urls), **totals})
        elif published:
            self.on_event("user_adapters_published", {"aliases": [a for a, _, _ in published], "version": version,
                                                      "engines": len(urls), **totals,
                                                      "waiting_users": len(self.users.waiting_users)})
        return totals

    def sync(self, trainer: AdapterTrainer, url: str, version: int) -> dict[str, Any]:
        """A restarted engine lacks every adapter: each alias's current version into it (base weights never
        moved)."""
        stats: dict[str, Any] = {"seconds": 0.0}
        for alias, slot, user in self._targets(None):
            current: int | None = version
            if user is not None and self.users is not None:  # a user trained but not published yet has none
                current = self.users.current(user)
            if current is None:
                continue
            stats["seconds"] += float(trainer.push_adapter([url], self.pub.versioned(alias, current), slot)
                                      .get("seconds") or 0.0)
        return stats

    def save(self, trainer: AdapterTrainer, version: int, directory: Path | None = None) -> None:
        """Each adapter at ``version`` as a PEFT directory (under ``directory``, default the job's save dir) that a
        restart or an eviction loads again: the aliases outlive the job."""
        for alias, slot, _ in self._targets(None):
            try:
                self._save(trainer, alias, slot, version, directory or self.pub.save_dir)
            except Exception as e:  # noqa: BLE001 - a dead rank: the last checkpoint's adapter stands
                log.warning("could not save adapter %s version %s: %r", alias, version, e)
                return

    def park(self, trainer: AdapterTrainer, user: str, slot: int, version: int) -> str:
        """``user``'s adapter (slot ``slot``) saved as a PEFT directory before the slot goes to another user; its
        alias records it as saved (under their newest published version, what the engines serve), so it comes
        back after a restart; its Adam moments and step count beside it, so that their next step is the one they
        would have taken had they kept the slot. Returns the directory."""
        assert self.users is not None
        shown = self.users.current(user)
        return self._save(trainer, user_alias(user), slot, version if shown is None else shown,
                          self.pub.save_dir / "parked", with_adam=True)

    def _save(self, trainer: AdapterTrainer, alias: str, slot: int | None, version: int, directory: Path,
              with_adam: bool = False) -> str:
        """One adapter as ``directory``/<its versioned name>, recorded on its alias as saved at ``version``."""
        path = directory / self.pub.versioned(alias, version)
        trainer.save_adapter(str(path), None, slot, with_adam)
        self.pub.saved(alias, version, str(path))
        return str(path)

    def finish_unloads(self, timeout: float = 2 * UNLOAD_AFTER_S + 60) -> None:
        """Wait for the left versions' unloads (at a job's end: the engines' client closes after it, and a version
        left in the engines would hold one of their adapter slots until they restart)."""
        deadline = time.monotonic() + timeout
        for t in self._unloads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._unloads = [t for t in self._unloads if t.is_alive()]

    def _unload_later(self, name: str) -> None:
        """Unload a left version once every gateway has stopped routing new requests to it (their alias reads
        expire after ``UNLOAD_AFTER_S``; a request that still reaches it is sent again by the gateway)."""
        time.sleep(UNLOAD_AFTER_S)
        self.pub.unload(name)
