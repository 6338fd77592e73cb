"""The trajectory store's contract: every test here runs on SQLite (``test_sqlite_store.py``) and on
PostgreSQL (``test_postgres_store.py``), each module giving its own ``store`` fixture. One list of
behaviours for the one implementation over two databases (``buffer/trajectory_store.py``)."""

from __future__ import annotations

import math
import time

import pytest

from slime_server.buffer.schema import (
    IdempotencyConflict,
    ResponseNotFound,
    SessionClosedError,
    SessionExistsError,
    SessionNotFound,
    StaleWriteError,
    StoreError,
    Trajectory,
    TrajectoryNotFound,
    Turn,
)
from slime_server.buffer.store import ResponseRef, TrajectoryStore, TurnWrite


def _traj(session_id: str, logprobs: list[float], *, response_id: str = "chatcmpl-1", segment: int = 0,
          branch: int = 0) -> Trajectory:
    n_prompt = 3
    return Trajectory(
        session_id=session_id, segment=segment, branch=branch, group_id=session_id,
        tokens=list(range(10, 10 + n_prompt + len(logprobs))),
        loss_mask=[0] * n_prompt + [1] * len(logprobs), rollout_logprobs=[0.0] * n_prompt + logprobs,
        weight_versions=[-1] * n_prompt + [4] * len(logprobs),
        turns=[Turn(response_id=response_id, prompt_start=0, output_start=n_prompt,
                    output_end=n_prompt + len(logprobs), finish_reason="stop")],
        turn_rewards=[None])


def _write(store: TrajectoryStore, traj: Trajectory, *, close: bool = False) -> Trajectory:
    refs = [ResponseRef(response_id=t.response_id, choice=0, trajectory_id=traj.id) for t in traj.turns
            if traj.revision == 0]
    [stored] = store.write_turn(TurnWrite(session_id=traj.session_id, trajectories=[traj], responses=refs,
                                          close_session=close))
    return stored


