"""A job's Prometheus gauges and counters, labelled by job id (the server's ``/metrics`` shows them)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

JOB_STEP = Gauge("slime_job_step", "optimizer steps taken", ["job"])
JOB_VERSION = Gauge("slime_job_policy_version", "policy version of the job's trainer", ["job"])
JOB_METRIC = Gauge("slime_job_metric", "last value of a training metric", ["job", "name"])
JOB_DROPPED = Counter("slime_job_dropped_trajectories_total", "trajectories never trained on", ["job", "reason"])
