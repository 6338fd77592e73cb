"""Token-exact multi-turn assembly over the real tiny tokenizer and a real SQLite store."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from pydantic import ValidationError

from slime_server.buffer.schema import SessionClosedError
from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from slime_server.gateway.chat_template import ChatRenderer, ChatTemplateError
from slime_server.gateway.sessions import ChoiceResult, SessionManager
from tests._sessions_helpers import TOOLS, FakeEngine, assert_mask_invariant, client_message


@pytest.fixture(scope="module")
def renderer(tiny_model_path: Path) -> ChatRenderer:
    return ChatRenderer(tiny_model_path)


@pytest.fixture
def store(tmp_path: Path):
    s = SQLiteTrajectoryStore(tmp_path / "buffer.db")
    yield s
    s.close()


@pytest.fixture
def sm(store: SQLiteTrajectoryStore, renderer: ChatRenderer) -> SessionManager:
    return SessionManager(store, renderer)


@pytest.fixture
def engine(renderer: ChatRenderer) -> FakeEngine:
    return FakeEngine(renderer)


def _splits() -> float:
    return REGISTRY.get_sample_value("slime_session_segment_splits_total") or 0.0


def test_five_turn_tool_session_is_one_trajectory(sm: SessionManager, store, engine: FakeEngine,
                                                  renderer: ChatRenderer) -> None:
    messages: list[dict] = [{"role": "system", "content": "You are terse."},
                            {"role": "user", "content": "Weather in Paris and Rome?"}]
    script = [
        dict(content="", tool_calls=[("get_weather", '{"city": "Paris"}')]),
        dict(content="Checking Rome too.", tool_calls=[("get_weather", '{"city":"Rome"}')]),
        dict(content="Paris 21C, Rome 25C."),
        dict(content="", tool_calls=[("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Bergen"}')]),
        dict(content="Oslo 9C, Bergen 7C. Done."),
    ]
    modes = []
    for k, step in enumerate(script):
        prepared = sm.prepare_turn("agent-1", messages, TOOLS)
        modes.append(prepared.mode)
        assert prepared.prompt_ids == renderer.render_ids(messages, TOOLS)  # canonical outputs: plain merge
        rid = engine.response_id()
        choice = engine.choice(rid, 0, version=k, **step)
        [record] = sm.commit_turn(prepared, [choice])
        assert record.turn_index == k and record.output_end - record.output_start == len(choice.output_ids)
        messages.append(client_message(choice))
        for call in choice.message.get("tool_calls", []):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"{call['function']['name']}: ok"})
        if not choice.message.get("tool_calls"):
            messages.append({"role": "user", "content": f"thanks ({k})"})
    assert modes == ["new", "merge", "merge", "merge", "merge"]
    [traj] = store.get_trajectories("agent-1")
    assert len(traj.turns) == 5 and traj.segment == 0
    assert_mask_invariant(traj, engine.ledger)
    assert sum(traj.loss_mask) == sum(len(v[0]) for v in engine.ledger.values())
    # The stored sequence is exactly what the template renders for the whole conversation up to the
    # last reply (the model's ids here are canonical, so both ways agree).
    full = renderer.render_ids(messages[:-1], TOOLS, add_generation_prompt=False)
    assert traj.tokens == full[: len(traj.tokens)] and renderer.decode(full[len(traj.tokens):]) == "\n"
    assert [t.tool_calls[0].arguments for t in traj.turns if t.tool_calls][:2] == ['{"city": "Paris"}',
                                                                                 '{"city":"Rome"}']
    assert store.get_session("agent-1").segment_splits == 0


def test_noncanonical_output_is_reused_not_retokenized(sm: SessionManager, store, engine: FakeEngine,
                                                       renderer: ChatRenderer) -> None:
    messages = [{"role": "user", "content": "Say hello world"}]
    p1 = sm.prepare_turn("s-b", messages, None)
    choice = engine.choice(engine.response_id(), 0, "hello world, friend", canonical=False)
    assert choice.output_ids[:-1] != renderer.encode("hello world, friend")  # really non-canonical
    sm.commit_turn(p1, [choice])
    messages += [client_message(choice), {"role": "user", "content": "again"}]
    p2 = sm.prepare_turn("s-b", messages, None)
    assert p2.mode == "reuse"
    assert p2.prompt_ids[: p2.base_len] == p1.prompt_ids + choice.output_ids  # the model's own ids, verbatim
    assert renderer.decode(p2.prompt_ids) == renderer.render_text(messages, None)
    c2 = engine.choice(engine.response_id(), 0, "hello world, again", canonical=False)
    sm.commit_turn(p2, [c2])
    [traj] = store.get_trajectories("s-b")
    assert_mask_invariant(traj, engine.ledger)
    assert len(traj.turns) == 2


def test_reasoning_dropped_by_client_still_merges_by_reuse(sm: SessionManager, store, engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "2+2?"}]
    p1 = sm.prepare_turn("s-think", messages, None)
    c1 = engine.choice(engine.response_id(), 0, "4", reasoning="two plus two is four")
    sm.commit_turn(p1, [c1])
    messages += [client_message(c1), {"role": "user", "content": "and 3+3?"}]  # no reasoning_content echoed
    p2 = sm.prepare_turn("s-think", messages, None)
    assert p2.mode == "reuse"
    sm.commit_turn(p2, [engine.choice(engine.response_id(), 0, "6", reasoning="six")])
    [traj] = store.get_trajectories("s-think")
    assert_mask_invariant(traj, engine.ledger)


def test_editing_an_earlier_assistant_message_splits(sm: SessionManager, store, engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "Name a colour"}]
    p1 = sm.prepare_turn("s-drift", messages, None)
    c1 = engine.choice(engine.response_id(), 0, "Blue.")
    sm.commit_turn(p1, [c1])
    before = _splits()
    edited = messages + [{"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another"}]
    p2 = sm.prepare_turn("s-drift", edited, None)
    assert p2.mode == "split" and p2.base_trajectory_id is None and p2.segment == 1
    sm.commit_turn(p2, [engine.choice(engine.response_id(), 0, "Green.")])
    assert _splits() == before + 1
    assert store.get_session("s-drift").segment_splits == 1
    trajs = store.get_trajectories("s-drift")
    assert [(t.segment, len(t.turns)) for t in trajs] == [(0, 1), (1, 1)]
    for t in trajs:
        assert_mask_invariant(t, engine.ledger)
    # The edited "Red." is context now (mask 0), never trained on as if the model said it.
    new_turn = trajs[1].turns[0]
    assert new_turn.output_start > 0
    assert sum(trajs[1].loss_mask) == len(engine.ledger[(new_turn.response_id, 0)][0])


def test_n2_branches_and_continuing_the_matching_one(sm: SessionManager, store, engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "Pick a number"}]
    p1 = sm.prepare_turn("s-n2", messages, None, n=2)
    rid = engine.response_id()
    c0, c1 = engine.choice(rid, 0, "Seven."), engine.choice(rid, 1, "Three.")
    records = sm.commit_turn(p1, [c0, c1])
    assert [(r.branch, r.choice) for r in records] == [(0, 0), (1, 1)]
    trajs = store.get_trajectories("s-n2")
    assert len({t.group_id for t in trajs}) == 1 and trajs[0].tokens[: len(p1.prompt_ids)] == p1.prompt_ids
    # The client continues with the second choice.
    messages += [client_message(c1), {"role": "user", "content": "Why?"}]
    p2 = sm.prepare_turn("s-n2", messages, None)
    assert p2.mode == "merge" and p2.base_trajectory_id == records[1].trajectory_id
    sm.commit_turn(p2, [engine.choice(engine.response_id(), 0, "Because.")])
    by_branch = {t.branch: t for t in store.get_trajectories("s-n2")}
    assert len(by_branch[0].turns) == 1 and len(by_branch[1].turns) == 2
    for t in by_branch.values():
        assert_mask_invariant(t, engine.ledger)
    # n=2 on a later turn forks the continued branch: both new branches share its exact prefix.
    messages += [{"role": "assistant", "content": "Because."}, {"role": "user", "content": "Sure?"}]
    p3 = sm.prepare_turn("s-n2", messages, None, n=2)
    rid3 = engine.response_id()
    recs = sm.commit_turn(p3, [engine.choice(rid3, 0, "Yes."), engine.choice(rid3, 1, "No.")])
    assert recs[0].trajectory_id == records[1].trajectory_id and recs[1].branch == 2
    trajs = {t.id: t for t in store.get_trajectories("s-n2")}
    fork = trajs[recs[1].trajectory_id]
    assert fork.tokens[: p3.base_len] == trajs[recs[0].trajectory_id].tokens[: p3.base_len]
    assert len(fork.turns) == 3 and fork.metadata["forked_from"] == records[1].trajectory_id
    for t in trajs.values():
        assert_mask_invariant(t, engine.ledger)


def test_concurrent_requests_on_one_trajectory_fork_instead_of_interleaving(sm: SessionManager, store,
                                                                           engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "hi"}]
    sm.commit_turn(sm.prepare_turn("s-c", messages, None), [c1 := engine.choice(engine.response_id(), 0, "Hello.")])
    follow = messages + [client_message(c1), {"role": "user", "content": "go"}]
    pa, pb = sm.prepare_turn("s-c", follow, None), sm.prepare_turn("s-c", follow, None)
    assert pa.base_trajectory_id == pb.base_trajectory_id
    ra = sm.commit_turn(pa, [engine.choice(engine.response_id(), 0, "A")])
    rb = sm.commit_turn(pb, [engine.choice(engine.response_id(), 0, "B")])
    assert ra[0].trajectory_id != rb[0].trajectory_id
    for t in store.get_trajectories("s-c"):
        assert len(t.turns) == 2
        assert_mask_invariant(t, engine.ledger)


class _CountingStore(SQLiteTrajectoryStore):
    """The real SQLite store, counting how often a session's trajectories are read."""

    reads = 0

    def get_trajectories(self, session_id: str):
        self.reads += 1
        return super().get_trajectories(session_id)


