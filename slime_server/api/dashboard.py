"""``/dashboard``: a live view of jobs, training curves, engines and recorded sessions.

Why here and this shape: the server already holds everything the page shows, so the page is static
files (plain JS, uPlot vendored in ``dashboard_static/``, no build step, nothing fetched from a CDN)
served without auth, and every piece of data comes from the JSON API with the admin key, so the
page grants nothing a ``curl`` with that key could not do. Jobs, metrics and trajectories use the
existing routes (``/jobs``, ``/v1/sessions/{id}/trajectory``); this module adds only what had no
route yet: engine health and load, recent sessions, and token ids -> text for the token view.
"""

from __future__ import annotations

import asyncio
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, HTMLResponse
from pydantic import BaseModel, Field, ValidationError

from slime_server.api.deps import Admin, gateway_of
from slime_server.gateway.core import Gateway
from slime_server.gateway.errors import APIError
from slime_server.gateway.protocol import ErrorResponse
from slime_server.gateway.threads import in_thread
from slime_server.rollout.engine_info import engine_weight_version_async
from slime_server.rollout.protocol import LoadsResponse

STATIC = Path(str(resources.files("slime_server.api") / "dashboard_static"))
PROBE_TIMEOUT_S = 2.0  # a stuck engine must not stall the page's 2 s poll for long
MAX_DETOKENIZE = 65_536
_MEDIA = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".txt": "text/plain",
          ".md": "text/plain"}

router = APIRouter(prefix="/dashboard", tags=["dashboard"])
api = APIRouter(prefix="/api", dependencies=[Admin],
                responses={s: {"model": ErrorResponse} for s in (400, 401, 403, 404)})


# ---------------------------------------------------------------- page and static files (no auth)
@router.get("", response_class=HTMLResponse, include_in_schema=False)
async def page() -> HTMLResponse:
    return HTMLResponse((STATIC / "index.html").read_text(), headers={"Cache-Control": "no-cache"})


@router.get("/static/{name}", include_in_schema=False)
async def static_file(name: str) -> FileResponse:
    """Only plain file names of the static folder: no paths, so nothing outside it is reachable."""
    path = STATIC / name
    if "/" in name or "\\" in name or name.startswith(".") or not path.is_file():
        raise APIError(404, f"unknown dashboard file: {name}", code="unknown_url")
    return FileResponse(path, media_type=_MEDIA.get(path.suffix, "application/octet-stream"),
                        headers={"Cache-Control": "no-cache"})


# ---------------------------------------------------------------- engines
class EngineInfo(BaseModel):
    url: str
    router_healthy: bool | None = Field(None, description="the router's own health flag; None: not in the router")
    router_load: int | None = Field(None, description="requests the router counts on this worker")
    healthy: bool = Field(description="the engine's /health answered 200")
    running_reqs: int | None = None
    waiting_reqs: int | None = None
    weight_version: str | None = None
    error: str | None = None


class EnginesView(BaseModel):
    router_url: str
    router_reachable: bool
    router_error: str | None = None
    engines: list[EngineInfo]


async def _probe(http: httpx.AsyncClient, url: str, router_healthy: bool | None, router_load: int | None) -> EngineInfo:
    """One engine's /health, its load and the weight version of /model_info (SGLang's routes; each may be
    missing)."""
    info = EngineInfo(url=url, router_healthy=router_healthy, router_load=router_load, healthy=False)
    try:
        info.healthy = (await http.get(f"{url}/health", timeout=PROBE_TIMEOUT_S)).status_code == 200
    except httpx.HTTPError as e:
        info.error = f"health: {type(e).__name__}"
        return info
    try:
        load = await _engine_load(http, url)
        if load is not None:
            info.running_reqs, info.waiting_reqs = load
        info.weight_version = await engine_weight_version_async(http, url, timeout=PROBE_TIMEOUT_S)
    except (httpx.HTTPError, ValidationError, ValueError, TypeError, AttributeError) as e:
        info.error = f"load: {type(e).__name__}"
    return info


async def _engine_load(http: httpx.AsyncClient, url: str) -> tuple[int, int] | None:
    """(running, waiting) requests over the engine's DP ranks: SGLang 0.5.23's ``/v1/loads``, else the
    ``/get_load`` of earlier releases (a list of ``{num_reqs, num_waiting_reqs}`` per rank); None: neither."""
    r = await http.get(f"{url}/v1/loads", params={"include": "core"}, timeout=PROBE_TIMEOUT_S)
    if r.status_code == 200:
        loads = LoadsResponse.model_validate_json(r.content).loads
        return sum(x.num_running_reqs for x in loads), sum(x.num_waiting_reqs for x in loads)
    r = await http.get(f"{url}/get_load", timeout=PROBE_TIMEOUT_S)
    if r.status_code != 200:
        return None
    body = r.json()
    ranks = body if isinstance(body, list) else [body]
    waiting = sum(int(x.get("num_waiting_reqs", 0)) for x in ranks)
    return max(0, sum(int(x.get("num_reqs", 0)) for x in ranks) - waiting), waiting


