"""Jobs REST: create, inspect, pause/resume/cancel, metrics, events (SSE) and checkpoints.

Every route needs an admin key (``api/auth.py``: the admin key, a minted admin key, or the server
key when no admin key is set); agent and session keys get 403. Errors are OpenAI-shaped like the rest of the API.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse

from slime_server.api.deps import Admin, gateway_of
from slime_server.buffer.job_store import EventRow, MetricsRow
from slime_server.gateway.core import Gateway
from slime_server.gateway.errors import APIError
from slime_server.gateway.protocol import ErrorResponse
from slime_server.gateway.threads import in_thread
from slime_server.jobs.errors import JobError
from slime_server.jobs.spec import JobSpec, JobView

if TYPE_CHECKING:
    from slime_server.jobs.manager import JobManager

router = APIRouter(prefix="/jobs", tags=["jobs"],
                   responses={s: {"model": ErrorResponse} for s in (400, 401, 403, 404, 409, 503)})


async def get_jobs(request: Request) -> JobManager:
    gw: Gateway = gateway_of(request)
    if gw.jobs is None:
        raise APIError(503, "this server runs without a trainer (serve --no-trainer)", code="no_trainer")
    return gw.jobs


# Any, not JobManager: FastAPI resolves the annotation at import, and the manager module loads the trainer
# (torch), which a gateway without one must not load (tests/test_import_graph.py)
Jobs = Annotated[Any, Depends(get_jobs)]
TERMINAL = ("completed", "failed", "cancelled")
MAX_SEQ = 2**63 - 1  # SQLite integers are 64-bit: a larger cursor would be a 500, not a 400


async def _call(fn, *args: Any) -> Any:
    try:
        return await in_thread(fn, *args)
    except JobError as e:
        raise APIError(e.status_code, str(e), code=e.code) from e


@router.post("", response_model=JobView, dependencies=[Admin])
async def create_job(spec: JobSpec, jobs: Jobs) -> JobView:
    return await _call(jobs.create, spec)


@router.get("", dependencies=[Admin])
async def list_jobs(jobs: Jobs) -> dict[str, Any]:
    return {"object": "list", "data": [j.model_dump() for j in await _call(jobs.list)]}


@router.get("/{job_id}", response_model=JobView, dependencies=[Admin])
async def get_job(job_id: str, jobs: Jobs) -> JobView:
    return await _call(jobs.get, job_id)


@router.post("/{job_id}/pause", response_model=JobView, dependencies=[Admin])
async def pause_job(job_id: str, jobs: Jobs) -> JobView:
    return await _call(jobs.pause, job_id)


@router.post("/{job_id}/resume", response_model=JobView, dependencies=[Admin])
async def resume_job(job_id: str, jobs: Jobs) -> JobView:
    return await _call(jobs.resume, job_id)


@router.post("/{job_id}/cancel", response_model=JobView, dependencies=[Admin])
async def cancel_job(job_id: str, jobs: Jobs) -> JobView:
    return await _call(jobs.cancel, job_id)


@router.get("/{job_id}/metrics", response_model=list[MetricsRow], dependencies=[Admin])
async def job_metrics(job_id: str, jobs: Jobs, since_step: Annotated[int, Query(ge=0, le=MAX_SEQ)] = 0) -> list[MetricsRow]:
    return await _call(jobs.metrics, job_id, since_step)


@router.get("/{job_id}/evals", dependencies=[Admin])
async def job_evals(job_id: str, jobs: Jobs) -> dict[str, Any]:
    """Evaluation results (greedy, serve-only episodes), one entry per eval set and policy version."""
    events: list[EventRow] = await _call(jobs.events, job_id, 0)
    return {"object": "list", "data": [{"t": e.t, **e.data} for e in events if e.kind == "eval"]}


@router.post("/{job_id}/checkpoints", dependencies=[Admin])
async def create_checkpoint(job_id: str, jobs: Jobs) -> dict[str, Any]:
    return await _call(jobs.request_checkpoint, job_id)


@router.get("/{job_id}/checkpoints", dependencies=[Admin])
async def list_checkpoints(job_id: str, jobs: Jobs) -> dict[str, Any]:
    return {"object": "list", "data": await _call(jobs.checkpoints, job_id)}


@router.get("/{job_id}/events", dependencies=[Admin], responses={200: {"content": {"text/event-stream": {}}}})
async def job_events(job_id: str, jobs: Jobs, request: Request,
                     after: Annotated[int, Query(ge=0, le=MAX_SEQ, description="replay events after this seq")] = 0,
                     follow: bool = True) -> StreamingResponse:
    """Server-sent events: the stored history after ``after``, then live events while ``follow``.

    The stream ends with the job's terminal event, and at once for a job that had already ended."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[EventRow] = asyncio.Queue()
    unsubscribe = jobs.subscribe(  # before reading the history, so no event falls between the two
        lambda jid, ev: loop.call_soon_threadsafe(queue.put_nowait, ev) if jid == job_id else None)
    try:
        ended = (await _call(jobs.get, job_id)).status in TERMINAL
        history: list[EventRow] = await _call(jobs.events, job_id, after)
    except BaseException:
        unsubscribe()
        raise

    def frame(ev: EventRow) -> str:
        return f"id: {ev.seq}\nevent: {ev.kind}\ndata: {json.dumps(ev.model_dump(), default=str)}\n\n"

    async def stream():
        try:
            last = after
            for ev in history:
                last = ev.seq
                yield frame(ev)
            if any(ev.kind in TERMINAL for ev in history):
                return
            while follow and not await request.is_disconnected():
                try:  # an ended job's last event is already queued, if it is not in the history
                    ev = await asyncio.wait_for(queue.get(), timeout=1 if ended else 15)
                except TimeoutError:
                    if ended or (await _call(jobs.get, job_id)).status in TERMINAL:
                        return
                    yield ": keep-alive\n\n"
                    continue
                if ev.seq > last:
                    last = ev.seq
                    yield frame(ev)
                    if ev.kind in TERMINAL:
                        return
        finally:
            unsubscribe()

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
