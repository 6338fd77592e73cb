"""The python environment's sandbox (time, network, files), and the search environment (BM25)."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import jsonschema
import pytest

from slime_server.envs.base import get_environment
from slime_server.envs.python_env import PythonEnv
from slime_server.envs.sandbox import run_python
from slime_server.envs.search import BM25, SearchEnv


@pytest.mark.parametrize("name", ["python", "search"])
def test_tool_schemas_are_valid(name: str) -> None:
    for tool in get_environment(name).tools():
        jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])


def test_sandbox_runs_code_and_kills_an_infinite_loop() -> None:
    assert run_python("print(6 * 7)").stdout == "42\n"
    r = run_python("while True:\n    pass", timeout_s=1.0)
    assert r.timed_out and not r.ok and r.seconds < 5


def test_sandbox_blocks_network(tmp_path: Path) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted: list[object] = []
    t = threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True)
    t.start()
    r = run_python(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
    assert not r.ok and "connected" not in r.stdout
    t.join(0.5)
    assert accepted == []  # nothing reached the listener
    server.close()


def test_sandbox_blocks_writes_outside_its_dir_and_subprocesses(tmp_path: Path) -> None:
    target = tmp_path / "evil.txt"
    r = run_python(f"open({str(target)!r}, 'w').write('x')")
    assert not r.ok and "outside the sandbox" in r.stderr and not target.exists()
    r = run_python(f"import os\nos.remove({str(tmp_path)!r})")
    assert not r.ok
    assert run_python("open('ok.txt', 'w').write('fine')\nprint(open('ok.txt').read())").stdout == "fine\n"
    r = run_python("import subprocess\nsubprocess.run(['echo', 'hi'])")
    assert not r.ok and "not allowed" in r.stderr


def test_python_env_rewards_passing_code_only() -> None:
    env = PythonEnv(timeout_s=3)
    row = env.default_dataset(1, seed=0)[0]
    state = env.reset(row)
    name = row.label.split("assert ")[1].split("(")[0]
    good = {"add": "a + b", "square": "x * x", "is_even": "n % 2 == 0", "reverse": "s[::-1]", "maximum": "max(xs)"}
    args = {"add": "a, b", "square": "x", "is_even": "n", "reverse": "s", "maximum": "xs"}
    code = f"def {name}({args[name]}):\n    return {good[name]}\n"
    assert env.reward(state, f"Here it is:\n```python\n{code}```") == 1.0
    assert env.reward(state, f"```python\ndef {name}({args[name]}):\n    return None\n```") == 0.0
    assert env.reward(state, "```python\nwhile True: pass\n```") == 0.0
    assert env.step(state, "python", json.dumps({"code": "print(2 + 2)"})) == "4"


def test_bm25_and_search_env_episode() -> None:
    index = BM25([{"id": "a", "text": "The capital of Lomira is Tenvu."},
                  {"id": "b", "text": "The longest river of Lomira is the Zobel."},
                  {"id": "c", "text": "Cats are animals."}])
    assert [d["id"] for d in index.search("capital Lomira", k=2)][0] == "a"
    assert index.search("zzz") == []
    env = SearchEnv(seed=1)
    row = env.default_dataset(1, seed=2)[0]
    state = env.reset(row)
    hits = env.step(state, "search", json.dumps({"query": row.prompt}))
    assert str(row.label) in hits.splitlines()[0]  # the right fact ranks first
    assert env.reward(state, f"<answer>{row.label}</answer>") == 1.0
    assert env.reward(state, "<answer>Paris</answer>") == 0.0
    assert env.step(state, "search", json.dumps({"query": ""})).startswith("error")