def test_a_commit_starts_from_what_prepare_read(tmp_path: Path, renderer: ChatRenderer, engine: FakeEngine) -> None:
    """The commit does not read the session again (a 75k-token trace costs ms per read): it writes from prepare's
    read, and only when another turn of the session was recorded in between (its revision check fails) does it
    read again, then fork as before."""
    store = _CountingStore(tmp_path / "buffer.db")
    sm = SessionManager(store, renderer)
    messages = [{"role": "user", "content": "hi"}]
    for k in range(3):
        prepared = sm.prepare_turn("s-r", messages, None)
        assert store.reads == k + 1
        (rec,) = sm.commit_turn(prepared, [c := engine.choice(engine.response_id(), 0, f"Answer {k}.")])
        assert store.reads == k + 1 and rec.mode == ("new" if k == 0 else "merge")
        messages = messages + [client_message(c), {"role": "user", "content": f"more {k}"}]
    pa, pb = sm.prepare_turn("s-r", messages, None), sm.prepare_turn("s-r", messages, None)
    reads = store.reads
    ra = sm.commit_turn(pa, [engine.choice(engine.response_id(), 0, "A")])
    assert store.reads == reads
    rb = sm.commit_turn(pb, [engine.choice(engine.response_id(), 0, "B")])  # pa's write made pb's read stale
    assert store.reads == reads + 1 and rb[0].trajectory_id != ra[0].trajectory_id
    (trajectory,) = [t for t in store.get_trajectories("s-r") if t.id == ra[0].trajectory_id]
    assert len(trajectory.turns) == 4
    for t in store.get_trajectories("s-r"):
        assert_mask_invariant(t, engine.ledger)
    store.close()


