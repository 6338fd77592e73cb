"""Command line for a real SGLang server (GPU path).

Every ``--sglang-foo-bar v`` flag given to ``slime-server`` becomes ``--foo-bar v`` here, as slime
does, so any SGLang option is reachable without us mirroring SGLang's ~300 flags. SGLang itself is
imported only when a function needs the installed release's ``ServerArgs`` (``check_sglang_args``, or
an optional flag given without ``known_args``): the CPU install does not have it.

``ServerArgs`` is a ``dataclasses.dataclass`` up to SGLang 0.5.15 and a ``msgspec.Struct`` (built with
``msgspec.defstruct`` from the ``arg_groups/fields`` namespaces) in 0.5.23: ``server_arg_names`` reads
either. Options slime-server sets on its own (``optional_args``, e.g. ``--api-key``) are passed only
where the release has the field, so a release that renamed or dropped one still starts. No release we
target has a health-check flag: SGLang's health probe is tuned by environment variables
(``SGLANG_HEALTH_CHECK_TIMEOUT``, ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``), and slime-server's own
health monitor is ``rollout/supervisor.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Collection, Mapping
from typing import Any

from slime_server.config import EngineSettings
from slime_server.utils.procs import cli_flags

log = logging.getLogger(__name__)

# Set by the launcher from EngineSettings/actor placement; a pass-through copy would be ambiguous.
RESERVED_KEYS = frozenset({"model_path", "host", "port"})


class SGLangArgsError(ValueError):
    """A pass-through argument cannot be turned into an SGLang flag."""


def sglang_flag_args(args: Mapping[str, Any]) -> list[str]:
    """``{"mem_fraction_static": 0.7, "enable_x": True, "y": [1, 2]}`` -> SGLang CLI tokens.

    True is a bare switch, False/None drop the flag, lists become several values after one flag.
    """
    normalized: dict[str, Any] = {}
    for key, value in args.items():
        norm = key.replace("-", "_")
        if norm in RESERVED_KEYS:
            raise SGLangArgsError(f"--sglang-{key.replace('_', '-')} is set by slime-server itself")
        if isinstance(value, dict):
            raise SGLangArgsError(f"--{norm.replace('_', '-')}: nested mappings cannot be passed on a command line")
        normalized[norm] = value
    return cli_flags(normalized)


def build_sglang_command(engine: EngineSettings, model_path: str, port: int,
                         python: str = sys.executable, *, api_key: str | None = None,
                         optional_args: Mapping[str, Any] | None = None,
                         known_args: Collection[str] | None = None) -> list[str]:
    """The exact ``python -m sglang.launch_server`` command for one engine on ``port``.

    ``api_key`` and ``optional_args`` are slime-server's own options: each is passed only if SGLang's
    ``ServerArgs`` has the field (``known_args``; default: the installed release, imported only when there
    is such an option) and the user did not set it through ``--sglang-*``.
    """
    args = dict(engine.sglang_args)
    cmd = [
        python, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--host", engine.host,
        "--port", str(port),
    ]
    if "max_running_requests" not in args:
        cmd += ["--max-running-requests", str(engine.max_running_requests)]
    extra = {k.replace("-", "_"): v for k, v in (optional_args or {}).items() if v is not None}
    if api_key is not None:
        extra["api_key"] = api_key
    user = {k.replace("-", "_") for k in args}
    extra = {k: v for k, v in extra.items() if k not in user}  # a --sglang-* flag wins
    if extra:
        known = known_args if known_args is not None else _installed_server_arg_names()
        if known is not None:
            dropped = sorted(k for k in extra if k not in known)
            if dropped:
                log.warning("this SGLang release has no %s: not passed", ", ".join(f"--{k.replace('_', '-')}"
                                                                                  for k in dropped))
            extra = {k: v for k, v in extra.items() if k in known}
    return cmd + sglang_flag_args(args) + sglang_flag_args(extra)


def server_arg_names(server_args_cls: type) -> frozenset[str]:
    """Field names of an SGLang ``ServerArgs`` class: a msgspec Struct (0.5.23) or a dataclass (<= 0.5.15)."""
    struct_fields = getattr(server_args_cls, "__struct_fields__", None)  # msgspec, without importing it
    if struct_fields is not None:
        return frozenset(struct_fields)
    if dataclasses.is_dataclass(server_args_cls):
        return frozenset(f.name for f in dataclasses.fields(server_args_cls))
    raise TypeError(f"{server_args_cls!r} is neither a msgspec Struct nor a dataclass: unknown SGLang ServerArgs")


def _installed_server_arg_names() -> frozenset[str] | None:
    """The installed SGLang's ``ServerArgs`` fields; None (with a warning) when SGLang cannot be imported."""
    try:
        from sglang.srt.server_args import ServerArgs  # lazy: GPU extra only
    except ImportError as e:
        log.warning("cannot import sglang here (%s): optional SGLang flags are passed unchecked", e)
        return None
    return server_arg_names(ServerArgs)


def check_sglang_args(args: Mapping[str, Any], known_args: Collection[str] | None = None) -> list[str]:
    """Names in ``args`` that SGLang's ``ServerArgs`` does not know (``known_args``; default: the installed
    release's fields, which needs sglang importable)."""
    if known_args is None:
        from sglang.srt.server_args import ServerArgs  # lazy: GPU extra only

        known_args = server_arg_names(ServerArgs)
    return sorted(k.replace("-", "_") for k in args if k.replace("-", "_") not in known_args)
