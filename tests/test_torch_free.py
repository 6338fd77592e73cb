"""A gateway run alone loads transformers without torch (utils/torch_free.py): the same renderings, ids, text and
token bytes as with torch, on every model the suite serves through a gateway; its process maps no torch library
until something that needs torch asks for it (xgrammar, on the first constrained call), and answers on after it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from tests._gateway_helpers import MODEL, GatewayProc

# What a gateway computes from a model's tokenizer, printed as JSON by a fresh interpreter: with transformers
# loaded without torch (argv[1] == "without") or with torch imported first.
FINGERPRINT = r"""
import json, sys
if sys.argv[1] == "without":
    from slime_server.utils.torch_free import transformers_without_torch
    assert transformers_without_torch()
else:
    import torch  # noqa: F401
from slime_server.gateway.chat_template import ChatRenderer

tools = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}
talk = [{"role": "system", "content": "Be brief. Ünïcödé ✓ 日本語"}, {"role": "user", "content": " What is 2+3?\n\n "},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}, {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "Thanks <|im_end|> and   spaces\t\ttabs"}]
out = {}
for path in sys.argv[2:]:
    r = ChatRenderer(path)
    text = r.render_text(talk, tools)
    ids = r.render_ids(talk, tools)
    n = len(r.tokenizer)
    sample = list(range(0, n, max(1, n // 3000)))
    out[path] = {
        "text": text, "ids": ids, "suffix": r.encode_suffix(talk[:5], talk, tools),
        "decode": r.decode(ids), "decode_skip": r.decode(ids, skip_special_tokens=True),
        "pieces": [r.decode([i]) for i in sample], "bytes": [r.token_bytes(i).hex() for i in sample],
        "tokens": r.tokenizer.convert_ids_to_tokens(sample), "stops": r.stop_token_ids, "len": n,
        "tools_shown": r.template_renders_tools, "context": r.context_length,
        "pads": r.vision.tokens(640, 480) if r.vision is not None else None,
    }
out["torch loaded"] = "torch" in sys.modules
print(json.dumps(out))
"""


def fingerprint(mode: str, models: list[Path]) -> dict:
    done = subprocess.run([sys.executable, "-c", FINGERPRINT, mode, *map(str, models)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_gateways_tokenizer_is_the_same_without_torch(tiny_model_path: Path, real_model_path: Path,
                                                          vl_path: Path) -> None:
    models = [tiny_model_path, real_model_path, vl_path]
    without, with_torch = fingerprint("without", models), fingerprint("with", models)
    assert without.pop("torch loaded") is False and with_torch.pop("torch loaded") is True
    assert without[str(vl_path)]["pads"] and without[str(tiny_model_path)]["pads"] is None  # both kinds compared
    for path in map(str, models):
        for key, value in with_torch[path].items():
            assert without[path][key] == value, (path, key)


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_a_gateway_process_serves_without_torch_until_a_constrained_call(gateway: GatewayProc) -> None:
    pid = gateway.proc.pid
    assert "slime_server.cli" in Path(f"/proc/{pid}/cmdline").read_bytes().decode().replace("\0", " ")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    with httpx.Client(base_url=gateway.base_url, timeout=60) as client:
        assert client.post("/chat/completions", json=chat).status_code == 200
        assert not _maps_torch(pid)
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        constrained = {**chat, "max_tokens": 16,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
        assert client.post("/chat/completions", json=constrained).status_code == 200
        assert _maps_torch(pid)  # xgrammar's import brought torch in: transformers went on without it
        assert client.post("/chat/completions", json=chat).status_code == 200