class StoreContract:
    """Subclassed once per database as ``Test...``; pytest collects the subclass's copies of these."""

    def test_sessions_create_get_and_typed_not_found(self, store: TrajectoryStore) -> None:
        s = store.create_session(group_id="g1", metadata={"env": "calc"}, key_hash="abc")
        got = store.get_session(s.id)
        assert (got.group_id, got.metadata, got.key_hash, got.status) == ("g1", {"env": "calc"}, "abc", "open")
        with pytest.raises(SessionExistsError):
            store.create_session(s.id)
        with pytest.raises(SessionNotFound) as exc:
            store.get_session("nope")
        assert isinstance(exc.value, LookupError) and exc.value.status_code == 404
        with pytest.raises(SessionNotFound):
            store.set_reward("nope", reward=1.0)
        with pytest.raises(SessionNotFound):
            store.get_trajectories("nope")
        assert store.get_or_create_session("hdr-1").id == "hdr-1"
        assert store.get_or_create_session("hdr-1").created_at == store.get_session("hdr-1").created_at


    def test_token_arrays_and_logprobs_round_trip_bit_exactly(self, store: TrajectoryStore) -> None:
        weird = [-0.0, -1e-320, -math.inf, -0.1 - 2**-50, -12.345678901234567, -5e-324, -math.pi]
        store.create_session("s")
        traj = _write(store, _traj("s", weird))
        back = store.get_trajectory(traj.id)
        assert [x.hex() for x in back.rollout_logprobs] == [x.hex() for x in traj.rollout_logprobs]
        assert math.copysign(1.0, back.rollout_logprobs[3]) == -1.0  # negative zero survives
        assert (back.tokens, back.loss_mask, back.weight_versions) == (traj.tokens, traj.loss_mask, traj.weight_versions)
        assert back.turns == traj.turns and back.revision == 1


    def test_routed_experts_round_trip_and_extend(self, store: TrajectoryStore) -> None:
        """An MoE trajectory's routes (one byte per id up to 256 experts, two above) come back as written, through
        an update; a trajectory without them reads None."""
        import numpy as np

        from slime_server.buffer.routed_experts import RoutedExperts

        store.create_session("moe")
        rng = np.random.default_rng(0)
        traj = _traj("moe", [-0.5, -0.25])
        wide = rng.integers(0, 300, size=(len(traj.tokens) - 1, 4, 2))
        traj = traj.model_copy(update={"routed_experts": RoutedExperts.of(wide)})
        stored = _write(store, traj)
        back = store.get_trajectory(stored.id).routed_experts
        assert back.itemsize == 2 and np.array_equal(back.array(), wide)
        narrow = rng.integers(0, 128, size=(len(traj.tokens) + 1, 4, 2))  # a next turn: 2 tokens more, 2 routes
        grown = stored.model_copy(update={
            "tokens": stored.tokens + [1, 2], "loss_mask": stored.loss_mask + [0, 0],
            "rollout_logprobs": stored.rollout_logprobs + [0.0, 0.0], "weight_versions": stored.weight_versions + [-1, -1],
            "routed_experts": RoutedExperts.of(wide).extended(2, narrow[2:])})
        _write(store, grown)
        again = store.get_trajectory(stored.id).routed_experts
        assert again.positions == len(grown.tokens) - 1
        assert np.array_equal(again.array(), np.concatenate([wide[:2], narrow[2:]]))
        plain = _write(store, _traj("moe", [-1.0], response_id="chatcmpl-2", segment=1))
        assert store.get_trajectory(plain.id).routed_experts is None
        with pytest.raises(ValueError, match="positions"):
            Trajectory(session_id="moe", tokens=[1], loss_mask=[0], rollout_logprobs=[0.0], weight_versions=[-1],
                       routed_experts=RoutedExperts.of(np.zeros((2, 4, 2), dtype=int)))

    def test_images_are_stored_once_and_trajectories_keep_their_spans(self, store: TrajectoryStore) -> None:
        """Issue 45: a turn's image files are written in its transaction, once per content hash (a second turn
        sending one again changes nothing), read back byte for byte; a trajectory's image spans round-trip; a
        trajectory without images reads none."""
        from slime_server.buffer.schema import ImageBlob, ImageSpan

        store.create_session("img")
        a = ImageBlob(sha256="a" * 64, mime="image/png", width=56, height=56, data=b"\x89PNG\x00\xff" * 9)
        b = ImageBlob(sha256="b" * 64, mime="image/jpeg", width=100, height=60, data=bytes(range(256)))
        traj = _traj("img", [-0.5, -0.25]).model_copy(update={"images": [ImageSpan(sha256=a.sha256, offset=1, length=2)]})
        [stored] = store.write_turn(TurnWrite(session_id="img", trajectories=[traj], images=[a, b]))
        assert store.get_trajectory(stored.id).images == traj.images
        again = a.model_copy(update={"data": b"other bytes under the same hash"})  # never overwrites
        store.write_turn(TurnWrite(session_id="img", trajectories=[_traj("img", [-1.0], segment=1)], images=[again]))
        got = store.get_images([a.sha256, b.sha256, "c" * 64])
        assert got.keys() == {a.sha256, b.sha256} and got[a.sha256] == a and got[b.sha256] == b
        assert store.get_images([]) == {}
        plain = [t for t in store.get_trajectories("img") if t.segment == 1]
        assert plain[0].images == []


    def test_heads_list_what_the_trajectories_list_and_ids_fetch_them_whole(self, store: TrajectoryStore) -> None:
        """The loop chooses a batch from heads (generating versions read from the stored bytes) and then reads
        the chosen whole: both must say what reading every trajectory whole says."""
        versions = {"a": [3, 5, 4], "b": [-1, 2, -1], "c": [], "d": [7], "e": [6, 6]}  # b: some not generated
        ids = {}
        for name, vs in versions.items():
            store.create_session(name)
            t = _traj(name, [-0.5] * len(vs), response_id=f"chatcmpl-{name}")
            if name == "e":  # decoded under a grammar: generated, at loss mask 0 (Turn.grammar), and counted
                t = t.model_copy(update={"loss_mask": [0] * len(t.tokens)})
            ids[name] = _write(store, t.model_copy(update={"weight_versions": [-1] * 3 + vs})).id
        store.set_reward("a", reward=1.0, finish=True)
        store.set_reward("b", reward=0.0, finish=True)
        store.set_reward("c", reward=0.5)
        store.mark_consumed([ids["a"]], 3)
        for filters in ({}, {"status": "finished"}, {"rewarded": True}, {"rewarded": False}, {"unconsumed": True},
                        {"status": "finished", "rewarded": True, "unconsumed": True}, {"limit": 2}):
            heads = store.list_heads(**filters)
            assert heads == [t.head() for t in store.list_trajectories(**filters)], filters
        assert [h.min_version for h in store.list_heads()] == [3, 2, None, 7, 6]
        assert store.count_ready() == store.stats().unconsumed_finished_rewarded == 1  # b: a trained, c and d open
        assert store.count_open_rewarded_sessions() == 1  # c (d is open but unrewarded)
        wanted = [ids["d"], ids["a"], ids["c"]]
        assert [t.id for t in store.get_trajectories_by_id(wanted)] == wanted
        assert store.get_trajectories_by_id(wanted) == [store.get_trajectory(i) for i in wanted]
        with pytest.raises(TrajectoryNotFound):
            store.get_trajectories_by_id([ids["a"], "traj-missing"])
        _write(store, _traj("c", [-0.5], response_id="chatcmpl-c2", segment=1))  # c's second segment
        store.set_reward("c", reward=0.25)
        assert len(store.list_heads(status="open", rewarded=True)) == 2
        assert store.count_open_rewarded_sessions() == 1  # sessions, not trajectories


    def test_optimistic_concurrency_rejects_stale_writes(self, store: TrajectoryStore) -> None:
        store.create_session("s")
        stored = _write(store, _traj("s", [-0.5]))
        _write(store, stored.model_copy(update={"metadata": {"a": 1}}))
        with pytest.raises(StaleWriteError):
            _write(store, stored.model_copy(update={"metadata": {"b": 2}}))  # read at revision 1, now 2
        with pytest.raises(StaleWriteError):  # same (segment, branch) inserted twice
            _write(store, _traj("s", [-0.5], response_id="chatcmpl-2"))
        assert store.get_trajectory(stored.id).metadata == {"a": 1}


    def test_rewards_are_idempotent_and_per_turn(self, store: TrajectoryStore) -> None:
        store.create_session("s")
        t = _write(store, _traj("s", [-0.5, -0.25], response_id="chatcmpl-a"))
        assert store.set_reward("s", reward=1.0, idempotency_key="k1") is True
        assert store.set_reward("s", reward=1.0, idempotency_key="k1") is False
        assert store.get_trajectory(t.id).reward == 1.0
        with pytest.raises(IdempotencyConflict) as exc:
            store.set_reward("s", reward=0.0, idempotency_key="k1")
        assert exc.value.status_code == 409
        assert store.set_reward("s", reward=0.25, idempotency_key="k2") is True  # a new key: last write wins
        assert store.get_trajectory(t.id).reward == 0.25
        assert store.set_reward("s", turn_rewards=[0.75]) is True
        assert store.get_trajectory(t.id).turn_rewards == [0.75]
        with pytest.raises(StoreError) as bad:
            store.set_reward("s", turn_rewards=[1.0, 2.0])
        assert bad.value.status_code == 400
        with pytest.raises(StoreError):
            store.set_reward("s")


    def test_a_final_reward_finishes_the_session_in_its_transaction(self, store: TrajectoryStore) -> None:
        store.create_session("s")
        t = _write(store, _traj("s", [-0.5]))
        assert store.set_reward("s", reward=0.5, idempotency_key="mid", finish=False) is True
        assert store.get_session("s").status == "open" and store.get_trajectory(t.id).status == "open"
        assert store.set_reward("s", reward=1.0, idempotency_key="end", finish=True) is True
        session, traj = store.get_session("s"), store.get_trajectory(t.id)
        assert (session.status, traj.status, traj.reward) == ("closed", "finished", 1.0)
        assert store.set_reward("s", reward=1.0, idempotency_key="end", finish=True) is False  # a retry: no change
        with pytest.raises(SessionClosedError):  # the episode is over: no more turns
            _write(store, _traj("s", [-0.1], response_id="chatcmpl-late", segment=1))
        assert store.set_reward("s", reward=0.0, finish=True) is True  # a closed session still takes rewards
        assert store.get_trajectory(t.id).reward == 0.0


    def test_idle_sessions_are_closed_oldest_first(self, store: TrajectoryStore) -> None:
        for sid in ("a", "b"):
            store.create_session(sid)
            _write(store, _traj(sid, [-0.5], response_id=f"chatcmpl-{sid}"))
            time.sleep(0.02)
        cutoff = time.time()
        time.sleep(0.02)
        store.create_session("c")
        c = _write(store, _traj("c", [-0.5], response_id="chatcmpl-c"))
        store.create_session("closed-already")
        store.close_session("closed-already")
        assert store.close_idle_sessions(cutoff, limit=1) == ["a"]
        assert store.close_idle_sessions(cutoff) == ["b"]
        assert store.close_idle_sessions(cutoff) == []
        assert [store.get_session(x).status for x in "abc"] == ["closed", "closed", "open"]
        assert all(t.status == "finished" for x in "ab" for t in store.get_trajectories(x))
        assert store.get_trajectory(c.id).status == "open"
        assert store.close_idle_sessions(time.time() + 1) == ["c"]


    def test_recent_sessions_newest_first_with_counts(self, store: TrajectoryStore) -> None:
        for sid in ("a", "b", "c"):
            store.create_session(sid, group_id=f"g-{sid}", metadata={"k": sid})
            time.sleep(0.002)
        _write(store, _traj("b", [-0.5, -0.25], response_id="chatcmpl-b"))
        _write(store, _traj("b", [-0.5], response_id="chatcmpl-b2", segment=1))
        store.set_reward("b", reward=0.75, finish=True)
        recent = store.recent_sessions(2)
        assert [r.id for r in recent] == ["c", "b"]
        b = recent[1]
        assert (b.status, b.group_id, b.metadata, b.num_trajectories, b.num_tokens, b.reward) == (
            "closed", "g-b", {"k": "b"}, 2, 9, 0.75)
        assert recent[0].num_trajectories == 0 and recent[0].reward is None
        assert [r.id for r in store.recent_sessions(10)] == ["c", "b", "a"]


    def test_feedback_and_response_lookup(self, store: TrajectoryStore) -> None:
        store.create_session("s")
        t = _write(store, _traj("s", [-0.5], response_id="chatcmpl-fb"))
        [(found, turn_index)] = store.find_by_response_id("chatcmpl-fb")
        assert (found.id, turn_index) == (t.id, 0)
        fb = store.add_feedback("chatcmpl-fb", thumb="down", comment="wrong city")
        assert fb.session_id == "s"
        assert [f.thumb for f in store.get_feedback("chatcmpl-fb")] == ["down"]
        with pytest.raises(ResponseNotFound):
            store.add_feedback("chatcmpl-missing", thumb="up")
        with pytest.raises(ResponseNotFound):
            store.find_by_response_id("chatcmpl-missing")


    def test_listing_filters_paging_and_consumption(self, store: TrajectoryStore) -> None:
        ids = []
        for i in range(5):
            store.create_session(f"s{i}")
            ids.append(_write(store, _traj(f"s{i}", [-0.1 * (i + 1)], response_id=f"chatcmpl-{i}")).id)
        for i in (0, 1, 2):
            store.close_session(f"s{i}")
        store.set_reward("s0", reward=1.0)
        store.set_reward("s2", reward=0.0)
        assert [t.id for t in store.list_trajectories(status="open")] == ids[3:]
        ready = store.list_trajectories(status="finished", rewarded=True, unconsumed=True)
        assert [t.id for t in ready] == [ids[0], ids[2]]
        assert store.stats().unconsumed_finished_rewarded == 2
        assert store.mark_consumed([ids[0], "traj-unknown"], train_step=7) == 1
        assert store.mark_consumed([ids[0]], train_step=8) == 0  # first consumption wins
        assert [t.id for t in store.list_trajectories(status="finished", rewarded=True, unconsumed=True)] == [ids[2]]
        assert store.get_trajectory(ids[0]).consumed_step == 7
        page1 = store.list_trajectories(limit=2)
        page2 = store.list_trajectories(limit=2, after=page1[-1].id)
        assert [t.id for t in page1 + page2] == ids[:4]
        assert [t.id for t in store.iter_trajectories(page_size=2)] == ids
        with pytest.raises(TrajectoryNotFound):
            store.list_trajectories(after="traj-unknown")
        stats = store.stats()
        assert (stats.sessions, stats.open_sessions, stats.trajectories, stats.rewarded) == (
            5, 2, {"finished": 3, "open": 2}, 2)


    def test_release_puts_back_only_the_jobs_own_later_steps(self, store: TrajectoryStore) -> None:
        ids = []
        for i in range(5):
            store.create_session(f"r{i}")
            ids.append(_write(store, _traj(f"r{i}", [-0.5], response_id=f"chatcmpl-r{i}"), close=True).id)
        store.mark_consumed([ids[0]], 1, "job-a")
        store.mark_consumed([ids[1]], 3, "job-a")
        store.mark_consumed([ids[2]], -1, "job-a")  # dropped: stays out of the pool
        store.mark_consumed([ids[3]], 5, "job-b")  # another job's step 5
        assert store.release_consumed(2, "job-a") == 1
        assert [store.get_trajectory(i).consumed_step for i in ids] == [1, None, -1, 5, None]
        assert store.release_consumed(2, "job-a") == 0  # idempotent


    def test_a_closing_turn_stamps_every_trajectory_it_finishes(self, store: TrajectoryStore) -> None:
        """A turn that closes its session finishes the session's other open trajectories in the same write,
        and stamps them with that write's time (the SQLite copy of the store once left their updated_at)."""
        store.create_session("s")
        first = _write(store, _traj("s", [-0.5]))
        last = _write(store, _traj("s", [-0.25], response_id="chatcmpl-2", segment=1), close=True)
        before = store.get_trajectory(first.id)
        assert (before.status, last.status) == ("finished", "finished")
        assert before.updated_at == last.updated_at > first.updated_at
        assert before.revision == first.revision + 1


    def test_stored_responses_round_trip_and_replace(self, store: TrajectoryStore) -> None:
        from slime_server.buffer.schema import StoredResponse

        body = {"input": [{"role": "user", "content": "héllo"}], "output": {"role": "assistant", "content": "hi"}}
        store.put_stored_response(StoredResponse(id="resp_1", session_id="s", owner="key:1", body=body))
        store.put_stored_response(StoredResponse(id="resp_2", session_id="s", previous_response_id="resp_1", body={}))
        got = store.get_stored_response("resp_1")
        assert (got.session_id, got.owner, got.previous_response_id, got.body) == ("s", "key:1", None, body)
        assert store.get_stored_response("resp_2").previous_response_id == "resp_1"
        store.put_stored_response(StoredResponse(id="resp_2", session_id="s", body={"x": 1}))  # same id: replaced
        assert store.get_stored_response("resp_2").body == {"x": 1}
        with pytest.raises(ResponseNotFound):
            store.get_stored_response("resp_missing")
        again = type(store)(getattr(store, "url", None) or store.path)  # durable: another connection reads it
        assert again.get_stored_response("resp_1").body == body
        again.close()