def test_threads_on_many_sessions(sm: SessionManager, store, engine: FakeEngine) -> None:
    choices = {f"t{i}": engine.choice(engine.response_id(), 0, f"Reply {i}.") for i in range(8)}
    errors: list[BaseException] = []

    def run(sid: str) -> None:
        try:
            sm.commit_turn(sm.prepare_turn(sid, [{"role": "user", "content": sid}], None), [choices[sid]])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(sid,)) for sid in choices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for sid in choices:
        [traj] = store.get_trajectories(sid)
        assert_mask_invariant(traj, engine.ledger)


def test_request_without_session_is_a_closed_one_turn_session(sm: SessionManager, store, engine: FakeEngine) -> None:
    prepared = sm.prepare_turn(None, [{"role": "user", "content": "one shot"}], None)
    assert prepared.ephemeral and prepared.session_id.startswith("sess-")
    [rec] = sm.commit_turn(prepared, [engine.choice(engine.response_id(), 0, "Done.")])
    assert store.get_session(rec.session_id).status == "closed"
    [traj] = store.get_trajectories(rec.session_id)
    assert traj.status == "finished"
    assert_mask_invariant(traj, engine.ledger)


def test_truncated_output_without_eos_is_closed_with_mask_zero(sm: SessionManager, store, engine: FakeEngine,
                                                                renderer: ChatRenderer) -> None:
    messages = [{"role": "user", "content": "Long story"}]
    p1 = sm.prepare_turn("s-len", messages, None)
    c1 = engine.choice(engine.response_id(), 0, "Once upon a", finish="length", canonical=False)
    sm.commit_turn(p1, [c1])
    messages += [client_message(c1), {"role": "user", "content": "go on"}]
    p2 = sm.prepare_turn("s-len", messages, None)
    assert p2.mode == "reuse" and p2.prompt_ids[p2.base_len] == renderer.eos_token_id
    sm.commit_turn(p2, [engine.choice(engine.response_id(), 0, "a time.")])
    [traj] = store.get_trajectories("s-len")
    assert_mask_invariant(traj, engine.ledger)


