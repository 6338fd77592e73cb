"""The agent runner: plays environment episodes against any slime-server's ``/v1`` over plain HTTP.

For each dataset row it opens ``n_samples_per_prompt`` sessions sharing one group id (a GRPO
group), runs the chat/tool loop (the model calls tools, the environment answers, up to
``max_turns``), posts the episode's reward, and closes the session; the server's buffer then
holds one rewarded trajectory per episode, in groups, ready for a job. Async with bounded
concurrency; transient errors are retried with backoff (as the openai SDK retries them) and 429 (buffer
pacing) is waited out as its ``Retry-After`` says, without limit (``wait_when_paced``): a failed episode would
leave its group incomplete.

The Chat Completions call is a JSON POST read as JSON (agents/server_client.py), not the openai SDK's: the SDK's
request transforms and response models were a fifth of a training process's CPU (profiled: the demo's calculator
episodes, where the gateway, the store and the runner share one process); the wire is the same.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pydantic import BaseModel, Field

from slime_server.agents.server_client import HTTPStatusError, Reply, ServerClient, TransportError
from slime_server.envs.base import DatasetRow, Environment, ToolOutput

log = logging.getLogger(__name__)


class Flag(Protocol):
    """What stops a run: a ``threading.Event`` or anything with ``is_set``."""

    def is_set(self) -> bool: ...


class EpisodeCut(Exception):
    """The run was stopped: the episode makes no further call (the one in flight completes and is recorded)."""


class RunnerSettings(BaseModel):
    base_url: str = Field(description="the server's /v1 URL")
    api_key: str = "none"
    model: str | None = Field(None, description="default: the first model the server lists")
    adapter: str | None = Field(None, description="a LoRA adapter (or a job's alias) of that model: the episodes ask "
                                "for '<model>:<adapter>'")
    n_samples_per_prompt: int = Field(4, ge=1)
    concurrency: int = Field(8, ge=1)
    temperature: float = Field(1.0, ge=0)
    max_tokens: int = Field(64, ge=1)
    seed: int | None = None
    max_retries: int = Field(8, ge=0)
    timeout_s: float = Field(300.0, gt=0)
    post_rewards: bool = Field(True, description="False for evaluation runs that must not train")
    serve_only: bool = Field(False, description="mark sessions serve-only (never paced, e.g. evaluation)")
    wait_when_paced: bool = Field(
        True, description="a 429 from buffer pacing is back-pressure, not a failure: keep waiting as its Retry-After "
        "says (a failed episode would leave its group incomplete, and the trainer waits for whole groups)")


class EpisodeResult(BaseModel):
    session_id: str
    group_id: str
    reward: float
    turns: int
    tool_calls: int
    final_text: str
    error: str | None = None
    cut: bool = Field(False, description="stopped before its end (the run's stop flag): not a failure, no reward")


class RunSummary(BaseModel):
    episodes: int
    groups: int
    mean_reward: float
    success_rate: float
    errors: int
    seconds: float
    cut: int = Field(0, description="episodes stopped before their end by the run's stop flag (not counted above)")
    results: list[EpisodeResult]


class APIStatusError(HTTPStatusError):
    """A Chat Completions call the server refused (its status and its error body, as the openai SDK's error says)."""


class RateLimitError(APIStatusError):
    """A 429: buffer pacing (or a server's rate limit)."""


def _retried(status: int) -> bool:
    """A timeout, a limit or a server failure, as the openai SDK retries them; not its 409 (here: a closed session,
    which stays closed)."""
    return status in (408, 429) or status >= 500


def _retry_delay(response: Reply | None, attempt: int) -> float:
    """The server's Retry-After when it gives a usable one, else the SDK's backoff (0.5 s doubling to 8 s, less up
    to a quarter at random so that retries spread)."""
    try:
        after = float(response.headers.get("retry-after", "")) if response is not None else -1.0
    except ValueError:
        after = -1.0
    if 0 <= after <= 60:
        return after
    return min(0.5 * 2 ** attempt, 8.0) * (1 - 0.25 * random.random())


def _without_none(value: Any) -> Any:
    """A JSON value with every null field left out (as the SDK's ``model_dump(exclude_none=True)``): the
    assistant's message goes back into the conversation as the server would take it from any client."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def tool_images_message(images: list[bytes]) -> dict[str, Any]:
    """The user turn that shows a vision-language model the images its tools returned (data URLs, in order)."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": "The tool returned:"}]
    for data in images:
        mime = "image/jpeg" if data[:3] == b"\xff\xd8\xff" else "image/png"
        parts.append({"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}})
    return {"role": "user", "content": parts}


class AgentRunner:
    def __init__(self, env: Environment, settings: RunnerSettings) -> None:
        self.env = env
        self.settings = settings

    async def run(self, rows: Sequence[DatasetRow], *, on_episode: Callable[[EpisodeResult], None] | None = None,
                  stop: Flag | None = None) -> RunSummary:
        """Play every row's group; once ``stop`` is set, episodes make no new call (a call in flight completes
        and is recorded, so nothing reaches the server after this returns) and end as ``cut``."""
        s = self.settings
        t0 = time.monotonic()
        rest = ServerClient(s.base_url, s.api_key, s.timeout_s)
        try:
            model = s.model or (await rest.get_json("/models"))["data"][0]["id"]
            if s.adapter:
                model = f"{model}:{s.adapter}"
            sem = asyncio.Semaphore(s.concurrency)
            jobs = []
            for i, row in enumerate(rows):
                group = f"grp-{uuid.uuid4().hex[:12]}"
                for k in range(s.n_samples_per_prompt):
                    seed = None if s.seed is None else s.seed + i * s.n_samples_per_prompt + k
                    jobs.append(self._guarded(sem, stop, rest, model, row, group, seed, on_episode))
            results = await asyncio.gather(*jobs)
        finally:
            await rest.aclose()
        done = [r for r in results if not r.cut]
        rewards = [r.reward for r in done]
        return RunSummary(episodes=len(done), groups=len({r.group_id for r in done}),
                          mean_reward=statistics.fmean(rewards) if rewards else 0.0,
                          success_rate=sum(r >= 1.0 for r in rewards) / max(1, len(rewards)),
                          errors=sum(r.error is not None for r in done), seconds=time.monotonic() - t0,
                          results=list(results), cut=len(results) - len(done))

    async def _guarded(self, sem: asyncio.Semaphore, stop: Flag | None, rest: ServerClient, model: str,
                       row: DatasetRow, group: str, seed: int | None,
                       on_episode: Callable[[EpisodeResult], None] | None) -> EpisodeResult:
        async with sem:
            if stop is not None and stop.is_set():  # not started: no session is opened for it
                return EpisodeResult(session_id="", group_id=group, reward=0.0, turns=0, tool_calls=0, final_text="",
                                     cut=True)
            return await self.episode(rest, model, row, group, seed, on_episode, stop=stop)

    async def _create(self, rest: ServerClient, body: dict[str, Any], headers: dict[str, str],
                      stop: Flag | None = None) -> dict[str, Any]:
        """POST /chat/completions: a transient failure is retried ``max_retries`` times with backoff, buffer pacing
        (429) is waited out without limit when ``wait_when_paced``; any other refusal raises."""
        s, attempt = self.settings, 0
        while True:
            if stop is not None and stop.is_set():
                raise EpisodeCut
            response: Reply | None = None
            try:
                response = await rest.request("POST", "/chat/completions", body, headers)
            except TransportError:
                if attempt >= s.max_retries:
                    raise
            else:
                if response.status_code < 400:
                    return response.json()
                paced = response.status_code == 429 and s.wait_when_paced
                if not _retried(response.status_code) or (attempt >= s.max_retries and not paced):
                    raise (RateLimitError if response.status_code == 429 else APIStatusError)(response)
                if paced:
                    await asyncio.sleep(min(max(_retry_delay(response, 0), 0.1), 30.0))
                    continue
            await asyncio.sleep(_retry_delay(response, attempt))
            attempt += 1

    async def episode(self, rest: ServerClient, model: str, row: DatasetRow, group: str, seed: int | None,
                      on_episode: Callable[[EpisodeResult], None] | None = None, *,
                      stop: Flag | None = None) -> EpisodeResult:
        s = self.settings
        meta = {"env": self.env.name, **({"serve_only": True} if s.serve_only else {})}
        state = self.env.reset(row)
        final_text, turns, error, sid, cut = "", 0, None, "", False
        try:
            sid = (await rest.post_retrying("/sessions", {"group_id": group, "metadata": meta})).json()["id"]
            for turn in range(self.env.max_turns):
                turns = turn + 1
                body = {"model": model, "messages": state.messages, "tools": state.tools or None,
                        "temperature": s.temperature, "max_tokens": s.max_tokens,
                        "seed": None if seed is None else seed + turn,
                        "metadata": {"serve_only": "true"} if s.serve_only else None}
                resp = await self._create(rest, {k: v for k, v in body.items() if v is not None},
                                          {"X-Session-Id": sid}, stop)
                msg = _without_none(resp["choices"][0]["message"])
                state.messages.append(msg)
                if not msg.get("tool_calls"):
                    final_text = msg.get("content") or ""
                    break
                shown: list[bytes] = []
                for call in msg["tool_calls"]:
                    out = self.env.step(state, call["function"]["name"], call["function"]["arguments"])
                    text, images = (out.text, out.images) if isinstance(out, ToolOutput) else (out, [])
                    state.messages.append({"role": "tool", "tool_call_id": call["id"], "content": text})
                    shown += images
                if shown:  # Chat Completions' tool messages hold text: the tools' images follow as a user turn
                    state.messages.append(tool_images_message(shown))
            reward = self.env.reward(state, final_text)
        except EpisodeCut:
            reward, cut = 0.0, True
        except Exception as e:  # noqa: BLE001 - an episode that failed is reported, with reward 0
            reward, error = 0.0, repr(e)[:500]
            log.warning("episode %s failed: %s", sid, error)
        try:
            if s.post_rewards and error is None and not cut:
                await rest.post_retrying(f"/sessions/{sid}/reward",
                                         {"reward": reward, "idempotency_key": f"{sid}-final"})
            if sid:
                await rest.post_retrying(f"/sessions/{sid}/close", {})
        except Exception as e:  # noqa: BLE001 - one episode's failure is its own, never the whole run's
            error = error or repr(e)[:500]
            log.log(logging.DEBUG if cut else logging.WARNING, "episode %s: finishing failed: %s", sid, error)
        result = EpisodeResult(session_id=sid, group_id=group, reward=reward, turns=turns,
                               tool_calls=state.tool_calls, final_text=final_text, error=error, cut=cut)
        if on_episode is not None:
            on_episode(result)
        return result
