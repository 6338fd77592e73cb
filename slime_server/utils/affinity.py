"""CPU placement on one host: keep the trainer's ranks and the CPU engines on cores of their own.

On GPUs the trainer and the engines never share a device; on a CPU host they share cores unless told
otherwise, and each then slows the other (on 2 cores a train step took 36% longer beside generation sharing
them, -3% to +10% pinned apart; ``tools/bench_async.py --split``). ``engine.cpus`` and ``trainer.cpus`` give each
side its cores, as a GPU deployment gives each its devices.
"""

from __future__ import annotations

import os


def format_cpu_list(cpus: list[int]) -> str:
    """The inverse of ``config.parse_cpu_list`` for a command line: ``[0, 1, 2, 5]`` -> ``"0,1,2,5"``."""
    return ",".join(str(c) for c in cpus)


def host_cores() -> list[int]:
    """The cores this process may use (a container's cpuset, a taskset), not every core the host has."""
    return sorted(os.sched_getaffinity(0))


def slices(cores: list[int], n: int) -> list[list[int]]:
    """``cores`` in ``n`` contiguous shares as even as they go (the first ones one larger); with fewer cores
    than shares, share ``i`` gets core ``i % len(cores)``."""
    if n <= len(cores):
        return [cores[i * len(cores) // n:(i + 1) * len(cores) // n] for i in range(n)]
    return [[cores[i % len(cores)]] for i in range(n)]


def pin_process(cpus: list[int]) -> None:
    """Run every thread of this process, and every thread and child it starts later, on ``cpus``.

    ``sched_setaffinity(0, ...)`` moves only the calling thread; a process that already runs threads (a Ray
    worker, torch's pool) has each moved through ``/proc/self/task``. Raises ``ValueError`` naming the cores
    this host has when none of ``cpus`` can be used.
    """
    pin_pid("self", cpus)


def pin_pid(pid: int | str, cpus: list[int]) -> None:
    """``pin_process`` for another process of this host (``pid``; ``"self"``): each of its threads now."""
    wanted = set(cpus)
    try:
        tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:  # no /proc (not Linux), or the process is gone
        tasks = [0] if pid == "self" else []
    for tid in tasks:
        try:
            os.sched_setaffinity(tid, wanted)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as e:
            raise ValueError(f"cannot run on cores {format_cpu_list(sorted(wanted))}: {e.strerror} (this host has "
                             f"cores 0-{(os.cpu_count() or 1) - 1})") from None
