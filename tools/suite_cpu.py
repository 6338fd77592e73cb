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
import time
from collections import Counter
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

OUT = Path(os.environ.get("SUITE_CPU_OUT", "/tmp/suite-cpu"))
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
V1 = Path("/sys/fs/cgroup/cpuacct")
GROUP = (V1 if V1.is_dir() else Path("/sys/fs/cgroup")) / f"suite-cpu-{WORKER}"
_rows: list[tuple[str, float, float, float]] = []  # node id, CPU seconds, wall start and end (epoch seconds)


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
    before, start = _usage(), time.time()
    yield
    _rows.append((item.nodeid, _usage() - before, start, time.time()))


def pytest_sessionfinish(session: Any) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{WORKER}.json").write_text(json.dumps(_rows))


def main() -> None:
    per_module: Counter[str] = Counter()
    spans: dict[str, tuple[float, float]] = {}  # worker -> its first test's start, its last test's end
    for f in sorted(Path(sys.argv[1]).glob("*.json")):
        rows = json.loads(f.read_text())
        for nodeid, seconds, *_ in rows:
            per_module[nodeid.split("::")[0]] += seconds
        if rows and len(rows[0]) == 4:
            spans[f.stem] = (min(r[2] for r in rows), max(r[3] for r in rows))
    total, running = sum(per_module.values()), 0.0
    print(f"{total:.0f} cpu-s in {len(per_module)} modules")
    for module, seconds in per_module.most_common():
        running += seconds
        print(f"{seconds:7.1f}  {100 * running / total:5.1f}%  {module}")
    if spans:  # a worker done long before the others is cores left idle at the end
        t0 = min(a for a, _ in spans.values())
        print("workers' tests ran (s from the first start): " + ", ".join(
            f"{w} {a - t0:.0f}-{b - t0:.0f}" for w, (a, b) in sorted(spans.items())))


if __name__ == "__main__":
    main()
