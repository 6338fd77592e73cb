"""Reading an engine's weight version through SGLang's own route, for every caller that needs it.

Why ``/model_info``: SGLang 0.5.15 answers 404 on ``/get_weight_version`` (and ``/weight_version``),
and 0.5.23 no longer has the route; both give the version as ``weight_version`` in ``GET /model_info``
(the route sgl-router also reads). Our CPU engine answers the same. Callers: the engine supervisor,
the training loop's ``EngineControl``, the dashboard's engine probe (async).

This module imports only ``httpx``, so the rollout, trainer and API layers can all use it without
import cycles.
"""

from __future__ import annotations

from typing import Any

import httpx

MODEL_INFO_PATH = "/model_info"


def weight_version_of(model_info: Any) -> str | None:
    """``weight_version`` of a ``/model_info`` body, as a string (None when absent or malformed)."""
    if not isinstance(model_info, dict):
        return None
    v = model_info.get("weight_version")
    return None if v is None else str(v)


def weight_version_from_response(r: httpx.Response) -> str | None:
    """``weight_version`` of a ``/model_info`` answer (None unless a 200 with the field)."""
    if r.status_code != 200:
        return None
    try:
        return weight_version_of(r.json())
    except ValueError:  # not JSON
        return None


def engine_weight_version(client: httpx.Client, url: str, timeout: float | None = None) -> str | None:
    """The weight version ``url`` serves, or None when it does not answer (down, busy, not SGLang)."""
    try:
        kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        return weight_version_from_response(client.get(f"{url.rstrip('/')}{MODEL_INFO_PATH}", **kw))
    except httpx.HTTPError:
        return None


async def engine_weight_version_async(client: httpx.AsyncClient, url: str,
                                      timeout: float | None = None) -> str | None:
    """``engine_weight_version`` for async callers."""
    try:
        kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        return weight_version_from_response(await client.get(f"{url.rstrip('/')}{MODEL_INFO_PATH}", **kw))
    except httpx.HTTPError:
        return None


SERVER_INFO_PATH = "/server_info"


def engine_tp_size(client: httpx.Client, url: str, timeout: float | None = None) -> int | None:
    """How many TP ranks ``url`` runs (``tp_size`` in SGLang's ``GET /server_info``, its ``ServerArgs``): the
    payloads an engine takes on ``/update_weights_from_tensor`` (one per rank) and its ranks in a weight-update
    group. None when it does not answer with one."""
    try:
        kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        r = client.get(f"{url.rstrip('/')}{SERVER_INFO_PATH}", **kw)
        tp = r.json().get("tp_size") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return tp if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 else None
