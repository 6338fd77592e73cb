"""Implicit feedback: when a session's next user turn arrives, judge the previous assistant turn.

Flow (all off the request path; the user's request is never delayed by the judge):
  1. the gateway prepared a turn that extends a trajectory (``merge``/``reuse``) and the new
     messages contain a user message: that message is the *next state* of the trajectory's last
     assistant turn;
  2. the judge scores (that turn's text, the next user message) -> +1 / -1 / 0 and maybe a hint;
  3. with a hint (and OPD on), the *teacher* is the same policy with the hint appended to the
     context: the engines score the original response tokens under it (input log-probs, no
     generation), giving per-token teacher log-probs;
  4. the judged turn becomes its own finished, rewarded training sample: the trajectory's tokens up
     to the end of that turn, loss on that turn only, ``reward`` = the verdict, teacher log-probs in
     its metadata. A live job trains on it like on any rewarded trajectory (the loop adds
     ``w_opd * (teacher - student)`` per token when ``LoopSettings.opd`` is set).

Rules: a turn is judged once (the sample's session id is derived from the trajectory and turn, so
a second judgement is refused by the store); a verdict of 0 without a hint records nothing (no
signal); the *last* turn of a session has no next state and is never judged: it is trained on
only through explicit feedback or a session reward. Side turns (``X-Turn-Type: side``) are never
judged (they are recorded in their own one-turn session, see the gateway).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from prometheus_client import Counter
from pydantic import BaseModel, Field

from slime_server.buffer.schema import NormalizedMessage, Session, SessionExistsError, Trajectory, Turn
from slime_server.buffer.store import TurnWrite
from slime_server.gateway.threads import in_thread
from slime_server.online.judge import Judge, JudgeSettings, verdict_payload

log = logging.getLogger(__name__)

JUDGED = Counter("slime_online_judged_turns_total", "assistant turns scored by the implicit judge", ["score"])
JUDGE_FAILED = Counter("slime_online_judge_failures_total", "judge calls that failed (the turn stays unjudged)")


class OnlineSettings(BaseModel):
    judge: JudgeSettings = Field(default_factory=JudgeSettings)
    opd: bool = Field(True, description="score judge hints with the hinted teacher (on-policy distillation)")
    max_pending: int = Field(256, ge=1, description="judgements in flight; more are skipped and counted")


def _text(message: NormalizedMessage) -> str:
    """What the judge reads of a message: its text, and its tool calls as JSON."""
    calls = [json.dumps({"name": c.name, "arguments": c.arguments}) for c in message.tool_calls]
    return "\n".join(p for p in [message.content, *calls] if p)


def sample_session_id(trajectory_id: str, turn_index: int) -> str:
    return f"{trajectory_id}:turn-{turn_index}"


def turn_sample(base: Trajectory, turn_index: int, reward: float, metadata: dict[str, Any]) -> Trajectory:
    """Tokens up to the end of turn ``turn_index`` with loss on that turn only."""
    turn = base.turns[turn_index]
    end, start = turn.output_end, turn.output_start
    mask = [0] * start + base.loss_mask[start:end]
    lps = [0.0] * start + base.rollout_logprobs[start:end]
    versions = [-1] * start + base.weight_versions[start:end]
    sid = sample_session_id(base.id, turn_index)
    return Trajectory(session_id=sid, group_id=None, tokens=base.tokens[:end], loss_mask=mask,
                      rollout_logprobs=lps, weight_versions=versions,
                      turns=[turn.model_copy(update={"prompt_start": 0})], messages=[], tools_digest=base.tools_digest,
                      reward=reward, status="finished", metadata=metadata)


class ImplicitFeedback:
    """Attached to the gateway (``gw.feedback``) by ``serve --online``."""

    def __init__(self, gw: Any, settings: OnlineSettings, judge: Judge) -> None:
        self.gw, self.settings, self.judge = gw, settings, judge
        self._tasks: set[asyncio.Task[None]] = set()
        self.skipped = 0

    def on_turn_prepared(self, prepared: Any, tools: list[dict[str, Any]] | None) -> None:
        """Called by the chat handler after ``prepare_turn``; schedules the judgement and returns."""
        if prepared.mode not in ("merge", "reuse") or not prepared.base_trajectory_id:
            return
        if len(self._tasks) >= self.settings.max_pending:
            self.skipped += 1
            return
        task = asyncio.get_running_loop().create_task(self._judge(prepared, tools))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout: float = 30.0) -> None:
        """Wait for the judgements in flight (shutdown, tests)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)

    async def _judge(self, prepared: Any, tools: list[dict[str, Any]] | None) -> None:
        store = self.gw.store
        try:
            base: Trajectory = await in_thread(store.get_trajectory, prepared.base_trajectory_id)
            if not base.turns or not base.messages or base.messages[-1].role != "assistant":
                return
            new = prepared.messages[len(base.messages):]
            nxt = next((m for m in new if m.role == "user"), None)
            if nxt is None:  # a tool result or nothing new: not the user's reaction
                return
            turn_index = len(base.turns) - 1
            verdict = await self.judge.score(_text(base.messages[-1]), _text(nxt))
            JUDGED.labels(str(verdict.score)).inc()
            if verdict.score == 0 and not verdict.hint:
                return
            meta: dict[str, Any] = {"online": True, "source_session": base.session_id,
                                    "source_trajectory": base.id, "turn": turn_index,
                                    "judge": verdict_payload(verdict)}
            if verdict.hint and self.settings.opd:
                meta["teacher_logprobs"] = await self.teacher_logprobs(base, base.turns[turn_index], verdict.hint,
                                                                       tools)
            sample = turn_sample(base, turn_index, float(verdict.score), meta)
            # the sample is its conversation's user's (what a per-user job trains that user's adapter on)
            owner = (await in_thread(store.get_session, base.session_id)).owner
            write = TurnWrite(session_id=sample.session_id, trajectories=[sample], close_session=True,
                              create_session=Session(id=sample.session_id, owner=owner, metadata={
                                  "online_turn_sample": True, "source_session": base.session_id}))
            await in_thread(store.write_turn, write)
        except SessionExistsError:
            pass  # judged already
        except Exception:  # noqa: BLE001 - a failed judgement must never touch serving
            JUDGE_FAILED.inc()
            log.exception("implicit feedback failed for trajectory %s", prepared.base_trajectory_id)

    async def teacher_logprobs(self, base: Trajectory, turn: Turn, hint: str,
                               tools: list[dict[str, Any]] | None) -> list[float]:
        """Per-token log-probs of the turn's own output under the hinted context (0.0 outside it)."""
        context = [m.model_dump(exclude_none=True) for m in base.messages[:-1]]
        context.append({"role": "system", "content": f"Hint for your next reply: {hint}"})
        prompt = await in_thread(self.gw.renderer.render_ids, self.gw.renderer.normalize(context), tools)
        output = base.tokens[turn.output_start:turn.output_end]
        scored = await score_tokens(self.gw.engine.http, prompt, output)
        return [0.0] * turn.output_start + scored


async def score_tokens(http: Any, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """log p(output_ids[i] | prompt_ids + output_ids[:i]) from the engines (SGLang input log-probs)."""
    body = {"input_ids": prompt_ids + output_ids, "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": len(prompt_ids)}
    r = await http.post("/generate", json=body)
    r.raise_for_status()
    entries = r.json()["meta_info"]["input_token_logprobs"]
    values = [float(e[0]) if e[0] is not None else 0.0 for e in entries]
    return values[-len(output_ids):] if output_ids else []
