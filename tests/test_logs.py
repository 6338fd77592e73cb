"""Log formatting: JSON lines carry ``extra`` fields at top level; text lines show them as key=value."""

from __future__ import annotations

import json
import logging

from slime_server.utils.logs import JsonFormatter, TextFormatter


def _record(**extra) -> logging.LogRecord:
    logger = logging.getLogger("slime_server.test")
    return logger.makeRecord(logger.name, logging.INFO, __file__, 1, "served %s", ("x",), None, extra=extra)


def test_json_lines_have_fields() -> None:
    line = json.loads(JsonFormatter().format(_record(status=200, session_id="s1")))
    assert line["msg"] == "served x" and line["level"] == "info" and line["logger"] == "slime_server.test"
    assert line["status"] == 200 and line["session_id"] == "s1" and "args" not in line


def test_json_carries_exceptions() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec = logging.getLogger("t").makeRecord("t", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert "ValueError: boom" in json.loads(JsonFormatter().format(rec))["exc"]


def test_text_lines_show_fields() -> None:
    text = TextFormatter().format(_record(status=404))
    assert text.endswith("served x status=404") and " INFO slime_server.test: " in text
