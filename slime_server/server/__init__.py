"""The composition root: builds the whole server from its settings and starts it.

``serve`` (engines, router, gateway, trainer, jobs), ``gateway`` (a gateway over running engines),
the gateway app's wiring (``build.py``), the thread a gateway runs in beside a trainer, and the
process launcher for engines and routers (``launch.py``). Nothing else imports this package but the
command line (``cli.py``), the demo and the judge's own gateway.
"""
