"""Training jobs, by responsibility:

- ``spec.py``: what a job is (``JobSpec`` and its parts, ``JobView``), the statuses;
- ``manager.py``: the state machine and the manager that runs jobs and restores them after a restart;
- ``runners.py``: what runs beside a job's loop: dataset episodes through ``/v1``, eval rounds;
- ``metrics.py``: the Prometheus gauges a job reports.

Pacing (429 while a job's buffer is full) is the gateway's: ``gateway/pacing.py``.
"""
