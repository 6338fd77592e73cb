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


def pin_process(cpus: list[int]) -> None:
    """Run every thread of this process, and every thread and child it starts later, on ``cpus``.

    ``sched_setaffinity(0, ...)`` moves only the calling thread; a process that already runs threads (a Ray
    worker, torch's pool) has each moved through ``/proc/self/task``. Raises ``ValueError`` naming the cores
    this host has when none of ``cpus`` can be used.
    """
    wanted = set(cpus)
    tasks = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tasks:
        try:
            os.sched_setaffinity(tid, wanted)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as e:
            raise ValueError(f"cannot run on cores {format_cpu_list(sorted(wanted))}: {e.strerror} (this host has "
                             f"cores 0-{(os.cpu_count() or 1) - 1})") from None

