"""Issue 43, per-user learning (``lora.per = 'user'``) in the loop, on a real SQLite buffer and a real alias store:
each sample trains its user's adapter slot (its session's owner), samples of no user are dropped, users beyond
the slots wait in the buffer, a step publishes only the users it trained under their own alias, staleness is
counted in each user's own adapter versions, and a restarted engine or the job's end gets every user's adapter.
A recording stand-in for the trainer ranks (outside this unit; the real ranks train per user in
test_lora_per_user.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from slime_server.buffer.adapter_store import SQLiteAdapterStore, user_alias
from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from slime_server.jobs.adapters import publication
from slime_server.jobs.spec import JobSpec
from slime_server.trainer.loop import EngineControl, TrainLoop
from slime_server.trainer.settings import LoopSettings
from tests._loop_helpers import RecordingTrainer, add

ALICE, BOB, CAROL = "key:fe/alice", "key:fe/bob", "key:k_carol"


class AdapterTrainer(RecordingTrainer):
    def __init__(self) -> None:
        super().__init__()
        self.adapter_pushes: list[tuple[list[str], str, int | None]] = []
        self.saved: list[tuple[str, int | None]] = []
        self.with_adam: list[str] = []  # saved with their Adam moments and count (a user giving up a slot)
        self.slots_set: list[tuple[int, str | None]] = []

    def push_adapter(self, urls, name, adapter=None):
        self.adapter_pushes.append((list(urls), name, adapter))
        return {"seconds": 0.01, "bytes": 100}

    def save_adapter(self, path, base_model=None, adapter=None, with_adam=False):
        self.saved.append((path, adapter))
        if with_adam:
            self.with_adam.append(path)
        return path

    def set_adapter(self, adapter, path=None):
        self.slots_set.append((adapter, path))
        return {}


@pytest.fixture
def stores(tmp_path: Path):
    s, a = SQLiteTrajectoryStore(tmp_path / "buffer.db"), SQLiteAdapterStore(tmp_path / "buffer.db")
    yield s, a
    s.close()


def per_user_loop(stores: Any, tmp_path: Path, slots: int = 2, **settings: Any
                  ) -> tuple[TrainLoop, AdapterTrainer, list[tuple[str, dict[str, Any]]]]:
    store, adapters = stores
    spec = JobSpec(algorithm="reinforce_plus_plus", data={"source": "live"},
                   lora={"rank": 4, "per": "user", "adapters": slots})
    engines = EngineControl(lambda: ["http://engine-a"])
    trainer, events = AdapterTrainer(), []
    lp = TrainLoop(store, lambda: trainer, engines, LoopSettings(**settings), tmp_path, job_id="job-u",
                   adapter=publication(spec, "job-u", adapters, engines, tmp_path),
                   on_event=lambda k, d: events.append((k, d)))
    lp.start_trainer()
    return lp, trainer, events


def test_each_user_trains_and_publishes_only_their_own_adapter(stores, tmp_path: Path) -> None:
    store, adapters = stores
    lp, trainer, events = per_user_loop(stores, tmp_path, batch_size=4, advantage={"estimator": "reinforce_plus_plus"})
    assert trainer.adapter_pushes == [] and lp.published.is_set()  # no user yet: nothing to publish, base serves
    ids = [add(store, "a0", owner=ALICE), add(store, "b0", owner=BOB, reward=0.0), add(store, "a1", owner=ALICE),
           add(store, "b1", owner=BOB, reward=0.0)]
    admin = add(store, "admin0", owner=None)  # no user: nothing to train it into
    assert lp.step_once() is not None
    batch = trainer.batches[0]
    assert [s.sample_id for s in batch] == ids
    assert [s.adapter for s in batch] == [0, 1, 0, 1]  # slots in order of arrival
    assert lp.state.users[ALICE].slot == 0 and lp.state.users[BOB].slot == 1
    assert store.get_trajectory(admin).consumed_step == -1
    assert ("dropped", {"no_user": 1, "forgotten_user": 0, "version": 0}) in events
    a_alias, b_alias = user_alias(ALICE), user_alias(BOB)
    assert [(n, slot) for _, n, slot in trainer.adapter_pushes] == [(f"{a_alias}@job-u.v1", 0),
                                                                    (f"{b_alias}@job-u.v1", 1)]
    assert adapters.get(a_alias).version == 1 and adapters.get(b_alias).version == 1

    # a step of Alice's samples alone publishes only hers; Bob's alias stays where it was
    [add(store, f"a{i}", owner=ALICE, reward=float(i % 2)) for i in range(2, 6)]
    assert lp.step_once() is not None
    assert {s.adapter for s in trainer.batches[1]} == {0}
    assert [n for _, n, _ in trainer.adapter_pushes[2:]] == [f"{a_alias}@job-u.v2"]
    assert adapters.get(a_alias).version == 2 and adapters.get(b_alias).version == 1
    assert adapters.get(a_alias).previous == f"{a_alias}@job-u.v1"  # the left version, unloaded when drained
    assert lp.state.users[ALICE].versions == [1, 2] and lp.state.users[BOB].versions == [1]
    published = [d for k, d in events if k == "user_adapters_published"]
    assert [p["aliases"] for p in published] == [[a_alias, b_alias], [a_alias]]

    # a restarted engine gets every user's current version; the job's end saves each user's adapter
    lp.sync_engine("http://engine-b")
    assert trainer.adapter_pushes[-2:] == [(["http://engine-b"], f"{a_alias}@job-u.v2", 0),
                                           (["http://engine-b"], f"{b_alias}@job-u.v1", 1)]
    lp.close()  # ... after the left versions' unloads are done (the engines' client is closed after it)
    assert not [t.name for t in threading.enumerate() if t.name == f"unload-{a_alias}@job-u.v1"]
    assert [slot for _, slot in trainer.saved] == [0, 1] and trainer.with_adam == []
    assert adapters.get(a_alias).saved_version == 2 and adapters.get(b_alias).saved_version == 2


def test_more_users_than_slots_take_turns(stores, tmp_path: Path) -> None:
    """Three users, two slots: a step trains at most two users (the third waits in the buffer); a newcomer takes
    the slot of the user trained least recently outside the step, who is published, saved and parked; a parked
    user coming back gets a slot again with their saved adapter loaded into it."""
    store, adapters = stores
    lp, trainer, events = per_user_loop(stores, tmp_path, slots=2, batch_size=4,
                                        advantage={"estimator": "reinforce_plus_plus"})
    a, b, c = user_alias(ALICE), user_alias(BOB), user_alias(CAROL)
    add(store, "a0", owner=ALICE)
    add(store, "b0", owner=BOB, reward=0.0)
    carol = [add(store, f"c{i}", owner=CAROL, reward=float(i)) for i in range(2)]
    add(store, "a1", owner=ALICE, reward=0.0)
    add(store, "b1", owner=BOB)
    assert lp.step_once() is not None  # Alice and Bob: the two slots; Carol's samples wait
    assert {s.adapter for s in trainer.batches[0]} == {0, 1} and lp.users is not None
    assert lp.users.waiting_users == {CAROL}
    assert [store.get_trajectory(t).consumed_step for t in carol] == [None, None]
    assert trainer.slots_set == []  # fresh slots need nothing

    add(store, "a2", owner=ALICE)
    add(store, "a3", owner=ALICE, reward=0.0)
    assert lp.step_once() is not None  # Carol's two and Alice's two: Bob (not in the step) gives up his slot
    bob_slot = 1
    assert [s.adapter for s in trainer.batches[1]] == [bob_slot, bob_slot, 0, 0]
    assert set(lp.state.users) == {ALICE, CAROL} and set(lp.state.parked) == {BOB}
    parked = lp.state.parked[BOB].parked
    assert parked is not None and (parked, bob_slot) in trainer.saved and trainer.with_adam == [parked]
    assert trainer.slots_set == [(bob_slot, None)]  # Carol starts fresh
    assert adapters.get(b).saved_path == parked and adapters.get(b).saved_version == 1  # his alias stays, saved
    assert adapters.get(c).version == 2 and adapters.get(a).version == 2

    add(store, "b2", owner=BOB)
    add(store, "b3", owner=BOB, reward=0.0)
    add(store, "c2", owner=CAROL)
    add(store, "c3", owner=CAROL, reward=0.0)
    assert lp.step_once() is not None  # Bob is back: Alice (not in the step) is parked, Bob's adapter loaded
    assert set(lp.state.users) == {BOB, CAROL} and set(lp.state.parked) == {ALICE}
    assert trainer.slots_set[-1] == (0, parked)
    assert lp.state.users[BOB].versions == [1, 3]  # his versions went with him
    assert [d["parked"] for k, d in events if k == "user_slot"] == [True, True]
    # restored from step 1's checkpoint, whose slots were Alice's and Bob's: both slots are loaded again with what
    # their holders now were seated with (Carol fresh, Bob his saved adapter); from no checkpoint, only Bob's
    assert sorted(lp.users.reseat(1), key=str) == sorted([(1, None), (0, parked)], key=str)
    assert lp.users.reseat(None) == [(0, parked)]


def test_staleness_counts_the_users_own_versions(stores, tmp_path: Path) -> None:
    store, _ = stores
    lp, trainer, _ = per_user_loop(stores, tmp_path, batch_size=2, max_staleness=0, stale_policy="drop",
                                   advantage={"estimator": "reinforce_plus_plus"})
    add(store, "a0", owner=ALICE)
    add(store, "a1", owner=ALICE, reward=0.0)
    assert lp.step_once() is not None  # Alice's adapter: version 1
    for i in range(2, 6):  # ... versions 2 and 3, each step on samples her newest version generated
        add(store, f"a{i}", owner=ALICE, version=lp.state.version, reward=float(i % 2))
        if i % 2:
            assert lp.step_once() is not None
    assert lp.state.version == 3 and lp.state.users[ALICE].versions == [1, 2, 3]
    # Bob's samples of the base (version 0) are 3 job versions old but fresh for Bob, whose adapter never moved;
    # Alice's of version 2 are one of her versions old: dropped at max_staleness 0
    stale = [add(store, f"a-old{i}", owner=ALICE, version=2, reward=float(i)) for i in range(2)]
    bob = [add(store, f"b{i}", owner=BOB, reward=float(i)) for i in range(2)]
    assert lp.step_once() is not None
    assert [s.sample_id for s in trainer.batches[-1]] == bob
    assert lp.state.dropped_stale == 2 and all(store.get_trajectory(t).consumed_step == -1 for t in stale)


def test_a_per_user_job_is_refused_off_live_data_or_merged() -> None:
    with pytest.raises(ValueError, match="data.source must be 'live'"):
        JobSpec(algorithm="grpo", data={"source": "dataset", "environment": "calculator"},
                lora={"per": "user", "adapters": 2})
    with pytest.raises(ValueError, match="lora.publish 'merged'"):
        JobSpec(algorithm="grpo", lora={"per": "user", "publish": "merged"})
    with pytest.raises(ValueError, match="users' adapters"):
        JobSpec(algorithm="grpo", lora={"name": "user-abc"})
    with pytest.raises(ValueError, match="per-user slots"):  # one alias cannot publish several adapters
        JobSpec(algorithm="grpo", lora={"adapters": 2})


def test_a_deleted_users_adapter_is_forgotten_by_the_running_job(stores, tmp_path: Path) -> None:
    """Deleting a user's adapter while their per-user job runs (``TrainLoop.forget_user``, asked of the loop's
    thread between steps): their slot starts fresh, their unconsumed samples are dropped (and those begun before, rewarded later), every checkpoint that
    holds their tensors gives way to a new one without them; the other user is untouched, and the forgotten user's
    next sample seats them afresh. A user the job never trained is not forgotten (nothing to do)."""
    store, adapters = stores
    lp, trainer, events = per_user_loop(stores, tmp_path, slots=2, batch_size=2, poll_interval_s=0.01,
                                        advantage={"estimator": "reinforce_plus_plus"})
    add(store, "a0", owner=ALICE)
    add(store, "b0", owner=BOB, reward=0.0)
    assert lp.step_once() is not None
    first = Path(lp.checkpoint().path)
    first.mkdir(parents=True)
    alice_slot = lp.state.users[ALICE].slot
    add(store, "b1", owner=BOB)
    add(store, "b2", owner=BOB, reward=0.0)
    assert lp.step_once() is not None  # Bob alone: a step past the checkpoint
    waiting = add(store, "a1", owner=ALICE)  # one sample of hers left unconsumed (a step needs two)

    runner = threading.Thread(target=lp.run, daemon=True)
    runner.start()
    try:
        done = lp.between_steps(lambda: lp.forget_user(user_alias(ALICE)), timeout=30)
        assert lp.between_steps(lambda: lp.forget_user("user-0000"), timeout=30) == {"forgotten": False}
    finally:
        lp.stop.set()
        runner.join(30)
    assert done["forgotten"] is True and done["slot"] == alice_slot and done["dropped_samples"] == 1
    assert trainer.slots_set == [(alice_slot, None)]  # her slot: A as it started, B = 0, fresh Adam moments
    assert set(lp.state.users) == {BOB} and lp.state.parked == {}
    assert store.get_trajectory(waiting).consumed_step == -1
    assert [Path(c.path).name for c in lp.state.checkpoints] == ["step_00000002"]
    assert not first.exists()  # held her tensors
    assert ("user_forgotten", {"alias": user_alias(ALICE), "slot": alice_slot, "dropped_samples": 1,
                               "checkpoints_removed": 1}) in events

    # a conversation of hers in flight when she was forgotten (begun by the deleted adapter), rewarded only now:
    # never trained, neither into the new adapter she may get nor anywhere else
    in_flight = add(store, "a-in-flight", owner=ALICE, created_at=lp.state.forgotten[user_alias(ALICE)] - 1.0)
    assert lp.step_once() is None and store.get_trajectory(in_flight).consumed_step == -1
    assert ("dropped", {"no_user": 0, "forgotten_user": 1, "version": lp.state.version}) in events
    add(store, "a2", owner=ALICE)
    add(store, "b3", owner=BOB)
    assert lp.step_once() is not None  # she comes back as a newcomer into the free (fresh) slot
    assert [s.sample_id for s in trainer.batches[-1]] != [] and in_flight not in {
        s.sample_id for batch in trainer.batches for s in batch}
    assert lp.state.users[ALICE].slot == alice_slot and lp.state.users[ALICE].versions == [lp.state.version]
    assert trainer.slots_set == [(alice_slot, None)]  # nothing loaded into it: it was reset when she went
