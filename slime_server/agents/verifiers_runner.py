"""A job's episodes from a verifiers environment (``data.source: verifiers``): its rollouts played through /v1.

verifiers (PrimeIntellect) environments bring their dataset, their interaction (single-turn, multi-turn, tools)
and their rubric. This runner plays one group of ``n_samples_per_prompt`` rollouts per dataset row, each in its
own session of one group (every model call carries ``X-Session-Id``, so the gateway records it token-exactly),
scores the group with the environment's rubric (``score_group``: group-aware reward functions see the whole group),
and posts each session's rubric reward. The environment's own loop runs unmodified: only its client is ours, one
per rollout, bound to that rollout's session, waiting out buffer pacing (429) as the built-in runner does.

Built against verifiers 0.3.x, the last releases with the classic environment API (``load_environment(**args)``,
``SingleTurnEnv``/``MultiTurnEnv``/``ToolEnv``, ``Rubric``), which they keep under ``verifiers.legacy`` and the
historical top-level names. 0.4.0 removed that API (Taskset/Agent/Trace; see docs/research/verifiers-0.4.0.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
import signal
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import verifiers as vf
from openai import AsyncOpenAI, RateLimitError

SUPPORTED = "0.3"  # the release line whose environment API this runner speaks (pinned in pyproject's extra)
if not vf.__version__.startswith(SUPPORTED + "."):  # before its modules are read: another line has other ones
    raise ImportError(f"verifiers {vf.__version__} is installed; data.source 'verifiers' speaks the {SUPPORTED}.x "
                      f"environment API (pip install 'verifiers=={SUPPORTED}.*')")

from verifiers.clients.openai_chat_completions_client import OpenAIChatCompletionsClient  # noqa: E402

from slime_server.agents.runner import (  # noqa: E402
    EpisodeCut,
    EpisodeResult,
    Flag,
    RunnerSettings,
    RunSummary,
)
from slime_server.agents.server_client import ServerClient  # noqa: E402
from slime_server.envs.base import verifiers_module  # noqa: E402
from slime_server.utils.net import tls_context  # noqa: E402

log = logging.getLogger(__name__)


class _SignalsStayTheServers:
    """verifiers' ``Environment`` installs SIGINT/SIGTERM handlers as it is built (its teardown, then
    ``exit(143)``): in a server they would replace the server's own shutdown, and off the main thread (a job
    starts in a request's thread) they raise. Its module sees this stand-in: the signal module, with ``signal()``
    a no-op (the environment's teardown still runs at exit, by the atexit hook it also registers)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(signal, name)

    @staticmethod
    def signal(signum: int, handler: Any) -> Any:
        return signal.getsignal(signum)


importlib.import_module("verifiers.envs.environment").signal = _SignalsStayTheServers()


def load(env_id: str, env_args: dict[str, Any]) -> Any:
    """The environment, or a ValueError that names what is wrong: not installed, arguments its
    ``load_environment`` does not take, or its own refusal of their values."""
    name = verifiers_module(env_id)
    factory = getattr(importlib.import_module(name), "load_environment", None)
    if factory is None:
        raise ValueError(f"module {name!r} has no load_environment(): not a verifiers environment")
    try:
        inspect.signature(factory).bind(**env_args)
    except TypeError as e:
        raise ValueError(f"data.env_args do not fit {name}.load_environment{inspect.signature(factory)}: {e}") from e
    with contextlib.suppress(ImportError):  # an environment's dataset maps would print bars into the server's log
        import datasets

        datasets.disable_progress_bars()
    try:
        env = factory(**env_args)
    except Exception as e:  # noqa: BLE001 - the environment's own refusal, named for the 400
        raise ValueError(f"verifiers environment {env_id!r} refused data.env_args {env_args}: {e!r}") from e
    if not isinstance(env, vf.Environment):
        raise ValueError(f"{name}.load_environment() returned {type(env).__name__}, not a verifiers Environment")
    env.env_id, env.env_args = env.env_id or env_id, env.env_args or env_args
    return env


def rows_of(env: Any, seed: int, n: int = -1, *, split: str = "train") -> list[dict[str, Any]]:
    """``n`` (-1: all) of the environment's ``split`` rows ("train" or "eval"; the other split when it has none),
    shuffled by ``seed``: the same rows for the same seed (an eval set's at every round)."""
    has = {"train": env.dataset_source is not None or env.dataset is not None,
           "eval": env.eval_dataset_source is not None or env.eval_dataset is not None}
    use_eval = has["eval"] if split == "eval" else not has["train"]
    ds = env.get_eval_dataset(n=n, seed=seed) if use_eval else env.get_dataset(n=n, seed=seed)
    return [dict(r) for r in ds]


def _retry_after(e: RateLimitError) -> float:
    try:
        return min(max(float(e.response.headers.get("retry-after", "1")), 0.1), 30.0)
    except ValueError:
        return 1.0


class SessionClient(OpenAIChatCompletionsClient):
    """verifiers' Chat Completions client for one rollout: every call in the rollout's session; a 429 of buffer
    pacing waited out for its Retry-After (a failed rollout would leave its group incomplete); once the run's
    stop flag is set, no new call (``EpisodeCut``)."""

    def __init__(self, client: AsyncOpenAI, stop: Flag | None) -> None:
        super().__init__(client)
        self.stop = stop

    async def get_native_response(self, *args: Any, **kwargs: Any) -> Any:
        while True:
            if self.stop is not None and self.stop.is_set():
                raise EpisodeCut
            try:
                return await super().get_native_response(*args, **kwargs)
            except RateLimitError as e:
                await asyncio.sleep(_retry_after(e))


def _failure(state: Any) -> str | None:
    """A rollout error that is not the model's own doing (an empty or malformed reply is the policy's, and
    scored as the rubric says): the server or the environment failed, and the episode has no reward."""
    err = state.get("error")
    if err is None or isinstance(err, vf.InvalidModelResponseError):
        return None
    return repr(err)[:500]


def _cut(state: Any) -> bool:
    err = state.get("error")
    return err is not None and isinstance(err.__cause__, EpisodeCut)


def _final_text(state: Any) -> str:
    for msg in reversed(state.get("completion") or []):
        if getattr(msg, "role", None) == "assistant":
            content = getattr(msg, "content", None)
            return content if isinstance(content, str) else ""
    return ""


@dataclass(eq=False)
class _Played:
    """One rollout as played: its session, the environment's state, why it failed (no reward), or cut (the run
    was stopped: neither a failure nor rewarded)."""

    sid: str = ""
    state: Any = None
    error: str | None = None
    cut: bool = False


class VerifiersRunner:
    """Plays rows of a verifiers environment as GRPO groups through a server's /v1 (``run``, as ``AgentRunner``)."""

    def __init__(self, env: Any, settings: RunnerSettings, sampling_args: dict[str, Any] | None = None) -> None:
        self.env, self.settings = env, settings
        self.sampling = {**env.sampling_args, **(sampling_args or {}),
                         "temperature": settings.temperature, "max_tokens": settings.max_tokens,
                         **({"metadata": {"serve_only": "true"}} if settings.serve_only else {})}
        self.metric_means: dict[str, float] = {}  # the rubric's functions, averaged over the last run's episodes

    async def run(self, rows: Sequence[dict[str, Any]], *, stop: Flag | None = None) -> RunSummary:
        s = self.settings
        t0 = time.monotonic()
        http = httpx.AsyncClient(timeout=s.timeout_s, verify=tls_context())  # one TLS setup per process, not per run
        rest = ServerClient(s.base_url, s.api_key, s.timeout_s)
        try:
            lister = AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, http_client=http)
            model = s.model or (await lister.models.list()).data[0].id
            if s.adapter:
                model = f"{model}:{s.adapter}"
            sem = asyncio.Semaphore(s.concurrency)
            groups = await asyncio.gather(*(self._group(sem, stop, http, rest, model, row, i)
                                            for i, row in enumerate(rows)))
        finally:
            await rest.aclose()
            await http.aclose()
        results = [r for g, _ in groups for r in g]
        metrics = [m for _, ms in groups for m in ms]
        self.metric_means = {k: statistics.fmean(m[k] for m in metrics if k in m)
                             for k in sorted({k for m in metrics for k in m})}
        done = [r for r in results if not r.cut]
        rewards = [r.reward for r in done if r.error is None]
        return RunSummary(episodes=len(done), groups=len({r.group_id for r in done}),
                          mean_reward=statistics.fmean(rewards) if rewards else 0.0,
                          success_rate=sum(r >= 1.0 for r in rewards) / max(1, len(rewards)),
                          errors=sum(r.error is not None for r in done), seconds=time.monotonic() - t0,
                          results=results, cut=len(results) - len(done))

    async def _group(self, sem: asyncio.Semaphore, stop: Flag | None, http: httpx.AsyncClient,
                     rest: ServerClient, model: str, row: dict[str, Any], index: int,
                     ) -> tuple[list[EpisodeResult], list[dict[str, float]]]:
        s = self.settings
        group = f"grp-{uuid.uuid4().hex[:12]}"
        n = s.n_samples_per_prompt
        played = await asyncio.gather(*(self._rollout(sem, stop, http, rest, model, row, group,
                                                      None if s.seed is None else s.seed + index * n + k)
                                        for k in range(n)))
        scored = [p for p in played if p.state is not None and not p.cut and p.error is None]
        if scored:  # the rubric over the whole group at once (group reward functions compare its members)
            try:
                await self.env.rubric.score_group([p.state for p in scored])
            except Exception as e:  # noqa: BLE001 - the environment's rubric raised: the group has no rewards
                log.warning("verifiers rubric failed on group %s: %r", group, e)
                for p in scored:
                    p.error = f"the rubric failed: {e!r}"[:500]
                scored = []
        results: list[EpisodeResult] = []
        for p in played:
            reward = float(p.state["reward"] or 0.0) if p in scored else 0.0
            try:
                if s.post_rewards and p in scored:
                    await rest.post_retrying(f"/sessions/{p.sid}/reward", {"reward": reward,
                                                                          "idempotency_key": f"{p.sid}-final"})
                if p.sid:
                    await rest.post_retrying(f"/sessions/{p.sid}/close", {})
            except Exception as e:  # noqa: BLE001 - one episode's failure is its own
                p.error = p.error or repr(e)[:500]
            st = p.state
            if st is not None:
                with contextlib.suppress(Exception):  # the environment's cleanup: its own business
                    await self.env.rubric.cleanup(st)
            results.append(EpisodeResult(
                session_id=p.sid, group_id=group, reward=reward, cut=p.cut, error=None if p.cut else p.error,
                turns=len(st["trajectory"]) if st is not None else 0,
                tool_calls=int((st.get("metrics") or {}).get("total_tool_calls", 0)) if st is not None else 0,
                final_text=_final_text(st) if st is not None else ""))
        return results, [p.state.get("metrics") or {} for p in scored]

    async def _rollout(self, sem: asyncio.Semaphore, stop: Flag | None, http: httpx.AsyncClient,
                       rest: ServerClient, model: str, row: dict[str, Any], group: str,
                       seed: int | None) -> _Played:
        s = self.settings
        async with sem:
            if stop is not None and stop.is_set():  # not started: no session is opened for it
                return _Played(cut=True)
            meta = {"env": f"verifiers:{self.env.env_id}", "example_id": row.get("example_id"),
                    **({"serve_only": True} if s.serve_only else {})}
            try:
                sid = (await rest.post_retrying("/sessions", {"group_id": group, "metadata": meta})).json()["id"]
            except Exception as e:  # noqa: BLE001 - the server did not take the session: this episode failed
                return _Played(error=repr(e)[:500])
            client = AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, http_client=http, max_retries=s.max_retries,
                                 default_headers={"X-Session-Id": sid})
            try:
                sampling = {**self.sampling, **({"seed": seed} if seed is not None else {})}  # every turn's
                state = await self.env.rollout(row, SessionClient(client, stop), model, sampling)
            except Exception as e:  # noqa: BLE001 - the environment's own code raised: its episode failed
                cut = stop is not None and stop.is_set()
                if not cut:
                    log.warning("verifiers rollout %s raised: %r", sid, e)
                return _Played(sid, error=repr(e)[:500], cut=cut)
            if _cut(state):
                return _Played(sid, state, cut=True)
            error = _failure(state)
            if error is not None:
                log.warning("verifiers rollout %s failed: %s", sid, error)
            return _Played(sid, state, error)

