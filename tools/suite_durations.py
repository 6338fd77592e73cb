"""Write ``tests/suite_durations.json`` (seconds per test file, summed over its tests' setup, call and teardown)
from the output of a suite run with ``--durations=0``, e.g.

    PYTEST_ADDOPTS="--durations=0" make test 2>&1 | tee /tmp/suite.log
    .venv/bin/python tools/suite_durations.py /tmp/suite.log

Why: ``tests/conftest.py`` hands the files to the xdist workers longest first, so that the run ends on short
files that fill the workers' last gaps instead of one worker finishing a long file alone."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

LINE = re.compile(r"\s*([\d.]+)s (?:setup|call|teardown)\s+(tests/[^:\s]+)")


def file_durations(log: str) -> dict[str, float]:
    per_file: Counter[str] = Counter()
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            per_file[Path(m.group(2)).name] += float(m.group(1))
    return {name: round(seconds, 1) for name, seconds in per_file.most_common()}


def main() -> None:
    durations = file_durations(Path(sys.argv[1]).read_text())
    if not durations:
        sys.exit("no --durations=0 lines in that log")
    out = Path(__file__).resolve().parents[1] / "tests" / "suite_durations.json"
    out.write_text(json.dumps(durations, indent=0) + "\n")
    print(f"{out}: {len(durations)} files, {sum(durations.values()):.0f} s")


if __name__ == "__main__":
    main()
