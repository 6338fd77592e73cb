"""Property test: random interleavings of turns, n>1, tool results, edits, rewinds and bad input over
the real tiny tokenizer never raise anything but typed client errors, and every recorded
trajectory satisfies the mask invariant (generated tokens: mask 1 + exact logprob; others: 0).

History rewrites an agent framework does are among the ops: editing any message (tool results
included), cutting the history back, adding or changing the system prompt, dropping reasoning, and
re-serialising tool-call arguments (same JSON, other spacing or key order)."""

from __future__ import annotations

import json
import tempfile
from functools import cache
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from slime_server.buffer.schema import StoreError
from slime_server.buffer.sqlite_store import SQLiteTrajectoryStore
from slime_server.gateway.chat_template import ChatRenderer
from slime_server.gateway.sessions import SessionManager
from slime_server.models.tiny import ensure_tiny_model
from tests._sessions_helpers import TOOLS, FakeEngine, assert_mask_invariant, client_message

TEXT = st.one_of(st.text(alphabet="ab c,.\n{}\"é7", max_size=10),
                 st.sampled_from(["", "<|im_end|>", "<tool_call>", " hello", "</think>"]))
ARGS = st.dictionaries(st.sampled_from(["city", "n"]), st.one_of(st.integers(-5, 50), TEXT), max_size=2).map(
    lambda d: json.dumps(d, separators=(",", ":")) if len(d) % 2 else json.dumps(d))
OPS = ["turn", "turn", "turn", "user", "edit", "rewind", "bad", "drop_reasoning", "system", "reformat_args"]


@cache
def _renderer() -> ChatRenderer:
    return ChatRenderer(ensure_tiny_model())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_interleavings_keep_the_mask_invariant(data: st.DataObject) -> None:
    renderer = _renderer()
    engine = FakeEngine(renderer)
    with tempfile.TemporaryDirectory() as tmp:
        store = SQLiteTrajectoryStore(Path(tmp) / "h.db")
        sm = SessionManager(store, renderer)
        convs: dict[str, list[dict]] = {"s-a": [], "s-b": []}
        for sid in convs:
            store.create_session(sid)
        tools = data.draw(st.sampled_from([None, TOOLS]))
        try:
            for _ in range(data.draw(st.integers(3, 10))):
                sid = data.draw(st.sampled_from(sorted(convs)))
                msgs = convs[sid]
                op = data.draw(st.sampled_from(OPS))
                event(op)
                if op == "user" or (op == "turn" and (not msgs or msgs[-1]["role"] == "assistant")):
                    msgs.append({"role": "user", "content": data.draw(TEXT)})
                if op == "edit" and msgs:
                    i = data.draw(st.integers(0, len(msgs) - 1))
                    msgs[i] = {**msgs[i], "content": data.draw(TEXT) + "!"}
                elif op == "rewind" and msgs:
                    del msgs[data.draw(st.integers(0, len(msgs) - 1)):]
                elif op == "drop_reasoning":
                    for m in msgs:
                        m.pop("reasoning_content", None)
                elif op == "system":
                    system = {"role": "system", "content": data.draw(TEXT)}
                    if msgs and msgs[0]["role"] == "system":
                        msgs[0] = system
                    else:
                        msgs.insert(0, system)
                elif op == "reformat_args":
                    _reformat_arguments(msgs, data)
                elif op == "bad":
                    bad = msgs + [data.draw(st.sampled_from([
                        {"role": "robot", "content": "x"}, {"role": "user", "content": 3},
                        {"role": "user", "content": [{"type": "audio"}]}]))]
                    try:
                        sm.prepare_turn(sid, bad, tools)
                        raise AssertionError("bad input accepted")
                    except StoreError as e:
                        assert 400 <= e.status_code < 500
                    except ValueError as e:
                        assert getattr(e, "status_code", 0) == 400
                elif op == "turn" and msgs:
                    _turn(sm, store, engine, renderer, sid, msgs, tools, data)
                for traj in store.list_trajectories(limit=1000):
                    assert_mask_invariant(traj, engine.ledger)
        finally:
            store.close()


def _turn(sm: SessionManager, store: SQLiteTrajectoryStore, engine: FakeEngine, renderer: ChatRenderer, sid: str,
          msgs: list[dict], tools: list | None, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 2))
    prepared = sm.prepare_turn(sid, msgs, tools, n=n)
    if prepared.mode != "reuse":
        assert renderer.decode(prepared.prompt_ids) == renderer.render_text(msgs, tools)
    rid = engine.response_id()
    choices = []
    for i in range(n):
        calls = [("get_weather", data.draw(ARGS)) for _ in range(data.draw(st.integers(0, 2)))] if tools else []
        choices.append(engine.choice(
            rid, i, data.draw(TEXT), tool_calls=calls,
            reasoning=data.draw(st.one_of(st.none(), st.sampled_from(["think", "a b"]))),
            canonical=data.draw(st.booleans()), version=data.draw(st.integers(0, 3)),
            finish=data.draw(st.sampled_from(["stop", "stop", "length"]))))
    records = sm.commit_turn(prepared, choices)
    for rec in records:  # the engine saw exactly the recorded context
        traj = store.get_trajectory(rec.trajectory_id)
        assert traj.tokens[: rec.output_start] == prepared.prompt_ids
    picked = choices[data.draw(st.integers(0, n - 1))]
    echoed = client_message(picked)
    if picked.message.get("reasoning_content") and data.draw(st.booleans()):
        echoed["reasoning_content"] = picked.message["reasoning_content"]
    msgs.append(echoed)
    for call in echoed.get("tool_calls") or []:
        msgs.append({"role": "tool", "tool_call_id": call["id"], "content": data.draw(TEXT)})


def _reformat_arguments(msgs: list[dict], data: st.DataObject) -> None:
    """Re-serialise one assistant message's tool-call arguments: the same JSON, other text."""
    calls = [c for m in msgs if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    if not calls:
        return
    call = data.draw(st.sampled_from(calls))
    args = json.loads(call["function"]["arguments"])
    style = data.draw(st.sampled_from([{"separators": (",", ":")}, {"indent": 1}, {"sort_keys": True}, {}]))
    if style.get("sort_keys") is None and data.draw(st.booleans()):
        args = dict(reversed(list(args.items())))
    call["function"] = {**call["function"], "arguments": json.dumps(args, **style)}
