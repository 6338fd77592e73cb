"""The agent runner: plays environment episodes against any slime-server's ``/v1`` with the openai SDK.

For each dataset row it opens ``n_samples_per_prompt`` sessions sharing one group id (a GRPO
group), runs the chat/tool loop (the model calls tools, the environment answers, up to
``max_turns``), posts the episode's reward, and closes the session; the server's buffer then
holds one rewarded trajectory per episode, in groups, ready for a job. Async with bounded
concurrency; transient errors are retried by the SDK with backoff and 429 (buffer pacing) is waited out
as its ``Retry-After`` says, without limit (``wait_when_paced``): a failed episode would leave its
group incomplete.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import httpx
from pydantic import BaseModel, Field

from slime_server.envs.base import DatasetRow, Environment, ToolOutput
from slime_server.utils.net import tls_context

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


def rest_client(s: RunnerSettings) -> httpx.AsyncClient:
    """The client for the server's own routes (sessions, rewards, closes), with the runner's key; the process's
    one TLS context (building one loads the CA bundle)."""
    return httpx.AsyncClient(base_url=s.base_url, headers={"Authorization": f"Bearer {s.api_key}"},
                             timeout=s.timeout_s, verify=tls_context())


async def _post(rest: httpx.AsyncClient, path: str, body: dict[str, Any], tries: int = 4) -> httpx.Response:
    """POST that rides out a transient server failure (502/503/504, a dropped connection: a busy store,
    a restarting gateway) with backoff; the calls it is used for are harmless to repeat (a reward has its
    idempotency key, a close is idempotent, a session created twice is one empty session more)."""
    for attempt in range(tries):
        try:
            r = await rest.post(path, json=body)
            if r.status_code not in (502, 503, 504) or attempt == tries - 1:
                return r.raise_for_status()
        except httpx.TransportError:
            if attempt == tries - 1:
                raise
        await asyncio.sleep(0.5 * 2 ** attempt)
    raise AssertionError("unreachable")


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
        from openai import AsyncOpenAI, DefaultAsyncHttpxClient

        s = self.settings
        t0 = time.monotonic()
        client = AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=s.max_retries, timeout=s.timeout_s,
                             http_client=DefaultAsyncHttpxClient(verify=tls_context()))  # one TLS setup per process
        rest = rest_client(s)
        try:
            model = s.model or (await client.models.list()).data[0].id
            if s.adapter:
                model = f"{model}:{s.adapter}"
            sem = asyncio.Semaphore(s.concurrency)
            jobs = []
            for i, row in enumerate(rows):
                group = f"grp-{uuid.uuid4().hex[:12]}"
                for k in range(s.n_samples_per_prompt):
                    seed = None if s.seed is None else s.seed + i * s.n_samples_per_prompt + k
                    jobs.append(self._guarded(sem, stop, client, rest, model, row, group, seed, on_episode))
            results = await asyncio.gather(*jobs)
        finally:
            await rest.aclose()
            await client.close()
        done = [r for r in results if not r.cut]
        rewards = [r.reward for r in done]
        return RunSummary(episodes=len(done), groups=len({r.group_id for r in done}),
                          mean_reward=statistics.fmean(rewards) if rewards else 0.0,
                          success_rate=sum(r >= 1.0 for r in rewards) / max(1, len(rewards)),
                          errors=sum(r.error is not None for r in done), seconds=time.monotonic() - t0,
                          results=list(results), cut=len(results) - len(done))

    async def _guarded(self, sem: asyncio.Semaphore, stop: Flag | None, client: Any, rest: httpx.AsyncClient,
                       model: str, row: DatasetRow, group: str, seed: int | None,
                       on_episode: Callable[[EpisodeResult], None] | None) -> EpisodeResult:
        async with sem:
            if stop is not None and stop.is_set():  # not started: no session is opened for it
                return EpisodeResult(session_id="", group_id=group, reward=0.0, turns=0, tool_calls=0, final_text="",
                                     cut=True)
            return await self.episode(client, rest, model, row, group, seed, on_episode, stop=stop)

    async def _create(self, client: Any, stop: Flag | None = None, **kw: Any) -> Any:
        """``chat.completions.create``, waiting out buffer pacing (429) when ``wait_when_paced``."""
        from openai import RateLimitError

        while True:
            if stop is not None and stop.is_set():
                raise EpisodeCut
            try:
                return await client.chat.completions.create(**kw)
            except RateLimitError as e:
                if not self.settings.wait_when_paced:
                    raise
                try:
                    delay = float(e.response.headers.get("retry-after", "1"))
                except ValueError:
                    delay = 1.0
                await asyncio.sleep(min(max(delay, 0.1), 30.0))

    async def episode(self, client: Any, rest: httpx.AsyncClient, model: str, row: DatasetRow, group: str,
                      seed: int | None, on_episode: Callable[[EpisodeResult], None] | None = None, *,
                      stop: Flag | None = None) -> EpisodeResult:
        s = self.settings
        meta = {"env": self.env.name, **({"serve_only": True} if s.serve_only else {})}
        state = self.env.reset(row)
        final_text, turns, error, sid, cut = "", 0, None, "", False
        try:
            sid = (await _post(rest, "/sessions", {"group_id": group, "metadata": meta})).json()["id"]
            for turn in range(self.env.max_turns):
                turns = turn + 1
                resp = await self._create(
                    client, stop, model=model, messages=state.messages, tools=state.tools or None,
                    temperature=s.temperature, max_tokens=s.max_tokens, seed=None if seed is None else seed + turn,
                    extra_headers={"X-Session-Id": sid},
                    metadata={"serve_only": "true"} if s.serve_only else None)
                msg = resp.choices[0].message
                state.messages.append(msg.model_dump(exclude_none=True))
                if not msg.tool_calls:
                    final_text = msg.content or ""
                    break
                shown: list[bytes] = []
                for call in msg.tool_calls:
                    out = self.env.step(state, call.function.name, call.function.arguments)
                    text, images = (out.text, out.images) if isinstance(out, ToolOutput) else (out, [])
                    state.messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
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
                await _post(rest, f"/sessions/{sid}/reward", {"reward": reward, "idempotency_key": f"{sid}-final"})
            if sid:
                await _post(rest, f"/sessions/{sid}/close", {})
        except Exception as e:  # noqa: BLE001 - one episode's failure is its own, never the whole run's
            error = error or repr(e)[:500]
            log.log(logging.DEBUG if cut else logging.WARNING, "episode %s: finishing failed: %s", sid, error)
        result = EpisodeResult(session_id=sid, group_id=group, reward=reward, turns=turns,
                               tool_calls=state.tool_calls, final_text=final_text, error=error, cut=cut)
        if on_episode is not None:
            on_episode(result)
        return result
