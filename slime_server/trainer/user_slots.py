"""A per-user LoRA job (``lora.per = 'user'``): whose each buffered sample is, which of the trainer's stacked adapters
trains it, and how stale it is for its user.

A sample's user is its session's owner when that owner is a user (``Principal.user``: a minted agent key,
``key:<id>``, or a front end's user, ``key:<front end>/<user>``); samples of no user (the admin, the shared
configured key, open access) have no adapter to train and are dropped. A user gets a free slot the first time a
step trains them and keeps it (``LoopState.users``, persisted with the job). When every slot is taken, a step
that trains a newcomer takes the slot of the user it trained least recently among those not in the step: their
adapter is saved and they are parked (``LoopState.parked``); when they come back they take a slot again and their
adapter is loaded into it (its Adam moments start over). A step trains at most ``capacity`` users: newcomers
beyond that wait in the buffer for a later step (``waiting_users``).

A user whose adapter is deleted (``DELETE /admin/adapters/<their alias>``) is forgotten: their slot starts fresh,
their parked copy goes, and their next rewarded conversation seats them like a newcomer.

Staleness is counted in the user's own adapter versions: a sample is as many versions old as their adapter was
published since the version that generated it, not the job's step count (other users' updates do not age it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from slime_server.buffer.adapter_store import user_alias
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
    def __init__(self, state: LoopState, capacity: int, owner_of: Callable[[str], str | None],
                 move: Callable[[int, str | None, str | None], None] | None = None) -> None:
        self.state, self.capacity = state, capacity
        self._owner_of = owner_of  # a session's owner (a store read; cached here)
        self._owners: dict[str, str | None] = {}
        # move(slot, leaving user or None, the arriving user's saved adapter or None: a fresh one): the trainer's
        # side of a slot changing hands (the loop saves and parks the leaving user, loads the slot); not called
        # for a never-used slot
        self._move = move or (lambda slot, leaving, arriving: None)
        self.waiting_users: set[str] = set()  # users with samples left for a later step (too many in this one)

    def user_of(self, item: HasSession) -> str | None:
        sid = item.session_id
        if sid not in self._owners:
            if len(self._owners) >= _OWNERS_KEPT:
                self._owners.clear()
            owner = self._owner_of(sid)
            self._owners[sid] = owner if is_user(owner) else None
        return self._owners[sid]

    def split(self, pool: Sequence[T]) -> tuple[list[T], list[T]]:
        """``pool`` (buffer order) as (the samples a step may take: of at most ``capacity`` users, those holding a
        slot first; the samples of no user). Samples of users beyond that are in neither: they wait."""
        users = [u for u in dict.fromkeys(map(self.user_of, pool)) if u is not None]
        holders = [u for u in users if u in self.state.users]
        admitted = set(holders) | set([u for u in users if u not in self.state.users][:self.capacity - len(holders)])
        trainable = [t for t in pool if self.user_of(t) in admitted]
        unowned = [t for t in pool if self.user_of(t) is None]
        self.waiting_users = set(users) - admitted
        return trainable, unowned

    def lag(self, item: HasSession, version: int) -> int:
        """How many times ``item``'s user's adapter was published since ``version`` generated it."""
        user = self.user_of(item)
        slot = None if user is None else self.state.users.get(user) or self.state.parked.get(user)
        return 0 if slot is None else sum(1 for v in slot.versions if v > version)

    def assign(self, items: Sequence[HasSession], samples: Sequence[TrainSample]) -> list[TrainSample]:
        """Each sample through its user's adapter (slots given to the users who have none)."""
        users = self.users_of(items)
        if len(users) > self.capacity:
            raise ValueError(f"{len(users)} users in one step; lora.adapters = {self.capacity}")
        for user in users:
            if user not in self.state.users:
                self._seat(user, set(users))
            self.state.users[user].last_step = self.state.step + 1
        out = []
        for item, sample in zip(items, samples, strict=True):
            user = self.user_of(item)
            if user is None:
                raise ValueError(f"session {item.session_id} has no user: a per-user job cannot train it")
            out.append(sample.model_copy(update={"adapter": self.state.users[user].slot}))
        return out

    def users_of(self, items: Sequence[HasSession]) -> list[str]:
        """The distinct users of ``items``, in order."""
        return list(dict.fromkeys(u for u in map(self.user_of, items) if u is not None))

    def slot(self, user: str) -> int:
        return self.state.users[user].slot

    def current(self, user: str) -> int | None:
        """The newest version published for seated ``user`` (None: trained, not published yet)."""
        return next(reversed(self.state.users[user].versions), None)

    def published(self, user: str, version: int) -> None:
        versions = self.state.users[user].versions
        versions.append(version)
        del versions[:-USER_VERSIONS_KEPT]

    def park(self, user: str, path: str) -> None:
        """``user`` gave up their slot; their adapter is saved at ``path``."""
        seat = self.state.users.pop(user)
        self.state.parked[user] = seat.model_copy(update={"slot": -1, "parked": path})

    def by_alias(self, alias: str) -> str | None:
        """The seated or parked user whose adapter ``alias`` names (None: the job never trained them)."""
        return next((u for u in (*self.state.users, *self.state.parked) if user_alias(u) == alias), None)

    def forget(self, user: str) -> tuple[int | None, str | None]:
        """``user`` gone from the job: (the slot they held, their parked directory), either None."""
        self.waiting_users.discard(user)
        seat = self.state.users.pop(user, None) or self.state.parked.pop(user, None)
        if seat is None:
            return None, None
        return (seat.slot if seat.slot >= 0 else None), seat.parked

    def _seat(self, user: str, in_step: set[str]) -> None:
        """A slot for ``user``: a free one, or the least recently trained holder's outside this step."""
        taken = {s.slot for s in self.state.users.values()}
        free = next((i for i in range(self.capacity) if i not in taken), None)
        leaving = None
        if free is None:
            candidates = [u for u in self.state.users if u not in in_step]
            if not candidates:
                raise ValueError(f"no adapter slot left for user {user!r} (lora.adapters = {self.capacity})")
            leaving = min(candidates, key=lambda u: self.state.users[u].last_step)
            free = self.state.users[leaving].slot
        back = self.state.parked.pop(user, None)
        if leaving is not None or back is not None:
            self._move(free, leaving, back.parked if back else None)
        self.state.users[user] = UserSlot(slot=free, versions=back.versions if back else [],
                                          seated_step=self.state.step + 1, origin=back.parked if back else None)

    def reseat(self, checkpoint_step: int | None) -> list[tuple[int, str | None]]:
        """After a restore from the checkpoint of ``checkpoint_step`` (None: none, a fresh trainer): the (slot, what
        to load) of every user seated after it, whose slot the checkpoint holds as another user's (or fresh)."""
        return [(s.slot, s.origin) for s in self.state.users.values()
                if (checkpoint_step is None and s.origin is not None)
                or (checkpoint_step is not None and s.seated_step > checkpoint_step)]
