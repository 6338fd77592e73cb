"""``--eval-data NAME=PATH`` flags (``serve`` and ``demo``): checked at start, not when a job runs."""

from __future__ import annotations

from pathlib import Path


def parse_eval_data(items: list[str]) -> list[tuple[str, str]]:
    """``NAME=PATH`` pairs (the file must exist); a clear error otherwise."""
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--eval-data expects NAME=PATH, got {item!r}")
        if not Path(path).is_file():
            raise SystemExit(f"--eval-data {name}: {path} is not a file")
        out.append((name, path))
    return out
