"""The operator side of webhook-outbox: a room apart from the send path.

Here live the surfaces people and tools use to run and inspect the service: the
`outbox` command (`cli/`), the admin HTTP API (`api/`), the console and portal
(`console/`), both on the shared `context.py`, Prometheus metrics, the demo, and the
wiring that turns settings into running services (`app.py`, `supervisor.py`). They
compose the send path (`delivery.worker`, `delivery.http`, ...) and the library
(`outbox`), and are never imported by either: the send path knows nothing of how it
is operated, and `outbox/` stays what applications import, with no HTTP stack and no
CLI.
"""