def test_typed_client_errors(sm: SessionManager, store, engine: FakeEngine) -> None:
    with pytest.raises(ChatTemplateError):
        sm.prepare_turn("s-e", [{"role": "robot", "content": "x"}], None)
    with pytest.raises(ChatTemplateError):
        sm.prepare_turn("s-e", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], None)
    with pytest.raises(ValidationError):
        ChoiceResult(output_ids=[1, 2], output_logprobs=[-0.5], response_id="chatcmpl-x")
    sm.commit_turn(sm.prepare_turn("s-e", [{"role": "user", "content": "x"}], None),
                   [engine.choice(engine.response_id(), 0, "y")])
    store.close_session("s-e")
    with pytest.raises(SessionClosedError) as exc:
        sm.prepare_turn("s-e", [{"role": "user", "content": "x"}], None)
    assert exc.value.status_code == 409


def test_weight_versions_from_engine_strings() -> None:
    one = ChoiceResult(output_ids=[5, 6], output_logprobs=[-1.0, -2.0], weight_version="step-7", response_id="r")
    assert one.versions() == [7, 7]
    per_token = ChoiceResult(output_ids=[5, 6], output_logprobs=[-1.0, -2.0], weight_version=["3", 4],
                             response_id="r")
    assert per_token.versions() == [3, 4]
    assert ChoiceResult(output_ids=[5], output_logprobs=[-1.0], weight_version="default",
                        response_id="r").versions() == [0]
    with pytest.raises(ValidationError):
        ChoiceResult(output_ids=[5, 6], output_logprobs=[-1.0, -2.0], weight_version=["3"], response_id="r")
