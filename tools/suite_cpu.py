"""CPU seconds per test module of a suite run, everything each test started included (engines, Ray's processes,
trainer ranks, CLI subprocesses, and the orphans they leave): each xdist worker moves itself into a cgroup of its
own, whose CPU counter every descendant adds to, and reads it around each test. The durations pytest prints are
wall time under three workers' contention; this says where the 2 cores' time went. Needs root (a cgroup is
created under /sys/fs/cgroup: v1's cpuacct or v2).

    PYTHONPATH=tools PYTEST_ADDOPTS="-p suite_cpu" SUITE_CPU_OUT=/tmp/suite-cpu make test
    .venv/bin/python tools/suite_cpu.py /tmp/suite-cpu          # per module, most first, with the running share
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

OUT = Path(os.environ.get("SUITE_CPU_OUT", "/tmp/suite-cpu"))
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
V1 = Path("/sys/fs/cgroup/cpuacct")
GROUP = (V1 if V1.is_dir() else Path("/sys/fs/cgroup")) / f"suite-cpu-{WORKER}"
_rows: list[tuple[str, float]] = []


def _usage() -> float:
    """The group's CPU seconds so far (a counter that cannot be read fails the run: a 0 would be a wrong table)."""
    if V1.is_dir():
        return int((GROUP / "cpuacct.usage").read_text()) / 1e9
    stat = dict(line.split() for line in (GROUP / "cpu.stat").read_text().splitlines())
    return int(stat["usage_usec"]) / 1e6


def pytest_configure(config: Any) -> None:
    GROUP.mkdir(exist_ok=True)
    (GROUP / "cgroup.procs").write_text(str(os.getpid()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Generator[None, None, None]:
    before = _usage()
    yield
    _rows.append((item.nodeid, _usage() - before))


def pytest_sessionfinish(session: Any) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{WORKER}.json").write_text(json.dumps(_rows))


def main() -> None:
    per_module: Counter[str] = Counter()
    for f in Path(sys.argv[1]).glob("*.json"):
        for nodeid, seconds in json.loads(f.read_text()):
            per_module[nodeid.split("::")[0]] += seconds
    total, running = sum(per_module.values()), 0.0
    print(f"{total:.0f} cpu-s in {len(per_module)} modules")
    for module, seconds in per_module.most_common():
        running += seconds
        print(f"{seconds:7.1f}  {100 * running / total:5.1f}%  {module}")


if __name__ == "__main__":
    main()
