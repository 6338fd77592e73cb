"""A per-user LoRA job (``lora.per = 'user'``): whose each buffered sample is, which of the trainer's stacked adapters
trains it, and how stale it is for its user.

A sample's user is its session's owner when that owner is a user (``Principal.user``: a minted agent key,
``key:<id>``, or a front end's user, ``key:<front end>/<user>``); samples of no user (the admin, the shared
configured key, open access) have no adapter to train and are dropped. Each user gets the first free slot the
first time a step trains them, and keeps it (``LoopState.users``, persisted with the job). When every slot is
taken, newcomers' samples stay in the buffer, untrained and counted (``waiting_users``), until the job is
restarted with more ``lora.adapters``.

Staleness is counted in the user's own adapter versions: a sample is as many versions old as their adapter was
published since the version that generated it, not the job's step count (other users' updates do not age it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from slime_server.trainer.settings import LoopState, UserSlot
from slime_server.trainer.types import TrainSample

USER_VERSIONS_KEPT = 64  # each user's newest published versions: staleness beyond this many is counted as this many
_OWNERS_KEPT = 100_000  # session owners remembered (they never change); the cache starts over beyond this


class HasSession(Protocol):
    @property
    def session_id(self) -> str: ...


def is_user(owner: str | None) -> bool:
    """Whether a session owner is a user (``Principal.user``'s forms), as opposed to the admin or a shared key."""
    return bool(owner) and str(owner).startswith("key:")


T = TypeVar("T", bound=HasSession)


class UserSlots:
    def __init__(self, state: LoopState, capacity: int, owner_of: Callable[[str], str | None]) -> None:
        self.state, self.capacity = state, capacity
        self._owner_of = owner_of  # a session's owner (a store read; cached here)
        self._owners: dict[str, str | None] = {}
        self.waiting_users: set[str] = set()  # users with samples but no slot (every slot taken)

    def user_of(self, item: HasSession) -> str | None:
        sid = item.session_id
        if sid not in self._owners:
            if len(self._owners) >= _OWNERS_KEPT:
                self._owners.clear()
            owner = self._owner_of(sid)
            self._owners[sid] = owner if is_user(owner) else None
        return self._owners[sid]

    def split(self, pool: Sequence[T]) -> tuple[list[T], list[T]]:
        """``pool`` (buffer order) as (the samples a step may take: users with a slot, or one free for them; the
        samples of no user). Samples of users beyond the free slots are in neither: they wait."""
        free = self.capacity - len(self.state.users)
        newcomers: set[str] = set()
        trainable: list[T] = []
        unowned: list[T] = []
        waiting: set[str] = set()
        for item in pool:
            user = self.user_of(item)
            if user is None:
                unowned.append(item)
            elif user in self.state.users or user in newcomers:
                trainable.append(item)
            elif len(newcomers) < free:
                newcomers.add(user)
                trainable.append(item)
            else:
                waiting.add(user)
        self.waiting_users = waiting
        return trainable, unowned

    def lag(self, item: HasSession, version: int) -> int:
        """How many times ``item``'s user's adapter was published since ``version`` generated it."""
        user = self.user_of(item)
        slot = self.state.users.get(user) if user is not None else None
        return 0 if slot is None else sum(1 for v in slot.versions if v > version)

    def assign(self, items: Sequence[HasSession], samples: Sequence[TrainSample]) -> list[TrainSample]:
        """Each sample through its user's adapter (a slot given to users who have none yet)."""
        out = []
        for item, sample in zip(items, samples, strict=True):
            user = self.user_of(item)
            if user is None:
                raise ValueError(f"session {item.session_id} has no user: a per-user job cannot train it")
            out.append(sample.model_copy(update={"adapter": self._slot(user).slot}))
        return out

    def users_of(self, items: Sequence[HasSession]) -> list[str]:
        """The distinct users of ``items``, in order."""
        return list(dict.fromkeys(u for u in map(self.user_of, items) if u is not None))

    def slot(self, user: str) -> int:
        return self.state.users[user].slot

    def published(self, user: str, version: int) -> None:
        versions = self.state.users[user].versions
        versions.append(version)
        del versions[:-USER_VERSIONS_KEPT]

    def _slot(self, user: str) -> UserSlot:
        if user not in self.state.users:
            taken = {s.slot for s in self.state.users.values()}
            free = next((i for i in range(self.capacity) if i not in taken), None)
            if free is None:
                raise ValueError(f"no adapter slot left for user {user!r} (lora.adapters = {self.capacity})")
            self.state.users[user] = UserSlot(slot=free)
        return self.state.users[user]
