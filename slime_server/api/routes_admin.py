"""Admin REST: mint, list and revoke API keys; export trajectories over HTTP.

Why keys over REST: an operator hands each agent fleet (or tenant) its own key, whose sessions no
other agent key can read or reward, and revokes it without restarting the server. The key's
secret is shown once, in the creation answer; only its hash is stored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from slime_server.api.deps import get_gateway, require_admin
from slime_server.buffer.export import SampleNumbering
from slime_server.buffer.key_store import ApiKeyRecord, KeyRole, MintedKey
from slime_server.gateway.core import Gateway
from slime_server.gateway.errors import APIError
from slime_server.gateway.protocol import ErrorResponse
from slime_server.gateway.threads import in_thread

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)],
                   responses={s: {"model": ErrorResponse} for s in (400, 401, 403, 404, 503)})

GW = Annotated[Gateway, Depends(get_gateway)]


class CreateKeyRequest(BaseModel):
    role: KeyRole = Field("agent", description="agent: /v1 and its own sessions; frontend: an agent key of a trusted "
                          "front end, which may name the user of each call (X-Slime-User); admin: everything")
    name: str = Field("", max_length=200, description="a label for listings (who holds the key)")


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ApiKeyRecord]


def _keys(gw: Gateway) -> Any:
    if gw.keys is None:
        raise APIError(503, "this server's store keeps no keys", code="no_key_store")
    return gw.keys


@router.post("/keys", response_model=MintedKey)
async def create_key(body: CreateKeyRequest, gw: GW) -> MintedKey:
    return await in_thread(_keys(gw).mint, body.role, body.name)


@router.get("/keys", response_model=KeyList)
async def list_keys(gw: GW) -> KeyList:
    return KeyList(data=await in_thread(_keys(gw).list))


@router.post("/keys/{key_id}/revoke", response_model=ApiKeyRecord)
async def revoke_key(key_id: str, gw: GW) -> ApiKeyRecord:
    record = await in_thread(_keys(gw).revoke, key_id)
    if record is None:
        raise APIError(404, f"unknown key '{key_id}'", code="key_not_found", param="key_id")
    return record


@router.get("/export", responses={200: {"content": {"application/x-ndjson": {}}}})
async def export(gw: GW, status: Literal["finished", "open", "aborted", "all"] = "finished",
                 rewarded_only: bool = False, limit: Annotated[int | None, Query(ge=1)] = None) -> StreamingResponse:
    """Trajectories as slime samples, one JSON object per line (what ``slime-server export`` writes)."""
    it = SampleNumbering(gw.store).samples(gw.store.iter_trajectories(
        status=None if status == "all" else status, rewarded=True if rewarded_only else None))

    def next_lines(n: int = 64) -> list[str]:
        lines = []
        for sample in it:
            lines.append(json.dumps(sample.model_dump(), ensure_ascii=False) + "\n")
            if len(lines) == n:
                break
        return lines

    async def body():
        sent = 0
        while limit is None or sent < limit:
            lines = await in_thread(next_lines)
            if not lines:
                return
            lines = lines if limit is None else lines[: limit - sent]
            sent += len(lines)
            yield "".join(lines)

    return StreamingResponse(body(), media_type="application/x-ndjson")
