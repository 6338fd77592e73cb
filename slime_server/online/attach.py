"""Implicit feedback (``serve --online``) attached to a running gateway, by ``serve`` and the gateway-only
entry point alike."""

from __future__ import annotations

from typing import Any

from slime_server.config import GatewaySettings
from slime_server.online.feedback import ImplicitFeedback
from slime_server.online.judge import Judge


def attach_online(gw: Any, online: Any, gw_settings: GatewaySettings) -> None:
    """Implicit feedback on the gateway; a judge without a URL is this server's own /v1."""
    judge_settings = online.judge
    if judge_settings.base_url is None and gw_settings.api_key:
        judge_settings = judge_settings.model_copy(update={"api_key": gw_settings.api_key})
    host = "127.0.0.1" if gw_settings.host in ("0.0.0.0", "::") else gw_settings.host
    gw.feedback = ImplicitFeedback(gw, online, Judge(judge_settings, f"http://{host}:{gw_settings.port}/v1"))
