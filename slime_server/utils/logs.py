"""Process logging: plain text for people, or one JSON object per line for log shippers.

Why JSON lines: a server run for days is read by Loki/ELK/CloudWatch, which index fields, not
prose. Any ``extra={...}`` given to a log call becomes top-level fields of its line, so the gateway's
request lines carry method, path, status, duration, session id and request id as fields.
"""

from __future__ import annotations

import json
import logging
import sys
import time

# attributes every LogRecord has; anything else on a record came from ``extra=`` and is a field
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": round(record.created, 3), "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
                "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        line.update({k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``time level logger: msg key=value ...``: the same fields as JSON, readable."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}
        return text + "".join(f" {k}={v}" for k, v in fields.items())


def setup_logging(level: str = "warning", fmt: str = "text") -> None:
    """Configure the root logger once for this process (stderr); replaces earlier handlers."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
