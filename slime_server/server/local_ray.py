"""The Ray cluster a server starts for itself (no ``ray.address``), without what only a shared cluster uses.

Why: an idle local cluster as ``ray.init`` starts it burned 2.2-2.3 CPU-s a minute on its own (2026-11-30, 2-core
EPYC, two 60 s samples): a log monitor that tails every worker's output files every 0.1 s and publishes the lines
for drivers that print them (ours do not: ``log_to_driver=False``), an autoscaler monitor (a local cluster never
scales), idle pooled workers kept for tasks that rarely come (~0.45 CPU-s a minute each), and metrics and
task events that no dashboard reads (``include_dashboard=False``). Off, an idle cluster takes 1.05-1.09 CPU-s a minute:
a server waiting for traffic, and every test that keeps one up, pay that much less. A cluster the server joins
(``ray.address``) is its operator's and keeps its own settings.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Ray's own settings (``_system_config``: each checked by name when the head starts; an unknown one fails it)
LOCAL_SYSTEM_CONFIG: dict[str, Any] = {
    "num_workers_soft_limit": 0,  # a worker idle for a second exits (actors own theirs); a task starts one
    "prestart_worker_first_driver": False,  # ... so none is started ahead only to exit unused
    "enable_metrics_collection": False,  # the metrics agent's exports: no dashboard, no Prometheus here
    "task_events_report_interval_ms": 0,  # no task state reports to the GCS (what `ray list tasks` shows)
}


@contextmanager
def _without_monitors() -> Iterator[None]:
    """While ``ray.init`` starts a head node: no log monitor, no autoscaler monitor. ``ray.init`` has no switch
    for either and Ray's node parameters (``RayParams``) have both, so its constructor gets them as defaults for
    this call; a Ray whose parameters lack either is left as it is."""
    from ray._private import parameter

    init = parameter.RayParams.__init__
    if not {"include_log_monitor", "no_monitor"} <= set(inspect.signature(init).parameters):
        yield
        return

    def lean(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("include_log_monitor", False)
        kwargs.setdefault("no_monitor", True)
        init(self, *args, **kwargs)

    parameter.RayParams.__init__ = lean  # type: ignore[method-assign]
    try:
        yield
    finally:
        parameter.RayParams.__init__ = init  # type: ignore[method-assign]


def start_local_ray(num_cpus: int, **init_kwargs: Any) -> None:
    """``ray.init`` of a new local cluster of ``num_cpus`` CPUs, lean (above). ``address="local"``: without it
    ray.init joins whatever RAY_ADDRESS or /tmp/ray/ray_current_cluster (left by any earlier `ray start`, even a
    dead one) names, and fails."""
    import ray

    if init_kwargs.get("log_to_driver", True):
        raise ValueError("a lean local Ray has no log monitor: its drivers cannot print their workers' output")
    with _without_monitors():
        ray.init(address="local", num_cpus=num_cpus, _system_config=dict(LOCAL_SYSTEM_CONFIG), **init_kwargs)
