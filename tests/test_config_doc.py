"""The configuration reference is generated from the settings models and committed; this keeps the
committed file true. The deployment files parse and wire the services together."""

from __future__ import annotations

import os
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
    assert "### `job.loop`" not in text and "(job-spec.md)" in text


def test_committed_job_spec_reference_matches_the_models() -> None:
    committed = (ROOT / "docs" / "job-spec.md").read_text()
    assert committed == config_doc.render_jobs(), (
        "docs/job-spec.md is stale: run `python -m slime_server.utils.config_doc --jobs > docs/job-spec.md`")
    for table in ("### `job.loop`", "### `job.optimizer`", "### `job.loss`", "### `job.lora`", "### `job.eval[]`"):
        assert table in committed, table
    for row in ("| `batch_size` |", "| `max_flat_groups_in_a_row` |", "| `kl_coef` |", "| `lr` |"):
        assert row in committed, row


def test_compose_file_wires_head_workers_and_server() -> None:
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
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
    _assert_secured(spec)


def _assert_secured(spec: dict) -> None:
    """Every Ray process demands the cluster token; the server has the engine key (it hands it to the engines
    it starts) and the admin key, from secret files into its environment, never into argv or this file."""
    services = spec["services"]
    assert set(spec["secrets"]) == {"ray_token", "engine_api_key", "admin_api_key"}
    for name, svc in services.items():  # all three run Ray processes (the server is a Ray driver)
        env = svc["environment"]
        env = env if isinstance(env, dict) else dict(e.split("=", 1) for e in env)
        assert env["RAY_AUTH_MODE"] == "token", name
        assert env["RAY_AUTH_TOKEN_PATH"] == "/run/secrets/ray_token", name
        assert "ray_token" in [s if isinstance(s, str) else s["source"] for s in svc["secrets"]], name
    server = services["server"]
    assert {s if isinstance(s, str) else s["source"] for s in server["secrets"]} == set(spec["secrets"])
    script = " ".join(server["command"])
    assert 'SLIME_ENGINE__API_KEY="$$(cat /run/secrets/engine_api_key)"' in script
    assert 'SLIME_GATEWAY__ADMIN_API_KEY="$$(cat /run/secrets/admin_api_key)"' in script
    assert "--ray-auth-token-file /run/secrets/ray_token" in script and "exec slime-server serve" in script


def _compose() -> list[str] | None:
    """`docker compose` (v2 plugin) if present, else Debian's `docker-compose` (v1; .ci/run installs it)."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def test_docker_compose_config() -> None:
    compose = _compose()
    if compose is None:
        pytest.skip("neither `docker compose` nor `docker-compose` here (apt-get install docker-compose)")
    r = subprocess.run([*compose, "-p", "slime-server", "-f", str(ROOT / "docker-compose.yml"), "config",
                        "-q"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([*compose, "-p", "slime-server", "-f", str(ROOT / "docker-compose.yml"), "config"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "SLIME_SECRETS": "/s"})
    assert r.returncode == 0, r.stderr
    rendered = yaml.safe_load(r.stdout)  # what compose itself makes of the file: merge keys and variables applied
    _assert_secured(rendered)
    assert {k: v["file"] for k, v in rendered["secrets"].items()} == {
        s: f"/s/{s}" for s in ("ray_token", "engine_api_key", "admin_api_key")}
