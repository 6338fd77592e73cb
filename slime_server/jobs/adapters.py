"""A LoRA job that publishes its adapter (``lora.publish = 'adapter'``, the default): where its versions go.

Each version is loaded into the engines beside the base and every other adapter (trainer/adapter_push.py), the
job's alias (``lora.name``, default the job's id) is moved to it in the store every gateway reads
(buffer/adapter_store.py), and the version it left is unloaded once its requests have drained. The job's own
episodes and evaluations are played through the alias (``<served>:<alias>``), so what it trains on is what its
adapter generated, version by version.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from slime_server.buffer.adapter_store import AdapterStore, versioned_name
from slime_server.jobs.errors import JobError
from slime_server.jobs.spec import JobSpec
from slime_server.trainer.loop import AdapterPublication, EngineControl

log = logging.getLogger(__name__)


def publishes_adapter(spec: JobSpec) -> bool:
    return spec.lora is not None and spec.lora.publish == "adapter"


def alias_of(spec: JobSpec, job_id: str) -> str | None:
    """The alias clients and the job's own episodes name (None: the job pushes weights)."""
    if not publishes_adapter(spec):
        return None
    assert spec.lora is not None
    return spec.lora.name or job_id


def check_serving(spec: JobSpec, lora_enabled: bool, max_lora_rank: int | None) -> None:
    """A 400 before anything starts when the engines cannot serve this job's adapter."""
    if not publishes_adapter(spec):
        return
    assert spec.lora is not None
    if not lora_enabled:
        raise JobError(400, "lora.publish 'adapter' needs engines that serve LoRA adapters: start serve with "
                       "--enable-lora (engine.enable_lora), or set lora.publish to 'merged'", "lora_not_enabled")
    if max_lora_rank is not None and spec.lora.rank > max_lora_rank:
        raise JobError(400, f"lora.rank {spec.lora.rank} is above the engines' max_lora_rank {max_lora_rank}",
                       "invalid_value")


def publication(spec: JobSpec, job_id: str, adapters: AdapterStore, engines: EngineControl, job_dir: Path
                ) -> AdapterPublication | None:
    alias = alias_of(spec, job_id)
    if alias is None:
        return None
    assert spec.lora is not None

    def unload(name: str) -> None:
        errors = engines.unload_adapter(name)
        if errors:
            log.warning("unloading adapter %s: %s", name, errors)

    return AdapterPublication(
        alias=alias, versioned=lambda a, v: versioned_name(a, job_id, v),
        publish=lambda a, name, v: adapters.publish(a, name, v, job_id).previous, unload=unload,
        saved=adapters.saved, save_dir=job_dir / "adapters",
        user_slots=spec.lora.adapters if spec.lora.per == "user" else 0)


def runner_adapter(spec: JobSpec, job_id: str) -> dict[str, Any]:
    """``RunnerSettings`` fields that send the job's own episodes to its adapter."""
    alias = alias_of(spec, job_id)
    return {"adapter": alias} if alias else {}


def restore_published(adapters: AdapterStore, active: set[str], engines: EngineControl) -> list[str]:
    """At start: every alias whose job is not running again is served from its newest saved version (the versions
    it was loaded under from tensors died with the engines); a running job publishes its own. Returns the
    aliases restored."""
    restored = []
    for record in adapters.list():
        if record.job_id in active or record.saved_path is None or record.saved_name is None:
            continue
        errors = engines.load_adapter(record.saved_name, record.saved_path)
        if errors:
            log.warning("adapter %s could not be loaded again from %s: %s", record.alias, record.saved_path, errors)
            continue
        adapters.publish(record.alias, record.saved_name, int(record.saved_version or 0), record.job_id)
        restored.append(record.alias)
    return restored
