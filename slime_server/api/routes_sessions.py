"""Sessions, rewards and feedback REST: how environments close the loop with the trainer.

``POST /v1/sessions`` -> id (+ optional per-session key); chat calls name it; the environment
later posts a reward (idempotent by ``Idempotency-Key``), closes the session, and can read the
recorded trajectory exactly as the trainer will see it.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header

from slime_server.api.auth import mint_session_key
from slime_server.api.deps import get_gateway, get_principal
from slime_server.api.sessions_views import SessionView, TrajectoryView, session_view, trajectory_view
from slime_server.buffer.schema import new_id
from slime_server.gateway.core import Gateway
from slime_server.gateway.errors import APIError, bad_request
from slime_server.gateway.principal import Principal
from slime_server.gateway.protocol import (
    CreateSessionRequest,
    ErrorResponse,
    FeedbackRequest,
    FeedbackResult,
    RewardRequest,
    RewardResult,
    SessionClosed,
    SessionCreated,
)
from slime_server.gateway.recording import call_store
from slime_server.gateway.sessions_resolve import get_session_or_404
from slime_server.gateway.threads import in_thread

router = APIRouter(prefix="/v1", tags=["sessions"],
                   responses={s: {"model": ErrorResponse} for s in (400, 401, 403, 404, 409, 413)})

GW = Annotated[Gateway, Depends(get_gateway)]
Caller = Annotated[Principal, Depends(get_principal)]


@router.post("/sessions", response_model=SessionCreated)
async def create_session(body: CreateSessionRequest, gw: GW, principal: Caller) -> SessionCreated:
    principal.require_agent()

    session_id = new_id("sess")
    key, key_hash = mint_session_key(session_id) if body.with_key else (None, None)
    session = await in_thread(call_store, gw.store.create_session, session_id, group_id=body.group_id,
                                      metadata=body.metadata, key_hash=key_hash, owner=principal.session_owner)
    return SessionCreated(id=session.id, group_id=session.group_id, api_key=key)


async def _session(gw: Gateway, principal: Principal, session_id: str) -> Any:
    """The session if the caller may reach it: 403 for another key's session (checked before the
    lookup for session keys, so they cannot probe which ids exist)."""
    principal.check_session_id(session_id)
    session = await in_thread(get_session_or_404, gw.store, session_id)
    principal.check_session(session)
    return session


@router.get("/sessions/{session_id}", response_model=SessionView)
async def get_session(session_id: str, gw: GW, principal: Caller) -> SessionView:
    session = await _session(gw, principal, session_id)
    trajs = await in_thread(call_store, gw.store.get_trajectories, session_id)
    return session_view(session, trajs)


@router.get("/sessions/{session_id}/trajectory", response_model=list[TrajectoryView])
async def get_trajectory(session_id: str, gw: GW, principal: Caller) -> list[TrajectoryView]:
    await _session(gw, principal, session_id)
    trajs = await in_thread(call_store, gw.store.get_trajectories, session_id)
    return [trajectory_view(t) for t in trajs]


@router.post("/sessions/{session_id}/reward", response_model=RewardResult)
async def set_reward(session_id: str, body: RewardRequest, gw: GW, principal: Caller,
                     idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> RewardResult:
    """Scalar (``reward``) or per-turn (``turn_rewards``); the same idempotency key twice changes nothing.
    A scalar reward finishes the session unless the body says ``"final": false``."""
    await _session(gw, principal, session_id)
    if (body.reward is None) == (body.turn_rewards is None):
        raise bad_request("give exactly one of 'reward' or 'turn_rewards'", param="reward")
    key = idempotency_key or body.idempotency_key
    if idempotency_key and body.idempotency_key and idempotency_key != body.idempotency_key:
        raise bad_request("Idempotency-Key header and body field differ", param="idempotency_key")
    changed = await in_thread(call_store, gw.store.set_reward, session_id, reward=body.reward,
                                      turn_rewards=body.turn_rewards, idempotency_key=key,
                                      finish=body.finishes())
    return RewardResult(session_id=session_id, changed=bool(changed), finished=body.finishes())


@router.post("/sessions/{session_id}/close", response_model=SessionClosed)
async def close_session(session_id: str, gw: GW, principal: Caller) -> SessionClosed:
    await _session(gw, principal, session_id)
    await in_thread(call_store, gw.store.close_session, session_id)
    return SessionClosed(id=session_id, status="closed")


@router.post("/sessions/{session_id}/abort")
async def abort_session(session_id: str, gw: GW, principal: Caller) -> dict[str, Any]:
    """Abort the session's generations in flight (over-sampling: surplus rollouts). Never continued."""
    await _session(gw, principal, session_id)
    return {"session_id": session_id, **await gw.abort_session(session_id)}


@router.post("/responses/{response_id}/feedback", response_model=FeedbackResult)
async def feedback(response_id: str, body: FeedbackRequest, gw: GW, principal: Caller) -> FeedbackResult:
    if body.thumb is None and body.score is None:
        raise bad_request("give 'thumb' (up/down) or 'score'", param="thumb")
    found = await in_thread(call_store, gw.store.find_by_response_id, response_id)
    if not found:
        raise APIError(404, f"unknown response '{response_id}'", code="response_not_found")
    await _session(gw, principal, found[0][0].session_id)
    fb = await in_thread(call_store, gw.store.add_feedback, response_id, thumb=body.thumb,
                                 score=body.score, comment=body.comment)
    return FeedbackResult(response_id=response_id, session_id=fb.session_id)
