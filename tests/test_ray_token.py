"""Ray clusters run with a token, as docker-compose.yml and README's recipe start them.

A real ``ray start --head`` with the compose file's Ray environment (``RAY_AUTH_MODE=token``, the token
read from ``RAY_AUTH_TOKEN_PATH``): a client without the token is refused, and slime-server says which
flag fixes it; with ``--ray-auth-token-file`` (``ray.auth_token_file``) it joins.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from slime_server.utils.net import find_free_port
from slime_server.utils.procs import kill_group

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"RAY_USAGE_STATS_ENABLED": "0"}


def compose_ray_env(token_file: Path) -> dict[str, str]:
    """The Ray head's auth environment as docker-compose.yml sets it, the secret's path made local."""
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    env = {k: str(v) for k, v in spec["services"]["ray-head"]["environment"].items() if k.startswith("RAY_AUTH")}
    assert env == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/run/secrets/ray_token"}
    return env | {"RAY_AUTH_TOKEN_PATH": str(token_file)}


class TokenHead:
    """One ``ray start --head --block`` with the compose file's auth environment.

    ``--block`` kills the whole head when any Ray subprocess exits (a raylet or agent losing a port race to
    another process on a busy machine, say); that is Ray's own start-up, outside the unit, so a head found
    dead is started again on fresh ports, its log printed, rather than failing the test that found it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.token_file = tmp / "ray_token"
        self.token_file.write_text(secrets.token_urlsafe(32) + "\n")
        self.token_file.chmod(0o600)
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.starts = 0
        self.ray_dirs: list[str] = []

    def _start(self) -> None:
        self.starts += 1
        port = find_free_port()
        run = self.tmp / f"run{self.starts}"
        run.mkdir()
        self.ray_dirs.append(tempfile.mkdtemp(prefix="rt"))  # short: Ray's socket paths must fit 107 bytes
        ports = {flag: find_free_port() for flag in ("--ray-client-server-port", "--dashboard-agent-listen-port",
                                                    "--dashboard-agent-grpc-port", "--node-manager-port",
                                                    "--object-manager-port", "--runtime-env-agent-port",
                                                    "--metrics-export-port")}
        cmd = [RAY, "start", "--head", "--block", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
               "--disable-usage-stats", f"--temp-dir={self.ray_dirs[-1]}", *(f"{k}={v}" for k, v in ports.items())]
        self.log_path = run / "head.log"
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(cmd, env=_clean_env() | compose_ray_env(self.token_file), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.address = f"127.0.0.1:{port}"

    def _ready(self) -> bool:
        """Started, and its GCS answers a client holding the token."""
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in self.log_path.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        probe = (f"from slime_server.server.launch import use_ray_token\nuse_ray_token({str(self.token_file)!r})\n"
                 f"from ray._raylet import GcsClient\nGcsClient(address={self.address!r})"
                 ".internal_kv_get(b'k', b'', timeout=20)")
        return _python(probe, _clean_env()).returncode == 0 and self.proc.poll() is None

    def ensure(self) -> tuple[str, Path]:
        """The running head's address and token file, starting it (again) when it is not up."""
        for _ in range(3):
            if self.proc is not None and self.proc.poll() is None:
                return self.address, self.token_file
            if self.proc is not None:
                print(f"ray head exited ({self.proc.returncode}); its log:\n{self.log_path.read_text()[-3000:]}",
                      file=sys.stderr)
                self.stop()
            self._start()
            if not self._ready():
                self.proc.poll()
                if self.proc.returncode is None:  # alive but its GCS never answered: not a port race
                    raise AssertionError(self.log_path.read_text()[-3000:])
        raise AssertionError(f"the ray head did not stay up in 3 starts:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc, timeout=5)  # the head's whole process group (GCS, raylet, workers)
            self.proc = None
        for d in self.ray_dirs:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def token_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenHead]:
    head = TokenHead(tmp_path_factory.mktemp("raytoken"))
    try:
        yield head
    finally:
        head.stop()


@pytest.fixture
def token_cluster(token_head: TokenHead) -> tuple[str, Path]:
    return token_head.ensure()


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_client_without_the_token_is_refused_and_told_the_fix(token_cluster: tuple[str, Path]) -> None:
    address, _ = token_cluster
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "slime_server.cli", "engines", "--ray-address", address,
                        "--num-engines", "0"], capture_output=True, text=True, timeout=120, env=_clean_env())
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"the Ray cluster at {address} refused this server's token" in r.stderr
    assert "--ray-auth-token-file" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 60  # not ray.init's retry loop and its "crashed cluster" guess

    # Ray itself refuses the connection (the guard is the cluster's, not ours)
    r = _python(f"from ray._raylet import GcsClient; GcsClient(address={address!r}).internal_kv_get(b'k', b'', "
                "timeout=10)", _clean_env())
    assert r.returncode != 0 and "InvalidAuthToken" in r.stderr


def test_wrong_token_is_refused(token_cluster: tuple[str, Path], tmp_path: Path) -> None:
    address, _ = token_cluster
    wrong = tmp_path / "wrong"
    wrong.write_text(secrets.token_urlsafe(32))
    code = ("from slime_server.server.launch import check_ray_auth, use_ray_token\n"
            f"use_ray_token({str(wrong)!r})\ncheck_ray_auth({address!r})")
    r = _python(code, _clean_env())
    assert r.returncode != 0 and "RayAuthError" in r.stderr
    assert "the token this server presents is not the cluster's" in r.stderr


def test_server_with_the_token_file_joins(token_cluster: tuple[str, Path]) -> None:
    address, token_file = token_cluster
    code = ("import ray\nfrom slime_server.config import ServerSettings\nfrom slime_server.server.launch import _init_ray\n"
            f"s = ServerSettings(ray={{'address': {address!r}, 'auth_token_file': {str(token_file)!r}}})\n"
            "assert _init_ray(s)\nprint('CPUS', ray.cluster_resources()['CPU'])\n"
            "print('TASK', ray.get(ray.remote(lambda: 41 + 1).remote()))\nray.shutdown()")
    r = _python(code, _clean_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "CPUS 1.0" in r.stdout and "TASK 42" in r.stdout  # a task ran on the token-guarded cluster


def test_missing_token_file_is_named(tmp_path: Path) -> None:
    from slime_server.server.launch import RayAuthError, use_ray_token

    with pytest.raises(RayAuthError, match="missing or empty"):
        use_ray_token(str(tmp_path / "nope"))
