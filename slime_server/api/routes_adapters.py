"""Admin REST over published LoRA adapters: list the aliases, delete one (issue 43).

Why deleting is more than a row: the alias's versions sit in every engine and its saved versions on disk; a user
whose adapter is deleted must be served by the base from then on, with nothing of theirs left to load again. A
user's adapter can be deleted while its per-user job runs: the job lets the user go first (their slot starts
fresh, their unconsumed samples and parked copy go, its checkpoints are replaced by one without them), then the
alias, the engines' versions and the saved copies go; their next rewarded conversations start a new adapter.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel

from slime_server.api.deps import get_gateway, require_admin
from slime_server.buffer.adapter_store import AdapterStore, PublishedAdapter, is_user_alias, is_version_of
from slime_server.gateway.core import Gateway
from slime_server.gateway.errors import APIError
from slime_server.gateway.protocol import ErrorResponse
from slime_server.gateway.threads import in_thread
from slime_server.jobs.errors import JobError
from slime_server.jobs.spec import ACTIVE

router = APIRouter(prefix="/admin/adapters", tags=["admin"], dependencies=[Depends(require_admin)],
                   responses={s: {"model": ErrorResponse} for s in (401, 403, 404, 409, 503)})

GW = Annotated[Gateway, Depends(get_gateway)]


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[PublishedAdapter]


class DeletedAdapter(BaseModel):
    alias: str
    deleted: bool = True
    unloaded: list[str]  # the versions the engines held
    removed_dirs: list[str]  # saved versions removed from disk


def _store(gw: Gateway) -> AdapterStore:
    if gw.adapters.aliases is None:
        raise APIError(503, "this server's store keeps no adapters", code="no_adapter_store")
    return gw.adapters.aliases


@router.get("", response_model=AdapterList)
async def list_adapters(gw: GW) -> AdapterList:
    return AdapterList(data=await in_thread(_store(gw).list))


@router.delete("/{alias}", response_model=DeletedAdapter)
async def delete_adapter(alias: str, gw: GW) -> DeletedAdapter:
    store = _store(gw)
    record = await in_thread(store.get, alias)
    if record is None:
        raise APIError(404, f"no adapter alias '{alias}'", code="adapter_not_found", param="alias")
    if gw.jobs is not None and record.job_id:
        try:
            job = gw.jobs.get(record.job_id)
        except JobError:  # its job is gone: nothing trains the alias
            job = None
        if job is not None and job.status in ACTIVE:
            if not is_user_alias(alias):
                raise APIError(409, f"job {record.job_id} still trains '{alias}'; cancel it first", code="job_active")
            try:  # a per-user job lets the user go first (slot, samples, files)
                await in_thread(gw.jobs.forget_user, record.job_id, alias)
            except JobError as e:
                raise APIError(e.status_code, str(e), code=e.code) from None
    await in_thread(store.delete, alias)  # first: no request routes to it from now on
    unloaded = await gw.adapters.unload_versions(alias)
    removed: list[str] = []
    if gw.jobs is not None and record.job_id:
        job_dir = Path(gw.jobs.work_dir) / record.job_id
        # the versions a job ended on, a per-user job's parked users, and the users' copies in its checkpoints
        for d in sorted((*job_dir.glob("adapters/*"), *job_dir.glob("adapters/parked/*"),
                         *job_dir.glob("checkpoints/*/users/*"))):
            if d.is_dir() and is_version_of(d.name, alias):
                await in_thread(shutil.rmtree, d, True)
                removed.append(str(d))
    return DeletedAdapter(alias=alias, unloaded=unloaded, removed_dirs=removed)
