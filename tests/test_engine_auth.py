"""The CPU engine's API keys are SGLang's: same header, same routes guarded, same answer on a refusal.

The rule is checked against the pinned SGLang release's own ``decide_request_auth`` and its routes'
``@auth_level`` decorators (read from the wheel), for every route of our engine, every key setup and
every kind of ``Authorization`` header; then a real engine process answers as that rule says.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from slime_server.rollout.engine_auth import ADMIN_ROUTES, request_allowed
from tests._engine_helpers import engine_process
from tests._sglang_source import AUTH, SGLangSourceError, fetch_all, load_by_path, route_auth_levels

API, ADMIN = "api-secret", "admin-secret"


@pytest.fixture(scope="module")
def our_routes(tiny_model_path: Path) -> set[tuple[str, str]]:
    """(method, path) of every route the engine serves (its own app, built around a real engine)."""
    from slime_server.rollout.cpu_engine import CPUEngine, EngineConfig
    from slime_server.rollout.engine_server import create_app

    engine = CPUEngine(EngineConfig(model_path=str(tiny_model_path), num_threads=1))
    try:
        app = create_app(engine)
    finally:
        engine.shutdown()
    return {(m, r.path) for r in app.routes for m in getattr(r, "methods", None) or ()}


@pytest.fixture(scope="module")
def sglang_auth():
    try:
        fetch_all()
    except SGLangSourceError as e:
        pytest.fail(str(e), pytrace=False)
    return load_by_path(AUTH), route_auth_levels()


def test_admin_routes_are_the_ones_sglang_marks(our_routes, sglang_auth) -> None:
    _, levels = sglang_auth
    paths = {p for _, p in our_routes}
    assert ADMIN_ROUTES <= paths
    for path in paths:
        if path in levels:  # a route SGLang has: the same level
            assert (path in ADMIN_ROUTES) == (levels[path] == "ADMIN_OPTIONAL"), path
        else:  # ours only (the /get_weight_version alias, OpenAPI docs): read-only, NORMAL
            assert path not in ADMIN_ROUTES, path


def test_every_route_decides_as_sglang(our_routes, sglang_auth) -> None:
    auth, levels = sglang_auth
    headers = [None, "", "Bearer", "Bearer wrong", f"Bearer {API}", f"bearer {API}", f"Bearer {ADMIN}", f"Basic {API}"]
    keys = [(None, None), (API, None), (None, ADMIN), (API, ADMIN)]
    checked = 0
    for (method, path), header, (api_key, admin_key) in itertools.product(sorted(our_routes), headers, keys):
        level = auth.AuthLevel[levels.get(path, "NORMAL")]
        theirs = auth.decide_request_auth(method=method, path=path, authorization_header=header, api_key=api_key,
                                          admin_api_key=admin_key, auth_level=level)
        assert theirs.error_status_code == 401  # no ADMIN_FORCE route here: a refusal is always 401
        assert request_allowed(method, path, header, api_key, admin_key) == theirs.allowed, (method, path, header,
                                                                                           api_key, admin_key)
        checked += 1
    assert checked > 500
    assert request_allowed("OPTIONS", "/generate", None, API, ADMIN)  # CORS preflight, as SGLang


@pytest.fixture(scope="module")
def keyed_engine(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with engine_process(tiny_model_path, tmp_path_factory.mktemp("keyed"), "--api-key", API,
                        "--admin-api-key", ADMIN) as url:
        yield url


def _call(url: str, method: str, path: str, key: str | None, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{url}{path}", headers=headers, timeout=60, **kw)


STATE_CHANGING = [  # every admin route with a body it accepts
    ("POST", "/flush_cache", {}),
    ("POST", "/abort_request", {"rid": "nobody"}),
    ("POST", "/pause_generation", {"mode": "in_place"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}),
    ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                            "world_size": 2, "group_name": "g", "backend": "nccl"}),
    ("POST", "/destroy_weights_update_group", {"group_name": "g"}),
    ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": [], "flush_cache": False}),
    ("POST", "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [], "group_name": "g"}),
    ("POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/nonexistent"}),
    ("POST", "/unload_lora_adapter", {"lora_name": "a"}),
    ("POST", "/load_lora_adapter_from_tensors", {"lora_name": "a", "config_dict": {}, "serialized_named_tensors": []}),
]


def test_a_keyed_engine_answers_as_sglang(keyed_engine: str) -> None:
    url = keyed_engine
    for path in ("/health", "/health_generate"):  # probes need no key
        assert _call(url, "GET", path, None).status_code == 200
    body = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    for key in (None, "wrong", ADMIN):  # a normal route takes the API key only, even when an admin key is set
        r = _call(url, "POST", "/generate", key, json=body)
        assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"}), key
    assert len(_call(url, "POST", "/generate", API, json=body).json()["output_ids"]) == 2
    assert _call(url, "GET", "/model_info", API).json()["weight_version"] == "0"
    assert _call(url, "GET", "/model_info", None).status_code == 401
    assert set(ADMIN_ROUTES) == {p for _, p, _ in STATE_CHANGING}
    for method, path, payload in STATE_CHANGING:
        for key in (None, "wrong", API):  # with an admin key set, the API key no longer opens admin routes
            r = _call(url, method, path, key, json=payload)
            assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"}), (path, key)
        r = _call(url, method, path, ADMIN, json=payload)
        assert r.status_code != 401, (path, r.text)  # reached the route (which may refuse the body itself)
    assert _call(url, "POST", "/flush_cache", ADMIN).status_code == 200
    assert _call(url, "POST", "/generate", API, json=body).status_code == 200  # still serving after it all


def test_an_api_key_alone_guards_everything_but_health(tiny_model_path: Path, tmp_path: Path) -> None:
    with engine_process(tiny_model_path, tmp_path, "--api-key", API) as url:
        assert _call(url, "GET", "/health", None).status_code == 200
        for method, path, payload in [("POST", "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}),
                                      *STATE_CHANGING[:2]]:
            assert _call(url, method, path, None, json=payload).status_code == 401
            assert _call(url, method, path, API, json=payload).status_code == 200, path