@api.get("/engines", response_model=EnginesView)
async def engines(request: Request) -> EnginesView:
    """The router's workers, each probed directly; if the router is down, the deployment's engine list."""
    gw: Gateway = gateway_of(request)
    router_url, http = gw.engine.base_url, gw.engine.http
    view = EnginesView(router_url=router_url, router_reachable=False, engines=[])
    workers: list[tuple[str, bool | None, int | None]] = []
    try:
        r = await http.get(f"{router_url}/workers", timeout=PROBE_TIMEOUT_S)
        r.raise_for_status()
        workers = [(w["url"], bool(w.get("is_healthy", True)), w.get("load"))
                   for w in r.json().get("workers", [])]
        view.router_reachable = True
    except (httpx.HTTPError, ValueError, KeyError, AttributeError) as e:
        view.router_error = f"{type(e).__name__}: {e}"[:300]
        known = gw.jobs.engine_urls() if gw.jobs is not None else []
        workers = [(u, None, None) for u in known]
    view.engines = list(await asyncio.gather(*(_probe(http, *w) for w in workers)))
    return view


# ---------------------------------------------------------------- sessions
class SessionRow(BaseModel):
    id: str
    status: str
    group_id: str | None = None
    created_at: float
    updated_at: float
    num_trajectories: int
    num_tokens: int
    reward: float | None = Field(None, description="reward of the newest rewarded trajectory")
    metadata: dict[str, Any] = {}


class SessionList(BaseModel):
    object: str = "list"
    data: list[SessionRow]


def recent_sessions(store: Any, limit: int) -> list[SessionRow]:
    """Newest sessions first, through the store's interface (SQLite and Postgres alike)."""
    return [SessionRow.model_validate(r.model_dump()) for r in store.recent_sessions(limit)]


@api.get("/sessions", response_model=SessionList)
async def sessions(request: Request, limit: Annotated[int, Query(ge=1, le=500)] = 20) -> SessionList:
    return SessionList(data=await in_thread(recent_sessions, gateway_of(request).store, limit))


class ToolCallInfo(BaseModel):
    name: str
    arguments: str


class TurnTools(BaseModel):
    response_id: str
    tool_calls: list[ToolCallInfo]


class TrajectoryTools(BaseModel):
    trajectory_id: str
    turns: list[TurnTools] = Field(description="in the order of the trajectory view's turns")


@api.get("/sessions/{session_id}/tools", response_model=list[TrajectoryTools])
async def session_tools(session_id: str, request: Request) -> list[TrajectoryTools]:
    """The tool calls of each turn (the trajectory view has none): the token view marks tool turns."""
    store = gateway_of(request).store
    try:
        trajs = await in_thread(store.get_trajectories, session_id)
    except LookupError as e:
        raise APIError(404, f"session {session_id!r} not found", code="session_not_found") from e
    return [TrajectoryTools(trajectory_id=t.id, turns=[
        TurnTools(response_id=turn.response_id,
                  tool_calls=[ToolCallInfo(name=c.name, arguments=c.arguments) for c in turn.tool_calls])
        for turn in t.turns]) for t in trajs]


# ---------------------------------------------------------------- token text
class DetokenizeRequest(BaseModel):
    ids: list[int] = Field(max_length=MAX_DETOKENIZE)


class DetokenizeResponse(BaseModel):
    pieces: list[str] = Field(description="the text of each token on its own (special tokens included)")


@api.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """Token ids -> one text piece per token, with the served model's tokenizer (for the token view)."""
    tokenizer = gateway_of(request).renderer.tokenizer

    def run() -> list[str]:
        return tokenizer.batch_decode([[i] for i in body.ids], skip_special_tokens=False)

    try:
        return DetokenizeResponse(pieces=await in_thread(run))
    except (OverflowError, IndexError, TypeError, ValueError) as e:
        raise APIError(400, f"ids: not token ids of the served model ({type(e).__name__})", param="ids",
                       code="invalid_value") from e


router.include_router(api)  # after the routes above: include_router copies the routes it finds
