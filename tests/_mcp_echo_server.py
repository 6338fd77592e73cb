"""A minimal stdio MCP server for tests: tools ``add`` and ``shout`` (JSON-RPC 2.0, one line per message)."""

import json
import sys

TOOLS = [
    {"name": "add", "description": "Add two integers.",
     "inputSchema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                     "required": ["a", "b"]}},
    {"name": "shout", "description": "Upper-case a text.",
     "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}},
]

for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue  # a notification
    method, params = msg["method"], msg.get("params", {})
    if method == "initialize":
        result = {"protocolVersion": params["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "echo", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": TOOLS}
    elif method == "tools/call":
        args = params.get("arguments", {})
        if params["name"] == "add":
            result = {"content": [{"type": "text", "text": str(args["a"] + args["b"])}], "isError": False}
        elif params["name"] == "shout":
            result = {"content": [{"type": "text", "text": args["text"].upper()}], "isError": False}
        else:
            result = {"content": [{"type": "text", "text": "no such tool"}], "isError": True}
    else:
        print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "error": {"code": -32601, "message": "unknown"}}),
              flush=True)
        continue
    print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}), flush=True)
