"""Two gateway replicas on one Postgres store (issue 8: several server replicas share it).

A session begun on one replica is continued on the other and stays ONE token-exact trajectory;
rewards, minted keys and key ownership are shared; the export sees everything. Real parts: a
throwaway PostgreSQL cluster, two gateway processes, the real sgl-router and a CPU engine, the
`openai` SDK.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests._gateway_helpers import (
    MODEL,
    GatewayProc,
    openai_client,
    start_gateway,
    stop_gateway,
)
from tests._postgres_helpers import PgCluster, create_database, find_bindir

pytestmark = pytest.mark.slow
ADMIN = "sk-test-admin"


@pytest.fixture(scope="module")
def replicas(router_url: str, tiny_model_path: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProc, GatewayProc]]:
    bindir = find_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (apt-get install postgresql; .ci/run does)")
    cluster = PgCluster(bindir)
    try:
        _, url = create_database(cluster.url())
        work = tmp_path_factory.mktemp("replicas")
        gws = [start_gateway(router_url, tiny_model_path, url, work / f"gw{i}.log", "--api-key", "shared-agent",
                             "--admin-api-key", ADMIN) for i in range(2)]
        try:
            yield gws[0], gws[1]
        finally:
            for gw in gws:
                stop_gateway(gw)
    finally:
        cluster.destroy()


def test_a_session_continues_across_replicas(replicas: tuple[GatewayProc, GatewayProc]) -> None:
    a, b = replicas
    key = httpx.post(f"{a.url}/admin/keys", json={"role": "agent"}, headers={"Authorization": f"Bearer {ADMIN}"}
                     ).json()["key"]  # minted on replica a ...
    headers = {"X-Session-Id": "sess-across"}
    messages = [{"role": "user", "content": "hi"}]
    first = openai_client(a, api_key=key).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_headers=headers)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "and again"}]
    openai_client(b, api_key=key).chat.completions.create(  # ... honoured by replica b
        model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_headers=headers)
    auth = {"Authorization": f"Bearer {key}"}
    assert httpx.post(f"{b.base_url}/sessions/sess-across/reward", json={"reward": 1.0}, headers=auth).status_code == 200
    view = httpx.get(f"{a.base_url}/sessions/sess-across/trajectory", headers=auth).json()
    assert len(view) == 1 and len(view[0]["turns"]) == 2 and view[0]["reward"] == 1.0  # one merged trajectory
    # the shared agent key does not own the minted key's session, on either replica
    for gw in (a, b):
        with pytest.raises(openai.PermissionDeniedError):
            openai_client(gw, api_key="shared-agent").chat.completions.create(
                model=MODEL, messages=messages, max_tokens=2, extra_headers=headers)
    exported = httpx.get(f"{b.url}/admin/export?rewarded_only=true&status=all",
                         headers={"Authorization": f"Bearer {ADMIN}"}).text.splitlines()
    assert len(exported) == 1
