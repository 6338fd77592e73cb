"""The configuration reference is generated from the settings models and committed; this keeps the
committed file true. The deployment files parse and wire the services together."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from slime_server.config import ServerSettings
from slime_server.utils import config_doc

ROOT = Path(__file__).resolve().parents[1]


def test_committed_reference_matches_the_models() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == config_doc.render(), (
        "docs/configuration.md is stale: run `python -m slime_server.utils.config_doc > docs/configuration.md`")


def test_reference_lists_every_setting_with_its_env_var() -> None:
    text = config_doc.render()
    for section, field in ServerSettings.model_fields.items():
        model = config_doc._model_of(field.annotation)
        assert model is not None
        for name in model.model_fields:
            assert f"`SLIME_{section.upper()}__{name.upper()}`" in text, (section, name)
    assert "### `job.loop`" in text and "### `job.optimizer`" in text


def test_compose_file_wires_head_workers_and_server() -> None:
    spec = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    services = spec["services"]
    assert set(services) == {"ray-head", "gpu-worker", "server"}
    for name, svc in services.items():
        assert "healthcheck" in svc, name
        assert svc["image"].startswith("${SLIME_IMAGE")  # the YAML merge keys resolved
    assert "ray-head:6379" in " ".join(services["server"]["command"])
    assert services["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert {"models", "checkpoints", "store"} <= set(spec["volumes"])
    assert "store:/data/store" in services["server"]["volumes"]
    env = services["server"]["environment"]
    ServerSettings.model_validate({"engine": {"host": env["SLIME_ENGINE__HOST"]},
                                   "gateway": {"host": env["SLIME_GATEWAY__HOST"],
                                               "db_path": env["SLIME_GATEWAY__DB_PATH"]}})


def _compose() -> list[str] | None:
    """`docker compose` (v2 plugin) if present, else Debian's `docker-compose` (v1; .ci/run installs it)."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def test_docker_compose_config() -> None:
    compose = _compose()
    if compose is None:
        pytest.skip("neither `docker compose` nor `docker-compose` here (apt-get install docker-compose)")
    r = subprocess.run([*compose, "-p", "slime-server", "-f", str(ROOT / "deploy" / "docker-compose.yml"), "config",
                        "-q"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
